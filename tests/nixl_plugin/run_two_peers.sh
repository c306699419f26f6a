#!/usr/bin/env bash
# ctest nixl_plugin.two_peers: NIXL's Python API (the PyPI wheel) loads
# libplugin_FERRY.so through NIXL_PLUGIN_DIR and two agents, one per process,
# move bytes and notifications over it (two_peers.py says what is checked).
#
#   run_two_peers.sh PLUGIN_DIR|"" [PYTHON]
#
# PLUGIN_DIR  folder holding libplugin_FERRY.so ("" when the build has no NIXL
#             source tree)
# PYTHON      interpreter with NIXL's wheel (`pip install nixl==1.5.1`);
#             default $FERRY_NIXL_PYTHON, else python3
# Exits 77 (skipped, reason printed) without the plugin or the wheel.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PLUGIN_DIR=${1:-}
PYTHON=${2:-${FERRY_NIXL_PYTHON:-python3}}

if [ -z "$PLUGIN_DIR" ] || [ ! -f "$PLUGIN_DIR/libplugin_FERRY.so" ]; then
  echo "SKIP: libplugin_FERRY.so is not built: configure with -DFERRY_NIXL_SOURCE_DIR=<a NIXL source tree>"
  exit 77
fi
where=$("$PYTHON" -c 'import nixl._api as a, nixl_meta_utils; print(a.__file__)' 2>&1) || {
  echo "SKIP: $PYTHON has no NIXL wheel (pip install nixl==1.5.1; FERRY_NIXL_PYTHON names the interpreter): ${where##*$'\n'}"
  exit 77
}
case "$where" in *ferry*) echo "SKIP: $PYTHON resolves nixl to Ferry's shim ($where), not NIXL's wheel"; exit 77 ;; esac
echo "NIXL: $where; plugin: $PLUGIN_DIR/libplugin_FERRY.so"

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
OUT=$(mktemp -d /tmp/nixl-plugin-test.XXXXXX)
export NIXL_PLUGIN_DIR=$PLUGIN_DIR PYTHONUNBUFFERED=1
fail=0
# Twice: Ferry's automatic choice (shm between two processes of one host), then
# tcp alone (FERRY_ENGINE_TRANSPORTS), the path between hosts.
for transports in auto tcp; do
  echo "== engine.transports=$transports"
  port=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
  FERRY_ENGINE_TRANSPORTS=$transports timeout --kill-after=5 120 "$PYTHON" "$HERE/two_peers.py" \
    --role target --port "$port" --seed "$seed" >"$OUT/target.log" 2>&1 &
  tpid=$!
  wait_listening "$port" $tpid || echo "the target is not listening on $port"
  FERRY_ENGINE_TRANSPORTS=$transports timeout --kill-after=5 120 "$PYTHON" "$HERE/two_peers.py" \
    --role initiator --port "$port" --seed "$seed" >"$OUT/initiator.log" 2>&1
  irc=$?
  wait $tpid
  trc=$?
  for side in target initiator; do sed "s/^/  $side| /" "$OUT/$side.log"; done
  [ $irc -eq 0 ] && [ $trc -eq 0 ] || { echo "FAIL: exit status target $trc, initiator $irc"; fail=1; }
  for side in target initiator; do
    grep -q "^\[$side\] PASS" "$OUT/$side.log" || { echo "FAIL: $side did not pass"; fail=1; }
  done
  # Every refusal is logged by the backend, naming the thing.
  for pattern in \
    "nixl backend FERRY \(agent 'initiator'\): READ of .* with agent 'target' \(transfer [0-9]+\) failed: NotFound" \
    "unknown FERRY backend parameter 'bogus'" \
    "cannot start the Ferry engine .*tcp.streams" \
    "nixl backend FERRY \(agent 'tamper-check'\): loadRemoteMD of agent 'target' .* is not a Ferry descriptor" \
    "WRITE of .* (with|to) agent 'target'.*: PeerDisconnected" \
    "WRITE to the exited target refused: nixlRemoteDisconnectError"; do
    grep -Eq "$pattern" "$OUT/initiator.log" || { echo "FAIL: the initiator's log lacks: $pattern"; fail=1; }
  done
done
rm -rf "$OUT"
[ $fail -eq 0 ] && echo "PASS"
exit $fail
