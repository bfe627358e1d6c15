"""SGLang: engine check, server smoke test, decode and plan-cost benchmarks, GPU runner."""
