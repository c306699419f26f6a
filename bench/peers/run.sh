#!/usr/bin/env bash
# Ferry against NIXL (UCX; its fastest configuration, the initiator without a
# progress thread, and its default beside it), Mooncake Transfer Engine and one
# iperf3 stream on this host: two processes per measurement, host memory,
# one-sided WRITE and READ, several calls in flight; engines alternate, medians
# of 3 rounds with their spread. One command:
#
#   bench/peers/run.sh                 # full run (about 10 minutes on 2 cores)
#   bench/peers/run.sh --quick         # smoke run: 1 repetition, 0.5 s per run
#   bench/peers/run.sh --json          # also bench/results/peers-DATE-COMMIT.jsonl + docs/peers.png
#
# Options (passed to bench.py): -r/--reps N, --secs S, --warmup S, -d/--depth N,
#   --engines "Ferry,NIXL,...", --workloads "1MiB x 8,...", --ops write, --grouped,
#   --place netns (two network namespaces over veth; root; tcp rows and iperf3 only),
#   --json [PATH]; and here: --no-plot, --no-setup
#   (use build/peers-venv as it is).
# Set-up (skipped when done): a venv in build/peers-venv with nixl (its UCX
# backend; installed without torch, which only its GPU paths use),
# mooncake-transfer-engine-non-cuda, numpy, matplotlib, and Ferry's own Python
# package built from this tree (rebuilt when the sources changed).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/build/peers-venv"
PY="$VENV/bin/python"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
log() { echo "[peers] $*" >&2; }

SETUP=1 PLOT=1 JSON=0 ARGS=()
for a in "$@"; do
  case "$a" in
    --no-setup) SETUP=0 ;;
    --no-plot) PLOT=0 ;;
    -h|--help) sed -n '2,22p' "$0"; exec python3 "$ROOT/bench/peers/bench.py" --help ;;
    *) [[ "$a" == --json* ]] && JSON=1; ARGS+=("$a") ;;
  esac
done

setup() {
  # Debian: the Ferry build (as in ferry.sh), libibverbs, which Mooncake's
  # engine links even for tcp, and iperf3 (the single-stream reference).
  local need=()
  for p in build-essential cmake ninja-build pkg-config libspdlog-dev \
      libfmt-dev python3-venv python3-dev libibverbs1 iperf3; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
  done
  if [[ ${#need[@]} -gt 0 ]]; then
    log "installing Debian packages: ${need[*]}"
    local sudo=""; [[ $(id -u) -eq 0 ]] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi

  [[ -x "$PY" ]] || { log "creating $VENV"; python3 -m venv "$VENV"; }
  "$PY" -c "import numpy, matplotlib, nanobind, scikit_build_core" 2>/dev/null ||
    { log "installing numpy matplotlib (and Ferry's build tools)"; "${PIP[@]}" numpy matplotlib "scikit-build-core>=0.10" "nanobind>=2.4"; }
  "$PY" -c "import mooncake.engine" 2>/dev/null ||
    { log "installing mooncake-transfer-engine-non-cuda"; "${PIP[@]}" mooncake-transfer-engine-non-cuda ||
      log "mooncake install failed (reported in the table)"; }

  # NIXL: the `nixl` meta package requires nixl-cu12 AND nixl-cu13, and each
  # requires torch with its CUDA libraries (GBs); the UCX backend on host memory
  # needs none of it. Install the meta package and one backend without deps.
  # (os._exit: NIXL 1.5.1 crashes in a library's exit handler, after all work.)
  local nixl_ok='from nixl._api import nixl_agent, nixl_agent_config; nixl_agent("probe", nixl_agent_config(backends=["UCX"])); import os; os._exit(0)'
  if ! "$PY" -c "$nixl_ok" >/dev/null 2>&1; then
    for variant in nixl-cu13 nixl-cu12; do
      log "installing nixl + $variant (--no-deps: no torch)"
      if "${PIP[@]}" --no-deps nixl "$variant" && "$PY" -c "$nixl_ok" >/dev/null 2>&1; then
        echo "$variant" >"$VENV/nixl-variant"; break
      fi
      log "$variant does not import here"; "$VENV/bin/pip" uninstall -q -y "$variant" || true
    done
  fi

  # Ferry: rebuilt when HEAD or the working tree's sources differ from the last build.
  local stamp
  stamp=$( (git -C "$ROOT" rev-parse HEAD; git -C "$ROOT" diff HEAD -- src include python CMakeLists.txt \
    pyproject.toml cmake 2>/dev/null) | sha1sum | cut -c1-16)
  if [[ "$(cat "$VENV/ferry-stamp" 2>/dev/null)" != "$stamp" ]] || ! "$PY" -c "import ferry" 2>/dev/null; then
    log "building Ferry's Python package into the venv (build dir build/peers-py)"
    if "${PIP[@]}" --no-build-isolation -Cbuild-dir="$ROOT/build/peers-py" "$ROOT" >"$ROOT/build/peers-pip.log" 2>&1; then
      echo "$stamp" >"$VENV/ferry-stamp"
    else
      log "Ferry build failed (build/peers-pip.log: $(tail -n 1 "$ROOT/build/peers-pip.log"));" \
        "$("$PY" -c 'import ferry' 2>/dev/null && echo 'using the Ferry installed before' || echo 'Ferry will be NOT RUN')"
    fi
  fi
}

[[ $SETUP -eq 1 ]] && setup
[[ -x "$PY" ]] || { echo "run.sh: no $PY (run without --no-setup)" >&2; exit 1; }

status=0
"$PY" "$ROOT/bench/peers/bench.py" "${ARGS[@]}" || status=$?
if [[ $JSON -eq 1 && $PLOT -eq 1 ]]; then
  "$PY" "$ROOT/bench/peers/plot.py" || log "plot failed"
fi
exit $status
