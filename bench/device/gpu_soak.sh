#!/usr/bin/env bash
# On the GPU device machine: the soak (tests/soak, docs/reliability.md "Soak")
# over GPU memory -- every target area, readable region and local buffer
# cudaMalloc'd on the worker's GPU (worker i on GPU i % GPUs), every byte
# checked through a copy to the host -- once over cuda_ipc and once over tcp,
# with kills, stops and the churn process as the host-memory soaks run.
#   run(command="bench/device/gpu_soak.sh", carry=[".devcarry/root"], kind="nvidia-h100-x2")
# Builds ferry-soak with bench/device/build.sh (BUILD, default build-dev),
# then runs the transports of SOAK_TRANSPORTS (default "cuda_ipc tcp") at the
# same time (SOAK_SERIAL=1: one after the other; two runs of 240 s do not fit
# one 10-minute call that way), each for SOAK_SECONDS (default 240).
# SOAK_PROCESSES (default 4) workers; SOAK_ISOLATE=1 gives each worker only
# its own GPU (CUDA_VISIBLE_DEVICES, as serving stacks launch theirs);
# SOAK_FAULTS (default "--kill-every 30 --stop-every 30 --churn 1000") and
# SOAK_ARGS (more ferry-soak options) change the run.
# Results in $OUT: machine.txt, soak_build.txt, gpu_soak_<transport>.txt.
# Exit status: 0 when every run printed PASS.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
O=${OUT:-/tmp/out}
mkdir -p "$O"
t0=$SECONDS
# NVLink multicast stays off (the device machines' rule), for every process started here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi -L; nvidia-smi topo -m; uname -r; nproc; git log --oneline -1 2> /dev/null; } > "$O/machine.txt" 2>&1
cat "$O/machine.txt"
export BUILD=${BUILD:-build-dev}
TARGETS=ferry-soak bench/device/build.sh > "$O/soak_build.txt" 2>&1 ||
  { echo "BUILD FAILED"; grep -E "error|FAILED" -A3 "$O/soak_build.txt" | head -60; exit 1; }
echo "built in $((SECONDS - t0)) s"
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
SECS=${SOAK_SECONDS:-240}
FAULTS=${SOAK_FAULTS:---kill-every 30 --stop-every 30 --churn 1000}
ISOLATE=()
[ "${SOAK_ISOLATE:-0}" = 1 ] && ISOLATE=(--gpu-isolate)
soak() {  # transport
  # The soak's own end: traffic, faults healed (up to 60 s), drain (up to 90 s).
  # shellcheck disable=SC2086
  timeout -k 10 $((SECS + 200)) "$BUILD/tests/soak/ferry-soak" --memory gpu --transport "$1" \
    --processes "${SOAK_PROCESSES:-4}" --seconds "$SECS" --report-every 30 "${ISOLATE[@]}" \
    $FAULTS ${SOAK_ARGS:-} > "$O/gpu_soak_$1.txt" 2>&1
  echo "soak over $1: exit $? at $((SECONDS - t0)) s"
}
for t in ${SOAK_TRANSPORTS:-cuda_ipc tcp}; do
  if [ "${SOAK_SERIAL:-0}" = 1 ]; then soak "$t"; else soak "$t" & fi
done
wait
rc=0
for t in ${SOAK_TRANSPORTS:-cuda_ipc tcp}; do
  echo "=== $t"
  grep -E "^ferry-soak|^\[ *[0-9]+ s\] transfers|chosen:|data errors|registrations|processes" \
    "$O/gpu_soak_$t.txt" | tail -7
  grep -q "ferry-soak: PASS" "$O/gpu_soak_$t.txt" || rc=1
done
exit $rc
