#!/usr/bin/env bash
# Lint everything: ruff (check + format) and mypy. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy --no-incremental  # a stale cache once hid an error that a clean clone reports
