#!/usr/bin/env bash
# Runs NIXL's own Python examples and API tests, unmodified, against Ferry's NIXL
# compatibility layer: `import nixl` resolves to ferry.compat.nixl through a shim
# package written outside the repository (python -m ferry.compat.nixl.shim).
#
#   bench/nixl/run_nixl_scripts.sh NIXL_TREE [OUT_DIR]
#
# NIXL_TREE  a NIXL source tree (a checkout of ai-dynamo/nixl; only
#            examples/python and test/python are used, read-only)
# OUT_DIR    logs and summary.txt (default: a new folder under /tmp)
#
# Environment:
#   PYTHON            interpreter with torch, numpy and pytest (default python3)
#   FERRY_PYTHONPATH  folder holding the ferry package to test (default: the
#                     ferry installed for $PYTHON)
#   NIXL_ONLY         space-separated script names to run (default: all)
#   NIXL_TIMEOUT      seconds per script (default 180)
#   NIXL_USE_CUDA=1   also run the two-peer examples with --use_cuda True (GPU memory)
#   FERRY_ETCD        etcd binary for partial_md_example.py --etcd (default: etcd on PATH)
#
# Exit status: 0 if nothing that ran failed.
set -uo pipefail

NIXL=${1:?usage: run_nixl_scripts.sh NIXL_TREE [OUT_DIR]}
NIXL=$(cd "$NIXL" && pwd)
OUT=${2:-$(mktemp -d /tmp/nixl-run.XXXXXX)}
mkdir -p "$OUT/work"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
TIMEOUT=${NIXL_TIMEOUT:-180}
[ -f "$NIXL/examples/python/basic_two_peers.py" ] || { echo "no examples/python in $NIXL" >&2; exit 2; }

export PYTHONPATH="$OUT/shim${FERRY_PYTHONPATH:+:$FERRY_PYTHONPATH}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PYTHON" -m ferry.compat.nixl.shim "$OUT/shim" >/dev/null || { echo "cannot write the shim (is ferry importable?)" >&2; exit 1; }

SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }

probe=$("$PYTHON" - <<'PY' 2>&1
import nixl, ferry
print("ferry", ferry.__version__, "nixl ->", nixl._api.__name__)
try:
    import torch
    print("TORCH", torch.__version__, "GPUS", torch.cuda.device_count() if torch.cuda.is_available() else 0)
except Exception as e:
    print("NOTORCH", repr(e))
try:
    import pytest
    print("PYTEST", pytest.__version__)
except Exception:
    print("NOPYTEST")
PY
)
note "# NIXL scripts against ferry.compat.nixl — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
note "# NIXL tree: $NIXL ($(git -C "$NIXL" rev-parse HEAD 2>/dev/null || cat "$NIXL/.nixl-commit" 2>/dev/null || echo 'not a git checkout'))"
note "# python: $("$PYTHON" -c 'import sys; print(sys.version.split()[0])') — $(tr '\n' ' ' <<<"$probe")"
case "$probe" in *"nixl -> ferry.compat.nixl._api"*) ;; *) note "FAIL: the shim does not resolve nixl to ferry.compat.nixl"; exit 1 ;; esac
HAVE_TORCH=0; GPUS=0; HAVE_PYTEST=0
case "$probe" in *TORCH\ *) HAVE_TORCH=1; GPUS=$(sed -n 's/.*GPUS \([0-9]*\).*/\1/p' <<<"$probe") ;; esac
case "$probe" in *PYTEST\ *) HAVE_PYTEST=1 ;; esac

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wanted() { [ -z "${NIXL_ONLY:-}" ] || grep -qw -- "$1" <<<"$NIXL_ONLY"; }
failed=0
verdict() {  # name log1 regex1 [log2 regex2] -- pass when every log matches and has no traceback
  local name=$1 rc=$2 t0=$3; shift 3
  local ok=1
  [ "$rc" -eq 0 ] || ok=0
  while [ $# -ge 2 ]; do
    grep -Eq -- "$2" "$1" || ok=0
    ! grep -q "^Traceback" "$1" || ok=0
    shift 2
  done
  if [ $ok = 1 ]; then note "PASS  $name ($((SECONDS - t0)) s)"
  else failed=$((failed + 1)); note "FAIL  $name (exit $rc, $((SECONDS - t0)) s) — logs in $OUT"; fi
}

two_peers() {  # script, extra args, target pass regex, initiator pass regex
  local script=$1 extra=$2 tpass=$3 ipass=$4 tag=${5:-}
  local name="$script${tag:+ $tag}"
  wanted "$script" || return
  if [ $HAVE_TORCH = 0 ]; then note "SKIP  $name — torch is not installed for $PYTHON (the example allocates torch tensors)"; return; fi
  local port t0=$SECONDS rc=0 tlog="$OUT/${script%.py}${tag:+-$tag}-target.log" ilog="$OUT/${script%.py}${tag:+-$tag}-initiator.log"
  port=$(free_port)
  (cd "$OUT/work" && timeout --kill-after=10 "$TIMEOUT" "$PYTHON" "$NIXL/examples/python/$script" \
      --mode target --ip 127.0.0.1 --port "$port" $extra) >"$tlog" 2>&1 &
  local tpid=$!
  (cd "$OUT/work" && timeout --kill-after=10 "$TIMEOUT" "$PYTHON" "$NIXL/examples/python/$script" \
      --mode initiator --ip 127.0.0.1 --port "$port" $extra) >"$ilog" 2>&1 || rc=$?
  wait $tpid || rc=$((rc ? rc : $?))
  verdict "$name" $rc $t0 "$tlog" "$tpass" "$ilog" "$ipass"
}

two_peers basic_two_peers.py "" "Test Complete" "Data verification passed"
two_peers expanded_two_peers.py "--backend UCX" "Target data verification passed" \
  "Initiator final data verification passed"
if [ "${NIXL_USE_CUDA:-0}" = 1 ]; then
  if [ "$GPUS" -ge 1 ]; then
    two_peers basic_two_peers.py "--use_cuda True" "Test Complete" "Data verification passed" cuda
    two_peers expanded_two_peers.py "--backend UCX --use_cuda True" "Target data verification passed" \
      "Initiator final data verification passed" cuda
  else
    note "SKIP  two-peer examples with --use_cuda — torch sees no CUDA GPU"
  fi
fi

if wanted partial_md_example.py; then
  t0=$SECONDS; log="$OUT/partial_md_example-socket.log"
  # The script deletes NIXL_ETCD_ENDPOINTS from its environment in socket mode: it must be set.
  (cd "$OUT/work" && NIXL_ETCD_ENDPOINTS="" timeout --kill-after=10 "$TIMEOUT" "$PYTHON" \
      "$NIXL/examples/python/partial_md_example.py" --init-port "$(free_port)" \
      --target-port "$(free_port)") >"$log" 2>&1
  verdict "partial_md_example.py (socket exchange)" $? $t0 "$log" "Correct exception" "$log" "Test Complete"
  ETCD_BIN=${FERRY_ETCD:-$(command -v etcd || true)}
  if [ -z "$ETCD_BIN" ]; then
    note "SKIP  partial_md_example.py --etcd — etcd is not installed (Debian package etcd-server)"
  else
    t0=$SECONDS; log="$OUT/partial_md_example-etcd.log"; cport=$(free_port); pport=$(free_port)
    "$ETCD_BIN" --name=nixl-run --data-dir="$OUT/etcd-data" --listen-client-urls="http://127.0.0.1:$cport" \
      --advertise-client-urls="http://127.0.0.1:$cport" --listen-peer-urls="http://127.0.0.1:$pport" \
      --initial-advertise-peer-urls="http://127.0.0.1:$pport" \
      --initial-cluster="nixl-run=http://127.0.0.1:$pport" >"$OUT/etcd.log" 2>&1 &
    etcd_pid=$!
    for _ in $(seq 100); do
      curl -s -m 1 -X POST "http://127.0.0.1:$cport/v3/kv/range" -d '{"key":"AA=="}' >/dev/null 2>&1 && break
      sleep 0.1
    done
    (cd "$OUT/work" && NIXL_ETCD_ENDPOINTS="http://127.0.0.1:$cport" NIXL_ETCD_NAMESPACE="/nixl-run-$$/agents/" \
        timeout --kill-after=10 "$TIMEOUT" "$PYTHON" "$NIXL/examples/python/partial_md_example.py" --etcd) >"$log" 2>&1
    verdict "partial_md_example.py --etcd" $? $t0 "$log" "Correct exception" "$log" "Test Complete"
    kill "$etcd_pid" 2>/dev/null; wait "$etcd_pid" 2>/dev/null
  fi
fi

if wanted query_mem_example.py; then
  t0=$SECONDS; log="$OUT/query_mem_example.log"
  (cd "$OUT/work" && timeout --kill-after=10 "$TIMEOUT" "$PYTHON" "$NIXL/examples/python/query_mem_example.py") >"$log" 2>&1
  verdict "query_mem_example.py (POSIX query of files)" $? $t0 "$log" "Example completed successfully"
fi

if wanted test_nixl_api.py; then
  if [ $HAVE_TORCH = 0 ] || [ $HAVE_PYTEST = 0 ]; then
    note "SKIP  test_nixl_api.py — it needs torch and pytest for $PYTHON"
  else
    t0=$SECONDS; log="$OUT/test_nixl_api.log"
    (cd "$OUT/work" && timeout --kill-after=10 "$TIMEOUT" "$PYTHON" -m pytest -p no:cacheprovider -rs -v \
        "$NIXL/test/python/test_nixl_api.py") >"$log" 2>&1
    rc=$?
    verdict "test_nixl_api.py ($(grep -Eo '[0-9]+ passed[^=]*' "$log" | tail -1))" $rc $t0 "$log" " passed"
    grep -E "^SKIPPED" "$log" | sed 's/^/        /' | tee -a "$SUMMARY"
  fi
fi

note "SKIP  nixl_gds_example.py, remote_storage_example/ — GPUDirect Storage and file/object backends: ferry.compat.nixl moves memory between agents (DRAM, VRAM) only"
note "SKIP  telemetry_reader.py — reads NIXL's telemetry ring files, which Ferry does not write (get_xfer_telemetry works)"
note "# $failed failed; logs in $OUT"
[ $failed -eq 0 ]
