#!/usr/bin/env python3
"""MoE dispatch and combine (ferry.symmetric.MoeExchange) against NCCL
all_to_all_single of the same bytes and, where it runs, torch symmetric
memory's all_to_all_vdev (NVSHMEM), in one run on --world GPUs (default 2;
MoE spreads experts over 4-8 GPUs, so run it with --world 4 where 4 exist).

Workload: bf16, hidden 7,168, top-8, 8 experts per GPU, 1 / 128 / 512 / 4,096
tokens per GPU, random routing (8 distinct experts per token). Bytes per GPU
per call: tokens x 8 x 7,168 x 2 (each (token, expert) copy; the copies that
stay on the GPU included, for Ferry and the references alike) -- what the
all-to-alls move. Ferry's dispatch sends each token over NVLink once per
member holding any of its experts and copies it to the experts there; its
combine returns one summed row per (token, member): the same result in fewer
NVLink bytes, which is the point of the comparison.

Three timings per system and size, the systems taking turns per size:
  stream:  the GPU time of each call in a stream of --iters calls enqueued
           behind a sleep kernel (so no host overhead or launch skew between
           the two processes is counted) -- how calls run inside a model step;
           the GPUs run in lockstep, and one call's time includes any wait for
           the other GPUs to finish their previous call (which of dispatch and
           combine shows that wait can change from run to run: compare sums);
  gpu barrier: the same, with a barrier among the GPUs (a kernel, Ferry's
           SymmetricMemory.barrier) before every call of every system: each
           call's own time, every GPU starting it within the barrier's skew;
  barrier: dist.barrier + synchronize before each call, CUDA events around it
           (host launch overhead and the two processes' skew included).
p50 and p99 in microseconds.

    python3 bench/device_api/moe_bench.py [--iters 50] [--world 2] [--json FILE]
    python3 bench/device_api/moe_bench.py --breakdown   # where a one-token call goes
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
WARMUP = 3
SLEEP_CYCLES = 40_000_000  # ~20 ms of GPU sleep while the host enqueues the calls


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")


def random_call(tokens, experts, gen, dev):
    """One call's inputs: bf16 rows, TOP_K distinct random experts per token and
    their weights, and the combine's output buffer."""
    x = torch.randn((tokens, HIDDEN), generator=gen, device=dev).to(torch.bfloat16)
    scores = torch.rand((tokens, experts), generator=gen, device=dev)
    topk = scores.argsort(dim=1)[:, :TOP_K].contiguous().to(torch.int64)
    w = torch.rand((tokens, TOP_K), generator=gen, device=dev)
    return x, topk, w, torch.empty((tokens, HIDDEN), dtype=torch.bfloat16, device=dev)


def event_pair():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def stream_timed(calls, iters, before=None):
    """GPU microseconds of each callable per iteration, all enqueued behind a sleep.

    before: enqueued ahead of every call, outside its timing -- with
    gpu_barrier_timed, a barrier among the GPUs (Ferry's SymmetricMemory.barrier
    kernel), so that each call starts on every GPU within the barrier's skew and
    neither host launches nor the other GPU's previous call are counted."""
    dist.barrier()
    torch.cuda.synchronize()
    events = [[event_pair() for _ in calls] for _ in range(iters + WARMUP)]
    torch.cuda._sleep(SLEEP_CYCLES)
    for row in events:
        for (a, b), call in zip(row, calls):
            if before is not None:
                before()
            a.record()
            call()
            b.record()
    torch.cuda.synchronize()
    return [[row[j][0].elapsed_time(row[j][1]) * 1000.0 for row in events[WARMUP:]]
            for j in range(len(calls))]


def gpu_barrier_timed(calls, iters, gpu_barrier):
    """stream_timed with a barrier among the GPUs before every call."""
    return stream_timed(calls, iters, before=gpu_barrier)


def barrier_timed(calls, iters):
    """Microseconds of each callable with a barrier before it."""
    out = [[] for _ in calls]
    a, b = event_pair()
    for i in range(iters + WARMUP):
        for j, call in enumerate(calls):
            dist.barrier()
            torch.cuda.synchronize()
            a.record()
            call()
            b.record()
            b.synchronize()
            if i >= WARMUP:
                out[j].append(a.elapsed_time(b) * 1000.0)
    return out


def finish(rank, queue, payload):
    """A worker's end: rank 0 hands the payload to the parent; all leave together."""
    if rank == 0:
        queue.put(("ok", payload))
    dist.barrier()
    dist.destroy_process_group()


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
        if args.breakdown:
            return finish(rank, queue, ("breakdown", breakdown_runs(moe, world, dev, args.iters)))
        if args.sm_sweep:
            return finish(rank, queue, ("sm_sweep", sm_sweep_runs(rank, world, dev, args.iters,
                                                                  moe.memory.barrier)))
        rows = {}
        for t in SIZES:
            x, topk, w, out = random_call(t, experts, gen, dev)
            ferry_calls = [lambda: moe.dispatch(x, topk, w),
                           lambda: moe.combine(moe.recv_x, out=out)]
            inp = torch.randn((t * TOP_K, HIDDEN), device=dev).to(torch.bfloat16)
            outp = torch.empty_like(inp)
            nccl_calls = [lambda: dist.all_to_all_single(outp, inp)]
            r = {"tokens": t, "bytes_per_gpu": t * TOP_K * HIDDEN * 2}
            r["dispatch"], r["combine"] = stream_timed(ferry_calls, args.iters)
            (r["nccl"],) = stream_timed(nccl_calls, args.iters)
            gpu_barrier = moe.memory.barrier
            r["dispatch_gpu_barrier"], r["combine_gpu_barrier"] = gpu_barrier_timed(
                ferry_calls, args.iters, gpu_barrier)
            (r["nccl_gpu_barrier"],) = gpu_barrier_timed(nccl_calls, args.iters, gpu_barrier)
            r["dispatch_barrier"], r["combine_barrier"] = barrier_timed(ferry_calls, args.iters)
            (r["nccl_barrier"],) = barrier_timed(nccl_calls, args.iters)
            moe.memory.check_device_error()
            rows[t] = r
        # torch symmetric memory (NVSHMEM) last: its set-up must not disturb the others.
        note = symm_mem_runs(rank, world, dev, args.iters, rows, moe.memory.barrier)
        return finish(rank, queue, (rows, note))
    except Exception:  # noqa: BLE001 -- reported to the parent, which prints it
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def breakdown_runs(moe, world, dev, iters):
    """Where a one-token call's time goes: each part timed alone behind a barrier
    among the GPUs (gpu barrier timing). A one-element torch kernel is the floor
    of any timed launch; the barrier kernel itself is one signal to and one wait
    for every other GPU; a 0-token dispatch or combine runs everything but the
    data (its counts, signals and waits); NCCL moves 2 bytes to each GPU."""
    gpu_barrier = moe.memory.barrier
    gen = torch.Generator(device=dev)
    gen.manual_seed(99 + dist.get_rank())
    experts = world * EXPERTS_PER_RANK

    (x0, k0, w0, o0), (x1, k1, w1, o1), (x8, k8, w8, o8) = (
        random_call(t, experts, gen, dev) for t in (0, 1, 8))
    one = torch.zeros(1, device=dev)
    tiny_in = torch.ones(world, dtype=torch.bfloat16, device=dev)
    tiny_out = torch.empty_like(tiny_in)
    tok_in = torch.randn((TOP_K, HIDDEN), device=dev).to(torch.bfloat16)
    tok_out = torch.empty_like(tok_in)
    groups = [
        (["one-element torch kernel"], [lambda: one.add_(1)]),
        (["Ferry barrier kernel"], [gpu_barrier]),
        (["dispatch, 0 tokens", "combine, 0 tokens"],
         [lambda: moe.dispatch(x0, k0, w0), lambda: moe.combine(moe.recv_x, out=o0)]),
        (["dispatch, 1 token", "combine, 1 token"],
         [lambda: moe.dispatch(x1, k1, w1), lambda: moe.combine(moe.recv_x, out=o1)]),
        (["dispatch, 8 tokens (the low-latency bound)", "combine, 8 tokens"],
         [lambda: moe.dispatch(x8, k8, w8), lambda: moe.combine(moe.recv_x, out=o8)]),
        (["NCCL a2a, 2 B per GPU"], [lambda: dist.all_to_all_single(tiny_out, tiny_in)]),
        (["NCCL a2a, 1 token"], [lambda: dist.all_to_all_single(tok_out, tok_in)]),
    ]
    out = {}
    for names, calls in groups:
        for name, times in zip(names, gpu_barrier_timed(calls, iters, gpu_barrier)):
            out[name] = times
    moe.memory.check_device_error()
    return out


SWEEP_SMS = [0, 96, 64, 48, 32]  # 0: every SM (the default)
SWEEP_SIZES = [128, 512]


def sm_sweep_runs(rank, world, dev, iters, gpu_barrier):
    """Dispatch and combine p50 (gpu barrier timing) per MoeConfig.sm_count, for
    the mid sizes: how many SMs a call of that size is best given."""
    from ferry.symmetric import MoeExchange

    experts = world * EXPERTS_PER_RANK
    gen = torch.Generator(device=dev)
    gen.manual_seed(4321 + rank)
    table = []
    for sms in SWEEP_SMS:
        moe = MoeExchange(max_tokens=max(SWEEP_SIZES), hidden=HIDDEN, top_k=TOP_K,
                          experts_per_rank=EXPERTS_PER_RANK, rank=rank, size=world, sm_count=sms)
        for t in SWEEP_SIZES:
            x, topk, w, out = random_call(t, experts, gen, dev)
            calls = [lambda: moe.dispatch(x, topk, w), lambda: moe.combine(moe.recv_x, out=out)]
            d, c = gpu_barrier_timed(calls, iters, gpu_barrier)
            moe.memory.check_device_error()
            table.append((sms, t, statistics.median(d), statistics.median(c)))
        moe = None  # frees its buffer before the next sm_count
        torch.cuda.synchronize()
        dist.barrier()
    return table


def symm_mem_runs(rank, world, dev, iters, rows, gpu_barrier):
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        group_name = dist.group.WORLD.group_name
        for t in SIZES:
            numel = t * TOP_K * HIDDEN
            inp = symm_mem.empty(numel, dtype=torch.bfloat16, device=dev)
            inp.copy_(torch.randn(numel, device=dev).to(torch.bfloat16))
            outp = symm_mem.empty(numel, dtype=torch.bfloat16, device=dev)
            in_splits = symm_mem.empty(world, dtype=torch.int64, device=dev).fill_(numel // world)
            so = symm_mem.empty((2, world), dtype=torch.int64, device=dev)
            for tensor in (inp, outp, in_splits, so):
                symm_mem.rendezvous(tensor, group_name)
            call = lambda: torch.ops.symm_mem.all_to_all_vdev(inp, outp, in_splits, so,
                                                               group_name)
            call()
            torch.cuda.synchronize()
            (rows[t]["symm_mem"],) = stream_timed([call], iters)
            (rows[t]["symm_mem_gpu_barrier"],) = gpu_barrier_timed([call], iters, gpu_barrier)
            (rows[t]["symm_mem_barrier"],) = barrier_timed([call], iters)
        return ""
    except Exception as e:  # noqa: BLE001 -- a reference that cannot run is recorded, not fatal
        return f"not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default="")
    ap.add_argument("--world", type=int, default=2, help="GPUs (one process each), 2..8")
    ap.add_argument("--breakdown", action="store_true",
                    help="only the parts of a one-token call (breakdown_runs), not the sizes")
    ap.add_argument("--sm-sweep", action="store_true",
                    help="only dispatch/combine of 128 and 512 tokens per sm_count (sm_sweep_runs)")
    args = ap.parse_args()
    world = args.world
    if torch.cuda.device_count() < world:
        print(f"SKIP: {world} GPUs needed, {torch.cuda.device_count()} visible")
        return 0
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    status, payload = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=120)
    if status != "ok":
        print(payload, file=sys.stderr)
        return 1
    gpu = torch.cuda.get_device_name(0)
    if args.breakdown:
        return print_breakdown(payload[1], gpu, world, args)
    if args.sm_sweep:
        print(f"\n{gpu} x {world}; sm_count sweep, gpu barrier timing, p50 us of {args.iters} calls "
              "(sm_count 0: every SM)")
        print(f"{'sm_count':>8} {'tokens':>6} {'dispatch':>9} {'combine':>9}")
        for sms, t, d, c in payload[1]:
            print(f"{sms:8d} {t:6d} {d:9.1f} {c:9.1f}")
        return 0
    rows, note = payload
    med = lambda r, k: statistics.median(r[k]) if r.get(k) else float("nan")
    cell = lambda r, k: (f"{med(r, k):8.1f} ({pct(r[k], 0.99):6.1f})" if r.get(k)
                         else f"{'not run':>17}")
    lines = []
    for mode, suffix in (("stream", ""), ("gpu barrier", "_gpu_barrier"), ("barrier", "_barrier")):
        print(f"\n{gpu} x {world}; bf16, hidden {HIDDEN}, top-{TOP_K}, {EXPERTS_PER_RANK} experts"
              f" per GPU; {mode} timing, p50 (p99) us of {args.iters} calls")
        print(f"{'tokens':>7} {'MB/GPU':>7} {'dispatch':>17} {'combine':>17} {'NCCL a2a':>17}"
              f" {'symm_mem a2a':>17} {'disp/NCCL':>9} {'comb/disp':>9} {'disp/symm':>9}")
        for t in SIZES:
            r = rows[t]
            d, c, n, s = (med(r, k + suffix) for k in ("dispatch", "combine", "nccl", "symm_mem"))
            print(f"{t:>7} {r['bytes_per_gpu'] / 1e6:7.2f} {cell(r, 'dispatch' + suffix)}"
                  f" {cell(r, 'combine' + suffix)} {cell(r, 'nccl' + suffix)}"
                  f" {cell(r, 'symm_mem' + suffix)} {d / n:9.2f} {c / d:9.2f} {d / s:9.2f}")
            lines.append({
                "bench": "moe", "timing": mode, "gpu": gpu, "tokens": t, "hidden": HIDDEN,
                "top_k": TOP_K, "experts_per_rank": EXPERTS_PER_RANK, "world": world,
                "bytes_per_gpu": r["bytes_per_gpu"], "iters": args.iters,
                "dispatch_p50_us": d, "combine_p50_us": c, "nccl_a2a_p50_us": n,
                "symm_mem_a2a_p50_us": s,
                "dispatch_p99_us": pct(r["dispatch" + suffix], 0.99),
                "combine_p99_us": pct(r["combine" + suffix], 0.99),
                "nccl_a2a_p99_us": pct(r["nccl" + suffix], 0.99),
                "dispatch_gbs": r["bytes_per_gpu"] / d / 1e3,
                "nccl_gbs": r["bytes_per_gpu"] / n / 1e3, "symm_mem_note": note,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    if note:
        print(f"torch symmetric memory: {note}")
    if args.json:
        with open(args.json, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return 0


def print_breakdown(parts, gpu, world, args):
    print(f"\n{gpu} x {world}; where a one-token call goes (hidden {HIDDEN}, top-{TOP_K}, "
          f"{EXPERTS_PER_RANK} experts per GPU); gpu barrier timing, us of {args.iters} calls")
    print(f"{'part':<44} {'p50':>8} {'p99':>8}")
    lines = []
    for name, times in parts.items():
        p50 = statistics.median(times)
        print(f"{name:<44} {p50:8.1f} {pct(times, 0.99):8.1f}")
        lines.append({"bench": "moe_breakdown", "gpu": gpu, "world": world, "part": name,
                      "p50_us": p50, "p99_us": pct(times, 0.99), "iters": args.iters,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    if args.json:
        with open(args.json, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
