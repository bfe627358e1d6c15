"""Steps planned from the device table never wait for the GPU: the plan, its device check
and the launches of decode runs, of steps whose batch changed and of steps with prefill
chunks run under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any operation
that synchronizes with the device (a device-to-host copy into pageable memory, ``.item()``,
a data-dependent output size)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixattn import PrefixAttention
from prefixattn.engine.step import StepPlanner

from . import KERNEL_MARKS

pytestmark = KERNEL_MARKS

DEV = torch.device("cuda")


class _Steps:
    """Requests under one shared prefix, as an engine's rows: decode steps, a request that
    leaves (the rows after it move up, ids kept), one that joins with a prefill chunk."""

    def __init__(self, page_size: int, requests: int = 24) -> None:
        self.ps = page_size
        self.prefix = list(range(1, 1 + 512 // page_size))
        self.next = 10_000
        self.rows: list[list[int]] = []
        self.lens: list[int] = []
        self.ids: list[int] = []
        for i in range(requests):
            self._add(i, 512 + 40 + 7 * i)

    def _add(self, rid: int, length: int) -> None:
        own = -(-(length + 64) // self.ps) - len(self.prefix)
        self.rows.append(self.prefix + list(range(self.next, self.next + own)))
        self.next += own
        self.lens.append(length)
        self.ids.append(rid)

    def step(self, event: str) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
        new = [1] * len(self.rows)
        if event == "leave":
            gone = len(self.rows) // 3
            for seq in (self.rows, self.lens, self.ids):
                del seq[gone]
            new.pop()
        self.lens = [n + 1 for n in self.lens]
        if event == "join":
            self._add(1000 + len(self.ids), 512 + 30)  # its prompt: 30 tokens past the prefix
            new.append(30)
        width = max(len(r) for r in self.rows) + 1
        table = np.zeros((len(self.rows), width), np.int32)
        for i, r in enumerate(self.rows):
            table[i, : len(r)] = r
        indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
        return (
            torch.from_numpy(table).to(DEV),
            np.asarray(self.lens, np.int64),
            indptr,
            np.asarray(self.ids),
        )


@pytest.mark.parametrize("page_size", [1, 16])
def test_planned_steps_do_not_synchronize(page_size: int) -> None:
    hq, hkv, d = 32, 8, 128
    planner = StepPlanner(
        lambda: PrefixAttention(hq, hkv, d, page_size, device=DEV, dtype=torch.bfloat16),
        page_size,
    )
    steps = _Steps(page_size)
    events = ["decode"] * 4 + ["leave"] + ["decode"] * 3 + ["join"] + ["decode"] * 3
    events += ["leave", "decode"]
    # Every step's inputs first: uploading a table is the engine's work, not the planner's.
    inputs = [steps.step(e) for e in ["decode", "decode", *events]]
    pages = steps.next + 16
    gen = torch.Generator(device=DEV).manual_seed(0)
    k = torch.randn(pages, page_size, hkv, d, device=DEV, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(pages, page_size, hkv, d, device=DEV, generator=gen, dtype=torch.bfloat16)
    qs = [
        torch.randn(int(indptr[-1]), hq, d, device=DEV, generator=gen, dtype=torch.bfloat16)
        for _, _, indptr, _ in inputs
    ]
    kinds: list[str] = []
    plans = []

    def one(i: int) -> None:
        table, lens, indptr, ids = inputs[i]
        decode = bool((np.diff(indptr) == 1).all())
        choice = planner.choose(len(lens), decode=decode)
        attention = planner.attention_for(graph=False)
        if choice.device_table:
            plan = planner.plan_device(
                attention, choice, table, lens, indptr, num_real=len(lens), ids=ids
            )
        else:
            plan = planner.plan_host(
                attention, table.cpu().numpy(), lens, indptr, num_real=len(lens), ids=ids
            )
        attention.run(qs[i], k, v, plan=plan)
        kinds.append(choice.kind)
        plans.append(plan)

    one(0)  # the first step copies the table (a host plan)
    one(1)
    torch.cuda.synchronize()  # the hint and the probe's verdict have landed
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(2, len(inputs)):
            one(i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert kinds[0] == "copy" and set(kinds[2:]) == {"hinted"}, kinds
    # Requests known by id: every hint matched, no step fell back.
    assert not any(bool(p.fallback_taken) for p in plans[2:])
