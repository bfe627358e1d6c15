#!/usr/bin/env bash
# SGLang on the GPU machine: correctness checks and the decode benchmark for prefixattn.
#
#   integration/sglang/run_gpu.sh check   engine_check.py (CUDA graphs on and off, against
#                                         SGLang's triton backend), then server_smoke.py
#   integration/sglang/run_gpu.sh smoke   server_smoke.py alone
#   integration/sglang/run_gpu.sh decode-only
#                                         engine_check.py --decode-only (triton prefill beside
#                                         prefixattn decode), CUDA graphs on and off
#   integration/sglang/run_gpu.sh bench   bench_decode.py (prefixattn, flashinfer, triton)
#   integration/sglang/run_gpu.sh all     check, then bench (two parts' time)
#
# Expects SGLang importable (PYTHONPATH=/root/site-sglang) and prefixattn installed. Each part
# (counted from the script's start) stays within PART_BUDGET seconds (default 530); every
# step runs under `timeout` and logs to $OUT (default /tmp/prefixattn-sglang). The last lines
# printed are a short summary (also in $OUT/summary.txt).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/prefixattn-sglang}
mkdir -p "$OUT"
part=${1:-check}
budget=${PART_BUDGET:-530}
summary="$OUT/summary.txt"
: >"$summary"
here=integration/sglang
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
    python - <<'EOF'
import torch, sglang, prefixattn
from prefixattn import _ops
print("torch", torch.__version__, "cuda", torch.version.cuda, "sglang", sglang.__version__)
print("prefixattn cuda kernels:", _ops.cuda_ops_available(),
      "cuda_graph_safe:", getattr(prefixattn.PrefixAttention, "cuda_graph_safe", False))
EOF
  } >"$OUT/environment.txt" 2>&1
  cat "$OUT/environment.txt" >>"$summary"
}

model=/tmp/prefixattn-tiny-llama # outside $OUT: its weights need not come back

save_model() {
  [[ -f $model/config.json ]] || python -c "import sys; sys.path.insert(0, '$here')
from engine_check import save_model; save_model('$model')" >"$OUT/save_model.log" 2>&1
}

part_check() {
  save_model
  local secs=$(($(left) - 130))
  step engine_check "$secs" python $here/engine_check.py --out "$OUT" \
    --model "$model" --graph-modes on off --budget $((secs - 25))
  python - "$OUT/sglang_engine_check.json" <<'EOF' | tee -a "$summary"
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
  step server_smoke "$secs" python $here/server_smoke.py --model "$model" \
    --timeout $((secs - 40)) --extra --cuda-graph-max-bs-decode 32
  grep -E "healthy after|answer:|exited|did not" "$OUT/server_smoke.log" | cut -c1-200 |
    tee -a "$summary"
}

part_decode_only() {
  save_model
  local secs=$(($(left) - 5))
  step engine_check_decode_only "$secs" python $here/engine_check.py --out "$OUT" \
    --model "$model" --graph-modes on off --decode-only --budget $((secs - 25))
  grep -E "^graphs|engine_check" "$OUT/engine_check_decode_only.log" | cut -c1-400 | tee -a "$summary"
}

part_bench() {
  local secs=$(($(left) - 5))
  step bench_decode "$secs" python $here/bench_decode.py --out "$OUT" --budget $((secs - 20))
  sed -n '/^decode step time/,$p' "$OUT/bench_decode.log" | tee -a "$summary"
}

environment
case $part in
  check) part_check ;;
  smoke) smoke ;;
  decode-only) part_decode_only ;;
  bench) part_bench ;;
  all)
    part_check
    t0_part=$SECONDS
    part_bench
    ;;
  *) echo "usage: $0 [check|smoke|decode-only|bench|all]" >&2; exit 2 ;;
esac
echo "==== summary ($OUT/summary.txt)"
cat "$summary"
exit "$status"
