#!/usr/bin/env bash
# On the GPU device machine, in one command: the GPU tests of cancel() and of
# a read's order after the caller's default-stream work, run under load, as
# docs/reliability.md reports them.
#   1. builds the GPU tests (bench/device/build.sh);
#   2. runs the GPU suite (ctest -R '^gpu\.' -j4) SUITE_PASSES times in the
#      background: the load (other processes' copies on both GPUs, busy CPUs);
#   3. meanwhile gpu.two_gpus.TcpGpuCancel.* REPEAT times in a row (target on
#      GPU 1) and gpu.TcpGpuMemory.ReadLandsAfterWorkQueuedOnTheDefaultStream.
# BEFORE=<patch> also builds the tree with the patch reversed (the code before a
# fix: `git diff <base> -- src > fix.patch`, put in the shipped tree) and runs
# the same two tests from it beside the others, for comparison.
#   4. then tests/integration/cancel_stress_test (host memory, every CPU busy).
# Results in $OUT: build.txt, suite_N.txt, cancel.txt, read_order.txt,
# stress.txt (and *_before.txt).
#   run(command="cd .dev/NAME && ln -sfn ../../.devcarry .devcarry && \
#       BEFORE=fix.patch bench/device/cancel_under_load.sh", carry=[".dev/NAME", ".devcarry/root"],
#       kind="nvidia-h100-x2")
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
O=${OUT:-/tmp/out}
mkdir -p "$O"
t0=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi -L
TARGETS="ferry_gpu_api_test ferry_gpu_copy_test ferry_tcp_gpu_memory_test ferry_tcp_gpu_peer
  ferry_fabric_gpu_memory_test ferry_cuda_ipc_test ferry_cuda_ipc_peer cancel_stress_test
  ferry_test_peer"
B=${BUILD:-/tmp/b-cancel}
BB=/tmp/b-cancel-before
if [ -n "${BEFORE:-}" ]; then
  rm -rf /tmp/before && mkdir -p /tmp/before && cp -a . /tmp/before/ &&
    ln -sfn "$(readlink -f .devcarry)" /tmp/before/.devcarry
  (cd /tmp/before && (patch -s -p1 -R < "$BEFORE" || git apply -R "$BEFORE")) ||
    { echo "could not reverse $BEFORE"; exit 1; }
  (cd /tmp/before && BUILD=$BB TARGETS="ferry_tcp_gpu_memory_test ferry_tcp_gpu_peer" \
    bench/device/build.sh > "$O/build_before.txt" 2>&1) &
  before_build=$!
fi
BUILD=$B TARGETS=$TARGETS bench/device/build.sh > "$O/build.txt" 2>&1 ||
  { echo "BUILD FAILED"; grep -E "error|FAILED" -A3 "$O/build.txt" | head -40; exit 1; }
if [ -n "${BEFORE:-}" ]; then
  wait "$before_build" || { echo "BEFORE BUILD FAILED"; tail -20 "$O/build_before.txt"; exit 1; }
fi
echo "built in $((SECONDS - t0)) s"

# The load: the GPU suite, 4 tests at a time.
(
  for n in $(seq "${SUITE_PASSES:-2}"); do
    ctest --test-dir "$B" -R '^gpu\.' -j 4 --timeout 300 --output-on-failure > "$O/suite_$n.txt" 2>&1
    echo "suite pass $n: $(grep -E 'tests passed' "$O/suite_$n.txt") at $((SECONDS - t0)) s"
  done
) &
load=$!
sleep 3
run_tests() {  # build dir, file suffix
  FERRY_ENGINE_TRANSPORTS=tcp FERRY_TEST_PEER_DEVICE=1 "$1/tests/gpu/ferry_tcp_gpu_memory_test" \
    --gtest_filter='TcpGpuCancel.*' --gtest_repeat="${REPEAT:-20}" > "$O/cancel$2.txt" 2>&1
  echo "TcpGpuCancel (two GPUs) x${REPEAT:-20}$2: $(grep -c '^\[       OK' "$O/cancel$2.txt") passed," \
    "$(grep -c '^\[  FAILED  \] TcpGpuCancel.*ms)' "$O/cancel$2.txt") failed"
  FERRY_ENGINE_TRANSPORTS=tcp "$1/tests/gpu/ferry_tcp_gpu_memory_test" \
    --gtest_filter='TcpGpuMemory.ReadLandsAfterWorkQueuedOnTheDefaultStream' --gtest_repeat=3 \
    > "$O/read_order$2.txt" 2>&1
  echo "ReadLandsAfterWorkQueuedOnTheDefaultStream x3$2: $(grep -c '^\[       OK' "$O/read_order$2.txt") passed"
}
run_tests "$B" "" &
after=$!
if [ -n "${BEFORE:-}" ]; then run_tests "$BB" "_before"; fi
wait "$after"
wait "$load"
# Host memory over tcp with every CPU busy (tests/integration/cancel_stress_test.cc),
# after the GPU load: its spinning processes would slow the timed GPU tests.
FERRY_ENGINE_TRANSPORTS=tcp timeout 60 "$B/tests/integration/cancel_stress_test" > "$O/stress.txt" 2>&1
echo "cancel_stress_test: $(grep -E '^\[  (PASSED|FAILED) ' "$O/stress.txt" | head -1); $(grep -E 'rounds' "$O/stress.txt")"
grep -hE "Failed|\*\*\*Failed|Timeout" "$O"/suite_*.txt | grep -v "tests passed" | head -20
grep -h -B2 -A6 "Failure" "$O"/cancel*.txt "$O"/read_order*.txt 2>/dev/null | head -60
echo "done at $((SECONDS - t0)) s"
