#!/usr/bin/env bash
# Connect by address against connect by metadata, same host, host memory: the
# same ferry-bench workload (two processes, --spawn-local) connected both ways,
# alternating per round, so that any difference in what the connection reaches
# shows up as a ratio from the same run.
#
#   bench/connect_by_address.sh [ROUNDS] [extra ferry-bench arguments]
#   default workload: write, 1 MiB blocks, 8 calls in flight, 2 s per run
#
# Prints each round's GB/s and carrier, then the medians and the ratio
# address / metadata (floor: 0.95, issue 31).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BENCH=${FERRY_BENCH:-build/tools/ferry-bench}
ROUNDS=${1:-5}
shift || true
ARGS=(--spawn-local --op write --block-size 1MiB --depth 8 --time 2 --json --quiet "$@")
[ -x "$BENCH" ] || { echo "no $BENCH (ninja -C build ferry-bench)" >&2; exit 1; }
echo "# connect by address vs by metadata: $BENCH ${ARGS[*]}"
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD), $(nproc) CPUs"
python3 - "$BENCH" "$ROUNDS" "${ARGS[@]}" <<'PY'
import json, statistics, subprocess, sys
bench, rounds, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
got = {"metadata": [], "address": []}
for r in range(rounds):
    order = ("metadata", "address") if r % 2 == 0 else ("address", "metadata")
    for how in order:
        out = subprocess.run([bench, *args, "--connect-by", how], check=True,
                             capture_output=True, text=True).stdout
        j = [json.loads(l) for l in out.splitlines() if l.startswith("{")][-1]
        got[how].append(j["gbps"])
        print(f"round {r + 1} {how:8s} {j['gbps']:7.3f} GB/s  p50 {j['p50_us']:8.1f} us  "
              f"carrier {j['transport']}", flush=True)
m, a = statistics.median(got["metadata"]), statistics.median(got["address"])
print(f"median: by metadata {m:.3f} GB/s, by address {a:.3f} GB/s, address/metadata {a / m:.3f}")
PY
