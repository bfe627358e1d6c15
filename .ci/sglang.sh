#!/usr/bin/env bash
# SGLang adapter tests on a CPU-only machine, in their own environment (.venv-sglang):
# SGLang 0.5.17 with its real dependencies (its pinned CUDA builds of torch and torchvision
# load and run on a CPU), this project built without CUDA, then tests/adapter_sglang.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

start=$SECONDS
python3 -m venv .venv-sglang
# shellcheck disable=SC1091
. .venv-sglang/bin/activate
pip install -q "sglang==0.5.17" pytest hypothesis scikit-build-core cmake ninja
echo "sglang env installed in $((SECONDS - start)) s"
PREFIXATTN_CUDA=0 pip install -q --no-build-isolation --no-deps .
echo "prefixattn installed in $((SECONDS - start)) s"
# Run from outside the source tree so the installed package (and its entry point) is used.
python -m pytest tests/adapter_sglang -q -p no:cacheprovider
echo "sglang adapter tests done in $((SECONDS - start)) s"
deactivate
