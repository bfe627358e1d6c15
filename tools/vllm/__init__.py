"""vLLM: engine check, decode and metadata-builder benchmarks, GPU runner (run_gpu.sh)."""
