"""Whether a recent step shared pages, known without waiting for the GPU.

An engine that plans every step with :meth:`PrefixAttention.plan` copies its block table to
the host, and that copy waits for the previous step's GPU work. When no request of a batch
shares a page with another, :meth:`PrefixAttention.plan_unshared` gives the same reads without
the copy. :class:`SharingProbe` tells the engine which to use: it watches the first page id of
each request (with prefix caching, requests that share any page share their first one), from
the host table when the engine has one, else from an asynchronous copy of the device table's
first column that is read once it has landed, a step or more later.

Using a verdict that is a step old only costs speed: ``plan_unshared`` is correct for any
batch, and a step planned with ``plan`` updates the verdict from its own table.

:class:`TableHint` keeps the other input of planning without a wait: a host copy of the block
table from an earlier step (copied asynchronously, read once it has landed), the ``hint`` of
:meth:`PrefixAttention.plan_hinted`. An old hint also only costs speed: the plan checks it on
the device and falls back to per-request work items where it is wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def shares_pages(first_pages: np.ndarray) -> bool:
    """Do two requests start on the same page (so share at least their first page)?"""
    return bool(np.unique(first_pages).shape[0] < first_pages.shape[0])


class SharingProbe:
    """The sharing verdict of the latest batch whose first page ids were looked at."""

    def __init__(self) -> None:
        self.sharing: bool | None = None
        """True / False for the latest batch seen; None before any."""
        self._pinned: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._pending = False

    def expects_sharing(self) -> bool:
        """True unless the latest batch seen had no sharing (also True before any)."""
        self._poll()
        return self.sharing is not False

    def observe(self, first_pages: np.ndarray) -> None:
        """Record the verdict of a batch whose first page ids are on the host."""
        self.sharing = shares_pages(np.asarray(first_pages))

    def start(self, first_pages: torch.Tensor, real: torch.Tensor | None = None) -> bool:
        """Look at a batch's first page ids (1-D integer tensor) without waiting: on the
        device, whether two of them are equal, copied to the host asynchronously; the verdict
        changes once the copy has landed. ``real`` (bool, same length) leaves padding rows
        out. Does nothing while a copy is in flight, and then returns False (the batch was
        not looked at); else True."""
        if not first_pages.is_cuda:
            pages = first_pages if real is None else first_pages[real]
            self.observe(pages.numpy())
            return True
        if self.in_flight():
            return False
        if first_pages.shape[0] < 2:
            return True
        ids = first_pages.to(torch.int64)
        if real is not None:
            # Padding rows get distinct negative ids: they never match anything.
            ids = torch.where(real, ids, -1 - torch.arange(ids.shape[0], device=ids.device))
        ids = ids.sort().values
        dup = (ids[1:] == ids[:-1]).any()
        if self._pinned is None:
            self._pinned = torch.empty(1, dtype=torch.bool, pin_memory=True)
            self._event = torch.cuda.Event()
        assert self._event is not None
        self._pinned.copy_(dup.view(1), non_blocking=True)
        self._event.record()
        self._pending = True
        return True

    def in_flight(self) -> bool:
        """Is a copy of an earlier look still on its way (so :meth:`start` would skip)?"""
        self._poll()
        return bool(self._pending)

    def _poll(self) -> None:
        if self._pending and self._event is not None and self._event.query():
            assert self._pinned is not None
            self.sharing = bool(self._pinned[0])
            self._pending = False


class TableHint:
    """The latest host copy of a block table that has landed, for
    :meth:`PrefixAttention.plan_hinted`.

    Each step, :meth:`start` copies the batch's rows of the device table to pinned host memory
    without waiting (unless the previous copy is still in flight), and :meth:`take` returns
    the newest copy that has landed, with every entry past its request's pages at that step
    set to -1 (unknown: such entries hold stale ids). :meth:`observe` records a table the
    engine already has on the host.
    """

    def __init__(self) -> None:
        self._hint: np.ndarray | None = None
        self._lens: np.ndarray | None = None  # the hint rows' lengths when copied
        self._ids: np.ndarray | None = None  # the hint rows' request ids, if the engine gave them
        self._pinned: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        # rows, cols, lens, page size, ids
        self._pending: tuple[int, int, np.ndarray, int, np.ndarray | None] | None = None
        self._superseded = False  # a newer table was observed while the copy was in flight

    def take(self) -> np.ndarray | None:
        """The newest landed copy (int32 [rows, cols], -1 where unknown), or None."""
        self._poll()
        return self._hint

    @property
    def lens(self) -> np.ndarray | None:
        """int64 [rows]: each row's request length when the hint :meth:`take` last returned
        was copied (0 for rows without one), or None."""
        return self._lens

    @property
    def ids(self) -> np.ndarray | None:
        """int64 [rows]: each row's request id (the engine's, stable while the request runs)
        when that hint was copied, or None where the engine gave none."""
        return self._ids

    def observe(
        self, table: np.ndarray, seq_lens: np.ndarray, page_size: int, ids: Any = None
    ) -> None:
        """Record a host table (rows = requests, the first ``ceil(len / page_size)`` entries
        of each are its pages; ``ids``: their request ids, optional). A copy still in flight
        is older: it is dropped once landed."""
        row_ids = _row_ids(ids, len(table))  # first: a bad length leaves the hint as it was
        lens = _row_lens(seq_lens, len(table))
        self._hint = _read_only(_mask_unused(np.array(table, dtype=np.int32), lens, page_size))
        self._lens = lens
        self._ids = row_ids
        self._superseded = self._pending is not None

    def start(
        self, table: torch.Tensor, seq_lens: np.ndarray, page_size: int, ids: Any = None
    ) -> bool:
        """Copy ``table`` (rows = requests, on any device; ``ids``: their request ids,
        optional) to the host without waiting; it becomes the hint once landed. Does nothing
        while an earlier copy is in flight, and then returns False (the rows were not copied);
        else True."""
        if not table.is_cuda:
            self.observe(table.cpu().numpy(), seq_lens, page_size, ids)
            return True
        if self.in_flight():
            return False
        rows, cols = table.shape
        row_ids = _row_ids(ids, rows)  # before the copy is queued
        if self._pinned is None or self._pinned.numel() < rows * cols:
            self._pinned = torch.empty(
                max(rows * cols, 2 * (0 if self._pinned is None else self._pinned.numel())),
                dtype=torch.int32,
                pin_memory=True,
            )
            self._event = torch.cuda.Event()
        assert self._event is not None
        self._pinned[: rows * cols].view(rows, cols).copy_(table, non_blocking=True)
        self._event.record()
        self._pending = (rows, cols, np.array(seq_lens, dtype=np.int64), page_size, row_ids)
        return True

    def in_flight(self) -> bool:
        """Is an earlier copy still on its way (so :meth:`start` would skip)?"""
        self._poll()
        return self._pending is not None

    def _poll(self) -> None:
        if self._pending is None or self._event is None or not self._event.query():
            return
        rows, cols, lens, page_size, ids = self._pending
        self._pending = None
        if self._superseded:
            self._superseded = False
            return
        assert self._pinned is not None
        table = self._pinned[: rows * cols].view(rows, cols).numpy().copy()
        self._lens = _row_lens(lens, rows)
        self._hint = _read_only(_mask_unused(table, self._lens, page_size))
        self._ids = ids


def _read_only(table: np.ndarray) -> np.ndarray:
    """``table``, marked read-only: a hint is never changed once made, so planners may keep
    what they derived from it."""
    table.flags.writeable = False
    return table


def _row_lens(seq_lens: np.ndarray, rows: int) -> np.ndarray:
    """int64 [rows]: ``seq_lens`` of the first rows, 0 past them."""
    out = np.zeros(rows, np.int64)
    n = min(rows, len(seq_lens))
    out[:n] = np.asarray(seq_lens, dtype=np.int64)[:n]
    out.flags.writeable = False
    return out


def _row_ids(ids: Any, rows: int) -> np.ndarray | None:
    """int64 [rows] copy of the first ``rows`` request ids (None: none given); a length that
    is not ``rows`` raises."""
    if ids is None:
        return None
    out = np.array(ids, dtype=np.int64).reshape(-1)
    if len(out) != rows:
        raise ValueError(f"prefixattn: {len(out)} request ids for {rows} table rows")
    out.flags.writeable = False
    return out


def _mask_unused(table: np.ndarray, row_lens: np.ndarray, page_size: int) -> np.ndarray:
    """-1 past each row's pages (``row_lens``: one length per row, :func:`_row_lens`; 0 for
    rows without a request: all of it)."""
    pages = (row_lens + page_size - 1) // page_size
    table[np.arange(table.shape[1])[None, :] >= pages[:, None]] = -1
    return table
