#!/usr/bin/env bash
cd "$(dirname "$0")/.."
D=$BG_DIR
export PYTHONUNBUFFERED=1
(env -u PYTHONPATH PREFIXATTN_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps --upgrade --target /tmp/site . > $D/build.log 2>&1) || { tail -30 $D/build.log; exit 1; }
bash scripts/gpu_bg.sh mark r4 build
export PYTHONPATH=/tmp/site
timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider -k "keys128 or root_tiles or pat_tree or scale_and_rising or random_forest" 2>&1 | tail -4 | tee $D/quick.log
bash scripts/gpu_bg.sh mark r4 quick
for r in 1 2; do
  for v in 0 1; do
    PREFIXATTN_WGMMA_KEYS128=$v timeout 200 python3 benchmarks/bench_attention.py --iters 15 --no-flashinfer --heads 32,8 64,8 16,8 32,32 --out $D/ab_k${v}_$r.json > $D/ab_k${v}_$r.log 2>&1
    echo "keys128=$v r=$r: $(tail -1 $D/ab_k${v}_$r.log)"
  done
done
python3 benchmarks/compare_builds.py --base $D/ab_k0_1.json $D/ab_k0_2.json --new $D/ab_k1_1.json $D/ab_k1_2.json --out-md $D/ab_v64b.md --out-json $D/ab_v64b.json > /dev/null 2>&1
head -3 $D/ab_v64b.md
bash scripts/gpu_bg.sh mark r4 ab
for v in 0 1; do
  PREFIXATTN_WGMMA_KEYS128=$v timeout 120 python3 benchmarks/timeline.py --trees 1,1024_2048,32 1,4,16,512_1024,256,128,32 1,16,32,64,256,1024_256,128,64,32,32,32 1,8,512_32,512,256 --heads 32,8 64,8 32,32 --calls 2 > $D/timeline_k$v.txt 2>&1
done
bash scripts/gpu_bg.sh mark r4 timeline
OUT=$D bash scripts/gpu_kernels.sh test memcheck
bash scripts/gpu_bg.sh mark r4 full
