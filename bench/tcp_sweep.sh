#!/usr/bin/env bash
# Block-size sweep over loopback tcp: Ferry WRITE and READ at batch 1 and batch
# 128 (iovs per call), blocking calls, beside iperf3 (one stream, -l = the
# block size, at most 1 MiB) run right before each size: the kernel's TCP
# limit for that write size. One invocation, sizes in turn.
#
#   bench/tcp_sweep.sh                     # 4 KiB ... 64 MiB, about 4 minutes on 2 cores
#   bench/tcp_sweep.sh --sizes 4KiB,1MiB --time 1
#
# Options: --sizes LIST (default 4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB),
# --batches "1 128", --time SECONDS per Ferry run (default 1.5), --reps N (default 3: the
# table shows medians; all sizes once per repetition), --no-build,
# --build-dir DIR. Larger-than-1-GiB calls wrap around ferry-bench's 1 GiB
# buffers (--max-buffer). Results: bench/results/tcp_sweep-DATE.jsonl, and a
# markdown table on stdout (GB/s = 10^9 B/s of payload).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
SIZES="4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"
BATCHES="1 128"
TIME=1.5
REPS=3
DO_BUILD=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sizes) SIZES="$2"; shift 2 ;;
    --batches) BATCHES="$2"; shift 2 ;;
    --time) TIME="$2"; shift 2 ;;
    --reps) REPS="$2"; shift 2 ;;
    --no-build) DO_BUILD=0; shift ;;
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "tcp_sweep.sh: unknown argument '$1' (see --help)" >&2; exit 1 ;;
  esac
done
log() { echo "[tcp_sweep] $*" >&2; }

if ! command -v iperf3 >/dev/null 2>&1; then
  log "installing iperf3"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq iperf3 >/dev/null
fi
BENCH="$BUILD_DIR/tools/ferry-bench"
if [[ $DO_BUILD -eq 1 ]]; then
  [[ -f "$BUILD_DIR/build.ninja" ]] ||
    cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  ninja -C "$BUILD_DIR" -j"${JOBS:-2}" ferry-bench >/dev/null
fi
[[ -x "$BENCH" ]] || { echo "tcp_sweep.sh: $BENCH not found" >&2; exit 1; }

mkdir -p "$ROOT/bench/results"
OUT="$ROOT/bench/results/tcp_sweep-$(date -u +%Y%m%dT%H%M%SZ).jsonl"
echo "{\"kind\":\"run\",\"date\":\"$(date -u +%FT%TZ)\",\"nproc\":$(nproc),\"time_s\":$TIME,\"batches\":\"$BATCHES\",\"reps\":$REPS}" >"$OUT"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
iperf() {  # bytes -> GB/s on stdout (empty on failure)
  local len=$1 port
  ((len > 1048576)) && len=1048576
  port=$(free_port)
  timeout 30 iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  local spid=$!
  for _ in $(seq 50); do ss -Hltn "sport = :$port" 2>/dev/null | grep -q . && break; sleep 0.05; done
  timeout 30 iperf3 -c 127.0.0.1 -p "$port" -t 2 -l "$len" -J 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/8e9)' || true
  wait "$spid" 2>/dev/null || true
}
bytes_of() { python3 -c "import re,sys; m=re.fullmatch(r'(\d+)(KiB|MiB|GiB)?','$1'); print(int(m[1])*{None:1,'KiB':1024,'MiB':1<<20,'GiB':1<<30}[m[2]])"; }

for rep in $(seq "$REPS"); do
for size in ${SIZES//,/ }; do
  b=$(bytes_of "$size")
  g=$(iperf "$b")
  [[ -n "$g" ]] && echo "{\"kind\":\"measure\",\"system\":\"iperf3\",\"block_size\":$b,\"gbps\":$g,\"rep\":$rep}" >>"$OUT"
  log "rep $rep, $size: iperf3 ${g:-n/a} GB/s"
  for batch in $BATCHES; do
    "$BENCH" --spawn-local --op write,read -s "$size" -b "$batch" --time "$TIME" --json -q 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    d=json.loads(l); d["kind"]="measure"; d["rep"]=int(sys.argv[1]); print(json.dumps(d))' "$rep" >>"$OUT" ||
      log "ferry-bench failed at $size x $batch"
  done
done
done

python3 - "$OUT" "$BATCHES" <<'PY'
import json, statistics, sys
from collections import defaultdict
rows = [json.loads(l) for l in open(sys.argv[1])]
batches = [int(b) for b in sys.argv[2].split()]
runs = defaultdict(list)
for r in rows:
    if r.get("system") == "iperf3":
        runs[r["block_size"]].append(r["gbps"])
    elif r.get("system") == "ferry":
        runs[(r["block_size"], r["batch"], r["op"])].append(r["gbps"])
iperf = {k: statistics.median(v) for k, v in runs.items() if not isinstance(k, tuple)}
ferry = {k: {"gbps": statistics.median(v)} for k, v in runs.items() if isinstance(k, tuple)}
def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
head = ["block", "iperf3 (-l ≤ 1 MiB)"]
for b in batches:
    head += [f"write ×{b}", f"read ×{b}", f"write ×{b} / iperf3"]
print("| " + " | ".join(head) + " |")
print("| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |")
for bs in sorted(iperf.keys() | {k[0] for k in ferry}):
    cells = [size(bs), f"{iperf[bs]:.3f}" if bs in iperf else "n/a"]
    for b in batches:
        w, r = ferry.get((bs, b, "write")), ferry.get((bs, b, "read"))
        cells += [f"{w['gbps']:.3f}" if w else "n/a", f"{r['gbps']:.3f}" if r else "n/a",
                  f"{w['gbps'] / iperf[bs]:.2f}" if w and bs in iperf else "n/a"]
    print("| " + " | ".join(cells) + " |")
print(f"\n(medians over repetitions; raw: {sys.argv[1]})")
PY
