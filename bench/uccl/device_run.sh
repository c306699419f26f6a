#!/usr/bin/env bash
# On the GPU device machine: build Ferry's Python module and the cuda_ipc test,
# run the connect-by-address GPU tests, then UCCL's benchmark_uccl.py (default
# mode, --write-ipc, --read-ipc) through run_uccl_scripts.sh, each beside
# Ferry's own API on the same sizes. Everything goes to $OUT.
#
#   UCCL=path/to/uccl-tree BUILD=/tmp/b-x bench/uccl/device_run.sh
#   (carry .devcarry/root; UCCL: a tree holding UCCL's p2p/, read-only)
# Environment: SKIP_BUILD / SKIP_GTEST (set: a warm machine's earlier build and run),
#   UCCL_BENCH_ARGS (default "--sizes 4096,1048576,16777216"),
#   UCCL_MATCH (which runs, default the three one-block GPU modes),
#   GTEST_FILTER (default the cuda_ipc connect-by-address tests).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
O=${OUT:-/tmp/out}
mkdir -p "$O"
B=${BUILD:-build-dev}
t0=$SECONDS
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
{ nvidia-smi -L; nproc; python3 --version; } > "$O/machine.txt" 2>&1
cat "$O/machine.txt"
[ -n "${SKIP_BUILD:-}" ] || BUILD=$B TARGETS="ferry_python_devtree ferry_cuda_ipc_test ferry_cuda_ipc_peer" bench/device/build.sh \
  -DFERRY_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" > "$O/build.txt" 2>&1 ||
  { echo "BUILD FAILED"; tail -30 "$O/build.txt"; exit 1; }
echo "built in $((SECONDS - t0)) s"
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
if [ -z "${SKIP_GTEST:-}" ]; then
  "$B/tests/gpu/ferry_cuda_ipc_test" \
    --gtest_filter="${GTEST_FILTER:-CudaIpc.ConnectByAddress*:CudaIpc.ChosenForPeerGpuMemory}" \
    > "$O/gtest.txt" 2>&1
  echo "gtest exit $? ($((SECONDS - t0)) s)"
  grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) *\]|Failure|Expected|Which is" "$O/gtest.txt" | head -20
fi
case $B in /*) PYDIR=$B/python ;; *) PYDIR=$PWD/$B/python ;; esac
FERRY_PYTHONPATH=$PYDIR UCCL_TIMEOUT=${UCCL_TIMEOUT:-60} \
  UCCL_MATCH=${UCCL_MATCH:-'^benchmark_uccl.py (gpu|--write-ipc|--read-ipc)$'} \
  UCCL_BENCH_ARGS=${UCCL_BENCH_ARGS:---sizes 4096,1048576,16777216} \
  bench/uccl/run_uccl_scripts.sh "${UCCL:?set UCCL}" "$O/uccl" > /dev/null 2>&1
cat "$O/uccl/summary.txt"
echo "done in $((SECONDS - t0)) s"
