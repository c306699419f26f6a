#!/usr/bin/env bash
# Here (a Debian machine with network): fill .devcarry/ (git-ignored) with
# what the GPU device machine lacks, since it has no network:
#   .devcarry/root/        Debian's C++ packages Ferry builds with (headers,
#                          CMake files, shared libraries), unpacked by dpkg -x
#   .devcarry/wheels-nixl/ NIXL's wheels for the peer comparison (only with
#                          --nixl: bench/cuda_ipc/fetch_wheels.sh)
# Safe to run again: what is there is kept. Then, in a device call:
#   run(command="bench/device/build.sh ...", carry=[".devcarry/root", ...])
#
#   bench/device/prepare.sh [--nixl]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY=$ROOT/.devcarry
# The -dev packages and the runtime libraries they link against. libfabric
# and libcurl stay out: their transports answer NotSupported without them.
PACKAGES=(libfmt-dev libfmt9 libspdlog-dev libspdlog1.10 libcli11-dev nlohmann-json3-dev
          libgtest-dev googletest)
mkdir -p "$CARRY/debs" "$CARRY/root"
if [ ! -f "$CARRY/root/.done" ]; then
  (cd "$CARRY/debs" && apt-get download "${PACKAGES[@]}")
  for d in "$CARRY"/debs/*.deb; do dpkg -x "$d" "$CARRY/root"; done
  rm -rf "$CARRY/root/usr/share/doc" "$CARRY/root/usr/src/googletest/googlemock/docs" \
    "$CARRY/root/usr/src/googletest/docs"
  touch "$CARRY/root/.done"
fi
du -sh "$CARRY/root"
if [ "${1:-}" = "--nixl" ] && ! ls "$CARRY"/wheels-nixl/nixl_cu13-*.whl > /dev/null 2>&1; then
  "$ROOT/bench/cuda_ipc/fetch_wheels.sh"
fi
