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
