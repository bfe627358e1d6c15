"""Native (C++) plan construction: :func:`build_forest` + :func:`pack` in one host call.

``build_plan_native`` returns exactly what ::

    forest = build_forest(block_table, np.where(np.diff(qo_indptr) > 0, seq_lens, 0), page_size)
    host, tiles, tile_indptr, accounting = pack(
        forest, block_table, seq_lens, qo_indptr, shape, table, packing, split_kv
    )

returns (the forest built from the requests that have new tokens, as
``PrefixAttention.plan`` does), computed by the ``prefixattn::build_plan`` CPU op of the
compiled library (cpp/plan/). The int32 arrays are numpy views of the op's output buffers
(fresh ones on every call).

The op must be registered: ``prefixattn.runtime.library.native_plan_available()`` loads the
library and says whether it provides it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any, overload

import numpy as np
import torch

from .forest import PrefixForest
from .packing import LEAF_SPLIT_TOKENS, MIN_SPLIT_TOKENS, PACKINGS, BatchShape
from .tiles import TileTable
from .types import PlanArrays

_FOREST_FIELDS = (
    "parent", "page_begin", "page_end", "req_begin", "req_end", "order", "ending_indptr",
    "ending_reqs", "children_indptr", "children",
)  # fmt: skip
_PLAN_FIELDS = (
    "kv_page_offset", "kv_start", "kv_len", "q_indptr", "q_tokens", "q_limit",
    "q_out", "tile_id", "tile_indptr", "merge_tokens", "merge_indptr", "merge_partials",
)  # fmt: skip
_NUM_FIELDS = len(_FOREST_FIELDS) + len(_PLAN_FIELDS)  # int32 arrays in the op's first output
# (kv_pages, the largest array, is the op's third output)


def _registered() -> Any:
    try:
        return torch.ops.prefixattn.build_plan
    except (AttributeError, RuntimeError):
        return None


class _Children(Sequence[list[int]]):
    """``PrefixForest.children`` of a native forest: the lists are built on first use from
    the CSR arrays (children of ``u``: ``flat[indptr[u]:indptr[u + 1]]``, in order).

    It compares equal to the list of lists it stands for.
    """

    __slots__ = ("_flat", "_indptr", "_lists")

    def __init__(self, indptr: np.ndarray, flat: np.ndarray) -> None:
        self._indptr = indptr
        self._flat = flat
        self._lists: list[list[int]] | None = None

    def _all(self) -> list[list[int]]:
        if self._lists is None:
            flat = self._flat.tolist()
            self._lists = [flat[a:b] for a, b in pairwise(self._indptr.tolist())]
        return self._lists

    @overload
    def __getitem__(self, i: int) -> list[int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[list[int]]: ...
    def __getitem__(self, i: int | slice) -> list[int] | list[list[int]]:
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._indptr) - 1

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Children):
            other = other._all()
        return self._all() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._all())


def _as_tensor(a: Any, name: str) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        t = a.detach().cpu()
    else:
        arr = np.asarray(a)
        if arr.dtype not in (np.int32, np.int64):
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"{name} must be an integer array, got {arr.dtype}")
            arr = arr.astype(np.int64)
        t = torch.from_numpy(np.ascontiguousarray(arr))
    return t


def build_plan_native(
    block_table: np.ndarray | torch.Tensor,
    seq_lens: np.ndarray | torch.Tensor,
    qo_indptr: np.ndarray | torch.Tensor,
    page_size: int,
    shape: BatchShape,
    table: TileTable,
    packing: str,
    split_kv: bool,
    split_target: int = 0,
    *,
    forest_skips_idle: bool = True,
    reuse_forest: bool = False,
    finish_leaf_warps: int = 0,
    split_waves: bool = False,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    leaf_split_tokens: int = LEAF_SPLIT_TOKENS,
) -> tuple[PrefixForest, PlanArrays, tuple[tuple[int, int], ...], tuple[int, ...], dict[str, int]]:
    """The forest, host plan arrays, tiles, tile-group bounds and byte accounting of a batch.

    Arguments as for :func:`prefixattn.plan.forest.build_forest` and
    :func:`prefixattn.plan.packing.pack`. With ``forest_skips_idle=False`` the forest is built from
    ``seq_lens`` as given (``build_forest(block_table, seq_lens, page_size)``).

    The forest's ``children`` is a read-only sequence that equals the Python forest's list of
    lists; its lists are built on first use. Host work only (not for graph capture or
    ``torch.compile``); each calling thread reuses its own scratch memory.

    ``reuse_forest=True`` packs with the forest of this thread's previous call instead of
    building it again: for a batch packed with several tile tables in a row, the same
    ``block_table``, ``seq_lens`` and ``qo_indptr`` objects, unchanged, and the same
    ``page_size`` and ``forest_skips_idle``. Where those are not the previous call's buffers and
    sizes the op builds the forest anyway.

    ``finish_leaf_warps > 0`` also applies :func:`prefixattn.plan.packing.finish_in_leaf` to the
    packed arrays (the items of 16-row tiles as the leaf items, ``leaf_warps =
    finish_leaf_warps``); the accounting then has ``num_finished``.
    """
    op = _registered()
    if op is None:
        raise RuntimeError(
            "the compiled prefixattn library with build_plan is not loaded "
            "(prefixattn.runtime.library.native_plan_available())"
        )
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}; expected one of {', '.join(PACKINGS)}")
    n_by = table.n_by_kv_len
    ints_t, meta_t, pages_t = op(
        _as_tensor(block_table, "block_table"),
        _as_tensor(seq_lens, "seq_lens"),
        _as_tensor(qo_indptr, "qo_indptr"),
        page_size,
        shape.num_qo_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.elem_bytes,
        list(table.m_sizes),
        [b for b, _ in n_by],
        [n for _, n in n_by],
        packing,
        bool(split_kv),
        int(split_target),
        bool(forest_skips_idle),
        int(table.wide_rows),
        int(table.wide_kv_len),
        bool(reuse_forest),
        int(finish_leaf_warps),
        bool(split_waves),
        int(min_split_tokens),
        int(leaf_split_tokens),
    )
    ints = ints_t.numpy()
    meta = meta_t.numpy()
    head = meta[: _NUM_FIELDS + 5].tolist()
    arrays = []
    at = 0
    for size in head[:_NUM_FIELDS]:
        arrays.append(ints[at : at + size])
        at += size
    kv_bytes, partial_bytes, num_partials, num_finished, num_tiles = head[_NUM_FIELDS:]
    at = _NUM_FIELDS + 5
    tm = meta[at : at + num_tiles].tolist()
    tn = meta[at + num_tiles : at + 2 * num_tiles].tolist()
    token_end = meta[at + 2 * num_tiles :]

    nf = len(_FOREST_FIELDS)
    f = dict(zip(_FOREST_FIELDS, arrays[:nf], strict=True))
    children = _Children(f.pop("children_indptr"), f.pop("children"))
    forest = PrefixForest(
        page_size=page_size,
        token_end=token_end,
        children=children,
        **f,
    )
    plan_arrays = dict(zip(_PLAN_FIELDS, arrays[nf:], strict=True))
    host = PlanArrays(kv_pages=pages_t.numpy(), **plan_arrays)
    tiles = tuple(zip(tm, tn, strict=True))
    tile_indptr = tuple(host.tile_indptr.tolist())
    accounting = {
        "kv_bytes": kv_bytes,
        "partial_bytes": partial_bytes,
        "num_partials": num_partials,
    }
    if finish_leaf_warps > 0:
        accounting["num_finished"] = num_finished
    return forest, host, tiles, tile_indptr, accounting
