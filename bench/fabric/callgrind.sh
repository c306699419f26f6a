#!/usr/bin/env bash
# User-space instructions per call of a small fabric write on the initiator
# thread: callgrind with --toggle-collect on Engine::write_async and
# Engine::wait (libfabric's work inside them included), the target running
# natively. Deterministic enough to compare builds where wall-clock rounds on
# a shared 2-core machine are not (bench/results/fabric_vs_raw_runs.txt).
#
#   bench/fabric/callgrind.sh [build dir, default build] [calls, default 20000] [size, default 4KiB]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
CALLS=${2:-20000}
SIZE=${3:-4KiB}
WARMUP=2000
PROVIDER=${FERRY_FABRIC_PROVIDER:-tcp;ofi_rxm}
OUT=$(mktemp -d)
trap 'kill "${TARGET_PID:-}" 2>/dev/null || true; rm -rf "$OUT"' EXIT
opts=(-o "engine.transports=fabric,tcp" -o "fabric.provider=$PROVIDER")
"$BUILD/tools/ferry-bench" --role target --forever --listen 127.0.0.1:0 \
  --info-file "$OUT/t.info" --buffer-size 16MiB -q "${opts[@]}" >/dev/null </dev/null &
TARGET_PID=$!
for _ in $(seq 100); do [ -s "$OUT/t.info" ] && break; sleep 0.1; done
valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.out" \
  --toggle-collect='ferry::Engine::write_async*' --toggle-collect='ferry::Engine::wait*' \
  "$BUILD/tools/ferry-bench" --role initiator --peer "$OUT/t.info" --op write -s "$SIZE" -d 16 \
  -n "$CALLS" -w "$WARMUP" --timeout 600 -q "${opts[@]}" >/dev/null 2>"$OUT/vg.log"
callgrind_annotate --inclusive=yes --auto=no "$OUT/cg.out" >"$OUT/annotate.txt" 2>/dev/null
callgrind_annotate --inclusive=yes --auto=no --tree=caller "$OUT/cg.out" >"$OUT/callers.txt" 2>/dev/null
python3 - "$OUT/annotate.txt" $((CALLS + WARMUP)) "$OUT/callers.txt" <<'PY'
import re, sys
text, calls = open(sys.argv[1]).read(), int(sys.argv[2])
# wait's share moves with how many completions the waiter handles (the rest
# are the progress thread's, not counted): say how many.
callers = open(sys.argv[3]).read()
polled = sum(int(m.group(1).replace(",", "")) for m in re.finditer(
    r"<[^\n]*FabricTransport::progress\(ferry::Transfer const&\) \(([\d,]+)x\)[^\n]*\n(?=(?:[^\n]*<[^\n]*\n)*[^\n]*\*[^\n]*FabricTransport::on_completion)", callers))
def ir(pattern):
    for line in text.splitlines():
        if re.search(pattern, line):
            return int(line.split()[0].replace(",", ""))
    return 0
total = ir(r"PROGRAM TOTALS")
w, wt = ir(r"ferry::Engine::write_async\("), ir(r"ferry::Engine::wait\(")
print(f"{calls} calls: {total / calls:,.0f} instructions per call "
      f"(write_async {w / calls:,.0f}, wait {wt / calls:,.0f}; "
      f"{polled:,} completions handled by the waiter)")
PY
if [ -n "${CALLGRIND_KEEP:-}" ]; then cp "$OUT/cg.out" "$OUT/annotate.txt" "$CALLGRIND_KEEP"/; fi
