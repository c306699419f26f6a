#!/usr/bin/env bash
# Blocking 4 KiB tcp writes between two network namespaces (bench/netns.py:
# a veth pair, as between two hosts), tcp.serve_poll_us at its default and at
# 0 alternated, on an idle machine and beside 1 and 2 CPU hogs. Needs root and
# iproute2; ferry-bench from BUILD (default build).
#   bench/tcp_serve_poll.sh [rounds] [hog counts, e.g. "0 1 2"]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
B=${BUILD:-build}
ROUNDS=${1:-3}
HOGS=${2:-"0 1 2"}
INFO=$(mktemp)
python3 -c "import sys; sys.path.insert(0, 'bench'); import netns; netns.up()" || exit 1
cleanup() {
  pkill -f "ferry-bench --role target --forever --info-file $INFO" 2> /dev/null
  [ -n "${HOG_PIDS:-}" ] && kill $HOG_PIDS 2> /dev/null
  python3 -c "import sys; sys.path.insert(0, 'bench'); import netns; netns.down()"
  rm -f "$INFO"
}
trap cleanup EXIT
one() {  # $1: options for both sides
  : > "$INFO"
  # shellcheck disable=SC2086
  ip netns exec ferryabA "$B/tools/ferry-bench" --role target --forever --info-file "$INFO" \
    --listen 10.78.78.1:0 -o engine.transports=tcp $1 -q > /dev/null 2>&1 &
  local target=$!
  for _ in $(seq 100); do [ -s "$INFO" ] && break; sleep 0.05; done
  # shellcheck disable=SC2086
  ip netns exec ferryabB "$B/tools/ferry-bench" --role initiator --peer "$INFO" -s 4KiB -n 5000 \
    --listen 10.78.78.2:0 -o engine.transports=tcp $1 -q 2>&1 | tail -1
  kill "$target" 2> /dev/null
  wait "$target" 2> /dev/null
}
echo "# blocking 4 KiB tcp write between two network namespaces, $(nproc) CPUs, $(git rev-parse --short HEAD)"
echo "# columns: hogs round setting | op block batch threads depth iters GB/s p50(us) p99(us)"
for hogs in $HOGS; do
  HOG_PIDS=""
  for _ in $(seq 1 "$hogs"); do
    yes > /dev/null &
    HOG_PIDS="$HOG_PIDS $!"
  done
  sleep 0.5
  for r in $(seq 1 "$ROUNDS"); do
    echo "$hogs $r default    | $(one "")"
    echo "$hogs $r serve0     | $(one "-o tcp.serve_poll_us=0")"
  done
  [ -n "$HOG_PIDS" ] && kill $HOG_PIDS 2> /dev/null
  wait 2> /dev/null
  HOG_PIDS=""
done
