"""SharingProbe on device tensors: the verdict arrives through an asynchronous copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixattn import SharingProbe

pytestmark = pytest.mark.gpu


def test_verdict_after_the_copy_lands():
    probe = SharingProbe()
    pages = torch.tensor([[7, 1], [3, 2], [7, 5]], dtype=torch.int32, device="cuda")
    probe.start(pages[:, 0])
    torch.cuda.synchronize()
    assert probe.expects_sharing() and probe.sharing is True
    real = torch.tensor([True, True, False], device="cuda")
    probe.start(pages[:, 0], real)  # the third row is padding
    torch.cuda.synchronize()
    assert not probe.expects_sharing() and probe.sharing is False
    # While a copy is in flight a second start is ignored, not queued over it.
    probe._pending = True
    probe.start(pages[:, 0])
    probe._pending = False
    assert probe.sharing is False


def test_table_hint_lands_asynchronously():
    from prefixattn import TableHint

    hint = TableHint()
    big = torch.tensor([[3, 4, 9, 8], [5, 6, 7, 1]], dtype=torch.int32, device="cuda")
    hint.start(big[:, :3], np.array([5, 3]), 2)  # a strided slice of a larger table
    torch.cuda.synchronize()
    taken = hint.take()
    assert taken is not None
    assert taken.tolist() == [[3, 4, 9], [5, 6, -1]]
    # A larger table regrows the pinned buffer; the newest landed copy wins.
    larger = torch.arange(12, dtype=torch.int32, device="cuda").view(3, 4)
    hint.start(larger, np.array([8, 1, 0]), 2)
    torch.cuda.synchronize()
    taken = hint.take()
    assert taken is not None
    assert taken.tolist() == [[0, 1, 2, 3], [4, -1, -1, -1], [-1, -1, -1, -1]]


def test_looks_skip_while_the_stream_is_busy():
    """With the stream held (a long sleep kernel queued first), a look's copy is in flight:
    ``in_flight`` says so, a second ``start`` returns False and queues nothing; once the
    stream has drained both land and the next look is taken."""
    from prefixattn import TableHint

    probe, hint = SharingProbe(), TableHint()
    pages = torch.tensor([[7, 1], [3, 2], [7, 5]], dtype=torch.int32, device="cuda")
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU cycles before the copies
    assert probe.start(pages[:, 0]) is True
    assert hint.start(pages, np.array([4, 4, 4]), 2) is True
    assert probe.in_flight() and hint.in_flight()
    assert probe.start(pages[1:, 0]) is False
    assert hint.start(pages[1:], np.array([4, 4]), 2) is False
    torch.cuda.synchronize()
    assert not probe.in_flight() and not hint.in_flight()
    assert probe.sharing is True  # the first look's verdict, not the skipped one's
    taken = hint.take()
    assert taken is not None and taken.shape[0] == 3
    assert probe.start(pages[1:, 0]) is True
