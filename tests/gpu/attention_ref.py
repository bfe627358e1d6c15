"""Plain paged attention in fp32 on the GPU, the oracle of the kernel tests."""

from __future__ import annotations

import numpy as np
import torch


def gathered_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    qo_indptr: np.ndarray,
    kv_layout: str,
    scale: float,
) -> torch.Tensor:
    """fp32 [T, Hq, D]: token i of the n new tokens of a request of KV length L attends to
    positions < L - n + i + 1 of that request's pages."""
    t, hq, d = q.shape
    if kv_layout == "HND":
        k_cache = k_cache.transpose(1, 2)
        v_cache = v_cache.transpose(1, 2)
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    out = torch.empty(t, hq, d, dtype=torch.float32, device=q.device)
    for b in range(len(seq_lens)):
        length = int(seq_lens[b])
        npages = -(-length // ps)
        pages = torch.as_tensor(block_table[b, :npages].astype(np.int64), device=q.device)
        k = k_cache[pages].reshape(-1, hkv, d)[:length].float()  # [L, Hkv, D]
        v = v_cache[pages].reshape(-1, hkv, d)[:length].float()
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        n = q1 - q0
        qb = q[q0:q1].float()  # [n, Hq, D]
        s = torch.einsum("nhd,lhd->hnl", qb, k) * scale
        pos = torch.arange(length, device=q.device)
        limit = length - n + torch.arange(n, device=q.device) + 1
        s = s.masked_fill(pos[None, None, :] >= limit[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), v)
    return out
