#!/usr/bin/env bash
# GPU smoke test: `vllm serve` with --attention-backend CUSTOM answers one completion request.
# Usage: integration/vllm/serve_smoke.sh MODEL_DIR [PORT]   (MODEL_DIR: a local Llama folder)
set -euo pipefail
model=$1 port=${2:-8765}
log=${OUT:-/tmp}/vllm_serve.log
vllm serve "$model" --attention-backend CUSTOM --port "$port" --max-model-len 2048 \
  --gpu-memory-utilization 0.5 --skip-tokenizer-init >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  curl -sf "localhost:$port/health" >/dev/null && break
  kill -0 $pid 2>/dev/null || { echo "server exited"; tail -50 "$log"; exit 1; }
  sleep 1
done
reply=$(curl -sf --max-time 60 "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"prompt\": [1, 2, 3, 4, 5, 6, 7, 8], \"max_tokens\": 8, \"temperature\": 0}")
echo "$reply"
echo "$reply" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["choices"], r; print("serve smoke ok")'
