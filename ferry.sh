#!/usr/bin/env bash
# Ferry's two set-up commands (README "Quick start"):
#   ./ferry.sh demo   build, then move data between two processes over tcp on
#                     loopback (4 KiB … 64 MiB writes and reads), print GB/s
#   ./ferry.sh test   build, then run the whole test suite (C++ and Python)
# Both install what is missing (Debian packages, a Python venv) and are safe to
# run again: an existing install and build are reused.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
BUILD=${FERRY_BUILD_DIR:-$ROOT/build}
JOBS=${FERRY_JOBS:-$(nproc)}

log() { printf '\033[1m[ferry]\033[0m %s\n' "$*" >&2; }

# --- dependencies -----------------------------------------------------------
DEBIAN_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libsodium-dev zlib1g-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev googletest iproute2 python3 python3-venv python3-dev
  clang libclang-rt-14-dev
)

install_debian_packages() {
  local missing=()
  for p in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

PY_VENV=$ROOT/.venv
PY_PACKAGES=(pip "scikit-build-core>=0.10" "nanobind>=2.0" numpy pytest)

install_python_env() {
  if [ ! -x "$PY_VENV/bin/python" ]; then
    log "creating Python environment in .venv"
    python3 -m venv "$PY_VENV"
  fi
  if ! "$PY_VENV/bin/python" -c "import nanobind, scikit_build_core, numpy, pytest" 2>/dev/null; then
    log "installing Python build and test packages"
    "$PY_VENV/bin/pip" install -q --upgrade "${PY_PACKAGES[@]}"
  fi
}

# --- build ------------------------------------------------------------------
build_cpp() {
  local werror=OFF
  [ "${CI:-}" = "true" ] && werror=ON
  if [ ! -f "$BUILD/build.ninja" ]; then
    cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DFERRY_WERROR=$werror >/dev/null
  fi
  log "building (ninja -j$JOBS)"
  ninja -C "$BUILD" -j"$JOBS" | grep -v '^\[' || true
  ninja -C "$BUILD" -j"$JOBS" >/dev/null  # fail loudly if the build failed
}

build_python() {
  [ -f "$ROOT/pyproject.toml" ] || return 0
  install_python_env
  log "building the Python package"
  "$PY_VENV/bin/pip" install -q --no-build-isolation \
    -Cbuild-dir="$BUILD/python" "$ROOT"
}

# --- commands ---------------------------------------------------------------
demo() {
  install_debian_packages
  build_cpp
  log "two processes on loopback, default transport (tcp): writes then reads"
  "$BUILD/tools/ferry-bench" --spawn-local --op write,read \
    --block-size 4KiB,64KiB,1MiB,16MiB,64MiB --time 1.5 --verify "$@"
}

run_tests() {
  install_debian_packages
  build_cpp
  log "C++ tests (ctest)"
  local status=0
  (cd "$BUILD" && ctest --output-on-failure -j2 --timeout 600 "$@") || status=$?
  log "C++ unit and integration tests again under AddressSanitizer + UBSan"
  if [ ! -f "$BUILD-asan/build.ninja" ]; then
    cmake -S "$ROOT" -B "$BUILD-asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DFERRY_SANITIZE=ON -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_TOOLS=OFF >/dev/null
  fi
  if ninja -C "$BUILD-asan" -j"$JOBS" >/dev/null; then
    (cd "$BUILD-asan" && ctest --output-on-failure -j2 --timeout 600 -L "unit|integration") || status=$?
  else
    log "sanitizer build failed"; status=1
  fi
  log "fuzzing (bounded: ${FERRY_FUZZ_SECONDS:-20} s per target)"
  FERRY_FUZZ_SECONDS=${FERRY_FUZZ_SECONDS:-20} FERRY_FUZZ_BUILD_DIR="$BUILD-fuzz" \
    "$ROOT/tests/fuzz/run.sh" || status=$?
  if [ -f "$ROOT/pyproject.toml" ] && [ -d "$ROOT/tests/python" ]; then
    build_python
    log "Python tests (pytest)"
    "$PY_VENV/bin/python" -m pytest -q "$ROOT/tests/python" || status=$?
  fi
  return $status
}

case "${1:-}" in
  demo) shift; demo "$@" ;;
  test) shift; run_tests "$@" ;;
  *)
    echo "usage: $0 demo|test" >&2
    exit 2
    ;;
esac
