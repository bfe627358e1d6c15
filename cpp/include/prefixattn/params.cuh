// Parameters of the forward and merge kernels: one POD struct per stage, raw device pointers
// and element strides, filled by the launcher (cpp/launch/run_plan.cu). Torch-free.
#pragma once

#include <stdint.h>

#include "prefixattn/plan_layout.h"

namespace prefixattn {

// Division by a divisor fixed for a launch (GQA group size, page size),
// for dividends 0 <= n < 2^31 and divisors 1 <= d < 2^31: with s = ceil(log2 d) and
// m = floor(2^32 (2^s - d) / d) + 1, n / d = (umulhi(n, m) + n) >> s (round-up reciprocal
// method; tests/test_fast_div.py checks the identity). Three instructions instead of the
// twenty or so of a division by a runtime value.
struct FastDiv {
  uint32_t d, m, s;
  __host__ __device__ void init(int divisor) {
    d = static_cast<uint32_t>(divisor);
    s = 0;
    while ((1u << s) < d) ++s;
    m = static_cast<uint32_t>((static_cast<uint64_t>((1ull << s) - d) << 32) / d + 1);
  }
#ifdef __CUDACC__
  __device__ __forceinline__ int div(int n) const {
    const uint32_t q = (__umulhi(static_cast<uint32_t>(n), m) + static_cast<uint32_t>(n)) >> s;
    return static_cast<int>(q);
  }
  __device__ __forceinline__ int mod(int n) const { return n - div(n) * static_cast<int>(d); }
#endif
};

// Byte ranges that every forward launch asks the L2 to fetch as it starts (WarmL2): the plan's
// index arrays and q. A pair's loads form a chain (its item's bounds, then its slots, then q
// rows, page ids and partial-row indices), and from a cold L2 each link is a DRAM round trip;
// fetched up front, the links after the first are L2 hits (docs/dev/log.md v57).
constexpr int kWarmRanges = 13;
constexpr int kWarmLine = 128;  // bytes per prefetch
struct WarmL2 {
  const char* base[kWarmRanges];  // kWarmLine-aligned
  uint32_t lines[kWarmRanges];    // 0: nothing to fetch
};

struct ForwardParams {
  const void* q;  // [T, Hq, D]
  const void* k;  // paged cache, element strides below
  const void* v;
  void* out;           // [T, Hq, D], q's dtype
  void* partial_o;     // [num_partials, Hq, D], q's dtype
  float* partial_lse;  // [num_partials, Hq]
  const int32_t* kv_page_offset;
  const int32_t* kv_pages;
  const int32_t* kv_start;
  const int32_t* kv_len;
  const int32_t* q_indptr;
  const int32_t* q_tokens;
  const int32_t* q_limit;
  // Per slot: its partial row (>= 0), -1 (the output), or -2 - (16 j + n): a leaf slot that
  // finishes its token, whose n other partial rows are merge_partials[j - n .. j - 1] and
  // whose own row is merge_partials[j] (slot_dst).
  const int32_t* q_out;
  const int32_t* merge_partials;
  const int32_t* counts;  // kCountsLen entries (layout above)
  int64_t q_stride_t, q_stride_h;
  int64_t o_stride_t, o_stride_h;
  int64_t k_stride_page, k_stride_tok, k_stride_head;
  int64_t v_stride_page, v_stride_tok, v_stride_head;
  int page_size;
  int page_shift;  // log2(page_size) when a power of two, else -1
  int group_size;
  FastDiv page_div;   // by page_size
  FastDiv group_div;  // by group_size
  int num_qo_heads;
  int num_kv_heads;
  int variant;  // which group of items this launch runs
  // 1: the launch's items are [range_begin, range_end) and the plan's tokens merge or not as
  // range_merges says, known on the host (not under a fixed grid, and not for plans whose
  // device counts a check may zero), so a block's first loads need not wait on `counts`;
  // 0: read from `counts`.
  int host_range;
  int range_begin, range_end;
  int range_leaf_alone;  // the 16-row items are the plan's only items and nothing merges
  int prefetch_tiles;    // > 0: prefetch the KV tile this many tiles ahead of the copies into L2
  int chain_next;        // 1: the next launch of the run is chained to this one (ChainLink)
  // 1: the leaf launch runs after every other forward launch and finishes the merged tokens
  // of its slots with q_out <= -2 (forward_leaf.cuh); 0: those slots write a partial row.
  int finish;
  float scale_log2;  // softmax scale * log2(e)
  WarmL2 warm;
};

struct MergeParams {
  const void* partial_o;  // q's dtype
  const float* partial_lse;
  void* out;
  const int32_t* merge_tokens;
  const int32_t* merge_indptr;
  const int32_t* merge_partials;
  const int32_t* counts;
  int64_t o_stride_t, o_stride_h;
  int num_qo_heads;
  int vec_out;  // 1: out rows are 16-byte aligned (16-byte stores), else 4-byte stores
  int finish;   // 1: the leaf launch finished the last merged tokens; merge the others only
};

}  // namespace prefixattn
