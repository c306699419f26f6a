#!/usr/bin/env bash
# MoE dispatch/combine A/B on a 2-GPU device machine, in one command: this tree
# ("new") against an older one ("base", .devcarry/base.tar), and optionally
# this tree with .devcarry/<v>.patch applied for each v in VARIANTS. Builds all
# (in parallel), runs the symmetric-memory GPU tests of this tree
# (bench/device_api/run.sh), then moe_bench.py --world 2 alternating the trees
# (ROUNDS, default "1 2") and --breakdown for new and base. Results in $OUT.
#   here:   git archive -o .devcarry/base.tar <base commit>
#   run(kind="nvidia-h200-x2", carry=[".devcarry/root", ".devcarry/base.tar"],
#       command="bench/device_api/ab_moe.sh")
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
O=${OUT:-/tmp/out}
mkdir -p "$O"
PY=$(command -v "${PYTHON:-python3}")
[[ -f .devcarry/base.tar ]] || { echo "ab_moe.sh: .devcarry/base.tar is missing (git archive -o .devcarry/base.tar <commit>)"; exit 1; }
t0=$SECONDS
VARIANTS=${VARIANTS:-}
mkdir -p /tmp/base && tar -xf .devcarry/base.tar -C /tmp/base && ln -sfn "$PWD/.devcarry" /tmp/base/.devcarry
for v in $VARIANTS; do
  rm -rf "/tmp/$v" && mkdir -p "/tmp/$v"
  tar --exclude=./.devcarry -cf - . | tar -xf - -C "/tmp/$v"
  ln -sfn "$PWD/.devcarry" "/tmp/$v/.devcarry"
  if ! (cd "/tmp/$v" && patch -p1 -s < ".devcarry/$v.patch"); then
    echo "ab_moe.sh: variant $v does not apply"
    exit 1
  fi
done
for v in base $VARIANTS; do
  (cd "/tmp/$v" && BUILD=/tmp/b-$v TARGETS="ferry_python_devtree" bench/device/build.sh -DFERRY_BUILD_PYTHON=ON \
     -DFERRY_BUILD_TOOLS=OFF -DPython_EXECUTABLE="$PY" > "$O/build_$v.txt" 2>&1; echo "built $v rc $?") &
done
RUN_API_BENCH=0 RUN_PYTEST=0 RUN_MOE_BENCH=0 bench/device_api/run.sh > "$O/run_sh.txt" 2>&1
rc=$?
grep -E "tests passed|Failed|\*\*\*|built in|BUILD FAILED" "$O/run_sh.txt"
wait
echo "trees built at $((SECONDS - t0)) s"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/.devcarry/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
tree_python() { if [[ $1 == new ]]; then echo /tmp/b-devapi/python; else echo "/tmp/b-$1/python"; fi; }
for round in ${ROUNDS:-1 2}; do
  for v in new base $VARIANTS; do
    echo "=== $v round $round"
    FERRY_PYTHONPATH=$(tree_python "$v") PYTHONPATH=$(tree_python "$v") timeout 150 "$PY" \
      bench/device_api/moe_bench.py --world 2 --iters "${ITERS:-50}" 2>&1 |
      tee -a "$O/moe_$v.txt" | grep -A5 "gpu barrier timing" | tail -4 || rc=1
  done
done
for v in new base; do
  echo "=== breakdown $v"
  FERRY_PYTHONPATH=$(tree_python "$v") PYTHONPATH=$(tree_python "$v") timeout 120 "$PY" \
    bench/device_api/moe_bench.py --breakdown --world 2 --iters 200 2>&1 |
    tee "$O/breakdown_$v.txt" | grep -E "dispatch|combine|NCCL a2a, 1|torch" || rc=1
done
rm -f "$O"/build_*.txt  # the device returns few files: keep the results
echo "all done at $((SECONDS - t0)) s, rc $rc"
exit $rc
