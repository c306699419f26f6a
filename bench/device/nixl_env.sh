# shellcheck shell=bash
# Sourced by device scripts that run NIXL beside Ferry (bench/cuda_ipc/device_run.sh,
# bench/nixl/gpu_rows_run.sh): an interpreter that sees torch, with NIXL installed
# from the wheels carried in .devcarry/wheels-nixl (bench/device/prepare.sh --nixl).
#
#   nixl_env PY LOG   -- run from the repository root
# sets BPY (a venv, /tmp/cuda-ipc-venv, made with --system-site-packages, plus a
# .pth naming PY's site-packages where PY is itself a venv, as /opt/torch/.venv
# is; where `PY -m venv` fails for want of ensurepip, PY itself), NIXL_PYTHONPATH
# (where NIXL was installed instead of a venv, /tmp/cuda-ipc-site; else empty:
# give it to NIXL's processes as PYTHONPATH) and LD_LIBRARY_PATH (the
# libcudart.so.13 that UCX's CUDA modules in nixl-cu13 need: the one torch
# loads). pip's output goes to LOG. Returns 1, with the reason on stdout, where
# NIXL is not importable afterwards.
nixl_env() {
  local py=$1 log=$2 v=${BENCH_VENV:-/tmp/cuda-ipc-venv} sp cudart pip
  NIXL_PYTHONPATH=
  if { [[ -x $v/bin/python ]] || "$py" -m venv --system-site-packages "$v" >> "$log" 2>&1; } &&
     "$v/bin/python" -m pip --version > /dev/null 2>&1; then
    BPY=$v/bin/python
    if ! "$BPY" -c "import torch" 2> /dev/null; then
      sp=$("$BPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
      "$py" -c "import site; print('\n'.join(site.getsitepackages()))" > "$sp/zz-system-python3.pth"
      echo "venv: $py is itself a venv; its site-packages added by $sp/zz-system-python3.pth" >> "$log"
    fi
    pip=("$BPY" -m pip install)
  else
    BPY=$py
    NIXL_PYTHONPATH=/tmp/cuda-ipc-site
    pip=("$py" -m pip install --target "$NIXL_PYTHONPATH")
    echo "venv: '$py -m venv' failed ($(tail -n 1 "$log")); installing into $NIXL_PYTHONPATH" >> "$log"
  fi
  export NIXL_PYTHONPATH
  local ok='import torch, nixl; from nixl._api import nixl_agent, nixl_agent_config; import os; os._exit(0)'
  if ! PYTHONPATH=$NIXL_PYTHONPATH "$BPY" -c "$ok" >> "$log" 2>&1; then
    if ! ls .devcarry/wheels-nixl/nixl*.whl > /dev/null 2>&1; then
      echo "no .devcarry/wheels-nixl/*.whl (bench/device/prepare.sh --nixl here, and carry it)"
      return 1
    fi
    PIP_DISABLE_PIP_VERSION_CHECK=1 "${pip[@]}" -q --no-index --no-deps \
      --find-links .devcarry/wheels-nixl nixl nixl-cu13 >> "$log" 2>&1 ||
      { echo "nixl install failed: $(tail -n 1 "$log")"; return 1; }
  fi
  cudart=$("$BPY" - << 'PYEOF' 2> /dev/null
import glob, os, sys
for p in sys.path:
    for f in glob.glob(os.path.join(p, "nvidia", "**", "libcudart.so.13*"), recursive=True):
        print(os.path.dirname(f)); raise SystemExit
PYEOF
  )
  [[ -n "$cudart" ]] && export LD_LIBRARY_PATH=$cudart:${LD_LIBRARY_PATH:-}
  [[ -d /usr/local/cuda/lib64 ]] && export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64
  PYTHONPATH=$NIXL_PYTHONPATH "$BPY" -c "$ok" >> "$log" 2>&1 ||
    { echo "nixl: NOT importable ($log)"; return 1; }
}
