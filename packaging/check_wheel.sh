#!/usr/bin/env bash
# Checks a built wheel the way a user gets it: a fresh venv outside the source
# tree, `pip install <wheel>` (numpy, its one dependency, comes from the package
# index or pip's cache), then from a directory outside the source tree
#   - packaging/smoke_test.py: import, versions, CUDA answer, two engines
#     moving 1 MiB host->host;
#   - with --full: the repository's Python suite (tests/python, copied out of
#     the tree) against the installed package.
# usage: packaging/check_wheel.sh [--full] dist/ferry-<version>-<tags>.whl
# FERRY_CHECK_PYTHON picks the interpreter (default python3); it must match the
# wheel's Python tag. FERRY_CHECK_KEEP=1 keeps the temporary directory.
set -euo pipefail
full=0
if [ "${1:-}" = "--full" ]; then full=1; shift; fi
if [ $# -ne 1 ] || [ ! -f "$1" ]; then
  echo "usage: $0 [--full] WHEEL" >&2
  exit 2
fi
SRC=$(cd "$(dirname "$0")/.." && pwd -P)
WHEEL=$(cd "$(dirname "$1")" && pwd -P)/$(basename "$1")
PYTHON=${FERRY_CHECK_PYTHON:-python3}
log() { printf '\033[1m[check_wheel]\033[0m %s\n' "$*" >&2; }

TMP=$(mktemp -d "${TMPDIR:-/tmp}/ferry-wheel-check.XXXXXX")
TMP=$(cd "$TMP" && pwd -P)
case "$TMP/" in
  "$SRC"/*) echo "check_wheel: temporary directory $TMP is inside the source tree" >&2; exit 1 ;;
esac
if [ "${FERRY_CHECK_KEEP:-0}" = 1 ]; then
  log "keeping $TMP"
else
  trap 'rm -rf "$TMP"' EXIT
fi

log "fresh venv in $TMP/venv ($($PYTHON --version 2>&1))"
"$PYTHON" -m venv "$TMP/venv"
PY="$TMP/venv/bin/python"
log "pip install $(basename "$WHEEL")"
"$PY" -m pip install -q --disable-pip-version-check "$WHEEL"

# Nothing from the source tree or the caller's environment on the path: run
# from $TMP, isolated mode (-I: no PYTHONPATH, no user site, no script dir).
cp "$SRC/packaging/smoke_test.py" "$TMP/smoke_test.py"
cd "$TMP"
status=0

# What the installed binaries need: nothing outside the wheel but the
# manylinux policy's system libraries, and never the CUDA driver.
SITE=$("$PY" -I -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
if command -v readelf >/dev/null; then
  needed=$(find "$SITE/ferry" "$SITE/ferry.libs" -name '*.so*' -type f 2>/dev/null \
             -exec readelf -d {} \; | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u | tr '\n' ' ')
  log "the installed binaries need: $needed"
  case " $needed " in
    *" libcuda.so"*) log "FAIL: a library of the wheel links the CUDA driver (libcuda)"; status=1 ;;
  esac
fi

log "smoke test (from $TMP)"
env -u PYTHONPATH -u FERRY_PYTHONPATH "$PY" -I -u "$TMP/smoke_test.py" || status=$?

if [ $full = 1 ]; then
  log "installing pytest into the venv for the Python suite"
  "$PY" -m pip install -q --disable-pip-version-check pytest
  cp -r "$SRC/tests/python" "$TMP/tests"
  rm -rf "$TMP/tests/__pycache__"
  # The suite's conftest puts only its own directory (helpers such as
  # peer_proc.py) on sys.path; FERRY_PYTHONPATH stays unset, so `import ferry`
  # must find the installed package, checked first.
  env -u PYTHONPATH -u FERRY_PYTHONPATH "$PY" -I -c '
import os, sys, sysconfig, ferry
site = os.path.realpath(sysconfig.get_paths()["purelib"])
assert os.path.realpath(ferry.__file__).startswith(site + os.sep), ferry.__file__
print("pytest will import ferry from", os.path.dirname(ferry.__file__))' || status=1
  log "Python suite against the installed wheel (from $TMP)"
  env -u PYTHONPATH -u FERRY_PYTHONPATH "$PY" -m pytest -q -p no:cacheprovider \
    --rootdir="$TMP/tests" --import-mode=importlib "$TMP/tests" || status=$?
fi
if [ $status = 0 ]; then log "passed: $(basename "$WHEEL")"; else log "FAILED: $(basename "$WHEEL")"; fi
exit $status
