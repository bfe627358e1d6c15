"""Reference dump of plan arrays over a random-forest suite (behaviour check for the planner).

Builds ~200 random batches (prefix forests in the style of tests/conftest.py ``batches``, plus
the PAT trees of ``prefixattn.workloads``), plans each with ``PrefixAttention`` on a CPU device
with the native and the Python planner, several packings and options, through ``plan``,
``plan_unshared`` and ``plan_hinted``, and writes every LaunchPlan host array, device array and
scalar field to an .npz. Two runs of different code must give byte-identical files.

    PYTHONPATH=<tree>/python python -m tools.plan_arrays OUT.npz     # run on each tree, then
    cmp A.npz B.npz                                                  # byte-identical
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import numpy as np
import torch

import prefixattn
from prefixattn import PrefixAttention
from prefixattn.workloads import PAT_TREES, tree_batch

HOST_FIELDS = (
    "kv_page_offset", "kv_pages", "kv_start", "kv_len", "q_indptr", "q_tokens", "q_limit",
    "q_out", "tile_id", "tile_indptr", "merge_tokens", "merge_indptr", "merge_partials",
)  # fmt: skip
DEVICE_FIELDS = (
    "kv_page_offset", "kv_pages", "kv_start", "kv_len", "q_indptr", "q_tokens", "q_limit",
    "q_out", "tile_id", "merge_tokens", "merge_indptr", "merge_partials", "counts",
)  # fmt: skip
SCALARS = (
    "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "packing", "split_kv",
    "batch_size", "num_tokens", "num_work_items", "num_partials", "num_merge_tokens",
    "max_page_id", "tiles", "tile_indptr", "num_ctas", "kv_bytes", "partial_bytes",
    "distinct_kv_bytes", "query_centric_kv_bytes", "qo_bytes", "num_finished",
    "leaf_max_rows", "leaf_tiles", "narrow",
)  # fmt: skip
FOREST_FIELDS = ("parent", "page_begin", "page_end", "req_begin", "req_end", "order", "token_end")


def random_batch(rng: np.random.Generator, decode_only: bool) -> tuple[Any, ...]:
    """A random prefix forest: each request copies a prefix of an earlier row (or none)."""
    ps = int(rng.choice([1, 2, 3, 7, 16, 32]))
    b = int(rng.integers(1, 40))
    max_pages = int(rng.choice([4, 12, 40, 200]))
    rows: list[list[int]] = []
    lens: list[int] = []
    next_id = 0
    for i in range(b):
        parent = int(rng.integers(-1, i)) if i else -1
        row: list[int] = []
        if parent >= 0:
            share = int(rng.integers(0, len(rows[parent]) + 1))
            row = list(rows[parent][:share])
        lo = 0 if row else 1
        extra = int(rng.integers(lo, max(max_pages - len(row), lo) + 1))
        row += list(range(next_id, next_id + extra))
        next_id += extra
        rows.append(row)
        lens.append(int(rng.integers((len(row) - 1) * ps + 1, len(row) * ps + 1)))
    qo = [1] * b if decode_only else [int(rng.integers(0, min(4, n) + 1)) for n in lens]
    width = max(len(r) for r in rows) + int(rng.integers(0, 3))
    num_pages = next_id + int(rng.integers(0, 4))
    relabel = rng.permutation(num_pages)
    table = rng.integers(-1, num_pages, size=(b, width))
    for i, r in enumerate(rows):
        table[i, : len(r)] = relabel[r]
    return (
        table.astype(np.int32),
        np.asarray(lens, dtype=np.int32),
        np.concatenate(([0], np.cumsum(qo))).astype(np.int32),
        np.int64(ps),
    )


def pat_batches() -> list[tuple[Any, ...]]:
    out = []
    for spec in PAT_TREES[:12]:
        for ps in (1, 16):
            table, lens = tree_batch(spec, ps)
            b = table.shape[0]
            out.append((table, lens, np.arange(b + 1, dtype=np.int32), np.int64(ps)))
    return out


def dump(out: dict[str, Any], key: str, plan: Any) -> None:
    for f in HOST_FIELDS:
        out[f"{key}/host/{f}"] = np.asarray(getattr(plan.host, f))
    for f in DEVICE_FIELDS:
        out[f"{key}/dev/{f}"] = getattr(plan, f).cpu().numpy()
    out[f"{key}/scalars"] = np.frombuffer(
        repr(tuple(getattr(plan, f) for f in SCALARS)).encode(), dtype=np.uint8
    )
    for f in FOREST_FIELDS:
        out[f"{key}/forest/{f}"] = np.asarray(getattr(plan.forest, f))
    out[f"{key}/forest/children"] = np.frombuffer(
        repr([list(c) for c in plan.forest.children]).encode(), dtype=np.uint8
    )
    if plan.fallback is not None:
        dump(out, key + "/fallback", plan.fallback)
        out[f"{key}/taken"] = np.asarray(bool(plan.fallback_taken))


HEADS = ((32, 8), (32, 32), (8, 1), (64, 8), (28, 4))
# (packing, split_kv, option overrides) per plan() call
VARIANTS: tuple[tuple[str, bool, dict[str, Any]], ...] = (
    ("memory", True, {}),
    ("memory", False, {}),
    ("naive", True, {}),
    ("per_query", True, {}),
    ("memory", True, {"finish_in_leaf": False, "pack_heads": False}),
    ("memory", True, {"one_launch_in_one_wave": False, "split_target": 0}),
    ("memory", True, {"split_target": 16}),
)


def main(path: str) -> None:
    rng = np.random.default_rng(20260101)
    suite = [random_batch(rng, decode_only=i % 3 == 0) for i in range(176)] + pat_batches()
    out: dict[str, Any] = {}
    for i, (table, lens, indptr, ps) in enumerate(suite):
        hq, hkv = HEADS[i % len(HEADS)]
        d = (64, 128, 256)[i % 3]
        for native in (True, False):
            for v, (packing, split, opts) in enumerate(VARIANTS):
                att = PrefixAttention(hq, hkv, d, int(ps), device="cpu", dtype=torch.bfloat16)
                att.native_plan = native
                for name, value in opts.items():
                    setattr(att, name, value)
                key = f"{i}/{int(native)}/{v}"
                dump(out, key, att.plan(table, lens, indptr, packing=packing, split_kv=split))
            att = PrefixAttention(hq, hkv, d, int(ps), device="cpu", dtype=torch.bfloat16)
            att.native_plan = native
            bt = torch.from_numpy(table.copy())
            # plan_unshared with the table's own rows and padding junk (ids may be -1: the
            # page ids are read on the device and not checked)
            dump(out, f"{i}/{int(native)}/unshared", att.plan_unshared(bt, lens, indptr))
            if (np.diff(indptr) <= 1).all():
                hint = table.copy()
                dump(out, f"{i}/{int(native)}/hinted", att.plan_hinted(bt, hint, lens, indptr))
                stale = table.copy()
                stale[:, 0] = stale[::-1, 0]
                dump(out, f"{i}/{int(native)}/stale", att.plan_hinted(bt, stale, lens, indptr))
    np.savez(path, **out)
    h = hashlib.sha256()
    for k in sorted(out):
        h.update(k.encode())
        h.update(out[k].dtype.str.encode())
        h.update(out[k].tobytes())
    print(f"{prefixattn.__file__}: {len(suite)} batches, {len(out)} arrays, sha256 {h.hexdigest()}")


if __name__ == "__main__":
    main(sys.argv[1])
