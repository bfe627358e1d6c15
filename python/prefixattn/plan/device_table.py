"""Host side of plans whose page ids are read on the device (``plan_unshared``,
``plan_hinted``).

Such a plan is built with *positions* in the device block table (``row * W + column``)
standing for page ids; the device stage then replaces each position by the table's entry, in
stream order, so the host never waits for the table. Rows never share a position, so a plan
of positions shares nothing (``plan_unshared``). A hinted plan is built from a host copy of
the table that may be stale (``hint``): its pages are read from the row of each work item's
first request, and a device check compares, for every other request of the item, its pages
with those (:func:`hint_checks`).

Worked example (W = 4): request 0 reads row 2, request 1 row 0, both 2 pages ->
positions [[8, 9], [0, 1]].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .types import PlanArrays


def table_positions(row_of: np.ndarray, width: int, cols: int) -> np.ndarray:
    """int32 [B, cols]: ``row_of[b] * width + column``, the positions in a device table of
    each request's first ``cols`` pages (int32 range checked by the caller)."""
    return row_of.astype(np.int32)[:, None] * np.int32(width) + np.arange(cols, dtype=np.int32)


def hinted_table(
    hint: np.ndarray, row_of: np.ndarray, cols: int, private: Any = None
) -> np.ndarray:
    """The planning table of a hinted plan (int32 [B, cols]): the hint's page ids where known,
    a unique id past them elsewhere (unknown pages are private).

    ``hint``: int array [R', W'] (negative: unknown); ``row_of``: the table row of each
    request; ``private``: bool [B] or None, requests planned as sharing nothing.
    """
    b = row_of.shape[0]
    base = max(int(hint.max(initial=-1)), -1) + 1
    if base + b * cols > np.iinfo(np.int32).max:
        raise ValueError(f"hint holds page id {base - 1}, too large to plan with (int32)")
    table = np.full((b, cols), -1, np.int32)
    known = row_of < hint.shape[0]
    if private is not None:
        mask = np.asarray(private)
        if mask.dtype != np.bool_ or mask.shape != (b,):
            raise ValueError(
                f"private must be a bool array of shape ({b},), got {mask.dtype} "
                f"{tuple(mask.shape)}"
            )
        known &= ~mask
    hc = min(cols, hint.shape[1])
    n_known = int(np.argmin(known)) if not known.all() else b
    if (
        known[:n_known].all()
        and not known[n_known:].any()
        and np.array_equal(row_of[:n_known], np.arange(n_known))
    ):
        table[:n_known, :hc] = hint[:n_known, :hc]  # the usual case: rows in order
    else:
        table[known, :hc] = hint[row_of[known], :hc]
    flat = table.reshape(-1)
    unknown = np.flatnonzero(flat < 0)
    flat[unknown] = base + unknown
    return table


def item_rows(
    host: PlanArrays, indptr: np.ndarray, row_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The table row of each query slot, and of each item's first slot (its page source)."""
    req = np.searchsorted(indptr, host.q_tokens.astype(np.int64), side="right") - 1
    slot_row = row_of[req]
    return slot_row, slot_row[host.q_indptr[:-1]]


def hint_positions(
    host: PlanArrays, indptr: np.ndarray, row_of: np.ndarray, width: int, page_size: int
) -> np.ndarray:
    """Positions in the device table (row * width + column) of every item's pages: the
    columns of the item's KV run in the row of its first request."""
    if (host.kv_start % page_size).any():
        raise RuntimeError("prefixattn internal error: a work item starts inside a page")
    _, rep_row = item_rows(host, indptr, row_of)
    npages = -(-host.kv_len.astype(np.int64) // page_size)
    item = np.repeat(np.arange(len(host.kv_len)), npages)
    k = np.arange(len(item)) - np.repeat(np.cumsum(npages) - npages, npages)
    col = host.kv_start[item].astype(np.int64) // page_size + k
    # Items that share stored pages write the same page ids (each item's rows hold them).
    positions = np.zeros(len(host.kv_pages), dtype=np.int64)
    positions[host.kv_page_offset[item].astype(np.int64) + k] = rep_row[item] * width + col
    return positions.astype(np.int32)


def stored_runs(off: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stored runs of ``kv_pages`` that items with entries ``[off, end)`` form: items whose
    entries overlap belong to one run. Returns ``order`` (the items by offset, stable),
    ``first`` (where in that order each run starts) and ``run`` (the run of each item in that
    order)."""
    order = np.argsort(off, kind="stable")
    reach = np.maximum.accumulate(end[order])
    opens = np.ones(len(order), dtype=bool)
    opens[1:] = off[order][1:] >= reach[:-1]
    return order, np.flatnonzero(opens), np.cumsum(opens) - 1


def position_runs(
    host: PlanArrays, item_row: np.ndarray, width: int, page_size: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The positions of a device-table plan's ``kv_pages`` as runs, in O(items).

    Item ``w`` reads the columns from ``kv_start[w] / page_size`` on of device-table row
    ``item_row[w]``, stored from ``kv_page_offset[w]`` on, so entry ``i`` of its pages stands
    for position ``i + delta_w``, ``delta_w = item_row[w] * width + kv_start[w] / page_size -
    kv_page_offset[w]``. Items whose stored pages overlap form one run, which has one delta.
    Returns int32 ``(run_len, run_delta)``, the runs in order, tiling ``kv_pages``; ``None``
    where the items of one run disagree (the caller then computes every position).

    Entries no item reads (room left after a run for later decode steps, see
    :func:`~prefixattn.plan.advance.with_room`) belong to the run before them, so their
    positions continue its row and may pass the table's end: the caller clamps them. Entries
    before the first run form a run of delta 0.

    Worked example (W = 100, page size 1): items (row 2, start 0, 3 pages, offset 0) and
    (row 5, start 4, 2 pages, offset 3): runs of 3 and 2 entries, deltas 200 and 501, so
    ``kv_pages`` stands for positions [200, 201, 202, 504, 505].
    """
    npages = -(-host.kv_len.astype(np.int64) // page_size)
    has = np.flatnonzero(npages > 0)
    total = len(host.kv_pages)
    if not len(has):
        return (np.zeros(0, np.int32), np.zeros(0, np.int32)) if total == 0 else None
    off = host.kv_page_offset.astype(np.int64)[has]
    end = off + npages[has]
    delta = item_row.astype(np.int64)[has] * width + host.kv_start[has] // page_size - off
    o, first, run = stored_runs(off, end)
    off, end, delta = off[o], end[o], delta[o]
    if (delta != delta[first][run]).any() or np.maximum.reduceat(end, first)[-1] > total:
        return None
    run_start = off[first]
    run_len = np.diff(run_start, append=total)
    run_delta = delta[first]
    if run_start[0] > 0:
        run_len = np.concatenate([[run_start[0]], run_len])
        run_delta = np.concatenate([[0], run_delta])
    return run_len.astype(np.int32), run_delta.astype(np.int32)


def hint_checks(
    host: PlanArrays, indptr: np.ndarray, row_of: np.ndarray, width: int, page_size: int
) -> dict[str, np.ndarray]:
    """Runs of pages to compare on the device: for every item and every request of it other
    than the one its pages are read from, ``a`` (first position in that request's row), ``b``
    (first position in the source row) and ``n`` (page count), int32."""
    slot_row, rep_row = item_rows(host, indptr, row_of)
    slots: np.ndarray = np.diff(host.q_indptr).astype(np.int64)
    item = np.repeat(np.arange(len(host.kv_len)), slots)
    npages = -(-host.kv_len.astype(np.int64) // page_size)[item]
    keep = (slot_row != rep_row[item]) & (npages > 0)
    col0 = host.kv_start[item].astype(np.int64) // page_size
    a0 = slot_row * width + col0
    b0 = rep_row[item] * width + col0
    return {
        "a": a0[keep].astype(np.int32),
        "b": b0[keep].astype(np.int32),
        "n": npages[keep].astype(np.int32),
    }
