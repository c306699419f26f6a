#!/usr/bin/env bash
# `pip install .` on a machine that has a compiler and Python but none of
# Ferry's C++ libraries, without root and without network -- checked on this
# machine by hiding what its packages installed:
#   - a private mount namespace (unshare; the machine itself is untouched, but
#     making one needs root) mounts empty folders over the headers, CMake
#     packages and pkg-config files of fmt, spdlog, nlohmann-json, libcurl,
#     libsodium, zlib, CLI11, GoogleTest and libfabric;
#   - packaging/fetch_dependencies.sh fills a folder first (the network is
#     used for that only); pip then runs with --no-index from that folder, in
#     a fresh venv, with a fresh build directory, as a user would;
#   - packaging/smoke_test.py runs from outside the source tree against the
#     installed package.
# usage: packaging/check_bare_build.sh   (FERRY_BARE_KEEP=1 keeps the temporary folder;
#        FERRY_BARE_CMAKE_ARGS passes CMake arguments, e.g. -DFERRY_WITH_CUDA=OFF)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd -P)
log() { printf '\033[1m[check_bare_build]\033[0m %s\n' "$*" >&2; }

if [ "${FERRY_BARE_INSIDE:-0}" != 1 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v unshare >/dev/null; then
    echo "check_bare_build: needs root and unshare(1) to hide the installed packages in a private mount namespace" >&2
    exit 2
  fi
  TMP=$(mktemp -d "${TMPDIR:-/tmp}/ferry-bare.XXXXXX")
  [ "${FERRY_BARE_KEEP:-0}" = 1 ] && log "keeping $TMP" || trap 'rm -rf "$TMP"' EXIT
  log "fetching the dependency folder (network used here only)"
  "$SRC/packaging/fetch_dependencies.sh" "$TMP/deps" >"$TMP/fetch.log" 2>&1 ||
    { cat "$TMP/fetch.log" >&2; exit 1; }
  FERRY_BARE_INSIDE=1 FERRY_BARE_TMP=$TMP unshare --mount --propagation private "$0" "$@"
  exit $?
fi

TMP=$FERRY_BARE_TMP
hidden=()
hide_dir() {
  [ -d "$1" ] || return 0
  mount -t tmpfs -o size=1m,mode=0755 ferry-bare-hidden "$1"
  hidden+=("$1")
}
hide_file() {
  [ -f "$1" ] || return 0
  printf '#error "%s is hidden by packaging/check_bare_build.sh"\n' "$1" >"$TMP/hidden-$(basename "$1")"
  mount --bind "$TMP/hidden-$(basename "$1")" "$1"
  hidden+=("$1")
}
for d in /usr/include/fmt /usr/include/spdlog /usr/include/nlohmann /usr/include/curl \
         /usr/include/x86_64-linux-gnu/curl /usr/include/sodium /usr/include/CLI \
         /usr/include/gtest /usr/include/gmock /usr/include/rdma \
         /usr/lib/x86_64-linux-gnu/cmake /usr/lib/cmake /usr/share/cmake/nlohmann_json \
         /usr/lib/x86_64-linux-gnu/pkgconfig /usr/share/pkgconfig /usr/local/lib/cmake; do
  hide_dir "$d"
done
for f in /usr/include/sodium.h /usr/include/zlib.h /usr/include/zconf.h; do hide_file "$f"; done
log "hidden: ${hidden[*]}"
for h in fmt/format.h spdlog/spdlog.h nlohmann/json.hpp curl/curl.h sodium.h zlib.h; do
  if echo "#include <$h>" | c++ -x c++ -fsyntax-only - 2>/dev/null; then
    echo "check_bare_build: <$h> is still visible" >&2
    exit 1
  fi
done

PYTHON=${FERRY_CHECK_PYTHON:-python3}
log "fresh venv ($($PYTHON --version 2>&1)); pip install --no-index --find-links deps $SRC"
"$PYTHON" -m venv "$TMP/venv"
start=$(date +%s)
FERRY_DEPENDENCY_DIR="$TMP/deps" CMAKE_ARGS="${FERRY_BARE_CMAKE_ARGS:-}" \
  "$TMP/venv/bin/python" -m pip install --disable-pip-version-check --no-index \
  --find-links "$TMP/deps" --config-settings=build-dir="$TMP/build" -v "$SRC" >"$TMP/pip.log" 2>&1 ||
  { tail -60 "$TMP/pip.log" >&2; log "pip install . failed"; exit 1; }
log "pip install . took $(( $(date +%s) - start )) s"
grep -E "ferry: (dependencies|.* not installed)|libfabric headers|curl" "$TMP/pip.log" | sed 's/^/  /' >&2 || true
cd "$TMP"
"$TMP/venv/bin/python" "$SRC/packaging/smoke_test.py"
log "passed"
