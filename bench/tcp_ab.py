#!/usr/bin/env python3
"""tcp A/B: two builds of ferry-bench against each other and one iperf3 stream, on
loopback and between two network namespaces joined by a veth pair (the closest thing
to two hosts on one machine). Host memory, WRITE, DEPTH calls in flight, forced to
tcp; per round and place the systems run one after the other in a rotated order;
medians of the rounds, the spread, and ratios of the medians with the spread of the
per-round ratios. Every Ferry run is a fresh pair of processes (--verify: the data
is written, read back and compared after the timed run).

    python3 bench/tcp_ab.py --base BASE/build/tools/ferry-bench --new build/tools/ferry-bench \\
        [--rounds 5] [--secs 1] [--places loopback,netns] [--workloads "1MiB x 8,64KiB x 8"]

netns needs root and iproute2; its namespaces (bench/netns.py: ferryabA/B, 10.78.78.0/24 on
the veth only) are deleted at the end whatever happens. The target side runs in A, the
initiator and the iperf3 client in B. Run it `nice -n 10` on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from netns import addr, prefix, sh  # bench/netns.py: the namespaces and their veth
import netns

WORKLOADS = {"4KiB x 64": ("4KiB", 64), "64KiB x 8": ("64KiB", 8), "1MiB x 8": ("1MiB", 8),
             "KV 298 x 1179648": ("1179648", 298)}


def env_for(binary):
    # A copy of a build's ferry-bench with its libferry.so.0.1 beside it (its RUNPATH names
    # the build directory, which may since hold another build): load the one beside it.
    here = os.path.dirname(os.path.abspath(binary))
    if os.path.exists(os.path.join(here, "libferry.so.0.1")):
        return {**os.environ, "LD_LIBRARY_PATH": here}
    return None


def run_ferry(binary, place, block, batch, a):
    env = env_for(binary)
    common = ["-s", block, "-b", str(batch), "-d", str(a.depth), "--op", "write",
              "-o", "engine.transports=tcp"] + sum((["-o", o] for o in a.option), [])
    target = subprocess.Popen(prefix(place, 0) + [binary, "--role", "target", "--listen",
                              addr(place, 0) + ":0", "--quiet", "-o", "engine.host_id=ab-target"] + common,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready = ""
        while not ready.startswith("FERRY_TARGET"):
            ready = target.stdout.readline()
            if not ready:
                raise RuntimeError(f"{binary}: the target exited before its ready line")
        out = subprocess.run(prefix(place, 1) + [binary, "--role", "initiator", "--peer", ready.strip(),
                             "--json", "--verify", "--time", str(a.secs), "-o", "engine.host_id=ab-initiator",
                             *common], capture_output=True, text=True, env=env)
        rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
        if not rows or rows[0]["verify"] not in ("ok", "pass", "passed"):
            raise RuntimeError(f"{binary}: {rows or out.stderr[-300:]}")
        return rows[0]["gbps"]
    finally:
        target.stdin.close()
        target.wait(timeout=30)


def run_iperf3(place, block, a):
    port = "5311"
    server = subprocess.Popen(prefix(place, 0) + ["iperf3", "-s", "-1", "-B", addr(place, 0), "-p", port],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.2)
        length = min(block, 1 << 20)  # iperf3 writes at most 1 MiB
        out = sh(*prefix(place, 1), "iperf3", "-c", addr(place, 0), "-p", port, "-l", str(length),
                 "-t", str(max(1, round(a.secs))), "-J")
        return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9
    finally:
        server.wait(timeout=10)


def size_of(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20}
    for u, m in units.items():
        if text.endswith(u):
            return int(text[:-len(u)]) * m
    return int(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="ferry-bench of the reference build")
    ap.add_argument("--new", required=True, help="ferry-bench of the changed build")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--secs", type=float, default=1.0)
    ap.add_argument("-d", "--depth", type=int, default=4)
    ap.add_argument("--places", default="loopback,netns")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--no-iperf3", action="store_true")
    ap.add_argument("-o", "--option", action="append", default=[], help="engine option for both builds")
    a = ap.parse_args()
    places = [p.strip() for p in a.places.split(",")]
    workloads = [w.strip() for w in a.workloads.split(",")]
    systems = ["base", "new"] + ([] if a.no_iperf3 else ["iperf3"])
    runs = {}
    log = lambda *m: print(*m, file=sys.stderr, flush=True)
    try:
        if "netns" in places:
            netns.up()
        for r in range(a.rounds):
            for place in places:
                for w in workloads:
                    block, batch = WORKLOADS[w]
                    order = systems[r % len(systems):] + systems[:r % len(systems)]
                    for s in order:
                        if s == "iperf3":
                            g = run_iperf3(place, size_of(block), a)
                        else:
                            g = run_ferry(a.base if s == "base" else a.new, place, block, batch, a)
                        runs.setdefault((place, w, s), {})[r] = g
                        log(f"round {r + 1} {place:8} {w:17} {s:6} {g:7.3f} GB/s")
    finally:
        if "netns" in places:
            netns.down()

    def cell(v):
        v = list(v.values())
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

    def ratio(x, y):
        rx, ry = runs[x], runs[y]
        per = [rx[k] / ry[k] for k in rx if k in ry]
        return f"{statistics.median(rx.values()) / statistics.median(ry.values()):.2f} " \
               f"({min(per):.2f}-{max(per):.2f})"

    print(f"\nGB/s, WRITE, {a.depth} in flight, tcp, medians of {a.rounds} rounds (lowest-highest); "
          f"{os.cpu_count()} CPUs; ratios of medians (per-round lowest-highest)")
    cols = systems + ["new/base"] + ([] if a.no_iperf3 else ["new/iperf3", "base/iperf3"])
    print("| place | workload | " + " | ".join(cols) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in cols) + " |")
    for place in places:
        for w in workloads:
            row = [cell(runs[place, w, s]) for s in systems] + [ratio((place, w, "new"), (place, w, "base"))]
            if not a.no_iperf3:
                row += [ratio((place, w, "new"), (place, w, "iperf3")),
                        ratio((place, w, "base"), (place, w, "iperf3"))]
            print(f"| {place} | {w} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
