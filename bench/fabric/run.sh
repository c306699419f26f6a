#!/usr/bin/env bash
# Ferry over the fabric transport (tcp;ofi_rxm) against the provider's own
# ceiling (a raw fi_write loop, raw_fi_write.cc) and Ferry's tcp transport,
# one invocation: 4 KiB / 64 KiB / 1 MiB / 16 MiB writes, 16 in flight,
# GB/s and ratios. Measure on a quiet machine (uptime load < 1.5).
#
#   bench/fabric/run.sh [build dir, default build-fabric] [seconds per cell, default 2]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build-fabric}
SECS=${2:-2}
PROVIDER=${FERRY_FABRIC_PROVIDER:-tcp;ofi_rxm}
OUT=$(mktemp -d)
g++ -O2 -std=c++20 "$ROOT/bench/fabric/raw_fi_write.cc" -o "$OUT/raw_fi_write" -lfabric
echo "load: $(uptime)"
"$OUT/raw_fi_write" "$PROVIDER" 16 "$SECS" delivery | tee "$OUT/raw.txt"
"$OUT/raw_fi_write" "$PROVIDER" 16 "$SECS" transmit | tee "$OUT/raw_tx.txt"
BENCH="$BUILD/tools/ferry-bench"
common=(--spawn-local --op write -s 4KiB,64KiB,1MiB,16MiB -d 16 --time "$SECS" --json -q)
"$BENCH" "${common[@]}" -o engine.transports=fabric,tcp -o fabric.provider="$PROVIDER" >"$OUT/fabric.json"
"$BENCH" "${common[@]}" -o engine.transports=tcp >"$OUT/tcp.json"
python3 - "$OUT" <<'PY'
import json, sys, re
out = sys.argv[1]
def raw(name):
    d = {}
    for line in open(f"{out}/{name}"):
        m = re.match(r"size (\d+) GB/s ([\d.]+)", line)
        if m: d[int(m.group(1))] = float(m.group(2))
    return d
def ferry(name):
    d = {}
    for line in open(f"{out}/{name}"):
        line = line.strip()
        if not line.startswith("{"): continue
        j = json.loads(line)
        d[j["block_size"]] = (j["gbps"], j.get("transport"))
    return d
r, rt, f, t = raw("raw.txt"), raw("raw_tx.txt"), ferry("fabric.json"), ferry("tcp.json")
print("| block | raw fi_write (delivery) | raw fi_write (transmit) | Ferry fabric | Ferry tcp | fabric/raw (delivery) | fabric/raw (transmit) | fabric/tcp |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for size, label in [(4096, "4 KiB"), (65536, "64 KiB"), (1 << 20, "1 MiB"), (16 << 20, "16 MiB")]:
    fb, ft = f.get(size, (0, "?")), t.get(size, (0, "?"))
    print(f"| {label} | {r.get(size,0):.2f} | {rt.get(size,0):.2f} | {fb[0]:.2f} ({fb[1]}) | {ft[0]:.2f} ({ft[1]}) | "
          f"{fb[0]/max(r.get(size,1e-9),1e-9):.2f} | {fb[0]/max(rt.get(size,1e-9),1e-9):.2f} | {fb[0]/max(ft[0],1e-9):.2f} |")
PY
rm -rf "$OUT"
