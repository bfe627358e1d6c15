"""Per-architecture tile tables: which (m, n) forward kernels exist and how an item picks one.

``m`` is the query-tile height in rows (tokens x GQA group), ``n`` the KV tokens per tile.
The table is data. The sm90 entries are the PAT paper's feasible set for Hopper (powers of two
from 16, larger KV tiles for long items); they are to be re-derived from the CUDA kernels'
shared-memory, register and bytes-in-flight limits once those kernels exist.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import numpy.typing as npt

MAX_TILE_N = 65535
"""The largest KV tile (``n``): plans key tiles as ``m * 65536 + n``."""
_INT32_MAX = 2**31 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _check_heights(name: str, sizes: Any, allow_empty: bool) -> None:
    """``sizes``: a tuple of positive ascending int heights (the planners divide by them)."""
    if not isinstance(sizes, tuple):
        raise TypeError(f"TileTable.{name} must be a tuple of ints, got {sizes!r}")
    if not sizes and not allow_empty:
        raise ValueError(f"TileTable.{name} must hold at least one tile height, got ()")
    for i, m in enumerate(sizes):
        if not _is_int(m):
            raise TypeError(f"TileTable.{name}[{i}] must be an int, got {m!r}")
        if not 0 < m <= _INT32_MAX:
            raise ValueError(f"TileTable.{name}[{i}] = {m}: heights must be positive")
        if i and m <= sizes[i - 1]:
            raise ValueError(
                f"TileTable.{name} must be ascending, got {sizes} ({name}[{i}] = {m} after "
                f"{sizes[i - 1]})"
            )


@dataclasses.dataclass(frozen=True)
class TileTable:
    """Feasible tiles of one (architecture, head_dim).

    m_sizes: ascending query-tile heights; the largest bounds the rows of one work item.
    n_by_kv_len: ((max_kv_len, n), ...) ascending; an item of KV length L takes the n of the
        first entry with L <= max_kv_len (the last entry's bound is ignored).
    wide_rows, wide_kv_len: an item of more than ``wide_rows`` rows and at least
        ``wide_kv_len`` KV tokens takes the largest height instead of the smallest that fits
        (0: off). On sm90 the largest height is the warp-specialized ``wgmma`` tile, whose
        producer warpgroup keeps the copies going while the consumers compute; the 64-row
        ``mma.sync`` tile issues both from the same warps (docs/dev/log.md, v55).
    narrow_m_sizes, narrow_traffic: the planner also plans with these heights alone (at
        head_dim 128 on sm90: 16 and 64, no 128-row tile) and takes that plan where its KV
        and partial-row bytes are at most ``narrow_traffic`` times those of the plan with
        ``m_sizes`` (``()``: off). Twice the blocks of half the rows run beside the other
        launches' blocks (a 64-row ``wgmma`` block leaves room on its SM) but re-read the
        KV of items of more than 64 rows (docs/dev/log.md, v56).
    """

    m_sizes: tuple[int, ...]
    n_by_kv_len: tuple[tuple[int, int], ...]
    wide_rows: int = 0
    wide_kv_len: int = 0
    narrow_m_sizes: tuple[int, ...] = ()
    narrow_traffic: float = 0.0

    def __post_init__(self) -> None:
        # Checked here so that no planner sees a table it would divide by zero with or key
        # wrongly (every way to make or change a table goes through this).
        _check_heights("m_sizes", self.m_sizes, allow_empty=False)
        _check_heights("narrow_m_sizes", self.narrow_m_sizes, allow_empty=True)
        n_by = self.n_by_kv_len
        if not isinstance(n_by, tuple) or not n_by:
            raise ValueError(
                f"TileTable.n_by_kv_len must be a non-empty tuple of (max_kv_len, n) pairs, "
                f"got {n_by!r}"
            )
        for i, entry in enumerate(n_by):
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise TypeError(
                    f"TileTable.n_by_kv_len[{i}] must be a (max_kv_len, n) pair, got {entry!r}"
                )
            bound, n = entry
            if not _is_int(bound) or not _is_int(n):
                raise TypeError(f"TileTable.n_by_kv_len[{i}] must hold two ints, got {entry!r}")
            if not 0 <= bound < 2**63:
                raise ValueError(
                    f"TileTable.n_by_kv_len[{i}] has max_kv_len = {bound}, outside [0, 2**63)"
                )
            if not 1 <= n <= MAX_TILE_N:
                raise ValueError(
                    f"TileTable.n_by_kv_len[{i}] has KV tile size n = {n}, outside "
                    f"[1, {MAX_TILE_N}]"
                )
            if i and bound < n_by[i - 1][0]:
                raise ValueError(
                    f"TileTable.n_by_kv_len bounds must be ascending, got {bound} after "
                    f"{n_by[i - 1][0]} at entry {i}"
                )
        for name in ("wide_rows", "wide_kv_len"):
            value = getattr(self, name)
            if not _is_int(value):
                raise TypeError(f"TileTable.{name} must be an int, got {value!r}")
            if not 0 <= value <= _INT32_MAX:
                raise ValueError(f"TileTable.{name} must be in [0, {_INT32_MAX}], got {value}")
        traffic = self.narrow_traffic
        if isinstance(traffic, bool) or not isinstance(traffic, int | float):
            raise TypeError(f"TileTable.narrow_traffic must be a number, got {traffic!r}")
        if not (math.isfinite(traffic) and traffic >= 0):
            raise ValueError(f"TileTable.narrow_traffic must be finite and >= 0, got {traffic}")

    def narrow(self) -> TileTable | None:
        """The table of the narrow alternative plan (``narrow_m_sizes``, no wide rule), or
        None."""
        if not self.narrow_m_sizes:
            return None
        return _narrow_table(self.narrow_m_sizes, self.n_by_kv_len)

    @property
    def max_rows(self) -> int:
        return self.m_sizes[-1]

    def height_index(self, rows: npt.ArrayLike, kv_len: npt.ArrayLike) -> np.ndarray:
        """Index into ``m_sizes`` of the height of items of ``rows`` rows and ``kv_len`` KV
        tokens (ints or equal-shaped integer arrays)."""
        m = np.asarray(self.m_sizes)
        idx = np.minimum(np.searchsorted(m, rows), len(m) - 1)
        if self.wide_kv_len > 0:
            wide = (np.asarray(rows) > self.wide_rows) & (np.asarray(kv_len) >= self.wide_kv_len)
            idx = np.where(wide, len(m) - 1, idx)
        return idx

    def heights_up_to(self, rows: int) -> tuple[int, ...]:
        """The tile heights a plan of this table may give work items of at most ``rows``
        query rows (the narrow alternative's included), ascending: every height up to the
        tallest such an item may take. A plan of ``T`` tokens at GQA group ``g`` uses no other
        heights than ``heights_up_to(T * g)``, so a launch with a fixed grid (a CUDA graph
        captured at ``T`` tokens) needs only their kernel variants. Remembered per table and
        row count (every plan checks its heights against them).

        Worked example (sm90, head_dim 128: heights 16, 32, 64, 128, wide above 32 rows;
        narrow 16, 64): 4 rows -> (16,); 32 rows -> (16, 32, 64) (the narrow plan's 64);
        33 rows -> all four.
        """
        return _heights_up_to(self, max(1, int(rows)))

    def _heights_up_to(self, rows: int) -> tuple[int, ...]:
        """:meth:`heights_up_to`, computed."""
        tallest = self.m_sizes[int(self.height_index(rows, max(self.wide_kv_len, 1)))]
        narrow = self.narrow()
        if narrow is not None:
            tallest = max(tallest, narrow.m_sizes[int(narrow.height_index(rows, 1))])
        return tuple(m for m in sorted({*self.m_sizes, *self.narrow_m_sizes}) if m <= tallest)

    def select(self, rows: int, kv_len: int) -> tuple[int, int]:
        """(m, n) for an item with ``rows`` query rows and ``kv_len`` KV tokens."""
        m = self.m_sizes[int(self.height_index(rows, kv_len))]
        n = self.n_by_kv_len[-1][1]
        for bound, size in self.n_by_kv_len:
            if kv_len <= bound:
                n = size
                break
        return m, n


@functools.lru_cache(maxsize=16)
def _narrow_table(m_sizes: tuple[int, ...], n_by_kv_len: tuple[tuple[int, int], ...]) -> TileTable:
    """The narrow alternative's table, one object per (heights, KV tile sizes): planning asks
    for it at every call."""
    return TileTable(m_sizes=m_sizes, n_by_kv_len=n_by_kv_len)


@functools.lru_cache(maxsize=1024)
def _heights_up_to(table: TileTable, rows: int) -> tuple[int, ...]:
    return table._heights_up_to(rows)


_SM90 = {
    64: TileTable(m_sizes=(16, 32, 64, 128), n_by_kv_len=((128, 64), (1 << 30, 128))),
    # Items of 33-64 rows and at least 256 KV tokens run on the 128-row tile (v55); plans of
    # 16- and 64-row tiles alone where they move at most 1.25 times the bytes (v56). Both
    # measured at head_dim 128 only.
    128: TileTable(
        m_sizes=(16, 32, 64, 128),
        n_by_kv_len=((128, 64), (1 << 30, 128)),
        wide_rows=32,
        wide_kv_len=256,
        narrow_m_sizes=(16, 64),
        narrow_traffic=1.25,
    ),
    256: TileTable(m_sizes=(16, 32, 64), n_by_kv_len=((1 << 30, 64),)),
}

SUPPORTED_HEAD_DIMS = tuple(sorted(_SM90))


def tile_table(head_dim: int, arch: str = "sm90") -> TileTable:
    """The tile table for ``head_dim`` on ``arch`` (only "sm90" is tabulated)."""
    if arch != "sm90":
        raise ValueError(f"no tile table for architecture {arch!r}; known: 'sm90'")
    if head_dim not in _SM90:
        raise ValueError(
            f"unsupported head_dim {head_dim}; supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )
    return _SM90[head_dim]
