#!/usr/bin/env bash
# One small-write cell of issue 13's floor, Ferry over fabric against the raw
# fi_write loop on the same provider: FERRY_BENCH_ROUNDS (15) alternating
# rounds raw | Ferry, 16 in flight, each cell started once the machine is
# idle (>= 90% idle CPU over 1 s, at most 60 s of waiting; a cell that had to
# start busy says so). Prints each round, the medians, the ratio of the
# medians and the median of the per-round ratios (the method of part 6 of
# bench/results/fabric_vs_raw_runs.txt).
#
#   bench/fabric/small.sh [build dir, default build] [seconds per cell, default 2] [bytes, default 4096]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
SECS=${2:-2}
SIZE=${3:-4096}
ROUNDS=${FERRY_BENCH_ROUNDS:-15}
PROVIDER=${FERRY_FABRIC_PROVIDER:-tcp;ofi_rxm}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
g++ -O2 -std=c++20 "$ROOT/bench/fabric/raw_fi_write.cc" -o "$OUT/raw_fi_write" -lfabric

idle_pct() {  # percent of CPU time idle over the next second
  local a b
  a=($(head -1 /proc/stat))
  sleep 1
  b=($(head -1 /proc/stat))
  local idle=$(((b[4] + b[5]) - (a[4] + a[5])))
  local total=0 i
  for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
  echo $((100 * idle / (total > 0 ? total : 1)))
}
wait_idle() {
  local t
  for t in $(seq 60); do
    [ "$(idle_pct)" -ge 90 ] && return 0
  done
  echo "busy" >&2
  return 0
}

echo "load: $(uptime)"
echo "round raw_GBps ferry_GBps"
for r in $(seq 1 "$ROUNDS"); do
  wait_idle
  raw=$("$OUT/raw_fi_write" "$PROVIDER" 16 "$SECS" delivery "$SIZE" | awk '/^size/{print $4}')
  wait_idle
  ferry=$("$BUILD/tools/ferry-bench" --spawn-local --op write -s "$SIZE" -d 16 --time "$SECS" \
    --json -q -o engine.transports=fabric,tcp -o "fabric.provider=$PROVIDER" |
    python3 -c "import sys, json; print(round(next(json.loads(l) for l in sys.stdin if l.startswith('{'))['gbps'], 3))")
  echo "$r $raw $ferry"
done | tee "$OUT/rounds.txt"
echo "load: $(uptime)"
python3 - "$OUT/rounds.txt" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l[0].isdigit()]
raw = [float(r[1]) for r in rows]
fer = [float(r[2]) for r in rows]
mr, mf = statistics.median(raw), statistics.median(fer)
print("raw   " + " ".join(f"{v:.3f}" for v in raw) + f"  median {mr:.3f}")
print("ferry " + " ".join(f"{v:.3f}" for v in fer) + f"  median {mf:.3f}")
print(f"ratio of medians {mf / mr:.3f}; median of the per-round ratios "
      f"{statistics.median(f / r for f, r in zip(fer, raw)):.3f}; Ferry ahead in "
      f"{sum(f >= r for f, r in zip(fer, raw))} of {len(rows)}")
PY
