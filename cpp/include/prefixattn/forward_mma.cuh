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
#pragma once

#include "prefixattn/kv_copier.cuh"

namespace prefixattn {

template <int D, int WARPS, int KS, int STAGES>
constexpr int forward_mma_smem_bytes() {
  // KV stages. The key-split combine (WARPS x 32 lanes x (D/2 + 4) floats = 256 (D + 8) B
  // for 4 warps, one stage) goes through the stage whose tile was just computed.
  static_assert(
      KS == 1 || WARPS * 32 * (D / 2 + 4) * 4 <= 2 * detail::kTileN * (D + detail::kPad) * 2,
      "the key-split combine must fit in one KV stage");
  return STAGES * 2 * detail::kTileN * (D + detail::kPad) * 2;
}

namespace detail {
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
                                           int num_rows, int r0, const float* o, float m0, float m1,
                                           float l0, float l1) {
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
                     : static_cast<T*>(p.partial_o) +
                           (static_cast<int64_t>(dst) * p.num_qo_heads + head) * D;
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
  constexpr int kKeys = kTileN / KS;                 // keys per warp per tile
  constexpr int kNB = kKeys / 8;                     // key blocks of 8 per warp
  constexpr int kDB = D / 8;                         // output dim blocks of 8
  constexpr int kKC = D / 16;                        // k-chunks of q.k
  constexpr bool kPrefetchQ = WARPS <= 4 && KS > 1;  // KS = 1 would spill with it
  constexpr bool kPacksHeads = WARPS == KS;          // one 16-row block: the 16-row tiles
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
  constexpr int kLdStep = kThreadsM / kChunks;           // rows per pass; a thread keeps its column
  constexpr int kLdRows = kTileN / kLdStep;              // rows per thread per tile
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
