// The kernel of each launch: declarations of the per-(dtype, head_dim) launch functions, which
// inst/forward_{fp16,bf16}_d{64,128,256}.cu instantiate explicitly (dispatch.cuh defines them).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "prefixattn/params.cuh"

namespace prefixattn {

// The leaf kernel's forms (forward_leaf_kernel): every item of the 16-row variant has at most
// 8 query rows (kLeafNarrow: one column block), and its items are also short (kLeafShort: 2
// stages, 3 blocks per SM at head_dim 128).
constexpr int kLeafGeneral = 0, kLeafNarrow = 1, kLeafShort = 2;
constexpr int kLeafShortTiles = 3;  // the short form's largest mean tiles per item

// The forward launch of variant p.variant: `pairs` (item, KV head) pairs known on the host (an
// upper bound where the 16-row kernel packs several KV heads per pair: surplus blocks return
// at once), or -1 when the launch must run any plan (fixed grid).
template <typename T, int D>
void launch_forward(const ForwardParams& p, int pairs, cudaStream_t stream, bool chained,
                    int leaf_form);

// The merge launch: `num_merge` tokens known on the host, or -1 for the fixed grid.
template <typename T, int D>
void launch_merge(const MergeParams& p, int num_merge, cudaStream_t stream, bool chained);

// Thread blocks of the merge's fixed grid on the current device (SMs x resident blocks with the
// largest weight table), shared by every head_dim; instantiated with head_dim 128.
template <typename T>
int merge_full_grid();

// cudaFuncGetAttributes of one merge kernel: whether the library has code for the device.
template <typename T>
cudaError_t merge_kernel_attributes(cudaFuncAttributes* attr);

#define PREFIXATTN_DECLARE_INSTANCES(T, D)                                                       \
  extern template void launch_forward<T, D>(const ForwardParams&, int, cudaStream_t, bool, int); \
  extern template void launch_merge<T, D>(const MergeParams&, int, cudaStream_t, bool);
PREFIXATTN_DECLARE_INSTANCES(half, 64)
PREFIXATTN_DECLARE_INSTANCES(half, 128)
PREFIXATTN_DECLARE_INSTANCES(half, 256)
PREFIXATTN_DECLARE_INSTANCES(__nv_bfloat16, 64)
PREFIXATTN_DECLARE_INSTANCES(__nv_bfloat16, 128)
PREFIXATTN_DECLARE_INSTANCES(__nv_bfloat16, 256)
#undef PREFIXATTN_DECLARE_INSTANCES
extern template int merge_full_grid<half>();
extern template int merge_full_grid<__nv_bfloat16>();
extern template cudaError_t merge_kernel_attributes<half>(cudaFuncAttributes*);
extern template cudaError_t merge_kernel_attributes<__nv_bfloat16>(cudaFuncAttributes*);

}  // namespace prefixattn
