"""Plot bench/peers results: GB/s per workload per engine, WRITE and READ side by side.

    python bench/peers/plot.py [RESULTS.jsonl] [-o docs/peers.png]

Without a file it takes the newest bench/results/peers-*.jsonl.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?")
    ap.add_argument("-o", "--out", default=str(ROOT / "docs/peers.png"))
    a = ap.parse_args()
    path = Path(a.results) if a.results else max((ROOT / "bench/results").glob("peers-*.jsonl"),
                                                  key=lambda p: p.stat().st_mtime)
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    run = next(r for r in rows if r["kind"] == "run")
    med = {(r["workload"], r["op"], r["engine"]): r["gbps"] for r in rows if r["kind"] == "median"}
    workloads = list(dict.fromkeys(w for w, _, _ in med))
    engines = [e for e in run["engines"] if any(k[2] == e for k in med)]

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    x = np.arange(len(workloads))
    width = 0.8 / max(1, len(engines))
    for ax, op in zip(axes, ("write", "read")):
        for i, e in enumerate(engines):
            v = [med.get((w, op, e), 0) for w in workloads]
            bars = ax.bar(x + (i - (len(engines) - 1) / 2) * width, v, width, label=e,
                          hatch="//" if e == "memcpy" else None, alpha=0.6 if e == "memcpy" else 1)
            ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
        ax.set_xticks(x, workloads)
        ax.set_title(f"one-sided {op.upper()}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s (10^9 B/s of payload)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Two processes on one host, host memory, {run['depth']} calls in flight, "
                 f"median of {run['reps']} ({run['nproc']} cores, {run['date']}, {run['commit']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out} from {path}")


if __name__ == "__main__":
    main()
