// Forward and merge kernels that execute a prefixattn LaunchPlan. Torch-free: raw pointers and
// one params struct per stage.
//
// Work: a (work item, KV head) pair. Items are grouped by query-tile height m (16, 32, 64, 128
// rows; rows = tokens x GQA group, token-major: row r -> slot r / group, q head
// kv_head * group + r % group). One launch per height ("variant") runs that group's pairs; the
// group's bounds are read from device memory (counts[kVariantBase + v ..]), never from the
// host, and a block loops over pairs with a grid stride, so a launch with a fixed grid runs any
// plan (CUDA-graph replay). Within a group, consecutive blocks take consecutive items of one KV
// head, so items that share KV (row chunks of one forest node) run side by side and meet in L2.
//
// Each pair streams its item's KV run through shared memory once (64-token tiles, STAGES-deep
// cp.async pipeline, zero-filled past the end: masked keys carry V = 0, never NaN) and computes
// every query row of the item against it. A query covered by one item gets its output written
// in q's dtype; otherwise the item writes its normalised partial row, also in q's dtype (half
// the bytes of fp32: partial rows are a large share of a deep tree's traffic), and its fp32
// natural-log log-sum-exp, and the merge kernel combines the partials in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace prefixattn {

// Layout of the plan's int32 `counts` device array.
constexpr int kCountItems = 0;        // work items
constexpr int kCountMergeTokens = 3;  // tokens the merge stage combines
constexpr int kVariantBase = 6;       // counts[6 + v] .. counts[7 + v]: items of variant v
constexpr int kNumVariants = 4;       // query-tile heights 16, 32, 64, 128
// KV heads one pair of the 16-row variant covers (1, 2, 4, ...; a divisor of the KV heads):
// items whose rows fit that many times in 16 rows (one decode token of a small GQA group)
// stack the heads' rows in one tile and stream the heads' KV one after another.
constexpr int kCountPackedHeads = kVariantBase + kNumVariants + 1;
// Merged tokens the merge launch takes when the leaf launch finishes the others (the last
// entries of merge_tokens; ForwardParams::finish).
constexpr int kCountMergeOpen = kCountPackedHeads + 1;
constexpr int kCountsLen = kCountMergeOpen + 1;

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
    return static_cast<int>((__umulhi(static_cast<uint32_t>(n), m) + static_cast<uint32_t>(n)) >> s);
  }
  __device__ __forceinline__ int mod(int n) const { return n - div(n) * static_cast<int>(d); }
#endif
};

// Byte ranges that every forward launch asks the L2 to fetch as it starts (WarmL2): the plan's
// index arrays and q. A pair's loads form a chain (its item's bounds, then its slots, then q
// rows, page ids and partial-row indices), and from a cold L2 each link is a DRAM round trip;
// fetched up front, the links after the first are L2 hits (docs/kernel-notes.md v57).
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
  void* out;            // [T, Hq, D], q's dtype
  void* partial_o;      // [num_partials, Hq, D], q's dtype
  float* partial_lse;   // [num_partials, Hq]
  const int32_t* kv_page_indptr;
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
  int variant;         // which group of items this launch runs
  // 1: the launch's items are [range_begin, range_end) and the plan's tokens merge or not as
  // range_merges says, known on the host (not under a fixed grid, and not for plans whose
  // device counts a check may zero), so a block's first loads need not wait on `counts`;
  // 0: read from `counts`.
  int host_range;
  int range_begin, range_end;
  int range_leaf_alone;  // the 16-row items are the plan's only items and nothing merges
  int prefetch_tiles;  // > 0: prefetch the KV tile this many tiles ahead of the copies into L2
  int chain_next;      // 1: the next launch of the run is chained to this one (ChainLink)
  // 1: the leaf launch runs after every other forward launch and finishes the merged tokens
  // of its slots with q_out <= -2 (leaf_forward.cuh); 0: those slots write a partial row.
  int finish;
  // 1: the wgmma producer's copies signal their stage full as they land, up to STAGES tiles in
  // flight; 0: two tiles in flight (wgmma_forward.cuh).
  int async_full;
  // 1: the `wgmma` producer stages each pair's page ids in shared memory (KvCopier::spg).
  int smem_pages;
  float scale_log2;    // softmax scale * log2(e)
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

namespace detail {

// Chained launches (programmatic dependent launch, sm_90): the host may launch a run's forward
// launches after the first, and its merge, with the programmatic-serialization attribute, so
// each may start while the one before drains. A forward launch whose next launch is chained
// (ForwardParams::chain_next) lets it start at once; otherwise it signals nothing early, so a
// kernel that follows the run (launched by others, perhaps with the attribute) never starts
// before the run's last launch ends. The next launch's blocks find room on an SM only as this
// launch's blocks leave, so the launches overlap at their tails, not at their cores. They write disjoint rows, so none
// waits for another's data. Block 0 of every forward launch waits for the launch before it to
// finish before it exits, so a launch finishes only after every launch before it, and the
// merge waits for the last forward launch before it reads a partial row. Launched without
// the attribute, both instructions return at once.
__device__ __forceinline__ void chain_allow_next() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void chain_wait_prev() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The launch's threads split the lines of every WarmL2 range among them (one
// prefetch.global.L2::evict_last each, nothing waits for it): the plan's arrays are a few KB to
// a few hundred KB, q up to a few MB, read by every launch of a run.
__device__ __forceinline__ void warm_l2(const WarmL2& w) {
  const uint32_t n = gridDim.x * blockDim.x;
  const uint32_t g = blockIdx.x * blockDim.x + threadIdx.x;
#pragma unroll
  for (int r = 0; r < kWarmRanges; ++r) {
    const char* base = w.base[r];
    for (uint32_t i = g; i < w.lines[r]; i += n)
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(base + static_cast<size_t>(i) * kWarmLine));
  }
}

// Declared first in a forward kernel: lets a chained next launch start, asks the L2 for the
// plan's arrays and q (warm_l2), and makes block 0 wait for the previous launch on every way
// out of the kernel.
struct ChainLink {
  __device__ __forceinline__ explicit ChainLink(const ForwardParams& p) {
    if (p.chain_next) chain_allow_next();
    warm_l2(p.warm);
  }
  __device__ __forceinline__ ~ChainLink() {
    if (blockIdx.x == 0) chain_wait_prev();
  }
};

// Where a query slot's row goes: its partial row (>= 0) or the output (-1). A leaf slot that
// finishes its token (q_out = -2 - (16 j + n)) keeps that value when the launch finishes
// tokens, and otherwise writes its own row merge_partials[j] (the merge then takes the token).
__device__ __forceinline__ int slot_dst(const ForwardParams& p, int slot) {
  const int d = p.q_out[slot];
  return d >= -1 || p.finish ? d : p.merge_partials[(-2 - d) >> 4];
}

constexpr int kTileN = 64;
constexpr int kPad = 8;  // halfs of padding per smem KV row: rows 16 B apart mod 128 B

template <typename T>
struct Vec;
template <>
struct Vec<half> {
  static __device__ __forceinline__ float2 to_float2(uint32_t x) {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  }
  static __device__ __forceinline__ half from_float(float x) { return __float2half_rn(x); }
};
template <>
struct Vec<__nv_bfloat16> {
  static __device__ __forceinline__ float2 to_float2(uint32_t x) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

// 16-byte async copy, zero-filled when !valid. The L2::128B hint lets the L2 fetch the whole
// 128-byte line from DRAM on the first sector's miss (measured: 1-3% faster streaming than no
// hint; 64 and 256 bytes gained nothing, docs/kernel-notes.md v44).
__device__ __forceinline__ void cp_async_16(uint32_t s, const void* gmem, bool valid) {
  int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_size));
}
// The same under an L2 cache policy (from createpolicy).
__device__ __forceinline__ void cp_async_16(uint32_t s, const void* gmem, bool valid,
                                            uint64_t policy) {
  int src_size = valid ? 16 : 0;
  asm volatile(
      "cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;\n" ::"r"(s),
      "l"(gmem), "r"(src_size), "l"(policy));
}
// Lines read under this policy are the first the L2 evicts.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Bulk prefetch of `bytes` (a multiple of 16) at a 16-byte aligned global address into L2.
__device__ __forceinline__ void prefetch_l2(const void* gmem, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(gmem), "r"(bytes));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Element offset of KV position `pos` of a run of pages (page then slot within the page).
__device__ __forceinline__ int64_t kv_offset(const int32_t* pages, int pos, int page_size,
                                             int page_shift, int64_t stride_page,
                                             int64_t stride_tok) {
  int page_idx, slot;
  if (page_shift >= 0) {
    page_idx = pos >> page_shift;
    slot = pos & (page_size - 1);
  } else {
    page_idx = pos / page_size;
    slot = pos - page_idx * page_size;
  }
  return static_cast<int64_t>(pages[page_idx]) * stride_page + slot * stride_tok;
}

// This launch's items [begin, begin + num_items): from the host where it passed them
// (ForwardParams::host_range), else from the plan's device counts.
__device__ __forceinline__ void launch_items(const ForwardParams& p, int& begin, int& num_items) {
  if (p.host_range) {
    begin = p.range_begin;
    num_items = p.range_end - begin;
  } else {
    begin = p.counts[kVariantBase + p.variant];
    num_items = p.counts[kVariantBase + p.variant + 1] - begin;
  }
}

// A block's place in its stream of pairs: pair w = head * num_items + idx (item begin + idx).
struct PairPos {
  int w, idx, head;
};

// The (item, kv_head) pairs of this launch's variant: [0, total). A block walks them with a
// grid stride; the stride's quotient and remainder by num_items are taken once, so a step is
// two adds and a compare instead of a division.
// With packed heads (`heads` > 1) a pair covers KV heads head * heads .. + heads - 1.
struct WorkRange {
  int begin, num_items, total, step_idx, step_head, heads;
  __device__ __forceinline__ WorkRange(const ForwardParams& p, bool packs = false) {
    launch_items(p, begin, num_items);
    heads = packs ? max(p.counts[kCountPackedHeads], 1) : 1;
    total = num_items > 0 ? num_items * (p.num_kv_heads / heads) : 0;
    const int n = max(num_items, 1);
    step_idx = static_cast<int>(gridDim.x) % n;
    step_head = static_cast<int>(gridDim.x) / n;
  }
  // The block's first pair (blockIdx.x < total).
  __device__ __forceinline__ PairPos first() const {
    const int w = blockIdx.x, n = max(num_items, 1);
    return PairPos{w, w % n, w / n};
  }
  __device__ __forceinline__ void advance(PairPos& q) const {
    q.w += gridDim.x;
    q.idx += step_idx;
    q.head += step_head;
    if (q.idx >= num_items) {
      q.idx -= num_items;
      ++q.head;
    }
  }
};

}  // namespace detail

namespace detail {
// KV length and first page offset of the pair after `pos` in `range` (a WorkRange or the leaf
// kernel's LeafPairs), fetched a pair ahead by the copy sides; unchanged past the last pair.
template <typename Range>
__device__ __forceinline__ void fetch_pair_after(const ForwardParams& p, const Range& range,
                                                 PairPos pos, int& len, int& page0) {
  range.advance(pos);
  if (pos.w < range.total) {
    const int item = range.begin + pos.idx;
    len = p.kv_len[item];
    page0 = p.kv_page_indptr[item];
  }
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// CUDA-core forward (head_dim 256): 8 warps; warp w owns rows w, w + 8, ... (ROWS_PER_WARP of
// them); lane j scores keys j and j + 32 of the tile; lane owns D / 32 contiguous output dims;
// online softmax in the log2 domain; two-stage cp.async pipeline.
namespace detail {
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
}  // namespace detail

template <int D, int ROWS_PER_WARP>
constexpr int forward_smem_bytes() {
  return 2 * 2 * detail::kTileN * (D + detail::kPad) * 2  // K, V x 2 stages
         + detail::kWarps * ROWS_PER_WARP * D * 2         // q tile
         + detail::kWarps * ROWS_PER_WARP * detail::kTileN * 4;  // probabilities
}

template <typename T, int D, int ROWS_PER_WARP>
__device__ __forceinline__ void forward_item(const ForwardParams& p, int item, int kv_head,
                                             unsigned char* smem_raw) {
  using namespace detail;
  constexpr int kRow = D + kPad;   // smem KV row, halfs
  constexpr int kChunks = D / 8;   // 16-byte chunks per row
  constexpr int kDpl = D / 32;     // output dims per lane
  constexpr int kRows = kWarps * ROWS_PER_WARP;
  T* k_s = reinterpret_cast<T*>(smem_raw);                   // [2][kTileN][kRow]
  T* v_s = k_s + 2 * kTileN * kRow;                          // [2][kTileN][kRow]
  T* q_s = v_s + 2 * kTileN * kRow;                          // [kRows][D]
  float* p_s = reinterpret_cast<float*>(q_s + kRows * D);    // [kRows][kTileN]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = p.group_size;
  const int slot0 = p.q_indptr[item];
  const int num_rows = (p.q_indptr[item + 1] - slot0) * g;
  const int kv_len = p.kv_len[item];
  const int kv_start = p.kv_start[item];
  const int32_t* pages = p.kv_pages + p.kv_page_indptr[item];
  const T* k_base = static_cast<const T*>(p.k) + kv_head * p.k_stride_head;
  const T* v_base = static_cast<const T*>(p.v) + kv_head * p.v_stride_head;

  auto load_tile = [&](int tile, int stage) {
    for (int c = tid; c < kTileN * kChunks; c += kThreads) {
      int t = c / kChunks, ch = c % kChunks;
      int pos = tile * kTileN + t;
      bool valid = pos < kv_len;
      int64_t ko = valid ? kv_offset(pages, pos, p.page_size, p.page_shift, p.k_stride_page,
                                     p.k_stride_tok)
                         : 0;
      int64_t vo = valid ? kv_offset(pages, pos, p.page_size, p.page_shift, p.v_stride_page,
                                     p.v_stride_tok)
                         : 0;
      cp_async_16(k_s + (stage * kTileN + t) * kRow + ch * 8, k_base + ko + ch * 8, valid);
      cp_async_16(v_s + (stage * kTileN + t) * kRow + ch * 8, v_base + vo + ch * 8, valid);
    }
    cp_async_commit();
  };

  const int num_tiles = (kv_len + kTileN - 1) / kTileN;
  if (num_tiles > 0) load_tile(0, 0);

  // q tile: rows past num_rows are zero (never written out).
  for (int c = tid; c < kRows * kChunks; c += kThreads) {
    int r = c / kChunks, ch = c % kChunks;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < num_rows) {
      const int rs = p.group_div.div(r);
      int token = p.q_tokens[slot0 + rs];
      int head = kv_head * g + (r - rs * g);
      val = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + token * p.q_stride_t +
                                            head * p.q_stride_h + ch * 8);
    }
    *reinterpret_cast<uint4*>(q_s + r * D + ch * 8) = val;
  }

  float m_run[ROWS_PER_WARP], l_run[ROWS_PER_WARP], o_acc[ROWS_PER_WARP][kDpl];
  int limit[ROWS_PER_WARP];
#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    int r = warp + i * kWarps;
    m_run[i] = -INFINITY;
    l_run[i] = 0.f;
    limit[i] = r < num_rows ? p.q_limit[slot0 + p.group_div.div(r)] - kv_start : 0;
#pragma unroll
    for (int d = 0; d < kDpl; ++d) o_acc[i][d] = 0.f;
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_tiles) {
      load_tile(tile + 1, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* kt = k_s + stage * kTileN * kRow;
    const T* vt = v_s + stage * kTileN * kRow;

    // Scores for keys lane and lane + 32, every row of this warp.
    float s[ROWS_PER_WARP][2];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) s[i][0] = s[i][1] = 0.f;
#pragma unroll 2
    for (int ch = 0; ch < kChunks; ++ch) {
      uint4 k0 = *reinterpret_cast<const uint4*>(kt + lane * kRow + ch * 8);
      uint4 k1 = *reinterpret_cast<const uint4*>(kt + (lane + 32) * kRow + ch * 8);
      float2 a0 = Vec<T>::to_float2(k0.x), a1 = Vec<T>::to_float2(k0.y),
             a2 = Vec<T>::to_float2(k0.z), a3 = Vec<T>::to_float2(k0.w);
      float2 b0 = Vec<T>::to_float2(k1.x), b1 = Vec<T>::to_float2(k1.y),
             b2 = Vec<T>::to_float2(k1.z), b3 = Vec<T>::to_float2(k1.w);
#pragma unroll
      for (int i = 0; i < ROWS_PER_WARP; ++i) {
        int r = warp + i * kWarps;
        if (r < num_rows) {
          uint4 qv = *reinterpret_cast<const uint4*>(q_s + r * D + ch * 8);
          float2 q0 = Vec<T>::to_float2(qv.x), q1 = Vec<T>::to_float2(qv.y),
                 q2 = Vec<T>::to_float2(qv.z), q3 = Vec<T>::to_float2(qv.w);
          s[i][0] += q0.x * a0.x + q0.y * a0.y + q1.x * a1.x + q1.y * a1.y + q2.x * a2.x +
                     q2.y * a2.y + q3.x * a3.x + q3.y * a3.y;
          s[i][1] += q0.x * b0.x + q0.y * b0.y + q1.x * b1.x + q1.y * b1.y + q2.x * b2.x +
                     q2.y * b2.y + q3.x * b3.x + q3.y * b3.y;
        }
      }
    }

    const int base = tile * kTileN;
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
      int r = warp + i * kWarps;
      if (r >= num_rows) continue;  // warp-uniform
      float* pr = p_s + r * kTileN;
      int bound = min(limit[i], kv_len) - base;  // keys j < bound are visible
      float x0 = lane < bound ? s[i][0] * p.scale_log2 : -INFINITY;
      float x1 = lane + 32 < bound ? s[i][1] * p.scale_log2 : -INFINITY;
      float m_new = fmaxf(m_run[i], warp_max(fmaxf(x0, x1)));
      float alpha = m_new == -INFINITY ? 1.f : exp2f(m_run[i] - m_new);
      float p0 = m_new == -INFINITY ? 0.f : exp2f(x0 - m_new);
      float p1 = m_new == -INFINITY ? 0.f : exp2f(x1 - m_new);
      m_run[i] = m_new;
      l_run[i] = l_run[i] * alpha + p0 + p1;
#pragma unroll
      for (int d = 0; d < kDpl; ++d) o_acc[i][d] *= alpha;
      pr[lane] = p0;
      pr[lane + 32] = p1;
    }
    __syncwarp();

#pragma unroll 4
    for (int j = 0; j < kTileN; ++j) {
      float vf[kDpl];
      const T* vr = vt + j * kRow + lane * kDpl;
#pragma unroll
      for (int d = 0; d < kDpl; d += 2) {
        float2 f = Vec<T>::to_float2(*reinterpret_cast<const uint32_t*>(vr + d));
        vf[d] = f.x;
        vf[d + 1] = f.y;
      }
#pragma unroll
      for (int i = 0; i < ROWS_PER_WARP; ++i) {
        int r = warp + i * kWarps;
        if (r < num_rows) {
          float pj = p_s[r * kTileN + j];
#pragma unroll
          for (int d = 0; d < kDpl; ++d) o_acc[i][d] += pj * vf[d];
        }
      }
    }
    __syncthreads();  // the stage is refilled next iteration
  }

#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    int r = warp + i * kWarps;
    if (r >= num_rows) continue;
    float l = warp_sum(l_run[i]);
    float inv = l > 0.f ? 1.f / l : 0.f;
    const int rs = p.group_div.div(r);
    int slot = slot0 + rs;
    int head = kv_head * g + (r - rs * g);
    int dst = slot_dst(p, slot);
    T* o = dst < 0 ? static_cast<T*>(p.out) + p.q_tokens[slot] * p.o_stride_t + head * p.o_stride_h
                   : static_cast<T*>(p.partial_o) + (static_cast<int64_t>(dst) * p.num_qo_heads + head) * D;
#pragma unroll
    for (int d = 0; d < kDpl; ++d) o[lane * kDpl + d] = Vec<T>::from_float(o_acc[i][d] * inv);
    // m_run is in log2 units: lse = ln(sum exp(scale * qk)) = (m + log2(l)) * ln(2).
    if (dst >= 0 && lane == 0)
      p.partial_lse[static_cast<int64_t>(dst) * p.num_qo_heads + head] =
          l > 0.f ? (m_run[i] + log2f(l)) * 0.69314718055994531f : -INFINITY;
  }
}

template <typename T, int D, int ROWS_PER_WARP>
__global__ void __launch_bounds__(detail::kThreads) forward_kernel(const ForwardParams p) {
  const detail::ChainLink chain(p);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const detail::WorkRange range(p);
  if (static_cast<int>(blockIdx.x) >= range.total) return;
  for (detail::PairPos q = range.first(); q.w < range.total; range.advance(q)) {
    forward_item<T, D, ROWS_PER_WARP>(p, range.begin + q.idx, q.head, smem_raw);
    __syncthreads();  // shared memory is reused by the next pair
  }
}

namespace detail {
// One warp merges one (token, head): merge_kernel's path for small merges (a warp per pair of
// the plan) and, inside a block, for tokens with more than kMergeMaxPartials partial rows.
// Lane owns D / 32 contiguous dims. The token's partials go 32 at a time: lane j loads partial
// j's row index and log-sum-exp (one round trip for all of them), then the warp reads
// kMergeUnroll rows at once (index and weight passed by shuffle), so a token with n partials
// waits on about 3 + n / kMergeUnroll dependent loads instead of n.
constexpr int kMergeUnroll = 8;
// The plan's side of a (token, head) merge: the token's partial rows merge_partials[begin ..
// end) and lane j's row index of the first 32 of them. Plan arrays only, so a chained merge
// loads it before it waits for the forward launches (merge_kernel).
struct MergeRows {
  int begin, end, row0;
  __device__ __forceinline__ void load(const MergeParams& p, int i, int lane) {
    begin = p.merge_indptr[i];
    end = p.merge_indptr[i + 1];
    row0 = begin + lane < end ? p.merge_partials[begin + lane] : 0;
  }
};
template <typename T, int D>
__device__ __forceinline__ void merge_head_warp(const MergeParams& p, int i, int h, int lane,
                                                const MergeRows& mr) {
  constexpr int kDpl = D / 32;
  constexpr unsigned kAll = 0xffffffffu;
  const int begin = mr.begin, end = mr.end;
  // Pass 1: the max log-sum-exp; the first 32 partials' indices and lse stay in registers.
  float m = -INFINITY, lse0 = -INFINITY;
  int row0 = 0;
  for (int j = begin + lane; j < end; j += 32) {
    const int r = j < begin + 32 ? mr.row0 : p.merge_partials[j];
    const float x = __ldcg(p.partial_lse + static_cast<int64_t>(r) * p.num_qo_heads + h);
    if (j < begin + 32) row0 = r, lse0 = x;
    m = fmaxf(m, x);
  }
  m = warp_max(m);
  float acc[kDpl];
#pragma unroll
  for (int d = 0; d < kDpl; ++d) acc[d] = 0.f;
  float wsum = 0.f;
  if (m != -INFINITY) {
    for (int base = begin; base < end; base += 32) {
      int r = row0;
      float x = lse0;
      if (base != begin) {  // tokens of more than 32 partials: reload this chunk's
        const int j = base + lane;
        r = j < end ? p.merge_partials[j] : 0;
        x = j < end ? __ldcg(p.partial_lse + static_cast<int64_t>(r) * p.num_qo_heads + h) : -INFINITY;
      }
      const float w = x == -INFINITY ? 0.f : __expf(x - m);  // 0 past the token's partials
      wsum += w;
      const int cnt = min(32, end - base);
      for (int k0 = 0; k0 < cnt; k0 += kMergeUnroll) {
        uint32_t v[kMergeUnroll][kDpl / 2];
        float wk[kMergeUnroll];
#pragma unroll
        for (int u = 0; u < kMergeUnroll; ++u) {
          const int k = k0 + u;
          const int rk = __shfl_sync(kAll, r, k & 31);
          wk[u] = __shfl_sync(kAll, w, k & 31);
          const uint32_t* src = reinterpret_cast<const uint32_t*>(
              static_cast<const T*>(p.partial_o) + (static_cast<int64_t>(rk) * p.num_qo_heads + h) * D +
              lane * kDpl);
#pragma unroll
          for (int d = 0; d < kDpl / 2; ++d) v[u][d] = k < cnt ? __ldcg(src + d) : 0u;
          if (k >= cnt) wk[u] = 0.f;
        }
#pragma unroll
        for (int u = 0; u < kMergeUnroll; ++u) {
#pragma unroll
          for (int d = 0; d < kDpl / 2; ++d) {
            const float2 f = Vec<T>::to_float2(v[u][d]);
            acc[2 * d] += wk[u] * f.x;
            acc[2 * d + 1] += wk[u] * f.y;
          }
        }
      }
    }
  }
  wsum = warp_sum(wsum);
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* o = static_cast<T*>(p.out) + p.merge_tokens[i] * p.o_stride_t + h * p.o_stride_h + lane * kDpl;
#pragma unroll
  for (int d = 0; d < kDpl; ++d) o[d] = Vec<T>::from_float(acc[d] * inv);
}
}  // namespace detail

// Partial rows per token and query heads that the block path of merge_kernel keeps in shared
// memory (16 KB of weights at most, under the 48 KB that needs no opt-in).
constexpr int kMergeMaxPartials = 16;
constexpr int kMergeMaxHeads = 256;
constexpr int kMergeThreads = 256;
constexpr int kMergeBlockUnroll = 4;  // partial rows read at once by the block path
inline int merge_smem_bytes(int num_qo_heads) {
  return num_qo_heads <= kMergeMaxHeads ? kMergeMaxPartials * (num_qo_heads + 1) * 4 : 0;
}

// Two ways through one launch, chosen for the whole grid from the plan's merge token count:
// - Few tokens (every (token, head) has a warp of the grid): a warp per (token, head), the
//   most loads in flight at once (merge_head_warp).
// - Otherwise a block per token, grid-stride over counts[kCountMergeTokens]; a fixed grid
//   runs any plan. The dependent loads (the token's partial row indices, their log-sum-exps,
//   then the rows) are paid once for all its heads:
//   1. the partial row indices into shared memory;
//   2. a thread per head: the max of the head's fp32 log-sum-exps and the normalised weights
//      exp(lse - max) / sum into shared memory (0 where no partial saw a key);
//   3. a thread per 8 contiguous elements of the token's [heads, D] output: the weighted sum
//      of the partial rows (q's dtype, 16-byte loads, kMergeBlockUnroll partials per step) in fp32,
//      written in q's dtype.
//   A token with more than kMergeMaxPartials partials (or more than kMergeMaxHeads heads)
//   takes the warp-per-head path within its block.
template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const MergeParams p) {
  // The plan's arrays (counts, token bounds, partial row indices) were written before the
  // run's first launch, so the merge reads them at once; it waits for the forward launches
  // (chain_wait_prev) only before its first partial row or log-sum-exp.
  const int hq = p.num_qo_heads;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr int kWarps = kMergeThreads / 32;
  const int total = p.counts[p.finish ? kCountMergeOpen : kCountMergeTokens];
  const int grid_warps = static_cast<int>(gridDim.x) * kWarps;
  if (static_cast<int64_t>(total) * hq <= grid_warps) {
    const int w = static_cast<int>(blockIdx.x) * kWarps + warp;
    detail::MergeRows mr;
    if (w < total * hq) mr.load(p, w / hq, lane);
    detail::chain_wait_prev();  // the forward launches have written every partial row
    if (w < total * hq) detail::merge_head_warp<T, D>(p, w / hq, w % hq, lane, mr);
    return;
  }
  extern __shared__ __align__(16) unsigned char merge_smem[];
  float* const wts = reinterpret_cast<float*>(merge_smem);                 // [partials][hq]
  int* const rows = reinterpret_cast<int*>(wts + kMergeMaxPartials * hq);  // [partials]
  const int64_t elems = static_cast<int64_t>(hq) * D;
  // The block's first token's row indices, before the wait.
  const int first = blockIdx.x;
  if (first < total) {
    const int begin = p.merge_indptr[first];
    const int n = p.merge_indptr[first + 1] - begin;
    if (tid < n && n <= kMergeMaxPartials && hq <= kMergeMaxHeads)
      rows[tid] = p.merge_partials[begin + tid];
  }
  detail::chain_wait_prev();  // the forward launches have written every partial row
  for (int i = first; i < total; i += gridDim.x) {
    const int begin = p.merge_indptr[i];
    const int n = p.merge_indptr[i + 1] - begin;
    if (n > kMergeMaxPartials || hq > kMergeMaxHeads) {
      for (int h = warp; h < hq; h += kWarps) {
        detail::MergeRows mr;
        mr.load(p, i, lane);
        detail::merge_head_warp<T, D>(p, i, h, lane, mr);
      }
      continue;
    }
    if (i != first) {
      __syncthreads();  // the previous token is done with the weights
      if (tid < n) rows[tid] = p.merge_partials[begin + tid];
    }
    __syncthreads();
    for (int h = tid; h < hq; h += kMergeThreads) {
      // The head's log-sum-exps (independent loads) into its weight column, then the weights.
      float m = -INFINITY;
      for (int j = 0; j < n; ++j) {
        const float x = __ldcg(p.partial_lse + static_cast<int64_t>(rows[j]) * hq + h);
        wts[j * hq + h] = x;
        m = fmaxf(m, x);
      }
      float sum = 0.f;
      for (int j = 0; j < n; ++j) {
        const float w = m == -INFINITY ? 0.f : __expf(wts[j * hq + h] - m);
        wts[j * hq + h] = w;
        sum += w;
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int j = 0; j < n; ++j) wts[j * hq + h] *= inv;
    }
    __syncthreads();
    const int64_t tok = p.merge_tokens[i];
    for (int e = tid * 8; e < elems; e += kMergeThreads * 8) {
      const int h = e / D;
      const T* const src = static_cast<const T*>(p.partial_o) + e;
      float acc[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = 0.f;
      // kMergeBlockUnroll partial rows per step, their loads issued together.
      for (int j = 0; j < n; j += kMergeBlockUnroll) {
        uint4 x[kMergeBlockUnroll];
        float w[kMergeBlockUnroll];
#pragma unroll
        for (int u = 0; u < kMergeBlockUnroll; ++u) {
          const bool ok = j + u < n;
          const int jj = ok ? j + u : n - 1;  // stays inside the token's rows and weights
          x[u] = ok ? __ldcg(reinterpret_cast<const uint4*>(src + rows[jj] * elems)) : make_uint4(0, 0, 0, 0);
          w[u] = ok ? wts[jj * hq + h] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < kMergeBlockUnroll; ++u) {
          const uint32_t a[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float2 f = detail::Vec<T>::to_float2(a[k]);
            acc[2 * k] += w[u] * f.x;
            acc[2 * k + 1] += w[u] * f.y;
          }
        }
      }
      alignas(16) T vals[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) vals[k] = detail::Vec<T>::from_float(acc[k]);
      T* const dst = static_cast<T*>(p.out) + tok * p.o_stride_t + h * p.o_stride_h + (e - h * D);
      if (p.vec_out) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(vals);
      } else {
#pragma unroll
        for (int k = 0; k < 8; k += 2)
          *reinterpret_cast<uint32_t*>(dst + k) = *reinterpret_cast<const uint32_t*>(vals + k);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core forward (mma.sync m16n8k16, fp32 accumulate), head_dim 64 and 128.
//
// WARPS warps = RB row blocks x KS key splits. Warp w computes query rows 16 * (w / KS) ..
// +15 against keys (w % KS) * 64 / KS .. of every 64-token tile; the KS warps of a row block
// keep separate softmax states and combine them through shared memory at the end (so an item
// with 16 rows keeps 4 warps computing). q stays in registers as A fragments; K fragments come
// from ldmatrix.x4, V fragments from ldmatrix.x4.trans; probabilities stay in registers (the S
// accumulators of two key blocks are the A fragment of P.V). Fragment layouts (PTX ISA,
// m16n8k16): A a0 = (row l/4, cols 2(l%4)+{0,1}), a1 = row+8, a2 = cols+8, a3 = both;
// B b0 = (k 2(l%4)+{0,1}, n l/4), b1 = k+8; C c0,c1 = (row l/4, cols 2(l%4)+{0,1}), c2,c3 = row+8.
namespace detail {
template <typename T>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<half>(float* c, const uint32_t* a, uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<half>(float x, float y) {
  __half2 v = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
}  // namespace detail

template <int D, int WARPS, int KS, int STAGES>
constexpr int forward_mma_smem_bytes() {
  // KV stages. The key-split combine (WARPS x 32 lanes x (D/2 + 4) floats = 256 (D + 8) B
  // for 4 warps, one stage) goes through the stage whose tile was just computed.
  static_assert(KS == 1 || WARPS * 32 * (D / 2 + 4) * 4 <= 2 * detail::kTileN * (D + detail::kPad) * 2,
                "the key-split combine must fit in one KV stage");
  return STAGES * 2 * detail::kTileN * (D + detail::kPad) * 2;
}

namespace detail {
// bar.sync on named barrier `id` for `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The copy side's position in its pair stream. k_base / v_base (the pair's first KV head)
// include the thread's column `col`. The next pair's KV length and page offset are fetched
// one pair ahead, so moving on to a pair never waits on them.
template <typename T>
struct PairCursor {
  PairPos pos;
  int kv_len, head_tiles;  // tiles per KV head, >= 1: an empty item still runs a masked tile
  const int32_t* pages;
  const T* k_base;
  const T* v_base;
  int next_len, next_page0;  // of the pair after pos, when there is one

  __device__ __forceinline__ void first(const ForwardParams& p, const WorkRange& range,
                                        int col) {
    pos = range.first();
    const int item = range.begin + pos.idx;
    set(p, range, p.kv_len[item], p.kv_page_indptr[item], col);
    fetch_next(p, range);
  }
  // Moves to the next pair; false past the last one.
  __device__ __forceinline__ bool next(const ForwardParams& p, const WorkRange& range, int col) {
    range.advance(pos);
    if (pos.w >= range.total) return false;
    set(p, range, next_len, next_page0, col);
    fetch_next(p, range);
    return true;
  }

 private:
  __device__ __forceinline__ void set(const ForwardParams& p, const WorkRange& range, int len,
                                      int page0, int col) {
    kv_len = len;
    head_tiles = max(1, (kv_len + kTileN - 1) / kTileN);
    pages = p.kv_pages + page0;
    const int kv_head = pos.head * range.heads;
    k_base = static_cast<const T*>(p.k) + kv_head * p.k_stride_head + col;
    v_base = static_cast<const T*>(p.v) + kv_head * p.v_stride_head + col;
  }
  __device__ __forceinline__ void fetch_next(const ForwardParams& p, const WorkRange& range) {
    fetch_pair_after(p, range, pos, next_len, next_page0);
  }
};

// The copy side of the tensor-core forwards: streams the KV tiles of a block's pairs, one
// after another, into STAGES shared-memory stages, one cp.async commit group per tile (an
// empty group once the stream ends). Thread-fixed: the keys row0 + i * step (i < ROWS) of
// each tile, the 8 elements at column `col` of each row, written at element offset
// dst0 + i * dst_step of a stage's K and V tiles (the kernel's layout); a pair with packed heads
// streams its first KV head's tiles, then the next head's, and so on. The page ids of the
// next tile are loaded one copy ahead, so a copy never waits on them. A row's source is one
// wide 32 x 32-bit multiply (page id x page stride) plus a 32-bit in-page offset: page and
// token strides fit in 32 bits, and so does a page's span (checked on the host); its shared
// address is 32-bit, formed once per tile.
// SLICE: the keys one warp computes of a tile. A warp skips its slice when the slice starts at
// or past the item's end, so rows past the item's length rounded up to SLICE are never read
// and are not copied; the rows before that past the end are zero-filled (masked keys carry
// V = 0, never NaN). An empty item still gets its first slice of zeros.
// kEvictFirst: the copies carry an L2 evict-first policy, for launches whose items rarely
// share pages (docs/kernel-notes.md v46); the `wgmma` producer, whose 128-row items are often
// row chunks of one node reading the same pages, keeps the default.
template <typename T, int ROWS, int SLICE, bool kEvictFirst = false, bool kSmemPages = false>
struct KvCopier {
  PairCursor<T> ld;
  int tile, sub, stage;  // tile within the KV head, KV head within the pair
  bool done;
  int row0, step, col, dst0, dst_step;
  int pg[ROWS];
  // kSmemPages: the current pair's first spg_cap page ids, staged in shared memory by the
  // spg_threads copying threads (named barrier 2) when the pair starts, so a tile's page ids
  // are a shared-memory load instead of a global one (docs/kernel-notes.md v62). spg ==
  // nullptr: every page id from global memory.
  int32_t* spg = nullptr;
  int spg_cap = 0, spg_threads = 0, spg_n = 0;

  __device__ __forceinline__ void start(const ForwardParams& p, const WorkRange& range) {
    ld.first(p, range, col);
    tile = 0;
    sub = 0;
    stage = 0;
    done = false;
    stage_pages(p);
    if (p.page_shift >= 0)
      load_pages<true>(p);
    else
      load_pages<false>(p);
  }
  // The pair's page ids [0, min(pages, spg_cap)) into spg, by the spg_threads copying threads.
  __device__ __forceinline__ void stage_pages(const ForwardParams& p) {
    if constexpr (!kSmemPages) return;
    if (spg == nullptr) return;
    named_barrier_sync(2, spg_threads);  // every thread is done with the previous pair's ids
    const int n = p.page_shift >= 0 ? (ld.kv_len + p.page_size - 1) >> p.page_shift
                                    : (ld.kv_len + p.page_size - 1) / p.page_size;
    spg_n = min(n, spg_cap);
    for (int i = static_cast<int>(threadIdx.x); i < spg_n; i += spg_threads) spg[i] = ld.pages[i];
    named_barrier_sync(2, spg_threads);
  }
  template <bool kPow2>
  __device__ __forceinline__ void load_pages(const ForwardParams& p) {
    const int pos0 = tile * kTileN + row0;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int pos = pos0 + i * step;
      const int idx = kPow2 ? pos >> p.page_shift : p.page_div.div(pos);
      if constexpr (kSmemPages)
        pg[i] = pos < ld.kv_len ? (idx < spg_n ? spg[idx] : ld.pages[idx]) : 0;
      else
        pg[i] = pos < ld.kv_len ? ld.pages[idx] : 0;
    }
  }
  template <bool kPow2>
  __device__ __forceinline__ void copy_rows(const ForwardParams& p, T* kd, T* vd) {
    const uint32_t spk = static_cast<uint32_t>(p.k_stride_page);
    const uint32_t spv = static_cast<uint32_t>(p.v_stride_page);
    const int stk = static_cast<int>(p.k_stride_tok), stv = static_cast<int>(p.v_stride_tok);
    const int pos0 = tile * kTileN + row0;
    const int needed = (max(ld.kv_len, 1) + SLICE - 1) / SLICE * SLICE;
    const uint32_t ks = static_cast<uint32_t>(__cvta_generic_to_shared(kd + dst0));
    const uint32_t vs = static_cast<uint32_t>(__cvta_generic_to_shared(vd + dst0));
    const uint64_t pol = kEvictFirst ? l2_evict_first_policy() : 0;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int pos = pos0 + i * step;
      // A slice of a whole tile: every row of the item's tiles is read (no check needed).
      if constexpr (SLICE < kTileN)
        if (pos >= needed) continue;
      const bool valid = pos < ld.kv_len;
      const int slot = kPow2 ? pos & (p.page_size - 1) : p.page_div.mod(pos);
      const uint32_t page = static_cast<uint32_t>(pg[i]);
      const T* ksrc = ld.k_base + (static_cast<uint64_t>(page) * spk + static_cast<uint32_t>(slot * stk));
      const T* vsrc = ld.v_base + (static_cast<uint64_t>(page) * spv + static_cast<uint32_t>(slot * stv));
      const uint32_t off = static_cast<uint32_t>(i * dst_step * sizeof(T));
      if constexpr (kEvictFirst) {
        cp_async_16(ks + off, ksrc, valid, pol);
        cp_async_16(vs + off, vsrc, valid, pol);
      } else {
        cp_async_16(ks + off, ksrc, valid);
        cp_async_16(vs + off, vsrc, valid);
      }
    }
  }
  // Copies the next tile of the stream into stage `stage` of k_s / v_s (stage_elems apart).
  template <int D, int STAGES, int THREADS>
  __device__ __forceinline__ void issue(const ForwardParams& p, const WorkRange& range, T* k_s,
                                        T* v_s, int stage_elems) {
    if (!done) {
      T* const kd = k_s + stage * stage_elems;
      T* const vd = v_s + stage * stage_elems;
      if (p.page_shift >= 0)
        copy_rows<true>(p, kd, vd);
      else
        copy_rows<false>(p, kd, vd);
      if (p.prefetch_tiles > 0) {
        // One K or V row (D * 2 bytes) per thread, prefetch_tiles tiles ahead in this KV head.
        const int pt = tile + p.prefetch_tiles;
        for (int r = threadIdx.x; r < 2 * kTileN; r += THREADS) {
          const int pos = pt * kTileN + (r >> 1);
          if (pos >= ld.kv_len) break;
          const T* src = (r & 1) ? ld.v_base - col + kv_offset(ld.pages, pos, p.page_size,
                                                               p.page_shift, p.v_stride_page,
                                                               p.v_stride_tok)
                                 : ld.k_base - col + kv_offset(ld.pages, pos, p.page_size,
                                                               p.page_shift, p.k_stride_page,
                                                               p.k_stride_tok);
          prefetch_l2(src, D * sizeof(T));
        }
      }
      if (++tile == ld.head_tiles) {
        tile = 0;
        if (++sub == range.heads) {
          sub = 0;
          done = !ld.next(p, range, col);
          if (!done) stage_pages(p);
        } else {
          ld.k_base += p.k_stride_head;
          ld.v_base += p.v_stride_head;
        }
      }
      if (!done) {
        if (p.page_shift >= 0)
          load_pages<true>(p);
        else
          load_pages<false>(p);
      }
    }
    cp_async_commit();
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
};

// The pair's query slots and KV run: the item's rows (tokens x group) for each of the pair's
// KV heads kv_head .. kv_head + heads - 1, stacked head after head in num_rows tile rows.
struct PairDesc {
  int kv_head, slot0, item_rows, num_rows, kv_len, kv_start;
  __device__ __forceinline__ void load(const ForwardParams& p, const WorkRange& range,
                                       const PairPos& pos) {
    const int item = range.begin + pos.idx;
    kv_head = pos.head * range.heads;
    slot0 = p.q_indptr[item];
    item_rows = (p.q_indptr[item + 1] - slot0) * p.group_size;
    num_rows = item_rows * range.heads;
    kv_len = p.kv_len[item];
    kv_start = p.kv_start[item];
  }
};

// What a lane's two rows (r0 and r0 + 8) of a pair need from their slots: the causal bound
// (q_limit), where the row goes (q_out), its token (q_tokens), its query head and which of the
// pair's KV heads it belongs to (`sub`). Loaded a pair ahead, so the pair's masking and
// epilogue never wait on them. A row past the pair's rows sees no key.
struct RowSlots {
  int qlim[2], dst[2], tok[2], head[2], sub[2];
  __device__ __forceinline__ void load(const ForwardParams& p, const PairDesc& d, int r0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int r = r0 + 8 * h;
      if (r < d.num_rows) {
        const int s = d.num_rows > d.item_rows ? r / d.item_rows : 0;  // packed heads
        r -= s * d.item_rows;
        const int t = p.group_div.div(r);
        const int slot = d.slot0 + t;
        qlim[h] = p.q_limit[slot];
        dst[h] = slot_dst(p, slot);
        tok[h] = p.q_tokens[slot];
        head[h] = (d.kv_head + s) * p.group_size + r - t * p.group_size;
        sub[h] = s;
      } else {
        qlim[h] = d.kv_start;
        dst[h] = -1;
        tok[h] = 0;
        head[h] = 0;
        sub[h] = -1;
      }
    }
  }
  // Keys of the item row r0 + 8 h sees.
  __device__ __forceinline__ int limit(const PairDesc& d, int h) const {
    return min(qlim[h] - d.kv_start, d.kv_len);
  }
};

// q A-fragments of one 16-row block (rows r0 = 16 rb + lane / 4 and r0 + 8), zero past the
// item's rows.
template <typename T, int kKC>
__device__ __forceinline__ void load_q_frags(const ForwardParams& p, const PairDesc& d,
                                             const RowSlots& rs, int rb, uint32_t (&qa)[kKC][4]) {
  const int lane = threadIdx.x & 31;
  const int r0 = rb * 16 + lane / 4, r1 = r0 + 8, qc = 2 * (lane % 4);
  const T* q0 = nullptr;
  const T* q1 = nullptr;
  if (r0 < d.num_rows)
    q0 = static_cast<const T*>(p.q) + rs.tok[0] * p.q_stride_t + rs.head[0] * p.q_stride_h + qc;
  if (r1 < d.num_rows)
    q1 = static_cast<const T*>(p.q) + rs.tok[1] * p.q_stride_t + rs.head[1] * p.q_stride_h + qc;
#pragma unroll
  for (int kc = 0; kc < kKC; ++kc) {
    qa[kc][0] = q0 ? *reinterpret_cast<const uint32_t*>(q0 + kc * 16) : 0u;
    qa[kc][1] = q1 ? *reinterpret_cast<const uint32_t*>(q1 + kc * 16) : 0u;
    qa[kc][2] = q0 ? *reinterpret_cast<const uint32_t*>(q0 + kc * 16 + 8) : 0u;
    qa[kc][3] = q1 ? *reinterpret_cast<const uint32_t*>(q1 + kc * 16 + 8) : 0u;
  }
}

// Epilogue of one warp's 16 rows (r0 = 16 rb + lane / 4 and r0 + 8) in the tensor-core
// kernels: o holds D / 2 accumulators (n8 block db at o[4 db .. 4 db + 3], rows r0 and r0 + 8
// in its halves), m and l the rows' softmax state over the lane's keys (summed over the 4
// lanes of a row here). The normalised row goes out in T: to the output for a slot with
// q_out == -1, else to its partial row, with the fp32 natural-log log-sum-exp beside it.
template <typename T, int D>
__device__ __forceinline__ void store_rows(const ForwardParams& p, int lane, const RowSlots& rs,
                                           int num_rows, int r0, const float* o, float m0,
                                           float m1, float l0, float l1) {
  const int qc = 2 * (lane % 4);
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r >= num_rows) continue;
    const float l = h ? l1 : l0, m = h ? m1 : m0;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int head = rs.head[h];
    const int dst = rs.dst[h];
    T* out = dst < 0 ? static_cast<T*>(p.out) + rs.tok[h] * p.o_stride_t + head * p.o_stride_h
                     : static_cast<T*>(p.partial_o) + (static_cast<int64_t>(dst) * p.num_qo_heads + head) * D;
#pragma unroll
    for (int db = 0; db < D / 8; ++db)
      *reinterpret_cast<uint32_t*>(out + db * 8 + qc) =
          pack2<T>(o[4 * db + 2 * h] * inv, o[4 * db + 2 * h + 1] * inv);
    if (dst >= 0 && lane % 4 == 0)
      p.partial_lse[static_cast<int64_t>(dst) * p.num_qo_heads + head] =
          l > 0.f ? (m + log2f(l)) * 0.69314718055994531f : -INFINITY;
  }
}
}  // namespace detail

// Persistent and pipelined across pairs: the block's pairs form one stream of KV tiles, and
// the copies run STAGES - 1 tiles ahead of the math across pair boundaries, so a pair of one
// tile (a short leaf) costs its bytes, not a round of dependent loads. With key splits (the
// 16- and 32-row tiles) the next pair's q fragments are fetched into registers while the
// current pair computes. The 16-row kernel may run several KV heads of an item as one pair
// (counts[kCountPackedHeads]): rows stacked head after head, one head's tiles after another.
template <typename T, int D, int WARPS, int KS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) forward_mma_kernel(const ForwardParams p) {
  using namespace detail;
  const ChainLink chain(p);
  constexpr int kRow = D + kPad;
  constexpr int kChunks = D / 8;
  constexpr int kThreadsM = WARPS * 32;
  constexpr int kKeys = kTileN / KS;  // keys per warp per tile
  constexpr int kNB = kKeys / 8;      // key blocks of 8 per warp
  constexpr int kDB = D / 8;          // output dim blocks of 8
  constexpr int kKC = D / 16;         // k-chunks of q.k
  constexpr bool kPrefetchQ = WARPS <= 4 && KS > 1;  // KS = 1 would spill with it
  constexpr bool kPacksHeads = WARPS == KS;           // one 16-row block: the 16-row tiles
  static_assert(kKeys % 16 == 0, "a warp's keys must fill whole k16 chunks of P.V");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Stage s holds K rows then V rows of one tile: [STAGES][2][kTileN][kRow].
  T* const kv_s = reinterpret_cast<T*>(smem_raw);
  auto k_stage = [&](int st) { return kv_s + st * 2 * kTileN * kRow; };
  auto v_stage = [&](int st) { return kv_s + (st * 2 + 1) * kTileN * kRow; };

  const WorkRange range(p, kPacksHeads);
  if (static_cast<int>(blockIdx.x) >= range.total) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rb = warp / KS, ks = warp % KS;
  const int qc = 2 * (lane % 4);
  const int key0 = ks * kKeys;  // this warp's first key within a tile

  // ---- loads: thread tid copies chunk tid % kChunks of keys tid / kChunks + i kLdStep.
  constexpr int kLdStep = kThreadsM / kChunks;  // rows per pass; a thread keeps its column
  constexpr int kLdRows = kTileN / kLdStep;     // rows per thread per tile
  KvCopier<T, kLdRows, kKeys, /*kEvictFirst=*/true> cp;  // items of <= 64 rows: read-once KV
  cp.row0 = tid / kChunks;
  cp.step = kLdStep;
  cp.col = (tid % kChunks) * 8;
  cp.dst0 = cp.row0 * kRow + cp.col;
  cp.dst_step = kLdStep * kRow;
  cp.start(p, range);
  auto issue_next = [&]() {
    cp.template issue<D, STAGES, kThreadsM>(p, range, k_stage(0), v_stage(0), 2 * kTileN * kRow);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_next();

  // ---- math. The next pair's descriptor is fetched when a pair starts, its row slots (and,
  // with key splits, its q fragments) when the pair's tiles are done.
  const int r0 = rb * 16 + lane / 4;
  PairDesc cur, nxt;
  RowSlots rs, nrs;
  PairPos npos = range.first();  // the pair after the current one, once advanced
  cur.load(p, range, npos);
  rs.load(p, cur, r0);
  uint32_t qa[kKC][4];
  uint32_t qa_next[kPrefetchQ ? kKC : 1][4];
  load_q_frags<T, kKC>(p, cur, rs, rb, qa);
  int stage = 0;
  for (int w = blockIdx.x; w < range.total; w += gridDim.x) {
    if (w != static_cast<int>(blockIdx.x)) {
      cur = nxt;
      rs = nrs;
      if constexpr (kPrefetchQ) {
#pragma unroll
        for (int kc = 0; kc < kKC; ++kc)
#pragma unroll
          for (int e = 0; e < 4; ++e) qa[kc][e] = qa_next[kc][e];
      } else {
        load_q_frags<T, kKC>(p, cur, rs, rb, qa);
      }
    }
    const int lim0 = rs.limit(cur, 0), lim1 = rs.limit(cur, 1);
    range.advance(npos);
    const bool has_next = npos.w < range.total;
    if (has_next) nxt.load(p, range, npos);
    const int num_rows = cur.num_rows;
    const int head_tiles = max(1, (cur.kv_len + kTileN - 1) / kTileN);
    const int num_tiles = head_tiles * range.heads;
    int ht = 0, tsub = 0;  // the tile within its KV head, and that head within the pair
    const bool active = rb * 16 < num_rows;  // warp-uniform
    // Keys at or past the warp's largest bound are masked for all its rows: such tiles are
    // skipped (short items in a key split, causal extends).
    const int warp_lim = __reduce_max_sync(0xffffffffu, max(lim0, lim1));
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float o[kDB][4];
#pragma unroll
    for (int i = 0; i < kDB; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    for (int tile = 0; tile < num_tiles; ++tile) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // this tile landed for everyone; the previous stage is free
      issue_next();
      const int base = ht * kTileN + key0;
      if (active && base < warp_lim) {
        const T* kt = k_stage(stage) + key0 * kRow;
        const T* vt = v_stage(stage) + key0 * kRow;
        float s[kNB][4];
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
        // ldmatrix.x4 (K): lane l addresses key (l & 7) + 8 * (l >> 4) of a 16-key pair of
        // blocks, dims +8 * ((l >> 3) & 1): results are b0, b1 of key block 2j and 2j + 1.
        const T* krow = kt + ((lane & 7) + ((lane >> 4) << 3)) * kRow + (((lane >> 3) & 1) << 3);
#pragma unroll
        for (int kc = 0; kc < kKC; ++kc) {
#pragma unroll
          for (int nb = 0; nb < kNB; nb += 2) {
            uint32_t b[4];
            ldmatrix_x4(b, krow + nb * 8 * kRow + kc * 16);
            mma16816<T>(s[nb], qa[kc], b[0], b[1]);
            mma16816<T>(s[nb + 1], qa[kc], b[2], b[3]);
          }
        }
        // Rows of the pair's other KV heads see no key of this tile.
        const int b0 = (rs.sub[0] == tsub ? lim0 : 0) - base;
        const int b1 = (rs.sub[1] == tsub ? lim1 : 0) - base;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            int key = nb * 8 + qc + e;
            s[nb][e] = key < b0 ? s[nb][e] * p.scale_log2 : -INFINITY;
            s[nb][2 + e] = key < b1 ? s[nb][2 + e] * p.scale_log2 : -INFINITY;
            mx0 = fmaxf(mx0, s[nb][e]);
            mx1 = fmaxf(mx1, s[nb][2 + e]);
          }
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float al0 = n0 == -INFINITY ? 1.f : exp2f(m0 - n0);
        const float al1 = n1 == -INFINITY ? 1.f : exp2f(m1 - n1);
        m0 = n0;
        m1 = n1;
        l0 *= al0;
        l1 *= al1;
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            s[nb][e] = n0 == -INFINITY ? 0.f : exp2f(s[nb][e] - n0);
            s[nb][2 + e] = n1 == -INFINITY ? 0.f : exp2f(s[nb][2 + e] - n1);
            l0 += s[nb][e];
            l1 += s[nb][2 + e];
          }
        }
#pragma unroll
        for (int db = 0; db < kDB; ++db) {
          o[db][0] *= al0;
          o[db][1] *= al0;
          o[db][2] *= al1;
          o[db][3] *= al1;
        }
#pragma unroll
        for (int kc = 0; kc < kKeys / 16; ++kc) {
          uint32_t a[4];
          a[0] = pack2<T>(s[2 * kc][0], s[2 * kc][1]);
          a[1] = pack2<T>(s[2 * kc][2], s[2 * kc][3]);
          a[2] = pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]);
          a[3] = pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3]);
          // ldmatrix.x4.trans (V): lane l addresses row l % 8 of 8x8 matrix l / 8 = (keys
          // +8 * (i & 1), dims +8 * (i >> 1)); the results are b0, b1 of two dim blocks.
          const T* vrow = vt + (kc * 16 + (lane & 8) + (lane & 7)) * kRow + ((lane >> 4) << 3);
#pragma unroll
          for (int db = 0; db < kDB; db += 2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, vrow + db * 8);
            mma16816<T>(o[db], a, b[0], b[1]);
            mma16816<T>(o[db + 1], a, b[2], b[3]);
          }
        }
      }
      if (tile + 1 < num_tiles) stage = stage + 1 == STAGES ? 0 : stage + 1;
      if (++ht == head_tiles) {
        ht = 0;
        ++tsub;
      }
    }
    if (has_next) {
      nrs.load(p, nxt, r0);
      if constexpr (kPrefetchQ) load_q_frags<T, kKC>(p, nxt, nrs, rb, qa_next);
    }

    bool writer = active;
    if constexpr (KS > 1) {
      // Combine the KS softmax states of each row block through the stage just computed (no
      // copy targets it until the next tile's barrier). Lanes hold the same fragment positions
      // in every warp, so lane l of the first warp reads lane l of the others.
      // A warp that saw no visible key (its slices start past a short item's end) has nothing
      // to add and is left out.
      constexpr int kVals = kDB * 4 + 4;
      float* red = reinterpret_cast<float*>(k_stage(stage));  // [WARPS][kVals][32]
      __shared__ int split_used[WARPS];
      __syncthreads();  // every warp is done with this stage
      const bool used =
          active && ks != 0 && __any_sync(0xffffffffu, m0 != -INFINITY || m1 != -INFINITY);
      if (lane == 0) split_used[warp] = used;
      if (used) {
        float* mine = red + warp * kVals * 32 + lane;
#pragma unroll
        for (int db = 0; db < kDB; ++db)
#pragma unroll
          for (int e = 0; e < 4; ++e) mine[(db * 4 + e) * 32] = o[db][e];
        mine[(kDB * 4 + 0) * 32] = m0;
        mine[(kDB * 4 + 1) * 32] = m1;
        mine[(kDB * 4 + 2) * 32] = l0;
        mine[(kDB * 4 + 3) * 32] = l1;
      }
      __syncthreads();
      writer = active && ks == 0;
      if (writer) {
#pragma unroll
        for (int j = 1; j < KS; ++j) {
          if (!split_used[warp + j]) continue;
          const float* other = red + (warp + j) * kVals * 32 + lane;
          const float om0 = other[(kDB * 4 + 0) * 32], om1 = other[(kDB * 4 + 1) * 32];
          const float n0 = fmaxf(m0, om0), n1 = fmaxf(m1, om1);
          // Weights of the two states (a state that saw no visible key has m = -inf, l = 0).
          const float wa0 = m0 == -INFINITY ? 0.f : exp2f(m0 - n0);
          const float wb0 = om0 == -INFINITY ? 0.f : exp2f(om0 - n0);
          const float wa1 = m1 == -INFINITY ? 0.f : exp2f(m1 - n1);
          const float wb1 = om1 == -INFINITY ? 0.f : exp2f(om1 - n1);
          l0 = l0 * wa0 + other[(kDB * 4 + 2) * 32] * wb0;
          l1 = l1 * wa1 + other[(kDB * 4 + 3) * 32] * wb1;
          m0 = n0;
          m1 = n1;
#pragma unroll
          for (int db = 0; db < kDB; ++db) {
            o[db][0] = o[db][0] * wa0 + other[(db * 4 + 0) * 32] * wb0;
            o[db][1] = o[db][1] * wa0 + other[(db * 4 + 1) * 32] * wb0;
            o[db][2] = o[db][2] * wa1 + other[(db * 4 + 2) * 32] * wb1;
            o[db][3] = o[db][3] * wa1 + other[(db * 4 + 3) * 32] * wb1;
          }
        }
      }
    }
    stage = stage + 1 == STAGES ? 0 : stage + 1;

    if (writer) store_rows<T, D>(p, lane, rs, num_rows, r0, &o[0][0], m0, m1, l0, l1);
  }
  cp_async_wait<0>();
}

}  // namespace prefixattn
