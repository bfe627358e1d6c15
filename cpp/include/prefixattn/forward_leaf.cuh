// The leaf kernel: the 16-row variant (items of at most 16 query rows per KV head: decode
// tokens of a GQA group, short speculative runs, small shared nodes) on tensor cores, one warp
// per (item, KV head) pair. Torch-free.
//
// Why a kernel of its own: a leaf item has few query rows (4 for one decode token at group 4)
// and is bound by the bytes of its KV. The 16-row tile of forward_mma_kernel computes 16 rows
// per key whatever the item fills, splits each 64-key tile over 4 warps that meet at a block
// barrier per tile and combine their softmax states per pair. Here the products are
// transposed: S^T = K q^T with keys as the 16 rows of mma.m16n8k16 and the item's query rows
// as its 8 columns, and O^T = V^T P^T. A warp then does 8 + 8 MMAs per 16 keys of its head
// (half of the 16-row tile's), holds O^T in D / 4 registers (half), and needs no other warp:
//
// - Warp-independent streams. Each warp walks its own (item, KV head) pairs, KV head
//   fastest, with a grid stride over all warps of the launch. Its 32 lanes copy its head's KV into
//   the warp's own STAGES shared-memory stages (16 tokens per stage, cp.async, zero-filled past the
//   item's end so that masked keys carry V = 0), and the warp waits on its own copies
//   (cp.async.wait_group + __syncwarp): there is no block barrier anywhere. The copies run
//   STAGES - 1 tiles ahead of the math across pair boundaries; the copier fetches a pair's KV
//   length and page offset two pairs ahead, and the math side's loads of a pair (descriptor,
//   slot data, q fragments) run one round per pair, three, two and one pairs ahead.
// - Columns are the item's query rows (tokens x group, token-major): one block of 8 columns
//   for items of up to 8 rows, two blocks (twice the MMAs and O^T registers, the same K and V
//   fragments) for 9-16 rows; a warp-uniform branch per pair picks the instantiation.
// - S^T fragments hold (key g, rows 2t, 2t + 1) and (key g + 8, ...) for lane l = 4g + t, and
//   O^T fragments (dim g, rows 2t, 2t + 1): the softmax state of rows 2t, 2t + 1 is
//   lane-local, the row maximum a reduction over the 8 lanes of equal t. P^T, the B operand of
//   O^T += V^T P^T, is the S^T fragment packed to 16 bits and transposed in registers
//   (movmatrix.trans); V^T comes from ldmatrix.trans of the V rows, K from ldmatrix of the K
//   rows, q^T (the B operand of S^T) from global memory, 2 registers per 16 dims.
// - The epilogue transposes O^T back the same way, so lane l writes row l / 4: 4 bytes in
//   each 8-dim half of every 16-dim block.
#pragma once

#include "prefixattn/work.cuh"

namespace prefixattn {

constexpr int kLeafWarps = 4;
constexpr int kLeafTokens = 16;  // KV tokens per stage and warp

// A stage holds K rows then V rows of 16 tokens, D halfs each with no padding; the 16-byte
// chunk c of row r lies at chunk c ^ (r % 8) of its row (an XOR swizzle). So the ldmatrix rows
// of one 8x8 matrix fall in different banks, and the two 16-byte halves of every 32-byte sector
// a copy reads from global memory land in one 32-byte sector of shared memory: padded rows
// (D + 8 halfs: every other row 16 bytes past a sector boundary) made the L1 fetch each of
// those rows' sectors twice, 1.5 times the KV bytes from the L2 (docs/dev/log.md v54).
// A block still asks for 16 bytes per stage row more than its stages use (kLeafSmemReserve),
// the size the padded rows had: two blocks of the 3-stage forms (three of the short form)
// then fill an SM's shared memory, and no block of another launch is placed beside them (v54:
// without the reserve, 6 configurations ran x1.04-1.15 slower).
constexpr int kLeafSmemReserve = 8;  // halfs per stage row
template <int D, int STAGES>
constexpr int forward_leaf_smem_bytes() {
  return kLeafWarps * STAGES * 2 * kLeafTokens * (D + kLeafSmemReserve) * 2;
}

namespace detail {

// A warp's stream of (item, KV head) pairs of the 16-row variant: pair w = idx * num_kv_heads
// + head (head fastest, so the 4 warps of a block usually take 4 KV heads of one item and read
// neighbouring bytes of each token in NHD caches); the launch's warps take w = global warp,
// + all warps, ... (no division per step).
struct LeafPairs {
  int begin, num_items, total, heads, step_idx, step_head;
  __device__ __forceinline__ explicit LeafPairs(const ForwardParams& p) {
    launch_items(p, begin, num_items);
    heads = p.num_kv_heads;
    total = num_items > 0 ? num_items * heads : 0;
    const int warps = static_cast<int>(gridDim.x) * kLeafWarps;
    step_idx = warps / heads;
    step_head = warps % heads;
  }
  __device__ __forceinline__ PairPos first(int gwarp) const {
    return PairPos{gwarp, gwarp / heads, gwarp % heads};
  }
  __device__ __forceinline__ void advance(PairPos& q) const {
    q.w += static_cast<int>(gridDim.x) * kLeafWarps;
    q.idx += step_idx;
    q.head += step_head;
    if (q.head >= heads) {
      q.head -= heads;
      ++q.idx;
    }
  }
};

// The copy side of one warp: lane l copies 16-byte chunk l % kChunks of the tile's tokens
// l / kChunks + i * kStep (i < kRows) of K and V into the warp's stages. The page ids of the
// next tile are loaded one copy ahead (one id where a page holds the whole tile).
template <typename T, int D, int STAGES>
struct LeafCopier {
  static constexpr int kChunks = D / 8;
  static constexpr int kStep = 32 / kChunks;  // tokens per pass of the warp
  static constexpr int kRows = kLeafTokens / kStep;
  static constexpr int kRow = D;  // halfs per smem row (swizzled, forward_leaf_smem_bytes)
  PairPos pos;
  int kv_len, tiles, tile, stage;
  bool done;
  const int32_t* pages;
  const T* k_base;
  const T* v_base;
  int next_len, next_page0;    // of the pair after pos
  int next2_len, next2_page0;  // of the pair after that
  int tok0, col;
  uint32_t colx;  // bytes: this lane's chunk swizzled by tok0 (rows tok0 + i * kStep add (i *
                  // kStep) % 8)
  // The KV is streamed evict-first when the plan has other launches or a merge: the leaf
  // pairs read their pages once, and the L2 is left to the partial rows and the pages that
  // row chunks share (docs/dev/log.md v45). A plan of leaf pairs alone keeps the default
  // policy, which streams faster on its own.
  bool evict_first;
  uint32_t dst0;  // shared address of this lane's first K row in stage 0
  int pg[kRows];  // page ids of the next tile's rows (pg[0] only, where one page holds it)

  __device__ __forceinline__ void start(const ForwardParams& p, const LeafPairs& r, int lane,
                                        T* warp_smem) {
    tok0 = lane / kChunks;
    col = (lane % kChunks) * 8;
    // Row r = tok0 + i * kStep with tok0 < kStep (powers of two up to 8): r % 8 = tok0 ^ ((i *
    // kStep) % 8), so the swizzled chunk is (chunk ^ tok0) ^ ((i * kStep) % 8).
    colx = static_cast<uint32_t>(((lane % kChunks) ^ tok0) * 16);
    dst0 = static_cast<uint32_t>(__cvta_generic_to_shared(warp_smem + tok0 * kRow));
    pos = r.first(static_cast<int>(blockIdx.x) * kLeafWarps + static_cast<int>(threadIdx.x >> 5));
    tile = stage = 0;
    evict_first = p.host_range
                      ? !p.range_leaf_alone
                      : p.counts[kVariantBase + kNumVariants] > p.counts[kVariantBase + 1] ||
                            p.counts[kCountMergeTokens] > 0;
    done = pos.w >= r.total;
    if (!done) {
      const int item = r.begin + pos.idx;
      set(p, p.kv_len[item], p.kv_page_offset[item]);
      fetch_pair_after(p, r, pos, next2_len, next2_page0);  // pair + 1, moved on next
      fetch_next(p, r);
      load_pages(p);
    }
  }
  __device__ __forceinline__ void set(const ForwardParams& p, int len, int page0) {
    kv_len = len;
    tiles = max(1, (len + kLeafTokens - 1) / kLeafTokens);
    pages = p.kv_pages + page0;
    k_base = static_cast<const T*>(p.k) + pos.head * p.k_stride_head + col;
    v_base = static_cast<const T*>(p.v) + pos.head * p.v_stride_head + col;
  }
  // Moves the pair-ahead values on by one and fetches those of the pair two after pos.
  __device__ __forceinline__ void fetch_next(const ForwardParams& p, const LeafPairs& r) {
    next_len = next2_len;
    next_page0 = next2_page0;
    PairPos after = pos;
    r.advance(after);
    fetch_pair_after(p, r, after, next2_len, next2_page0);
  }
  // Pages of 16 tokens or more (powers of two) hold a whole tile: one page id.
  static __device__ __forceinline__ bool one_page(const ForwardParams& p) {
    return p.page_shift >= 4;
  }
  __device__ __forceinline__ void load_pages(const ForwardParams& p) {
    const int t0 = tile * kLeafTokens;
    if (one_page(p)) {
      pg[0] = t0 < kv_len ? pages[t0 >> p.page_shift] : 0;
      return;
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int ps = t0 + tok0 + i * kStep;
      const int idx = p.page_shift >= 0 ? ps >> p.page_shift : p.page_div.div(ps);
      pg[i] = ps < kv_len ? pages[idx] : 0;
    }
  }
  // Copies the next tile of the stream into the next stage; one commit group per call (empty
  // once the stream has ended).
  __device__ __forceinline__ void issue(const ForwardParams& p, const LeafPairs& r) {
    if (!done) {
      const uint32_t spk = static_cast<uint32_t>(p.k_stride_page);
      const uint32_t spv = static_cast<uint32_t>(p.v_stride_page);
      const int stk = static_cast<int>(p.k_stride_tok), stv = static_cast<int>(p.v_stride_tok);
      const uint32_t kd = dst0 + static_cast<uint32_t>(stage * 2 * kLeafTokens * kRow * sizeof(T));
      const uint32_t vd = kd + static_cast<uint32_t>(kLeafTokens * kRow * sizeof(T));
      const int pos0 = tile * kLeafTokens + tok0;
      const bool single = one_page(p);
      const uint64_t pol = l2_evict_first_policy();
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int ps = pos0 + i * kStep;
        const int slot = p.page_shift >= 0 ? ps & (p.page_size - 1) : p.page_div.mod(ps);
        const uint32_t page = static_cast<uint32_t>(single ? pg[0] : pg[i]);
        const T* ks =
            k_base + (static_cast<uint64_t>(page) * spk + static_cast<uint32_t>(slot * stk));
        const T* vs =
            v_base + (static_cast<uint64_t>(page) * spv + static_cast<uint32_t>(slot * stv));
        const uint32_t off = static_cast<uint32_t>(i * kStep * kRow * sizeof(T)) +
                             (colx ^ static_cast<uint32_t>(((i * kStep) & 7) * 16));
        const bool valid = ps < kv_len;
        if (evict_first) {
          cp_async_16(kd + off, ks, valid, pol);
          cp_async_16(vd + off, vs, valid, pol);
        } else {
          cp_async_16(kd + off, ks, valid);
          cp_async_16(vd + off, vs, valid);
        }
      }
      if (++tile == tiles) {
        tile = 0;
        r.advance(pos);
        done = pos.w >= r.total;
        if (!done) {
          set(p, next_len, next_page0);
          fetch_next(p, r);
        }
      }
      if (!done) load_pages(p);
    }
    cp_async_commit();
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
};

// What the math side needs of a pair: its item's query slots and KV run.
struct LeafDesc {
  int kv_head, slot0, rows, kv_len, kv_start;
  __device__ __forceinline__ void load(const ForwardParams& p, const LeafPairs& r,
                                       const PairPos& pos) {
    const int item = r.begin + pos.idx;
    kv_head = pos.head;
    slot0 = p.q_indptr[item];
    rows = (p.q_indptr[item + 1] - slot0) * p.group_size;
    kv_len = p.kv_len[item];
    kv_start = p.kv_start[item];
  }
};

// One block of 8 columns (query rows r0 .. r0 + 7 of a pair) as one lane sees it: columns
// 2t and 2t + 1 (softmax state, causal bounds) and row g (q fragments, output).
template <typename T, int D>
struct LeafRows {
  static constexpr int kKC = D / 16;
  int lim[2];           // keys rows r0 + 2t, r0 + 2t + 1 see (0 past the pair's rows)
  int dst, tok, head;   // row r0 + g: slot_dst, token, query head; tok < 0: none
  int other;            // dst <= -2 (the row finishes its token): the first other partial row
  uint32_t qb[kKC][2];  // q^T B fragments of row r0 + g

  // Everything but the q fragments: one round of independent loads (the pair's descriptor
  // must have landed).
  __device__ __forceinline__ void load_slots(const ForwardParams& p, const LeafDesc& d, int r0,
                                             int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = r0 + 2 * t + c;
      if (r < d.rows) {
        const int slot = d.slot0 + p.group_div.div(r);
        lim[c] = min(p.q_limit[slot] - d.kv_start, d.kv_len);
      } else {
        lim[c] = 0;
      }
    }
    const int r = r0 + g;
    if (r < d.rows) {
      const int tq = p.group_div.div(r);
      const int slot = d.slot0 + tq;
      dst = slot_dst(p, slot);
      tok = p.q_tokens[slot];
      head = d.kv_head * p.group_size + (r - tq * p.group_size);
    } else {
      dst = -1;
      tok = -1;
      head = 0;
    }
  }
  // The q fragments and, for a row that finishes its token, its first other partial row (the
  // slot loads must have landed).
  __device__ __forceinline__ void load_q(const ForwardParams& p, int lane) {
    const int t = lane & 3;
    other = 0;
    if (tok >= 0 && dst <= -2) {
      const int code = -2 - dst;
      other = p.merge_partials[(code >> 4) - (code & 15)];
    }
    if (tok >= 0) {
      const T* q = static_cast<const T*>(p.q) + tok * p.q_stride_t + head * p.q_stride_h + 2 * t;
#pragma unroll
      for (int kc = 0; kc < kKC; ++kc) {
        qb[kc][0] = *reinterpret_cast<const uint32_t*>(q + kc * 16);
        qb[kc][1] = *reinterpret_cast<const uint32_t*>(q + kc * 16 + 8);
      }
    } else {
#pragma unroll
      for (int kc = 0; kc < kKC; ++kc) qb[kc][0] = qb[kc][1] = 0u;
    }
  }
  __device__ __forceinline__ void load(const ForwardParams& p, const LeafDesc& d, int r0,
                                       int lane) {
    load_slots(p, d, r0, lane);
    load_q(p, lane);
  }
};

// A row that finishes its token (ForwardParams::finish; q_out = -2 - (16 j + n)): its own
// normalised output (w, as the epilogue packs it: dims 2t, 2t + 1 of each 8-dim half of every
// 16-dim block), with log-sum-exp gm + log2(gl) in log2 units, merged in place with the
// token's n other partial rows merge_partials[j - n .. j - 1] (`other` is the first, loaded
// with the row's q fragments a pair ahead) by log-sum-exp, in fp32. The other rows come from
// launches that ran before this one (the caller has waited for them).
template <typename T, int D>
__device__ __forceinline__ void leaf_finish_row(const ForwardParams& p, int dst, int other,
                                                int head, float gm, float gl,
                                                uint32_t (&w)[D / 16][2], int t) {
  constexpr int kMB = D / 16;
  const int hq = p.num_qo_heads;
  const int code = -2 - dst;
  const int n = code & 15, first = (code >> 4) - n;
  float mx = gl > 0.f ? gm + log2f(gl) : -INFINITY;
  float sum = gl > 0.f ? 1.f : 0.f;
  float acc[kMB][4];
#pragma unroll
  for (int mb = 0; mb < kMB; ++mb) {
    const float2 a = Vec<T>::to_float2(w[mb][0]), b = Vec<T>::to_float2(w[mb][1]);
    acc[mb][0] = a.x;
    acc[mb][1] = a.y;
    acc[mb][2] = b.x;
    acc[mb][3] = b.y;
  }
  for (int k = 0; k < n; ++k) {
    const int64_t row =
        static_cast<int64_t>(k == 0 ? other : p.merge_partials[first + k]) * hq + head;
    const float lse = __ldcg(p.partial_lse + row) * 1.4426950408889634f;
    const T* src = static_cast<const T*>(p.partial_o) + row * D + 2 * t;
    uint32_t x[kMB][2];
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb) {
      x[mb][0] = __ldcg(reinterpret_cast<const unsigned int*>(src + mb * 16));
      x[mb][1] = __ldcg(reinterpret_cast<const unsigned int*>(src + mb * 16 + 8));
    }
    if (lse == -INFINITY) continue;  // that partial saw no key
    const float nm = fmaxf(mx, lse);
    const float sc = mx == -INFINITY ? 0.f : exp2f(mx - nm);
    const float wj = exp2f(lse - nm);
    sum = sum * sc + wj;
    mx = nm;
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb) {
      const float2 a = Vec<T>::to_float2(x[mb][0]), b = Vec<T>::to_float2(x[mb][1]);
      acc[mb][0] = acc[mb][0] * sc + wj * a.x;
      acc[mb][1] = acc[mb][1] * sc + wj * a.y;
      acc[mb][2] = acc[mb][2] * sc + wj * b.x;
      acc[mb][3] = acc[mb][3] * sc + wj * b.y;
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
  for (int mb = 0; mb < kMB; ++mb) {
    w[mb][0] = pack2<T>(acc[mb][0] * inv, acc[mb][1] * inv);
    w[mb][1] = pack2<T>(acc[mb][2] * inv, acc[mb][3] * inv);
  }
}

// One pair on one warp: its KV tiles against NC blocks of 8 columns (NC = 1: up to 8 query
// rows, NC = 2: up to 16), then its rows out. `stage` is the warp's stage of the pair's first
// tile; the copier issues one tile per tile computed.
template <typename T, int D, int STAGES, int NC>
__device__ __forceinline__ void leaf_pair(const ForwardParams& p, const LeafPairs& range,
                                          LeafCopier<T, D, STAGES>& cp, const T* ws, int& stage,
                                          int k_lane, int v_lane, int lane, const LeafDesc& d,
                                          const LeafRows<T, D>& rw0, const LeafRows<T, D>& rw1) {
  constexpr int kRow = D;
  constexpr int kMB = D / 16;  // 16-dim blocks of O^T
  constexpr int kKC = D / 16;  // 16-dim chunks of q.k
  constexpr int kStageElems = 2 * kLeafTokens * kRow;
  const int g = lane >> 2, t = lane & 3;
  auto rw = [&](int c) -> const LeafRows<T, D>& { return c == 0 ? rw0 : rw1; };
  int lim_max = 0;
#pragma unroll
  for (int c = 0; c < NC; ++c) lim_max = max(lim_max, max(rw(c).lim[0], rw(c).lim[1]));
  const int warp_lim = __reduce_max_sync(0xffffffffu, lim_max);
  const int tiles = max(1, (d.kv_len + kLeafTokens - 1) / kLeafTokens);
  float m[NC][2], l[NC][2], o[NC][kMB][4];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    m[c][0] = m[c][1] = -INFINITY;
    l[c][0] = l[c][1] = 0.f;
#pragma unroll
    for (int i = 0; i < kMB; ++i) o[c][i][0] = o[c][i][1] = o[c][i][2] = o[c][i][3] = 0.f;
  }

  for (int tile = 0; tile < tiles; ++tile) {
    cp_async_wait<STAGES - 2>();
    __syncwarp();  // the tile landed for every lane; the previous stage is free
    cp.issue(p, range);
    const int base = tile * kLeafTokens;
    if (base < warp_lim) {
      const T* st = ws + stage * kStageElems;
      // S^T (16 keys x 8 rows) = K (16 x D) q^T (D x 8) per column block; with one block, two
      // accumulators for instruction-level parallelism.
      constexpr int kAcc = NC == 1 ? 2 : NC;
      float s[kAcc][4];
#pragma unroll
      for (int a = 0; a < kAcc; ++a) s[a][0] = s[a][1] = s[a][2] = s[a][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < kKC; ++kc) {
        uint32_t a[4];
        ldmatrix_x4(a, st + (k_lane ^ (kc * 16)));
#pragma unroll
        for (int c = 0; c < NC; ++c)
          mma16816<T>(s[NC == 1 ? (kc & 1) : c], a, rw(c).qb[kc][0], rw(c).qb[kc][1]);
      }
      if constexpr (NC == 1) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][e] += s[1][e];
      }
      // Keys g and g + 8 of the tile against columns 2t, 2t + 1 of each block.
      const int key0 = base + g, key1 = key0 + 8;
      uint32_t b[NC][2];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float* sc = s[c];
        sc[0] = key0 < rw(c).lim[0] ? sc[0] * p.scale_log2 : -INFINITY;
        sc[1] = key0 < rw(c).lim[1] ? sc[1] * p.scale_log2 : -INFINITY;
        sc[2] = key1 < rw(c).lim[0] ? sc[2] * p.scale_log2 : -INFINITY;
        sc[3] = key1 < rw(c).lim[1] ? sc[3] * p.scale_log2 : -INFINITY;
        float mx0 = fmaxf(sc[0], sc[2]), mx1 = fmaxf(sc[1], sc[3]);
#pragma unroll
        for (int off = 4; off <= 16; off <<= 1) {
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float n0 = fmaxf(m[c][0], mx0), n1 = fmaxf(m[c][1], mx1);
        const float al0 = n0 == -INFINITY ? 1.f : exp2f(m[c][0] - n0);
        const float al1 = n1 == -INFINITY ? 1.f : exp2f(m[c][1] - n1);
        m[c][0] = n0;
        m[c][1] = n1;
        const float p0 = n0 == -INFINITY ? 0.f : exp2f(sc[0] - n0);
        const float p1 = n1 == -INFINITY ? 0.f : exp2f(sc[1] - n1);
        const float p2 = n0 == -INFINITY ? 0.f : exp2f(sc[2] - n0);
        const float p3 = n1 == -INFINITY ? 0.f : exp2f(sc[3] - n1);
        l[c][0] = l[c][0] * al0 + (p0 + p2);
        l[c][1] = l[c][1] * al1 + (p1 + p3);
#pragma unroll
        for (int mb = 0; mb < kMB; ++mb) {
          o[c][mb][0] *= al0;
          o[c][mb][1] *= al1;
          o[c][mb][2] *= al0;
          o[c][mb][3] *= al1;
        }
        // P^T (16 keys x 8 rows) as the B operand: keys 2t, 2t + 1 (+8) of column g.
        b[c][0] = movmatrix_trans(pack2<T>(p0, p1));
        b[c][1] = movmatrix_trans(pack2<T>(p2, p3));
      }
#pragma unroll
      for (int mb = 0; mb < kMB; ++mb) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, st + (v_lane ^ (mb * 16)));
#pragma unroll
        for (int c = 0; c < NC; ++c) mma16816<T>(o[c][mb], a, b[c][0], b[c][1]);
      }
    }
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }

  // Epilogue per column block: full row sums, then O^T back to rows (lane l: row g, dims
  // 2t, 2t + 1 of each 8-dim half of every 16-dim block).
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    float l0 = l[c][0], l1 = l[c][1];
#pragma unroll
    for (int off = 4; off <= 16; off <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, off);
      l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    // Row g's state lives in lane g / 2 (component g % 2).
    const float gm0 = __shfl_sync(0xffffffffu, m[c][0], g >> 1);
    const float gm1 = __shfl_sync(0xffffffffu, m[c][1], g >> 1);
    const float gl0 = __shfl_sync(0xffffffffu, l0, g >> 1);
    const float gl1 = __shfl_sync(0xffffffffu, l1, g >> 1);
    const float gm = (g & 1) ? gm1 : gm0, gl = (g & 1) ? gl1 : gl0;
    uint32_t w[kMB][2];
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb) {
      w[mb][0] = movmatrix_trans(pack2<T>(o[c][mb][0] * inv0, o[c][mb][1] * inv1));
      w[mb][1] = movmatrix_trans(pack2<T>(o[c][mb][2] * inv0, o[c][mb][3] * inv1));
    }
    const LeafRows<T, D>& r = rw(c);
    // Rows that finish a merged token read partial rows of the launches before this one:
    // wait for them (once they are done, the wait returns at once).
    const bool fin = r.tok >= 0 && r.dst <= -2;
    if (__any_sync(0xffffffffu, fin)) chain_wait_prev();
    if (fin) leaf_finish_row<T, D>(p, r.dst, r.other, r.head, gm, gl, w, t);
    if (r.tok >= 0) {
      T* out = r.dst < 0 ? static_cast<T*>(p.out) + r.tok * p.o_stride_t + r.head * p.o_stride_h
                         : static_cast<T*>(p.partial_o) +
                               (static_cast<int64_t>(r.dst) * p.num_qo_heads + r.head) * D;
#pragma unroll
      for (int mb = 0; mb < kMB; ++mb) {
        *reinterpret_cast<uint32_t*>(out + mb * 16 + 2 * t) = w[mb][0];
        *reinterpret_cast<uint32_t*>(out + mb * 16 + 8 + 2 * t) = w[mb][1];
      }
      if (r.dst >= 0 && t == 0)
        p.partial_lse[static_cast<int64_t>(r.dst) * p.num_qo_heads + r.head] =
            gl > 0.f ? (gm + log2f(gl)) * 0.69314718055994531f : -INFINITY;
    }
  }
}

}  // namespace detail

// One warp per (item, KV head) pair; 4 independent warps per block (see the top of this file).
// NC_MAX: the column blocks a pair may need, 2 (items of up to 16 rows) or 1 (at most 8 rows,
// which the caller guarantees: rows 8-15 of a larger item would not be computed). Without the
// 16-row form the kernel needs 192 registers instead of 252 at head_dim 128 (docs/dev/log.md
// v52, v54). With NC_MAX = 1 and 2 stages at head_dim 128 it fits 3 blocks per SM (168
// registers, 68 KB of shared memory with the reserve): 12 warps, each a tile ahead, for plans
// of short pairs (v53).
template <typename T, int D, int STAGES, int NC_MAX>
__global__ void __launch_bounds__(kLeafWarps * 32, D <= 64 || (NC_MAX == 1 && STAGES == 2) ? 3 : 2)
    forward_leaf_kernel(const ForwardParams p) {
  using namespace detail;
  const ChainLink chain(p);
  static_assert(D == 64 || D == 128, "the leaf kernel runs head_dim 64 and 128");
  static_assert(STAGES >= 2, "the copies run STAGES - 1 tiles ahead of the math");
  static_assert(NC_MAX == 1 || NC_MAX == 2, "one or two blocks of 8 columns");
  constexpr int kRow = D;
  constexpr int kStageElems = 2 * kLeafTokens * kRow;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  T* const ws = reinterpret_cast<T*>(smem_raw) + warp * STAGES * kStageElems;

  const LeafPairs range(p);
  const int gwarp = static_cast<int>(blockIdx.x) * kLeafWarps + warp;
  if (gwarp >= range.total) return;  // warp-uniform; no block-wide barrier follows

  LeafCopier<T, D, STAGES> cp;
  cp.start(p, range, lane, ws);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) cp.issue(p, range);

  // ldmatrix lane addresses within a stage (element offsets). K (A operand, non-transposed):
  // matrix i = l / 8 = (keys +8 (i & 1), dims +8 (i >> 1)), row l % 8. V^T (A operand via
  // .trans): matrix i = (keys +8 (i >> 1), dims +8 (i & 1)). Swizzled (row r's chunk c at
  // c ^ (r % 8), r % 8 = l % 8): the chunk of 16-dim block kc is (2 kc + (i >> 1)) ^ (l % 8) =
  // 2 kc ^ ((i >> 1) ^ (l % 8)), so the offset of block kc is k_lane ^ (16 kc) (rows are
  // multiples of D >= 64 halfs, above the chunk bits).
  const int mi = lane >> 3, mr = lane & 7;
  const int k_lane = (mr + 8 * (mi & 1)) * kRow + 8 * ((mi >> 1) ^ mr);
  const int v_lane = kLeafTokens * kRow + (mr + 8 * (mi >> 1)) * kRow + 8 * ((mi & 1) ^ mr);

  // The math side's loads run in a pipeline over the warp's pairs, each stage a round of
  // independent loads a pair before the next needs it: when pair k starts, the descriptor of
  // pair k + 3 is fetched, the slot data (bounds, destinations, tokens) of pair k + 2 (its
  // descriptor landed during pair k - 1) and the q fragments of pair k + 1 (its tokens landed
  // during pair k - 1). So no load of pair k's own chain waits on another. Rows 8-15 (pairs
  // of more than 8 rows) are loaded when their pair starts.
  PairPos pos[4];  // pairs k .. k + 3
  pos[0] = range.first(gwarp);
#pragma unroll
  for (int i = 1; i < 4; ++i) {
    pos[i] = pos[i - 1];
    range.advance(pos[i]);
  }
  auto has = [&](int i) { return pos[i].w < range.total; };
  LeafDesc d0, d1, d2, d3;
  LeafRows<T, D> r0, r1, r2, hi;
  d0.load(p, range, pos[0]);
  if (has(1)) d1.load(p, range, pos[1]);
  if (has(2)) d2.load(p, range, pos[2]);
  r0.load(p, d0, 0, lane);
  if (has(1)) r1.load_slots(p, d1, 0, lane);
  int stage = 0;
  while (true) {
    if (has(1)) r1.load_q(p, lane);
    if (has(2)) r2.load_slots(p, d2, 0, lane);
    if (has(3)) d3.load(p, range, pos[3]);
    if (NC_MAX == 2 && d0.rows > 8) {  // warp-uniform
      hi.load(p, d0, 8, lane);
      leaf_pair<T, D, STAGES, 2>(p, range, cp, ws, stage, k_lane, v_lane, lane, d0, r0, hi);
    } else {
      leaf_pair<T, D, STAGES, 1>(p, range, cp, ws, stage, k_lane, v_lane, lane, d0, r0, r0);
    }
    if (!has(1)) break;
    d0 = d1;
    d1 = d2;
    d2 = d3;
    r0 = r1;
    r1 = r2;
#pragma unroll
    for (int i = 0; i < 3; ++i) pos[i] = pos[i + 1];
    range.advance(pos[3]);
  }
  cp_async_wait<0>();
}

}  // namespace prefixattn
