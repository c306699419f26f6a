#!/usr/bin/env bash
# On a 2- or 4-GPU device machine, in one command: build the symmetric-memory test,
# the device-API bench and the Python module; run the GPU tests (gpu.Symmetric*),
# the Python tests (tests/python/test_symmetric.py), ferry-device-api-bench
# (ping-pong, put bandwidth vs the copy engine) and moe_bench.py (dispatch /
# combine vs NCCL all_to_all_single and torch symm_mem all_to_all_vdev).
# Logs and JSON lines go to $OUT (default /tmp/out). RUN_API_BENCH=0 / RUN_MOE_BENCH=0 / RUN_PYTEST=0
# leave those steps out; ITERS sets moe_bench's calls per size.
#   run(kind="nvidia-h100-x2", carry=[".dev/devapi", ".devcarry/root"],
#       command="cd .dev/devapi && ln -sfn ../../.devcarry .devcarry && bench/device_api/run.sh")
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
O=${OUT:-/tmp/out}
mkdir -p "$O"
B=${BUILD:-/tmp/b-devapi}
PY=$(command -v "${PYTHON:-python3}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
t0=$SECONDS
{ nvidia-smi -L; nvidia-smi topo -m; git log --oneline -1 2>/dev/null; echo "python $PY";
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } \
  > "$O/machine.txt" 2>&1
cat "$O/machine.txt"
BUILD=$B TARGETS="ferry_symmetric_test ferry-device-api-bench ferry_python_devtree" \
  bench/device/build.sh -DFERRY_BUILD_PYTHON=ON -DFERRY_BUILD_TOOLS=OFF -DPython_EXECUTABLE="$PY" \
  > "$O/build.txt" 2>&1 || { echo "BUILD FAILED"; tail -60 "$O/build.txt"; tail -20 "$B.cmake.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
rc=0
(cd "$B" && timeout 200 ctest -R "gpu\.Symmetric" --timeout 60 --output-on-failure) 2>&1 | tee "$O/gtest.txt" || rc=1
# Where 4 GPUs exist, the same tests again with 4 members (MoE spreads experts over 4-8 GPUs).
NGPU=$(nvidia-smi -L | wc -l)
if [[ $NGPU -ge 4 ]]; then
  (cd "$B" && FERRY_TEST_MEMBERS=4 timeout 240 ctest -R "gpu\.Symmetric" --timeout 90 --output-on-failure) 2>&1 |
    tee "$O/gtest4.txt" | grep -E "tests passed|Failed|\*\*\*" || rc=1
fi
echo "gtest done at $((SECONDS - t0)) s"
if [[ ${RUN_API_BENCH:-1} == 1 ]]; then
  timeout 120 "$B/tests/gpu/ferry-device-api-bench" --json "$O/device_api.jsonl" 2>&1 |
    tee "$O/device_api_bench.txt" || rc=1
fi
export FERRY_PYTHONPATH=$B/python PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
if [[ ${RUN_MOE_BENCH:-1} == 1 ]]; then
  for w in ${MOE_WORLDS:-2 $([[ $NGPU -ge 4 ]] && echo 4)}; do
    timeout 150 "$PY" bench/device_api/moe_bench.py --world "$w" --iters "${ITERS:-50}" \
      --json "$O/moe.jsonl" 2>&1 | tee -a "$O/moe_bench.txt" || rc=1
  done
  "$PY" bench/device_api/plot.py "$O/moe.jsonl" -o "$O/device_api.png" > /dev/null 2>&1 || true
fi
echo "benches done at $((SECONDS - t0)) s"
if [[ ${RUN_PYTEST:-1} == 1 ]]; then
  timeout 120 "$PY" -m pytest -q -x tests/python/test_symmetric.py 2>&1 | tail -30 | tee "$O/pytest.txt" || rc=1
fi
echo "all done at $((SECONDS - t0)) s, rc $rc"
exit $rc
