"""The kernels' division by a launch-fixed divisor (`FastDiv` in decode_kernels.cuh).

The kernels divide row indices by the GQA group size and positions by the page size with
q = (umulhi(n, m) + n) >> s, where s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1,
computed by `FastDiv::init` on the host. This checks that identity in exact integer
arithmetic, with the same 32-bit wrap-arounds as the CUDA code, for divisors 1-256 (group
and page sizes) and larger ones up to 2^31 - 1, over the dividends
where an error would show first (multiples of d and their neighbours, powers of two, the
largest int32), plus random ones. The GPU tests run the kernels with group sizes 1, 3, 4, 7,
16 and page sizes 1, 3, 16, 24, 32, 64.
"""

from __future__ import annotations

import numpy as np
import pytest

M32 = (1 << 32) - 1
INT32_MAX = (1 << 31) - 1


def fast_div_init(d: int) -> tuple[int, int]:
    s = 0
    while (1 << s) < d:
        s += 1
    m = ((((1 << s) - d) << 32) // d + 1) & M32  # computed in uint64, stored in uint32
    return m, s


def fast_div(n: int, m: int, s: int) -> int:
    hi = (n * m) >> 32  # __umulhi(n, m)
    return ((hi + n) & M32) >> s  # uint32 add, then shift


def _dividends(d: int, rng: np.random.Generator) -> list[int]:
    ns = {0, 1, 2, d - 1, d, d + 1, INT32_MAX, INT32_MAX - 1}
    top = INT32_MAX // d
    for q in (1, 2, 3, 1000, top - 1, top):
        for e in (-1, 0, 1):
            ns.add(q * d + e)
    ns.update(1 << k for k in range(31))
    ns.update((1 << k) - 1 for k in range(1, 32))
    ns.update(int(x) for x in rng.integers(0, INT32_MAX, size=200, endpoint=True))
    return [n for n in ns if 0 <= n <= INT32_MAX]


@pytest.mark.parametrize(
    "divisors",
    [
        list(range(1, 257)),  # group sizes, page sizes, small item counts
        [511, 512, 513, 1000, 4095, 4096, 65535, 65536, 65537, 1 << 20, (1 << 20) + 7],
        [(1 << 30) - 1, 1 << 30, (1 << 30) + 1, INT32_MAX - 1, INT32_MAX],
    ],
)
def test_fast_div_matches_integer_division(divisors: list[int]) -> None:
    rng = np.random.default_rng(0)
    for d in divisors:
        m, s = fast_div_init(d)
        assert 0 <= m <= M32
        for n in _dividends(d, rng):
            q = fast_div(n, m, s)
            assert q == n // d, (d, n, q)
            assert n - q * d == n % d


def test_fast_div_header_uses_the_checked_formula() -> None:
    """The header's init and div are the formula checked above (guards against drift)."""
    from pathlib import Path

    include = Path(__file__).resolve().parents[2] / "cpp/include/prefixattn"
    src = next(
        text
        for text in (p.read_text() for p in sorted(include.glob("*.cuh")))
        if "struct FastDiv" in text
    )
    assert "while ((1u << s) < d) ++s;" in src
    assert "((1ull << s) - d) << 32) / d + 1" in src
    assert "(__umulhi(static_cast<uint32_t>(n), m) + static_cast<uint32_t>(n)) >> s" in src
