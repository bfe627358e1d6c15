"""The cache layout that delegated steps rely on: vLLM's FlashAttention kernel, reading
prefixattn's vLLM cache view, computes what prefixattn computes on the same step.

prefixattn's vLLM backend hands steps to ``FLASH_ATTN`` (``StepOptions.delegate_unshared``,
``delegate_prefills``) over its own cache: logical ``(blocks, kv_heads, block_size, 2 * D)``
in NHD memory order, K and V the two halves of the last dimension. Needs a GPU and vLLM's
FlashAttention build (skipped otherwise).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixattn import PrefixAttention

from . import KERNEL_MARKS

pytestmark = KERNEL_MARKS

fa = pytest.importorskip("vllm.vllm_flash_attn", exc_type=ImportError)

HQ, HKV, D, BS = 32, 8, 128, 16


def test_flash_attn_reads_prefixattns_vllm_cache() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    blocks = 400
    # vLLM's allocation: memory order [blocks, block_size, kv_heads, 2D], viewed logically
    # as (blocks, kv_heads, block_size, 2D) (get_kv_cache_stride_order (0, 2, 1, 3)).
    physical = torch.randn(blocks, BS, HKV, 2 * D, generator=gen).to(dev, torch.bfloat16)
    kv_cache = physical.permute(0, 2, 1, 3)
    k_cache, v_cache = kv_cache.transpose(1, 2).split(D, dim=-1)  # NHD views, as the impls do
    # Four decodes under a shared 5-block prefix, then two prefill chunks (decodes first).
    prefix = list(range(1, 6))
    rows, lens, q_lens, nxt = [], [], [], 100
    for seq_len, new in ((120, 1), (97, 1), (150, 1), (81, 1), (300, 37), (64, 64)):
        own = -(-seq_len // BS) - (len(prefix) if new == 1 else 0)
        rows.append((prefix if new == 1 else []) + list(range(nxt, nxt + own)))
        nxt += own
        lens.append(seq_len)
        q_lens.append(new)
    width = max(len(r) for r in rows)
    table = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = int(indptr[-1])
    q = torch.randn(n, HQ, D, generator=gen).to(dev, torch.bfloat16)
    scale = D**-0.5

    attention = PrefixAttention(HQ, HKV, D, BS, kv_layout="NHD", device=dev, dtype=torch.bfloat16)
    plan = attention.plan(table, np.asarray(lens, np.int32), indptr)
    ours = torch.empty_like(q)
    attention.run(q, k_cache, v_cache, scale=scale, out=ours, plan=plan)

    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    theirs = torch.empty_like(q)
    fa.flash_attn_varlen_func(
        q=q, k=k_cache, v=v_cache, out=theirs, max_seqlen_q=max(q_lens),
        cu_seqlens_q=torch.from_numpy(indptr).to(dev), max_seqlen_k=max(lens),
        seqused_k=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_table=torch.from_numpy(table).to(dev), softmax_scale=scale, causal=True,
        fa_version=get_flash_attn_version(),  # FA3 on Hopper, as the engine runs it
    )  # fmt: skip
    torch.testing.assert_close(theirs, ours, atol=2e-2, rtol=2e-2)
