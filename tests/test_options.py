"""PlanOptions / LaunchOptions: defaults, checks when set, and PrefixAttention's attributes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prefixattn import LaunchOptions, PlanOptions, PrefixAttention
from prefixattn.options import LAUNCH_OPTIONS, PLAN_OPTIONS

DEFAULTS = {
    "native_plan": True,
    "split_target": None,
    "pack_heads": True,
    "finish_in_leaf": True,
    "one_launch_in_one_wave": True,
    "split_waves": True,
    "min_split_tokens": 256,
    "leaf_split_tokens": 64,
    "max_plan_bytes": 8 * 2**30,
    "use_kernels": True,
    "prefetch_tiles": 0,
    "fixed_grid": False,
    "concurrent_groups": False,
    "chain_launches": True,
}


def test_defaults() -> None:
    assert set(PLAN_OPTIONS) | set(LAUNCH_OPTIONS) == set(DEFAULTS)
    pa = PrefixAttention(8, 2, 64, 4)
    for name, value in DEFAULTS.items():
        assert getattr(pa, name) == value, name
    assert dataclasses.asdict(PlanOptions()) == {n: DEFAULTS[n] for n in PLAN_OPTIONS}
    assert dataclasses.asdict(LaunchOptions()) == {n: DEFAULTS[n] for n in LAUNCH_OPTIONS}


def test_finish_in_leaf_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXATTN_FINISH_IN_LEAF", "0")
    assert PrefixAttention(8, 2, 64, 4).finish_in_leaf is True


def test_attributes_read_and_write_the_options() -> None:
    plan_options = PlanOptions(split_target=7)
    launch_options = LaunchOptions(prefetch_tiles=2)
    pa = PrefixAttention(8, 2, 64, 4, plan_options=plan_options, launch_options=launch_options)
    assert pa.plan_options is plan_options and pa.split_target == 7 and pa.prefetch_tiles == 2
    pa.chain_launches = False
    pa.pack_heads = False
    assert launch_options.chain_launches is False and plan_options.pack_heads is False
    plan_options.one_launch_in_one_wave = False
    assert pa.one_launch_in_one_wave is False


def test_split_target_resolves_at_the_first_plan() -> None:
    pa = PrefixAttention(8, 2, 64, 4)
    pa.plan(np.array([[0, 1]], np.int32), np.array([5], np.int32))
    assert pa.split_target == 132 == pa.plan_options.split_target


@pytest.mark.parametrize("name", [n for n, v in DEFAULTS.items() if isinstance(v, bool)])
@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_switches_take_bools_only(name: str, value: object) -> None:
    pa = PrefixAttention(8, 2, 64, 4)
    with pytest.raises(TypeError, match=rf"Options\.{name} must be a bool"):
        setattr(pa, name, value)
    assert getattr(pa, name) == DEFAULTS[name]


@pytest.mark.parametrize(
    ("options", "field", "value", "error"),
    [
        (LaunchOptions, "prefetch_tiles", -1, ValueError),
        (LaunchOptions, "prefetch_tiles", 2**31, ValueError),
        (LaunchOptions, "prefetch_tiles", 1.0, TypeError),
        (LaunchOptions, "prefetch_tiles", True, TypeError),
        (PlanOptions, "split_target", -5, ValueError),
        (PlanOptions, "split_target", "0", TypeError),
        (PlanOptions, "min_split_tokens", 0, ValueError),
        (PlanOptions, "min_split_tokens", 2**31, ValueError),
        (PlanOptions, "min_split_tokens", 64.0, TypeError),
        (PlanOptions, "leaf_split_tokens", 0, ValueError),
        (PlanOptions, "leaf_split_tokens", None, TypeError),
    ],
)
def test_counts_are_checked(options: type, field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=rf"{options.__name__}\.{field} must"):
        options(**{field: value})
    opts = options()
    with pytest.raises(error, match=rf"{options.__name__}\.{field} must"):
        setattr(opts, field, value)


def test_unknown_option_and_wrong_options_type() -> None:
    with pytest.raises(AttributeError, match="no option 'chained'"):
        LaunchOptions().chained = True
    with pytest.raises(TypeError, match="plan_options must be a PlanOptions"):
        PrefixAttention(8, 2, 64, 4, plan_options=LaunchOptions())  # type: ignore[arg-type]
