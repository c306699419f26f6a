#!/usr/bin/env python3
"""Plot GB/s against block size per system from bench/tcp_vs_peers.sh results.

    python3 bench/plot_tcp.py                      # newest bench/results/tcp_vs_peers-*.jsonl
    python3 bench/plot_tcp.py RESULTS.jsonl -o docs/tcp_vs_peers.png
    python3 bench/plot_tcp.py --markdown           # also print the tables for docs/benchmarks.md

Each point is the median over the run's repetitions; thin error bars span the
fastest and slowest repetition. The KV-cache workload (298 x 1,179,648 B per
call) is drawn at its block size with its own marker; 4 KiB runs with 64 iovs
per call. Needs matplotlib (pip install matplotlib).
"""
import argparse
import glob
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def newest_results():
    files = sorted(glob.glob(os.path.join(ROOT, "bench", "results", "tcp_vs_peers-*.jsonl")))
    if not files:
        sys.exit("plot_tcp.py: no bench/results/tcp_vs_peers-*.jsonl; run bench/tcp_vs_peers.sh first")
    return files[-1]


def size_label(b):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if b >= (1 << shift):
            v = b / (1 << shift)
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{b}B"


def print_markdown(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    run = next((r for r in rows if r.get("kind") == "run"), {})
    summ = [r for r in rows if r.get("kind") == "summary"]
    depths = [str(d) for d in run.get("ferry_depths", [1])]
    label = {"4KiBx64": "4 KiB × 64 iovs", "64KiB": "64 KiB", "1MiB": "1 MiB", "16MiB": "16 MiB",
             "kv": "KV: 298 × 1,179,648 B"}
    f = lambda v, p=3: "n/a" if v is None else f"{v:.{p}f}"
    have_mc = any(s.get("mooncake_gbps") for s in summ)
    hdr = ["workload"] + [f"Ferry d{d}" for d in depths] + ["iperf3"] + [f"d{d} / iperf3" for d in depths] \
        + ["UCX put_bw"] + [f"d{d} / UCX" for d in depths] \
        + (["Mooncake"] + [f"d{d} / Mooncake" for d in depths] if have_mc else [])
    print("| " + " | ".join(hdr) + " |")
    print("| " + " | ".join(["---"] + ["---:"] * (len(hdr) - 1)) + " |")
    for s in summ:
        fe = s["ferry"]
        cells = [label.get(s["name"], s["name"])] + [f(fe[d]["gbps"]) for d in depths] + [f(s["iperf3_gbps"])] \
            + [f(fe[d]["ratio_iperf3"], 2) for d in depths] + [f(s["ucx_gbps"])] + [f(fe[d]["ratio_ucx"], 2) for d in depths]
        if have_mc:
            cells += [f(s.get("mooncake_gbps"))] + [f(fe[d].get("ratio_mooncake"), 2) for d in depths]
        print("| " + " | ".join(cells) + " |")
    print()
    print("| workload | " + " | ".join(f"d{d} p50 / p99 µs" for d in depths) + " |")
    print("| --- | " + " | ".join("---:" for _ in depths) + " |")
    for s in summ:
        fe = s["ferry"]
        print(f"| {label.get(s['name'], s['name'])} | " +
              " | ".join(f"{f(fe[d]['p50_us'], 0)} / {f(fe[d]['p99_us'], 0)}" for d in depths) + " |")
    print()
    # every run, to show the spread
    meas = [r for r in rows if r.get("kind") == "measure" and r.get("system") in ("ferry", "iperf3", "ucx", "mooncake")]
    names = [s["name"] for s in summ]
    systems = [("ferry", int(d)) for d in depths] + [("iperf3", None), ("ucx", None)] \
        + ([("mooncake", None)] if have_mc else [])
    print("| workload | system | " + " | ".join(f"rep {i}" for i in range(1, run.get("reps", 3) + 1)) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in range(run.get("reps", 3))) + " |")
    for n in names:
        for sysname, d in systems:
            vals = sorted((r["rep"], r["gbps"]) for r in meas if r["name"] == n and r["system"] == sysname
                          and (d is None or r.get("depth") == d))
            nm = f"Ferry d{d}" if sysname == "ferry" else {"iperf3": "iperf3", "ucx": "UCX", "mooncake": "Mooncake"}[sysname]
            print(f"| {label.get(n, n)} | {nm} | " + " | ".join(f(v) for _, v in vals) + " |")
    print()
    for fl in (r for r in rows if r.get("kind") == "floor"):
        print(f"- **{fl['result']}** {fl['floor']}: {fl['detail']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", help="JSON lines from tcp_vs_peers.sh (default: newest)")
    ap.add_argument("-o", "--output", default=os.path.join(ROOT, "docs", "tcp_vs_peers.png"))
    ap.add_argument("--markdown", action="store_true", help="print the result tables as Markdown")
    ap.add_argument("--no-plot", action="store_true", help="only --markdown")
    args = ap.parse_args()
    path = args.results or newest_results()
    if args.markdown:
        print_markdown(path)
    if args.no_plot:
        return

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_tcp.py: matplotlib is missing (pip install matplotlib)")

    rows = [json.loads(line) for line in open(path) if line.strip()]
    run = next((r for r in rows if r.get("kind") == "run"), {})
    meas = [r for r in rows if r.get("kind") == "measure" and r.get("gbps") is not None
            and r.get("system") in ("ferry", "iperf3", "ucx", "mooncake")]
    if not meas:
        sys.exit(f"plot_tcp.py: no measurements in {path}")

    # series key -> {(name, block): [gbps...]}
    series = {}
    for r in meas:
        if r["system"] == "ferry":
            d = r.get("depth", 1)
            key = "Ferry, blocking calls (depth 1)" if d == 1 else f"Ferry, {d} calls in flight (depth {d})"
        elif r["system"] == "iperf3":
            key = "iperf3, 1 stream (-l = block, max 1 MiB)"
        elif r["system"] == "mooncake":
            key = "Mooncake Transfer Engine (PyPI, tcp), blocking"
        else:
            key = "UCX 1.13 ucp_put_bw, UCX_TLS=tcp"
        series.setdefault(key, {}).setdefault((r["name"], r["block_size"]), []).append(r["gbps"])

    style = {
        "Ferry": dict(color="#d62728", lw=2.2),
        "iperf3": dict(color="#1f77b4", lw=1.6, ls="--"),
        "UCX": dict(color="#2ca02c", lw=1.6, ls=":"),
        "Mooncake": dict(color="#9467bd", lw=1.6, ls="-."),
    }
    fig, ax = plt.subplots(figsize=(8.5, 5.2), dpi=120)
    ferry_shades = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2"]
    fi = 0
    for key in sorted(series, key=lambda k: (not k.startswith("Ferry"), "blocking" not in k, k)):
        pts = series[key]
        st = dict(next(v for k, v in style.items() if key.startswith(k)))
        if key.startswith("Ferry"):
            st["color"] = ferry_shades[fi % len(ferry_shades)]
            fi += 1
        sweep = sorted((b, v) for (n, b), v in pts.items() if n != "kv")
        xs = [b for b, _ in sweep]
        med = [statistics.median(v) for _, v in sweep]
        lo = [m - min(v) for m, (_, v) in zip(med, sweep)]
        hi = [max(v) - m for m, (_, v) in zip(med, sweep)]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=key, **st)
        kv = [(b, v) for (n, b), v in pts.items() if n == "kv"]
        for b, v in kv:
            ax.plot([b], [statistics.median(v)], marker="*", markersize=13, color=st["color"], ls="none")
            ax.annotate("KV", (b, statistics.median(v)), textcoords="offset points", xytext=(7, -3),
                        fontsize=7, color=st["color"])
    ax.plot([], [], marker="*", markersize=11, color="gray", ls="none",
            label="KV workload: 298 x 1,179,648 B per call")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({b for s in series.values() for (n, b) in s if n != "kv"})
    ax.set_xticks(ticks)
    ax.set_xticklabels([size_label(b) for b in ticks])
    ax.set_xlabel("block size (4 KiB: 64 blocks per call; others: 1 block per call)")
    ax.set_ylabel("GB/s (10^9 B/s of payload)")
    when = run.get("date", "")
    if len(when) == 16 and when[8] == "T":  # 20261122T162132Z
        when = f"{when[:4]}-{when[4:6]}-{when[6:8]} {when[9:11]}:{when[11:13]} UTC"
    cpu = run.get("cpu", "")
    ax.set_title(f"Loopback TCP, one-sided WRITE: Ferry vs iperf3, UCX, Mooncake\n"
                 f"{cpu}, {run.get('nproc', '?')} cores, {when}, median of {run.get('reps', '?')}",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    fig.savefig(args.output)
    print(f"plot_tcp.py: wrote {args.output} from {path}")


if __name__ == "__main__":
    main()
