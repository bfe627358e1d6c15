#!/usr/bin/env bash
# On a GPU machine, after `bash scripts/gpu_kernels.sh build` (this tree's build in /tmp/site):
# build another tree (BASE, a .tar.gz such as `git archive REV | gzip`) into /tmp/site-base, then
# time prefixattn's default plans with both builds in alternating runs
# (base, new, base, new) of the attention benchmark, and compare them
# (benchmarks/compare_builds.py). Extra arguments go to the benchmark.
#   bash scripts/gpu_ab.sh BASE.tgz [--heads 32,8 ...]
# Results: $OUT/ab.md, $OUT/ab.json, logs and raw reports in $OUT/ab_runs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT" /tmp/ab-runs
base_tgz=$1
shift
export PYTHONUNBUFFERED=1
rm -rf /tmp/ab-base && mkdir -p /tmp/ab-base && tar -xzf "$base_tgz" -C /tmp/ab-base
start=$SECONDS
(cd /tmp/ab-base && PREFIXATTN_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps \
  --upgrade --target /tmp/site-base . >/tmp/ab-runs/build_base.log 2>&1) ||
  { tail -30 /tmp/ab-runs/build_base.log; exit 1; }
echo "== base build: $((SECONDS - start)) s"
for round in 1 2; do
  for side in base new; do
    site=/tmp/site
    [[ $side == base ]] && site=/tmp/site-base
    start=$SECONDS
    PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} timeout 200 python3 benchmarks/bench_attention.py \
      --iters 15 "$@" --out "/tmp/ab-runs/${side}_${round}.json" >"/tmp/ab-runs/${side}_${round}.log" 2>&1
    echo "== $side $round: exit $? after $((SECONDS - start)) s; $(tail -1 /tmp/ab-runs/${side}_${round}.log)"
  done
done
python3 benchmarks/compare_builds.py --base /tmp/ab-runs/base_*.json --new /tmp/ab-runs/new_*.json \
  --out-md "$OUT/ab.md" --out-json "$OUT/ab.json"
tar -czf "$OUT/ab_runs.tgz" -C /tmp ab-runs
