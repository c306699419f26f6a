#!/usr/bin/env bash
# The stage trace on a GPU machine (docs/trace.md), in one go: builds only what
# it needs (bench/device/build.sh, with the Debian packages carried in
# .devcarry/root), runs the trace tests -- unit, two-process host
# memory, and the GPU variant -- then prints the breakdown of the issue's
# small-transfer workloads (GPU->GPU, host->GPU, GPU->host, host->host; write
# and read; 4, 64, 256 KiB; blocking and 8 in flight; target in a second
# process). Output in $OUT (or ./out): trace_tests.log, trace_breakdown.txt
# (table and one JSON line per workload).
#   bench/tcp_trace_device.sh [extra ferry-tcp-gpu-bench arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export BUILD=${BUILD:-build-dev}
B=$BUILD
# The Debian packages carried in .devcarry/root (bench/device/prepare.sh), only what the trace needs.
TARGETS="stage_trace_test trace_order_test ferry_test_peer ferry_tcp_gpu_memory_test ferry_tcp_gpu_peer ferry-tcp-gpu-bench" \
  bench/device/build.sh > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A5 "$OUT/build.log" | head -60; exit 1; }
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/trace_tests.log"
rc=0
{
  $B/tests/unit/stage_trace_test || rc=1
  $B/tests/trace/trace_order_test || rc=1
  $B/tests/gpu/ferry_tcp_gpu_memory_test --gtest_filter='TcpGpuTraced.*' || rc=1
} 2>&1 | tee -a "$OUT/trace_tests.log" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|skipped" | head -40
grep -q "FAILED" "$OUT/trace_tests.log" && rc=1
$B/tests/gpu/ferry-tcp-gpu-bench --trace --two-process --json "$@" 2>&1 |
  tee "$OUT/trace_breakdown.txt" | grep -v '^{'
exit $rc
