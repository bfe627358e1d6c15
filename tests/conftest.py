"""Shared batch generators and plan checks for the CPU tests, and the test markers.

Markers:

- ``gpu``: needs a CUDA GPU; skipped without one.
- ``native``: needs the compiled planner (``prefixattn::build_plan``); skipped without it,
  unless ``PREFIXATTN_REQUIRE_NATIVE=1`` (CI) makes its absence a failure.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

NATIVE_OR_PYTHON = [
    pytest.param(True, id="native", marks=pytest.mark.native),
    pytest.param(False, id="python"),
]
"""``native`` planner switch for parametrized tests; the native case needs the library."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "native: needs the compiled planner (PREFIXATTN_REQUIRE_NATIVE=1: required)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("native") is not None:
        from prefixattn.runtime.library import native_plan_available

        if not native_plan_available():
            reason = (
                "the compiled planner (prefixattn::build_plan) is not available: build the "
                "library or point PREFIXATTN_LIBRARY at it"
            )
            if os.environ.get("PREFIXATTN_REQUIRE_NATIVE") == "1":
                pytest.fail(reason + " (PREFIXATTN_REQUIRE_NATIVE=1)", pytrace=False)
            pytest.skip(reason)


@dataclasses.dataclass
class Batch:
    """A paged batch: block table with junk past each row's pages, lengths, query layout."""

    block_table: np.ndarray  # int32 [B, max_pages]
    seq_lens: np.ndarray  # int32 [B]
    qo_indptr: np.ndarray  # int32 [B+1]
    page_size: int
    num_pages: int  # pages in the cache (all ids < num_pages)

    @property
    def qo_lens(self) -> np.ndarray:
        return np.diff(self.qo_indptr)


@st.composite
def batches(
    draw: st.DrawFn,
    max_requests: int = 10,
    max_pages: int = 10,
    page_sizes: tuple[int, ...] = (1, 2, 3, 7, 16),
    max_new_tokens: int = 4,
    decode_only: bool = False,
) -> Batch:
    """Random prefix forests: each request copies a prefix of an earlier row (or none)."""
    ps = draw(st.sampled_from(page_sizes))
    b = draw(st.integers(1, max_requests))
    rows: list[list[int]] = []
    lens: list[int] = []
    next_id = 0
    for i in range(b):
        parent = draw(st.integers(-1, i - 1))
        row: list[int] = []
        if parent >= 0:
            share = draw(st.integers(0, len(rows[parent])))
            row = list(rows[parent][:share])
        extra = draw(st.integers(0 if row else 1, max(max_pages - len(row), 0 if row else 1)))
        row += list(range(next_id, next_id + extra))
        next_id += extra
        rows.append(row)
        lens.append(draw(st.integers((len(row) - 1) * ps + 1, len(row) * ps)))
    qo = [1] * b if decode_only else [draw(st.integers(0, min(max_new_tokens, n))) for n in lens]
    width = max(len(r) for r in rows) + draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    num_pages = next_id + int(rng.integers(0, 4))
    relabel = rng.permutation(num_pages)
    table = rng.integers(-1, num_pages, size=(b, width))  # junk past each row's pages
    for i, r in enumerate(rows):
        table[i, : len(r)] = relabel[r]
    return Batch(
        block_table=table.astype(np.int32),
        seq_lens=np.asarray(lens, dtype=np.int32),
        qo_indptr=np.concatenate(([0], np.cumsum(qo))).astype(np.int32),
        page_size=ps,
        num_pages=num_pages,
    )


def embed_rows(
    batch: Batch, extra_rows: int, extra_cols: int, gen: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The batch's block-table rows at shuffled places of a larger table of junk page ids
    (``extra_rows`` more rows, ``extra_cols`` more columns): (table, row of each request)."""
    b, w = batch.block_table.shape
    big = gen.integers(0, batch.num_pages, (b + extra_rows, w + extra_cols)).astype(np.int32)
    rows = gen.permutation(b + extra_rows)[:b]
    big[rows, :w] = batch.block_table
    return big, rows


def random_cache(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    layout: str = "NHD",
    interleaved: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches; ``interleaved`` keeps K|V in one tensor's last dim (vLLM 0.26)."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "NHD":
        shape = (num_pages, page_size, num_kv_heads, head_dim)
    else:
        shape = (num_pages, num_kv_heads, page_size, head_dim)
    if interleaved:
        both = torch.randn(*shape[:-1], 2 * head_dim, generator=gen).to(dtype)
        return both[..., :head_dim], both[..., head_dim:]
    return (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
    )


def check_coverage(plan, batch: Batch) -> None:
    """Every (token, KV position) pair the token may see is covered exactly once, by pages
    that are the token's own request's pages, and nothing else is covered."""
    h = plan.host
    ps = batch.page_size
    qo_lens = batch.qo_lens
    req_of = np.repeat(np.arange(len(qo_lens)), qo_lens)
    num_tokens = int(batch.qo_indptr[-1])
    assert plan.num_tokens == num_tokens
    width = int(batch.seq_lens.max(initial=0)) + 1
    count = np.zeros((num_tokens, width), dtype=np.int64)
    expected_limit = np.zeros(num_tokens, dtype=np.int64)
    for t in range(num_tokens):
        b = req_of[t]
        i = t - int(batch.qo_indptr[b])
        expected_limit[t] = int(batch.seq_lens[b]) - int(qo_lens[b]) + i + 1
    for w in range(plan.num_work_items):
        start, n = int(h.kv_start[w]), int(h.kv_len[w])
        p0 = int(h.kv_page_offset[w])
        pages = h.kv_pages[p0 : p0 + -(-n // ps)]
        assert start % ps == 0 and n > 0
        assert len(pages) == -(-n // ps)
        assert h.q_indptr[w + 1] > h.q_indptr[w], "empty work item"
        for s in range(h.q_indptr[w], h.q_indptr[w + 1]):
            t = int(h.q_tokens[s])
            lim = int(h.q_limit[s])
            assert lim == expected_limit[t]
            hi = min(lim, start + n)
            assert hi > start, "slot sees nothing of its item"
            cols = np.arange(start // ps, -(-hi // ps))
            np.testing.assert_array_equal(batch.block_table[req_of[t], cols], pages[: len(cols)])
            count[t, start:hi] += 1
    for t in range(num_tokens):
        lim = expected_limit[t]
        assert (count[t, :lim] == 1).all(), f"token {t}: positions covered {count[t, :lim]}"
        assert (count[t, lim:] == 0).all()


def check_merge_layout(plan) -> None:
    """Tokens with one slot are written directly; others own distinct partial rows. Slots that
    finish a merged token in the leaf launch (q_out = -2 - (16 * j + n)) are leaf items' only
    slots of their tokens, their tokens come last in merge_tokens, and their own rows last in
    the tokens' partial lists (at j, after the n others)."""
    h = plan.host
    cover = np.bincount(h.q_tokens, minlength=plan.num_tokens)
    q_out = h.q_out.astype(np.int64)
    fin = q_out <= -2
    m_count = len(h.merge_tokens)
    assert int(fin.sum()) == plan.num_finished
    dec = q_out.copy()
    if fin.any():
        code = -2 - q_out[fin]
        pos, n = code >> 4, code & 15
        idx = np.searchsorted(h.merge_indptr, pos, side="right") - 1
        np.testing.assert_array_equal(h.merge_indptr[idx + 1] - 1, pos)  # own row last
        np.testing.assert_array_equal(h.merge_indptr[idx + 1] - h.merge_indptr[idx] - 1, n)
        np.testing.assert_array_equal(h.merge_tokens[idx], h.q_tokens[fin])
        assert (idx >= m_count - plan.num_finished).all() and (n >= 1).all()
        dec[fin] = h.merge_partials[pos]
        item = np.repeat(np.arange(plan.num_work_items), np.diff(h.q_indptr))
        height = np.repeat([m for m, _ in plan.tiles], np.diff(plan.tile_indptr))[item]
        assert (height[fin] == 16).all()
        # No other slot of a finished token is in a 16-row item.
        others = ~fin & np.isin(h.q_tokens, h.q_tokens[fin])
        assert (height[others] != 16).all()
    direct = dec < 0
    np.testing.assert_array_equal(direct, cover[h.q_tokens] == 1)
    rows = np.sort(dec[~direct])
    np.testing.assert_array_equal(rows, np.arange(plan.num_partials))
    np.testing.assert_array_equal(np.sort(h.merge_tokens), np.flatnonzero(cover > 1))
    owners = np.flatnonzero(~direct)
    for i, t in enumerate(h.merge_tokens):
        parts = h.merge_partials[h.merge_indptr[i] : h.merge_indptr[i + 1]]
        mine = owners[h.q_tokens[owners] == t]
        np.testing.assert_array_equal(np.sort(parts), np.sort(dec[mine]))


def read_entries(host, page_size: int) -> np.ndarray:
    """Indices of the ``kv_pages`` entries some work item reads (a device-table plan keeps
    room after its runs for later decode steps, whose entries no item reads)."""
    npages = -(-host.kv_len.astype(np.int64) // page_size)
    starts = np.repeat(host.kv_page_offset.astype(np.int64), npages)
    within = np.arange(int(npages.sum())) - np.repeat(np.cumsum(npages) - npages, npages)
    return np.unique(starts + within)


def read_pages(plan) -> list[int]:
    """The page ids at :func:`read_entries` of a ``LaunchPlan``, in entry order."""
    return plan.kv_pages.cpu()[read_entries(plan.host, plan.page_size)].tolist()


@pytest.fixture
def advances(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the planner's ``advance()`` calls: {"advanced": n, "refused": m}."""
    import prefixattn.attention as attention_module

    counts = {"advanced": 0, "refused": 0}
    real = attention_module.advance

    def counted(*args, **kwargs):
        hp = real(*args, **kwargs)
        counts["advanced" if hp is not None else "refused"] += 1
        return hp

    monkeypatch.setattr(attention_module, "advance", counted)
    return counts


def engine_run(
    page_size: int, seed: int, device: torch.device, dtype: torch.dtype, tol: float
) -> dict[str, int]:
    """40 steps as an engine makes them, planned by a ``StepPlanner``: decode runs, requests
    that finish and join (with a prefill chunk, under one of three shared prefixes), rows
    that move, requests whose pages were all replaced (preempted, their prefix evicted from
    the cache, and resumed: the same lengths on other pages, sharing nothing, which only
    the device check catches). Each step's attention must equal plain attention over the table within
    ``tol`` (relative to its largest value). Returns how many steps took each plan kind
    (``"hinted-fallback"``: the device check failed)."""
    from prefixattn import PrefixAttention, attention_reference
    from prefixattn.engine.step import StepPlanner

    rng = np.random.default_rng(seed)
    hq, hkv, d, width = 4, 2, 64, 64
    planner = StepPlanner(
        lambda: PrefixAttention(hq, hkv, d, page_size, device=device, dtype=dtype), page_size
    )
    prefixes = [list(range(p * 100, p * 100 + int(rng.integers(2, 9)))) for p in range(3)]
    next_page = 1000

    def new_request() -> tuple[list[int], int]:
        nonlocal next_page
        pages = list(prefixes[int(rng.integers(0, 3))])
        own = int(rng.integers(1, 4))
        shared = len(pages)
        pages += list(range(next_page, next_page + own + 8))  # room to grow
        next_page += own + 8
        return pages, (shared + own) * page_size - int(rng.integers(0, page_size))

    requests = [new_request() for _ in range(6)]
    kinds: dict[str, int] = {}
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(next_page + 2000, page_size, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(next_page + 2000, page_size, hkv, d, generator=gen).to(device, dtype)
    for _ in range(40):
        event = rng.random()
        if event < 0.15 and len(requests) > 2:  # a request finishes
            requests.pop(int(rng.integers(0, len(requests))))
        elif event < 0.35 and event >= 0.3:  # rows move
            requests = [requests[i] for i in rng.permutation(len(requests))]
        elif event < 0.45 and event >= 0.35:  # a request resumes on new pages
            i = int(rng.integers(0, len(requests)))
            pages, length = requests[i]
            requests[i] = (list(range(next_page, next_page + len(pages))), length)
            next_page += len(pages)
        new_tokens = [1] * len(requests)
        if 0.15 <= event < 0.3:  # a request joins with a prefill chunk
            pages, length = new_request()
            requests.append((pages, length))
            new_tokens.append(min(int(rng.integers(2, 9)), length))
        lens = np.array([n for _, n in requests], dtype=np.int64)
        lens += np.array(new_tokens) == 1  # decode: one more token
        requests = [(p, int(n)) for (p, _), n in zip(requests, lens, strict=True)]
        table = np.zeros((len(requests), width), np.int32)
        for i, (pages, _) in enumerate(requests):
            table[i, : len(pages)] = pages
        indptr = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int64)
        choice = planner.choose(len(requests), decode=max(new_tokens) == 1)
        attention = planner.attention_for(graph=False)
        if choice.device_table:
            dev_table = torch.from_numpy(table).to(device)
            plan = planner.plan_device(
                attention, choice, dev_table, lens, indptr, num_real=len(requests)
            )
        else:
            plan = planner.plan_host(attention, table, lens, indptr, num_real=len(requests))
        kind: str = choice.kind
        if plan.fallback_taken is not None and bool(plan.fallback_taken):
            kind += "-fallback"
        kinds[kind] = kinds.get(kind, 0) + 1
        q = torch.randn(int(indptr[-1]), hq, d, generator=gen).to(device, dtype)
        out = attention.run(q, k, v, plan=plan)
        ref = attention_reference(
            q.double(), k.double(), v.double(), torch.from_numpy(table).to(device),
            torch.from_numpy(lens).to(device), torch.from_numpy(indptr).to(device),
        )  # fmt: skip
        err = (out.double() - ref).abs().max().item()
        assert err <= tol * max(ref.abs().max().item(), 1.0), (kind, err)
    return kinds


def sglang_plugin_registers(env: dict[str, str], folder, name: str, extra: str = "") -> str:
    """What a process spawned as SGLang spawns its scheduler sees after ``load_plugins()``
    under ``env``: ``"registered (in the registry, in the choices[, extra])"``, where
    ``extra`` is a Python expression evaluated there after ``from tools.sglang import
    noattn``. Fails the test if the child fails."""
    import subprocess
    import sys

    tail = f", {extra}" if extra else ""
    code = (
        "import multiprocessing as mp\n"
        "def child(q):\n"
        "    from sglang.srt.plugins import load_plugins\n"
        "    load_plugins()\n"
        "    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS\n"
        "    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES\n"
        "    from tools.sglang import noattn\n"
        f"    q.put(({name!r} in ATTENTION_BACKENDS, {name!r} in ATTENTION_BACKEND_CHOICES{tail}))\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn'); q = ctx.Queue()\n"
        "    p = ctx.Process(target=child, args=(q,)); p.start()\n"
        "    print('registered', q.get(timeout=300)); p.join()\n"
    )
    script = folder / "check.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()
