#!/usr/bin/env python3
"""Ferry's own Python API on the workload of one UCCL benchmark_uccl.py run, for
bench/uccl/run_uccl_scripts.sh's summary: the same sizes, one block per call,
blocking calls after one warm-up, two processes, the same GPUs -- so that a
UCCL script that runs slowly on ferry.compat.uccl shows up beside what Ferry
itself does, instead of hiding behind PASS.

    python bench/uccl/ferry_same_sizes.py --like default|write-ipc|read-ipc|cpu \
        [--sizes 4096,1048576] [--iters 128] [--rounds 3] [--uccl-log LOG]

--like default    benchmark_uccl.py's default mode: GPU memory, both processes on GPU 0, write
--like write-ipc  --write-ipc: the initiator's GPU 0 into the target's GPU 1 (GPU 0 if only one)
--like read-ipc   --read-ipc: the initiator reads the target's GPU 1 into its GPU 0
--like cpu        --device cpu: host memory, write

Connects by address (engine.connect("ip:port")), as UCCL's connect does; uses
Peer.write / Peer.read with a Region and a descriptor. Prints one line per size
in benchmark_uccl.py's format ("[Ferry API] 4.0 KB : ... GB/s | ... us", the
median of --rounds rounds of --iters calls); with --uccl-log, a table of the
UCCL script's [Client] lines beside these, with the ratio of latencies.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import statistics
import sys
import time


def pretty(n: int) -> str:  # benchmark_uccl.py's _pretty_size
    val = float(n)
    for u in ("B", "KB", "MB", "GB"):
        if val < 1024 or u == "GB":
            return f"{val:.0f} {u}" if u == "B" else f"{val:.1f} {u}"
        val /= 1024
    return f"{n} B"


def alloc(size: int, gpu: int | None):
    if gpu is None:
        import numpy as np
        return np.ones(size, dtype=np.uint8)
    import torch
    return torch.ones(size, dtype=torch.uint8, device=f"cuda:{gpu}")


def target(conn, sizes, gpu):
    if gpu is not None:  # torch before ferry: the other order aborted at import (H200, 2026-11-27)
        import torch
        torch.cuda.set_device(gpu)
    import ferry
    engine = ferry.Engine("0.0.0.0:0")
    bufs = [alloc(s, gpu) for s in sizes]
    regions = [engine.register(b) for b in bufs]
    conn.send((engine.listen_address, [r.advertise() for r in regions]))
    conn.recv()  # done
    engine.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", choices=["default", "write-ipc", "read-ipc", "cpu"], required=True)
    p.add_argument("--sizes", default="4096,1048576,16777216")
    p.add_argument("--iters", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--uccl-log", default=None, help="a benchmark_uccl.py log to put beside")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]

    gpus = 0
    if a.like != "cpu":
        import torch
        gpus = torch.cuda.device_count()
        if gpus == 0:
            print(f"[Ferry API] not run: --like {a.like} needs a CUDA GPU")
            return 0
    mine = None if a.like == "cpu" else 0
    theirs = None if a.like == "cpu" else (1 if a.like != "default" and gpus > 1 else 0)
    op = "read" if a.like == "read-ipc" else "write"

    import ferry
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, sizes, theirs), daemon=True)
    proc.start()
    address, descs = here.recv()
    if mine is not None:
        import torch
        torch.cuda.set_device(mine)
    engine = ferry.Engine("0.0.0.0:0")
    peer = engine.connect(address.replace("0.0.0.0", "127.0.0.1"))
    carriers = {t["transport"]: t["carries"] for t in peer.transports() if t["carries"]}
    print(f"[Ferry API] {op}, initiator {'GPU ' + str(mine) if mine is not None else 'host'}, "
          f"target {'GPU ' + str(theirs) if theirs is not None else 'host'}, connected by "
          f"address; carriers: {carriers}")
    results = {}
    for size, desc in zip(sizes, descs):
        region = engine.register(alloc(size, mine))
        call = peer.write if op == "write" else peer.read
        local, remote = (region, 0, size), (desc, 0, size)
        call(local, remote)  # warm-up
        lats = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for _ in range(a.iters):
                call(local, remote)
            lats.append((time.perf_counter() - t0) / a.iters)
        lat = statistics.median(lats)
        results[pretty(size)] = lat
        print(f"[Ferry API] {pretty(size):>8} : {size / lat / 1e9:6.2f} GB/s  | "
              f"{lat * 1e6:8.2f} us")
        region.deregister()
    here.send("done")
    proc.join(30)
    engine.close()

    if a.uccl_log:
        line = re.compile(r"\[Client\]\s+(\S+ \S+)\s*:\s*[\d.]+ Gbps \|\s*([\d.]+) GB/s\s*\|\s*([\d.]+) us")
        try:
            text = open(a.uccl_log, encoding="utf-8", errors="replace").read()
        except OSError as e:
            print(f"[Ferry API] cannot read {a.uccl_log}: {e}")
            return 1
        print(f"{'size':>8} | {'UCCL script on Ferry':>24} | {'Ferry API':>22} | UCCL/Ferry latency")
        for m in line.finditer(text):
            name, gbs, us = m.group(1), float(m.group(2)), float(m.group(3))
            if name not in results:
                continue
            lat = results[name] * 1e6
            size = sizes[[pretty(s) for s in sizes].index(name)]
            print(f"{name:>8} | {gbs:8.2f} GB/s {us:9.2f} us | {size / lat / 1e3:7.2f} GB/s "
                  f"{lat:8.2f} us | {us / lat:5.2f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
