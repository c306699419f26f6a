#!/usr/bin/env bash
# On a GPU machine (after bench/device/build.sh -DFERRY_BUILD_PYTHON=ON): the
# C++ bench (cuda_ipc only) once per copy-stream variant, then bench.py (Ferry
# vs NIXL / NCCL / copy) with the variant that did best: the lowest 4 KiB
# blocking p50 among those within 5 % of the best "4096 x 4 KiB adjacent"
# throughput. Each line of VARIANTS is "NAME VAR=VALUE ..."; output in
# $OUT/variants.txt, then what device_run.sh writes.
#   BUILD=build-dev bench/cuda_ipc/variants_then_bench.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
O=${OUT:-/tmp/out}
B=${BUILD:-build-dev}
mkdir -p "$O"
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
dev=0
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && dev=1
VARIANTS=${VARIANTS:-"blocking_stream FERRY_COPY_AFTER_DEFAULT=blocking
query_legacy FERRY_COPY_AFTER_DEFAULT=query
blocking_batch_of_one FERRY_COPY_AFTER_DEFAULT=blocking FERRY_COPY_BATCH_OF_ONE=1"}
: > "$O/variants.txt"
while read -r name vars; do
  [ -z "$name" ] && continue
  echo "== $name ($vars)" >> "$O/variants.txt"
  # shellcheck disable=SC2086
  env $vars FERRY_TEST_PEER_DEVICE=$dev timeout 120 "$B/tests/gpu/ferry-cuda-ipc-bench" --no-tcp \
    --trace --iters ${ITERS:-2000} 2>&1 | grep -v '^setup' >> "$O/variants.txt"
done <<< "$VARIANTS"
pick=$(python3 - "$O/variants.txt" <<'PY'
import re, sys
rows, name = {}, None
for line in open(sys.argv[1]):
    m = re.match(r"== (\S+) \((.*)\)", line)
    if m:
        name = m.group(1); rows[name] = {"vars": m.group(2)}
    elif name and line.startswith("4096 B "):
        rows[name]["lat"] = float(line.split()[2])
    elif name and line.startswith("4096 x 4 KiB adjacent"):
        rows[name]["tput"] = float(line.split()[5])
ok = {k: v for k, v in rows.items() if "lat" in v and "tput" in v}
best = max(v["tput"] for v in ok.values())
name = min((k for k, v in ok.items() if v["tput"] >= 0.95 * best), key=lambda k: ok[k]["lat"])
for k, v in ok.items():
    print(f"# {k}: 4 KiB p50 {v['lat']} us, 4096 x 4 KiB adjacent {v['tput']} GB/s", file=sys.stderr)
print(ok[name]["vars"])
PY
)
echo "picked: $pick" | tee -a "$O/variants.txt"
# shellcheck disable=SC2086
env $pick FERRY_PYTHONPATH=$PWD/$B/python bench/cuda_ipc/device_run.sh
