#!/usr/bin/env bash
# One small-write cell of issue 13's floor, Ferry over fabric against the raw
# fi_write loop on the same provider: FERRY_BENCH_ROUNDS (15) alternating
# rounds raw | Ferry, 16 in flight, each cell started once the machine is
# idle (>= 90% idle CPU over 1 s, at most 60 s of waiting; a cell that had to
# start busy says so). Prints each round, the medians, the ratio of the
# medians and the median of the per-round ratios (the method of part 6 of
# bench/results/fabric_vs_raw_runs.txt).
#
# FERRY_BENCH_COMBINING=1 adds two cells per round: the raw loop with 4 blocks
# per fi_writemsg and 4 operations in flight (RAW_COMBINE=4: what Ferry's
# combining of small operations does, without Ferry), and Ferry with
# combining off (fabric.combine_after=0: one operation per call).
#
#   bench/fabric/small.sh [build dir, default build] [seconds per cell, default 2] [bytes, default 4096]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
SECS=${2:-2}
SIZE=${3:-4096}
ROUNDS=${FERRY_BENCH_ROUNDS:-15}
COMBINING=${FERRY_BENCH_COMBINING:-0}
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

ferry() {  # GB/s of Ferry over fabric, extra engine options as arguments
  "$BUILD/tools/ferry-bench" --spawn-local --op write -s "$SIZE" -d 16 --time "$SECS" \
    --json -q -o engine.transports=fabric,tcp -o "fabric.provider=$PROVIDER" "$@" |
    python3 -c "import sys, json; print(round(next(json.loads(l) for l in sys.stdin if l.startswith('{'))['gbps'], 3))"
}
echo "load: $(uptime)"
if [ "$COMBINING" = 1 ]; then
  echo "round raw_GBps ferry_GBps raw_4_per_op_GBps ferry_uncombined_GBps"
else
  echo "round raw_GBps ferry_GBps"
fi
for r in $(seq 1 "$ROUNDS"); do
  wait_idle
  raw=$("$OUT/raw_fi_write" "$PROVIDER" 16 "$SECS" delivery "$SIZE" | awk '/^size/{print $4}')
  wait_idle
  fer=$(ferry)
  if [ "$COMBINING" = 1 ]; then
    wait_idle
    raw4=$(RAW_COMBINE=4 "$OUT/raw_fi_write" "$PROVIDER" 4 "$SECS" delivery "$SIZE" | awk '/^size/{print $4}')
    wait_idle
    off=$(ferry -o fabric.combine_after=0)
    echo "$r $raw $fer $raw4 $off"
  else
    echo "$r $raw $fer"
  fi
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
if len(rows[0]) > 3:
    for name, col, ref, refname in (("raw, 4 blocks per op", 3, raw, "raw"),
                                    ("ferry, combining off", 4, raw, "raw"),
                                    ("ferry against raw 4 per op", 2, None, None)):
        vals = [float(r[col]) for r in rows]
        base = ref if ref is not None else [float(r[3]) for r in rows]
        print(f"{name:27s} median {statistics.median(vals):.3f}; ratio of medians "
              f"{statistics.median(vals) / statistics.median(base):.3f}; median per-round "
              f"{statistics.median(v / b for v, b in zip(vals, base)):.3f}")
PY
