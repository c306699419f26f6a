#!/usr/bin/env bash
# On the GPU device machine (two GPUs, no network), in one command: issue 28's
# GPU -> GPU rows of the NIXL-API program (bench/nixl/nixl_api_bench.py --mem vram):
# real NIXL (UCX, UCX_TLS unset: it picks cuda_ipc) against Ferry underneath
# (ferry.compat.nixl through the `nixl` shim), GPU 0 -> GPU 1 on one host, first
# with both GPUs visible to both processes (--gpus both), then with each process
# seeing only its own (--gpus one-each: CUDA_VISIBLE_DEVICES=0 / =1, as serving
# stacks launch them). Results in $OUT:
#   machine.txt   GPUs, topology, torch, commit
#   build.txt     Ferry's Python module (bench/device/build.sh, ferry_python_devtree)
#   pip.txt       NIXL from .devcarry/wheels-nixl in a venv that sees torch
#   nixl_api_vram_both.{txt,json,log}, nixl_api_vram_one_each.{txt,json,log}
#                 the table, --json, and the rounds (stderr)
#
#   run(command="bench/nixl/gpu_rows_run.sh", kind="nvidia-h200-x2",
#       carry=[".devcarry/root", ".devcarry/wheels-nixl"])
# (.devcarry/: bench/device/prepare.sh --nixl, here.) GPUS_MODES (default "both
# one-each") picks the launches; HOST_PLACES (default none; "host netns") adds
# the host-memory rows (--mem dram) on this machine's CPUs, between processes of
# one host and between two network namespaces (root, iproute2), results in
# nixl_api_dram_{host,netns}.*; SYSTEMS (default nixl,ferry) the systems,
# BENCH_ARGS replace "--rounds 3 --bytes-per-point 1e10 --lat-iters 3000"; each
# launch is cut at RUN_LIMIT_S (default 200). FERRY_PYTHONPATH=DIR skips the build.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
ROOT=$PWD
O=${OUT:-/tmp/out}
mkdir -p "$O"
t0=$SECONDS
LIMIT=${DEVICE_LIMIT_S:-590}  # the command's limit on the device machine (600 s), less a margin
PY=$(command -v "${PYTHON:-python3}")
# NVLink multicast stays off (the device machines' rule), also for the processes started here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{
  nvidia-smi -L; nvidia-smi topo -m; uname -r; echo "nproc $(nproc)"; echo "python3 $PY"
  git log --oneline -1 2>/dev/null; date -u +%Y-%m-%dT%H:%M:%SZ
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset} UCX_TLS=${UCX_TLS-unset}"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} > "$O/machine.txt" 2>&1
cat "$O/machine.txt"

# --- 1. Ferry's Python module ------------------------------------------------------------
export LD_LIBRARY_PATH=$ROOT/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
if [[ -z "${FERRY_PYTHONPATH:-}" ]]; then
  export BUILD=${BUILD:-/tmp/b-nixl-gpu}
  TARGETS=ferry_python_devtree bench/device/build.sh -DFERRY_BUILD_PYTHON=ON -DFERRY_BUILD_TESTS=OFF \
    -DFERRY_BUILD_TOOLS=OFF -DPython_EXECUTABLE="$PY" > "$O/build.txt" 2>&1 ||
    { echo "BUILD FAILED"; grep -E "error|FAILED" -A3 "$O/build.txt" | head -40; tail -20 "$BUILD.cmake.log" 2>/dev/null; exit 1; }
  export FERRY_PYTHONPATH=$BUILD/python
  echo "ferry built in $((SECONDS - t0)) s ($BUILD)"
fi

# --- 2. a venv that sees torch, with NIXL (bench/device/nixl_env.sh) ----------------------
# shellcheck source=bench/device/nixl_env.sh
source bench/device/nixl_env.sh
: > "$O/pip.txt"
nixl_env "$PY" "$O/pip.txt" || { tail -5 "$O/pip.txt"; exit 1; }
PYTHONPATH=$FERRY_PYTHONPATH "$BPY" -c "import ferry; print('ferry', ferry.version(), ferry.__file__, '| cuda:', ferry.cuda_available(), ferry.cuda_unavailable_reason())" 2>&1 | tee -a "$O/pip.txt"
echo "set-up done at $((SECONDS - t0)) s"

# --- 3. the launches ---------------------------------------------------------------------
rc=0
rows=()
for g in ${GPUS_MODES-both one-each}; do rows+=("nixl_api_vram_${g//-/_}|--mem vram --gpus $g"); done
for p in ${HOST_PLACES:-}; do rows+=("nixl_api_dram_$p|--mem dram --place $p"); done
for row in "${rows[@]}"; do
  name=${row%%|*} args=${row#*|}
  left=$((LIMIT - (SECONDS - t0)))
  if (( left < 60 )); then echo "$args: NOT RUN, $left s left of the command's limit"; rc=1; continue; fi
  lim=${RUN_LIMIT_S:-200}
  (( lim > left )) && lim=$left
  echo "--- $args (at $((SECONDS - t0)) s, limit $lim s)"
  # shellcheck disable=SC2086
  timeout -k 10 "$lim" "$PY" bench/nixl/nixl_api_bench.py --nixl-python "$BPY" --ferry-python "$BPY" \
    --systems "${SYSTEMS:-nixl,ferry}" $args \
    ${BENCH_ARGS:---rounds 3 --bytes-per-point 1e10 --lat-iters 3000} --json "$O/$name.json" \
    > "$O/$name.txt" 2> "$O/$name.log"
  r=$?
  cat "$O/$name.txt"
  if [ $r -ne 0 ]; then rc=1; echo "$args: exit $r"; tail -30 "$O/$name.log"; fi
done
echo "total $((SECONDS - t0)) s, rc $rc"
exit $rc
