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
entries). One step later B reads positions 8-10 and the run holds 11 entries. Laid out by
:func:`with_room`, the run had room for them and nothing else changes; laid out end to end,
the next run's items move one entry on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .device_table import stored_runs
from .layout import COUNTS, LEAF_TILE_TOKENS, variant_bounds
from .planner import HostPlan

ADVANCE_STEPS = 16
"""A plan is advanced at most this many times in a row before it is planned afresh."""

_NUM_PAGES = COUNTS.index("num_pages")


class AdvanceIndex:
    """What :func:`advance` looks up that stays the same while a plan is advanced (its items,
    their requests and query slots do not change): the request of each query slot, the item
    each request's newest pages are in (its tail), and where each item's stored pages may end
    before they reach the next run's (kept for one layout of the pages)."""

    def __init__(self, hp: HostPlan, indptr: np.ndarray, num_requests: int) -> None:
        h = hp.host
        n_items = len(h.kv_len)
        slots = np.diff(h.q_indptr).astype(np.int64)
        slot_item = np.repeat(np.arange(n_items), slots)
        self.slot_req = np.searchsorted(indptr, h.q_tokens.astype(np.int64), side="right") - 1
        self.tail_of = np.full(num_requests, -1, np.int64)
        if len(self.slot_req):
            # Items whose slots are all one request's: that request, else -1.
            first_req = self.slot_req[np.minimum(h.q_indptr[:-1], len(self.slot_req) - 1)]
            owner = np.where(slots > 0, first_req, -1)
            mixed = np.bincount(
                slot_item, weights=self.slot_req != owner[slot_item], minlength=n_items
            )
            owner = np.where(mixed > 0, -1, owner)
            # Each request's own item that ends last; none where two end there.
            own = np.flatnonzero(owner >= 0)
            end = h.kv_start[own].astype(np.int64) + h.kv_len[own]
            order = np.lexsort((end, owner[own]))
            own, end = own[order], end[order]
            last = np.ones(len(own), dtype=bool)
            last[:-1] = owner[own][1:] != owner[own][:-1]
            tie = np.zeros(len(own), dtype=bool)
            tie[1:] = (owner[own][1:] == owner[own][:-1]) & (end[1:] == end[:-1])
            keep = own[last & ~tie]
            self.tail_of[owner[keep]] = keep
        self._layout: tuple[np.ndarray, np.ndarray] | None = None

    def page_limits(self, h: Any, page_size: int) -> np.ndarray:
        """int64 [W]: the entry each item's stored pages may grow up to without reaching the
        next run (the next run's first entry, or the end of ``kv_pages``)."""
        if self._layout is not None and self._layout[0] is h.kv_page_offset:
            return self._layout[1]
        npages = -(-h.kv_len.astype(np.int64) // page_size)
        off = h.kv_page_offset.astype(np.int64)
        limit = np.full(len(off), len(h.kv_pages), np.int64)
        has = np.flatnonzero(npages > 0)
        if len(has):
            o, first, run = stored_runs(off[has], off[has] + npages[has])
            next_start = np.append(off[has][o][first][1:], len(h.kv_pages))
            limit[has[o]] = next_start[run]
        self._layout = (h.kv_page_offset, limit)
        return limit


def advances(indptr: np.ndarray) -> bool:
    """May a plan of these query offsets be advanced (:func:`advance`): at most one new token
    per request? Plans of other steps are never laid out with room (:func:`with_room`)."""
    return bool(np.diff(indptr).max(initial=0) <= 1)


def advance(
    hp: HostPlan,
    old_lens: np.ndarray,
    new_lens: np.ndarray,
    indptr: np.ndarray,
    page_size: int,
    kv_token_bytes: int,
    index: AdvanceIndex | None = None,
) -> HostPlan | None:
    """``hp`` (planned for ``old_lens``) advanced to ``new_lens``: each request at most one
    token longer, the same ``indptr`` with at most one query token per request. None where
    the plan cannot be advanced (see the module docstring). ``kv_token_bytes``: KV bytes of
    one token (all KV heads), for the byte accounting. ``index``: :class:`AdvanceIndex` of
    ``hp``'s lineage and ``indptr`` (kept by callers that advance step after step)."""
    grow = new_lens - old_lens
    if grow.min(initial=0) < 0 or grow.max(initial=0) > 1:
        return None
    if not advances(indptr) or (grow[np.diff(indptr) == 0] != 0).any():
        return None
    grown = np.flatnonzero(grow)
    if not len(grown):
        return hp
    h = hp.host
    if index is None:
        index = AdvanceIndex(hp, indptr, len(new_lens))
    if not len(index.slot_req):
        return None
    # The item each grown request extends: its own item ending at its old length.
    tail = index.tail_of[grown]
    if (tail < 0).any():
        return None
    if (h.kv_start[tail].astype(np.int64) + h.kv_len[tail] != old_lens[grown]).any():
        return None
    kv_len = h.kv_len.astype(np.int64)
    kv_len[tail] += 1
    q_limit = h.q_limit + grow[index.slot_req].astype(h.q_limit.dtype)
    # Stored pages: items whose page count grew lengthen their run. Where every run still
    # fits before the next one (the room of :func:`with_room`), nothing moves; else the
    # runs are laid out again, end to end.
    kv_page_offset = h.kv_page_offset
    num_pages = len(h.kv_pages)
    new_tail_pages = -(-kv_len[tail] // page_size)
    paged = new_tail_pages != -(-h.kv_len[tail].astype(np.int64) // page_size)
    if paged.any():
        ends = h.kv_page_offset[tail[paged]].astype(np.int64) + new_tail_pages[paged]
        if (ends > index.page_limits(h, page_size)[tail[paged]]).any():
            old_pages = -(-h.kv_len.astype(np.int64) // page_size)
            has, run, rel, run_len = _page_runs(h, old_pages, -(-kv_len // page_size))
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


def with_room(hp: HostPlan, page_size: int, room: int | None = None) -> HostPlan:
    """``hp`` with its stored page runs laid out again, end to end, each followed by room for
    the pages its items gain in :data:`ADVANCE_STEPS` decode steps, so that advancing the
    plan moves no item's pages (their positions, and so the device's expansion of them, stay
    the same). ``room``: at most this many entries in all (e.g. what a reserved device buffer
    holds), the room shared evenly by the runs (0 where there is none: end to end); None:
    no limit. Only for plans whose page ids are read on the device (the entries are
    positions, :mod:`prefixattn.plan.device_table`).

    Worked example (page size 1): runs of 10 and 3 entries at offsets 0 and 10 become runs at
    offsets 0 and 27, 47 entries in all (17 = ADVANCE_STEPS + 1 entries of room after each).
    """
    h = hp.host
    npages = -(-h.kv_len.astype(np.int64) // page_size)
    if not (npages > 0).any():
        return hp
    has, run, rel, run_len = _page_runs(h, npages, npages)
    extra = -(-ADVANCE_STEPS // page_size) + 1
    if room is not None:
        extra = min(extra, max(room - int(run_len.sum()), 0) // len(run_len))
    size = run_len + extra
    start = np.cumsum(size) - size
    num_pages = int(size.sum())
    kv_page_offset = np.zeros_like(h.kv_page_offset)  # items without pages: offset 0
    kv_page_offset[has] = (start[run] + rel).astype(np.int32)
    counts = hp.counts.copy()
    counts[_NUM_PAGES] = num_pages
    host = dataclasses.replace(h, kv_page_offset=kv_page_offset, kv_pages=_zeros(num_pages))
    return dataclasses.replace(hp, host=host, counts=counts)


def _page_runs(
    h: Any, old_pages: np.ndarray, new_pages: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The stored page runs of ``h`` (by the items' ``old_pages``, :func:`stored_runs`) and
    their lengths with ``new_pages`` per item: ``has`` (the items with pages, in stored
    order), ``run`` (the run of each), ``rel`` (its offset in the run) and ``run_len``."""
    has = np.flatnonzero(new_pages > 0)
    off = h.kv_page_offset.astype(np.int64)[has]
    o, first, run = stored_runs(off, off + old_pages[has])
    has, off = has[o], off[o]
    rel = off - off[first][run]
    return has, run, rel, np.maximum.reduceat(rel + new_pages[has], first)


def _zeros(n: int) -> np.ndarray:
    """A read-only int32 array of ``n`` zeros that takes no memory (a broadcast view)."""
    return np.broadcast_to(np.zeros(1, np.int32), (n,))


__all__ = ["ADVANCE_STEPS", "AdvanceIndex", "advance", "advances", "with_room"]
