#!/usr/bin/env bash
# Builds the fuzz targets with clang + libFuzzer + AddressSanitizer and runs
# each for FERRY_FUZZ_SECONDS (default 30). Exits non-zero on any finding.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${FERRY_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}
SECONDS_EACH=${FERRY_FUZZ_SECONDS:-30}
if ! command -v clang++ >/dev/null; then
  echo "fuzz: skipped: clang++ not installed"; exit 0
fi
if [ ! -f "$BUILD/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFERRY_FUZZ=ON -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_TOOLS=OFF -DFERRY_BUILD_PYTHON=OFF \
    -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
fi
if ! ninja -C "$BUILD" fuzz_codecs fuzz_tcp_frames >"$BUILD/fuzz_build.log" 2>&1; then
  echo "fuzz: building the fuzz targets (clang) failed:"; grep -E "error|FAILED" -A3 "$BUILD/fuzz_build.log" | head -30
  exit 1
fi
mkdir -p "$BUILD/corpus/codecs" "$BUILD/corpus/frames"
status=0
for t in codecs tcp_frames; do
  corpus="$BUILD/corpus/${t#tcp_}"
  echo "fuzz: $t for ${SECONDS_EACH}s"
  if ! "$BUILD/tests/fuzz/fuzz_$t" -max_total_time="$SECONDS_EACH" -max_len=16384 -timeout=10 \
      -print_final_stats=1 "$corpus" > "$BUILD/fuzz_$t.log" 2>&1; then
    echo "fuzz: $t FOUND A FAILURE"; tail -40 "$BUILD/fuzz_$t.log"; status=1
  else
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$BUILD/fuzz_$t.log" | sed "s/^/fuzz: $t /"
  fi
done
exit $status
