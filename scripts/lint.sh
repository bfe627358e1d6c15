#!/usr/bin/env bash
# Lint everything: ruff (check + format) and mypy. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy
