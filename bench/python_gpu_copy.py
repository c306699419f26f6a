#!/usr/bin/env python3
"""Ferry's batched copy called from Python against one contiguous copy of the same bytes.

256 MiB as scattered blocks (random slots) between pinned host memory and GPU
memory, host->GPU and GPU->host, in one process: ferry.CopyStream submit + wait
from Python (binding and enqueue included; "submit us" is the time until
submit() returns; the columns are built once, as an offload loop keeps them)
against one cudaMemcpyAsync of all the bytes (the link's speed), alternating,
median of --reps. Needs a GPU; CUDA through ctypes.

    python3 bench/python_gpu_copy.py [--sizes 4096,65536] [--reps 9] [--total-mib 256]
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from cudart import CUDART, NO_GPU_REASON  # noqa: E402

import ferry  # noqa: E402

H2D, D2H = 1, 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,16384,65536,262144,1048576")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--sm-budget", type=int, default=16)
    args = ap.parse_args()
    if CUDART is None or not ferry.cuda_available():
        print(f"skipped: {NO_GPU_REASON}: {ferry.cuda_unavailable_reason()}")
        return 0
    total = args.total_mib << 20
    host, dev = ctypes.c_void_p(), ctypes.c_void_p()
    assert CUDART.cudaHostAlloc(ctypes.byref(host), ctypes.c_size_t(total), 0) == 0
    assert CUDART.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(total)) == 0
    ctypes.memset(host, 0x5A, total)
    stream = ferry.CopyStream(sm_budget=args.sm_budget)

    def contiguous(direction):
        dst, src = (dev, host) if direction == H2D else (host, dev)
        t0 = time.perf_counter()
        assert CUDART.cudaMemcpyAsync(dst, src, ctypes.c_size_t(total), direction, ctypes.c_void_p(0)) == 0
        assert CUDART.cudaDeviceSynchronize() == 0
        return total / (time.perf_counter() - t0) / 1e9

    print(f"# python_gpu_copy  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  "
          f"{args.total_mib} MiB per call, sm_budget {args.sm_budget}, median of {args.reps}")
    print(f"{'dir':4} {'block':>8} {'blocks':>7} {'contig GB/s':>12} {'ferry GB/s':>11} {'ratio':>6} "
          f"{'submit us':>10}")
    rng = np.random.default_rng(1)
    for block in (int(s) for s in args.sizes.split(",")):
        count = total // block
        h = host.value + rng.permutation(count).astype(np.uint64) * np.uint64(block)
        d = dev.value + rng.permutation(count).astype(np.uint64) * np.uint64(block)
        for name, direction, dst, src in (("H2D", H2D, d, h), ("D2H", D2H, h, d)):
            stream.wait(stream.submit(dst, src, block))  # warm-up
            contiguous(direction)
            c, f, b = [], [], []
            for _ in range(args.reps):
                c.append(contiguous(direction))
                t0 = time.perf_counter()
                t = stream.submit(dst, src, block)
                t1 = time.perf_counter()
                stream.wait(t)
                f.append(total / (time.perf_counter() - t0) / 1e9)
                b.append((t1 - t0) * 1e6)
            cm, fm = statistics.median(c), statistics.median(f)
            print(f"{name:4} {block:>8} {count:>7} {cm:>12.2f} {fm:>11.2f} {fm / cm:>6.3f} "
                  f"{statistics.median(b):>10.0f}")
    CUDART.cudaFree(dev)
    CUDART.cudaFreeHost(host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
