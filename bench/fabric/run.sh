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
python3 - "$OUT" "$ROUNDS" "$ROOT/bench/fabric" <<'PY'
import sys
out, rounds = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, sys.argv[3])
from rounds import SIZES, cell, ferry, load, raw, ratio
runs = load(out, rounds, {"raw": (raw, "raw.{r}.txt"), "raw_tx": (raw, "raw_tx.{r}.txt"),
                          "fabric": (ferry, "fabric.{r}.json"), "tcp": (ferry, "tcp.{r}.json")})
print(f"medians of {rounds} alternating rounds (each round's value in brackets), GB/s")
print("| block | raw fi_write (delivery) | raw fi_write (transmit) | Ferry fabric | Ferry tcp | fabric/raw (delivery) | fabric/raw (transmit) | fabric/tcp |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for size, label in SIZES:
    print(f"| {label} | {cell(runs, 'raw', size)} | {cell(runs, 'raw_tx', size)} | "
          f"{cell(runs, 'fabric', size)} | {cell(runs, 'tcp', size)} | {ratio(runs, 'fabric', 'raw', size)} | "
          f"{ratio(runs, 'fabric', 'raw_tx', size)} | {ratio(runs, 'fabric', 'tcp', size)} |")
PY
rm -rf "$OUT"
