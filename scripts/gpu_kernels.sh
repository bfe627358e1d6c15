#!/usr/bin/env bash
# On a GPU machine: build the package with the CUDA kernels into /tmp/site, run the GPU tests
# (and, with --memcheck, a compute-sanitizer run of a small suite), then the attention
# benchmark. Logs and results go to $OUT (default ./gpu-out).
#   bash scripts/gpu_kernels.sh [build] [test] [memcheck] [bench] [bench-quick] [breakdown]
# breakdown: per-kernel device time of prefixattn's plans (32/8 heads, every tree; profiler).
# FlashInfer columns appear when `import flashinfer` works (e.g. PYTHONPATH with a staged
# vLLM or SGLang stack).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
steps=${*:-build test bench}
for step in $steps; do
  start=$SECONDS
  case $step in
    build)
      PREFIXATTN_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps --upgrade \
        --target /tmp/site . >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; } ;;
    test)
      timeout 540 python3 -m pytest tests/gpu tests/test_plan_buffers_cuda.py tests/test_custom_engine.py -q \
        --maxfail=10 -p no:cacheprovider 2>&1 | tee "$OUT/test.log" | tail -15 ;;
    memcheck)
      timeout 400 compute-sanitizer --tool memcheck python3 -m pytest tests/gpu -q -x \
        -p no:cacheprovider -k "long_kv or page1 or graph or root_tiles or merge_many or leaf_kernel or finishes or wgmma64 or smem_pages or keys128 or (random_forest and memory and 1-5)" \
        2>&1 | tee "$OUT/memcheck.log" | tail -5 ;;
    bench)
      timeout 560 python3 benchmarks/bench_attention.py --iters 15 --ablations \
        --out "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench.log" | tail -100 ;;
    bench-quick)
      timeout 300 python3 benchmarks/bench_attention.py --iters 10 --heads 32,8 64,8 \
        --page1-trees --out "$OUT/bench_quick.json" 2>&1 | tee "$OUT/bench.log" | tail -30 ;;
    breakdown)
      timeout 300 python3 benchmarks/bench_attention.py --iters 5 --heads 32,8 --no-flashinfer \
        --breakdown 10 --out "$OUT/bench_breakdown.json" 2>&1 | tee "$OUT/breakdown.log" | tail -60 ;;
  esac
  echo "== $step: $((SECONDS - start)) s"
done
