"""A decode step's plan from the previous step's, in O(items + slots): no forest, no packing.

In a decode run the batch stays the same and every request gains one token per step. The
previous step's plan then stays a valid plan of the new step once each request's newest
position is added to the one work item that ends at its old length and serves it alone (its
private tail), and its query slots see one position further. That is all this module does;
the items, their tiles, splits and merges stay as they were planned, so the plan stays
correct while its shape slowly drifts from the one a fresh plan would choose (callers plan
afresh every few steps).

Where a grown request has no such item (its newest pages were shared with another request
at the last plan, e.g. parallel samples before their first own token) :func:`advance` gives
None and the caller plans afresh. Only plans whose page ids are read on the device are
advanced: their ``kv_pages`` host array holds no page id the device reads (positions are
shipped as runs), so only its length and the items' offsets into it are kept up to date;
its entries are zero (a read-only view that takes no memory).

Worked example (page size 1): request 0 of length 10 has items A (shared, positions 0-7,
offset 0) and B (private, positions 8-9, offset 8), stored as one run of row 0 (10
entries). One step later B reads positions 8-10, the run holds 11 entries, and the next
run's items move one entry on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .device_table import stored_runs
from .layout import COUNTS, LEAF_TILE_TOKENS, variant_bounds
from .planner import HostPlan

ADVANCE_STEPS = 16
"""A plan is advanced at most this many times in a row before it is planned afresh."""

_NUM_PAGES = COUNTS.index("num_pages")


def advance(
    hp: HostPlan,
    old_lens: np.ndarray,
    new_lens: np.ndarray,
    indptr: np.ndarray,
    page_size: int,
    kv_token_bytes: int,
) -> HostPlan | None:
    """``hp`` (planned for ``old_lens``) advanced to ``new_lens``: each request at most one
    token longer, the same ``indptr`` with at most one query token per request. None where
    the plan cannot be advanced (see the module docstring). ``kv_token_bytes``: KV bytes of
    one token (all KV heads), for the byte accounting."""
    grow = new_lens - old_lens
    if grow.min(initial=0) < 0 or grow.max(initial=0) > 1:
        return None
    q_len = np.diff(indptr)
    if q_len.max(initial=0) > 1 or (grow[q_len == 0] != 0).any():
        return None
    grown = np.flatnonzero(grow)
    if not len(grown):
        return hp
    h = hp.host
    n_items = len(h.kv_len)
    slots = np.diff(h.q_indptr).astype(np.int64)
    slot_item = np.repeat(np.arange(n_items), slots)
    slot_req = np.searchsorted(indptr, h.q_tokens.astype(np.int64), side="right") - 1
    if not len(slot_req):
        return None
    # Items whose slots are all one request's: that request, else -1.
    first_req = slot_req[np.minimum(h.q_indptr[:-1], len(slot_req) - 1)]
    owner = np.where(slots > 0, first_req, -1)
    others = np.bincount(slot_item, weights=slot_req != owner[slot_item], minlength=n_items)
    owner = np.where(others > 0, -1, owner)
    end = h.kv_start.astype(np.int64) + h.kv_len
    # The item each grown request extends: its own item ending at its old length.
    tail = np.flatnonzero((owner >= 0) & (end == old_lens[np.maximum(owner, 0)]))
    tail = tail[grow[owner[tail]] == 1]
    if len(tail) != len(grown) or len(np.unique(owner[tail])) != len(grown):
        return None
    kv_len = h.kv_len.astype(np.int64)
    kv_len[tail] += 1
    q_limit = h.q_limit + grow[slot_req].astype(h.q_limit.dtype)
    # Stored pages: items whose page count grew lengthen their run; later runs move on.
    old_pages = -(-h.kv_len.astype(np.int64) // page_size)
    new_pages = -(-kv_len // page_size)
    kv_page_offset = h.kv_page_offset
    num_pages = len(h.kv_pages)
    if (new_pages != old_pages).any():
        has = np.flatnonzero(new_pages > 0)
        off = h.kv_page_offset.astype(np.int64)[has]
        o, first, run = stored_runs(off, off + old_pages[has])
        has, off = has[o], off[o]
        rel = off - off[first][run]
        run_len = np.maximum.reduceat(rel + new_pages[has], first)
        start = np.cumsum(run_len) - run_len
        kv_page_offset = h.kv_page_offset.copy()
        kv_page_offset[has] = (start[run] + rel).astype(np.int32)
        num_pages = int(run_len.sum())
    host = dataclasses.replace(
        h,
        kv_len=kv_len.astype(np.int32),
        q_limit=q_limit,
        kv_page_offset=kv_page_offset,
        kv_pages=h.kv_pages if num_pages == len(h.kv_pages) else _zeros(num_pages),
    )
    counts = hp.counts.copy()
    counts[_NUM_PAGES] = num_pages
    bounds = variant_bounds(hp.tiles, hp.tile_indptr)
    leaf_len = kv_len[bounds[0] : bounds[1]]
    added = len(grown) * kv_token_bytes
    return dataclasses.replace(
        hp,
        host=host,
        counts=counts,
        kv_bytes=hp.kv_bytes + added,
        distinct_kv_bytes=hp.distinct_kv_bytes + added,
        query_centric_kv_bytes=hp.query_centric_kv_bytes + added,
        leaf_tiles=int((-(-leaf_len // LEAF_TILE_TOKENS)).sum()),
    )


def _zeros(n: int) -> np.ndarray:
    """A read-only int32 array of ``n`` zeros that takes no memory (a broadcast view)."""
    return np.broadcast_to(np.zeros(1, np.int32), (n,))


__all__ = ["ADVANCE_STEPS", "advance"]
