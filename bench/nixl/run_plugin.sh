#!/usr/bin/env bash
# Runs NIXL's own Python API -- the `nixl` wheel from PyPI, not
# ferry.compat.nixl -- on Ferry's NIXL backend plugin, libplugin_FERRY.so,
# loaded through NIXL_PLUGIN_DIR with backends=["FERRY"]:
# its vtable compared with the wheel's POSIX plugin (check_plugin_abi.py), then,
# each with Ferry's automatic transport choice and with tcp alone:
#   1. tests/nixl_plugin/two_peers.py: two agents in two processes, READ of 64
#      shuffled pieces with a notification, WRITE with a notification, repost,
#      refusals (a deregistered region, unknown parameters); every byte checked;
#   2. NIXL's examples/python/expanded_two_peers.py --backend FERRY, unmodified
#      (needs torch for $PYTHON);
#   basic_two_peers.py takes no backend argument (its agents ask for UCX), so it
#   cannot name FERRY and is skipped, saying so.
#
#   bench/nixl/run_plugin.sh NIXL_TREE [PLUGIN_DIR] [OUT_DIR]
#
# NIXL_TREE   the NIXL source tree the plugin was built against (cmake
#             -DFERRY_NIXL_SOURCE_DIR=NIXL_TREE); its examples/python is read
# PLUGIN_DIR  folder holding libplugin_FERRY.so (default build/nixl_plugins)
# OUT_DIR     logs and summary.txt (default: a new folder under /tmp)
# Environment: PYTHON, an interpreter with NIXL's wheel (pip install nixl==1.5.1)
#   and, for the NIXL example, torch (default python3); NIXL_TIMEOUT seconds per
#   run (default 180).
# Exit status: 0 if nothing that ran failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
NIXL=$(cd "${1:?usage: run_plugin.sh NIXL_TREE [PLUGIN_DIR] [OUT_DIR]}" && pwd)
PLUGIN_DIR=$(cd "${2:-$ROOT/build/nixl_plugins}" && pwd) || exit 2
OUT=${3:-$(mktemp -d /tmp/nixl-plugin-run.XXXXXX)}
mkdir -p "$OUT/work" && OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
TIMEOUT=${NIXL_TIMEOUT:-180}
[ -f "$PLUGIN_DIR/libplugin_FERRY.so" ] || { echo "no libplugin_FERRY.so in $PLUGIN_DIR" >&2; exit 2; }
export NIXL_PLUGIN_DIR=$PLUGIN_DIR PYTHONUNBUFFERED=1

SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
probe=$("$PYTHON" - <<'PY' 2>&1
import importlib.metadata as md, nixl._api as a
print("nixl", md.version("nixl") if any(d.metadata["Name"] == "nixl" for d in md.distributions()) else "?", "from", a.__file__)
try:
    import torch
    print("TORCH", torch.__version__)
except Exception as e:
    print("NOTORCH", type(e).__name__)
PY
)
note "# NIXL's Python API on libplugin_FERRY.so — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
note "# NIXL tree: $NIXL ($(git -C "$NIXL" rev-parse HEAD 2>/dev/null || cat "$NIXL/.nixl-commit" 2>/dev/null || echo 'not a git checkout'))"
note "# plugin: $PLUGIN_DIR/libplugin_FERRY.so; python: $PYTHON — $(tr '\n' ' ' <<<"$probe")"
# The first line says where nixl came from; a later "NOTORCH ModuleNotFoundError" is no failure.
first=${probe%%$'\n'*}
case "$first" in "nixl "*" from "*ferry*|Traceback*|*Error*) note "FAIL: $PYTHON does not import NIXL's wheel"; exit 1 ;; "nixl "*) ;; *) note "FAIL: $PYTHON does not import NIXL's wheel"; exit 1 ;; esac

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# The target's NIXL listener must be up before the initiator sends its metadata
# there (NIXL sends it once): wait for the port to listen, without connecting.
wait_listening() {  # port pid
  for _ in $(seq 600); do
    [ -n "$(ss -ltnH "sport = :$1" 2>/dev/null)" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
failed=0
verdict() {  # name rc t0 log1 regex1 [log2 regex2]
  local name=$1 rc=$2 t0=$3 ok=1; shift 3
  [ "$rc" -eq 0 ] || ok=0
  while [ $# -ge 2 ]; do
    grep -Eq -- "$2" "$1" || ok=0
    ! grep -q "^Traceback" "$1" || ok=0
    shift 2
  done
  if [ $ok = 1 ]; then note "PASS  $name ($((SECONDS - t0)) s)"
  else failed=$((failed + 1)); note "FAIL  $name (exit $rc, $((SECONDS - t0)) s) — logs in $OUT"; fi
}
two_procs() {  # name, script, target args, initiator args, target regex, initiator regex
  local name=$1 script=$2 targs=$3 iargs=$4 tre=$5 ire=$6 t0=$SECONDS rc=0
  local base=${name%% *}; base=${base%.py}-${FERRY_ENGINE_TRANSPORTS:-auto}
  local tlog="$OUT/$base-target.log" ilog="$OUT/$base-initiator.log"
  (cd "$OUT/work" && timeout --kill-after=10 "$TIMEOUT" "$PYTHON" "$script" $targs) >"$tlog" 2>&1 &
  local tpid=$!
  local tport=${targs##*--port }; tport=${tport%% *}
  wait_listening "$tport" $tpid || note "      the target is not listening on $tport"
  (cd "$OUT/work" && timeout --kill-after=10 "$TIMEOUT" "$PYTHON" "$script" $iargs) >"$ilog" 2>&1 || rc=$?
  wait $tpid || rc=$((rc ? rc : $?))
  verdict "$name" $rc $t0 "$tlog" "$tre" "$ilog" "$ire"
}

# The plugin's vtable against the wheel's own POSIX plugin (check_plugin_abi.py).
wheel_plugins=$("$PYTHON" -c 'import nixl._api as a, pathlib; p = pathlib.Path(a.__file__).parent; print(p.parent / f".{p.name}.mesonpy.libs" / "plugins")')
t0=$SECONDS
"$PYTHON" "$ROOT/bench/nixl/check_plugin_abi.py" "$wheel_plugins" "$PLUGIN_DIR/libplugin_FERRY.so" >"$OUT/abi.log" 2>&1
verdict "ABI: FERRY's backend vtable slot by slot against the wheel's libplugin_POSIX.so ($(grep -o '[0-9]* slots' "$OUT/abi.log" | head -1))" $? $t0 "$OUT/abi.log" "vtables agree"

# Each twice: Ferry's automatic transport choice (shm, two processes of one
# host), then tcp alone (FERRY_ENGINE_TRANSPORTS=tcp), the path between hosts.
for transports in auto tcp; do
  export FERRY_ENGINE_TRANSPORTS=$transports
  port=$(free_port); seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
  two_procs "two_peers.py [$transports]" "$ROOT/tests/nixl_plugin/two_peers.py" \
    "--role target --port $port --seed $seed" "--role initiator --port $port --seed $seed" \
    "^\[target\] PASS" "^\[initiator\] PASS"
  case "$probe" in
    *TORCH\ *)
      port=$(free_port)
      two_procs "expanded_two_peers.py --backend FERRY [$transports]" \
        "$NIXL/examples/python/expanded_two_peers.py" \
        "--mode target --ip 127.0.0.1 --port $port --backend FERRY" \
        "--mode initiator --ip 127.0.0.1 --port $port --backend FERRY" \
        "Target data verification passed" "Initiator final data verification passed" ;;
    *) note "SKIP  expanded_two_peers.py --backend FERRY [$transports] — torch is not installed for $PYTHON (the example allocates torch tensors)" ;;
  esac
done
unset FERRY_ENGINE_TRANSPORTS
note "SKIP  basic_two_peers.py — it takes no backend argument: its agents ask for NIXL's default backend (UCX), so it cannot run on FERRY unmodified"
note "# $failed failed; logs in $OUT"
[ $failed -eq 0 ]
