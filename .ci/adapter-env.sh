#!/usr/bin/env bash
# Adapter tests on a CPU-only machine, in the framework's own environment (.venv-NAME):
# the framework with its real dependencies (its pinned CUDA build of torch loads and runs on a
# CPU), this project built without CUDA, then tests/adapter_NAME against the real classes.
#   bash .ci/adapter-env.sh vllm "vllm==0.26.0"
#   bash .ci/adapter-env.sh sglang "sglang==0.5.17"
set -euo pipefail
name=$1
requirement=$2
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PIP_NO_CACHE_DIR=1

start=$SECONDS
python3 -m venv ".venv-$name"
# shellcheck disable=SC1090
. ".venv-$name/bin/activate"
pip install -q "$requirement" pytest hypothesis scikit-build-core cmake ninja
echo "$name env installed in $((SECONDS - start)) s ($(du -sh ".venv-$name" | cut -f1); $(df -Ph . | tail -n 1 | awk '{print $4}') free)"
PREFIXATTN_CUDA=0 pip install -q --no-build-isolation --no-deps .
echo "prefixattn installed in $((SECONDS - start)) s"
python -m pytest "tests/adapter_$name" -q -p no:cacheprovider
echo "$name adapter tests done in $((SECONDS - start)) s"
deactivate
