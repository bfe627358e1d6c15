"""Validation of the inputs of ``PrefixAttention.plan*`` and ``run``.

Each check raises the exception a caller can act on (``TypeError`` for a wrong type,
``ValueError`` for a wrong shape or value, ``IndexError`` for a page id outside the cache)
with a message that names the argument and, where there is one, the offending entry.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .plan.planner import entries_read
from .plan.types import LaunchPlan

_INT64_MAX = np.iinfo(np.int64).max
_INT32_MAX = np.iinfo(np.int32).max


def host_int_array(name: str, value: Any, ndim: int, keep_dtype: bool = False) -> np.ndarray:
    """A C-contiguous host copy of an integer tensor/array argument (int32 kept as is, other
    integer types as int64, or as they are with ``keep_dtype``), with its rank checked."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 tensor, got {value.dtype}")
        if value.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor (it holds no values)")
        arr = value.detach().to("cpu").numpy()
    elif isinstance(value, np.ndarray):
        if not np.issubdtype(value.dtype, np.integer):
            raise TypeError(f"{name} must be an integer array, got {value.dtype}")
        arr = value
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if arr.dtype == np.int32 or keep_dtype:
        return np.ascontiguousarray(arr)
    if arr.dtype == np.uint64 and arr.size and arr.max() > _INT64_MAX:
        at = tuple(int(i) for i in np.unravel_index(int(arr.argmax()), arr.shape))
        raise ValueError(f"{name}[{', '.join(map(str, at))}] = {int(arr.max())} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def int32_page_ids(
    table: np.ndarray, lens: np.ndarray, indptr: np.ndarray, page_size: int
) -> np.ndarray:
    """``table`` (any integer dtype) as int32, after checking that every entry a request with
    new tokens uses (its first ``ceil(len / page_size)``) is a page id in [0, 2**31); other
    entries may hold anything. The first bad entry in row-major order is reported, the same
    for either planner."""
    int32_max = np.iinfo(np.int32).max
    if table.size == 0 or (
        int(table.min()) >= 0 and (table.dtype == np.int32 or int(table.max()) <= int32_max)
    ):
        return table if table.dtype == np.int32 else table.astype(np.int32)
    bad = entries_read(table, lens, indptr, page_size) & ((table < 0) | (table > int32_max))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        v = int(table[b, j])
        what = "a negative page id" if v < 0 else "a page id beyond int32 range"
        raise IndexError(f"block_table[{b}, {j}] = {v} is {what}")
    # Unused entries may wrap (or be negative): they are never read.
    return table if table.dtype == np.int32 else table.astype(np.int32)


def host_qo_indptr(qo_indptr: Any, b: int) -> np.ndarray:
    """int64 host copy of ``qo_indptr`` [B+1] (None: one new token per request)."""
    if qo_indptr is None:
        return np.arange(b + 1, dtype=np.int64)
    indptr = host_int_array("qo_indptr", qo_indptr, ndim=1).astype(np.int64, copy=False)
    if indptr.shape[0] != b + 1:
        raise ValueError(f"qo_indptr must have B+1 = {b + 1} entries, got {indptr.shape[0]}")
    return indptr


def check_split_kv(split_kv: Any) -> None:
    if not isinstance(split_kv, bool):
        raise TypeError(f"split_kv must be a bool, got {type(split_kv).__name__}")


def check_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.floating | np.integer):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def check_seq_lens(lens: np.ndarray) -> None:
    """seq_lens in [0, 2**31): plans hold positions and causal bounds as int32."""
    bad = (lens < 0) | (lens > _INT32_MAX)
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        v = int(lens[b])
        if v < 0:
            raise ValueError(f"seq_lens[{b}] = {v} is negative")
        raise ValueError(
            f"seq_lens[{b}] = {v} is beyond int32 range: request {b} is longer than the "
            f"{_INT32_MAX} tokens a plan's int32 positions hold"
        )


def check_lengths(table: np.ndarray, lens: np.ndarray, indptr: np.ndarray, page_size: int) -> None:
    """seq_lens in [0, 2**31) and within the table's rows, qo_indptr from 0, non-decreasing,
    within seq_lens and at most 2**31 - 1 tokens in all."""
    check_seq_lens(lens)
    if indptr.shape[0] and indptr[0] != 0:
        raise ValueError(f"qo_indptr must start at 0, got {int(indptr[0])}")
    qo_len = np.diff(indptr)
    if (qo_len < 0).any():
        b = int(np.flatnonzero(qo_len < 0)[0])
        raise ValueError(f"qo_indptr is decreasing at request {b} (negative query length)")
    if (qo_len > lens).any():
        b = int(np.flatnonzero(qo_len > lens)[0])
        raise ValueError(
            f"qo_indptr gives request {b} {int(qo_len[b])} new tokens but seq_lens[{b}] is "
            f"{int(lens[b])}; seq_lens must include the new tokens"
        )
    if indptr.shape[0] and indptr[-1] > _INT32_MAX:
        raise ValueError(
            f"qo_indptr holds {int(indptr[-1])} query tokens, more than the {_INT32_MAX} "
            "a plan's int32 token indices hold"
        )
    capacity = table.shape[1] * page_size
    if (lens > capacity).any():
        b = int(np.flatnonzero(lens > capacity)[0])
        raise ValueError(
            f"seq_lens[{b}] = {int(lens[b])} needs {-(-int(lens[b]) // page_size)} pages but "
            f"block_table rows hold {table.shape[1]} (page_size {page_size})"
        )


def plan_inputs(
    block_table: Any, seq_lens: Any, qo_indptr: Any, packing: str, packings: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host (block_table in its own integer dtype, int64 seq_lens, int64 qo_indptr) of
    ``PrefixAttention.plan``, shapes and packing checked."""
    table = host_int_array("block_table", block_table, ndim=2, keep_dtype=True)
    lens = host_int_array("seq_lens", seq_lens, ndim=1).astype(np.int64, copy=False)
    b = table.shape[0]
    if lens.shape[0] != b:
        raise ValueError(f"seq_lens has {lens.shape[0]} entries but block_table has {b} rows")
    indptr = host_qo_indptr(qo_indptr, b)
    if packing not in packings:
        raise ValueError(f"unknown packing {packing!r}; expected one of {', '.join(packings)}")
    return table, lens, indptr


def device_table_inputs(
    block_table: Any,
    seq_lens: Any,
    qo_indptr: Any,
    rows: Any,
    device: torch.device,
    page_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Checked (lens, qo_indptr, row of each request, columns used) of plans that read page
    ids from a device table (``plan_unshared``, ``plan_hinted``)."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(
            f"block_table must be a torch.Tensor on {device}, got {type(block_table).__name__}"
        )
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be an int32 tensor, got {block_table.dtype}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D, got shape {tuple(block_table.shape)}")
    if block_table.device != device and not (
        block_table.is_cuda and device.type == "cuda" and device.index is None
    ):
        raise ValueError(f"block_table is on {block_table.device}, expected {device}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError("block_table must have a contiguous last dimension")
    lens = host_int_array("seq_lens", seq_lens, ndim=1).astype(np.int64, copy=False)
    check_seq_lens(lens)
    b = lens.shape[0]
    indptr = host_qo_indptr(qo_indptr, b)
    if rows is None:
        row_of = np.arange(b, dtype=np.int64)
    else:
        row_of = host_int_array("rows", rows, ndim=1).astype(np.int64, copy=False)
        if row_of.shape[0] != b:
            raise ValueError(f"rows has {row_of.shape[0]} entries but seq_lens has {b}")
    num_rows, width = block_table.shape
    if b and (row_of.min() < 0 or row_of.max() >= num_rows):
        r = int(np.flatnonzero((row_of < 0) | (row_of >= num_rows))[0])
        raise IndexError(f"rows[{r}] = {int(row_of[r])} is outside block_table's {num_rows} rows")
    cols = max(1, -(-int(lens.max(initial=0)) // page_size))
    if cols > width:
        r = int(np.argmax(lens))
        raise ValueError(
            f"seq_lens[{r}] = {int(lens[r])} needs {cols} pages but block_table rows hold "
            f"{width} (page_size {page_size})"
        )
    # The host plans with positions in the table (row * W + column) standing for page ids;
    # the device maps positions to ids.
    if num_rows * width > np.iinfo(np.int32).max:
        raise ValueError(f"block_table has {num_rows * width} entries, more than int32 holds")
    return lens, indptr, row_of, cols


def layout_doc(layout: str) -> str:
    if layout == "NHD":
        return "[num_pages, page_size, num_kv_heads, head_dim]"
    return "[num_pages, num_kv_heads, page_size, head_dim]"


def check_layout_strides(name: str, cache: torch.Tensor, kv_layout: str) -> None:
    """Where page_size == num_kv_heads the NHD and HND shapes are the same; then the strides
    of dims 1 and 2 tell the layout where they can: a cache whose dim 2 encloses dim 1 in
    memory (stride(2) >= stride(1) * size(1), and not the other way round) is in the other
    layout's order (e.g. an HND view of an NHD cache, or of vLLM's packed K/V). A cache whose
    dim 1 encloses dim 2 (contiguous ones, vLLM's packed NHD views with strides
    (page, heads * 2D, 2D, 1)) is taken as ``kv_layout``: nothing tells the layouts apart
    there."""
    n = cache.shape[1]
    if n != cache.shape[2] or n <= 1:
        return
    s1, s2 = cache.stride(1), cache.stride(2)
    if s2 >= s1 * n and not s1 >= s2 * n:
        other = "HND" if kv_layout == "NHD" else "NHD"
        raise ValueError(
            f"{name} has shape {tuple(cache.shape)} and strides {tuple(cache.stride())}: with "
            f"page_size == num_kv_heads == {n} that shape fits both layouts, and the strides "
            f"put dim 2 outside dim 1 in memory, the order of a {other} cache "
            f"({layout_doc(other)}), but this PrefixAttention was built for kv_layout "
            f"{kv_layout!r} ({layout_doc(kv_layout)}). Pass the cache with dims 1 and 2 in "
            f"memory order, or build the object with kv_layout={other!r}"
        )


def check_run_inputs(
    geometry: tuple[int, int, int, int, str],
    dtype: torch.dtype,
    plan: Any,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    out: Any,
) -> None:
    """The arguments of ``PrefixAttention.run`` against the object's ``geometry``
    (num_qo_heads, num_kv_heads, head_dim, page_size, kv_layout), its ``dtype`` and the plan."""
    if not isinstance(plan, LaunchPlan):
        raise TypeError(f"plan must be a LaunchPlan, got {type(plan).__name__}")
    num_qo_heads, num_kv_heads, head_dim, page_size, kv_layout = geometry
    theirs = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
              plan.kv_layout)  # fmt: skip
    if geometry != theirs:
        names = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "kv_layout")
        diff = ", ".join(
            f"{n} {b!r} vs {a!r}" for n, a, b in zip(names, geometry, theirs, strict=True) if a != b
        )
        raise ValueError(f"the plan was built for another geometry than this object: {diff}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if not isinstance(t, torch.Tensor) and not (name == "out" and t is None):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(
            f"q must be 3-D [tokens, num_qo_heads, head_dim], got shape {tuple(q.shape)}"
        )
    expected_q = (plan.num_tokens, num_qo_heads, head_dim)
    if tuple(q.shape) != expected_q:
        raise ValueError(f"q has shape {tuple(q.shape)}, expected {expected_q} for this plan")
    if q.dtype != dtype:
        raise TypeError(f"q has dtype {q.dtype} but this PrefixAttention was built for {dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q must have a contiguous last dimension")
    if q.device.type != plan.device.type or (
        q.is_cuda and plan.device.index is not None and q.device.index != plan.device.index
    ):
        raise ValueError(f"q is on {q.device} but the plan's arrays are on {plan.device}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if name == "v_cache" and v_cache.dim() == 4 and v_cache.shape[0] != k_cache.shape[0]:
            raise ValueError(
                f"k_cache has {k_cache.shape[0]} pages but v_cache has {v_cache.shape[0]}"
            )
        if cache.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D ({layout_doc(kv_layout)}), got shape {tuple(cache.shape)}"
            )
        if kv_layout == "NHD":
            _, ps, hkv, d = cache.shape
        else:
            _, hkv, ps, d = cache.shape
        if (ps, hkv, d) != (page_size, num_kv_heads, head_dim):
            raise ValueError(
                f"{name} has shape {tuple(cache.shape)}; expected {layout_doc(kv_layout)} "
                f"with page_size={page_size}, num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        check_layout_strides(name, cache, kv_layout)
        if cache.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {cache.dtype} but q has {q.dtype}")
        if cache.device != q.device:
            raise ValueError(f"{name} is on {cache.device} but q is on {q.device}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (head_dim)")
        if plan.max_page_id >= cache.shape[0]:
            raise IndexError(
                f"block_table refers to page {plan.max_page_id} but {name} has only "
                f"{cache.shape[0]} pages"
            )
    if out is not None:
        if tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
        if out.dtype != q.dtype or out.device != q.device:
            raise TypeError(
                f"out must match q's dtype and device ({q.dtype}, {q.device}), "
                f"got ({out.dtype}, {out.device})"
            )
        if out.stride(-1) != 1:
            raise ValueError("out must have a contiguous last dimension")
        if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape, strict=True)):
            raise ValueError("out has overlapping elements (a stride of 0): it cannot be written")
        if out.requires_grad:
            raise ValueError(
                "out requires grad; pass a tensor that does not (attention here is inference only)"
            )
