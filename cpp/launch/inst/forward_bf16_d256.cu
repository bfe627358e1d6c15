// Kernels of bf16 at head_dim 256: the forward variants and the merge.
#include "launch/dispatch.cuh"

PREFIXATTN_INSTANTIATE(__nv_bfloat16, 256)
