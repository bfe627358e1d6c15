"""The prefix-math floor of the decode benchmarks: the bound plus the shared prefix's math.

On the decode step of B requests under one P-token prefix, any exact attention computes every
query against the prefix's keys and values: 4 B Hq P D floating-point operations per layer
(``Hq`` query heads of ``D`` dims), which with B = 256, P = 4096 and the 8B shape is 17.2
GFLOP, a compute-bound product. The floor backends (``prefixfloor`` in SGLang,
``tools/sglang/noattn.py``; ``PREFIXFLOOR`` in vLLM, ``tools/vllm/noattn.py``) are the
attention-free bound plus exactly that product on FA3, the fastest dense attention kernel
the engines ship for Hopper: each decode forward attends every query of the batch to a
fixed, random P-token K/V of the layer (its own per layer, so no layer's K/V stays in L2 for
the next). They read no KV cache and do no private tails, no merge, no planning. So their
step time is what a backend whose prefix math runs at FA3's rate reaches at best; the
benchmarks report it beside the bound (as % of the bound, like the backends). Prefill
forwards stay the bound's (zeros): only decode steps are timed.
"""

from __future__ import annotations

import functools
from typing import Any

MAX_FLOOR_TOKENS = 1 << 20


def check_floor_tokens(tokens: int) -> int:
    """``tokens`` as the floor's prefix length; raises ValueError unless 1 .. 2^20."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise ValueError(f"prefix floor: prefix tokens must be an int, got {tokens!r}")
    if not 1 <= tokens <= MAX_FLOOR_TOKENS:
        raise ValueError(f"prefix floor: prefix tokens {tokens} not in 1 .. {MAX_FLOOR_TOKENS}")
    return tokens


def random_kv(
    layers: int, tokens: int, kv_heads: int, head_dim: int, dtype: Any, device: Any
) -> list[tuple[Any, Any]]:
    """Per layer, random K and V of ``[1, tokens, kv_heads, head_dim]`` (FA3's batch, keys,
    heads, dims; ``[0]`` is the varlen layout), made once, before any graph capture."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, check_floor_tokens(tokens), kv_heads, head_dim)

    def one() -> Any:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    return [(one(), one()) for _ in range(layers)]


@functools.cache
def fa3_varlen() -> tuple[str, Any]:
    """``(source, run)`` of an FA3 build in this process: vLLM's (``vllm.vllm_flash_attn``),
    else sgl_kernel's; ImportError when neither loads. ``run(q, k, v, cu_q, cu_k, n, tokens,
    scale, out)`` attends ``q`` ``[n, Hq, D]`` (one sequence, not causal) to ``k``/``v``
    ``[tokens, Hkv, D]`` into ``out``, with FA3's own choice of KV splits."""
    errors = []
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func as vllm_fa

        def run_vllm(q, k, v, cu_q, cu_k, n, tokens, scale, out):
            vllm_fa(q=q, k=k, v=v, max_seqlen_q=n, cu_seqlens_q=cu_q, max_seqlen_k=tokens,
                    cu_seqlens_k=cu_k, softmax_scale=scale, causal=False, out=out,
                    fa_version=3, num_splits=0)  # fmt: skip

        return "vllm_flash_attn", run_vllm
    except ImportError as e:
        errors.append(f"vllm_flash_attn: {e}")
    try:
        from sgl_kernel.flash_attn import flash_attn_varlen_func as sgl_fa

        def run_sgl(q, k, v, cu_q, cu_k, n, tokens, scale, out):
            sgl_fa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=n,
                   max_seqlen_k=tokens, softmax_scale=scale, causal=False, num_splits=0,
                   out=out)  # fmt: skip

        return "sgl_kernel", run_sgl
    except ImportError as e:
        errors.append(f"sgl_kernel: {e}")
    raise ImportError("prefix floor: no FA3 build loads here: " + "; ".join(errors))
