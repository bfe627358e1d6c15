#!/usr/bin/env bash
# clang-format over every C++/CUDA source in cpp/ with the given options (style: .clang-format).
#   bash scripts/clang_format.sh --dry-run -Werror    # check (what lint.sh runs)
#   bash scripts/clang_format.sh -i                   # rewrite the files in place
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || {
  echo "clang_format.sh: 'clang-format' is not on PATH; install the dev tools:" \
    "pip install -e '.[dev]'" >&2
  exit 2
}
find cpp -type f \( -name '*.h' -o -name '*.cuh' -o -name '*.cc' -o -name '*.cpp' \
  -o -name '*.cu' \) -print0 | sort -z | xargs -0 --no-run-if-empty clang-format "$@"
