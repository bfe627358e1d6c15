"""Kernel-side schedule arrays derived from a plan's host arrays.

The forward kernels may need the work items in another shape than the framework-neutral plan
(e.g. a flattened queue for a persistent launch). ``schedule_arrays`` computes those once per
plan, on the host; the plan copies them to its device next to its other arrays, so ``run``
does no host work.
"""

from __future__ import annotations

import numpy as np

from .plan import PlanArrays


def schedule_arrays(host: PlanArrays, num_kv_heads: int) -> dict[str, np.ndarray]:
    """Extra int32 arrays for the CUDA forward stage, keyed by name."""
    del host, num_kv_heads
    return {}
