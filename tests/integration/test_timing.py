"""tools/timing.py: the decode step from paired timings."""

from __future__ import annotations

import pytest

import tools.timing


@pytest.fixture(scope="module")
def timing():
    return tools.timing


def test_paired_median_and_spread(timing) -> None:
    s = timing.paired_step_ms([1.0, 1.2], [2.0, 2.1], 8, 40)
    assert s == {"median": 29.688, "min": 28.125, "max": 31.25}
    # One disturbed pair moves the median less than it moves a difference of minimums.
    t1, t2 = [1.0, 1.0, 1.0, 1.6], [2.0, 2.0, 2.0, 2.6]
    assert timing.paired_step_ms(t1, t2, 8, 40)["median"] == 31.25


@pytest.mark.parametrize(
    ("t1", "t2", "n1", "n2"), [([1.0], [], 8, 40), ([], [], 8, 40), ([1.0], [2.0], 8, 8)]
)
def test_bad_input(timing, t1, t2, n1, n2) -> None:
    with pytest.raises(ValueError):
        timing.paired_step_ms(t1, t2, n1, n2)


def test_inter_token_from_engine_timestamps(timing) -> None:
    from types import SimpleNamespace as NS

    def out(first: float, last: float, n: int) -> NS:
        return NS(metrics=NS(first_token_ts=first, last_token_ts=last, num_generation_tokens=n))

    assert timing.inter_token_ms([out(10.0, 10.4, 5), out(10.0, 10.3, 3)]) == 125.0
    # One token, no timestamps (stats off) or no metrics: nothing to time.
    assert timing.inter_token_ms([out(10.0, 10.0, 1), NS(metrics=None), NS()]) is None
    assert timing.inter_token_ms([out(0.0, 0.0, 9), out(2.0, 2.8, 9)]) == 100.0
