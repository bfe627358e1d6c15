#!/usr/bin/env bash
# SGLang on the GPU machine: correctness checks and the decode benchmark for prefixattn.
#
#   tools/sglang/run_gpu.sh build   install this tree (a wheel in dist/, from `python -m build
#                                   --wheel` where PyPI is reachable, else `pip install
#                                   --no-deps -e .`; pure
#                                   Python) and compile its library for the installed torch
#                                   (`prefixattn build`)
#   tools/sglang/run_gpu.sh check   engine_check (CUDA graphs on and off, against SGLang's
#                                   triton backend), then server_smoke
#   tools/sglang/run_gpu.sh smoke   server_smoke alone
#   tools/sglang/run_gpu.sh decode-only
#                                   engine_check --decode-only (triton prefill beside
#                                   prefixattn decode), CUDA graphs on and off
#   tools/sglang/run_gpu.sh bench   bench_decode (prefixattn, flashinfer, triton)
#   tools/sglang/run_gpu.sh all     check, then bench (two parts' time)
#
# For SGLang 0.5.17-0.5.23. The GPU runs use SGLang 0.5.23, staged from .stage/sgl23 into
# /root/site-sgl23, with the torch 2.14.0 of the vLLM stage (/root/site33):
#   export PYTHONPATH=/root/site-sgl23:/root/site33
#   bash tools/sglang/run_gpu.sh build          # once per machine, with the same PYTHONPATH
#   bash tools/sglang/run_gpu.sh check
# Each part (counted from the script's start) stays within PART_BUDGET seconds (default 530);
# every step runs under `timeout` and logs to $OUT (default /tmp/prefixattn-sglang). The last
# lines printed are a short summary (also in $OUT/summary.txt).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/prefixattn-sglang}
mkdir -p "$OUT"
part=${1:-check}
budget=${PART_BUDGET:-530}
summary="$OUT/summary.txt"
: >"$summary"
t0_part=$SECONDS
status=0

left() { echo $((budget - (SECONDS - t0_part))); } # seconds left in this part
note() { echo "$*" | tee -a "$summary"; }

# step NAME SECONDS CMD...: run CMD under timeout, log to $OUT/NAME.log, record its status.
step() {
  local name=$1 secs=$2
  shift 2
  if ((secs < 30)); then
    note "$name: SKIPPED (only ${secs} s left in this part)"
    status=1
    return 1
  fi
  local t0=$SECONDS
  timeout -k 20 "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local what=PASS
  ((rc == 124 || rc == 137)) && what="TIMEOUT after ${secs} s"
  ((rc != 0 && rc != 124 && rc != 137)) && what="FAIL (exit $rc)"
  note "$name: $what in $((SECONDS - t0)) s (log $OUT/$name.log)"
  ((rc == 0)) || status=1
  return "$rc"
}

environment() {
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 - <<'EOF'
import torch, sglang, prefixattn
from prefixattn.runtime.library import cuda_ops_available
print("torch", torch.__version__, "cuda", torch.version.cuda, "sglang", sglang.__version__)
print("prefixattn cuda kernels:", cuda_ops_available(),
      "cuda_graph_safe:", getattr(prefixattn.PrefixAttention, "cuda_graph_safe", False))
EOF
  } >"$OUT/environment.txt" 2>&1
  cat "$OUT/environment.txt" >>"$summary"
}

model=/tmp/prefixattn-tiny-llama # outside $OUT: its weights need not come back

save_model() {
  [[ -f $model/config.json ]] || python3 -c "from tools.sglang.engine_check import save_model
save_model('$model')" >"$OUT/save_model.log" 2>&1
}

part_check() {
  save_model
  local secs=$(($(left) - 130))
  step engine_check "$secs" python3 -m tools.sglang.engine_check --out "$OUT" \
    --model "$model" --graph-modes on off --budget $((secs - 25))
  python3 - "$OUT/sglang_engine_check.json" <<'EOF' | tee -a "$summary"
import json, sys
try:
    runs = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(print("engine_check: no result file"))
for mode, r in runs.items():
    keys = ("ok", "why", "max_logprob_diff", "tokens", "flips", "prefixattn_decode_steps", "start_s")
    print(mode, json.dumps({k: r[k] for k in keys if k in r}))
EOF
  smoke
}

# server_smoke.py with SGLang's defaults (CUDA graphs on), in what is left of the part.
smoke() {
  save_model
  local secs=$(($(left) - 5))
  ((secs > 200)) && secs=200
  step server_smoke "$secs" python3 -m tools.sglang.server_smoke --model "$model" \
    --timeout $((secs - 40)) --extra --cuda-graph-max-bs-decode 32
  grep -E "healthy after|answer:|exited|did not" "$OUT/server_smoke.log" | cut -c1-200 |
    tee -a "$summary"
}

part_decode_only() {
  save_model
  local secs=$(($(left) - 5))
  step engine_check_decode_only "$secs" python3 -m tools.sglang.engine_check --out "$OUT" \
    --model "$model" --graph-modes on off --decode-only --budget $((secs - 25))
  grep -E "^graphs|engine_check" "$OUT/engine_check_decode_only.log" | cut -c1-400 | tee -a "$summary"
}

part_bench() {
  local secs=$(($(left) - 5))
  step bench_decode "$secs" python3 -m tools.sglang.bench_decode --out "$OUT" --budget $((secs - 20))
  sed -n '/^decode step time/,$p' "$OUT/bench_decode.log" | tee -a "$summary"
}

part_build() {
  local source=(-e .) wheel
  wheel=$(ls dist/prefixattn-*.whl 2>/dev/null | tail -n 1)
  [ -n "$wheel" ] && source=("$wheel")
  step install 300 python3 -m pip install -q --no-deps "${source[@]}" || return 1
  step build "$(left)" python3 -m prefixattn.cli build
}

[[ $part == build ]] && budget=${PART_BUDGET:-900}
[[ $part == build ]] || environment
case $part in
  build) part_build ;;
  check) part_check ;;
  smoke) smoke ;;
  decode-only) part_decode_only ;;
  bench) part_bench ;;
  all)
    part_check
    t0_part=$SECONDS
    part_bench
    ;;
  *) echo "usage: $0 [build|check|smoke|decode-only|bench|all]" >&2; exit 2 ;;
esac
echo "==== summary ($OUT/summary.txt)"
cat "$summary"
exit "$status"
