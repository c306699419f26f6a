#!/usr/bin/env bash
# On the GPU device machine (two GPUs), in one command: what each process
# seeing only its own GPU does (issue 26). Results in $OUT:
#   probe.txt      bench/cuda_ipc/invisible_gpu_probe.cu: what the driver allows
#                  (legacy IPC handle and cuMem POSIX descriptor of an invisible
#                  GPU's memory, copies both ways by copy engine and by kernel;
#                  then with the exporter in a child PID namespace, SKIP_PIDNS=1 not)
#   build.txt      Ferry with its tests and the Python module (bench/device/build.sh)
#   tests.txt      ctest: gpu.CudaIpc.*, gpu.two_gpus.CudaIpc.*, gpu.one_gpu_each.CudaIpc.*
#                  (this process CUDA_VISIBLE_DEVICES=0, the target =1), the GPU
#                  identity and codec tests
#   uccl/          UCCL's p2p/tests/test_gpu_index_mapping.py against ferry.compat.uccl
#                  (needs UCCL's p2p/ in .devcarry/uccl)
#   bench.txt ...  bench/cuda_ipc/bench.py through device_run.sh: contiguous copy,
#                  Ferry and NIXL with both GPUs visible and with one GPU each
#
#   run(command="bench/cuda_ipc/one_gpu_each_run.sh", kind="nvidia-h100-x2",
#       carry=[".devcarry/root", ".devcarry/wheels-nixl", ".devcarry/uccl"])
# SKIP_TESTS=1, SKIP_UCCL=1, SKIP_BENCH=1, SKIP_PIDNS=1 leave parts out; TESTS_REGEX
# replaces the ctest selection; BENCH_ARGS go to bench.py.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
O=${OUT:-/tmp/out}
mkdir -p "$O"
t0=$SECONDS
LIMIT=${DEVICE_LIMIT_S:-590}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{ nvidia-smi -L; nvidia-smi topo -m; uname -r; nproc; git log --oneline -1 2>/dev/null; } > "$O/machine.txt" 2>&1
cat "$O/machine.txt"
rc=0

# --- 1. the probe, on its own (nvcc only), while Ferry builds ------------------------------
(nvcc -std=c++17 -O2 -arch=sm_90 -o /tmp/ferry-invisible-gpu-probe bench/cuda_ipc/invisible_gpu_probe.cu \
   -lcuda > "$O/probe.txt" 2>&1 && /tmp/ferry-invisible-gpu-probe 0 1 >> "$O/probe.txt" 2>&1 &&
   /tmp/ferry-invisible-gpu-probe 1 0 >> "$O/probe.txt" 2>&1 &&
   { [ -n "${SKIP_PIDNS:-}" ] || /tmp/ferry-invisible-gpu-probe 0 1 pidns >> "$O/probe.txt" 2>&1; }) &
probe=$!

# --- 2. Ferry ---------------------------------------------------------------------------------
export BUILD=${BUILD:-/tmp/b-gpuvis}
TARGETS="ferry_cuda_ipc_test ferry_cuda_ipc_peer ferry_gpu_copy_test codec_test cuda_ipc_wire_test ferry_python_devtree" \
  bench/device/build.sh -DFERRY_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" \
  > "$O/build.txt" 2>&1 || { echo "BUILD FAILED"; grep -E "error|FAILED" -A3 "$O/build.txt" | head -60; rc=1; }
echo "built in $((SECONDS - t0)) s"
wait $probe || rc=1
grep PROBE "$O/probe.txt" || tail -20 "$O/probe.txt"
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
[ $rc -eq 0 ] || exit $rc

# --- 3. tests ---------------------------------------------------------------------------------
if [ -z "${SKIP_TESTS:-}" ]; then
  ctest --test-dir "$BUILD" -j2 --timeout 300 --output-on-failure \
    -R "${TESTS_REGEX:-^gpu\.(two_gpus\.|one_gpu_each\.)?CudaIpc\.|GpusAreNamed|DescriptorCodec|DescriptorFields|CudaIpcAddress|GpuNames}" \
    > "$O/tests.txt" 2>&1 || rc=1
  grep -E "tests passed|Failed|\*\*\*|Skipped|Not Run" "$O/tests.txt" | tail -30
  grep -cE "Test +#.*one_gpu_each.*Passed" "$O/tests.txt" | sed 's/^/gpu.one_gpu_each tests passed: /'
  echo "tests done at $((SECONDS - t0)) s"
fi
# The one-GPU-each suite once more, verbose: ctest counts a test gtest skipped as passed.
if [ -z "${SKIP_TESTS:-}" ] || [ -n "${ONE_GPU_EACH_TESTS:-}" ]; then
  CUDA_VISIBLE_DEVICES=0 FERRY_TEST_PEER_VISIBLE_DEVICES=1 "$BUILD/tests/gpu/ferry_cuda_ipc_test" \
    > "$O/one_gpu_each.txt" 2>&1 || rc=1
  grep -E "^\[ *(OK|FAILED|SKIPPED|PASSED) *\]" "$O/one_gpu_each.txt" | tail -40
  grep -m3 -iE "skipped:" "$O/one_gpu_each.txt"
  echo "one GPU each (gtest, verbose) done at $((SECONDS - t0)) s"
fi

# --- 4. UCCL's GPU identity test, unmodified ---------------------------------------------------
export FERRY_PYTHONPATH=$BUILD/python
if [ -z "${SKIP_UCCL:-}" ] && [ -d .devcarry/uccl/p2p ]; then
  PYTHONPATH=$FERRY_PYTHONPATH python3 -c "
import ferry, sys; sys.path.insert(0, 'tests/python')
print('ferry.gpus():', ferry.gpus())
import test_uccl_compat_local as t; t.test_metadata_names_the_gpu_by_pci_bus_id(); print('test_metadata_names_the_gpu_by_pci_bus_id passed')
" > "$O/python_identity.txt" 2>&1 || rc=1
  tail -3 "$O/python_identity.txt"
  UCCL_ONLY="test_gpu_index_mapping.py" UCCL_TIMEOUT=120 bench/uccl/run_uccl_scripts.sh .devcarry/uccl "$O/uccl" \
    > /dev/null 2>&1 || rc=1
  cat "$O/uccl/summary.txt"
  echo "uccl done at $((SECONDS - t0)) s"
fi

# --- 5. the benchmark -------------------------------------------------------------------------
if [ -z "${SKIP_BENCH:-}" ]; then
  DEVICE_LIMIT_S=$((LIMIT - (SECONDS - t0))) \
    BENCH_ARGS=${BENCH_ARGS:---engines Ferry,Ferry-1GPU,NIXL,NIXL-1GPU,copy --workloads g2g_kv128,g2g_4k,g2g_lat4k,g2g_read_kv128} \
    bench/cuda_ipc/device_run.sh || rc=1
fi
echo "total $((SECONDS - t0)) s, rc $rc"
exit $rc
