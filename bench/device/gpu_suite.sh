#!/usr/bin/env bash
# On the GPU device machine, in one command: build everything (tests, tools,
# the Python module) with bench/device/build.sh, run every GPU test (ctest
# -R '^gpu\.': one GPU serves both processes, and gpu.two_gpus.* puts the
# target process on GPU 1), then the tcp stage-trace breakdown of small GPU
# transfers with the target on the second GPU where there is one. Results in
# $OUT: machine.txt, build.txt, gpu_tests.txt, trace_breakdown.txt.
#   run(command="bench/device/gpu_suite.sh", carry=[".devcarry/root"], kind="nvidia-h200-x2")
# The tests run 4 at a time (CTEST_JOBS, default 4): races that show only
# under load -- another process's copies on the same GPU, every CPU busy --
# are caught here rather than by the user (a read's landing copy ran before
# the caller's cudaMemset of its destination only under -j4; docs/reliability.md).
# SKIP_TRACE=1 leaves out the breakdown; CTEST_ARGS adds ctest arguments.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
O=${OUT:-/tmp/out}
mkdir -p "$O"
t0=$SECONDS
# NVLink multicast stays off (the device machines' rule), for every process started here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{ nvidia-smi -L; nvidia-smi topo -m; uname -r; nproc; git log --oneline -1 2>/dev/null; } > "$O/machine.txt" 2>&1
cat "$O/machine.txt"
export BUILD=${BUILD:-build-dev}
bench/device/build.sh -DFERRY_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" \
  > "$O/build.txt" 2>&1 || { echo "BUILD FAILED"; grep -E "error|FAILED" -A3 "$O/build.txt" | head -60; exit 1; }
echo "built in $((SECONDS - t0)) s"
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
rc=0
# shellcheck disable=SC2086
ctest --test-dir "$BUILD" -R '^gpu\.' -j "${CTEST_JOBS:-4}" --timeout 300 --output-on-failure \
  ${CTEST_ARGS:-} > "$O/gpu_tests.txt" 2>&1 || rc=1
grep -E "tests passed|Failed|\*\*\*|Skipped" "$O/gpu_tests.txt" | grep -v "^ *[0-9]*/[0-9]* Test.*Passed" | tail -30
echo "tests done at $((SECONDS - t0)) s"
if [ -z "${SKIP_TRACE:-}" ]; then
  dev=0
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && dev=1
  FERRY_TEST_PEER_DEVICE=$dev timeout 240 "$BUILD/tests/gpu/ferry-tcp-gpu-bench" --trace --two-process --json \
    ${TRACE_ARGS:-} > "$O/trace_breakdown.txt" 2>&1 || rc=1
  echo "trace (target on GPU $dev): $(grep -c '^{' "$O/trace_breakdown.txt") workloads, done at $((SECONDS - t0)) s"
  grep -E "^(write|read)|total" "$O/trace_breakdown.txt" | paste - - | awk '{print $1,$2,$3,$4,$5,$6,$7,$(NF-2)}' | head -40
fi
exit $rc
