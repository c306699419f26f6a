#!/usr/bin/env bash
# On the GPU device machine (no network): build Ferry's Python module from this
# tree, install NIXL from the carried wheels, run bench/cuda_ipc/bench.py, and
# put the results into $OUT (and bench/results/ there).
#
#   run(command="bench/cuda_ipc/device_run.sh",
#       carry=[".devcarry/root", ".devcarry/build.sh", ".devcarry/wheels-nixl"],
#       kind="nvidia-h100-x2")            # 2 GPUs: GPU 0 -> GPU 1; one GPU works too
#   BENCH_ARGS="--quick" bench/cuda_ipc/device_run.sh      # arguments for bench.py
#
# Needs, carried in .devcarry/ (git-ignored): build.sh and root/ (the C++
# dependencies, as for .devcarry/run1.sh), wheels-nixl/ (bench/cuda_ipc/fetch_wheels.sh,
# run here beforehand). Steps:
#  1. Ferry: .devcarry/build.sh into build-cuda-ipc/ (-DFERRY_BUILD_PYTHON=ON, no tests
#     or tools; incremental on a warm machine), then PYTHONPATH=build-cuda-ipc/python.
#     FERRY_PYTHONPATH=DIR skips the build and uses that package instead.
#  2. bench/device/nixl_env.sh: a venv (/tmp/cuda-ipc-venv) with --system-site-packages,
#     plus a .pth naming the system python3's site-packages when python3 is itself a venv (/opt/torch/.venv:
#     a venv made from it would not see its torch); where `python3 -m venv` fails (no
#     ensurepip), pip install --target /tmp/cuda-ipc-site + PYTHONPATH instead. nixl +
#     nixl-cu13 installed with --no-index --no-deps from .devcarry/wheels-nixl. A failed
#     install leaves NIXL out of the table (NOT RUN, with the reason), not the run.
#  3. bench.py with --budget (what is left of the 10-minute command limit, less a
#     margin), its workers' logs kept; then into $OUT: machine.txt, build.txt, pip.txt,
#     bench.txt (the table), cuda_ipc-*.json, cuda_ipc-*.png, worker_logs.tar.gz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
ROOT=$PWD
O=${OUT:-/tmp/out}
mkdir -p "$O"
t0=$SECONDS
LIMIT=${DEVICE_LIMIT_S:-590}  # the command's limit on the device machine (600 s), less a margin
PY=$(command -v "${PYTHON:-python3}")
# NVLink multicast stays off (the device machines' rule), also for the processes started here.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
  NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} PYTHONUNBUFFERED=1

{
  nvidia-smi -L; nvidia-smi topo -m; uname -r; echo "nproc $(nproc)"; echo "python3 $PY"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} > "$O/machine.txt" 2>&1
cat "$O/machine.txt"

# --- 1. Ferry's Python module ---------------------------------------------------------
export LD_LIBRARY_PATH=$ROOT/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
if [[ -z "${FERRY_PYTHONPATH:-}" ]]; then
  [[ -x .devcarry/build.sh && -d .devcarry/root ]] ||
    { echo "device_run.sh: .devcarry/build.sh and .devcarry/root are needed (carry them)"; exit 1; }
  B=${FERRY_BUILD:-build-cuda-ipc}
  BUILD=$B .devcarry/build.sh -DFERRY_BUILD_PYTHON=ON -DFERRY_BUILD_TESTS=OFF -DFERRY_BUILD_TOOLS=OFF \
    -DPython_EXECUTABLE="$PY" > "$O/build.txt" 2>&1 ||
    { echo "BUILD FAILED ($((SECONDS - t0)) s)"; tail -40 "$O/build.txt"; tail -20 "$B.cmake.log" 2>/dev/null; exit 1; }
  FERRY_PYTHONPATH=$ROOT/$B/python
  echo "ferry built in $((SECONDS - t0)) s ($B)"
fi
export PYTHONPATH=$FERRY_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}

# --- 2. a venv that sees torch, with NIXL (bench/device/nixl_env.sh) --------------------
# shellcheck source=bench/device/nixl_env.sh
source bench/device/nixl_env.sh
: > "$O/pip.txt"
if nixl_env "$PY" "$O/pip.txt"; then
  echo "nixl: importable"
else
  echo "NIXL will be NOT RUN (see pip.txt)"
fi
export PYTHONPATH=${NIXL_PYTHONPATH:+$NIXL_PYTHONPATH:}$PYTHONPATH
"$BPY" -c "import ferry; print('ferry', ferry.version(), ferry.__file__, '| cuda:', ferry.cuda_available(), ferry.cuda_unavailable_reason())" 2>&1 | tee -a "$O/pip.txt"
echo "set-up done at $((SECONDS - t0)) s"

# --- 3. the benchmark ------------------------------------------------------------------
LOGS=/tmp/cuda-ipc-logs
rm -rf "$LOGS"
budget=$((LIMIT - (SECONDS - t0) - 40))  # 40 s: the last repetition's overrun, the table, JSON, plot
(( budget < 60 )) && budget=60
stamp=$(date -u +%Y%m%dT%H%M%SZ)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "${BENCH_COMMIT:-nogit}")
json=bench/results/cuda_ipc-$stamp-$commit.json
# shellcheck disable=SC2086
timeout $((LIMIT - (SECONDS - t0))) "$BPY" bench/cuda_ipc/bench.py --budget "$budget" --log-dir "$LOGS" \
  --json "$json" ${BENCH_ARGS:-} 2>&1 | tee "$O/bench.txt"
rc=${PIPESTATUS[0]}
cp "$json" "${json%.json}.png" "$O/" 2>/dev/null
tar -czf "$O/worker_logs.tar.gz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null
echo "bench rc=$rc, total $((SECONDS - t0)) s; results: $json"
exit "$rc"
