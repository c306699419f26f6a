#!/usr/bin/env bash
# On a GPU machine: ferry-cuda-ipc-bench (cuda_ipc only, --no-tcp) once per
# set of cuda_ipc options, to choose defaults from measurements. The target
# process is on GPU 1 where there are two GPUs. Each line of VARIANTS is
# "NAME VAR=VALUE ..." (FERRY_CUDA_IPC_* options); results in $OUT/options_NAME.txt
# and a summary on stdout.
# BENCH_ARGS: more arguments for the bench (e.g. --trace).
#   BUILD=build-dev bench/cuda_ipc/options_run.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
O=${OUT:-/tmp/out}
B=${BUILD:-build-dev}
mkdir -p "$O"
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
dev=0
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && dev=1
VARIANTS=${VARIANTS:-"defaults
peer_kernel_4m FERRY_CUDA_IPC_PEER_KERNEL_MAX_BLOCK=4MiB
peer_kernel_4m_sm16 FERRY_CUDA_IPC_PEER_KERNEL_MAX_BLOCK=4MiB FERRY_CUDA_IPC_SM_BUDGET=16
peer_kernel_4m_sm32 FERRY_CUDA_IPC_PEER_KERNEL_MAX_BLOCK=4MiB FERRY_CUDA_IPC_SM_BUDGET=32
sm16 FERRY_CUDA_IPC_SM_BUDGET=16
ce_loop FERRY_CUDA_IPC_BATCH_API=false
kernel_single FERRY_CUDA_IPC_ENGINE_MAX_BLOCKS=0"}
while read -r name vars; do
  [ -z "$name" ] && continue
  echo "== $name ($vars)"
  # shellcheck disable=SC2086
  env $vars FERRY_TEST_PEER_DEVICE=$dev timeout 120 "$B/tests/gpu/ferry-cuda-ipc-bench" --no-tcp \
    --iters ${ITERS:-1000} ${BENCH_ARGS:-} > "$O/options_$name.txt" 2>&1 ||
    echo "   rc=$? (see options_$name.txt)"
  grep -E "^(4096|65536|1048576) B|x 1179648|x 4 KiB|16 MiB|MISMATCH" "$O/options_$name.txt" |
    awk '{printf "   %s\n", $0}'
done <<< "$VARIANTS"
