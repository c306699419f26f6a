#!/usr/bin/env bash
# Builds the fuzz targets with clang + libFuzzer + AddressSanitizer and runs
# each for a bounded time. Exits non-zero on any finding.
#
# FERRY_FUZZ_SECONDS (default 30) is the time of a target that speaks to an
# engine over loopback sockets (fuzz_tcp_frames; fuzz_tcp_handshake gets half
# of it); the decoder targets, hundreds of times faster per input, get a
# quarter of it. FERRY_FUZZ_TARGETS (names without fuzz_) picks some.
# Inputs that once failed are kept in tests/fuzz/corpus/<target>/ and run
# first every time; what a run finds new goes to $BUILD/corpus/<target>/.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${FERRY_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}
SECONDS_EACH=${FERRY_FUZZ_SECONDS:-30}
TARGETS=${FERRY_FUZZ_TARGETS:-codecs tcp_handshake tcp_frames tcp_wire shm_wire cuda_ipc_wire fabric_wire}
if ! command -v clang++ >/dev/null; then
  echo "fuzz: skipped: clang++ not installed"; exit 0
fi
if [ ! -f "$BUILD/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFERRY_FUZZ=ON -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_TOOLS=OFF -DFERRY_BUILD_PYTHON=OFF \
    -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
fi
names=()
for t in $TARGETS; do names+=("fuzz_$t"); done
if ! ninja -C "$BUILD" "${names[@]}" >"$BUILD/fuzz_build.log" 2>&1; then
  echo "fuzz: building the fuzz targets (clang) failed:"; grep -E "error|FAILED" -A3 "$BUILD/fuzz_build.log" | head -30
  exit 1
fi
status=0
for t in $TARGETS; do
  case $t in
    tcp_frames) seconds=$SECONDS_EACH ;;
    tcp_handshake) seconds=$(( SECONDS_EACH / 2 > 0 ? SECONDS_EACH / 2 : 1 )) ;;
    *) seconds=$(( SECONDS_EACH / 4 > 0 ? SECONDS_EACH / 4 : 1 )) ;;
  esac
  corpus="$BUILD/corpus/$t"
  kept="$ROOT/tests/fuzz/corpus/$t"
  mkdir -p "$corpus"
  seeds=()
  [ -d "$kept" ] && seeds+=("$kept")
  echo "fuzz: $t for ${seconds}s"
  if ! "$BUILD/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -max_len=16384 -timeout=10 \
      -print_final_stats=1 "$corpus" "${seeds[@]}" > "$BUILD/fuzz_$t.log" 2>&1; then
    echo "fuzz: $t FOUND A FAILURE"; tail -40 "$BUILD/fuzz_$t.log"; status=1
  else
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$BUILD/fuzz_$t.log" | sed "s/^/fuzz: $t /"
  fi
done
exit $status
