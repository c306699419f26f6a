#!/usr/bin/env python3
"""KV-cache offload: evict paged KV blocks from GPU memory to a pinned host pool
and bring them back, with Ferry's batched copy (one call per batch of pages, no
Python loop per page).

    python examples/kv_offload.py [--pages 4096] [--page-bytes 16384] [--sm-budget 8]

A serving engine keeps KV pages in a GPU pool and evicts cold ones to host
memory. Here: fill the GPU pool with random pages, offload a random subset to
random slots of the host pool (GPU->host), poison the GPU pool, then reload the
pages into *different* GPU slots (host->GPU) on an ordered CopyStream, while
the copy kernel holds at most --sm-budget SMs. Every reloaded page is compared
with what was evicted. Needs a GPU and torch (for the buffers).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import ferry


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=4096, help="pages in the GPU pool")
    ap.add_argument("--page-bytes", type=int, default=16384)
    ap.add_argument("--evict", type=float, default=0.5, help="share of the pool offloaded")
    ap.add_argument("--sm-budget", type=int, default=8)
    args = ap.parse_args()
    if not ferry.cuda_available():
        print(f"skipped: {ferry.cuda_unavailable_reason()}")
        return 0
    try:
        import torch
    except ImportError:
        print("skipped: this example allocates its buffers with torch, which is not installed")
        return 0

    page, n = args.page_bytes, args.pages
    gpu_pool = torch.randint(0, 256, (n, page), dtype=torch.uint8, device="cuda")
    host_pool = torch.empty((n, page), dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    rng = np.random.default_rng(0)
    evicted = rng.choice(n, int(n * args.evict), replace=False).astype(np.uint64)  # GPU slots
    host_slots = rng.permutation(n)[: len(evicted)].astype(np.uint64)
    expected = gpu_pool[torch.from_numpy(evicted.astype(np.int64)).cuda()].cpu()

    stream = ferry.CopyStream(sm_budget=args.sm_budget)
    g, h, p = gpu_pool.data_ptr(), host_pool.data_ptr(), np.uint64(page)
    stream.wait(stream.submit(h, g, page))  # warm-up: the stream's first batch sets it up

    t0 = time.perf_counter()
    t = stream.submit(h + host_slots * p, g + evicted * p, page)  # offload: GPU -> host
    stream.wait(t)
    t_out = time.perf_counter() - t0

    gpu_pool.fill_(0xA5)  # the evicted pages are gone from the GPU
    reload_slots = rng.permutation(n)[: len(evicted)].astype(np.uint64)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    t = stream.submit(g + reload_slots * p, h + host_slots * p, page)  # reload: host -> GPU
    stream.wait(t)
    t_in = time.perf_counter() - t0

    got = gpu_pool[torch.from_numpy(reload_slots.astype(np.int64)).cuda()].cpu()
    ok = torch.equal(got, expected)
    moved = len(evicted) * page
    print(f"{len(evicted)} pages of {page} B ({moved / 2**20:.0f} MiB), sm_budget {args.sm_budget}: "
          f"offload {moved / t_out / 1e9:.1f} GB/s, reload {moved / t_in / 1e9:.1f} GB/s, "
          f"every page {'verified' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
