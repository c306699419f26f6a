#!/usr/bin/env bash
# Scattered host<->GPU block copies: Ferry's CopyStream vs a per-block
# cudaMemcpyAsync loop, one cudaMemcpyBatchAsync and one contiguous copy of
# the same bytes, in one program (ferry-gpu-copy-bench). Needs a GPU.
#
#   bench/gpu_copy.sh [--json] [--reps N] [--total-mib N] [--sizes a,b,..] [--dirs h2d,d2h,d2d]
#
# Uses $FERRY_GPU_BENCH if set, else a built binary from build/ or build-gpu/,
# else builds the GPU-only project (tests/gpu/standalone) into build-gpu/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

bin="${FERRY_GPU_BENCH:-}"
if [[ -z "$bin" ]]; then
  for c in "$root/build/src/cuda/ferry-gpu-copy-bench" "$root/build-gpu/cuda/ferry-gpu-copy-bench"; do
    if [[ -x "$c" ]]; then bin="$c"; break; fi
  done
fi
if [[ -z "$bin" ]]; then
  echo "# building ferry-gpu-copy-bench (tests/gpu/standalone -> build-gpu/)" >&2
  cmake -S "$root/tests/gpu/standalone" -B "$root/build-gpu" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DFERRY_BUILD_TESTS=OFF >&2
  ninja -C "$root/build-gpu" ferry-gpu-copy-bench >&2
  bin="$root/build-gpu/cuda/ferry-gpu-copy-bench"
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm \
    --format=csv,noheader 2>/dev/null | sed 's/^/# nvidia-smi: /' || true
fi
exec "$bin" "$@"
