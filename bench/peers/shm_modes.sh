#!/usr/bin/env bash
# Ferry's shm transport in its two modes on this host, with ferry-bench (no
# venv, no other engines): cross-memory attach (shm.mode=cma) against the
# shared-memory staging mode (shm.mode=staging), alternating per workload and
# repetition, every run's data verified. The workloads of bench/peers, plus
# scattered 4 KiB blocks (a gap after each, so no two merge into one copy).
#
#   bench/peers/shm_modes.sh [BUILD_DIR] [REPS] [SECS]    # defaults: build 3 2
#
# Prints one JSON line per run (ferry-bench --json plus "mode" and "rep") and
# a table of medians; ferry-bench lives in BUILD_DIR/tools.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-$ROOT/build}"
REPS="${2:-3}"
SECS="${3:-2}"
BENCH="$BUILD/tools/ferry-bench"
[[ -x "$BENCH" ]] || { echo "shm_modes.sh: no $BENCH (build Ferry first)" >&2; exit 1; }

# name | ferry-bench workload flags
WORKLOADS=(
  "4KiB x 64|-s 4KiB -b 64"
  "4KiB x 64 scattered|-s 4KiB -b 64 --stride 8KiB"
  "64KiB x 8|-s 64KiB -b 8"
  "1MiB x 8|-s 1MiB -b 8"
  "KV 298 x 1179648|-s kv"
)
MODES=(cma staging)
OUT="$(mktemp)"
trap 'rm -f "$OUT"' EXIT
for ((rep = 0; rep < REPS; rep++)); do
  for ((w = 0; w < ${#WORKLOADS[@]}; w++)); do
    name="${WORKLOADS[w]%%|*}"
    flags="${WORKLOADS[w]#*|}"
    order=("${MODES[@]}")
    (((rep + w) % 2 == 1)) && order=("${MODES[1]}" "${MODES[0]}")
    for mode in "${order[@]}"; do
      # shellcheck disable=SC2086
      "$BENCH" --spawn-local -q $flags -d 4 --op write,read --time "$SECS" --verify \
        -o "shm.mode=$mode" --json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    if l.startswith("{"):
        r = json.loads(l); r.update(mode=sys.argv[1], rep=int(sys.argv[2]), name=sys.argv[3]); print(json.dumps(r))' \
          "$mode" "$rep" "$name" | tee -a "$OUT"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
names = list(dict.fromkeys(r["name"] for r in rows))
bad = [r for r in rows if r.get("verify") != "ok"]
print(f"\nGB/s, medians of {max(r['rep'] for r in rows) + 1}; ferry-bench, 2 processes, 4 calls in flight")
print(f"{'workload':22} {'op':5} {'cma':>7} {'staging':>8} {'staging/cma':>12}")
for n in names:
    for op in ("write", "read"):
        m = {mode: statistics.median(r["gbps"] for r in rows
                                     if (r["name"], r["op"], r["mode"]) == (n, op, mode))
             for mode in ("cma", "staging")}
        print(f"{n:22} {op:5} {m['cma']:7.2f} {m['staging']:8.2f} {m['staging'] / m['cma']:12.2f}")
print("data checks: " + ("all ok" if not bad else f"{len(bad)} FAILED") + f" ({len(rows)} runs)")
sys.exit(1 if bad else 0)
PY
