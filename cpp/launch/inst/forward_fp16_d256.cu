// Kernels of fp16 at head_dim 256: the forward variants and the merge.
#include "launch/dispatch.cuh"

PREFIXATTN_INSTANTIATE(half, 256)
