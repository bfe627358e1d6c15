"""The kernels' partials scratch: partial rows in q's dtype, grown and moved only when needed."""

import torch

from prefixattn.runtime.buffers import Workspace


def test_workspace_partials_follow_q_dtype_and_grow():
    ws = Workspace("cpu", torch.bfloat16)
    assert ws.reserve(10, 8, 128)
    assert ws.partial_o.dtype == torch.bfloat16 and ws.partial_lse.dtype == torch.float32
    assert ws.partial_o.numel() >= 10 * 8 * 128 and ws.partial_lse.numel() >= 10 * 8
    ptr = ws.partial_o.data_ptr()
    # Same or fewer rows, same dtype: nothing moves (captured CUDA graphs stay valid).
    assert not ws.reserve(10, 8, 128, torch.bfloat16)
    assert not ws.reserve(3, 8, 128)
    assert ws.partial_o.data_ptr() == ptr
    # Another dtype moves the partial rows; more rows grow both buffers.
    assert ws.reserve(10, 8, 128, torch.float16)
    assert ws.partial_o.dtype == torch.float16
    assert ws.reserve(100, 8, 128)
    assert ws.partial_o.dtype == torch.float16 and ws.partial_o.numel() >= 100 * 8 * 128
    # A larger head_dim with enough lse rows grows the partial rows alone.
    lse_ptr = ws.partial_lse.data_ptr()
    assert ws.reserve(100, 8, 256)
    assert ws.partial_lse.data_ptr() == lse_ptr and ws.partial_o.numel() >= 100 * 8 * 256
