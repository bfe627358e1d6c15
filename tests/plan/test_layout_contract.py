"""The plan/kernel contract: prefixattn.plan.layout equals the C++ constants.

The C++ side defines the ``counts`` layout and the kernel variants' tile heights as
``constexpr`` values (``kCountItems``, ``kCountMergeTokens``, ``kVariantBase``,
``kNumVariants``, ``kCountPackedHeads``, ``kCountMergeOpen``, ``kCountsLen``,
``kVariantRows[]``), in cpp/include/prefixattn/plan_layout.h (or, in older trees,
decode_kernels.cuh). They are parsed here with a regex, their expressions evaluated over the
values defined before them, and compared with the Python values.
"""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path

import pytest

from prefixattn.plan import layout

CPP = Path(__file__).resolve().parents[2] / "cpp"
HEADERS = ("include/prefixattn/plan_layout.h", "include/prefixattn/decode_kernels.cuh")

_SCALAR = re.compile(r"constexpr\s+(?:int|int32_t|int64_t|size_t)\s+(k\w+)\s*=\s*([^;{]+);")
_ARRAY = re.compile(r"constexpr\s+(?:int|int32_t)\s+(k\w+)\s*\[[^\]]*\]\s*=\s*\{([^}]*)\}\s*;")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(expr: str, known: dict[str, int]) -> int:
    """An integer constant expression of literals, earlier constants, + - * and parentheses."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return known[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported constant expression {expr!r}")

    return ev(ast.parse(re.sub(r"\b(\d+)[uUlL]+\b", r"\1", expr.strip()), mode="eval").body)


def _header() -> Path:
    for rel in HEADERS:
        if (CPP / rel).exists():
            return CPP / rel
    pytest.fail(f"none of {', '.join(HEADERS)} under {CPP}")


def cpp_constants() -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """Scalars and arrays of the layout header; an array it lacks is looked for in the other
    C++ sources (older trees defined the variant rows beside the launcher)."""
    src = re.sub(r"//[^\n]*", "", _header().read_text())
    scalars: dict[str, int] = {}
    for name, expr in _SCALAR.findall(src):
        scalars[name] = _eval(expr, scalars)
    arrays = {
        name: tuple(_eval(x, scalars) for x in body.split(",") if x.strip())
        for name, body in _ARRAY.findall(src)
    }
    if "kVariantRows" not in arrays:
        for path in sorted(CPP.rglob("*.cu*")):
            found = _ARRAY.findall(re.sub(r"//[^\n]*", "", path.read_text()))
            for name, body in found:
                if name == "kVariantRows":
                    arrays[name] = tuple(_eval(x, scalars) for x in body.split(",") if x.strip())
    return scalars, arrays


def test_counts_layout_matches_cpp() -> None:
    scalars, _ = cpp_constants()
    expected = {
        "kCountItems": layout.COUNT_ITEMS,
        "kCountMergeTokens": layout.COUNT_MERGE_TOKENS,
        "kVariantBase": layout.VARIANT_BASE,
        "kNumVariants": layout.NUM_VARIANTS,
        "kCountPackedHeads": layout.PACKED_HEADS,
        "kCountMergeOpen": layout.MERGE_OPEN,
        "kCountsLen": layout.COUNTS_LEN,
    }
    assert {name: scalars.get(name) for name in expected} == expected


def test_q_out_encoding_matches_cpp() -> None:
    scalars, _ = cpp_constants()
    if "kQOutOutput" not in scalars:
        pytest.skip("this C++ tree does not name the q_out encoding")
    assert (
        scalars["kQOutOutput"],
        scalars["kQOutFinishBase"],
        scalars["kFinishRadix"],
        scalars["kFinishMaxPartials"],
    ) == (
        layout.Q_OUT_OUTPUT,
        layout.Q_OUT_FINISH_BASE,
        layout.FINISH_RADIX,
        layout.FINISH_MAX_PARTIALS,
    )


def test_variant_rows_match_cpp() -> None:
    _, arrays = cpp_constants()
    assert arrays.get("kVariantRows") == layout.VARIANT_ROWS


def test_layout_is_consistent() -> None:
    assert layout.COUNTS[layout.COUNT_ITEMS] == "num_work_items"
    assert layout.COUNTS[layout.COUNT_MERGE_TOKENS] == "num_merge_tokens"
    assert len(layout.COUNTS) == layout.VARIANT_BASE
    assert layout.PACKED_HEADS == layout.VARIANT_BASE + layout.NUM_VARIANTS + 1
    assert layout.COUNTS_LEN == layout.MERGE_OPEN + 1 == layout.PACKED_HEADS + 2
    assert list(layout.VARIANT_ROWS) == sorted(layout.VARIANT_ROWS)


def test_parser_evaluates_expressions() -> None:
    src = "constexpr int kA = 6;  // six\nconstexpr int kB = kA + 4 + 1;\n"
    scalars: dict[str, int] = {}
    for name, expr in _SCALAR.findall(src):
        scalars[name] = _eval(expr, scalars)
    assert scalars == {"kA": 6, "kB": 11}
