// CUDA implementation of prefixattn::run_plan: one forward launch per tile group on the current
// stream, then one merge launch.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "prefixattn/decode_kernels.cuh"

namespace prefixattn {
namespace {

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous(), "prefixattn: ",
              name, " must be a contiguous int32 CUDA tensor");
}

template <typename T, int D, int RPW>
void launch_forward(const ForwardParams& p, int num_items, int num_kv_heads, cudaStream_t stream) {
  constexpr int smem = forward_smem_bytes<D, RPW>();
  auto kernel = forward_kernel<T, D, RPW>;
  static bool configured = [&] {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    return true;
  }();
  (void)configured;
  kernel<<<dim3(num_items, num_kv_heads), detail::kThreads, smem, stream>>>(p);
}

template <typename T, int D, int WARPS>
void launch_forward_mma(const ForwardParams& p, int num_items, int num_kv_heads,
                        cudaStream_t stream) {
  constexpr int smem = forward_mma_smem_bytes<D, WARPS>();
  auto kernel = forward_mma_kernel<T, D, WARPS>;
  static bool configured = [&] {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    return true;
  }();
  (void)configured;
  kernel<<<dim3(num_items, num_kv_heads), WARPS * 32, smem, stream>>>(p);
}

template <typename T, int D>
void dispatch_forward(const ForwardParams& p, int m, int num_items, int num_kv_heads,
                      cudaStream_t stream) {
  // Tensor cores for head_dim <= 128 (16 rows per warp); CUDA cores for head_dim 256.
  if constexpr (D <= 128) {
    if (m <= 64) return launch_forward_mma<T, D, 4>(p, num_items, num_kv_heads, stream);
    if (m <= 128) return launch_forward_mma<T, D, 8>(p, num_items, num_kv_heads, stream);
  }
  const int rpw = (m + detail::kWarps - 1) / detail::kWarps;
  if (rpw <= 2) return launch_forward<T, D, 2>(p, num_items, num_kv_heads, stream);
  if (rpw <= 4) return launch_forward<T, D, 4>(p, num_items, num_kv_heads, stream);
  if (rpw <= 8) return launch_forward<T, D, 8>(p, num_items, num_kv_heads, stream);
  if constexpr (D <= 128) {
    if (rpw <= 16) return launch_forward<T, D, 16>(p, num_items, num_kv_heads, stream);
  }
  TORCH_CHECK(false, "prefixattn: query tile of ", m, " rows is not instantiated for head_dim ",
              D, " (max ", D <= 128 ? 128 : 64, ")");
}

template <typename T>
void dispatch_dim(int D, const ForwardParams& p, int m, int n, int kvh, cudaStream_t s) {
  switch (D) {
    case 64: return dispatch_forward<T, 64>(p, m, n, kvh, s);
    case 128: return dispatch_forward<T, 128>(p, m, n, kvh, s);
    case 256: return dispatch_forward<T, 256>(p, m, n, kvh, s);
    default: TORCH_CHECK(false, "prefixattn: head_dim ", D, " unsupported (64, 128, 256)");
  }
}

template <typename T>
void launch_merge(const MergeParams& p, int D, int num_merge, cudaStream_t s) {
  switch (D) {
    case 64: merge_kernel<T, 64><<<num_merge, 256, 0, s>>>(p); break;
    case 128: merge_kernel<T, 128><<<num_merge, 256, 0, s>>>(p); break;
    case 256: merge_kernel<T, 256><<<num_merge, 256, 0, s>>>(p); break;
  }
}

void run_plan_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   at::Tensor& out, at::Tensor& partial_o, at::Tensor& partial_lse,
                   const at::Tensor& kv_page_indptr, const at::Tensor& kv_pages,
                   const at::Tensor& kv_start, const at::Tensor& kv_len,
                   const at::Tensor& q_indptr, const at::Tensor& q_tokens,
                   const at::Tensor& q_limit, const at::Tensor& q_out,
                   const at::Tensor& merge_tokens, const at::Tensor& merge_indptr,
                   const at::Tensor& merge_partials, const at::Tensor& counts,
                   at::IntArrayRef tile_indptr, at::IntArrayRef tile_m, int64_t num_merge_tokens,
                   bool hnd, double scale) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 3, "prefixattn: q must be a 3-D CUDA tensor");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "prefixattn: CUDA kernels support float16 and bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "prefixattn: q, caches and out must share a dtype");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "prefixattn: caches must be 4-D");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "prefixattn: last dims must be contiguous");
  TORCH_CHECK(partial_o.scalar_type() == at::kFloat && partial_lse.scalar_type() == at::kFloat,
              "prefixattn: partial buffers must be float32");
  for (auto* t : {&kv_page_indptr, &kv_pages, &kv_start, &kv_len, &q_indptr, &q_tokens, &q_limit,
                  &q_out, &merge_tokens, &merge_indptr, &merge_partials, &counts})
    check_index(*t, "plan index arrays");
  TORCH_CHECK(tile_indptr.size() == tile_m.size() + 1, "prefixattn: tile_indptr/tile_m mismatch");
  const int D = q.size(2);
  const int hq = q.size(1);
  const int hkv = hnd ? k_cache.size(1) : k_cache.size(2);
  const int page_size = hnd ? k_cache.size(2) : k_cache.size(1);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "prefixattn: num_qo_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(hq / hkv <= 16, "prefixattn: GQA group size ", hq / hkv, " > 16 unsupported");
  // 16-byte copies: every stride a multiple of 8 elements, base pointers 16-byte aligned.
  auto aligned = [](const at::Tensor& t) {
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16) return false;
    for (int i = 0; i < t.dim() - 1; ++i)
      if (t.stride(i) % 8) return false;
    return true;
  };
  TORCH_CHECK(aligned(q) && aligned(k_cache) && aligned(v_cache),
              "prefixattn: q and caches need 16-byte aligned rows (strides multiple of 8 elements)");

  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  ForwardParams p{};
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.partial_o = partial_o.data_ptr<float>();
  p.partial_lse = partial_lse.data_ptr<float>();
  p.kv_page_indptr = kv_page_indptr.data_ptr<int32_t>();
  p.kv_pages = kv_pages.data_ptr<int32_t>();
  p.kv_start = kv_start.data_ptr<int32_t>();
  p.kv_len = kv_len.data_ptr<int32_t>();
  p.q_indptr = q_indptr.data_ptr<int32_t>();
  p.q_tokens = q_tokens.data_ptr<int32_t>();
  p.q_limit = q_limit.data_ptr<int32_t>();
  p.q_out = q_out.data_ptr<int32_t>();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  const int tok_dim = hnd ? 2 : 1, head_dim_idx = hnd ? 1 : 2;
  p.k_stride_page = k_cache.stride(0);
  p.k_stride_tok = k_cache.stride(tok_dim);
  p.k_stride_head = k_cache.stride(head_dim_idx);
  p.v_stride_page = v_cache.stride(0);
  p.v_stride_tok = v_cache.stride(tok_dim);
  p.v_stride_head = v_cache.stride(head_dim_idx);
  p.page_size = page_size;
  p.group_size = hq / hkv;
  p.num_qo_heads = hq;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);

  for (size_t t = 0; t < tile_m.size(); ++t) {
    const int n = tile_indptr[t + 1] - tile_indptr[t];
    if (n <= 0) continue;
    p.item_offset = tile_indptr[t];
    if (q.scalar_type() == at::kHalf)
      dispatch_dim<half>(D, p, tile_m[t], n, hkv, stream);
    else
      dispatch_dim<__nv_bfloat16>(D, p, tile_m[t], n, hkv, stream);
  }
  if (num_merge_tokens > 0) {
    MergeParams mp{};
    mp.partial_o = p.partial_o;
    mp.partial_lse = p.partial_lse;
    mp.out = p.out;
    mp.merge_tokens = merge_tokens.data_ptr<int32_t>();
    mp.merge_indptr = merge_indptr.data_ptr<int32_t>();
    mp.merge_partials = merge_partials.data_ptr<int32_t>();
    mp.counts = counts.data_ptr<int32_t>();
    mp.o_stride_t = p.o_stride_t;
    mp.o_stride_h = p.o_stride_h;
    mp.num_qo_heads = hq;
    if (q.scalar_type() == at::kHalf)
      launch_merge<half>(mp, D, num_merge_tokens, stream);
    else
      launch_merge<__nv_bfloat16>(mp, D, num_merge_tokens, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace prefixattn

TORCH_LIBRARY_IMPL(prefixattn, CUDA, m) { m.impl("run_plan", &prefixattn::run_plan_cuda); }
