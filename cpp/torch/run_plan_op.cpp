// The CUDA implementation of the prefixattn::run_plan op (schema: ops_schema.cpp): checks the
// tensors, turns them into raw pointers and strides on the current stream, and calls the
// torch-free launcher (cpp/launch/run_plan.h).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <stdexcept>

#include "launch/run_plan.h"
#include "prefixattn/plan_layout.h"

namespace prefixattn {
namespace {

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous(), "prefixattn: ", name,
              " must be a contiguous int32 CUDA tensor");
}

DeviceArray device_array(const at::Tensor& t) { return {t.data_ptr<int32_t>(), t.numel()}; }

void run_plan_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   at::Tensor& out, at::Tensor& partial_o, at::Tensor& partial_lse,
                   const at::Tensor& kv_page_offset, const at::Tensor& kv_pages,
                   const at::Tensor& kv_start, const at::Tensor& kv_len, const at::Tensor& q_indptr,
                   const at::Tensor& q_tokens, const at::Tensor& q_limit, const at::Tensor& q_out,
                   const at::Tensor& merge_tokens, const at::Tensor& merge_indptr,
                   const at::Tensor& merge_partials, const at::Tensor& counts,
                   at::IntArrayRef tile_indptr, at::IntArrayRef tile_m, int64_t num_merge_tokens,
                   bool hnd, double scale, int64_t prefetch_tiles, bool fixed_grid, bool concurrent,
                   int64_t fixed_variants, bool chained, int64_t num_finished, bool finish,
                   int64_t leaf_max_rows, int64_t leaf_tiles, bool host_counts) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 3, "prefixattn: q must be a 3-D CUDA tensor");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "prefixattn: CUDA kernels support float16 and bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "prefixattn: q, caches and out must share a dtype");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "prefixattn: caches must be 4-D");
  TORCH_CHECK(out.sizes() == q.sizes(), "prefixattn: out must have q's shape ", q.sizes(), ", got ",
              out.sizes());
  TORCH_CHECK(k_cache.size(3) == q.size(2) && v_cache.size(3) == q.size(2),
              "prefixattn: the caches' head_dim must be q's (", q.size(2), "), got ",
              k_cache.size(3), " and ", v_cache.size(3));
  TORCH_CHECK(k_cache.size(1) == v_cache.size(1) && k_cache.size(2) == v_cache.size(2),
              "prefixattn: k_cache and v_cache must have the same page size and KV heads, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(
      q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
      "prefixattn: last dims must be contiguous");
  TORCH_CHECK(partial_o.scalar_type() == q.scalar_type() && partial_lse.scalar_type() == at::kFloat,
              "prefixattn: partial_o must have q's dtype (", q.scalar_type(), "), got ",
              partial_o.scalar_type(), "; partial_lse must be float32, got ",
              partial_lse.scalar_type());
  // Partial rows are written two elements (4 bytes) at a time by the forward kernels and read
  // 16 bytes at a time by the merge.
  TORCH_CHECK(
      partial_o.is_cuda() && partial_lse.is_cuda() && partial_o.is_contiguous() &&
          partial_lse.is_contiguous() &&
          reinterpret_cast<uintptr_t>(partial_o.data_ptr()) % 16 == 0,
      "prefixattn: partial buffers must be contiguous CUDA tensors, partial_o 16-byte aligned");
  for (auto* t : {&kv_page_offset, &kv_pages, &kv_start, &kv_len, &q_indptr, &q_tokens, &q_limit,
                  &q_out, &merge_tokens, &merge_indptr, &merge_partials, &counts})
    check_index(*t, "plan index arrays");
  TORCH_CHECK(num_finished >= 0 && num_finished <= num_merge_tokens, "prefixattn: num_finished (",
              num_finished, ") must lie in [0, num_merge_tokens = ", num_merge_tokens, "]");
  TORCH_CHECK(tile_indptr.size() == tile_m.size() + 1, "prefixattn: tile_indptr/tile_m mismatch");
  TORCH_CHECK(counts.numel() >= kCountsLen, "prefixattn: counts must hold ", kCountsLen,
              " entries (plan sizes and variant bounds)");
  const int D = q.size(2);
  const int hq = q.size(1);
  const int hkv = hnd ? k_cache.size(1) : k_cache.size(2);
  const int page_size = hnd ? k_cache.size(2) : k_cache.size(1);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0,
              "prefixattn: num_qo_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(hq / hkv <= 16, "prefixattn: GQA group size ", hq / hkv, " > 16 unsupported");
  // 16-byte copies: every stride a multiple of 8 elements, base pointers 16-byte aligned.
  auto aligned = [](const at::Tensor& t) {
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16) return false;
    for (int i = 0; i < t.dim() - 1; ++i)
      if (t.stride(i) % 8) return false;
    return true;
  };
  TORCH_CHECK(
      aligned(q) && aligned(k_cache) && aligned(v_cache),
      "prefixattn: q and caches need 16-byte aligned rows (strides multiple of 8 elements)");
  // The output is written two elements at a time.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0 && out.stride(0) % 2 == 0 &&
                  out.stride(1) % 2 == 0,
              "prefixattn: out needs 4-byte aligned rows (even strides)");

  const c10::cuda::CUDAGuard guard(q.device());
  try {
    check_device_has_kernels();
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  RunPlanArgs a;
  a.dtype = q.scalar_type() == at::kHalf ? DType::kFloat16 : DType::kBFloat16;
  a.head_dim = D;
  a.num_qo_heads = hq;
  a.num_kv_heads = hkv;
  a.page_size = page_size;
  a.num_tokens = q.size(0);
  a.q = q.data_ptr();
  a.q_stride_t = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.k = k_cache.data_ptr();
  a.v = v_cache.data_ptr();
  const int tok_dim = hnd ? 2 : 1, head_dim_idx = hnd ? 1 : 2;
  a.k_stride_page = k_cache.stride(0);
  a.k_stride_tok = k_cache.stride(tok_dim);
  a.k_stride_head = k_cache.stride(head_dim_idx);
  a.v_stride_page = v_cache.stride(0);
  a.v_stride_tok = v_cache.stride(tok_dim);
  a.v_stride_head = v_cache.stride(head_dim_idx);
  // The kernels form row offsets as page x page stride + slot x token stride in 32-bit factors.
  for (int64_t stride : {a.k_stride_page, a.k_stride_tok, a.v_stride_page, a.v_stride_tok})
    TORCH_CHECK(stride >= 0 && stride <= INT32_MAX,
                "prefixattn: KV cache page and token strides must "
                "be non-negative and below 2^31 elements, got ",
                stride);
  for (int64_t stride : {a.k_stride_tok, a.v_stride_tok})
    TORCH_CHECK(static_cast<int64_t>(page_size - 1) * stride <= INT32_MAX,
                "prefixattn: a page's last token must sit below 2^31 elements from its first "
                "(page size ",
                page_size, ", token stride ", stride, ")");
  a.out = out.data_ptr();
  a.o_stride_t = out.stride(0);
  a.o_stride_h = out.stride(1);
  a.partial_o = partial_o.data_ptr();
  a.partial_lse = partial_lse.data_ptr<float>();
  a.kv_page_offset = device_array(kv_page_offset);
  a.kv_pages = device_array(kv_pages);
  a.kv_start = device_array(kv_start);
  a.kv_len = device_array(kv_len);
  a.q_indptr = device_array(q_indptr);
  a.q_tokens = device_array(q_tokens);
  a.q_limit = device_array(q_limit);
  a.q_out = device_array(q_out);
  a.merge_tokens = device_array(merge_tokens);
  a.merge_indptr = device_array(merge_indptr);
  a.merge_partials = device_array(merge_partials);
  a.counts = device_array(counts);
  a.tile_indptr = tile_indptr.data();
  a.tile_m = tile_m.data();
  a.num_tiles = static_cast<int64_t>(tile_m.size());
  a.num_merge_tokens = num_merge_tokens;
  a.num_finished = num_finished;
  a.leaf_max_rows = leaf_max_rows;
  a.leaf_tiles = leaf_tiles;
  a.scale = scale;

  LaunchOptions o;
  o.prefetch_tiles = static_cast<int>(prefetch_tiles);
  o.fixed_grid = fixed_grid;
  o.concurrent = concurrent;
  o.fixed_variants = fixed_variants;
  o.chained = chained;
  o.finish = finish;
  o.host_counts = host_counts;
  try {
    run_plan(a, o, stream);
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace
}  // namespace prefixattn

TORCH_LIBRARY_IMPL(prefixattn, CUDA, m) { m.impl("run_plan", &prefixattn::run_plan_cuda); }
