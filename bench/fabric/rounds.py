"""Reading the rounds of bench/fabric/run.sh and ab.sh: each round leaves one
raw_fi_write output (lines 'size N GB/s X') and ferry-bench --json outputs;
cells are the median over rounds, with each round's value beside it."""
import json
import re
import statistics

SIZES = [(4096, "4 KiB"), (65536, "64 KiB"), (1 << 20, "1 MiB"), (16 << 20, "16 MiB")]


def raw(path):
    """GB/s per block size from a raw_fi_write output."""
    d = {}
    for line in open(path):
        m = re.match(r"size (\d+) GB/s ([\d.]+)", line)
        if m:
            d[int(m.group(1))] = float(m.group(2))
    return d


def ferry(path):
    """GB/s per block size from a ferry-bench --json output."""
    d = {}
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            j = json.loads(line)
            d[j["block_size"]] = j["gbps"]
    return d


def load(out, rounds, kinds):
    """{kind: [per-round dict]}: kinds maps a name to (reader, file name with {r} for the round)."""
    return {k: [reader(f"{out}/" + name.format(r=r)) for r in range(1, rounds + 1)]
            for k, (reader, name) in kinds.items()}


def median(runs, kind, size):
    return statistics.median(run.get(size, 0.0) for run in runs[kind])


def each(runs, kind, size):
    return "/".join(f"{run.get(size, 0.0):.2f}" for run in runs[kind])


def cell(runs, kind, size):
    return f"{median(runs, kind, size):.2f} [{each(runs, kind, size)}]"


def ratio(runs, a, b, size):
    return f"{median(runs, a, size) / max(median(runs, b, size), 1e-9):.2f}"
