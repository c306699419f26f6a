#!/usr/bin/env python3
"""docs/device_api.png from moe_bench.py's JSON lines: p50 microseconds per call
(stream timing) of dispatch, combine, NCCL all_to_all_single and torch
symm_mem all_to_all_vdev against tokens per GPU, log-log.

    python3 bench/device_api/plot.py bench/results/moe_*.jsonl [-o docs/device_api.png]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("-o", default="docs/device_api.png")
    ap.add_argument("--timing", default="stream")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.jsonl) if line.strip()]
    rows = [r for r in rows if r.get("bench") == "moe" and r.get("timing") == args.timing]
    worlds = sorted({r.get("world", 2) for r in rows})  # one panel per GPU count
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 4.5), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        mine = sorted((r for r in rows if r.get("world", 2) == world), key=lambda r: r["tokens"])
        tokens = [r["tokens"] for r in mine]
        for key, label, style in (("dispatch_p50_us", "Ferry dispatch", "o-"),
                                  ("combine_p50_us", "Ferry combine", "s-"),
                                  ("nccl_a2a_p50_us", "NCCL all_to_all_single", "^--"),
                                  ("symm_mem_a2a_p50_us", "torch symm_mem all_to_all_vdev", "v--")):
            ys = [r.get(key) for r in mine]
            if all(y is not None and y == y for y in ys):
                ax.plot(tokens, ys, style, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens per GPU (bf16, hidden 7,168, top-8, 8 experts per GPU)")
        ax.set_ylabel("p50 microseconds per call")
        gpu = mine[0]["gpu"] if mine else ""
        ax.set_title(f"MoE dispatch/combine vs all-to-all, {world} x {gpu} ({args.timing} timing)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.o, dpi=110)
    print(args.o)


if __name__ == "__main__":
    main()
