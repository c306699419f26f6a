#!/usr/bin/env bash
# Before/after comparison of two Ferry builds over the fabric transport
# (tcp;ofi_rxm), with the raw fi_write loop (raw_fi_write.cc) as the ceiling:
# FERRY_BENCH_ROUNDS (5) alternating rounds of raw / before / after, writes of
# 4 KiB-16 MiB, 16 in flight, medians with each round's value in brackets.
# On 2 cores single runs of the 4 KiB cell vary by +-20%: compare medians.
#
#   bench/fabric/ab.sh BEFORE [AFTER, default build] [seconds per cell, default 2]
#
# BEFORE / AFTER: a build directory (tools/ferry-bench) or a directory holding
# a copied ferry-bench and its libferry.so.0.1 (run with LD_LIBRARY_PATH there).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BEFORE=${1:?usage: ab.sh BEFORE [AFTER] [seconds]}
AFTER=${2:-$ROOT/build}
SECS=${3:-2}
ROUNDS=${FERRY_BENCH_ROUNDS:-5}
PROVIDER=${FERRY_FABRIC_PROVIDER:-tcp;ofi_rxm}
OUT=$(mktemp -d)
g++ -O2 -std=c++20 "$ROOT/bench/fabric/raw_fi_write.cc" -o "$OUT/raw_fi_write" -lfabric
bench() {  # bench DIR ARGS...
  local dir=$1
  shift
  if [ -x "$dir/tools/ferry-bench" ]; then
    "$dir/tools/ferry-bench" "$@"
  else
    LD_LIBRARY_PATH="$dir" "$dir/ferry-bench" "$@"
  fi
}
echo "load: $(uptime)"
common=(--spawn-local --op write -s 4KiB,64KiB,1MiB,16MiB -d 16 --time "$SECS" --json -q
        -o engine.transports=fabric,tcp -o "fabric.provider=$PROVIDER")
for r in $(seq 1 "$ROUNDS"); do
  "$OUT/raw_fi_write" "$PROVIDER" 16 "$SECS" delivery >"$OUT/raw.$r.txt"
  bench "$BEFORE" "${common[@]}" >"$OUT/before.$r.json"
  bench "$AFTER" "${common[@]}" >"$OUT/after.$r.json"
  echo "round $r of $ROUNDS done"
done
python3 - "$OUT" "$ROUNDS" "$ROOT/bench/fabric" <<'PY'
import sys
out, rounds = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, sys.argv[3])
from rounds import SIZES, cell, ferry, load, raw, ratio
runs = load(out, rounds, {"raw": (raw, "raw.{r}.txt"), "before": (ferry, "before.{r}.json"),
                          "after": (ferry, "after.{r}.json")})
print(f"medians of {rounds} alternating rounds (each round's value in brackets), GB/s")
print("| block | raw fi_write (delivery) | Ferry before | Ferry after | before/raw | after/raw | after/before |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for size, label in SIZES:
    print(f"| {label} | {cell(runs, 'raw', size)} | {cell(runs, 'before', size)} | {cell(runs, 'after', size)} | "
          f"{ratio(runs, 'before', 'raw', size)} | {ratio(runs, 'after', 'raw', size)} | "
          f"{ratio(runs, 'after', 'before', size)} |")
PY
rm -rf "$OUT"
