#!/usr/bin/env bash
# A slow peer beside K normal ones (docs/reliability.md, "A slow peer"):
# runs ferry-slow-peer-bench once, niced and bounded in time, and keeps its
# output in bench/results/slow_peer_cpu_<date>_<commit>.txt (runs of one day
# and commit are appended).
#   bench/slow_peer.sh [build dir] [ferry-slow-peer-bench options...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
build="${1:-$root/build}"
shift || true
bin="$build/tools/ferry-slow-peer-bench"
[[ -x "$bin" ]] || { echo "build it first: ninja -C $build ferry-slow-peer-bench" >&2; exit 2; }
commit="$(git -C "$root" rev-parse --short HEAD)"
out="$root/bench/results/slow_peer_cpu_$(date -u +%F)_${commit}.txt"
{
  echo "# $(date -u +%FT%TZ) commit $commit; $(nproc) CPUs; load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# $bin $*"
  nice -n 10 timeout 600 "$bin" "$@"
} 2>&1 | tee -a "$out"
echo "kept in $out"
