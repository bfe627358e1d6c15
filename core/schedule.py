"""Per-plan arrays for the CUDA kernels beyond the plan's own (host side, int32).

The forward kernels read the plan's arrays directly (one thread block per (work item, KV
head), tile groups launched in order), so no extra arrays are needed at present.
"""

from __future__ import annotations

import numpy as np

from .plan import PlanArrays


def schedule_arrays(host: PlanArrays, num_kv_heads: int) -> dict[str, np.ndarray]:
    """Extra int32 arrays the kernels need for ``host``; copied to ``plan.extras[name]``."""
    del host, num_kv_heads
    return {}
