#!/usr/bin/env python3
"""Ferry Python benchmark, with the flags of UCCL's p2p/benchmarks/benchmark_uccl.py.

    python bench/python_bench.py [--sizes 65536,1048576,...] [--num-iovs 128]
                                 [--mode write|read] [--iters 200] [--async-api]
                                 [--api native|batch|uccl] [--ferry-bench PATH]

A target process (spawned here) registers and advertises a buffer; this process
connects and runs one-sided writes or reads of `size` bytes split into
`--num-iovs` blocks per call, printing size, Gbps, GB/s and latency columns like
benchmark_uccl.py.

In the same run it measures the cost of the Python layer against the C++ engine
driven by ferry-bench (build/tools/ferry-bench, if built):

* 64 KiB x 128 iovs, blocking writes: the same workload through ferry-bench
  (`--spawn-local --op write --block-size 64KiB --batch 128`) and through each
  Python API; rounds alternate between the two and the median is compared.
  Floor: Python within 10% of C++.
* 100,000 iovs in one call (4 KiB blocks over a 64 MiB region, ferry-bench
  `--post-cost 100000`): the numpy fast path `Peer.write_batch` vs. the C++ call.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

import ferry

KiB = 1024
MiB = 1024 * KiB


# ----------------------------------------------------------------- target side
def _target(conn, region_bytes, streams):
    import numpy as np
    import ferry

    opts = {"tcp.streams": str(streams)} if streams else None
    engine = ferry.Engine("127.0.0.1:0", options=opts)
    buf = np.full(region_bytes, 7, dtype=np.uint8)
    region = engine.register(buf)
    conn.send((engine.metadata(), region.advertise()))
    while True:
        msg = conn.recv()
        if msg[0] == "adv":  # descriptors of sub-ranges, as UCCL's advertisev hands out
            conn.send([region.advertise(off, length) for off, length in msg[1]])
        else:
            break
    engine.close()


class Target:
    def __init__(self, region_bytes, streams):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target, args=(child, region_bytes, streams), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise SystemExit("target process did not start")
        self.metadata, self.desc = self.conn.recv()

    def advertise(self, ranges):
        """One descriptor per (offset, length), made by the target's engine."""
        self.conn.send(("adv", list(ranges)))
        return self.conn.recv()

    def close(self):
        try:
            self.conn.send(("exit",))
        except OSError:
            pass
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()


# -------------------------------------------------------------- initiator side
class Initiator:
    """One engine + one region + a peer: runs calls of `n` blocks of `block` bytes."""

    def __init__(self, target: Target, region_bytes: int, streams: int):
        opts = {"tcp.streams": str(streams)} if streams else None
        self.engine = ferry.Engine("127.0.0.1:0", options=opts)
        self.buf = np.full(region_bytes, 1, dtype=np.uint8)
        self.region = self.engine.register(self.buf)
        self.peer = self.engine.connect(target.metadata)
        self.desc = target.desc
        self.target = target
        self._uccl = None

    def uccl(self):
        # The UCCL-compatible Endpoint over the same memory (its own engine).
        if self._uccl is None:
            from ferry.compat.uccl import p2p
            ep = p2p.Endpoint(0, listen="127.0.0.1:0")
            ok, mr = ep.reg(self.buf.ctypes.data, self.buf.nbytes)
            ok, conn_id = ep.add_remote_endpoint(self.target.metadata)
            self._uccl = (ep, mr, conn_id)
        return self._uccl

    def make_call(self, api, mode, block, n, async_api):
        """A zero-argument function doing one call of n x block bytes."""
        offs = [i * block for i in range(n)]
        if api == "native":
            local = [(self.region, o, block) for o in offs]
            remote = [(self.desc, o, block) for o in offs]
            fn = self.peer.write if mode == "write" else self.peer.read
            if async_api:
                afn = self.peer.write_async if mode == "write" else self.peer.read_async
                return lambda: afn(local, remote).wait()
            return lambda: fn(local, remote)
        if api == "batch":
            lo = np.arange(n, dtype=np.uint64) * np.uint64(block)
            fn = self.peer.write_batch if mode == "write" else self.peer.read_batch
            if async_api:
                return lambda: fn(self.region, lo, self.desc, None, lo, block, async_=True).wait()
            return lambda: fn(self.region, lo, self.desc, None, lo, block)
        if api == "uccl":
            ep, mr, conn_id = self.uccl()
            base = self.buf.ctypes.data
            ptrs = [base + o for o in offs]
            sizes = [block] * n
            mrs = [mr] * n
            blobs = self.target.advertise([(o, block) for o in offs])
            if mode == "write":
                call, acall = ep.writev, ep.writev_async
            else:
                call, acall = ep.readv, ep.readv_async
            if async_api:
                def run():
                    ok, tid = acall(conn_id, mrs, ptrs, sizes, blobs, n)
                    while not ep.poll_async(tid)[1]:
                        pass
                return run
            return lambda: call(conn_id, mrs, ptrs, sizes, blobs, n)
        raise ValueError(api)

    def close(self):
        if self._uccl:
            self._uccl[0].close()
        self.engine.close()


def time_calls(call, iters, warmup, binding=None):
    """Runs warmup + iters calls; returns (seconds, per-call latencies). When
    `binding` is a list, appends the binding's own cost (ns) of each call."""
    for _ in range(warmup):
        call()
    lats = []
    t0 = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        call()
        lats.append(time.perf_counter() - t)
        if binding is not None:
            binding.append(ferry._ferry._last_binding_ns())
    return time.perf_counter() - t0, lats


def pretty(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for suffix, mult in (("kib", KiB), ("mib", MiB), ("gib", 1 << 30), ("kb", KiB), ("mb", MiB),
                         ("gb", 1 << 30), ("k", KiB), ("m", MiB), ("g", 1 << 30)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def parse_sizes(v: str):
    try:
        return [parse_size(x) for x in v.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError("--sizes: comma-separated sizes in bytes (or 64KiB, 1MiB)")


# ------------------------------------------------------------------ ferry-bench
def find_ferry_bench(explicit):
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (explicit, os.environ.get("FERRY_BENCH"),
                 os.path.join(here, "..", "build", "tools", "ferry-bench"),
                 shutil.which("ferry-bench")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    return None


def run_ferry_bench(path, args):
    cmd = [path, "--spawn-local", "--json", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    rows = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not rows:
        raise RuntimeError(f"{' '.join(cmd)} printed no JSON result")
    return rows[-1]


# ------------------------------------------------------------------------ main
def main():
    p = argparse.ArgumentParser(description="Ferry Python benchmark (benchmark_uccl.py flags)")
    p.add_argument("--mode", choices=["write", "read"], default="write")
    p.add_argument("--sizes", type=parse_sizes,
                   default=[256, 1024, 4096, 16384, 65536, 262144, 1048576, 10485760, 67108864],
                   help="comma-separated message sizes in bytes (each split into --num-iovs blocks)")
    p.add_argument("--iters", type=int, default=50, help="measured calls per size")
    p.add_argument("--warmup-iters", type=int, default=5)
    p.add_argument("--num-iovs", type=int, default=1, help="iovs (blocks) per call")
    p.add_argument("--async-api", action="store_true", help="post asynchronously, then wait/poll")
    p.add_argument("--api", choices=["native", "batch", "uccl"], default="native",
                   help="native: Peer.write(list); batch: Peer.write_batch(numpy); "
                        "uccl: ferry.compat.uccl Endpoint.writev")
    p.add_argument("--device", choices=["cpu"], default="cpu", help="buffer location (cpu only)")
    p.add_argument("--local-gpu-idx", type=int, default=0, help="accepted for compatibility")
    p.add_argument("--streams", type=int, default=0, help="tcp.streams (0: engine default)")
    p.add_argument("--ferry-bench", default=None, help="path of the C++ ferry-bench")
    p.add_argument("--compare-rounds", type=int, default=3,
                   help="alternating Python/C++ rounds for the overhead comparison")
    p.add_argument("--compare-iters", type=int, default=200)
    p.add_argument("--no-compare", action="store_true", help="skip the ferry-bench comparison")
    p.add_argument("--batch-entries", type=int, default=100_000,
                   help="entries of the large-batch comparison (0: skip)")
    args = p.parse_args()

    print(f"Ferry Python benchmark — mode {args.mode.upper()}, api {args.api}"
          f"{' (async)' if args.async_api else ''}, {args.num_iovs} iov(s) per call, "
          f"ferry {ferry.version()}")
    region_bytes = max(max(args.sizes), 64 * KiB * 128, 64 * MiB)
    target = Target(region_bytes, args.streams)
    init = Initiator(target, region_bytes, args.streams)
    try:
        print(f"{'size':>9} {'iovs':>5} {'block':>9} {'Gbps':>8} {'GB/s':>8} "
              f"{'lat mean(us)':>13} {'lat p50(us)':>12}")
        for size in args.sizes:
            n = max(1, args.num_iovs)
            block = size // n
            if block == 0:
                print(f"{pretty(size):>9}: smaller than --num-iovs, skipped")
                continue
            call = init.make_call(args.api, args.mode, block, n, args.async_api)
            elapsed, lats = time_calls(call, args.iters, args.warmup_iters)
            total = block * n * args.iters
            print(f"{pretty(size):>9} {n:>5} {pretty(block):>9} {total * 8 / elapsed / 1e9:8.2f} "
                  f"{total / elapsed / 1e9:8.2f} {statistics.mean(lats) * 1e6:13.1f} "
                  f"{statistics.median(lats) * 1e6:12.1f}")

        if not args.no_compare:
            compare(init, args)
    finally:
        init.close()
        target.close()


def compare(init, args):
    fb = find_ferry_bench(args.ferry_bench)
    print()
    if fb is None:
        print("ferry-bench not found (build it: cmake -DFERRY_BUILD_TOOLS=ON, or pass "
              "--ferry-bench PATH): Python-vs-C++ comparison skipped")
        return
    print(f"Python vs C++ (ferry-bench: {fb})")
    streams = ["--streams", str(args.streams)] if args.streams else []

    # 1. 64 KiB x 128 iovs, blocking writes.
    block, n = 64 * KiB, 128
    apis = (("native", "Python Peer.write(list)"),
            ("batch", "Python Peer.write_batch(numpy)"),
            ("uccl", "Python compat Endpoint.writev"))
    calls = {api: init.make_call(api, "write", block, n, False) for api, _ in apis}

    # 1a. Against ferry-bench (its own two processes), rounds alternating.
    py_lat = {api: [] for api in calls}
    binding = {api: [] for api in calls}
    cpp_p50, cpp_gbps = [], []
    for _ in range(args.compare_rounds):
        r = run_ferry_bench(fb, ["--op", "write", "--block-size", "64KiB", "--batch", "128",
                                 "--iters", str(args.compare_iters), *streams])
        cpp_p50.append(r["p50_us"])
        cpp_gbps.append(r["gbps"])
        for api, call in calls.items():
            _, lats = time_calls(call, args.compare_iters, 20, binding[api])
            py_lat[api] += [x * 1e6 for x in lats]
    c50 = statistics.median(cpp_p50)
    print(f"  64 KiB x 128 iovs, blocking write ({args.compare_rounds} rounds of "
          f"{args.compare_iters} calls, alternating)")
    print(f"    {'':<34} {'GB/s':>7} {'p50 us':>9} {'Py/C++':>7} {'binding us':>11}")
    print(f"    {'C++ ferry-bench (own processes)':<34} {statistics.median(cpp_gbps):7.3f} {c50:9.1f}")
    for api, label in apis:
        p50 = statistics.median(py_lat[api])
        print(f"    {label:<34} {block * n / p50 / 1e3:7.3f} {p50:9.1f} {p50 / c50:7.3f} "
              f"{statistics.median(binding[api]) / 1e3:11.1f}")

    # 1b. Against the same C++ calls on the same engine and connection (in-process,
    # interleaved 10 calls at a time): the Python layer's cost without run-to-run noise.
    k = 10
    cpp_in, py_in = [], {api: [] for api in calls}
    for _ in range(max(1, args.compare_iters * args.compare_rounds // k)):
        cpp_in += ferry._ferry._cpp_loop(init.peer, "write", init.region, block, n, init.desc, k)
        for api, call in calls.items():
            _, lats = time_calls(call, k, 0)
            py_in[api] += [x * 1e6 for x in lats]
    ci = statistics.median(cpp_in)
    print(f"    {'C++ Engine::write, same engine':<34} {block * n / ci / 1e3:7.3f} {ci:9.1f}")
    worst = 0.0
    for api, label in apis:
        p50 = statistics.median(py_in[api])
        worst = max(worst, p50 / ci)
        print(f"    {label:<34} {block * n / p50 / 1e3:7.3f} {p50:9.1f} {p50 / ci:7.3f}")
    print(f"    => Python overhead ratio vs the same C++ call (worst API): {worst:.3f} "
          f"[{'ok: within 10%' if worst <= 1.10 else 'OVER the 10% floor'}]")

    # 2. One call of 100,000 iovs (C++ and Python rounds alternate).
    if args.batch_entries:
        N = args.batch_entries
        cap = 64 * MiB
        lo = (np.arange(N, dtype=np.uint64) * np.uint64(4096)) % np.uint64(cap)
        init.peer.write_batch(init.region, lo, init.desc, None, lo, 4096)  # warm-up
        c_post, c_total, posts, totals, bind = [], [], [], [], []
        for _ in range(args.compare_rounds):
            r = run_ferry_bench(fb, ["--post-cost", str(N), *streams])
            c_post.append(r["post_us"])
            c_total.append(r["total_us"])
            for _rep in range(3):
                t0 = time.perf_counter()
                t = init.peer.write_batch(init.region, lo, init.desc, None, lo, 4096, async_=True)
                t1 = time.perf_counter()
                bind.append(ferry._ferry._last_binding_ns() / 1e3)
                t.wait()
                t2 = time.perf_counter()
                posts.append((t1 - t0) * 1e6)
                totals.append((t2 - t0) * 1e6)
        cp, ct = statistics.median(c_post), statistics.median(c_total)
        pp, pt, pb = statistics.median(posts), statistics.median(totals), statistics.median(bind)
        print(f"  one call of {N:,} x 4 KiB iovs (medians; {args.compare_rounds} alternating rounds):")
        print(f"    {'C++ Engine::write_async':<34} post {cp:10.0f} us   total {ct:10.0f} us")
        print(f"    {'Python Peer.write_batch(numpy)':<34} post {pp:10.0f} us   total {pt:10.0f} us")
        print(f"    binding work before the engine call: {pb:.0f} us = {100 * pb / ct:.2f}% of the "
              f"C++ call; end-to-end time ratio Python/C++ = {pt / ct:.3f} "
              f"[{'ok: within 10%' if pb / ct <= 0.10 and pt / ct <= 1.10 else 'check: over 10%'}]")


if __name__ == "__main__":
    main()
