#!/usr/bin/env bash
# The vLLM GPU checks in one command, within about 9 minutes (BUDGET):
#   build  install this tree (a wheel in dist/, from `python -m build --wheel` where
#          PyPI is reachable, else `pip install --no-deps -e .`) and compile its library
#          for the installed torch (`prefixattn build`); not counted in BUDGET
#   check  tools/vllm/check_engine.py: CUSTOM against FLASH_ATTN, CUDA graphs on and off
#   serve  tools/vllm/serve_smoke.sh: `vllm serve --attention-backend CUSTOM`, one request
#   bench  tools/vllm/bench_decode.py: decode step time, CUSTOM vs FLASHINFER, FLASH_ATTN
#
# Usage, from the repository root on the GPU machine, for vLLM 0.26.0-0.33.0 (the GPU runs use
# vLLM 0.33.0 with FlashInfer and torch 2.14.0, staged from .stage/vllm33 into /root/site33):
#   export PYTHONPATH=/root/site33
#   bash tools/vllm/run_gpu.sh build                             # once per machine
#   bash tools/vllm/run_gpu.sh [check] [serve] [bench]           # no argument: all three
# The library must be compiled against the torch the engine imports (the staged one), so run
# `build` with the same PYTHONPATH. On a fresh machine the first engine compiles for about
# 2 minutes, which the check's share of the default budget cannot absorb: there, run `check`
# in one command and `serve bench` in the next (BUDGET=570 each).
# Env: OUT (logs and JSON, default /tmp/vllm-gpu), BUDGET (seconds for the selected parts,
# default 540: shared check 5 : serve 2 : bench 5), BENCH_ARGS (extra bench_decode.py arguments,
# e.g. "--batches 64 256" or "--backends CUSTOM FLASH_ATTN"), CHECK_ARGS (extra check_engine.py
# arguments, e.g. "--modes spec" for speculative decoding).
# Every part runs in its own process group under its share of BUDGET and is killed with all its
# processes (vLLM engine cores included) when it runs over. A summary table ends the output.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/vllm-gpu}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
export OUT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CLI="python3 -m vllm.entrypoints.cli.main"

parts=()
build=0
for p in "${@}"; do
  if [ "$p" = build ]; then build=1; else parts+=("$p"); fi
done
[ ${#parts[@]} -eq 0 ] && [ $build = 0 ] && parts=(check serve bench)
declare -A weight=([check]=5 [serve]=2 [bench]=5)
for p in "${parts[@]}"; do
  [ -n "${weight[$p]:-}" ] || { echo "unknown part '$p' (build, check, serve, bench)"; exit 2; }
done

if [ $build = 1 ]; then
  echo "== build (log $OUT/build.log)"
  source=(-e .)
  wheel=$(ls dist/prefixattn-*.whl 2>/dev/null | tail -n 1)
  [ -n "$wheel" ] && source=("$wheel")
  {
    python3 -m pip install -q --no-deps "${source[@]}" &&
      timeout 900 python3 -m prefixattn.cli build
  } >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo "build: FAIL"; exit 1; }
  tail -1 "$OUT/build.log"
  [ ${#parts[@]} -eq 0 ] && exit 0
fi
start=$SECONDS

echo "== preflight"
nvidia-smi -L 2>/dev/null | head -2
timeout 120 python3 - <<'EOF' 2>&1 | grep -v -E "^(INFO|WARNING) " | tee "$OUT/preflight.log"
import importlib.metadata as md
import types

import torch

import prefixattn
from prefixattn.adapters.vllm.backend import PrefixAttentionMetadataBuilder as B
from prefixattn.runtime.library import cuda_ops_available

spec = types.SimpleNamespace(dtype=torch.bfloat16)
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "prefixattn"]
print("torch", torch.__version__, "| vllm", md.version("vllm"), "| prefixattn", prefixattn.__file__)
if not eps:
    print("no prefixattn entry point: install this tree first (run_gpu.sh build)")
print("cuda kernels:", cuda_ops_available(),
      "| cuda_graph_safe:", getattr(prefixattn.PrefixAttention, "cuda_graph_safe", None),
      "| declared CG support:", B.get_cudagraph_support(None, spec).name,
      "| plugin entry point:", eps)
EOF

declare -A status secs
run_part() {  # NAME SECONDS CMD...: run CMD in its own process group, killed after SECONDS
  local name=$1 budget=$2 pid rc t0=$SECONDS
  shift 2
  echo "== $name (budget ${budget} s, log $OUT/$name.log)"
  if command -v setsid >/dev/null; then
    setsid timeout -k 10 "$budget" "$@" >"$OUT/$name.log" 2>&1 &
  else
    timeout -k 10 "$budget" "$@" >"$OUT/$name.log" 2>&1 &
  fi
  pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null  # whatever of the part is left (engine processes)
  secs[$name]=$((SECONDS - t0))
  case $rc in
    0) status[$name]=ok ;;
    124 | 137) status[$name]="TIMEOUT" ;;
    *) status[$name]="FAIL (exit $rc)" ;;
  esac
  tail -5 "$OUT/$name.log"
}

share() {  # seconds for part $1 out of what is left for the parts not yet run
  local left=$((BUDGET - (SECONDS - start))) w=0 p
  for p in "${remaining[@]}"; do w=$((w + weight[$p])); done
  echo $((left * weight[$1] / w))
}

remaining=("${parts[@]}")
for p in "${parts[@]}"; do
  b=$(share "$p")
  remaining=("${remaining[@]:1}")
  if [ "$b" -lt 40 ]; then
    status[$p]="SKIPPED (no time)" secs[$p]=0
    continue
  fi
  case $p in
    check)
      # shellcheck disable=SC2086
      run_part check "$b" python3 -m tools.vllm.check_engine --out "$OUT" --budget $((b - 25)) \
        ${CHECK_ARGS:-}
      ;;
    serve)
      model="$OUT/tiny-llama"
      mkdir -p "$model"
      cat >"$model/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
 "intermediate_size": 2816, "num_hidden_layers": 2, "num_attention_heads": 8,
 "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 8192, "rms_norm_eps": 1e-5,
 "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "bos_token_id": 1,
 "eos_token_id": 2}
EOF
      SERVE_WAIT=$((b - 20)) run_part serve "$b" bash tools/vllm/serve_smoke.sh "$model" 8765 \
        --load-format dummy
      ;;
    bench)
      # shellcheck disable=SC2086
      run_part bench "$b" python3 -m tools.vllm.bench_decode --out "$OUT/vllm_bench_decode.json" \
        --budget $((b - 20)) ${BENCH_ARGS:-}
      ;;
  esac
done

echo
echo "== summary ($((SECONDS - start)) s; logs and JSON in $OUT)"
printf '%-6s %-16s %6s\n' part status seconds
for p in "${parts[@]}"; do printf '%-6s %-16s %6s\n' "$p" "${status[$p]}" "${secs[$p]}"; done
python3 - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
check = out / "vllm_check_engine.json"
if check.exists():
    print("\ncheck_engine (CUSTOM vs FLASH_ATTN):")
    for mode, r in json.loads(check.read_text()).items():
        info = (r.get("info") or {}).get("CUSTOM") or {}
        print(f"  {mode:10s} ok={r.get('ok')} max_logprob_diff={r.get('max_logprob_diff')} "
              f"tokens={r.get('tokens')} flips={r.get('flips')} "
              f"full_decode_graphs={r.get('custom_full_decode_graphs')} "
              f"mode={info.get('cudagraph_mode')} {r.get('why', '')}")
bench = out / "vllm_bench_decode.json"
if bench.exists():
    b = json.loads(bench.read_text())
    steps = b.get("step_ms", {})
    keys = sorted({(k, bs) for per in steps.values() for k, v in per.items() for bs in v})
    print("\ndecode step ms (batch; workloads: shared1 one prefix, tree 3 levels, none):")
    print("  " + f"{'backend':12s}" + "".join(f"{k + '/' + bs:>14s}" for k, bs in keys))
    for backend, per in steps.items():
        cells = "".join(f"{per.get(k, {}).get(bs, '-')!s:>14s}" for k, bs in keys)
        exit_ = b.get("engine", {}).get(backend, {}).get("exit")
        print(f"  {backend:12s}{cells}   exit={exit_}")
EOF
for p in "${parts[@]}"; do [ "${status[$p]}" = ok ] || exit 1; done
