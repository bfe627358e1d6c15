"""Attention benchmark (see prefixattn.bench): python benchmarks/bench_attention.py --help."""

import sys

from prefixattn.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
