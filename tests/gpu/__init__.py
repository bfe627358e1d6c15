"""Tests that run the CUDA kernels: skipped without a GPU, and where the library was built
without its kernels."""

from __future__ import annotations

import pytest
import torch

from prefixattn.runtime.library import cuda_ops_available

KERNEL_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and not cuda_ops_available(),
        reason="prefixattn was built without CUDA kernels",
    ),
]
"""``pytestmark`` of a module of such tests."""
