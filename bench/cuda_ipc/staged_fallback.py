#!/usr/bin/env python3
"""GPU memory staged through shm's shared pinned host memory (issue 26, item 3):
Ferry with engine.gpu_same_host_path=shm_staged against its floor, two
back-to-back copy-engine copies through pinned host memory, in one invocation.

    python bench/cuda_ipc/staged_fallback.py              # GPU machine, 1 or 2 GPUs
    python bench/cuda_ipc/staged_fallback.py --quick      # 1 repetition, short runs

Reference (one process that sees both GPUs): per repetition, the batch's bytes
(BLOCKS x BLOCK) copied GPU 0 -> pinned host memory, then pinned host memory
-> GPU 1 (GPU 0 where only one exists), on one stream, back to back
("2 x CE, contiguous"), and the same per 1 MiB block ("2 x CE, per block").
Ferry (two real processes, initiator on GPU 0, target on GPU 1): DEPTH
prepared writes of BLOCKS x BLOCK in flight, GPU -> GPU, with the path forced
to shm_staged, both GPUs visible to both processes and each process seeing
only its own GPU (as serving stacks launch workers); cuda_ipc (auto) and tcp
beside it. GB/s = bytes moved / time from first post to last completion,
medians of REPS alternating repetitions. One call per cell is checked byte
for byte (crc32 of random bytes on both sides).

Floor (docs/gpu.md): 1 MiB blocks, shm_staged >= 0.8 x "2 x CE, contiguous".
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import zlib

from posting import gbps_with_calls_in_flight

MiB = 1 << 20


def reference(blocks, block, reps, dev_peer):
    import torch
    torch.cuda.set_device(0)
    n = blocks * block
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{dev_peer}")
    stream = torch.cuda.Stream(0)
    out = {"2 x CE, contiguous": [], "2 x CE, per block": []}
    for _ in range(reps):
        for name, step in (("2 x CE, contiguous", n), ("2 x CE, per block", block)):
            iters = 20
            with torch.cuda.stream(stream):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                for _ in range(iters):
                    for off in range(0, n, step):
                        pinned[off:off + step].copy_(src[off:off + step], non_blocking=True)
                        dst[off:off + step].copy_(pinned[off:off + step], non_blocking=True)
                end.record(stream)
            end.synchronize()
            out[name].append(iters * n / (start.elapsed_time(end) / 1e3) / 1e9)
    assert torch.equal(dst.cpu(), src.cpu()), "reference copy differs"
    return {k: statistics.median(v) for k, v in out.items()}


def target(conn, visible, dev, nbytes, options):
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    import torch
    import ferry
    torch.cuda.set_device(dev)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{dev}")
    engine = ferry.Engine(options=options)
    region = engine.register(buf)
    conn.send({"meta": engine.metadata(), "desc": region.advertise(access="rw")})
    while True:
        cmd = conn.recv()
        if cmd[0] == "crc":
            _, off, n = cmd
            conn.send(zlib.crc32(buf[off:off + n].cpu().numpy().tobytes()))
        else:
            engine.close()
            conn.send("bye")
            return


def initiator(conn, visible, blocks, block, depth, secs, reps_conn_info, options):
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    import numpy as np
    import torch
    import ferry
    torch.cuda.set_device(0)
    slot = blocks * block
    src = torch.randint(0, 256, (slot * depth,), dtype=torch.uint8, device="cuda:0")
    engine = ferry.Engine(options=options)
    region = engine.register(src)
    info = reps_conn_info
    peer = engine.connect(info["meta"])
    offs = np.arange(blocks, dtype=np.uint64) * np.uint64(block)
    posts = [peer.prepare_write(region, offs + np.uint64(k * slot), info["desc"],
                                remote_offsets=offs + np.uint64(k * slot), lengths=block).post
             for k in range(depth)]
    conn.send({"transports": peer.transports()})
    while True:
        cmd = conn.recv()
        if cmd == "run":
            gbps_with_calls_in_flight(posts, slot, min(0.5, secs))
            conn.send(gbps_with_calls_in_flight(posts, slot, secs))
        elif cmd == "check":
            src[:slot].copy_(torch.randint(0, 256, (slot,), dtype=torch.uint8, device="cuda:0"))
            torch.cuda.synchronize()
            posts[0]().wait(60_000)
            conn.send(zlib.crc32(src[:slot].cpu().numpy().tobytes()))
        else:
            engine.close()
            conn.send("bye")
            return


def cell(name, options, one_gpu_each, dev_peer, args):
    ctx = mp.get_context("spawn")
    nbytes = args.blocks * args.block * args.depth
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    tv, iv, tdev = (str(dev_peer), "0", 0) if one_gpu_each else (None, None, dev_peer)
    tp = ctx.Process(target=target, args=(t_child, tv, tdev, nbytes, options), daemon=True)
    tp.start()
    info = t_parent.recv()
    ip = ctx.Process(target=initiator, args=(i_child, iv, args.blocks, args.block, args.depth,
                                            args.secs, info, options), daemon=True)
    ip.start()
    hello = i_parent.recv()
    carriers = {t["transport"]: t for t in hello["transports"]}
    print(f"  {name}: " + "; ".join(f"{k}: [{v['carries']}] {v.get('via', '')}"
                                   for k, v in carriers.items() if v["carries"]), flush=True)

    def run():
        i_parent.send("run")
        return i_parent.recv()

    def check():
        i_parent.send("check")
        want = i_parent.recv()
        t_parent.send(("crc", 0, args.blocks * args.block))
        got = t_parent.recv()
        if want != got:
            raise RuntimeError(f"{name}: the target's bytes differ from what was written")

    def close():
        for p in (i_parent, t_parent):
            p.send("close")
            p.recv()
        ip.join(10)
        tp.join(10)
    return run, check, close


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--block", type=int, default=MiB)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.secs, args.reps = 1.0, 1
    try:
        import torch
    except ImportError as e:
        print(f"NOT RUN: {e} (this benchmark needs PyTorch with CUDA and a GPU)")
        return 0
    if not torch.cuda.is_available():
        print("NOT RUN: no CUDA device (this benchmark needs a GPU)")
        return 0
    gpus = torch.cuda.device_count()
    dev_peer = 1 if gpus > 1 else 0
    print(f"{args.blocks} x {args.block} B per call, {args.depth} in flight, GPU 0 -> "
          f"GPU {dev_peer}, {args.reps} repetitions of {args.secs} s, "
          f"{torch.cuda.get_device_name(0)} x {gpus}", flush=True)
    cells = [("shm_staged, both GPUs visible", {"engine.gpu_same_host_path": "shm_staged"}, False),
             ("auto (cuda_ipc), both visible", {}, False),
             ("tcp forced", {"engine.gpu_same_host_path": "tcp"}, False)]
    if gpus > 1:
        cells.insert(1, ("shm_staged, one GPU each", {"engine.gpu_same_host_path": "shm_staged"},
                         True))
    runners, results = {}, {name: [] for name, _, _ in cells}
    for name, options, one in cells:
        try:
            runners[name] = cell(name, options, one, dev_peer, args)
            runners[name][1]()  # byte check before timing
        except Exception as e:  # a cell that cannot start is reported, the run goes on
            print(f"  {name}: NOT RUN: {type(e).__name__}: {e}", flush=True)
            runners.pop(name, None)
    ref = {k: [] for k in ("2 x CE, contiguous", "2 x CE, per block")}
    for _ in range(args.reps):  # alternate: reference, then every cell, per repetition
        for k, v in reference(args.blocks, args.block, 1, dev_peer).items():
            ref[k].append(v)
        for name, (run, _, _) in runners.items():
            results[name].append(run())
    for run_check_close in runners.values():
        run_check_close[1]()
        run_check_close[2]()
    floor = statistics.median(ref["2 x CE, contiguous"])
    print(f"\n{'':34s} {'GB/s':>8s} {'x 2xCE':>8s}")
    for k, v in ref.items():
        print(f"{k:34s} {statistics.median(v):8.2f} {statistics.median(v) / floor:8.2f}")
    for name, v in results.items():
        if not v:
            print(f"{name:34s} {'NOT RUN':>8s}")
            continue
        print(f"{'Ferry ' + name:34s} {statistics.median(v):8.2f} "
              f"{statistics.median(v) / floor:8.2f}")
    staged = results.get("shm_staged, both GPUs visible") or []
    if staged:
        ratio = statistics.median(staged) / floor
        print(f"\nfloor (shm_staged >= 0.8 x 2 x CE, contiguous): "
              f"{'MET' if ratio >= 0.8 else 'MISSED'} ({ratio:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
