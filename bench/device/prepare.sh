#!/usr/bin/env bash
# Here (a Debian machine with network): fill .devcarry/ (git-ignored) with
# what the GPU device machine lacks, since it has no network:
#   .devcarry/root/        Debian's C++ packages Ferry builds with (headers,
#                          CMake files, shared libraries) and libfabric, unpacked
#                          by dpkg -x
#   .devcarry/wheels-nixl/ NIXL's wheels for the peer comparison (only with
#                          --nixl: bench/cuda_ipc/fetch_wheels.sh)
# Safe to run again: what is there is kept. Then, in a device call:
#   run(command="bench/device/build.sh ...", carry=[".devcarry/root", ...])
#
#   bench/device/prepare.sh [--nixl]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY=$ROOT/.devcarry
# The -dev packages and the runtime libraries they link against. libcurl
# stays out: its directory client answers NotSupported without it.
PACKAGES=(libfmt-dev libfmt9 libspdlog-dev libspdlog1.10 libcli11-dev nlohmann-json3-dev
          libgtest-dev googletest)
# libfabric for the fabric transport (its GPU tests, tcp;ofi_rxm on
# loopback): the headers CMake looks for (rdma/fabric.h) and libfabric.so.1
# with what it links against (apt-cache depends libfabric1, ldd), which
# Ubuntu 24.04 lacks. The scripts put .devcarry/root/usr/lib/x86_64-linux-gnu
# on LD_LIBRARY_PATH, where the transport's dlopen finds it.
FABRIC_PACKAGES=(libfabric1 libfabric-dev libibverbs1 ibverbs-providers librdmacm1
                 libpsm-infinipath1 libpsm2-2 libnl-3-200 libnl-route-3-200 libnuma1)
mkdir -p "$CARRY/debs" "$CARRY/debs-fabric" "$CARRY/root"
if [ ! -f "$CARRY/root/.done" ]; then
  (cd "$CARRY/debs" && apt-get download "${PACKAGES[@]}")
  for d in "$CARRY"/debs/*.deb; do dpkg -x "$d" "$CARRY/root"; done
  rm -rf "$CARRY/root/usr/share/doc" "$CARRY/root/usr/src/googletest/googlemock/docs" \
    "$CARRY/root/usr/src/googletest/docs"
  touch "$CARRY/root/.done"
fi
if [ ! -f "$CARRY/root/.done-fabric" ]; then
  (cd "$CARRY/debs-fabric" && apt-get download "${FABRIC_PACKAGES[@]}")
  for d in "$CARRY"/debs-fabric/*.deb; do dpkg -x "$d" "$CARRY/root"; done
  rm -rf "$CARRY/root/usr/share/doc" "$CARRY/root/usr/share/man"
  # Debian keeps some of these in /lib (usrmerge): one library directory.
  if [ -d "$CARRY/root/lib/x86_64-linux-gnu" ]; then
    mkdir -p "$CARRY/root/usr/lib/x86_64-linux-gnu"
    cp -a "$CARRY/root/lib/x86_64-linux-gnu/." "$CARRY/root/usr/lib/x86_64-linux-gnu/"
    rm -rf "$CARRY/root/lib"
  fi
  # Debian reaches libpsm_infinipath.so.1 through an alternatives link.
  L=$CARRY/root/usr/lib/x86_64-linux-gnu
  P=$(ls "$CARRY"/root/usr/lib/libpsm1/libpsm_infinipath.so.1.* 2> /dev/null | head -1 || true)
  [ -n "$P" ] && ln -sf "../libpsm1/$(basename "$P")" "$L/libpsm_infinipath.so.1"
  touch "$CARRY/root/.done-fabric"
fi
# Everything libfabric.so.1 needs is there, or on the machine itself.
LD_LIBRARY_PATH="$CARRY/root/usr/lib/x86_64-linux-gnu" ldd \
  "$CARRY/root/usr/lib/x86_64-linux-gnu/libfabric.so.1" | grep -F "not found" || true
du -sh "$CARRY/root"
if [ "${1:-}" = "--nixl" ] && ! ls "$CARRY"/wheels-nixl/nixl_cu13-*.whl > /dev/null 2>&1; then
  "$ROOT/bench/cuda_ipc/fetch_wheels.sh"
fi
