#!/usr/bin/env bash
# On the GPU device machine (no network; many idle cores): Ferry's Python module
# built from this tree (CUDA off: host memory only), NIXL from the carried wheels,
# iperf3 from carried Debian packages, then bench/peers/bench.py with the
# arguments given; the table and the results into $OUT.
#
#   run(kind="nvidia-h100-x2",
#       carry=[".devcarry/root", ".devcarry/wheels-nixl", ".devcarry/debs-iperf"],
#       command="PEERS_COMMIT=abc1234 bench/peers/device_run.sh -r 3 --secs 1 --grouped ...")
#
# Here beforehand: bench/device/prepare.sh --nixl (root/, wheels-nixl/) and
#   (cd .devcarry && mkdir -p debs-iperf && cd debs-iperf && apt-get download iperf3 libiperf0 libsctp1)
# --place netns needs `ip` (iproute2), which the device machines lack: carry .devcarry/debs-ip too,
#   (cd .devcarry && mkdir -p debs-ip && cd debs-ip && apt-get download iproute2 libmnl0 libbpf1 \
#      libelf1 libcap2 libxtables12 libtirpc3 libbsd0 libmd0 libdb5.3)
# Mooncake has no wheel carried: its rows are NOT RUN there. --place netns (two network
# namespaces over a veth pair, bench/netns.py) needs root and `ip` there.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
ROOT=$PWD
O=${OUT:-/tmp/out}
mkdir -p "$O"
t0=$SECONDS
PY=$(command -v "${PYTHON:-python3}")
{ echo "nproc $(nproc)"; lscpu | grep -E 'Model name|Socket|NUMA node\(s\)|^CPU\(s\)'; uname -r; free -g | head -2
  echo "python3 $PY"; } > "$O/machine.txt" 2>&1
cat "$O/machine.txt"

export LD_LIBRARY_PATH=$ROOT/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
B=${FERRY_BUILD:-/tmp/b-peers}
BUILD=$B TARGETS="ferry_python_devtree" bench/device/build.sh -DFERRY_BUILD_PYTHON=ON \
  -DFERRY_BUILD_TESTS=OFF -DFERRY_BUILD_TOOLS=OFF -DFERRY_WITH_CUDA=OFF -DPython_EXECUTABLE="$PY" \
  > "$O/build.txt" 2>&1 || { echo "BUILD FAILED"; tail -40 "$O/build.txt"; exit 1; }
echo "ferry built in $((SECONDS - t0)) s"
export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}

T=/tmp/peers-site
PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install -q --target "$T" --no-index --no-deps \
  --find-links .devcarry/wheels-nixl nixl nixl-cu13 > "$O/pip.txt" 2>&1 ||
  echo "nixl install failed (NIXL will be NOT RUN): $(tail -n 1 "$O/pip.txt")"
export PYTHONPATH=$PYTHONPATH:$T

D=/tmp/peers-iperf
mkdir -p "$D"
for d in .devcarry/debs-iperf/*.deb; do [ -f "$d" ] && dpkg -x "$d" "$D"; done
export PATH=$D/usr/bin:$PATH LD_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
if ! command -v ip > /dev/null && ls .devcarry/debs-ip/*.deb > /dev/null 2>&1; then
  I=/tmp/peers-iproute2
  mkdir -p "$I"
  for d in .devcarry/debs-ip/*.deb; do dpkg -x "$d" "$I"; done
  export PATH=$PATH:$I/bin:$I/sbin:$I/usr/bin:$I/usr/sbin
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$I/lib/x86_64-linux-gnu:$I/usr/lib/x86_64-linux-gnu
fi
echo "set up in $((SECONDS - t0)) s"

date=$(date -u +%Y%m%dT%H%M%SZ)
"$PY" bench/peers/bench.py "$@" --json "$O/peers-$date-${PEERS_COMMIT:-nogit}.jsonl" 2>&1 | tee "$O/bench.txt"
echo "done in $((SECONDS - t0)) s"
