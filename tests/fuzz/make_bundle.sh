#!/usr/bin/env bash
# Builds the fuzz targets (clang, libFuzzer, AddressSanitizer and
# UndefinedBehaviorSanitizer, the configuration of tests/fuzz/run.sh) and packs
# them into one self-contained archive for a machine without clang or network:
#   .devcarry/fuzz/fuzz_bundle.tar.xz   (git-ignored; xz, which Python's
#                                        standard library can unpack too)
# It holds bin/<target> (debug info stripped, symbols kept: sanitizer reports
# name functions), lib/ (every shared library a target needs beyond glibc,
# libstdc++, libgcc and libm, which ldd found), seeds/<target>/ (the kept
# inputs of tests/fuzz/corpus/ and what earlier runs here found), and
# MANIFEST (commit, compiler, sizes, ldd output). bench/device/fuzz_long.sh
# unpacks and runs it:
#   run(command="bench/device/fuzz_long.sh", carry=[".devcarry/fuzz"])
#
#   tests/fuzz/make_bundle.sh          FERRY_FUZZ_BUILD_DIR (default build-fuzz)
# FERRY_FUZZ_PACK_ONLY=1 packs the targets $BUILD already holds without
# running ninja (targets built there by hand, e.g. with other flags);
# FERRY_FUZZ_NOTE is a line added to the MANIFEST (how they were built).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${FERRY_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}
DEST=$ROOT/.devcarry/fuzz
TARGETS=(codecs tcp_handshake tcp_frames tcp_wire shm_wire cuda_ipc_wire fabric_wire)
command -v clang++ > /dev/null || { echo "make_bundle: clang++ is not installed"; exit 1; }
command -v xz > /dev/null || { echo "make_bundle: xz is not installed"; exit 1; }
LAUNCHER=()
command -v ccache > /dev/null && LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if [ ! -f "$BUILD/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFERRY_FUZZ=ON -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_TOOLS=OFF -DFERRY_BUILD_PYTHON=OFF \
    "${LAUNCHER[@]}" \
    -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" > /dev/null
fi
names=()
for t in "${TARGETS[@]}"; do names+=("fuzz_$t"); done
if [ "${FERRY_FUZZ_PACK_ONLY:-0}" = 1 ]; then
  for n in "${names[@]}"; do
    [ -x "$BUILD/tests/fuzz/$n" ] || { echo "make_bundle: $BUILD/tests/fuzz/$n is not built"; exit 1; }
  done
elif ! ninja -C "$BUILD" -j "${FERRY_FUZZ_JOBS:-2}" "${names[@]}" > "$BUILD/fuzz_build.log" 2>&1; then
  echo "make_bundle: building the fuzz targets failed:"
  grep -E "error|FAILED" -A3 "$BUILD/fuzz_build.log" | head -30
  exit 1
fi

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
B=$STAGE/fuzz_bundle
mkdir -p "$B/bin" "$B/lib" "$B/seeds"
# What the target machine is sure to have (Ubuntu 24.04: glibc 2.39, a newer
# libstdc++); everything else ldd names is carried.
SYSTEM='^(linux-vdso|/lib64/ld-linux|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so)'
{
  echo "commit: $(git -C "$ROOT" rev-parse HEAD 2> /dev/null || echo unknown)"
  echo "dirty: $(git -C "$ROOT" status --porcelain 2> /dev/null | grep -vc '^??' || true)"
  echo "compiler: $(clang++ --version | head -1)"
  echo "built on: $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -1)"
  echo "flags: -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined, RelWithDebInfo"
  [ -n "${FERRY_FUZZ_NOTE:-}" ] && echo "note: $FERRY_FUZZ_NOTE"
} > "$B/MANIFEST"
for t in "${TARGETS[@]}"; do
  bin=$BUILD/tests/fuzz/fuzz_$t
  # The sanitizers' runtimes are linked in statically: none of them may show up here.
  if ldd "$bin" | grep -qE 'libclang_rt|libasan|libubsan'; then
    echo "make_bundle: fuzz_$t links a sanitizer runtime dynamically"; exit 1
  fi
  objcopy --strip-debug "$bin" "$B/bin/fuzz_$t"
  echo "--- ldd fuzz_$t" >> "$B/MANIFEST"
  ldd "$bin" >> "$B/MANIFEST"
  while read -r name _ path _; do
    [[ $name =~ $SYSTEM ]] && continue
    [ -f "${path:-}" ] || { echo "make_bundle: fuzz_$t needs $name, not found"; exit 1; }
    cp -L "$path" "$B/lib/$name"
  done < <(ldd "$bin" | grep '=>')
  mkdir -p "$B/seeds/$t"
  for d in "$ROOT/tests/fuzz/corpus/$t" "$BUILD/corpus/$t"; do
    [ -d "$d" ] && find "$d" -maxdepth 1 -type f -size -64k -exec cp {} "$B/seeds/$t/" \;
  done
done
echo "--- carried libraries" >> "$B/MANIFEST"
ls -l "$B/lib" >> "$B/MANIFEST"
du -sh "$B"/* >> "$B/MANIFEST"
mkdir -p "$DEST"
rm -f "$DEST"/fuzz_bundle.tar.*
tar -C "$STAGE" -cf - fuzz_bundle | xz -6 -T2 > "$DEST/fuzz_bundle.tar.xz"
cp "$B/MANIFEST" "$DEST/MANIFEST"
echo "make_bundle: $DEST/fuzz_bundle.tar.xz ($(du -h "$DEST/fuzz_bundle.tar.xz" | cut -f1)," \
  "$(find "$B/seeds" -type f | wc -l) seed inputs, libraries carried: $(ls "$B/lib" | tr '\n' ' '))"
