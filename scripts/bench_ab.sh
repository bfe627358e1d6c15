#!/usr/bin/env bash
# A/B timing of two builds of the kernels on a GPU machine: the attention benchmark
# (`prefixattn bench`, as benchmarks/bench_attention.py) of BASE against this working tree, in
# alternating runs (base, new, base, new, ...), compared by benchmarks/compare_builds.py.
#
#   bash scripts/bench_ab.sh BASE [BENCH ARGS...]
#   bash scripts/bench_ab.sh HEAD~1 --no-flashinfer --heads 32,8 64,8 16,8 32,32
#   bash scripts/bench_ab.sh base.tar.gz --iters 30
#
# BASE is a git revision of this repository, or a source tree packed as .tar.gz
# (`git archive REV | gzip >base.tar.gz`, for a machine without the history). Each side runs
# its own package (PYTHONPATH=<tree>/python) with its own library, which `prefixattn build`
# compiles first for the installed torch into the usual cache (keyed by the C++ sources: a
# second A/B of the same trees compiles nothing).
# Env: OUT (results, default ./prefixattn-results/ab), ROUNDS (pairs of runs, default 2),
# ITERS (timed calls per variant, default 15), RUN_TIMEOUT (seconds per run, default 300).
# Results: $OUT/ab.md and $OUT/ab.json; every run's log and report in $OUT/runs/.
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
(($# >= 1)) || { usage; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
base=$1
shift
out=${OUT:-prefixattn-results/ab}
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)
rounds=${ROUNDS:-2}
export PYTHONUNBUFFERED=1
unset PREFIXATTN_LIBRARY # each side loads the library built from its own sources

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/base"
if [[ -f $base ]]; then
  tar -xzf "$base" -C "$work/base"
else
  git -C "$root" archive "$base" | tar -x -C "$work/base"
fi
[[ -d $work/base/python/prefixattn ]] ||
  { echo "BASE $base: no python/prefixattn at the top of the tree" >&2; exit 1; }
declare -A tree=([base]=$work/base [new]=$root)
rm -f "$out"/runs/base_*.json "$out"/runs/new_*.json # compare this A/B's runs only

for side in base new; do
  start=$SECONDS
  (cd "${tree[$side]}" && PYTHONPATH=${tree[$side]}/python python3 -m prefixattn.cli build) \
    >"$out/runs/build_$side.log" 2>&1 ||
    { tail -30 "$out/runs/build_$side.log"; echo "== $side: build failed" >&2; exit 1; }
  echo "== $side build: $((SECONDS - start)) s ($(tail -1 "$out/runs/build_$side.log"))"
done

for ((round = 1; round <= rounds; round++)); do
  for side in base new; do
    name=${side}_$round
    start=$SECONDS
    rc=0
    (cd "${tree[$side]}" && PYTHONPATH=${tree[$side]}/python timeout "${RUN_TIMEOUT:-300}" \
      python3 -m prefixattn.cli bench --iters "${ITERS:-15}" "$@" --out "$out/runs/$name.json") \
      >"$out/runs/$name.log" 2>&1 || rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s; $(tail -1 "$out/runs/$name.log")"
  done
done
for side in base new; do
  compgen -G "$out/runs/${side}_*.json" >/dev/null ||
    { echo "no $side run wrote a report (logs in $out/runs)" >&2; exit 1; }
done
python3 "$root/benchmarks/compare_builds.py" --base "$out"/runs/base_*.json \
  --new "$out"/runs/new_*.json --out-md "$out/ab.md" --out-json "$out/ab.json"
echo "results: $out/ab.md, $out/ab.json"
