#!/usr/bin/env bash
# Small GPU transfers over tcp (docs/gpu.md), modes compared in one run on a
# GPU machine, alternating (MODES, default "kernel on"):
#   off     inline staging copies off (FERRY_TCP_GPU_INLINE_BYTES=0: every
#           copy through the submit and watcher threads, the GPU path before them)
#   kernel  inline copies, a lone one on the copy kernel (FERRY_TCP_GPU_INLINE_ENGINE=0)
#   nospin  I/O threads never busy-poll (FERRY_TCP_BUSY_POLL_US=0)
#   bp200   I/O threads busy-poll 200 us after an event (the auto window before 500)
#   wait    every inline copy waited for by its caller, none handed to the
#           watcher when copies come close together (FERRY_TCP_GPU_HANDOFF_US=0)
#   query   copy streams ordered after the default stream by a query per copy
#           rather than as blocking streams (FERRY_COPY_AFTER_DEFAULT=query)
#   whole   GPU transfers striped over the streams only from 512 KiB shares, as
#           host memory (FERRY_TCP_GPU_MIN_STRIPE_BYTES=512KiB; default 32 KiB)
#   on      the defaults (a lone inline copy on the copy engine)
# The target is a second process, on GPU 1 where there are two.
#   1. the stage trace of blocking and 8-in-flight transfers, 4/64/256 KiB,
#      every memory pair: p50 per stage, host memory beside GPU memory;
#   2. throughput with 8 in flight, 4/64/256 KiB (GPU / host ratio);
#   3. large transfers (16 x 1 MiB, 16 MiB): not slower.
# Output: $OUT/tcp_small_{trace,tput}_MODE.txt and a summary on stdout.
#   BUILD=build-dev [MODES="off on"] [REPS=2] [TRACE_REPS=1] [TPUT_ITERS=2000]
#     [TPUT_ARGS=--cpu] [SIZES="4096 65536 262144"] [LARGE=1] bench/tcp_small_gpu.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
O=${OUT:-/tmp/out}
B=${BUILD:-build-dev}
BIN=$B/tests/gpu/ferry-tcp-gpu-bench
mkdir -p "$O"
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
dev=0
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && dev=1
export FERRY_TEST_PEER_DEVICE=$dev
MODES=${MODES:-kernel on}
mode() {
  case $1 in
    off) echo "FERRY_TCP_GPU_INLINE_BYTES=0" ;;
    kernel) echo "FERRY_TCP_GPU_INLINE_ENGINE=0" ;;
    nospin) echo "FERRY_TCP_BUSY_POLL_US=0" ;;
    bp200) echo "FERRY_TCP_BUSY_POLL_US=200" ;;
    wait) echo "FERRY_TCP_GPU_HANDOFF_US=0" ;;
    query) echo "FERRY_COPY_AFTER_DEFAULT=query" ;;
    whole) echo "FERRY_TCP_GPU_MIN_STRIPE_BYTES=512KiB" ;;
    *) echo "FERRY_TCP_GPU_INLINE_ENGINE=1" ;;
  esac
}
echo "target process on GPU $dev; modes: $MODES"
# TRACE_REPS (default 1) repetitions of the trace, modes alternating; the
# first repetition writes tcp_small_trace_MODE.txt, later ones _MODE_REP.txt.
for rep in $(seq 1 "${TRACE_REPS:-1}"); do
  for m in $MODES; do
    f="$O/tcp_small_trace_$m.txt"
    [ "$rep" -gt 1 ] && f="$O/tcp_small_trace_${m}_$rep.txt"
    # shellcheck disable=SC2046
    env $(mode $m) timeout 150 "$BIN" --trace --two-process --json --iters ${TRACE_ITERS:-300} \
      > "$f" 2>&1 || echo "trace $m rc=$?"
  done
done
SUMMARY='
import json, os, sys
for line in sys.stdin:
    r = json.loads(line)
    t = r["total_us"]
    print("  %-3s %-5s %4s->%-4s %7d B depth %d: p50 %7.1f  p90 %7.1f"
          % (os.environ["M"], r["op"], r["local"], r["remote"], r["block_size"], r["depth"], t["p50"], t["p90"]))'
echo "blocking and 8 in flight, p50 us (posted -> completed):"
for rep in $(seq 1 "${TRACE_REPS:-1}"); do
  for m in $MODES; do
    f="$O/tcp_small_trace_$m.txt"
    [ "$rep" -gt 1 ] && f="$O/tcp_small_trace_${m}_$rep.txt"
    [ "${TRACE_REPS:-1}" -gt 1 ] && echo " repetition $rep"
    grep '^{' "$f" | M=$m python3 -c "$SUMMARY"
  done
done
for rep in $(seq 1 "${REPS:-2}"); do
  for m in $MODES; do
    for s in ${SIZES:-4096 65536 262144}; do
      echo "=== $m rep $rep: --block $s --batch 1 --depth 8" >> "$O/tcp_small_tput_$m.txt"
      # shellcheck disable=SC2046
      env $(mode $m) timeout 60 "$BIN" --two-process --block $s --batch 1 --depth 8 \
        --iters ${TPUT_ITERS:-2000} --reps 1 ${TPUT_ARGS:-} \
        >> "$O/tcp_small_tput_$m.txt" 2>&1
    done
    [ "${LARGE:-1}" = 0 ] && continue
    for args in "--block 1048576 --batch 16" "--block 16777216 --batch 1"; do
      echo "=== $m rep $rep: $args" >> "$O/tcp_small_tput_$m.txt"
      # shellcheck disable=SC2046,SC2086
      env $(mode $m) timeout 60 "$BIN" --two-process $args --reps 1 >> "$O/tcp_small_tput_$m.txt" 2>&1
    done
  done
done
for m in $MODES; do echo "--- throughput, mode $m"; grep -E "^===|^(write|read)" "$O/tcp_small_tput_$m.txt"; done
