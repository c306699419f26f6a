#!/usr/bin/env python3
"""Writes in both directions at once between two GPUs of one host (issue 26's
floor: both directions >= 1.8 x one direction), Ferry beside the copy engine,
in one invocation.

    python bench/cuda_ipc/bidirectional.py            # GPU machine with 2 GPUs
    python bench/cuda_ipc/bidirectional.py --quick    # 1 repetition, short runs

Two real processes, A on GPU 0 and B on GPU 1, each with a Ferry engine that
registers a source buffer (DEPTH slots of BLOCKS x BLOCK) and a target buffer
of the same size and connects to the other. Per repetition, in turn: A writes
to B alone, B writes to A alone, then both write at once (started together by
the parent; each reports its own GB/s over its own timed window, the two
windows overlap but for a few ms). Prepared writes, DEPTH in flight, GPU -> GPU.
Both launches: both GPUs visible to both processes, and each process seeing
only its own GPU (CUDA_VISIBLE_DEVICES, as serving stacks launch workers).

Reference (one process that sees both GPUs): contiguous copies of the same
bytes per call, GPU 0 -> GPU 1 alone, then GPU 0 -> GPU 1 and GPU 1 -> GPU 0 on
two streams at once (torch: cudaMemcpyPeerAsync), timed by CUDA events.

Every direction is checked byte for byte (crc32 of fresh random bytes on both
sides) before and after the timed runs. Medians of the repetitions.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import zlib

from posting import gbps_with_calls_in_flight


def reference(nbytes, secs):
    import torch
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    b = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:1")
    a_in = torch.empty_like(a)  # on GPU 0, written by GPU 1's copy
    b_in = torch.empty_like(b)
    s0, s1 = torch.cuda.Stream(0), torch.cuda.Stream(1)

    def timed(both):
        iters = 1
        while True:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            with torch.cuda.stream(s0):
                starts[0].record(s0)
                for _ in range(iters):
                    b_in.copy_(a, non_blocking=True)
                ends[0].record(s0)
            if both:
                with torch.cuda.stream(s1):
                    starts[1].record(s1)
                    for _ in range(iters):
                        a_in.copy_(b, non_blocking=True)
                    ends[1].record(s1)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            wall = time.perf_counter() - t0
            if wall >= secs / 4 or iters >= 1 << 14:
                gbs = iters * nbytes / (starts[0].elapsed_time(ends[0]) / 1e3) / 1e9
                if both:
                    gbs += iters * nbytes / (starts[1].elapsed_time(ends[1]) / 1e3) / 1e9
                return gbs
            iters *= 2

    out = (timed(False), timed(True))
    if not (torch.equal(b_in.cpu(), a.cpu()) and torch.equal(a_in.cpu(), b.cpu())):
        raise RuntimeError("reference copy differs")
    return out


def worker(conn, visible, device, blocks, block, depth):
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    import numpy as np
    import torch
    import ferry
    torch.cuda.set_device(device)
    slot = blocks * block
    src = torch.randint(0, 256, (slot * depth,), dtype=torch.uint8, device=f"cuda:{device}")
    dst = torch.zeros(slot * depth, dtype=torch.uint8, device=f"cuda:{device}")
    engine = ferry.Engine()
    src_region = engine.register(src)
    dst_region = engine.register(dst)
    conn.send({"meta": engine.metadata(), "desc": dst_region.advertise(access="rw")})
    other = conn.recv()
    peer = engine.connect(other["meta"])
    offs = np.arange(blocks, dtype=np.uint64) * np.uint64(block)
    posts = [peer.prepare_write(src_region, offs + np.uint64(k * slot), other["desc"],
                                remote_offsets=offs + np.uint64(k * slot), lengths=block).post
             for k in range(depth)]
    conn.send({"transports": peer.transports()})

    def timed(seconds):
        return gbps_with_calls_in_flight(posts, slot, seconds)

    while True:
        cmd = conn.recv()
        if cmd[0] == "warm":
            timed(cmd[1])
            conn.send("ok")
        elif cmd[0] == "run":
            conn.send(timed(cmd[1]))
        elif cmd[0] == "send":  # fresh bytes into slot 0, written to the peer
            src[:slot].copy_(torch.randint(0, 256, (slot,), dtype=torch.uint8,
                                           device=f"cuda:{device}"))
            torch.cuda.synchronize()
            posts[0]().wait(60_000)
            conn.send(zlib.crc32(src[:slot].cpu().numpy().tobytes()))
        elif cmd[0] == "crc":
            conn.send(zlib.crc32(dst[:slot].cpu().numpy().tobytes()))
        else:
            engine.close()
            conn.send("bye")
            return


class Pair:
    def __init__(self, one_gpu_each, args):
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for dev in (0, 1):
            parent, child = ctx.Pipe()
            visible, local = (str(dev), 0) if one_gpu_each else (None, dev)
            p = ctx.Process(target=worker, daemon=True,
                            args=(child, visible, local, args.blocks, args.block, args.depth))
            p.start()
            self.pipes.append(parent)
            self.procs.append(p)
        hello = [p.recv() for p in self.pipes]
        self.pipes[0].send(hello[1])
        self.pipes[1].send(hello[0])
        self.transports = [p.recv()["transports"] for p in self.pipes]

    def check(self, name):
        for a, b in ((0, 1), (1, 0)):
            self.pipes[a].send(("send",))
            want = self.pipes[a].recv()
            self.pipes[b].send(("crc",))
            if self.pipes[b].recv() != want:
                raise RuntimeError(f"{name}: GPU {b}'s buffer differs from what GPU {a} wrote")

    def run(self, who, secs):
        for i in who:
            self.pipes[i].send(("run", secs))
        return [self.pipes[i].recv() for i in who]

    def warm(self, secs):
        for p in self.pipes:
            p.send(("warm", secs))
        for p in self.pipes:
            p.recv()

    def close(self):
        for p in self.pipes:
            p.send(("close",))
            p.recv()
        for p in self.procs:
            p.join(10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--block", type=int, default=1_179_648)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--secs", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.secs, args.reps = 0.7, 1
    try:
        import torch
    except ImportError as e:
        print(f"NOT RUN: {e} (this benchmark needs PyTorch with CUDA and two GPUs)")
        return 0
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print(f"NOT RUN: {torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA "
              "device(s); this benchmark writes between two GPUs")
        return 0
    nbytes = args.blocks * args.block
    print(f"{args.blocks} x {args.block} B per call, {args.depth} in flight, GPU 0 <-> GPU 1, "
          f"{args.reps} repetitions of {args.secs} s, {torch.cuda.get_device_name(0)} x "
          f"{torch.cuda.device_count()}", flush=True)
    launches = {"both GPUs visible": False, "one GPU each": True}
    pairs = {}
    for name, one in launches.items():
        pairs[name] = Pair(one, args)
        pairs[name].check(name)
        t = pairs[name].transports[0]
        print(f"  {name}: " + "; ".join(f"{x['transport']}: [{x['carries']}] {x.get('via', '')}"
                                         for x in t if x["carries"]), flush=True)
        pairs[name].warm(min(0.5, args.secs))
    rows = {k: [] for k in ("copy", *launches)}
    for _ in range(args.reps):  # alternate the reference and each launch per repetition
        one, both = reference(nbytes * args.depth, args.secs)
        rows["copy"].append((one, one, both))
        for name, pair in pairs.items():
            ab = pair.run([0], args.secs)[0]
            ba = pair.run([1], args.secs)[0]
            both = sum(pair.run([0, 1], args.secs))
            rows[name].append((ab, ba, both))
    for name, pair in pairs.items():
        pair.check(name)
        pair.close()
    print(f"\n{'GB/s':28s} {'0 -> 1':>9s} {'1 -> 0':>9s} {'both':>9s} {'both / one':>11s}")
    result = {}
    for name, runs in rows.items():
        ab, ba, both = (statistics.median(r[i] for r in runs) for i in range(3))
        ratio = both / ((ab + ba) / 2)
        result[name] = ratio
        label = "copy engine (one process)" if name == "copy" else f"Ferry, {name}"
        print(f"{label:28s} {ab:9.1f} {ba:9.1f} {both:9.1f} {ratio:10.2f}x")
    for name in launches:
        print(f"floor (Ferry, {name}: both directions >= 1.8 x one): "
              f"{'MET' if result[name] >= 1.8 else 'MISSED'} ({result[name]:.2f}; copy engine "
              f"{result['copy']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
