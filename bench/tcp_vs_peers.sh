#!/usr/bin/env bash
# Ferry (tcp) against the kernel's TCP limit (iperf3, one stream, loopback) and
# UCX (ucx_perftest -t ucp_put_bw, UCX_TLS=tcp) on the same machine, in one run.
#
#   bench/tcp_vs_peers.sh              # full run (about 8-10 minutes on 2 cores)
#   bench/tcp_vs_peers.sh -r 1 --quick # smoke run (about 2 minutes)
#
# Per repetition and per workload the three systems run back to back
# (alternating), R repetitions (default 3); the table shows medians. Workloads:
# 4KiB x batch 64, 64KiB, 1MiB, 16MiB (batch 1) and the KV-cache shape (298
# blocks of 1,179,648 B per call). iperf3 runs with -l equal to the block size,
# UCX with -s equal to the block size. Ferry runs `ferry-bench --spawn-local
# --op write` (a target child process and the initiator, over loopback tcp).
#
# Also measured: the host-side cost of posting one 100,000 x 4 KiB write batch
# (us per iov), VmRSS of an idle engine and over 10^6 completed 4 KiB writes,
# qperf tcp_bw/tcp_lat for orientation. Floors are checked and printed
# PASS/FAIL (issue 2, item 8). Results: bench/results/tcp_vs_peers-DATE.jsonl
# (raw runs, medians, floors); plot them with bench/plot_tcp.py.
#
# Options:
#   -r, --reps N        repetitions (default 3; env REPS)
#   --quick             shorter runs, 10^5 transfers for the RSS check
#   --no-build          use the existing build/tools/ferry-bench
#   --build-dir DIR     build directory (default build; env BUILD_DIR)
#   --ferry-args "..."  extra ferry-bench arguments for the throughput runs
#                       (e.g. "--depth 4" or "--streams 4"); recorded in the output
#   --depths "1 8"      ferry-bench --depth values to run (env FERRY_DEPTHS)
#   --skip-rss, --skip-post-cost, --skip-peers (iperf3/UCX), --skip-qperf,
#   --skip-mooncake     (Mooncake Transfer Engine from PyPI, installed into
#                        BUILD_DIR/peers-venv on first use; informational, no floor)
# Exit status: 0 when it ran (floors may FAIL: see the table), 1 when it could
# not run, 2 with --strict when a floor failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPS="${REPS:-3}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
QUICK=0
DO_BUILD=1
DO_RSS=1
DO_POST=1
DO_PEERS=1
DO_QPERF=1
DO_MOONCAKE=1
STRICT=0
FERRY_ARGS="${FERRY_ARGS:-}"
# Ferry runs twice per workload: blocking calls (depth 1: write() returns when
# the target acknowledged; a call's latency bounds its bandwidth) and pipelined
# (depth 8 write_async() calls in flight, as put_bw and iperf3 keep data in flight).
FERRY_DEPTHS="${FERRY_DEPTHS:-1 8}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    -r|--reps) REPS="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --no-build) DO_BUILD=0; shift ;;
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --ferry-args) FERRY_ARGS="$2"; shift 2 ;;
    --depths) FERRY_DEPTHS="$2"; shift 2 ;;
    --skip-rss) DO_RSS=0; shift ;;
    --skip-post-cost) DO_POST=0; shift ;;
    --skip-peers) DO_PEERS=0; shift ;;
    --skip-qperf) DO_QPERF=0; shift ;;
    --skip-mooncake) DO_MOONCAKE=0; shift ;;
    --strict) STRICT=1; shift ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "tcp_vs_peers.sh: unknown argument '$1' (see --help)" >&2; exit 1 ;;
  esac
done

log() { echo "[tcp_vs_peers] $*" >&2; }

# --- tools -----------------------------------------------------------------
need_pkgs=()
command -v iperf3 >/dev/null 2>&1 || need_pkgs+=(iperf3)
command -v ucx_perftest >/dev/null 2>&1 || need_pkgs+=(ucx-utils)
command -v qperf >/dev/null 2>&1 || need_pkgs+=(qperf)
command -v python3 >/dev/null 2>&1 || need_pkgs+=(python3)
if [[ $DO_BUILD -eq 1 ]]; then
  command -v cmake >/dev/null 2>&1 || need_pkgs+=(cmake)
  command -v ninja >/dev/null 2>&1 || need_pkgs+=(ninja-build)
  [[ -f /usr/include/CLI/CLI.hpp ]] || need_pkgs+=(libcli11-dev)
  [[ -f /usr/include/nlohmann/json.hpp ]] || need_pkgs+=(nlohmann-json3-dev)
fi
if [[ ${#need_pkgs[@]} -gt 0 ]]; then
  log "installing missing packages: ${need_pkgs[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

# --- build -----------------------------------------------------------------
BENCH="$BUILD_DIR/tools/ferry-bench"
if [[ $DO_BUILD -eq 1 ]]; then
  if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
    log "configuring $BUILD_DIR (Release)"
    cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  fi
  log "building ferry-bench"
  ninja -C "$BUILD_DIR" -j"${JOBS:-2}" ferry-bench >/dev/null
fi
[[ -x "$BENCH" ]] || { echo "tcp_vs_peers.sh: $BENCH not found (build failed?)" >&2; exit 1; }

# --- run parameters ----------------------------------------------------------
if [[ $QUICK -eq 1 ]]; then
  T_SEC=1; FERRY_TIME=1; RSS_N=100000; UCX_BYTES=400000000; UCX_CAL_BYTES=40000000
else
  T_SEC=3; FERRY_TIME=2.5; RSS_N=1000000; UCX_BYTES=1200000000; UCX_CAL_BYTES=100000000
fi
POST_N=100000
# name block_bytes batch
WORKLOADS=(
  "4KiBx64 4096 64"
  "64KiB 65536 1"
  "1MiB 1048576 1"
  "16MiB 16777216 1"
  "kv 1179648 298"
)

DATE="$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$ROOT/bench/results"
OUT="$ROOT/bench/results/tcp_vs_peers-$DATE.jsonl"
TMP="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
wait_port() {  # port timeout_s: wait until something LISTENs on 127.0.0.1:port.
  # Never probe by connecting: iperf3 -s -1 and ucx_perftest take the first
  # connection as their one client.
  local i
  for ((i = 0; i < $2 * 20; i++)); do
    if command -v ss >/dev/null 2>&1; then
      [[ -n "$(ss -Hltn "sport = :$1" 2>/dev/null)" ]] && return 0
    else
      python3 -c "import sys; p='%04X' % $1; sys.exit(0 if any(l.split()[1].endswith(':'+p) and l.split()[3]=='0A' for l in list(open('/proc/net/tcp'))[1:]+list(open('/proc/net/tcp6'))[1:]) else 1)" && return 0
    fi
    sleep 0.05
  done
  return 1
}
emit() { echo "$1" >>"$OUT"; }
reap() {  # pid: let a one-shot server exit by itself, else stop it
  local i
  for ((i = 0; i < 50; i++)); do
    kill -0 "$1" 2>/dev/null || { wait "$1" 2>/dev/null || true; return 0; }
    sleep 0.1
  done
  kill "$1" 2>/dev/null || true
  sleep 0.2
  kill -9 "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

emit "$(python3 - "$DATE" "$REPS" "$QUICK" "$FERRY_ARGS" "$FERRY_DEPTHS" <<'PY'
import json, os, platform, subprocess, sys
model = ""
try:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
except OSError:
    pass
print(json.dumps({"kind": "run", "date": sys.argv[1], "reps": int(sys.argv[2]), "quick": sys.argv[3] == "1",
                  "ferry_args": sys.argv[4], "ferry_depths": [int(x) for x in sys.argv[5].split()], "nproc": os.cpu_count(), "cpu": model,
                  "kernel": platform.release()}))
PY
)"

# --- one measurement per system (each prints GB/s or empty on failure) -------
run_ferry() {  # name block batch rep depth
  local name=$1 block=$2 batch=$3 rep=$4 depth=$5 line
  # shellcheck disable=SC2086
  if line=$("$BENCH" --spawn-local --op write --json -q --verify -s "$block" -b "$batch" --time "$FERRY_TIME" \
      --depth "$depth" $FERRY_ARGS 2>"$TMP/ferry.err" | tail -n 1) && [[ -n "$line" ]]; then
    emit "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(kind="measure", system="ferry", name=sys.argv[2], rep=int(sys.argv[3])); print(json.dumps(d))' "$line" "$name" "$rep")"
    python3 -c 'import json,sys; print(json.loads(sys.argv[1])["gbps"])' "$line"
  else
    log "ferry-bench failed for $name: $(tail -n 3 "$TMP/ferry.err" | tr '\n' ' ')"
    emit "{\"kind\":\"error\",\"system\":\"ferry\",\"name\":\"$name\",\"rep\":$rep,\"error\":$(python3 -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read()[-2000:]))' "$TMP/ferry.err")}"
  fi
}

run_iperf3() {  # name block rep
  local name=$1 block=$2 rep=$3 port gbps len
  # iperf3 refuses -l above 1 MiB ("block size too large (maximum = 1048576
  # bytes)"): larger workloads are compared with its largest write size.
  len=$block
  ((len > 1048576)) && len=1048576
  port=$(free_port)
  timeout 60 iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  local spid=$!
  PIDS+=("$spid")
  wait_port "$port" 5 || { log "iperf3 server did not start"; return; }
  if iperf3 -c 127.0.0.1 -p "$port" -t "$T_SEC" -l "$len" -J >"$TMP/iperf.json" 2>/dev/null; then
    gbps=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["end"]["sum_received"]["bits_per_second"]/8/1e9)' "$TMP/iperf.json")
    emit "{\"kind\":\"measure\",\"system\":\"iperf3\",\"name\":\"$name\",\"block_size\":$block,\"rep\":$rep,\"gbps\":$gbps,\"iperf3_l\":$len,\"args\":\"-t $T_SEC -l $len\"}"
    echo "$gbps"
  else
    log "iperf3 failed for $name"
  fi
  reap "$spid"
}

declare -A UCX_N=()
run_ucx() {  # name block rep [iterations]: prints GB/s
  local name=$1 block=$2 rep=$3 port n w mbps gbps
  port=$(free_port)
  n=${4:-${UCX_N[$name]:-$((UCX_BYTES / block))}}
  ((n < 20)) && n=20
  w=$((n / 10)); ((w < 5)) && w=5
  UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 200 ucx_perftest -p "$port" >"$TMP/ucx_srv.txt" 2>&1 &
  local spid=$!
  PIDS+=("$spid")
  wait_port "$port" 10 || { log "ucx_perftest server did not start"; return; }
  if UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t ucp_put_bw \
      -s "$block" -n "$n" -w "$w" -f >"$TMP/ucx.txt" 2>&1; then
    # Final line: iters p50 avg overall | bw avg, bw overall (MB/s = 2^20 B/s) | msg rates
    mbps=$(awk 'NF==8 && $1 ~ /^[0-9]+$/ {v=$6} END {print v}' "$TMP/ucx.txt")
    if [[ -n "$mbps" ]]; then
      gbps=$(python3 -c "print($mbps*1048576/1e9)")
      [[ $rep -gt 0 ]] && emit "{\"kind\":\"measure\",\"system\":\"ucx\",\"name\":\"$name\",\"block_size\":$block,\"rep\":$rep,\"gbps\":$gbps,\"mbps_2p20\":$mbps,\"args\":\"-t ucp_put_bw -s $block -n $n -w $w\"}"
      echo "$gbps"
    else
      log "could not parse ucx_perftest output for $name: $(tail -n 2 "$TMP/ucx.txt")"
    fi
  else
    log "ucx_perftest failed for $name: $(tail -n 2 "$TMP/ucx.txt" | tr '\n' ' ')"
  fi
  reap "$spid"
}

# --- Mooncake Transfer Engine (PyPI mooncake-transfer-engine-non-cuda), tcp ------
# One target process for the whole run (P2PHANDSHAKE metadata, no etcd), one
# initiator process per measurement calling batch_transfer_sync_write (blocking,
# like Ferry d1) in a loop for about FERRY_TIME seconds.
MC_REASON=""
MC_PY="$BUILD_DIR/peers-venv/bin/python"
MC_SEGMENT=""
MC_TARGET_PID=""
setup_mooncake() {
  if ! "$MC_PY" -c "import mooncake.engine" 2>/dev/null; then
    log "installing mooncake-transfer-engine-non-cuda into $BUILD_DIR/peers-venv"
    python3 -m venv "$BUILD_DIR/peers-venv" >/dev/null 2>&1 &&
      "$BUILD_DIR/peers-venv/bin/pip" install -q mooncake-transfer-engine-non-cuda >"$TMP/mc_pip.txt" 2>&1 ||
      { MC_REASON="pip install mooncake-transfer-engine-non-cuda failed: $(tail -n 1 "$TMP/mc_pip.txt")"; return 1; }
    "$MC_PY" -c "import mooncake.engine" 2>"$TMP/mc_imp.txt" ||
      { MC_REASON="import mooncake.engine failed: $(tail -n 1 "$TMP/mc_imp.txt")"; return 1; }
  fi
  cat >"$TMP/mc.py" <<'MCPY'
import ctypes, json, mmap, sys, time
from mooncake.engine import TransferEngine

def engine():
    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit("mooncake: initialize failed")
    return e

def buf(n):
    m = mmap.mmap(-1, n)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))

if sys.argv[1] == "target":
    size = int(sys.argv[2])
    e = engine()
    m, addr = buf(size)
    if e.register_memory(addr, size) != 0:
        sys.exit("mooncake: register_memory failed")
    print(json.dumps({"segment": f"127.0.0.1:{e.get_rpc_port()}", "addr": addr, "size": size}), flush=True)
    sys.stdin.read()
    sys.exit(0)
info = json.loads(open(sys.argv[2]).read())
block, batch, secs = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
size = block * batch
e = engine()
m, addr = buf(size)
m.write(bytes(range(256)) * (size // 256))
if e.register_memory(addr, size) != 0:
    sys.exit("mooncake: register_memory failed")
srcs = [addr + i * block for i in range(batch)]
dsts = [info["addr"] + i * block for i in range(batch)]
lens = [block] * batch
seg = info["segment"]
def call():
    rc = e.batch_transfer_sync_write(seg, srcs, dsts, lens)
    if rc != 0:
        sys.exit(f"mooncake: batch_transfer_sync_write returned {rc}")
t0 = time.perf_counter()
n = 0
while n < 2 or time.perf_counter() - t0 < 0.3:
    call(); n += 1
lat = []
t0 = time.perf_counter()
while len(lat) < 3 or time.perf_counter() - t0 < secs:
    a = time.perf_counter(); call(); lat.append(time.perf_counter() - a)
el = time.perf_counter() - t0
lat.sort()
print(json.dumps({"gbps": len(lat) * size / el / 1e9, "iters": len(lat), "block_size": block, "batch": batch,
                  "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6}))
MCPY
  # Region for the largest workload (KV: 298 x 1,179,648 B).
  mkfifo "$TMP/mc_in"
  "$MC_PY" "$TMP/mc.py" target 352321536 <"$TMP/mc_in" >"$TMP/mc_target.json" 2>"$TMP/mc_target.err" &
  MC_TARGET_PID=$!
  PIDS+=("$MC_TARGET_PID")
  exec {MC_IN}>"$TMP/mc_in"  # keeps the target's stdin open until the script ends
  local i
  for ((i = 0; i < 200; i++)); do
    [[ -s "$TMP/mc_target.json" ]] && break
    kill -0 "$MC_TARGET_PID" 2>/dev/null || break
    sleep 0.1
  done
  [[ -s "$TMP/mc_target.json" ]] || { MC_REASON="mooncake target did not start: $(tail -n 1 "$TMP/mc_target.err")"; return 1; }
  return 0
}

run_mooncake() {  # name block batch rep
  local name=$1 block=$2 batch=$3 rep=$4 line
  if line=$(timeout 120 "$MC_PY" "$TMP/mc.py" initiator "$TMP/mc_target.json" "$block" "$batch" "$FERRY_TIME" \
      2>"$TMP/mc.err" | tail -n 1) && [[ -n "$line" ]]; then
    emit "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(kind="measure", system="mooncake", name=sys.argv[2], rep=int(sys.argv[3])); print(json.dumps(d))' "$line" "$name" "$rep")"
    python3 -c 'import json,sys; print(json.loads(sys.argv[1])["gbps"])' "$line"
  else
    log "mooncake failed for $name: $(grep -v '^I' "$TMP/mc.err" | tail -n 2 | tr '\n' ' ')"
  fi
}

run_one() {  # system name block batch rep [depth]
  local v="" label=$1
  case $1 in
    ferry) v=$(run_ferry "$2" "$3" "$4" "$5" "$6"); label="ferry depth $6" ;;
    iperf3) [[ $DO_PEERS -eq 1 ]] && v=$(run_iperf3 "$2" "$3" "$5") ;;
    ucx) [[ $DO_PEERS -eq 1 ]] && v=$(run_ucx "$2" "$3" "$5") ;;
    mooncake) [[ $DO_MOONCAKE -eq 1 ]] && v=$(run_mooncake "$2" "$3" "$4" "$5") ;;
  esac
  log "rep $5/$REPS $2 $label: ${v:-n/a} GB/s"
}

# --- throughput, alternating ---------------------------------------------------
start=$(date +%s)
log "results -> $OUT"
if [[ $DO_PEERS -eq 1 ]]; then
  # ucx_perftest has no time limit: size -n from a short calibration run so each
  # measured run takes about T_SEC seconds (UCX over tcp varies 20x across sizes).
  for wl in "${WORKLOADS[@]}"; do
    read -r name block batch <<<"$wl"
    v=$(run_ucx "$name" "$block" 0 $((UCX_CAL_BYTES / block)))
    if [[ -n "$v" ]]; then
      UCX_N[$name]=$(python3 -c "print(max(20, int($v * 1e9 * $T_SEC / $block)))")
    fi
    log "UCX calibration $name: ${v:-n/a} GB/s -> -n ${UCX_N[$name]:-default}"
  done
fi
if [[ $DO_MOONCAKE -eq 1 ]]; then
  setup_mooncake || { log "mooncake not run: $MC_REASON"; DO_MOONCAKE=0; }
else
  MC_REASON="skipped (--skip-mooncake)"
fi
for ((rep = 1; rep <= REPS; rep++)); do
  for wl in "${WORKLOADS[@]}"; do
    read -r name block batch <<<"$wl"
    # rotate the order each repetition so no system always runs first
    order=(ferry iperf3 ucx mooncake)
    ((rep % 3 == 2)) && order=(iperf3 ucx mooncake ferry)
    ((rep % 3 == 0)) && order=(ucx mooncake ferry iperf3)
    for sys in "${order[@]}"; do
      [[ $sys == ferry ]] || { run_one "$sys" "$name" "$block" "$batch" "$rep"; continue; }
      for d in $FERRY_DEPTHS; do run_one ferry "$name" "$block" "$batch" "$rep" "$d"; done
    done
  done
done


# --- qperf, for orientation ---------------------------------------------------------
if [[ $DO_QPERF -eq 1 ]]; then
  port=$(free_port)
  qperf -lp "$port" >/dev/null 2>&1 &
  QPID=$!
  PIDS+=("$QPID")
  if wait_port "$port" 5; then
    for ((rep = 1; rep <= REPS; rep++)); do
      if qperf -lp "$port" -t "$T_SEC" -m 1M 127.0.0.1 tcp_bw >"$TMP/qbw.txt" 2>&1 &&
         qperf -lp "$port" -t "$T_SEC" -m 64 127.0.0.1 tcp_lat >"$TMP/qlat.txt" 2>&1; then
        emit "$(python3 - "$TMP/qbw.txt" "$TMP/qlat.txt" "$rep" <<'PY'
import json, re, sys
units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
bw = re.search(r"bw\s*=\s*([\d.]+)\s*([KMG]?B)/sec", open(sys.argv[1]).read())
lat = re.search(r"latency\s*=\s*([\d.]+)\s*(ns|us|ms)", open(sys.argv[2]).read())
d = {"kind": "measure", "system": "qperf", "name": "qperf", "rep": int(sys.argv[3])}
if bw: d["tcp_bw_1MiB_gbps"] = float(bw.group(1)) * units[bw.group(2)] / 1e9
if lat: d["tcp_lat_64B_us"] = float(lat.group(1)) * {"ns": 1e-3, "us": 1, "ms": 1e3}[lat.group(2)]
print(json.dumps(d))
PY
)"
      else
        log "qperf failed: $(tail -n 2 "$TMP/qbw.txt" "$TMP/qlat.txt" | tr '\n' ' ')"
      fi
    done
  else
    log "qperf server did not start"
  fi
  kill "$QPID" 2>/dev/null || true
fi

# --- post cost and memory -------------------------------------------------------------
if [[ $DO_POST -eq 1 ]]; then
  log "post cost: one write_async of $POST_N x 4 KiB"
  if line=$("$BENCH" --spawn-local --json -q --post-cost "$POST_N" 2>"$TMP/post.err" | tail -n 1) && [[ -n "$line" ]]; then
    emit "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(kind="post_cost"); print(json.dumps(d))' "$line")"
  else
    log "post-cost run failed: $(tail -n 3 "$TMP/post.err" | tr '\n' ' ')"
    emit "{\"kind\":\"error\",\"system\":\"ferry\",\"name\":\"post_cost\",\"error\":$(python3 -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read()[-2000:]))' "$TMP/post.err")}"
  fi
fi
if [[ $DO_RSS -eq 1 ]]; then
  log "RSS: idle engine and over $RSS_N completed 4 KiB writes"
  if line=$("$BENCH" --spawn-local --json -q --rss --rss-transfers "$RSS_N" --depth 16 2>"$TMP/rss.err" | tail -n 1) && [[ -n "$line" ]]; then
    emit "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(kind="rss"); print(json.dumps(d))' "$line")"
  else
    log "rss run failed: $(tail -n 3 "$TMP/rss.err" | tr '\n' ' ')"
    emit "{\"kind\":\"error\",\"system\":\"ferry\",\"name\":\"rss\",\"error\":$(python3 -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read()[-2000:]))' "$TMP/rss.err")}"
  fi
fi

# --- PyPI peer engines -------------------------------------------------------------------
if [[ -n "$MC_TARGET_PID" ]]; then
  exec {MC_IN}>&- 2>/dev/null || true
  reap "$MC_TARGET_PID"
fi
if [[ $DO_MOONCAKE -eq 0 ]]; then
  emit "$(python3 -c 'import json,sys; print(json.dumps({"kind":"not_run","system":"mooncake","what":"Mooncake Transfer Engine (tcp)","reason":sys.argv[1]}))' "$MC_REASON")"
fi
emit '{"kind":"not_run","system":"nixl","what":"NIXL (UCX backend)","reason":"not tried: the PyPI nixl packages are built for CUDA machines and need a Python driver for the agent API and metadata exchange; UCX ucp_put_bw (the transport under NIXL UCX backend) stands in for it"}'
emit '{"kind":"not_run","system":"uccl","what":"UCCL P2P","reason":"not tried: GPU/RDMA-oriented package, this machine has neither"}'

elapsed=$(($(date +%s) - start))
emit "{\"kind\":\"elapsed\",\"seconds\":$elapsed}"

# --- summary ------------------------------------------------------------------------------
set +e
python3 - "$OUT" <<'PY'
import json, statistics, sys

path = sys.argv[1]
rows = [json.loads(l) for l in open(path) if l.strip()]
run = next((r for r in rows if r.get("kind") == "run"), {})
depths = run.get("ferry_depths") or sorted({r.get("depth", 1) for r in rows if r.get("system") == "ferry" and r.get("kind") == "measure"})
order = ["4KiBx64", "64KiB", "1MiB", "16MiB", "kv"]
label = {"4KiBx64": "4KiB x64", "64KiB": "64KiB", "1MiB": "1MiB", "16MiB": "16MiB", "kv": "KV 298x1152KiB"}

def med(system, name, key="gbps", depth=None):
    v = [r[key] for r in rows if r.get("kind") == "measure" and r.get("system") == system
         and r.get("name") == name and r.get(key) is not None
         and (depth is None or r.get("depth", 1) == depth)]
    return (statistics.median(v), len(v)) if v else (None, 0)

def f(v, fmt="{:.3f}"):
    return fmt.format(v) if v is not None else "n/a"

def ratio(a, b):
    return a / b if a and b else None

summary = []
print()
print("Ferry (tcp, ferry-bench --spawn-local --op write, d = calls in flight) vs iperf3 (1 stream,")
print("-l = block, at most 1 MiB) vs UCX put_bw (UCX_TLS=tcp, -s = block); loopback; GB/s = 10^9 B/s")
print("of payload; median of each system's runs; Mooncake (MC) = Transfer Engine tcp, blocking batch writes")
cols = "".join(f"{'Ferry d'+str(d):>10}" for d in depths)
rcols = "".join(f"{'/iperf3 d'+str(d):>11}" for d in depths)
ucols = "".join(f"{'/UCX d'+str(d):>9}" for d in depths)
have_mc = any(r.get("system") == "mooncake" and r.get("kind") == "measure" for r in rows)
mcols = "".join(f"{'/MC d'+str(d):>8}" for d in depths) if have_mc else ""
hdr = f"{'workload':<15}{cols}{'iperf3':>9}{rcols}{'UCX':>8}{ucols}" + (f"{'Mooncake':>9}{mcols}" if have_mc else "")
print(hdr)
print("-" * len(hdr))
for name in order:
    ig, _ = med("iperf3", name)
    ug, _ = med("ucx", name)
    line = f"{label[name]:<15}"
    mg, _ = med("mooncake", name)
    s = {"kind": "summary", "name": name, "iperf3_gbps": ig, "ucx_gbps": ug, "mooncake_gbps": mg, "ferry": {}}
    for d in depths:
        fg, n = med("ferry", name, depth=d)
        p50, _ = med("ferry", name, "p50_us", d)
        p99, _ = med("ferry", name, "p99_us", d)
        s["ferry"][str(d)] = {"gbps": fg, "p50_us": p50, "p99_us": p99, "runs": n,
                              "ratio_iperf3": ratio(fg, ig), "ratio_ucx": ratio(fg, ug),
                              "ratio_mooncake": ratio(fg, mg)}
        line += f"{f(fg):>10}"
    line += f"{f(ig):>9}"
    for d in depths:
        line += f"{f(s['ferry'][str(d)]['ratio_iperf3'], '{:.2f}'):>11}"
    line += f"{f(ug):>8}"
    for d in depths:
        line += f"{f(s['ferry'][str(d)]['ratio_ucx'], '{:.2f}'):>9}"
    if have_mc:
        line += f"{f(mg):>9}"
        for d in depths:
            line += f"{f(s['ferry'][str(d)]['ratio_mooncake'], '{:.2f}'):>8}"
    summary.append(s)
    print(line)
print()
print("Ferry latency per call (median of runs' p50 / p99, us):")
for name in order:
    parts = []
    for d in depths:
        x = summary[order.index(name)]["ferry"][str(d)]
        parts.append(f"d{d} {f(x['p50_us'], '{:.0f}')} / {f(x['p99_us'], '{:.0f}')}")
    print(f"  {label[name]:<15} " + "   ".join(parts))

q = [r for r in rows if r.get("system") == "qperf"]
if q:
    bw = statistics.median([r["tcp_bw_1MiB_gbps"] for r in q if "tcp_bw_1MiB_gbps" in r] or [0])
    lat = statistics.median([r["tcp_lat_64B_us"] for r in q if "tcp_lat_64B_us" in r] or [0])
    print(f"qperf (orientation): tcp_bw 1MiB {bw:.3f} GB/s, tcp_lat 64B {lat:.1f} us")

floors = []
def floor(name, ok, detail):
    floors.append({"kind": "floor", "floor": name,
                   "result": "PASS" if ok else ("FAIL" if ok is not None else "N/A"), "detail": detail})

one = summary[order.index("1MiB")]
for d in depths:
    x = one["ferry"][str(d)]
    nm = f"[d{d}] Ferry 1MiB >= 0.85 x iperf3 -l 1M"
    if x["gbps"] and one["iperf3_gbps"]:
        floor(nm, x["ratio_iperf3"] >= 0.85, f"{x['gbps']:.3f} vs {one['iperf3_gbps']:.3f} GB/s = {x['ratio_iperf3']:.2f}x")
    else:
        floor(nm, None, "missing measurement")
for d in depths:
    for s in summary:
        x = s["ferry"][str(d)]
        nm = f"[d{d}] Ferry >= 2 x UCX put_bw at {label[s['name']]}"
        if x["gbps"] and s["ucx_gbps"]:
            floor(nm, x["ratio_ucx"] >= 2.0, f"{x['gbps']:.3f} vs {s['ucx_gbps']:.3f} GB/s = {x['ratio_ucx']:.2f}x")
        else:
            floor(nm, None, "missing measurement")

post = next((r for r in rows if r.get("kind") == "post_cost"), None)
rss = next((r for r in rows if r.get("kind") == "rss"), None)
print()
if post:
    print(f"post cost: one write_async of {post['batch']} x 4KiB: {post['post_us']:.0f} us inside the call = "
          f"{post['post_us_per_iov']:.3f} us/iov (aim < 1); post to completion {post['total_us']:.0f} us = "
          f"{post['total_us_per_iov']:.3f} us/iov, {post['gbps']:.3f} GB/s")
    floor("post cost < 1 us/iov (aim)", post["post_us_per_iov"] < 1.0, f"{post['post_us_per_iov']:.3f} us/iov")
else:
    print("post cost: not measured")
if rss:
    mib = lambda k: rss[k] / 1024 if rss.get(k, -1) >= 0 else None
    print(f"RSS (MiB): idle engine: target {f(mib('target_idle_kib'), '{:.1f}')}, initiator {f(mib('initiator_idle_kib'), '{:.1f}')}"
          f" (initiator process before its engine: {f(mib('initiator_start_kib'), '{:.1f}')})")
    ti, ii = rss["target_after_kib"] - rss["target_before_kib"], rss["initiator_after_kib"] - rss["initiator_before_kib"]
    print(f"RSS over {rss['transfers']} completed 4KiB writes, depth {rss['depth']} ({rss['transfers_per_s']:.0f}/s): "
          f"target {rss['target_before_kib']/1024:.1f} -> {rss['target_after_kib']/1024:.1f} MiB ({ti:+d} KiB), "
          f"initiator {rss['initiator_before_kib']/1024:.1f} -> {rss['initiator_after_kib']/1024:.1f} MiB ({ii:+d} KiB)")
    idle = max(rss["target_idle_kib"], rss["initiator_idle_kib"])
    floor("idle engine RSS < 50 MiB", idle < 50 * 1024, f"max(target, initiator) = {idle/1024:.1f} MiB")
    # "Not growing": the baseline is taken after 10^4 warm-up writes (pools and
    # touched buffers in place); allow 2 MiB of allocator noise.
    grow = max(ti, ii)
    floor(f"RSS not growing over {rss['transfers']} transfers (<= 2 MiB)", grow <= 2048, f"max growth {grow:+d} KiB")
else:
    print("RSS: not measured")
    floor("idle engine RSS < 50 MiB", None, "not measured")
    floor("RSS not growing over 10^6 transfers", None, "not measured")

print()
for fl in floors:
    print(f"  {fl['result']:<4}  {fl['floor']}: {fl['detail']}")
for r in rows:
    if r.get("kind") == "not_run":
        print(f"  not run: {r['system']} ({r['what']}): {r['reason']}")
for e in (r for r in rows if r.get("kind") == "error"):
    msg = e["error"].strip().splitlines()
    print(f"  ERROR {e['system']} {e['name']}: {msg[-1] if msg else '?'}")
el = next((r["seconds"] for r in rows if r.get("kind") == "elapsed"), None)
if el is not None:
    print(f"  ({el} s; raw results {path})")

with open(path, "a") as out:
    for s in summary:
        out.write(json.dumps(s) + "\n")
    for fl in floors:
        out.write(json.dumps(fl) + "\n")
sys.exit(1 if any(fl["result"] == "FAIL" for fl in floors) else 0)
PY
rc=$?
set -e
if [[ $rc -ne 0 && $STRICT -eq 1 ]]; then exit 2; fi
exit 0
