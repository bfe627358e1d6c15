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
"""

from __future__ import annotations

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

    def start(self, first_pages: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """Look at a batch's first page ids (1-D integer tensor) without waiting: on the
        device, whether two of them are equal, copied to the host asynchronously; the verdict
        changes once the copy has landed. ``real`` (bool, same length) leaves padding rows
        out. Does nothing while a copy is in flight."""
        if not first_pages.is_cuda:
            pages = first_pages if real is None else first_pages[real]
            self.observe(pages.numpy())
            return
        self._poll()
        if self._pending or first_pages.shape[0] < 2:
            return
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

    def _poll(self) -> None:
        if self._pending and self._event is not None and self._event.query():
            assert self._pinned is not None
            self.sharing = bool(self._pinned[0])
            self._pending = False
