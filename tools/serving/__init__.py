"""Serving benchmark: workloads with shared prefixes through whole engines, each backend
against an attention-free bound (``python -m tools.serving.bench``; docs/dev/serving.md)."""
