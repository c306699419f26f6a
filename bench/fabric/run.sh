#!/usr/bin/env bash
# Ferry over the fabric transport (tcp;ofi_rxm) against the provider's own
# ceiling (a raw fi_write loop, raw_fi_write.cc) and Ferry's tcp transport,
# one invocation: 4 KiB / 64 KiB / 1 MiB / 16 MiB writes, 16 in flight,
# FERRY_BENCH_ROUNDS (3) alternating rounds, medians in GB/s and ratios.
# Measure on a quiet machine (uptime load < 1.5).
#
#   bench/fabric/run.sh [build dir, default build] [seconds per cell, default 2]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
SECS=${2:-2}
PROVIDER=${FERRY_FABRIC_PROVIDER:-tcp;ofi_rxm}
OUT=$(mktemp -d)
g++ -O2 -std=c++20 "$ROOT/bench/fabric/raw_fi_write.cc" -o "$OUT/raw_fi_write" -lfabric
echo "load: $(uptime)"
ROUNDS=${FERRY_BENCH_ROUNDS:-3}
BENCH="$BUILD/tools/ferry-bench"
common=(--spawn-local --op write -s 4KiB,64KiB,1MiB,16MiB -d 16 --time "$SECS" --json -q)
# Rounds alternate the four runs, so a slow spell of the machine hits them all;
# the table shows each cell's median.
for r in $(seq 1 "$ROUNDS"); do
  "$OUT/raw_fi_write" "$PROVIDER" 16 "$SECS" delivery >"$OUT/raw.$r.txt"
  "$OUT/raw_fi_write" "$PROVIDER" 16 "$SECS" transmit >"$OUT/raw_tx.$r.txt"
  "$BENCH" "${common[@]}" -o engine.transports=fabric,tcp -o fabric.provider="$PROVIDER" >"$OUT/fabric.$r.json"
  "$BENCH" "${common[@]}" -o engine.transports=tcp >"$OUT/tcp.$r.json"
  echo "round $r of $ROUNDS done"
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, sys, re, statistics
out, rounds = sys.argv[1], int(sys.argv[2])
def raw(name):
    d = {}
    for line in open(name):
        m = re.match(r"size (\d+) GB/s ([\d.]+)", line)
        if m: d[int(m.group(1))] = float(m.group(2))
    return d
def ferry(name):
    d = {}
    for line in open(name):
        line = line.strip()
        if not line.startswith("{"): continue
        j = json.loads(line)
        d[j["block_size"]] = (j["gbps"], j.get("transport"))
    return d
runs = {k: [] for k in ("raw", "raw_tx", "fabric", "tcp")}
for r in range(1, rounds + 1):
    runs["raw"].append(raw(f"{out}/raw.{r}.txt"))
    runs["raw_tx"].append(raw(f"{out}/raw_tx.{r}.txt"))
    runs["fabric"].append({k: v[0] for k, v in ferry(f"{out}/fabric.{r}.json").items()})
    runs["tcp"].append({k: v[0] for k, v in ferry(f"{out}/tcp.{r}.json").items()})
def med(kind, size):
    return statistics.median(run.get(size, 0.0) for run in runs[kind])
def each(kind, size):
    return "/".join(f"{run.get(size, 0.0):.2f}" for run in runs[kind])
print(f"medians of {rounds} alternating rounds (each round's value in brackets), GB/s")
print("| block | raw fi_write (delivery) | raw fi_write (transmit) | Ferry fabric | Ferry tcp | fabric/raw (delivery) | fabric/raw (transmit) | fabric/tcp |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for size, label in [(4096, "4 KiB"), (65536, "64 KiB"), (1 << 20, "1 MiB"), (16 << 20, "16 MiB")]:
    r, rt, f, t = (med(k, size) for k in ("raw", "raw_tx", "fabric", "tcp"))
    print(f"| {label} | {r:.2f} [{each('raw', size)}] | {rt:.2f} [{each('raw_tx', size)}] | "
          f"{f:.2f} [{each('fabric', size)}] | {t:.2f} [{each('tcp', size)}] | "
          f"{f/max(r,1e-9):.2f} | {f/max(rt,1e-9):.2f} | {f/max(t,1e-9):.2f} |")
PY
rm -rf "$OUT"
