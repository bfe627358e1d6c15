// Kernels of bf16 at head_dim 128: the forward variants and the merge.
#include "launch/dispatch.cuh"

PREFIXATTN_INSTANTIATE(__nv_bfloat16, 128)

// The merge grid of every head_dim is sized with the head_dim-128 kernel.
namespace prefixattn {
template int merge_full_grid<__nv_bfloat16>();
template cudaError_t merge_kernel_attributes<__nv_bfloat16>(cudaFuncAttributes*);
}  // namespace prefixattn
