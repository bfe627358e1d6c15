#!/usr/bin/env bash
# Adapter tests on a CPU-only machine, in the engine's own environment (.venv-NAME): the
# engine with its real dependencies (its pinned CUDA build of torch loads and runs on a CPU),
# prefixattn from dist/ (its library compiled on first use against that torch), then
# tests/adapter_NAME against the real classes.
#   bash .ci/adapter-env.sh vllm "vllm==0.33.0"
#   bash .ci/adapter-env.sh sglang "sglang==0.5.23" "torchvision==0.29.1"
set -euo pipefail
name=$1
shift
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PIP_NO_CACHE_DIR=1

start=$SECONDS
rm -rf ".venv-$name"
python3 -m venv ".venv-$name"
# shellcheck disable=SC1090
. ".venv-$name/bin/activate"
pip install -q "$@" pytest hypothesis
echo "$* installed in $((SECONDS - start)) s ($(du -sh ".venv-$name" | cut -f1))"
wheel=$(ls dist/prefixattn-*.whl 2>/dev/null | head -n 1)
pip install -q --no-deps "${wheel:-.}" cmake ninja
python -c "import torch, $name; print('torch', torch.__version__, '$name', $name.__version__)"
python -m pytest "tests/adapter_$name" -q -p no:cacheprovider
echo "$* adapter tests done in $((SECONDS - start)) s"
deactivate
rm -rf ".venv-$name"
