"""prefixattn: prefix-aware paged decode attention.

Reads each shared KV page once per step for all the queries that share it: the block tables
become a prefix forest, the forest is packed into work items, the items run as one forward
stage writing partial results, and a log-sum-exp merge combines them.

Importing this package loads neither the compiled kernels (loaded on first CUDA ``run``) nor
any serving framework.
"""

from .attention import (
    CapturedBuffers,
    PrefixAttention,
    decode_reservation,
    decode_slots_per_token,
    leaf_split_spare,
)
from .engine.sharing import SharingProbe, TableHint, shares_pages
from .options import LaunchOptions, PlanOptions
from .plan.forest import PrefixForest, build_forest
from .plan.types import LaunchPlan, PlanArrays
from .runtime.reference import attention_reference, run_plan_reference
from .workloads import PAT_TREES, parse_tree, tree_batch

__all__ = [
    "PAT_TREES",
    "CapturedBuffers",
    "LaunchOptions",
    "LaunchPlan",
    "PlanArrays",
    "PlanOptions",
    "PrefixAttention",
    "PrefixForest",
    "SharingProbe",
    "TableHint",
    "attention_reference",
    "build_forest",
    "decode_reservation",
    "decode_slots_per_token",
    "leaf_split_spare",
    "parse_tree",
    "run_plan_reference",
    "shares_pages",
    "tree_batch",
]

__version__ = "0.1.0"
