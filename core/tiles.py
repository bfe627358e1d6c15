"""Per-architecture tile tables: which (m, n) forward kernels exist and how an item picks one.

``m`` is the query-tile height in rows (tokens x GQA group), ``n`` the KV tokens per tile.
The table is data. The sm90 entries are the PAT paper's feasible set for Hopper (powers of two
from 16, larger KV tiles for long items); they are to be re-derived from the CUDA kernels'
shared-memory, register and bytes-in-flight limits once those kernels exist.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TileTable:
    """Feasible tiles of one (architecture, head_dim).

    m_sizes: ascending query-tile heights; the largest bounds the rows of one work item.
    n_by_kv_len: ((max_kv_len, n), ...) ascending; an item of KV length L takes the n of the
        first entry with L <= max_kv_len (the last entry's bound is ignored).
    """

    m_sizes: tuple[int, ...]
    n_by_kv_len: tuple[tuple[int, int], ...]

    @property
    def max_rows(self) -> int:
        return self.m_sizes[-1]

    def select(self, rows: int, kv_len: int) -> tuple[int, int]:
        """(m, n) for an item with ``rows`` query rows and ``kv_len`` KV tokens."""
        m = next((m for m in self.m_sizes if m >= rows), self.m_sizes[-1])
        n = self.n_by_kv_len[-1][1]
        for bound, size in self.n_by_kv_len:
            if kv_len <= bound:
                n = size
                break
        return m, n


_SM90 = {
    64: TileTable(m_sizes=(16, 32, 64, 128), n_by_kv_len=((128, 64), (1 << 30, 128))),
    128: TileTable(m_sizes=(16, 32, 64, 128), n_by_kv_len=((128, 64), (1 << 30, 128))),
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
