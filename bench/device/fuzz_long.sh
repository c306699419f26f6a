#!/usr/bin/env bash
# On the device machine (many cores, no clang): every fuzz target until it has
# executed FUZZ_RUNS inputs (default 10^7), all targets at once over every
# core, within a hard time limit. The targets come prebuilt (clang, libFuzzer,
# ASan + UBSan) in the bundle tests/fuzz/make_bundle.sh makes here:
#   tests/fuzz/make_bundle.sh        # -> .devcarry/fuzz/fuzz_bundle.tar.xz
#   run(command="bench/device/fuzz_long.sh", carry=[".devcarry/fuzz"])
#
# How it runs (docs/reliability.md, "Long runs"):
# 1. Calibration: each target alone in one process for FUZZ_CALIBRATE s
#    (default 15), all at once, from the kept inputs (tests/fuzz/corpus/<t>/,
#    the bundle's seeds/<t>/): its executions per second.
# 2. The cores (nproc, or FUZZ_CORES) are shared out by the work each target
#    has left (executions still to do / its rate, in core-seconds; a tcp
#    target's worker counts as FUZZ_TCP_CORES cores, default 2: the engine it
#    speaks to has threads of its own): a target one worker finishes in time
#    gets one, the others share the rest, at least one worker each. Each target then runs as libFuzzer's
#    -jobs=W -workers=W: W processes sharing one corpus directory, each with
#    -runs=ceil(left / W), all stopped by -max_total_time at the deadline.
# Executions are counted as the sum, over the calibration run and every
# worker, of the "stat::number_of_executed_units" libFuzzer prints when a
# process ends (-print_final_stats=1); a worker that did not print it (killed)
# is counted by its last "#N" status line, and the table says so.
#
# FUZZ_SECONDS (default 480): fuzzing time in all, calibration included; the
# script ends about 30 s after it. FUZZ_TARGETS (names without fuzz_) picks
# some. FUZZ_DETECT_LEAKS=0 turns LeakSanitizer off where the machine refuses
# it (it needs ptrace; the summary says when a report is LeakSanitizer's own
# failure). Results in $OUT: fuzz_summary.md (the table and the machine),
# fuzz_logs.tar.gz (every log), fuzz_corpus.tar.gz (the corpora at the end),
# fuzz_artifacts.tar.gz (crash, leak, timeout and out-of-memory inputs, only
# when there are some). Exit status 1 when a target crashed or fell short.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
ROOT=$PWD
T0=$SECONDS
O=${OUT:-/tmp/out}
mkdir -p "$O"
RUNS=${FUZZ_RUNS:-10000000}
BUDGET=${FUZZ_SECONDS:-480}
CAL=${FUZZ_CALIBRATE:-15}
CORES=${FUZZ_CORES:-$(nproc)}
TCP_CORES=${FUZZ_TCP_CORES:-2}
TARGETS=${FUZZ_TARGETS:-codecs tcp_handshake tcp_frames tcp_wire shm_wire cuda_ipc_wire fabric_wire}
BUNDLE=${FUZZ_BUNDLE:-$ROOT/.devcarry/fuzz/fuzz_bundle.tar.xz}
W=${FUZZ_WORK:-/tmp/ferry-fuzz-long}

rm -rf "$W"
mkdir -p "$W"
[ -f "$BUNDLE" ] || { echo "fuzz_long: $BUNDLE is missing (tests/fuzz/make_bundle.sh here, carry .devcarry/fuzz)"; exit 1; }
if command -v xz > /dev/null; then
  tar -C "$W" -xJf "$BUNDLE"
else  # Python's standard library reads .tar.xz where xz-utils is absent
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$BUNDLE" "$W"
fi || { echo "fuzz_long: cannot unpack $BUNDLE"; exit 1; }
B=$W/fuzz_bundle
export LD_LIBRARY_PATH=$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Reports name functions without llvm-symbolizer where addr2line is there.
export ASAN_OPTIONS=${ASAN_OPTIONS:-allow_addr2line=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
COMMON=(-max_len=16384 -timeout=10 -rss_limit_mb=4096 -print_final_stats=1)
[ "${FUZZ_DETECT_LEAKS:-1}" = 0 ] && COMMON+=(-detect_leaks=0)
mkdir -p "$W/artifacts" "$W/logs"

for t in $TARGETS; do
  [ -x "$B/bin/fuzz_$t" ] || { echo "fuzz_long: the bundle has no fuzz_$t"; exit 1; }
  if ldd "$B/bin/fuzz_$t" | grep -q "not found"; then
    echo "fuzz_long: fuzz_$t needs libraries neither the bundle nor this machine has:"
    ldd "$B/bin/fuzz_$t" | grep "not found"
    exit 1
  fi
  mkdir -p "$W/corpus/$t" "$W/run/$t/cal" "$W/run/$t/main"
done

# Sum of executed units over the logs given; a log without final stats adds
# its last "#N" line and counts as killed. Prints "execs killed peak_rss_mb".
count() {
  local execs=0 killed=0 rss=0 f n r
  for f in "$@"; do
    [ -f "$f" ] || continue
    n=$(grep -a "stat::number_of_executed_units" "$f" | tail -1 | awk '{print $2}')
    if [ -z "$n" ]; then
      n=$(grep -aoE '^#[0-9]+' "$f" | tail -1 | tr -d '#')
      [ -n "$n" ] && killed=$((killed + 1))
    fi
    execs=$((execs + ${n:-0}))
    r=$(grep -a "stat::peak_rss_mb" "$f" | tail -1 | awk '{print $2}')
    [ -n "$r" ] && [ "$r" -gt "$rss" ] && rss=$r
  done
  echo "$execs $killed $rss"
}

seeds() {  # the corpus directories a target starts from: its own, then the kept inputs
  local t=$1 d
  echo "$W/corpus/$t"
  for d in "$ROOT/tests/fuzz/corpus/$t" "$B/seeds/$t"; do
    [ -d "$d" ] && [ -n "$(ls -A "$d")" ] && echo "$d"
  done
}

{
  echo "# Fuzz targets to $RUNS executions each"
  echo
  echo "- machine: $(nproc) CPUs ($CORES used), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(. /etc/os-release && echo "$PRETTY_NAME"), $(uname -r)"
  echo "- bundle: $(head -1 "$B/MANIFEST"), $(sed -n 3p "$B/MANIFEST")"
  echo "- tree here: $(git log --oneline -1 2> /dev/null || echo unknown)"
  echo "- budget: ${BUDGET} s of fuzzing (calibration ${CAL} s included), ${TCP_CORES} cores per tcp worker"
} > "$O/fuzz_summary.md"

# 1. Calibration: one process per target, all at once.
echo "fuzz_long: calibrating $TARGETS for ${CAL} s"
for t in $TARGETS; do
  # shellcheck disable=SC2046
  (cd "$W/run/$t/cal" && timeout -k 10 $((CAL + 30)) "$B/bin/fuzz_$t" "${COMMON[@]}" \
    -max_total_time="$CAL" -artifact_prefix="$W/artifacts/$t-" $(seeds "$t") \
    > "$W/run/$t/cal/fuzz-cal.log" 2>&1) &
done
wait
declare -A RATE LEFT WORKERS DONE_CAL
need_total=0
for t in $TARGETS; do
  read -r e _ _ < <(count "$W/run/$t/cal/fuzz-cal.log")
  DONE_CAL[$t]=$e
  RATE[$t]=$(( e / CAL > 0 ? e / CAL : 1 ))
  LEFT[$t]=$(( RUNS > e ? RUNS - e : 0 ))
  echo "fuzz_long: $t: $e executions in calibration, ${RATE[$t]}/s per process"
done

# 2. Workers by the work left: core-seconds needed = left / rate x cores per worker.
remaining=$(( BUDGET - (SECONDS - T0) ))
[ "$remaining" -lt 10 ] && remaining=10
weight() { case $1 in tcp_*) [ "$1" = tcp_wire ] && echo 1 || echo "$TCP_CORES" ;; *) echo 1 ;; esac; }
# A target one worker finishes in time gets one, and its core-seconds are
# taken off the budget (its core goes back to the others once it is done);
# the rest of CORES x remaining is shared by the others in proportion to their
# need, each capped at what finishes it and given at least one worker.
declare -A NEED
budget=$(( CORES * remaining ))
slow_need=0
for t in $TARGETS; do
  NEED[$t]=$(( LEFT[$t] * $(weight "$t") / RATE[$t] + 1 ))  # core-seconds
  if [ "${LEFT[$t]}" -eq 0 ]; then
    WORKERS[$t]=0
  elif [ "${NEED[$t]}" -le $(( $(weight "$t") * remaining )) ]; then
    WORKERS[$t]=1
    budget=$(( budget - NEED[$t] ))
  else
    WORKERS[$t]=-1
    slow_need=$(( slow_need + NEED[$t] ))
  fi
done
[ "$budget" -lt 0 ] && budget=0
plan=""
for t in $TARGETS; do
  if [ "${WORKERS[$t]}" -lt 0 ]; then
    per_worker=$(( $(weight "$t") * remaining ))
    w=$(( budget * NEED[$t] / slow_need / per_worker ))
    # Capped at 3 x what the calibration rate says finishes it: a worker's
    # rate falls as the corpus grows (tcp_frames on 32 cores: 7,812/s in
    # calibration, 3,830/s per worker over a 503 s run).
    cap=$(( (3 * NEED[$t] + per_worker - 1) / per_worker ))
    [ "$w" -gt "$cap" ] && w=$cap
    [ "$w" -lt 1 ] && w=1
    WORKERS[$t]=$w
  fi
  plan+=" $t=${WORKERS[$t]}"
done
echo "fuzz_long: ${remaining} s left; workers:$plan"

for t in $TARGETS; do
  w=${WORKERS[$t]}
  [ "$w" -eq 0 ] && continue
  per=$(( (LEFT[$t] + w - 1) / w ))
  # shellcheck disable=SC2046
  (cd "$W/run/$t/main" && date +%s > start && timeout -k 20 $((remaining + 40)) "$B/bin/fuzz_$t" \
    "${COMMON[@]}" -jobs="$w" -workers="$w" -runs="$per" -max_total_time="$remaining" \
    -artifact_prefix="$W/artifacts/$t-" $(seeds "$t") > "$W/run/$t/main/jobs.log" 2>&1
    date +%s > end) &
done
# Progress every minute while they run.
while [ -n "$(jobs -rp)" ]; do
  sleep 5
  if [ $(( (SECONDS - T0) % 60 )) -lt 5 ]; then
    line=""
    for t in $TARGETS; do
      read -r e _ _ < <(count "$W"/run/"$t"/main/fuzz-*.log)
      line+=" $t~$(( DONE_CAL[$t] + e ))"
    done
    echo "fuzz_long: $((SECONDS - T0)) s:$line (finished workers only)"
  fi
done
wall=$(( SECONDS - T0 ))

# 3. The table.
status=0
{
  echo
  echo "| target | workers | executions | seconds | executions/s | crashes | peak RSS (MB) | corpus (files) | FUZZ_RUNS reached |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
} >> "$O/fuzz_summary.md"
for t in $TARGETS; do
  read -r e killed rss < <(count "$W/run/$t/cal/fuzz-cal.log" "$W"/run/"$t"/main/fuzz-*.log)
  secs=$CAL
  if [ -f "$W/run/$t/main/end" ]; then
    secs=$(( CAL + $(cat "$W/run/$t/main/end") - $(cat "$W/run/$t/main/start") ))
  fi
  crashes=$(find "$W/artifacts" -name "$t-*" -type f | wc -l)
  findings=$(cat "$W/run/$t"/cal/*.log "$W/run/$t"/main/fuzz-*.log 2> /dev/null | grep -acE "ERROR: (AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|libFuzzer)|runtime error:")
  lsan_broken=$(cat "$W/run/$t"/cal/*.log "$W/run/$t"/main/fuzz-*.log 2> /dev/null | grep -ac "LeakSanitizer has encountered a fatal error")
  corpus=$(find "$W/corpus/$t" -type f | wc -l)
  reached=yes
  [ "$e" -lt "$RUNS" ] && reached=no && status=1
  [ "$crashes" -gt 0 ] || [ "$findings" -gt 0 ] && status=1
  note=""
  [ "$killed" -gt 0 ] && note+=" ($killed workers killed, counted by their last status line)"
  [ "$findings" -gt 0 ] && note+=" ($findings sanitizer/libFuzzer reports in the logs)"
  [ "$lsan_broken" -gt 0 ] && note+=" (LeakSanitizer could not run: FUZZ_DETECT_LEAKS=0)"
  printf '| `fuzz_%s` | %s (+1 calibration) | %s | %s | %s | %s | %s | %s | %s%s |\n' "$t" "${WORKERS[$t]}" \
    "$e" "$secs" "$(( e / secs ))" "$crashes" "${rss:-?}" "$corpus" "$reached" "$note" >> "$O/fuzz_summary.md"
done
{
  echo
  echo "Executions: the sum over the calibration process and every worker of libFuzzer's final"
  echo "\`stat::number_of_executed_units\`; seconds: the target's calibration plus its main phase"
  echo "(its workers ran in parallel); executions/s: executions / seconds, all its workers together."
  echo "Crashes: inputs libFuzzer saved (crash-, leak-, timeout-, oom-), in fuzz_artifacts.tar.gz."
  echo "Script wall time: ${wall} s."
} >> "$O/fuzz_summary.md"
tar -C "$W" -czf "$O/fuzz_logs.tar.gz" run
tar -C "$W" -czf "$O/fuzz_corpus.tar.gz" corpus
if [ -n "$(ls -A "$W/artifacts")" ]; then
  tar -C "$W" -czf "$O/fuzz_artifacts.tar.gz" artifacts
  echo "fuzz_long: FINDINGS:"; ls "$W/artifacts"
fi
cat "$O/fuzz_summary.md"
exit $status
