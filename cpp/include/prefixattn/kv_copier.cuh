// The copy side of the tensor-core forwards (forward_mma.cuh, forward_wgmma.cuh): a block's
// stream of pairs and its KV tiles through shared-memory stages.
#pragma once

#include "prefixattn/work.cuh"

namespace prefixattn {

namespace detail {

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

  __device__ __forceinline__ void first(const ForwardParams& p, const WorkRange& range, int col) {
    pos = range.first();
    const int item = range.begin + pos.idx;
    set(p, range, p.kv_len[item], p.kv_page_offset[item], col);
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
// share pages (docs/dev/log.md v46); the `wgmma` producer, whose 128-row items are often
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
  // are a shared-memory load instead of a global one (docs/dev/log.md v62). spg ==
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
      const T* ksrc =
          ld.k_base + (static_cast<uint64_t>(page) * spk + static_cast<uint32_t>(slot * stk));
      const T* vsrc =
          ld.v_base + (static_cast<uint64_t>(page) * spv + static_cast<uint32_t>(slot * stv));
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
          const T* src = (r & 1) ? ld.v_base - col +
                                       kv_offset(ld.pages, pos, p.page_size, p.page_shift,
                                                 p.v_stride_page, p.v_stride_tok)
                                 : ld.k_base - col +
                                       kv_offset(ld.pages, pos, p.page_size, p.page_shift,
                                                 p.k_stride_page, p.k_stride_tok);
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

}  // namespace detail

}  // namespace prefixattn
