#!/usr/bin/env bash
# vLLM adapter tests on a CPU-only machine, in their own environment (.venv-vllm):
# vLLM 0.26.0 with its real dependencies (its pinned CUDA build of torch loads and runs on a
# CPU), this project built without CUDA, then tests/adapter_vllm against the real vLLM classes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

start=$SECONDS
python3 -m venv .venv-vllm
# shellcheck disable=SC1091
. .venv-vllm/bin/activate
pip install -q "vllm==0.26.0" pytest hypothesis scikit-build-core cmake ninja
echo "vllm env installed in $((SECONDS - start)) s"
PREFIXATTN_CUDA=0 pip install -q --no-build-isolation --no-deps .
echo "prefixattn installed in $((SECONDS - start)) s"
python -m pytest tests/adapter_vllm -q -p no:cacheprovider
echo "vllm adapter tests done in $((SECONDS - start)) s"
deactivate
