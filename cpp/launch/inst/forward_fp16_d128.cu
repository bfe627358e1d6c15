// Kernels of fp16 at head_dim 128: the forward variants and the merge.
#include "launch/dispatch.cuh"

PREFIXATTN_INSTANTIATE(half, 128)

// The merge grid of every head_dim is sized with the head_dim-128 kernel.
namespace prefixattn {
template int merge_full_grid<half>();
template cudaError_t merge_kernel_attributes<half>(cudaFuncAttributes*);
}  // namespace prefixattn
