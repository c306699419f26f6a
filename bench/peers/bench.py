"""Ferry against NIXL and Mooncake on this host: two processes per measurement,
host memory, one-sided WRITE and READ, DEPTH calls in flight. Engines alternate
per workload and round (order rotated); the table shows medians and, after
several rounds, the spread (lowest-highest); ratios are of the medians, with
the spread of the per-round ratios. Started by run.sh (which sets up the venv);
see bench/peers/README.md.

--place netns: each measurement's target in network namespace A, its initiator in
B, joined by a veth pair (bench/netns.py; needs root; the namespaces are deleted
at the end); only the tcp rows and iperf3 run there.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import netns  # noqa: E402  (bench/netns.py: two namespaces and their veth pair)

# name shown, driver engine, extra environment
ENGINES = {
    "Ferry": ("ferry", {}),
    "Ferry tcp": ("ferry", {"FERRY_ENGINE_TRANSPORTS": "tcp"}),
    # tcp striped over 8 streams served by 8 I/O threads a side (the default: one stream
    # and thread per 4 CPUs, 2 to 4 streams)
    "Ferry tcp 8 streams": ("ferry", {"FERRY_ENGINE_TRANSPORTS": "tcp", "FERRY_TCP_STREAMS": "8",
                                      "FERRY_TCP_IO_THREADS": "8"}),
    # shm with a fixed budget of copy threads on the target (the default follows the CPUs)
    "Ferry 1 copy thread": ("ferry", {"FERRY_SHM_COPY_THREADS": "1"}),
    "Ferry 4 copy threads": ("ferry", {"FERRY_SHM_COPY_THREADS": "4"}),
    # shm's shared-memory staging mode, the path taken where cross-memory attach is refused
    "Ferry staging": ("ferry", {"FERRY_SHM_MODE": "staging"}),
    # shm with its small-request polling off (the waiting caller leaves the socket to
    # the I/O thread, which sleeps at once): shm as before shm.caller_polls and
    # shm.busy_poll_us, for an A/B in one run
    "Ferry nopoll": ("ferry", {"FERRY_SHM_CALLER_POLLS": "false", "FERRY_SHM_BUSY_POLL_US": "0"}),
    "Ferry staging nopoll": ("ferry", {"FERRY_SHM_MODE": "staging", "FERRY_SHM_CALLER_POLLS": "false",
                                       "FERRY_SHM_BUSY_POLL_US": "0"}),
    # NIXL's fastest configuration: the initiator without a UCX progress thread
    # (it polls); "progthread": NIXL's default, the initiator keeps one.
    "NIXL": ("nixl", {}),  # UCX picks (cross-memory attach on one host)
    "NIXL progthread": ("nixl", {"PEERS_NIXL_PROG_THREAD": "1"}),
    "NIXL tcp": ("nixl", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}),
    "NIXL tcp progthread": ("nixl", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
                                     "PEERS_NIXL_PROG_THREAD": "1"}),
    "Mooncake": ("mooncake", {}),  # tcp, P2PHANDSHAKE
    "iperf3": ("iperf3", {}),  # one TCP stream on loopback, iperf3 -l BLOCK
    "memcpy": ("memcpy", {}),  # one process: the same bytes copied by numpy
}
# A/B of a change: PEERS_BASELINE=DIR (a build's python/ folder, e.g. the
# ferry_python_devtree of another checkout, or a copy of it: its ferry/libferry.so.0.1
# is loaded rather than the one the module's RUNPATH names) adds "Ferry tcp baseline" and
# "Ferry baseline", the same rows with that build's module, and the ratios of
# this tree's rows to them.
if os.environ.get("PEERS_BASELINE"):
    _base = {"PYTHONPATH": os.environ["PEERS_BASELINE"],
             # keep the rest of the path: the carried spdlog/fmt of a device machine live there
             "LD_LIBRARY_PATH": os.pathsep.join(
                 p for p in (os.path.join(os.environ["PEERS_BASELINE"], "ferry"),
                             os.environ.get("LD_LIBRARY_PATH", "")) if p)}
    ENGINES["Ferry tcp baseline"] = ("ferry", {**ENGINES["Ferry tcp"][1], **_base})
    ENGINES["Ferry baseline"] = ("ferry", _base)
# Run unless --engines names others (the copy-thread variants are asked for).
DEFAULT_ENGINES = [n for n in ENGINES if "copy thread" not in n and "8 streams" not in n
                   and "baseline" not in n and "nopoll" not in n]
# Quiet logs for every engine (Mooncake logs each completed batch at INFO).
QUIET = {"MC_LOG_LEVEL": "WARNING", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "warn"}


def crosses_network(name):
    """The rows that make sense between two network namespaces: tcp ones and iperf3
    (shm and UCX's cross-memory attach are one-kernel shortcuts, Mooncake stays on 127.0.0.1)."""
    env = ENGINES[name][1]
    return name == "iperf3" or env.get("FERRY_ENGINE_TRANSPORTS") == "tcp" or env.get("UCX_TLS") == "tcp"


def place_env(place, kind):
    """Driver prefix and environment for a place: netns runs the initiator (the driver)
    in B and its target under `ip netns exec A`, each on its veth address; NIXL's UCX
    on each side's veth instead of lo."""
    if place != "netns":
        return [], {}
    env = {"PEERS_TARGET_PREFIX": " ".join(netns.prefix(place, netns.TARGET)
                                           + ["env", f"UCX_NET_DEVICES={netns.VETH[netns.TARGET]}"]),
           "PEERS_TARGET_ADDR": netns.addr(place, netns.TARGET),
           "PEERS_INITIATOR_ADDR": netns.addr(place, netns.INITIATOR)}
    if kind == "nixl":
        env["UCX_NET_DEVICES"] = netns.VETH[netns.INITIATOR]
    return netns.prefix(place, netns.INITIATOR), env


# name, block bytes, iovs per call
WORKLOADS = [("4KiB x 64", 4096, 64), ("64KiB x 8", 65536, 8), ("1MiB x 8", 1 << 20, 8),
             ("KV 298 x 1179648", 1179648, 298)]
RATIOS = [("Ferry", "NIXL"), ("Ferry", "NIXL progthread"), ("Ferry", "Mooncake"),
          ("Ferry", "Ferry 4 copy threads"), ("Ferry 1 copy thread", "NIXL"),
          ("Ferry tcp", "NIXL tcp"), ("Ferry tcp", "NIXL tcp progthread"), ("Ferry tcp", "iperf3"),
          ("Ferry tcp", "Mooncake"), ("Ferry tcp 8 streams", "NIXL tcp"), ("Ferry tcp 8 streams", "iperf3"), ("Ferry staging", "NIXL"), ("Ferry", "memcpy"),
          ("Ferry tcp", "Ferry tcp baseline"), ("Ferry", "Ferry baseline"), ("Ferry tcp baseline", "NIXL tcp"),
          ("Ferry tcp baseline", "iperf3"), ("Ferry", "Ferry nopoll"),
          ("Ferry staging", "Ferry staging nopoll")]


def call_driver(name, args, extra, timeout):
    kind, env = ENGINES[name]
    prefix, where = place_env(args.place, kind)
    env = {**os.environ, **QUIET, **env, **where}
    cmd = [*prefix, sys.executable, str(HERE / "peer.py"), kind, *extra]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout} s"
    rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    err = "" if p.returncode == 0 else \
        f"exit {p.returncode}: " + " | ".join(p.stderr.strip().splitlines()[-3:])[-400:]
    return rows, err


def spread(v):
    return f"{min(v):.2f}-{max(v):.2f}" if len(v) > 1 else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-r", "--reps", type=int, default=3, help="rounds")
    ap.add_argument("--secs", type=float, default=2.0, help="timed seconds per engine, workload and op")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("-d", "--depth", type=int, default=4, help="calls in flight")
    ap.add_argument("--quick", action="store_true", help="1 repetition, 0.5 s, 0.2 s warm-up")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES), help="comma list of: " + ", ".join(ENGINES))
    ap.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS),
                    help="comma list of: " + ", ".join(w[0] for w in WORKLOADS))
    ap.add_argument("--ops", default="write,read", help="write, read or both")
    ap.add_argument("--grouped", action="store_true",
                    help="one pair of processes per engine and round runs every workload (one "
                         "start-up instead of one per workload: for a short lease on a machine)")
    ap.add_argument("--place", choices=["loopback", "netns"], default="loopback",
                    help="loopback: both processes on 127.0.0.1; netns: target in network namespace "
                         f"{netns.NS[0]} ({netns.ADDR[0]}), initiator in {netns.NS[1]} ({netns.ADDR[1]}), "
                         "a veth pair between them (root; tcp rows and iperf3 only)")
    ap.add_argument("--json", nargs="?", const="auto", default=None,
                    help="write results (default bench/results/peers-DATE-COMMIT.jsonl)")
    a = ap.parse_args()
    if a.quick:
        a.reps, a.secs, a.warmup = 1, 0.5, 0.2
    names = [n.strip() for n in a.engines.split(",")]
    if unknown := [n for n in names if n not in ENGINES]:
        sys.exit(f"unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    not_run = {}
    if a.place == "netns":
        for n in names:
            if not crosses_network(n):
                not_run[n] = ("--place netns runs only the rows that cross a network "
                              "(Ferry tcp..., NIXL tcp..., iperf3)")
        names = [n for n in names if n not in not_run]
        if not names:
            sys.exit("--place netns: none of the engines crosses the network; name tcp rows "
                     "(Ferry tcp, NIXL tcp, iperf3, ...)")
    wanted = [w.strip() for w in a.workloads.split(",")]
    workloads = [w for w in WORKLOADS if w[0] in wanted]
    if len(workloads) != len(wanted):
        sys.exit(f"unknown workload in {wanted}; known: {', '.join(w[0] for w in WORKLOADS)}")
    op_list = [o.strip() for o in a.ops.split(",")]
    log = lambda *m: print("[peers]", *m, file=sys.stderr, flush=True)
    for n, why in not_run.items():
        log(f"{n}: NOT RUN ({why})")
    if a.place == "netns":  # `timeout` and the like stop with SIGTERM: delete the namespaces then too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if a.place == "netns":
            netns.up()
            log(f"netns: target in {netns.NS[0]} ({netns.VETH[0]} {netns.ADDR[0]}), "
                f"initiator in {netns.NS[1]} ({netns.VETH[1]} {netns.ADDR[1]})")
        return measure_and_report(a, names, workloads, op_list, not_run, log)
    finally:
        if a.place == "netns":
            netns.down()


def measure_and_report(a, names, workloads, op_list, not_run, log):
    # Which engines run here: each creates an engine on both sides and moves 4 KiB.
    versions = {}
    for n in names:
        rows, err = call_driver(n, a, ["--probe"], 120)
        if rows and not err:
            versions[n] = rows[0]
            log(f"{n}: {rows[0]['version']}", f"transports {rows[0]['transports']}" if rows[0].get("transports") else "")
        else:
            not_run[n] = err or "no output"
            log(f"{n}: NOT RUN ({not_run[n]})")
    running = [n for n in names if n in versions]
    by_shape = {(block, batch): wname for wname, block, batch in workloads}

    runs, failures = [], []
    for rep in range(a.reps):
        ops = op_list if rep % 2 == 0 else op_list[::-1]
        # Grouped: every workload in one call per engine; else one call per workload.
        groups = [workloads] if a.grouped else [[w] for w in workloads]
        for gi, group in enumerate(groups):
            k = (rep + gi) % max(1, len(running))
            timeout = 120 + len(group) * len(ops) * 4 * (a.secs + a.warmup)
            for n in running[k:] + running[:k]:  # rotated: no engine always first or last
                extra = ["--block", ",".join(str(w[1]) for w in group),
                         "--batch", ",".join(str(w[2]) for w in group), "--depth", str(a.depth),
                         "--secs", str(a.secs), "--warmup", str(a.warmup), "--ops", ",".join(ops)]
                rows, err = call_driver(n, a, extra, timeout)
                for r in rows:
                    # iperf3 reports per block size; its rows stand beside every workload of it.
                    names_ = [w for (bl, ba), w in by_shape.items()
                              if bl == r["block"] and (ba == r["batch"] or n == "iperf3")]
                    for wname in names_:
                        batch = next(w[2] for w in workloads if w[0] == wname)
                        r2 = dict(r, kind="measure", engine=n, workload=wname, block_size=r["block"],
                                  batch=batch, depth=a.depth, rep=rep, place=a.place)
                        runs.append(r2)
                        if r["verify"] != "ok":
                            failures.append(f"{n} {wname} {r['op']}: DATA CHECK {r['verify']}")
                        log(f"rep {rep + 1}/{a.reps} {wname} {r['op']:5} {n:9} {r['gbps']:7.3f} GB/s  "
                            f"verify {r['verify']}")
                if err:
                    failures.append(f"{n} {'+'.join(w[0] for w in group)}: {err}")
                    log(f"rep {rep + 1}/{a.reps} {n}: FAILED {err}")

    # --- medians, spread and the table ---------------------------------------------
    med, vals = {}, {}
    for wname, _, _ in workloads:
        for op in op_list:
            for n in running:
                v = [r["gbps"] for r in runs if (r["engine"], r["workload"], r["op"]) == (n, wname, op)]
                if v:
                    vals[wname, op, n] = v
                    med[wname, op, n] = statistics.median(v)

    def per_round(wname, op, x, y):  # ratios of the rounds where both ran
        gx = {r["rep"]: r["gbps"] for r in runs if (r["engine"], r["workload"], r["op"]) == (x, wname, op)}
        gy = {r["rep"]: r["gbps"] for r in runs if (r["engine"], r["workload"], r["op"]) == (y, wname, op)}
        return [gx[k] / gy[k] for k in sorted(gx) if k in gy and gy[k] > 0]

    cols = [n for n in names if n in running]
    ratios = [(x, y) for x, y in RATIOS if x in running and y in running]
    hdr = ["workload", "op"] + cols + [f"{x}/{y}" for x, y in ratios]
    table, ratio_rows = [], []
    for wname, _, _ in workloads:
        for op in op_list:
            row = [wname, op]
            for n in cols:
                v = vals.get((wname, op, n))
                row.append(f"{med[wname, op, n]:.2f}" + (f" ({spread(v)})" if v and len(v) > 1 else "")
                           if v else "-")
            for x, y in ratios:
                vx, vy = med.get((wname, op, x)), med.get((wname, op, y))
                pr = per_round(wname, op, x, y)
                if vx and vy:
                    row.append(f"{vx / vy:.2f}" + (f" ({spread(pr)})" if len(pr) > 1 else ""))
                    ratio_rows.append({"kind": "ratio", "place": a.place, "workload": wname, "op": op, "engine": x,
                                       "reference": y, "ratio_of_medians": vx / vy, "per_round": pr,
                                       "ahead_rounds": sum(1 for q in pr if q > 1)})
                else:
                    row.append("-")
            table.append(row)
    w = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(hdr)]
    fmt = lambda r: "  ".join(c.rjust(w[i]) if i >= 2 else c.ljust(w[i]) for i, c in enumerate(r))
    where = ("loopback (127.0.0.1)" if a.place == "loopback" else
             f"netns: target in {netns.NS[0]} ({netns.ADDR[0]}), initiator in {netns.NS[1]} "
             f"({netns.ADDR[1]}), veth; tcp rows and iperf3 only")
    print(f"\nplace: {where}")
    print(f"GB/s (10^9 B/s of payload), medians of {a.reps} rounds (lowest-highest); 2 processes, "
          f"host memory, {a.depth} calls in flight, {a.secs} s per run; ratios: of the medians "
          f"(lowest-highest per-round ratio); memcpy: one process, same bytes; iperf3: one stream, "
          f"-l BLOCK; {os.cpu_count()} CPUs")
    print(fmt(hdr))
    print("  ".join("-" * x for x in w))
    for r in table:
        print(fmt(r))
    # CPU cost: CPU seconds of both processes (every thread) per GB moved, medians.
    cpu_cols = [n for n in cols if any(r.get("cpu_s_per_gb") is not None for r in runs if r["engine"] == n)]
    if cpu_cols:
        print("\nCPU seconds per GB moved (initiator + target, every thread; medians)")
        chdr = ["workload", "op"] + cpu_cols
        crows = []
        for wname, _, _ in workloads:
            for op in op_list:
                row = [wname, op]
                for n in cpu_cols:
                    v = [r["cpu_s_per_gb"] for r in runs if (r["engine"], r["workload"], r["op"]) == (n, wname, op)
                         and r.get("cpu_s_per_gb") is not None]
                    row.append(f"{statistics.median(v):.3f}" if v else "-")
                crows.append(row)
        cw = [max(len(h), *(len(r[i]) for r in crows)) for i, h in enumerate(chdr)]
        print("  ".join(c.ljust(cw[i]) if i < 2 else c.rjust(cw[i]) for i, c in enumerate(chdr)))
        for r in crows:
            print("  ".join(c.ljust(cw[i]) if i < 2 else c.rjust(cw[i]) for i, c in enumerate(r)))
    print("\nversions: " + "; ".join(f"{n}: {v['version']}" for n, v in versions.items()))
    ferry_t = {n: v["transports"] for n, v in versions.items() if n.startswith("Ferry")}
    if ferry_t:
        print("Ferry transports: " + "; ".join(f"{n}: {t}" for n, t in ferry_t.items()))
    for n, why in not_run.items():
        print(f"NOT RUN {n}: {why}")
    for f in failures:
        print(f"FAILED {f}")
    if not failures:
        print("data checks: all ok (" + str(sum(1 for r in runs)) + " runs, one check each)")

    if a.json:
        # PEERS_COMMIT: a copy of the tree without .git (a device machine) names its commit.
        commit = os.environ.get("PEERS_COMMIT") or subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True).stdout.strip() or "nogit"
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = Path(a.json) if a.json != "auto" else ROOT / "bench/results" / f"peers-{date}-{commit}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True).stdout.strip())
            f.write(json.dumps({"kind": "run", "place": a.place, "date": date, "commit": commit, "dirty_tree": dirty,
                                "reps": a.reps, "secs": a.secs, "grouped": a.grouped, "warmup": a.warmup, "depth": a.depth,
                                "nproc": os.cpu_count(), "kernel": platform.release(),
                                "engines": {n: {"driver": ENGINES[n][0], "env": ENGINES[n][1]} for n in names},
                                "versions": versions, "not_run": not_run, "failures": failures}) + "\n")
            for r in runs:
                f.write(json.dumps(r) + "\n")
            for (wname, op, n), v in med.items():
                f.write(json.dumps({"kind": "median", "place": a.place, "workload": wname, "op": op, "engine": n, "gbps": v,
                                    "lowest": min(vals[wname, op, n]), "highest": max(vals[wname, op, n]),
                                    "rounds": len(vals[wname, op, n])}) + "\n")
            for r in ratio_rows:
                f.write(json.dumps(r) + "\n")
        print(f"results: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
