#!/usr/bin/env bash
# GPU smoke test: `vllm serve` with --attention-backend CUSTOM (vLLM's default compilation and
# CUDA graphs) answers one completion request on localhost.
# Usage: tools/vllm/serve_smoke.sh MODEL_DIR [PORT [EXTRA VLLM SERVE ARGS...]]
#   MODEL_DIR: a local Llama folder (with only config.json, pass --load-format dummy).
# Env: OUT (log folder, default /tmp), SERVE_WAIT (seconds to wait for /health, default 240),
# VLLM_CLI (the vllm command, default `vllm`; e.g. "python3 -m vllm.entrypoints.cli.main").
set -euo pipefail
model=$1 port=${2:-8765}
shift $(($# < 2 ? $# : 2))
log=${OUT:-/tmp}/vllm_serve.log
# shellcheck disable=SC2086  # VLLM_CLI may be several words
${VLLM_CLI:-vllm} serve "$model" --attention-backend CUSTOM --port "$port" --host 127.0.0.1 \
  --max-model-len 2048 --gpu-memory-utilization 0.5 --skip-tokenizer-init "$@" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
up=0
for _ in $(seq 1 "${SERVE_WAIT:-240}"); do
  if curl -sf "127.0.0.1:$port/health" >/dev/null; then up=1; break; fi
  kill -0 $pid 2>/dev/null || { echo "server exited"; tail -50 "$log"; exit 1; }
  sleep 1
done
[ "$up" = 1 ] || { echo "server not healthy in time"; tail -50 "$log"; exit 1; }
grep -m1 -E "Using .*CUSTOM|CUSTOM.*backend" "$log" || echo "(no backend selection line in the log)"
grep -m2 -iE "cudagraph_mode|Capturing CUDA graphs" "$log" || true
reply=$(curl -sf --max-time 60 "127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"prompt\": [1, 2, 3, 4, 5, 6, 7, 8], \"max_tokens\": 8, \"temperature\": 0}")
echo "$reply"
echo "$reply" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["choices"], r; print("serve smoke ok")'
