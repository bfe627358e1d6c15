#!/usr/bin/env bash
# Lint everything, from anywhere: ruff (check + format) and mypy over all Python (the package
# with its adapters, benchmarks/, tools/, examples/, tests/; the paths are in pyproject.toml),
# and clang-format over the C++/CUDA in cpp/ (style in .clang-format). The tools come from the
# dev extra (`pip install -e .[dev]`); .pre-commit-config.yaml runs the same commands.
#   bash scripts/lint.sh          # exit status 1 if any check fails
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
for tool in ruff mypy clang-format; do
  command -v "$tool" >/dev/null || {
    echo "lint.sh: '$tool' is not on PATH; install the dev tools: pip install -e '.[dev]'" >&2
    exit 2
  }
done
failed=()
run() { # NAME CMD...: run one check, remember it if it fails
  echo "== $1"
  "${@:2}" || failed+=("$1")
}
run "ruff check" ruff check .
run "ruff format" ruff format --check .
run mypy mypy --no-incremental # a stale cache once hid an error that a clean clone reports
run clang-format bash scripts/clang_format.sh --dry-run -Werror
if ((${#failed[@]})); then
  echo "lint.sh: failed: ${failed[*]}" >&2
  exit 1
fi
echo "lint.sh: all clean"
