"""StepPlanner on CPU: the plan method chosen for sequences of batches, padding rows, the
graph/eager pair, options and the capability probes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import engine_run

from prefixattn import LaunchPlan, PrefixAttention
from prefixattn.engine import step
from prefixattn.engine.step import StepOptions, StepPlanner
from prefixattn.runtime import library

PAGE = 4


def _attention() -> PrefixAttention:
    return PrefixAttention(4, 2, 64, PAGE, kv_layout="NHD", device="cpu", dtype=torch.float32)


def _planner(**options: object) -> StepPlanner:
    return StepPlanner(_attention, PAGE, options=StepOptions(**options), remedy="Do X.")  # type: ignore[arg-type]


class Batch:
    """Rows of a block table (page ids), decode lengths, and ``pad`` padding rows of the
    engine's own after them (one token each on page 0, as SGLang pads graph batches)."""

    def __init__(self, rows: list[list[int]], pad: int = 0, new_tokens: int = 1) -> None:
        self.num_real = len(rows)
        width = max(len(r) for r in rows) + 1
        table = np.zeros((len(rows) + pad, width), np.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
        self.table = table
        lens = [len(r) * PAGE - 1 for r in rows] + [1] * pad
        self.seq_lens = np.asarray(lens, np.int32)
        q = [new_tokens] * len(rows) + [1] * pad
        self.qo_indptr = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        self.decode = new_tokens == 1


SHARED = Batch([[1, 2, 10], [1, 2, 11], [1, 3, 12], [4, 13]])
PRIVATE = Batch([[20, 21], [22, 23], [24, 25], [26, 27]])


def kind(plan: LaunchPlan) -> str:
    if plan.fallback is None:
        return "copy" if plan.max_page_id >= 0 else "unshared"
    return "hinted-fallback" if bool(plan.fallback_taken) else "hinted"


def run_step(
    planner: StepPlanner,
    batch: Batch,
    *,
    capture: bool = False,
    graph: bool = False,
    device_table: bool = True,
) -> LaunchPlan:
    """What an adapter does for one step."""
    choice = planner.choose(
        batch.num_real,
        decode=batch.decode,
        capture=capture,
        device_table=device_table,
        graph=graph,
    )
    attention = planner.attention_for(graph=graph)
    if choice.device_table:
        plan = planner.plan_device(
            attention,
            choice,
            torch.from_numpy(batch.table),
            batch.seq_lens,
            batch.qo_indptr,
            num_real=batch.num_real,
        )
    else:
        plan = planner.plan_host(
            attention,
            batch.table,
            batch.seq_lens,
            batch.qo_indptr,
            num_real=batch.num_real,
            capture=capture,
        )
    if graph and not capture:
        planner.check()
    return plan


def test_plan_methods_follow_the_batches_seen() -> None:
    """1: nothing seen yet (copy); 2: hint from 1; 3: the shared table's hint for a private
    batch (caught on the device); 4: no sharing seen: unshared; 5: unshared, shows sharing;
    6: hint from 5's table; 7: hint caught."""
    planner = _planner()
    seq = [SHARED, SHARED, PRIVATE, PRIVATE, SHARED, SHARED, PRIVATE]
    kinds = [kind(run_step(planner, b)) for b in seq]
    assert kinds == [
        "copy", "hinted", "hinted-fallback", "unshared", "unshared", "hinted", "hinted-fallback"
    ]  # fmt: skip
    assert planner.plan_kinds == {"copy": 1, "unshared": 2, "hinted": 4, "delegated": 0}


def delegate_or_plan(planner: StepPlanner, batch: Batch, *, graph: bool = False) -> str:
    """An adapter with the engine's own kernel for delegated steps: the step's kind."""
    choice = planner.choose(batch.num_real, decode=batch.decode, graph=graph, delegate=True)
    if choice.kind == "delegated":
        planner.delegated(torch.from_numpy(batch.table), batch.seq_lens, num_real=batch.num_real)
        return "delegated"
    attention = planner.attention_for(graph=graph)
    if choice.device_table:
        plan = planner.plan_device(
            attention, choice, torch.from_numpy(batch.table), batch.seq_lens, batch.qo_indptr,
            num_real=batch.num_real,
        )  # fmt: skip
    else:
        plan = planner.plan_host(
            attention, batch.table, batch.seq_lens, batch.qo_indptr, num_real=batch.num_real
        )
    return kind(plan)


def test_unshared_steps_are_delegated_and_still_teach() -> None:
    """With the engine's kernel at hand, the steps planned unshared above go to it instead;
    their rows still teach: sharing that appears in a delegated step (5) has the next step
    planned from its rows (6). Nothing is delegated before the probe has seen a batch (1)."""
    planner = _planner(delegate_unshared=True)
    seq = [SHARED, SHARED, PRIVATE, PRIVATE, SHARED, SHARED, PRIVATE]
    kinds = [delegate_or_plan(planner, b) for b in seq]
    assert kinds == [
        "copy", "hinted", "hinted-fallback", "delegated", "delegated", "hinted", "hinted-fallback"
    ]  # fmt: skip
    assert planner.plan_kinds == {"copy": 1, "unshared": 0, "hinted": 4, "delegated": 2}
    assert planner.counts()["host_ms_per_plan"]["delegated"] > 0


def test_graph_steps_and_the_option_off_are_never_delegated() -> None:
    """Steps that may be replayed from a captured graph run prefixattn's plan (the graph holds
    its launches), and ``delegate_unshared=False`` (the default) plans unshared steps as
    before."""
    planner = _planner(delegate_unshared=True)
    planner.reserve_graphs(8, 8, 64)
    kinds = [delegate_or_plan(planner, b, graph=True) for b in (PRIVATE, PRIVATE, PRIVATE)]
    assert kinds == ["copy", "unshared", "unshared"]
    off = _planner()
    assert off.options.delegate_unshared is False
    assert [delegate_or_plan(off, b) for b in (PRIVATE, PRIVATE)] == ["copy", "unshared"]
    with pytest.raises(TypeError, match="delegate_unshared must be a bool"):
        StepOptions(delegate_unshared=1)  # type: ignore[arg-type]


def test_prefill_batches_alone_do_not_teach_decode_steps() -> None:
    """SGLang's extend batches hold new requests alone (here two private prompts, prefilled):
    after a decode batch with sharing, the next decode step keeps that batch's verdict and
    hint (hinted, every row kept) instead of the extend batch's (no sharing: unshared). A
    batch of prefills still teaches before any batch of running requests has (an engine's
    first steps)."""
    planner = _planner()
    extend = Batch([[30, 31, 32], [40, 41, 42]], new_tokens=3)

    def prefill(batch: Batch) -> LaunchPlan:
        choice = planner.choose(batch.num_real, decode=False)
        attention = planner.attention_for(graph=False)
        if choice.device_table:
            return planner.plan_device(
                attention, choice, torch.from_numpy(batch.table), batch.seq_lens,
                batch.qo_indptr, num_real=batch.num_real, prefill_only=True,
            )  # fmt: skip
        return planner.plan_host(
            attention, batch.table, batch.seq_lens, batch.qo_indptr, num_real=batch.num_real,
            prefill_only=True,
        )  # fmt: skip

    assert kind(prefill(extend)) == "copy"
    assert planner.probe.sharing is False  # the first batch teaches
    assert kind(run_step(planner, SHARED)) == "unshared"  # the verdict is a step old
    assert planner.probe.sharing is True
    # New requests, which no hint row describes; rows of near lengths may be taken for
    # theirs (then the device check falls back): either way a hinted plan.
    assert kind(prefill(extend)).startswith("hinted")
    assert planner.probe.sharing is True  # not taught by the extend batch
    kept = planner.hint_rows["kept"]
    plan = run_step(planner, SHARED)
    assert kind(plan) == "hinted"
    assert plan.distinct_kv_bytes < plan.query_centric_kv_bytes
    assert planner.hint_rows["kept"] - kept == 4  # the decode batch's own rows


def test_batches_of_new_prefills_go_to_the_engines_kernel() -> None:
    """With the engine's kernel at hand, a batch of new requests' prefills alone (SGLang's
    extend batch) that would be hinted (no row knows its requests: all private) is
    delegated; it does not teach; the decode step after it is hinted from the running
    batch's rows. Before any hint exists it is copied (the copy finds its sharing)."""
    planner = _planner(delegate_prefills=True)
    extend = Batch([[30, 31, 32], [30, 31, 42]], new_tokens=3)

    def prefill() -> str:
        choice = planner.choose(extend.num_real, decode=False, delegate=True, prefill_only=True)
        if choice.kind == "delegated":
            planner.delegated(
                torch.from_numpy(extend.table), extend.seq_lens, num_real=extend.num_real,
                prefill_only=True,
            )  # fmt: skip
            return "delegated"
        assert choice.kind == "copy"
        attention = planner.attention_for(graph=False)
        return kind(planner.plan_host(
            attention, extend.table, extend.seq_lens, extend.qo_indptr,
            num_real=extend.num_real, prefill_only=True,
        ))  # fmt: skip

    assert prefill() == "copy"
    assert kind(run_step(planner, SHARED)) == "hinted"  # the extend batch's rows: caught
    assert prefill() == "delegated"
    assert planner.probe.sharing is True  # not taught by the extend batch
    assert kind(run_step(planner, SHARED)) == "hinted"
    assert planner.plan_kinds["delegated"] == 1
    # After a batch without sharing (an unshared plan would plan it the same way), too.
    run_step(planner, PRIVATE)
    assert planner.probe.sharing is False and planner.options.delegate_unshared is False
    assert prefill() == "delegated"


def test_steps_of_several_tokens_keep_teaching() -> None:
    """Speculative decoding: after a step of one token each, steps of several tokens per
    running request (not prefills of new requests) still set the verdict and the hint."""
    planner = _planner()
    run_step(planner, PRIVATE)
    assert planner.probe.sharing is False
    spec = Batch([[1, 2, 10], [1, 2, 11], [1, 3, 12], [4, 13]], new_tokens=3)
    assert kind(run_step(planner, spec)) == "unshared"
    assert planner.probe.sharing is True
    assert kind(run_step(planner, spec)) == "hinted"


def test_capture_batches_do_not_teach() -> None:
    """A CUDA-graph capture batch (made-up rows) sets neither the verdict nor the hint."""
    planner = _planner()
    planner.reserve_graphs(8, 8, 64)
    run_step(planner, SHARED, capture=True, graph=True, device_table=False)
    assert planner.probe.sharing is None and planner.table_hint.take() is None


def test_counts_of_fallbacks_and_hint_rows(monkeypatch, caplog) -> None:
    """With count_fallbacks the planner counts the hinted steps whose device check failed and
    logs its counts every COUNT_LOG_STEPS planned steps; without, it touches no device count."""
    monkeypatch.setattr(step, "COUNT_LOG_STEPS", 4)
    planner = _planner(count_fallbacks=True)
    seq = [SHARED, SHARED, PRIVATE, PRIVATE, SHARED, SHARED, PRIVATE]
    with caplog.at_level("WARNING", logger="prefixattn"):
        for b in seq:
            run_step(planner, b)
    counts = planner.counts()
    assert counts["plans"] == {"copy": 1, "unshared": 2, "hinted": 4, "delegated": 0}
    assert counts["fallbacks"] == 2  # steps 3 and 7 (kinds above)
    # Every request of a hinted step here keeps its row (same count, lengths that match).
    assert counts["hint_rows"] == {"kept": 16, "moved": 0, "unknown": 0}
    # The mean host time of a planning call of each kind that ran.
    host = counts["host_ms_per_plan"]
    # (only the kinds that ran)
    assert set(host) == {"copy", "unshared", "hinted"} and all(v > 0 for v in host.values())
    total = sum(host[k] * n for k, n in counts["plans"].items() if n)
    assert total == pytest.approx(1e3 * sum(planner.host_seconds.values()), abs=0.01)
    logged = [r.getMessage() for r in caplog.records if "planner counts" in r.getMessage()]
    assert len(logged) == 1 and "'fallbacks': 1" in logged[0]  # after step 4 (3 device plans)
    quiet = _planner()
    for b in seq:
        run_step(quiet, b)
    assert "fallbacks" not in quiet.counts()


def _rows(*heads: tuple[int, int]) -> list[list[int]]:
    """Block-table rows of 2 prefix pages (the given ids) and 18 private pages each."""
    return [[a, b, *range(100 * (i + 1), 100 * (i + 1) + 18)] for i, (a, b) in enumerate(heads)]


def _step(rows: list[list[int]], lens: list[int]) -> Batch:
    batch = Batch(rows)
    batch.seq_lens = np.asarray(lens, np.int32)
    return batch


@pytest.mark.parametrize("with_ids", [False, True])
def test_moved_rows_are_counted(with_ids: bool) -> None:
    """SGLang's order: the request of row 1 left, the others moved up one row, a new request
    came last. By lengths or by the engine's request ids, the step keeps its shared plan."""
    planner = _planner()
    r0, r1, r2, r3 = _rows((1, 2), (1, 2), (1, 3), (4, 5))
    ids = np.asarray([7, 8, 9, 10]) if with_ids else None
    first = _step([r0, r1, r2, r3], [9, 30, 50, 70])
    for _ in range(2):  # the first copies its table, the second's rows become the hint
        plan_with_ids(planner, first, ids)
    new = [4, 5, 6, *range(900, 917)]
    moved = _step([r0, r2, r3, new], [11, 52, 72, 5])
    new_ids = None if ids is None else np.asarray([7, 9, 10, 3])
    plan = plan_with_ids(planner, moved, new_ids)
    assert kind(plan) == "hinted"
    assert planner.hint_rows == {"kept": 4 + 1, "moved": 2, "unknown": 1}


def plan_with_ids(planner: StepPlanner, batch: Batch, ids: np.ndarray | None) -> LaunchPlan:
    """:func:`run_step` for an engine that gives request ids."""
    choice = planner.choose(batch.num_real, decode=True)
    attention = planner.attention_for(graph=False)
    if choice.device_table:
        return planner.plan_device(
            attention, choice, torch.from_numpy(batch.table), batch.seq_lens,
            num_real=batch.num_real, ids=ids,
        )  # fmt: skip
    return planner.plan_host(
        attention, batch.table, batch.seq_lens, num_real=batch.num_real, ids=ids
    )


def test_no_sharing_gives_unshared_plans() -> None:
    planner = _planner()
    assert kind(run_step(planner, PRIVATE)) == "copy"  # nothing seen yet
    assert planner.probe.sharing is False
    for _ in range(3):
        plan = run_step(planner, PRIVATE)
        assert kind(plan) == "unshared" and plan.packing == "per_query"


def test_sharing_gives_hinted_plans_except_for_multi_token_graph_steps() -> None:
    planner = _planner()
    run_step(planner, SHARED)
    assert planner.probe.sharing is True
    plan = run_step(planner, SHARED)
    assert kind(plan) == "hinted"
    assert plan.distinct_kv_bytes < plan.query_centric_kv_bytes  # the hint's sharing is used
    # A step with prefill chunks is hinted too: no wait for its table.
    extend = Batch([[1, 2, 10], [1, 2, 11]], new_tokens=2)
    plan = run_step(planner, extend)
    assert kind(plan) == "hinted" and plan.num_tokens == 4
    # A graph step's fallback launches are those of decode steps: with several new tokens
    # per request it copies its table.
    planner.reserve_graphs(8, 16, 64)
    assert kind(run_step(planner, extend, graph=True)) == "copy"


def test_stale_hint_falls_back() -> None:
    planner = _planner()
    run_step(planner, SHARED)
    # The same requests in another order: the hint's rows are wrong for this step.
    reordered = Batch([[4, 13], [1, 3, 12], [1, 2, 11], [1, 2, 10]])
    assert kind(run_step(planner, reordered)) == "hinted-fallback"
    # The step's own rows became the next step's hint.
    assert kind(run_step(planner, reordered)) == "hinted"


def test_padding_rows_are_left_out_of_the_probe_and_the_hint() -> None:
    """Padding rows (all on page 0) share a page with each other, but they are not requests:
    a batch of private requests plus padding still counts as unshared, and the hint holds
    the real rows only."""
    planner = _planner()
    padded = Batch([[20, 21], [22, 23], [24, 25]], pad=3)
    assert kind(run_step(planner, padded)) == "copy"
    assert planner.probe.sharing is False
    hint = planner.table_hint.take()
    assert hint is not None and hint.shape[0] == 3
    plan = run_step(planner, padded)
    assert kind(plan) == "unshared" and plan.num_tokens == 6
    assert planner.probe.sharing is False
    shared = Batch([[1, 2, 10], [1, 2, 11]], pad=2)
    assert kind(run_step(planner, shared)) == "unshared"  # the verdict is a step old
    assert planner.probe.sharing is True
    hint = planner.table_hint.take()
    assert hint is not None and hint.shape[0] == 2
    plan = run_step(planner, shared)
    assert kind(plan) == "hinted" and plan.num_tokens == 4


def test_capture_and_engines_without_a_device_table_copy() -> None:
    planner = _planner()
    run_step(planner, PRIVATE)
    assert kind(run_step(planner, PRIVATE, device_table=False)) == "copy"
    assert kind(run_step(planner, PRIVATE, capture=True)) == "copy"
    assert planner.plan_kinds == {
        "copy": 2,
        "unshared": 0,
        "hinted": 0,
        "delegated": 0,
    }  # capture not counted


@pytest.mark.parametrize("unshared", [False, True])
@pytest.mark.parametrize("hinted", [False, True])
def test_options_switch_the_fast_paths_off(unshared: bool, hinted: bool) -> None:
    planner = _planner(unshared_plans=unshared, hinted_plans=hinted)
    assert kind(run_step(planner, PRIVATE)) == "copy"
    # With unshared plans off, a hint serves any decode step.
    second = "unshared" if unshared else ("hinted" if hinted else "copy")
    assert kind(run_step(planner, PRIVATE)) == second
    run_step(planner, SHARED)
    run_step(planner, SHARED)
    assert kind(run_step(planner, SHARED)) == ("hinted" if hinted else "copy")
    if not hinted:
        assert planner.table_hint.take() is None  # nothing recorded


def test_graph_and_eager_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    planner = _planner()
    eager = planner.attention_for(graph=False)
    assert eager is planner.eager_attention and planner.graph_attention is None
    with pytest.raises(RuntimeError, match="reserve_graphs"):
        planner.attention_for(graph=True)
    calls: list[dict] = []
    monkeypatch.setattr(PrefixAttention, "reserve", lambda self, **kw: calls.append(kw))
    sizes = planner.reserve_graphs(8, 8, 1024)
    graph = planner.attention_for(graph=True)
    assert graph is planner.graph_attention and graph is not eager
    assert calls == [{**sizes, "hinted": True}]
    # Graph steps plan on the graph object, eager steps on the other.
    run_step(planner, SHARED, graph=True)
    assert graph.last_plan is not None and eager.last_plan is None
    run_step(planner, PRIVATE)
    assert eager.last_plan is not None


def test_graph_slots_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PrefixAttention, "reserve", lambda self, **kw: None)
    planner = _planner()
    default = planner.reserve_graphs(8, 8, 4096)
    # 4/2 heads (group 2), 132 SMs: leaf chunks of up to 8 tokens, 1056 parts beyond one each.
    assert planner.spare_slots() == 1056 * 8
    assert default["num_slots"] == 8 * step.decode_slots_per_token(4096, 8) + 1056 * 8
    small = _planner(graph_slots_per_token=3).reserve_graphs(8, 8, 4096)
    assert small["num_slots"] == 8 * 3 + 1056 * 8


def test_moved_graph_buffers_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    planner = _planner()
    planner.reserve_graphs(8, 8, 1024)
    generation = [0]
    monkeypatch.setattr(PrefixAttention, "buffers_generation", property(lambda s: generation[0]))
    generation[0] = 5
    run_step(planner, SHARED, graph=True)  # nothing captured yet: no check
    assert planner.captured.captured_generation is None
    planner.pin()
    run_step(planner, SHARED, graph=True)
    generation[0] = 6
    with pytest.raises(RuntimeError, match=r"outgrew the buffers reserved.*Do X"):
        run_step(planner, SHARED, graph=True)
    run_step(planner, SHARED)  # eager steps do not read those buffers


def test_options_are_checked_when_set() -> None:
    with pytest.raises(TypeError, match=r"StepOptions\.hinted_plans must be a bool"):
        StepOptions(hinted_plans=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="graph_slots_per_token must be in"):
        StepOptions(graph_slots_per_token=0)
    options = StepOptions()
    with pytest.raises(TypeError, match="unshared_plans"):
        options.unshared_plans = "no"  # type: ignore[assignment]
    with pytest.raises(AttributeError, match="no option 'hinted'"):
        options.hinted = False
    with pytest.raises(AttributeError, match="no option"):
        options.updated({"slots": 3})
    assert options.updated({"graph_slots_per_token": 7}).graph_slots_per_token == 7
    assert options == StepOptions()  # updated() copies


def test_core_options_reach_every_core() -> None:
    planner = _planner(core_options={"split_waves": False, "prefetch_tiles": 2})
    assert planner.eager_attention.split_waves is False
    assert planner.eager_attention.prefetch_tiles == 2
    planner.reserve_graphs(4, 4, 64)
    graph = planner.attention_for(graph=True)
    assert graph.split_waves is False and graph is not planner.eager_attention
    # The defaults where none are given; the cores' own option objects are not shared.
    plain = _planner()
    assert plain.eager_attention.split_waves is True
    assert plain.eager_attention.plan_options is not planner.eager_attention.plan_options


def test_graph_slots_follow_the_split_floor() -> None:
    # A lower split floor lets a token join more split parts: the graphs' reservation grows.
    default = _planner().slots_per_token(8192, 256)
    low = _planner(core_options={"min_split_tokens": 64}).slots_per_token(8192, 256)
    assert low - default == 8192 // 64 - 8192 // 256


@pytest.mark.parametrize(
    ("heads", "max_bs", "ctx", "waves"),
    [((8, 1), 1, 131072, True), ((8, 1), 4, 32768, False), ((8, 1), 2, 65536, False),
     ((16, 2), 1, 131072, False), ((32, 8), 1, 131072, True), ((32, 8), 4, 131072, False)],
)  # fmt: skip
def test_graph_reservation_covers_small_batches_at_the_leaf_floor(
    heads: tuple[int, int], max_bs: int, ctx: int, waves: bool
) -> None:
    """Decode batches of up to ``max_bs`` long private requests plan leaf chunks alone, cut at
    the leaf floor (64 tokens) into as many parts as the balance allows: up to 2112 at one
    KV head. The graphs' reservation (StepPlanner.reserve_graphs) must hold every such plan,
    or a graph step would raise."""
    hq, hkv = heads

    def attention() -> PrefixAttention:
        pa = PrefixAttention(hq, hkv, 128, 16, device="cpu", dtype=torch.bfloat16)
        pa.split_waves = waves
        return pa

    planner = StepPlanner(attention, 16)
    planner.graph_attention = attention()
    sizes = step.decode_reservation(
        max_bs, max_bs, ctx, 16, slots_per_token=planner.slots_per_token(ctx, max_bs),
        spare_slots=planner.spare_slots(),
    )  # fmt: skip
    for bs in range(1, max_bs + 1):
        pages = -(-ctx // 16)
        table = np.arange(bs * pages, dtype=np.int32).reshape(bs, pages)
        plan = planner.graph_attention.plan(table, np.full(bs, ctx, np.int32))
        assert plan.num_work_items <= sizes["num_work_items"], (bs, plan.num_work_items)
        assert len(plan.host.q_tokens) <= sizes["num_slots"]
        assert len(plan.host.kv_pages) <= sizes["num_pages"]


def test_core_options_are_checked_and_copied() -> None:
    with pytest.raises(AttributeError, match="'split' is no PlanOptions or LaunchOptions field"):
        StepOptions(core_options={"split": True})
    with pytest.raises(TypeError, match="split_waves"):
        StepOptions(core_options={"split_waves": 1})
    with pytest.raises(TypeError, match="must be a mapping"):
        StepOptions(core_options=["split_waves"])  # type: ignore[arg-type]
    given = {"chain_launches": False}
    options = StepOptions(core_options=given)
    given["chain_launches"] = True  # the options keep their own copy
    assert options.core_options == {"chain_launches": False}
    with pytest.raises(TypeError):
        options.core_options["chain_launches"] = True  # type: ignore[index]
    assert options.updated({"core_options": {}}).core_options == {}
    assert StepOptions() == StepOptions(core_options={})


def test_configure_sets_the_defaults_of_later_planners(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step, "_defaults", StepOptions())
    before = StepPlanner(_attention, PAGE)
    assert step.configure(unshared_plans=False) == StepOptions(unshared_plans=False)
    after = StepPlanner(_attention, PAGE)
    assert before.options.unshared_plans and not after.options.unshared_plans
    explicit = StepPlanner(_attention, PAGE, options=StepOptions())
    assert explicit.options.unshared_plans
    with pytest.raises(TypeError):
        step.configure(hinted_plans=None)
    assert step.default_options() == StepOptions(unshared_plans=False)


def test_kernels_unavailable_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert step.kernels_unavailable_reason("cpu") is None
    assert step.kernels_unavailable_reason(None) is None
    monkeypatch.setattr(library, "cuda_ops_available", lambda: True)
    assert step.kernels_unavailable_reason("cuda") is None
    monkeypatch.setattr(library, "cuda_ops_available", lambda: False)
    monkeypatch.setattr(library, "kernels_status", lambda: "not available: nvcc missing")
    reason = step.kernels_unavailable_reason(torch.device("cuda", 0))
    assert reason is not None and "are not available: nvcc missing." in reason


@pytest.mark.parametrize(
    ("graph_safe", "kernels", "expected"),
    [(False, True, False), (True, False, False), (True, True, True), (None, True, False)],
)
def test_cuda_graphs_available(
    monkeypatch: pytest.MonkeyPatch, graph_safe: bool | None, kernels: bool, expected: bool
) -> None:
    if graph_safe is None:
        monkeypatch.delattr(PrefixAttention, "cuda_graph_safe", raising=False)
    else:
        monkeypatch.setattr(PrefixAttention, "cuda_graph_safe", graph_safe, raising=False)
    monkeypatch.setattr(library, "cuda_ops_available", lambda: kernels)
    assert step.cuda_graphs_available() is expected


def test_a_decode_run_copies_its_rows_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hint of a decode run (the same requests, one token further each step) is copied
    at its start and again after HINT_REFRESH_STEPS steps or when the batch changes."""
    planner = _planner()
    run_step(planner, SHARED)  # copy: observes the rows, probe says shared
    copies: list[int] = []
    real_start = planner.table_hint.start

    def start(
        table: torch.Tensor, seq_lens: np.ndarray, page_size: int, ids: object = None
    ) -> bool:
        copies.append(len(seq_lens))
        return real_start(table, seq_lens, page_size, ids)

    monkeypatch.setattr(planner.table_hint, "start", start)
    tail = [40, 41, 42, 43, 44, 45]
    rows = [[1, 2, 10, *tail], [1, 2, 11, *tail], [1, 3, 12, *tail], [4, 13, *tail]]
    rows = [[p + 100 * i if p >= 40 else p for p in r] for i, r in enumerate(rows)]
    batch = Batch(rows)
    batch.seq_lens = np.full(4, 2 * PAGE + 1, np.int32)  # 3 pages; room for 20 more tokens
    for step_ in range(step.HINT_REFRESH_STEPS + 2):
        if step_:
            batch.seq_lens = batch.seq_lens + 1  # one more token each, same requests
        assert kind(run_step(planner, batch)) == "hinted"
    # Copied at the run's first step and once the refresh interval had passed.
    assert len(copies) == 2
    batch.seq_lens = batch.seq_lens + 2  # two tokens at once: not a plain decode run
    run_step(planner, batch)
    assert len(copies) == 3
    fewer = Batch(rows[:3])
    fewer.seq_lens = batch.seq_lens[:3] + 1
    assert kind(run_step(planner, fewer)) == "hinted"
    assert len(copies) == 4


def _decode_run_rows(tail_pages: int = 6) -> Batch:
    tail = list(range(40, 40 + tail_pages))
    rows = [[1, 2, 10, *tail], [1, 2, 11, *tail], [1, 3, 12, *tail], [4, 13, *tail]]
    rows = [[p + 100 * i if p >= 40 else p for p in r] for i, r in enumerate(rows)]
    batch = Batch(rows)
    batch.seq_lens = np.full(4, 2 * PAGE + 1, np.int32)  # 3 pages, then room in the tail
    return batch


class _SlowCopies:
    """The probe's and the hint's copies as on a GPU the host runs ahead of: each lands
    ``lag`` steps after it starts (``step`` is advanced by the test); counts the starts."""

    def __init__(self, planner: step.StepPlanner, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step = 0
        self.landing = {"probe": -1, "hint": -1}
        self.starts = {"probe": 0, "hint": 0}
        self.lag = {"probe": 2, "hint": 2}
        for name, obj in (("probe", planner.probe), ("hint", planner.table_hint)):
            monkeypatch.setattr(obj, "in_flight", lambda n=name: self.step < self.landing[n])
            monkeypatch.setattr(obj, "start", lambda *a, n=name, **k: self._start(n))

    def _start(self, name: str) -> bool:
        if self.step < self.landing[name]:
            return False
        self.starts[name] += 1
        self.landing[name] = self.step + self.lag[name]
        return True


def test_a_look_missed_while_a_copy_is_in_flight_is_taken_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step whose rows could not be copied (an earlier copy still in flight) is not taken
    as looked at: a later step of the same decode run copies them, so new requests are not
    planned private for the run's HINT_REFRESH_STEPS steps; once copied, the run keeps them."""
    planner = _planner()
    run_step(planner, SHARED)
    copies = _SlowCopies(planner, monkeypatch)
    copies.landing = {"probe": 1, "hint": 1}  # the looks of the step before are on their way
    batch = _decode_run_rows()
    for i in range(8):
        copies.step = i
        if i:
            batch.seq_lens = batch.seq_lens + 1  # a decode run of the same requests
        run_step(planner, batch)
    # Missed at the run's first step, taken at its second, then kept by the run.
    assert copies.starts == {"probe": 1, "hint": 1}


@pytest.mark.parametrize(
    ("lags", "in_flight"), [((2, 2), (0, 0)), ((2, 2), (0, 1)), ((1, 3), (1, 0)), ((3, 1), (0, 2))]
)
def test_copies_out_of_step_are_not_repeated_every_step(
    monkeypatch: pytest.MonkeyPatch, lags: tuple[int, int], in_flight: tuple[int, int]
) -> None:
    """However the probe's and the hint's copies land (together or apart, one of them still
    on its way when the run starts), a decode run of 40 steps copies the rows at its start
    and at each refresh, not every other step."""
    planner = _planner()
    run_step(planner, SHARED)
    copies = _SlowCopies(planner, monkeypatch)
    copies.lag = {"probe": lags[0], "hint": lags[1]}
    copies.landing = {"probe": in_flight[0], "hint": in_flight[1]}
    batch = _decode_run_rows(tail_pages=12)
    for i in range(40):
        copies.step = i
        if i:
            batch.seq_lens = batch.seq_lens + 1  # the rows stay; lengths grow within them
        run_step(planner, batch)
    # The run's first step and one look per HINT_REFRESH_STEPS steps (plus a retry or two
    # where a refresh found a copy still in flight).
    runs = -(-40 // step.HINT_REFRESH_STEPS)
    assert copies.starts["hint"] <= runs + 2 and copies.starts["probe"] <= runs + 2


def test_the_looks_say_whether_they_were_taken() -> None:
    """SharingProbe.start and TableHint.start: True where the batch was looked at (on the
    host at once), which the planner relies on to look again after a miss."""
    from prefixattn.engine.sharing import SharingProbe, TableHint

    assert SharingProbe().start(torch.tensor([4, 9, 4])) is True
    assert TableHint().start(torch.tensor([[1, 2], [1, 3]]), np.array([8, 8]), 4) is True


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_an_engine_run_equals_plain_attention(
    page_size: int, seed: int, advances: dict[str, int]
) -> None:
    """Many steps as an engine makes them: decode runs, requests that finish and join (with
    prefill chunks, sharing a few prefixes), rows that move; every step's attention is plain
    attention over the table, whatever the planner chose."""
    kinds = engine_run(page_size, seed, torch.device("cpu"), torch.float64, 1e-10)
    # Most steps planned from the hint, some of them advanced, some caught by the check.
    assert kinds.get("hinted", 0) > 10 and kinds.get("hinted-fallback", 0) > 0
    assert advances["advanced"] > 0


def test_continued_rows_follow_moved_requests() -> None:
    cr = step.continued_rows
    # SGLang (and vLLM's model runner) close the gap in order; a new request comes last.
    assert cr([100, 200, 300, 400], [100, 300, 400, 7], 16).tolist() == [0, 2, 3, -1]
    # vLLM moves its last row into the gap.
    assert cr([100, 200, 300, 400], [101, 401, 301], 16).tolist() == [0, 3, 2]
    # In a decode run (every request 3 tokens on) a new request never takes a left row,
    # however close its length.
    assert cr([100, 200, 300, 400], [103, 303, 403, 205], 16).tolist() == [0, 2, 3, -1]
    # A decode run some steps on, and rejected draft tokens (speculative decoding).
    assert cr([100, 200], [109, 197], 16).tolist() == [0, 1]
    # A new request in a left one's row; rows without a request (0) continue nothing.
    assert cr([100, 0, 300], [2000, 5, 300], 16).tolist() == [-1, -1, 2]
    assert cr([], [5, 6], 16).tolist() == [-1, -1]
    # By request ids: a reused id whose length fell is a new request.
    assert cr([100, 200, 300], [300, 101, 50], 16, [5, 6, 7], [7, 5, 6]).tolist() == [2, 0, -1]
    # Ids that repeat tell nothing: lengths decide.
    assert cr([100, 200], [201, 101], 16, [5, 6], [5, 5]).tolist() == [1, 0]
    with pytest.raises(ValueError, match="1 ids for 2 requests"):
        cr([100, 200], [101, 201], 16, [1, 2], [1])
    # More than half the batch new: the decode run's gain still keeps them off left rows.
    new = [7, 8, 9, 10, 11, 12]
    assert cr([100, 200, 300, 400], [103, 303, 403, 205, *new], 16).tolist() == [
        0, 2, 3, -1, -1, -1, -1, -1, -1, -1
    ]  # fmt: skip


def test_continued_rows_prefer_the_gap_closing_shift() -> None:
    """Requests with equal lengths do not hijack a row: after a gap every request continues
    the row after its own (the run of exact gains), even where its own row's length would
    match too."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(8, 257))
        then = rng.integers(2100, 2600, n)
        gone = rng.choice(n, int(rng.integers(1, 4)), replace=False)
        stay = np.setdiff1d(np.arange(n), gone)
        gain = int(rng.integers(0, 16))
        computed = np.concatenate([then[stay] + gain, [2048, 2048]])  # two new requests
        got = step.continued_rows(then, computed, 16)
        assert (got[len(stay) :] == -1).all()
        # Exact equal lengths next to a gap may still mislead one request (rare).
        assert np.count_nonzero(got[: len(stay)] != stay) <= 1
    # An equal length in a moved request's own row: the shift wins.
    then = np.asarray([100, 200, 300, 400, 500, 600])
    computed = np.asarray([100, 300, 400, 400, 600]) + 2  # row 1 left; row 3 equals row 4
    then[3] = 402 - 2
    then[4] = 402 - 2
    assert step.continued_rows(then, computed, 16).tolist() == [0, 2, 3, 4, 5]


def test_hinted_plans_follow_rows_that_moved() -> None:
    # Step 1 copies the table; at step 2 the request of row 1 has left and the engine moved
    # its last request into row 1 (one token on for every request). The hint's rows are
    # realigned by length, so the step keeps its shared plan instead of falling back.
    planner = _planner()

    def rows(*heads: tuple[int, int]) -> list[list[int]]:  # 2 prefix pages, 18 private
        return [[a, b, *range(100 * (i + 1), 100 * (i + 1) + 18)] for i, (a, b) in enumerate(heads)]

    r0, r1, r2, r3 = rows((1, 2), (1, 2), (1, 3), (4, 5))
    first = Batch([r0, r1, r2, r3])
    first.seq_lens = np.asarray([9, 30, 50, 70], np.int32)
    run_step(planner, first)
    run_step(planner, first)  # the hint of step 1 is taken from here on
    moved = Batch([r0, r3, r2])
    moved.seq_lens = np.asarray([10, 71, 51], np.int32)
    plan = run_step(planner, moved)
    assert kind(plan) == "hinted"
    assert plan.distinct_kv_bytes < plan.query_centric_kv_bytes
    # A new request in the row of one that left reads its pages privately: no fallback.
    new = Batch([r0, [20, 21, 22, *range(900, 917)], r2])
    new.seq_lens = np.asarray([11, 5, 52], np.int32)
    assert kind(run_step(planner, new)) == "hinted"


def test_hint_fallback_model() -> None:
    """benchmarks/hint_fallbacks.py (cited in docs/dev/log.md): on its model of the engines'
    rows, hints by request ids never fall back, and by lengths rarely (the row-for-row hint
    fell back on most steps of the same model)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "hint_fallbacks.py"
    spec = importlib.util.spec_from_file_location("hint_fallbacks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    by_ids = module.run("vllm", 40, 64, 16, 0)
    assert by_ids["kinds"].get("hinted-fallback", 0) == 0
    # --parts: each hinted step builds its prefix-aware plan and the per-request fallback;
    # the timing is taken off again afterwards.
    parts = module.run("vllm", 12, 32, 16, 0, mixed=True, parts=True)
    hinted = parts["kinds"]["hinted"]
    assert parts["plan_ms"]["memory"]["calls"] >= hinted
    assert parts["plan_ms"]["per_query"]["calls"] >= hinted
    assert all(v["mean_ms"] > 0 for v in parts["plan_ms"].values())
    assert module.PrefixAttention._plan_host.__name__ == "_plan_host"
    assert sum(by_ids["kinds"].values()) == 40 and by_ids["counts"]["hint_rows"]["moved"] > 0
    for order in ("sglang", "vllm-v1"):
        by_lens = module.run(order, 40, 64, 16, 0)
        assert by_lens["kinds"].get("hinted-fallback", 0) <= 2, by_lens
        assert by_lens["kinds"].get("hinted", 0) >= 37
    # SGLang's extend batches (new requests alone) between the decode steps teach nothing:
    # no decode step is planned unshared for them.
    extend = module.run("sglang", 40, 64, 16, 0, True)
    assert extend["extend_kinds"] and "unshared" not in extend["kinds"], extend
    assert extend["kinds"].get("hinted", 0) >= 37
    # vLLM's mixed steps (new requests prefilled beside the decodes) are hinted too.
    mixed = module.run("vllm", 40, 64, 16, 0, mixed=True)
    assert mixed["kinds"].get("hinted-fallback", 0) == 0 and mixed["kinds"]["hinted"] >= 37
    assert mixed["counts"]["hint_rows"]["unknown"] > 0  # the newcomers, planned private
    # Looks that land two steps late (the host ahead of the GPU): fewer looks, each skipped
    # one taken at a later step, and still no fallback by ids.
    late = module.run("vllm", 40, 64, 16, 0, mixed=True, lag=2)
    assert late["kinds"].get("hinted-fallback", 0) == 0
    assert 0 < late["looks_started"]["hint"] <= mixed["looks_started"]["hint"]
    assert late["looks_started"]["probe"] == late["looks_started"]["hint"]


def test_a_run_after_its_batch_changed_keeps_advancing(advances: dict[str, int]) -> None:
    """After a request leaves (rows closed up, requests known by id), the changed step is
    planned afresh and copies its rows; the steps after it keep that step's hint and advance
    its plan rather than building one from the newly landed copy. A step whose hint did not
    know a request (it joined) is no run's start: the next step takes the landed copy, which
    knows the newcomer's shared pages."""
    planner = _planner()

    def rows(*heads: tuple[int, int]) -> list[list[int]]:  # 2 prefix pages, 18 private
        return [[a, b, *range(100 * (i + 1), 100 * (i + 1) + 18)] for i, (a, b) in enumerate(heads)]

    r = rows((1, 2), (1, 2), (1, 2), (1, 2))

    def step_(batch: Batch, ids: list[int]) -> LaunchPlan:
        choice = planner.choose(batch.num_real, decode=True)
        attention = planner.attention_for(graph=False)
        assert choice.device_table
        return planner.plan_device(
            attention, choice, torch.from_numpy(batch.table), batch.seq_lens, batch.qo_indptr,
            num_real=batch.num_real, ids=np.asarray(ids),
        )  # fmt: skip

    full = Batch(r)
    full.seq_lens = np.asarray([20, 30, 40, 50], np.int32)
    run_step(planner, full)  # copy
    step_(full, [0, 1, 2, 3])
    # Request 1 leaves; request 3 moves into its row.
    left = Batch([r[0], r[3], r[2]])
    left.seq_lens = np.asarray([22, 52, 42], np.int32)
    before = advances["advanced"]
    assert kind(step_(left, [0, 3, 2])) == "hinted"
    assert advances["advanced"] == before  # a new batch: planned afresh
    for _ in range(3):
        left.seq_lens = left.seq_lens + 1
        plan = step_(left, [0, 3, 2])
        assert kind(plan) == "hinted" and plan.distinct_kv_bytes < plan.query_centric_kv_bytes
    # The hinted plan and its fallback, advanced at each of the three steps.
    assert advances["advanced"] == before + 6
    # A request joins under the same prefix: unknown to the hint, planned private once ...
    joined = Batch([r[0], r[3], r[2], r[1]])
    joined.seq_lens = np.asarray([*(left.seq_lens + 1), 9], np.int32)
    alone = step_(joined, [0, 3, 2, 4])
    # ... and with its shared pages from the next step on (the copy made at the join).
    joined.seq_lens = joined.seq_lens + 1
    shared = step_(joined, [0, 3, 2, 4])
    assert kind(shared) == "hinted"
    saved = shared.query_centric_kv_bytes - shared.distinct_kv_bytes
    assert saved > alone.query_centric_kv_bytes - alone.distinct_kv_bytes


def test_a_run_drops_a_hint_that_matched_the_wrong_rows() -> None:
    """Without ids, requests of equal lengths are matched to rows by lengths alone: after the
    request of row 1 leaves, the hint pairs request 1 with the row of the request that left,
    under another prefix, and the device check falls back. The run keeps that hint only until
    the copy of its own rows lands: the next step is hinted again."""
    planner = _planner()
    a = [[1, 2, *range(100 + 10 * i, 106 + 10 * i)] for i in range(2)]  # prefix [1, 2]
    b = [[5, 6, *range(300 + 10 * i, 306 + 10 * i)] for i in range(2)]  # prefix [5, 6]
    rows = a + b
    lens = np.full(4, 2 * PAGE + 8, np.int32)
    kinds = []
    for _ in range(4):
        kinds.append(kind(run_step(planner, _step(rows, list(lens)))))
        lens = lens + 1
    rows, lens = [rows[0], rows[2], rows[3]], np.delete(lens, 1)
    for _ in range(6):
        kinds.append(kind(run_step(planner, _step(rows, list(lens)))))
        lens = lens + 1
    assert kinds == ["copy", *["hinted"] * 3, "hinted-fallback", *["hinted"] * 5], kinds
