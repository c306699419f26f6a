#!/usr/bin/env bash
# On the GPU device machine: configure and build Ferry with the Debian packages
# carried in .devcarry/root (bench/device/prepare.sh fills it here). Incremental
# on a warm machine. Extra arguments go to cmake's configure step; TARGETS
# (space-separated) limits what is built.
#   BUILD=build-dev bench/device/build.sh [-DFERRY_BUILD_PYTHON=ON ...]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
R=$PWD/.devcarry/root
[ -d "$R/usr" ] || { echo "build.sh: .devcarry/root is missing (run bench/device/prepare.sh here, carry it)"; exit 1; }
for pc in "$R"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc "$R"/usr/share/pkgconfig/*.pc; do
  [ -f "$pc" ] && sed -i "s|^prefix=.*|prefix=$R/usr|" "$pc"
done
export PKG_CONFIG_PATH=$R/usr/lib/x86_64-linux-gnu/pkgconfig:$R/usr/share/pkgconfig
export CMAKE_PREFIX_PATH=$R/usr
export LD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
B=${BUILD:-build-dev}
GEN=()
command -v ninja > /dev/null && GEN=(-G Ninja)
if [ ! -f "$B/CMakeCache.txt" ] || [ $# -gt 0 ]; then
  cmake -S . -B "$B" "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGTEST_ROOT="$R/usr" "$@" > "$B.cmake.log" 2>&1 || { tail -30 "$B.cmake.log"; exit 1; }
fi
# shellcheck disable=SC2086
cmake --build "$B" -j "$(nproc)" ${TARGETS:+--target $TARGETS}
