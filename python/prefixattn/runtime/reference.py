"""PyTorch references.

- :func:`run_plan_reference` executes a :class:`~prefixattn.plan.types.LaunchPlan` exactly as the
  kernels do: every work item's partial attention over its KV pages, written either to a
  partial row (o rounded to q's dtype, as the kernels store it, and its log-sum-exp) or
  straight to the output, then the log-sum-exp merge.
  It runs on any device and is what ``PrefixAttention.run`` uses without CUDA kernels.
- :func:`attention_reference` is plain attention over each request's gathered KV, with no
  plan at all: the ground truth the tests compare against.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..plan.types import LaunchPlan


def _gather(cache: torch.Tensor, pages: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """[len(pages) * page_size, Hkv, D] from a paged cache."""
    blocks = cache.index_select(0, pages)
    if kv_layout == "HND":
        blocks = blocks.transpose(1, 2)
    return blocks.reshape(-1, blocks.shape[-2], blocks.shape[-1])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def run_plan_reference(
    plan: LaunchPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Execute ``plan`` with PyTorch operations; fills and returns ``out`` [T, Hq, D]."""
    h = plan.host
    hq, hkv, d = plan.num_qo_heads, plan.num_kv_heads, plan.head_dim
    g = hq // hkv
    cdt = _compute_dtype(q.dtype)
    dev = q.device
    # Partial rows are stored in q's dtype (the lse in the compute dtype), as in the kernels.
    partial_o = torch.empty(plan.num_partials, hq, d, dtype=q.dtype, device=dev)
    partial_lse = torch.empty(plan.num_partials, hq, dtype=cdt, device=dev)
    # The plan's own page array (for plan_unshared the host array holds table positions).
    kv_pages = plan.kv_pages.to(device=dev, dtype=torch.long)
    for w in range(plan.num_work_items):
        kv_len = int(h.kv_len[w])
        p0 = int(h.kv_page_offset[w])
        p1 = p0 + -(-kv_len // plan.page_size)
        k = _gather(k_cache, kv_pages[p0:p1], plan.kv_layout)[:kv_len].to(cdt)
        v = _gather(v_cache, kv_pages[p0:p1], plan.kv_layout)[:kv_len].to(cdt)
        s0, s1 = int(h.q_indptr[w]), int(h.q_indptr[w + 1])
        tokens = torch.as_tensor(h.q_tokens[s0:s1], dtype=torch.long, device=dev)
        limit = torch.as_tensor(h.q_limit[s0:s1], dtype=torch.long, device=dev)
        pos = int(h.kv_start[w]) + torch.arange(kv_len, device=dev)
        qw = q.index_select(0, tokens).to(cdt).view(-1, hkv, g, d)
        # scores [slots, Hkv, g, kv_len]
        scores = torch.einsum("shgd,khd->shgk", qw, k) * scale
        masked = pos.view(1, 1, 1, -1) >= limit.view(-1, 1, 1, 1)
        scores = scores.masked_fill(masked, -math.inf)
        m = scores.amax(dim=-1, keepdim=True)
        p = torch.exp(scores - m)
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("shgk,khd->shgd", p, v) / denom
        lse = (m + torch.log(denom)).squeeze(-1)
        o = o.reshape(-1, hq, d)
        lse = lse.reshape(-1, hq)
        dst_host = h.q_out[s0:s1].astype(np.int64)
        fin = dst_host <= -2
        if fin.any():
            # Slots that finish a merged token in the leaf launch: here their row is the last
            # of the token's partial rows, merged below with the others.
            dst_host[fin] = h.merge_partials[(-2 - dst_host[fin]) >> 4]
        dst = torch.as_tensor(dst_host, dtype=torch.long, device=dev)
        direct = dst < 0
        if bool(direct.any()):
            out.index_copy_(0, tokens[direct], o[direct].to(out.dtype))
        if not bool(direct.all()):
            rows = dst[~direct]
            partial_o.index_copy_(0, rows, o[~direct].to(partial_o.dtype))
            partial_lse.index_copy_(0, rows, lse[~direct])
    if plan.num_merge_tokens:
        merge_tokens = torch.as_tensor(h.merge_tokens, dtype=torch.long, device=dev)
        counts = torch.as_tensor(h.merge_indptr[1:] - h.merge_indptr[:-1], device=dev)
        seg = torch.repeat_interleave(torch.arange(len(merge_tokens), device=dev), counts)
        rows = torch.as_tensor(h.merge_partials, dtype=torch.long, device=dev)
        lse = partial_lse.index_select(0, rows)  # [R, Hq]
        lse_max = torch.full((len(merge_tokens), hq), -math.inf, dtype=cdt, device=dev)
        lse_max.scatter_reduce_(0, seg.view(-1, 1).expand_as(lse), lse, reduce="amax")
        weight = torch.exp(lse - lse_max.index_select(0, seg))  # [R, Hq]
        total = torch.zeros_like(lse_max).index_add_(0, seg, weight)
        acc = torch.zeros(len(merge_tokens), hq, d, dtype=cdt, device=dev)
        acc.index_add_(0, seg, partial_o.index_select(0, rows).to(cdt) * weight.unsqueeze(-1))
        out.index_copy_(0, merge_tokens, (acc / total.unsqueeze(-1)).to(out.dtype))
    return out


def attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor | None = None,
    *,
    kv_layout: str = "NHD",
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain causal attention over each request's gathered pages, no prefix awareness.

    q: [T, Hq, D]; caches paged (``kv_layout``); block_table int [B, max_pages];
    seq_lens int [B] (KV length including the new tokens); qo_indptr int [B+1] or None for one
    token per request. Token ``i`` of the ``n`` new tokens of a request of length ``L`` attends
    to positions ``< L - n + i + 1``. Returns [T, Hq, D] in ``compute_dtype`` (default fp32,
    fp64 for fp64 inputs).
    """
    cdt = compute_dtype or _compute_dtype(q.dtype)
    t_total, hq, d = q.shape
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    hkv = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    lens = [int(x) for x in seq_lens.tolist()]
    if qo_indptr is None:
        indptr = list(range(len(lens) + 1))
    else:
        indptr = [int(x) for x in qo_indptr.tolist()]
    out = torch.zeros(t_total, hq, d, dtype=cdt, device=q.device)
    for b, length in enumerate(lens):
        t0, t1 = indptr[b], indptr[b + 1]
        if t1 == t0:
            continue
        npages = -(-length // page_size)
        pages = block_table[b, :npages].to(device=k_cache.device, dtype=torch.long)
        k = _gather(k_cache, pages, kv_layout)[:length].to(cdt)
        v = _gather(v_cache, pages, kv_layout)[:length].to(cdt)
        qb = q[t0:t1].to(cdt).view(t1 - t0, hkv, g, d)
        scores = torch.einsum("thgd,khd->thgk", qb, k) * scale
        n = t1 - t0
        limit = length - n + torch.arange(n, device=q.device) + 1
        masked = torch.arange(length, device=q.device).view(1, -1) >= limit.view(-1, 1)
        scores = scores.masked_fill(masked.view(n, 1, 1, length), -math.inf)
        p = torch.softmax(scores, dim=-1)
        out[t0:t1] = torch.einsum("thgk,khd->thgd", p, v).reshape(n, hq, d)
    return out
