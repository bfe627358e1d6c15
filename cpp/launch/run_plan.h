// The torch-free launcher of a LaunchPlan: one forward launch per query-tile variant on the
// given stream, then one merge launch; sizes come from the plan's device `counts`. Raw device
// pointers and element strides in, no allocation, no host synchronisation (safe under CUDA-graph
// capture). Errors throw std::runtime_error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "launch/launch_options.h"

namespace prefixattn {

enum class DType { kFloat16, kBFloat16 };

// An int32 plan array on the device and its length in elements.
struct DeviceArray {
  const int32_t* data = nullptr;
  int64_t size = 0;
};

struct RunPlanArgs {
  DType dtype = DType::kFloat16;  // of q, the caches, out and partial_o
  int head_dim = 0;               // 64, 128 or 256
  int num_qo_heads = 0;
  int num_kv_heads = 0;  // num_qo_heads / num_kv_heads <= 16
  int page_size = 0;
  int64_t num_tokens = 0;   // q's rows
  const void* q = nullptr;  // [num_tokens, num_qo_heads, head_dim], element strides below
  int64_t q_stride_t = 0, q_stride_h = 0;
  // Paged caches: element strides per page, token slot within a page and KV head (NHD or HND).
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_stride_page = 0, k_stride_tok = 0, k_stride_head = 0;
  int64_t v_stride_page = 0, v_stride_tok = 0, v_stride_head = 0;
  void* out = nullptr;  // q's shape and dtype
  int64_t o_stride_t = 0, o_stride_h = 0;
  void* partial_o = nullptr;     // [num_partials, num_qo_heads, head_dim], q's dtype, 16-B aligned
  float* partial_lse = nullptr;  // [num_partials, num_qo_heads]
  DeviceArray kv_page_offset, kv_pages, kv_start, kv_len, q_indptr, q_tokens, q_limit, q_out,
      merge_tokens, merge_indptr, merge_partials;
  DeviceArray counts;  // kCountsLen entries (plan_layout.h)
  // Host tile groups: items tile_indptr[t] .. tile_indptr[t + 1] - 1 run with query tile height
  // tile_m[t] (num_tiles groups; tile_indptr has num_tiles + 1 entries).
  const int64_t* tile_indptr = nullptr;
  const int64_t* tile_m = nullptr;
  int64_t num_tiles = 0;
  int64_t num_merge_tokens = 0;
  int64_t num_finished = 0;    // merged tokens the leaf launch may finish (the last ones)
  int64_t leaf_max_rows = -1;  // most query rows of a 16-row item (-1: not known)
  int64_t leaf_tiles = -1;     // 16-token tiles of the 16-row items, summed (-1: not known)
  double scale = 1.0;          // softmax scale
};

// Throws when the library has no kernels for the current device's architecture.
void check_device_has_kernels();

// Runs the plan on `stream` (the current device must be the tensors' device).
void run_plan(const RunPlanArgs& args, const LaunchOptions& options, cudaStream_t stream);

}  // namespace prefixattn
