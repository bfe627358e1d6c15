// Forward and merge kernels that execute a prefixattn LaunchPlan. Torch-free: raw pointers and
// one params struct per stage.
//
// Work: a (work item, KV head) pair. Items are grouped by query-tile height m (16, 32, 64, 128
// rows; rows = tokens x GQA group, token-major: row r -> slot r / group, q head
// kv_head * group + r % group). One launch per height ("variant") runs that group's pairs; the
// group's bounds are read from device memory (counts[kVariantBase + v ..]) unless the host
// passes them (ForwardParams::host_range), and a block loops over pairs with a grid stride, so
// a launch with a fixed grid runs any plan (CUDA-graph replay). Within a group, consecutive blocks
// take consecutive items of one KV head, so items that share KV (row chunks of one forest node) run
// side by side and meet in L2.
//
// Each pair streams its item's KV run through shared memory once (64-token tiles, STAGES-deep
// cp.async pipeline, zero-filled past the end: masked keys carry V = 0, never NaN) and computes
// every query row of the item against it. A query covered by one item gets its output written
// in q's dtype; otherwise the item writes its normalised partial row, also in q's dtype (half
// the bytes of fp32: partial rows are a large share of a deep tree's traffic), and its fp32
// natural-log log-sum-exp, and the merge kernel combines the partials in fp32.
//
// This header: the launch's work (pairs of a variant, their ranges, descriptors and row slots),
// chained-launch bookkeeping and the L2 warm-up.
#pragma once

#include "prefixattn/params.cuh"
#include "prefixattn/ptx.cuh"

namespace prefixattn {

namespace detail {

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
      asm volatile(
          "prefetch.global.L2::evict_last [%0];" ::"l"(base + static_cast<size_t>(i) * kWarmLine));
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

// KV length and first page offset of the pair after `pos` in `range` (a WorkRange or the leaf
// kernel's LeafPairs), fetched a pair ahead by the copy sides; unchanged past the last pair.
template <typename Range>
__device__ __forceinline__ void fetch_pair_after(const ForwardParams& p, const Range& range,
                                                 PairPos pos, int& len, int& page0) {
  range.advance(pos);
  if (pos.w < range.total) {
    const int item = range.begin + pos.idx;
    len = p.kv_len[item];
    page0 = p.kv_page_offset[item];
  }
}

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

}  // namespace detail

}  // namespace prefixattn
