#!/usr/bin/env python3
"""MoE dispatch and combine (ferry.symmetric.MoeExchange) against NCCL
all_to_all_single of the same bytes and, where it runs, torch symmetric
memory's all_to_all_vdev (NVSHMEM), in one run on two GPUs.

Workload: bf16, hidden 7,168, top-8, 8 experts per GPU, 1 / 128 / 512 / 4,096
tokens per GPU, random routing (8 distinct experts per token). Bytes per GPU
per call: tokens x 8 x 7,168 x 2 (each (token, expert) copy; the copies that
stay on the GPU included, for Ferry and the references alike). Each call is
timed by CUDA events after a barrier (dist.barrier + synchronize), p50 and p99
of --iters calls per size; the systems take turns per size.

    python3 bench/device_api/moe_bench.py [--iters 50] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, TOP_K, EXPERTS_PER_RANK = 7168, 8, 8
SIZES = [1, 128, 512, 4096]


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")


def timed(fn, iters, warmup=5):
    """fn() -> None; returns per-call microseconds (barrier before each call)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(iters + warmup):
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warmup:
            out.append(a.elapsed_time(b) * 1000.0)
    return out


def routing(tokens, experts, device, gen):
    scores = torch.rand((tokens, experts), generator=gen, device=device)
    topk = scores.argsort(dim=1)[:, :TOP_K].contiguous().to(torch.int64)
    weights = torch.rand((tokens, TOP_K), generator=gen, device=device, dtype=torch.float32)
    return topk, weights


def worker(rank, world, port, args, queue):
    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        try:
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
        except TypeError:  # a torch without device_id
            dist.init_process_group("nccl", rank=rank, world_size=world)
        from ferry.symmetric import MoeExchange

        moe = MoeExchange(max_tokens=max(SIZES), hidden=HIDDEN, top_k=TOP_K,
                          experts_per_rank=EXPERTS_PER_RANK, rank=rank, size=world)
        experts = world * EXPERTS_PER_RANK
        gen = torch.Generator(device=dev)
        gen.manual_seed(1234 + rank)
        rows = {}
        for t in SIZES:
            x = torch.randn((t, HIDDEN), generator=gen, device=dev).to(torch.bfloat16)
            topk, w = routing(t, experts, dev, gen)
            nbytes = t * TOP_K * HIDDEN * 2
            # Ferry: dispatch and combine, timed separately, alternating as they must.
            d_us, c_us = [], []
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for i in range(args.iters + 5):
                dist.barrier()
                torch.cuda.synchronize()
                a.record()
                moe.dispatch(x, topk)
                b.record()
                b.synchronize()
                if i >= 5:
                    d_us.append(a.elapsed_time(b) * 1000.0)
                dist.barrier()
                torch.cuda.synchronize()
                a.record()
                moe.combine(moe.recv_x, topk, w)
                b.record()
                b.synchronize()
                if i >= 5:
                    c_us.append(a.elapsed_time(b) * 1000.0)
            moe.memory.check_device_error()
            # NCCL all_to_all_single of the same bytes.
            inp = torch.randn((t * TOP_K, HIDDEN), device=dev).to(torch.bfloat16)
            outp = torch.empty_like(inp)
            n_us = timed(lambda: dist.all_to_all_single(outp, inp), args.iters)
            rows[t] = {"tokens": t, "bytes_per_gpu": nbytes,
                       "dispatch_us": d_us, "combine_us": c_us, "nccl_us": n_us}
        # torch symmetric memory (NVSHMEM) last: its set-up must not disturb the others.
        symm = symm_mem_runs(rank, world, dev, args.iters)
        for t in SIZES:
            rows[t]["symm_mem_us"] = symm.get(t)
        rows["symm_mem_note"] = symm.get("note", "")
        if rank == 0:
            queue.put(("ok", rows))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the parent, which prints it
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def symm_mem_runs(rank, world, dev, iters):
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        group_name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        out = {}
        for t in SIZES:
            numel = t * TOP_K * HIDDEN
            inp = symm_mem.empty(numel, dtype=torch.bfloat16, device=dev)
            inp.copy_(torch.randn(numel, device=dev).to(torch.bfloat16))
            outp = symm_mem.empty(numel, dtype=torch.bfloat16, device=dev)
            in_splits = symm_mem.empty(world, dtype=torch.int64, device=dev).fill_(numel // world)
            so = symm_mem.empty((2, world), dtype=torch.int64, device=dev)
            for tensor in (inp, outp, in_splits, so):
                symm_mem.rendezvous(tensor, group_name)
            try:
                torch.ops.symm_mem.all_to_all_vdev(inp, outp, in_splits, so, group_name)
                call = lambda: torch.ops.symm_mem.all_to_all_vdev(inp, outp, in_splits, so,
                                                                   group_name)
            except (RuntimeError, TypeError):  # older torch: one [3, world] splits tensor
                io = symm_mem.empty((3, world), dtype=torch.int64, device=dev)
                symm_mem.rendezvous(io, group_name)
                io[0].fill_(numel // world)
                call = lambda: torch.ops.symm_mem.all_to_all_vdev(inp, outp, io, group_name)
            torch.cuda.synchronize()
            out[t] = timed(call, iters)
        return out
    except Exception as e:  # noqa: BLE001 -- a reference that cannot run is recorded, not fatal
        return {"note": f"not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    world = 2
    if torch.cuda.device_count() < world:
        print(f"SKIP: {world} GPUs needed, {torch.cuda.device_count()} visible")
        return 0
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    status, rows = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=120)
    if status != "ok":
        print(rows, file=sys.stderr)
        return 1
    note = rows.pop("symm_mem_note")
    gpu = torch.cuda.get_device_name(0)
    print(f"{gpu} x {world}; bf16, hidden {HIDDEN}, top-{TOP_K}, {EXPERTS_PER_RANK} experts per GPU;"
          f" p50 (p99) us of {args.iters} calls, barrier before each")
    hdr = (f"{'tokens':>7} {'MB/GPU':>8} {'dispatch':>16} {'combine':>16} {'NCCL a2a':>16}"
           f" {'symm_mem a2a':>16} {'disp/NCCL':>9} {'comb/disp':>9} {'disp/symm':>9}")
    print(hdr)
    lines = []
    for t in SIZES:
        r = rows[t]
        d, c, n = (statistics.median(r[k]) for k in ("dispatch_us", "combine_us", "nccl_us"))
        s = statistics.median(r["symm_mem_us"]) if r.get("symm_mem_us") else float("nan")
        cell = lambda k: (f"{statistics.median(r[k]):8.1f} ({pct(r[k], 0.99):5.0f})"
                          if r.get(k) else f"{'not run':>16}")
        print(f"{t:>7} {r['bytes_per_gpu'] / 1e6:8.2f} {cell('dispatch_us')} {cell('combine_us')}"
              f" {cell('nccl_us')} {cell('symm_mem_us')} {d / n:9.2f} {c / d:9.2f} {d / s:9.2f}")
        lines.append({"bench": "moe", "gpu": gpu, "tokens": t, "hidden": HIDDEN, "top_k": TOP_K,
                      "experts_per_rank": EXPERTS_PER_RANK, "bytes_per_gpu": r["bytes_per_gpu"],
                      "dispatch_p50_us": d, "combine_p50_us": c, "nccl_a2a_p50_us": n,
                      "symm_mem_a2a_p50_us": s, "dispatch_p99_us": pct(r["dispatch_us"], 0.99),
                      "combine_p99_us": pct(r["combine_us"], 0.99),
                      "nccl_a2a_p99_us": pct(r["nccl_us"], 0.99),
                      "dispatch_gbs": r["bytes_per_gpu"] / d / 1e3,
                      "nccl_gbs": r["bytes_per_gpu"] / n / 1e3, "iters": args.iters,
                      "symm_mem_note": note, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                   time.gmtime())})
    if note:
        print(f"torch symmetric memory: {note}")
    if args.json:
        with open(args.json, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
