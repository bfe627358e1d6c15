// Warpgroup (`wgmma`) forward for the 128-row query tiles (variant 3) of head_dim 64 and 128
// and, with one consumer warpgroup, the 64-row tiles (variant 2) of head_dim 128.
// Torch-free, sm_90a only. Same plan and pairs as forward_mma_kernel (forward_mma.cuh); the
// block is warp-specialized.
//
// Block: 128 (1 + CWG) threads. Warpgroup 0 is the producer: it streams the KV tiles of the
// block's pairs into STAGES shared-memory stages with cp.async (the page-table walk and all copy
// addressing live there; each pair's first 512 page ids are staged in shared memory as the pair
// starts) and signals each stage through an mbarrier ("full") as its copies land
// (cp.async.mbarrier.arrive, up to STAGES tiles in flight); a consumer fences the stage for the
// async proxy after its wait. Warpgroups 1 .. CWG are consumers of 64 query
// rows each (warp w owns rows 16 (w - 4) .. + 15, as in the 8-warp mma.sync kernel); each warp
// releases a stage through a second mbarrier ("empty") after its last read of it. There is no
// block-wide barrier per tile, so two consumer warpgroups drift apart and one's softmax overlaps
// the other's tensor-core work. Per 64-key tile and consumer warpgroup:
//   S = Q K^T : D / 16 x wgmma.m64n64k16, q as the register A operand, K from shared memory;
//   online softmax on S in registers (the accumulator layout of one n8 block equals the
//   mma.sync C fragment, so the softmax is the one of the mma.sync kernel);
//   O += P V  : 4 x wgmma.m64nDk16, P packed from S as the register A operand, V from shared
//   memory read transposed (B is MN-major).
// Shared memory holds K and V in the 128-byte-swizzled canonical layout of wgmma operands: a
// tile is D / 64 atoms of [64 keys][64 dims], one 128-byte row per key, in which the 16-byte
// chunk c of key t sits at chunk c ^ (t % 8) (atoms 1024-byte aligned, so the hardware's swizzle
// of address bits 4-6 by bits 7-9 matches). The same bytes serve as a K-major operand for K
// (a k16 step is a 32-byte column of an atom; stride byte offset 1024 between 8-key groups) and
// as an MN-major operand for V (k16 = two 8-key groups, stride byte offset 1024; leading byte
// offset 8192 between the 64-dim atoms along n). Copies are 16 bytes per producer thread; eight
// consecutive threads fill one 128-byte row, conflict-free.
#pragma once

#include "prefixattn/forward_mma.cuh"

namespace prefixattn {

namespace detail {

// Page ids of a pair that the `wgmma` producer keeps in shared memory (the first 512: 32768
// tokens at page size 64, 8192 at 16, 512 at 1; later ones come from global memory).
constexpr int kWgmmaPageIds = 512;

}  // namespace detail

template <int D, int STAGES>
constexpr int forward_wgmma_smem_bytes() {
  // K and V tiles per stage, no padding, up to 1024 bytes to align the first atom, then the
  // producer's page ids of the current pair (kWgmmaPageIds).
  return STAGES * 2 * detail::kTileN * D * 2 + 1024 + detail::kWgmmaPageIds * 4;
}
// One producer warpgroup and CWG consumer warpgroups of 64 rows each: 128 rows (CWG = 2, one
// block per SM) or 64 rows (CWG = 1, two blocks per SM). With two consumer warpgroups the
// launch allocates 168 registers per thread (384 x 168 = 64512); the producer gives back down to
// 56 and the consumers take up to 224 (128 x 56 + 256 x 224 = 64512). With one, 128 per thread
// for two blocks (2 x 256 x 128 = 65536); the producer gives back down to 56 and the consumers
// take up to 200 (56 + 200 = 2 x 128). So setmaxnreg.inc never waits on registers no one frees.
// This relies on ptxas allocating the full count that the launch bounds allow (it does for a
// kernel with setmaxnreg: `-Xptxas -v` reports 168 and 128); with fewer, setmaxnreg.inc would
// wait forever, so check those lines after changing the kernel's launch bounds or build flags.
template <int CWG>
constexpr int wgmma_threads() {
  return 128 * (1 + CWG);
}
constexpr int kWgmmaThreads = wgmma_threads<2>();
template <int CWG, int KSTEP>
constexpr int kWgmmaProducerRegs = 56;
template <int CWG, int KSTEP>
constexpr int kWgmmaConsumerRegs = CWG == 2 ? 224 : 200;
// How far (log2 units) a row's scores may rise above its running maximum before the `wgmma`
// kernel moves the maximum and rescales O and l: probabilities stay below 2^8, well inside the
// range of P's 16-bit type.
constexpr float kRescaleSlack = 8.f;
// Keys per consumer step of the `wgmma` kernel, as a type: WgmmaKeyStep<N>::value tiles of 64.
template <int N>
struct WgmmaKeyStep {
  static constexpr int value = N;
};
// The least tiles of a pair (of more than 64 rows) that takes 128 keys per step where the
// kernel has that form (KSTEP = 2): shorter pairs lose more to the serialized products than
// they gain (docs/dev/log.md v64).
constexpr int kWgmmaKeys128MinTiles = 16;

template <typename T, int D, int STAGES, int CWG = 2, int KSTEP = 1>
__global__ void __launch_bounds__(wgmma_threads<CWG>(), 3 - CWG)
    forward_wgmma_kernel(const ForwardParams p) {
  using namespace detail;
  const ChainLink chain(p);
  static_assert(D == 64 || D == 128, "wgmma forward: head_dim 64 or 128");
  // KSTEP = 2: pairs of more than 64 rows and at least kWgmmaKeys128MinTiles tiles take 128
  // keys per consumer step (WgmmaKeyStep), the others 64.
  static_assert(KSTEP == 1 || KSTEP == 2, "64 or 128 keys per consumer step");
  static_assert(STAGES >= 3, "a consumer holds two stages while the producer fills the next");
  constexpr int kProducerThreads = 128;
  static_assert(CWG == 1 || CWG == 2, "one or two consumer warpgroups");
  constexpr int kConsumerWarps = 4 * CWG;
  constexpr int kChunks = D / 8;           // 16-byte chunks (8-dim core matrices) per key
  constexpr int kKC = D / 16;              // k16 steps of q.k
  constexpr int kTileElems = kTileN * D;   // one K or V tile
  constexpr int kAtomElems = kTileN * 64;  // one [64 keys][64 dims] atom
  static_assert(kTileN == 64, "the swizzle atoms hold 64 keys");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // full[s]: stage s holds its tile (one arrival per producer thread, after its copies landed).
  // empty[s]: stage s may be refilled (one arrival per consumer warp, after its last read).
  __shared__ uint64_t full_bar[STAGES], empty_bar[STAGES];
  // Stage s: K tile then V tile, [STAGES][2][D / 64][kTileN][64] in the swizzled layout above.
  T* const kv_s = reinterpret_cast<T*>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));
  auto k_stage = [&](int st) { return kv_s + st * 2 * kTileElems; };
  auto v_stage = [&](int st) { return kv_s + (st * 2 + 1) * kTileElems; };

  const WorkRange range(p);
  if (static_cast<int>(blockIdx.x) >= range.total) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid < STAGES) {
    mbar_init(&full_bar[tid], kProducerThreads);
    mbar_init(&empty_bar[tid], kConsumerWarps);
  }
  __syncthreads();

  if (warp < 4) {
    // ---- producer warpgroup: streams the block's KV tiles into the stages. Thread tid copies
    // chunk tid % kChunks of keys tid / kChunks + i kLdStep into the swizzled layout (eight
    // consecutive threads fill one 128-byte row). Each thread's copies of a tile arrive on its
    // "full" barrier as they land.
    regs_dec<kWgmmaProducerRegs<CWG, KSTEP>>();
    constexpr int kLdStep = kProducerThreads / kChunks;
    constexpr int kLdRows = kTileN / kLdStep;
    static_assert(kLdStep % 8 == 0, "a thread's rows share their swizzle");
    // Both consumer warpgroups compute every key of a tile; the pair's page ids are staged in
    // shared memory.
    KvCopier<T, kLdRows, kTileN, /*kEvictFirst=*/false, /*kSmemPages=*/true> cp;
    cp.row0 = tid / kChunks;
    cp.step = kLdStep;
    cp.col = (tid % kChunks) * 8;
    {
      const int ch = tid % kChunks;
      cp.dst0 = (ch >> 3) * kAtomElems + cp.row0 * 64 + (((ch & 7) ^ (cp.row0 & 7)) << 3);
      cp.dst_step = kLdStep * 64;
    }
    cp.spg = reinterpret_cast<int32_t*>(kv_s + STAGES * 2 * kTileElems);
    cp.spg_cap = kWgmmaPageIds;
    cp.spg_threads = kProducerThreads;
    cp.start(p, range);
    int phase = 0;
    // Each thread's copies of a stage signal "full" as they land (cp.async.mbarrier.arrive), so
    // the producer runs ahead as far as the "empty" barriers let it: up to STAGES tiles in
    // flight (docs/dev/log.md v59). The consumers fence the landed bytes for the async
    // proxy after their wait.
    while (!cp.done) {
      const int st = cp.stage;
      mbar_wait(&empty_bar[st], phase ^ 1);
      cp.template issue<D, STAGES, kProducerThreads>(p, range, k_stage(0), v_stage(0),
                                                     2 * kTileElems);
      cp_async_mbar_arrive(&full_bar[st]);
      if (cp.stage == 0) phase ^= 1;
    }
    cp_async_wait<0>();
    return;
  }

  // ---- consumer warpgroups: warp cw owns rows 16 cw .. 16 cw + 15 of the pair's tile.
  regs_inc<kWgmmaConsumerRegs<CWG, KSTEP>>();
  const int cw = warp - 4;
  const int wg = cw >> 2;
  const int qc = 2 * (lane % 4);
  const int r0 = cw * 16 + lane / 4;
  // The next pair's descriptor is fetched when a pair starts, its row slots when the pair's
  // tiles are done.
  PairDesc cur, nxt;
  RowSlots rs, nrs;
  PairPos npos = range.first();  // the pair after the current one, once advanced
  cur.load(p, range, npos);
  rs.load(p, cur, r0);
  uint32_t qa[kKC][4];
  int stage = 0, phase = 0;
  // Operand descriptors: stage st's K tile at k step kc, and its V tile at key step kc (16-byte
  // units past stage 0's K and V tiles).
  const SmemDescBase kdesc(k_stage(0), 16, 1024), vdesc(v_stage(0), kAtomElems * 2, 1024);
  constexpr uint32_t kStage16 = 2 * kTileElems * sizeof(T) / 16;
  auto k_off = [](int kc) {
    return static_cast<uint32_t>(((kc >> 2) * kAtomElems + (kc & 3) * 16) * sizeof(T) / 16);
  };
  auto v_off = [](int kc) { return static_cast<uint32_t>(kc * 16 * 64 * sizeof(T) / 16); };
  auto release = [&](int st) {  // this warp is done reading stage st
    if (lane == 0) mbar_arrive(&empty_bar[st]);
  };
  for (int w = blockIdx.x; w < range.total; w += gridDim.x) {
    if (w != static_cast<int>(blockIdx.x)) {
      cur = nxt;
      rs = nrs;
    }
    load_q_frags<T, kKC>(p, cur, rs, cw, qa);
    const int lim0 = rs.limit(cur, 0), lim1 = rs.limit(cur, 1);
    range.advance(npos);
    const bool has_next = npos.w < range.total;
    if (has_next) nxt.load(p, range, npos);
    const int num_rows = cur.num_rows;
    const int num_tiles = max(1, (cur.kv_len + kTileN - 1) / kTileN);
    const bool wg_active = wg * 64 < num_rows;  // uniform over the warpgroup
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;

    // One pair's tiles, KS (1 or 2) tiles of 64 keys per step: kKeys keys. With 64 keys per
    // step the softmax of step t runs while P(t-1) V(t-1) is on the tensor cores; with 128 the
    // registers do not hold P(t-1) beside S(t) (v64), so a step first runs P(t-1) V(t-1) to
    // the end, then S(t), and the other consumer warpgroup fills the gaps.
    auto consume = [&](auto key_step) {
      constexpr int KS = decltype(key_step)::value;
      constexpr int kKeys = KS * kTileN;
      constexpr bool kOverlapPV = KS == 1;
      // A step takes KS tiles (stages) of 64 keys. Step t (KS = 1): S(t) = Q K(t)^T is
      // issued, then P(t-1) V(t-1), kept from the previous step, so the softmax of step t runs
      // while the tensor cores do P(t-1) V(t-1); O is rescaled once that product has landed,
      // and only then are the stages of step t - 1 released. Every step issues both products
      // (the first one P = 0 against its own, landed, V), so no wgmma sits on a divergent
      // path, which would make the compiler serialize them. A pair's last step may hold one
      // tile where KS = 2: its second half then reads the first half's stage again, and its
      // keys lie past the item's end (masked: P = 0 against finite V).
      // P(t-1) as A fragments: keys 16 kc .. are the n8 blocks 2 kc and 2 kc + 1.
      uint32_t pa[kKeys / 16][4];
#pragma unroll
      for (int kc = 0; kc < kKeys / 16; ++kc) pa[kc][0] = pa[kc][1] = pa[kc][2] = pa[kc][3] = 0u;
      int pv_st[KS];
      int pv_n = 0;  // stages the pending P V reads (0 before the pair's first step)
#pragma unroll
      for (int h = 0; h < KS; ++h) pv_st[h] = stage;
      auto issue_pv = [&]() {
#pragma unroll
        for (int kc = 0; kc < kKeys / 16; ++kc)
          Wgmma<T, D, 1>::run(
              o, pa[kc], vdesc.at(static_cast<uint32_t>(pv_st[kc / 4]) * kStage16 + v_off(kc % 4)),
              1);
        wgmma_commit();
      };
      // The pending P V issued and landed, its stages released.
      auto finish_pv = [&]() {
        wgmma_fence();
        issue_pv();
        wgmma_wait<0>();
        pin_registers(o);
#pragma unroll
        for (int h = 0; h < KS; ++h)
          if (h < pv_n) release(pv_st[h]);
        pv_n = 0;
      };
      for (int tile = 0; tile < num_tiles; tile += KS) {
        const int n_here = min(KS, num_tiles - tile);  // uniform
        if constexpr (!kOverlapPV) {
          // P(t-1) V(t-1) first, landed and its stages released before S(t) is issued.
          if (wg_active && pv_n > 0) finish_pv();
        }
        int st[KS];
#pragma unroll
        for (int h = 0; h < KS; ++h) {
          if (h < n_here) {
            mbar_wait(&full_bar[stage], phase);
            st[h] = stage;
            if (++stage == STAGES) {
              stage = 0;
              phase ^= 1;
            }
          } else {
            st[h] = st[0];
          }
        }
        if (wg_active) {
          fence_proxy_async_smem();
          const int base = tile * kTileN;
          float s[kKeys / 2];
          wgmma_fence();
#pragma unroll
          for (int h = 0; h < KS; ++h) {
            const uint32_t st16 = static_cast<uint32_t>(st[h]) * kStage16;
#pragma unroll
            for (int kc = 0; kc < kKC; ++kc)
              Wgmma<T, kTileN, 0>::run(s + h * (kTileN / 2), qa[kc], kdesc.at(st16 + k_off(kc)),
                                       kc > 0);
          }
          wgmma_commit();
          if constexpr (kOverlapPV) {
            issue_pv();
            wgmma_wait<1>();  // S(t) has landed; P(t-1) V(t-1) may still run
          } else {
            wgmma_wait<0>();
          }
          pin_registers(s);

          // Scores to log2 units. A step where every key is visible to every row of the warp and
          // the scale is positive keeps the raw scores: the maximum scales with them, and the
          // scale is folded into the exponent (one FFMA per score). Otherwise the scores are
          // scaled here, masked keys set to -inf, and the exponent's factor is 1.
          const int b0 = lim0 - base, b1 = lim1 - base;
          const bool fold = __all_sync(0xffffffffu, min(b0, b1) >= kKeys) && p.scale_log2 > 0.f;
          float sc = p.scale_log2;
          if (!fold) {
#pragma unroll
            for (int nb = 0; nb < kKeys / 8; ++nb) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int key = nb * 8 + qc + e;
                s[4 * nb + e] = key < b0 ? s[4 * nb + e] * sc : -INFINITY;
                s[4 * nb + 2 + e] = key < b1 ? s[4 * nb + 2 + e] * sc : -INFINITY;
              }
            }
            sc = 1.f;
          }
          float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
          for (int nb = 0; nb < kKeys / 8; ++nb) {
            mx0 = fmaxf(mx0, fmaxf(s[4 * nb], s[4 * nb + 1]));
            mx1 = fmaxf(mx1, fmaxf(s[4 * nb + 2], s[4 * nb + 3]));
          }
#pragma unroll
          for (int off = 1; off <= 2; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
          }
          mx0 *= sc;  // sc > 0 here; -inf stays -inf
          mx1 *= sc;
          // The running maximum m moves only when some row of the warp would see a score more
          // than kRescaleSlack above it (log2 units), and then to the exact maximum; otherwise
          // the probabilities exp2(score - m) stay below 2^kRescaleSlack and neither O nor l is
          // rescaled (the final 1 / l and the log-sum-exp m + log2(l) are the same either way).
          const bool grow =
              __any_sync(0xffffffffu, mx0 > m0 + kRescaleSlack || mx1 > m1 + kRescaleSlack);
          float al0 = 1.f, al1 = 1.f;
          if (grow) {
            const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
            // A row with no visible key so far keeps m = -inf.
            al0 = exp2f(m0 - (n0 == -INFINITY ? 0.f : n0));
            al1 = exp2f(m1 - (n1 == -INFINITY ? 0.f : n1));
            m0 = n0;
            m1 = n1;
          }
          // Its probabilities are then exp2(-inf) = 0.
          const float z0 = m0 == -INFINITY ? 0.f : m0, z1 = m1 == -INFINITY ? 0.f : m1;
          float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
          for (int nb = 0; nb < kKeys / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              s[4 * nb + e] = exp2f(fmaf(s[4 * nb + e], sc, -z0));
              s[4 * nb + 2 + e] = exp2f(fmaf(s[4 * nb + 2 + e], sc, -z1));
              ps0 += s[4 * nb + e];
              ps1 += s[4 * nb + 2 + e];
            }
          }
          l0 = l0 * al0 + ps0;
          l1 = l1 * al1 + ps1;
          if constexpr (kOverlapPV) {
            wgmma_wait<0>();
            pin_registers(o);
            if (pv_n > 0) release(pv_st[0]);  // P(t-1) V(t-1) was its last read
          }
          if (grow) {
#pragma unroll
            for (int db = 0; db < D / 8; ++db) {
              o[4 * db + 0] *= al0;
              o[4 * db + 1] *= al0;
              o[4 * db + 2] *= al1;
              o[4 * db + 3] *= al1;
            }
          }
#pragma unroll
          for (int kc = 0; kc < kKeys / 16; ++kc) {
            pa[kc][0] = pack2<T>(s[8 * kc + 0], s[8 * kc + 1]);
            pa[kc][1] = pack2<T>(s[8 * kc + 2], s[8 * kc + 3]);
            pa[kc][2] = pack2<T>(s[8 * kc + 4], s[8 * kc + 5]);
            pa[kc][3] = pack2<T>(s[8 * kc + 6], s[8 * kc + 7]);
          }
#pragma unroll
          for (int h = 0; h < KS; ++h) pv_st[h] = st[h];
          pv_n = n_here;
        } else {
#pragma unroll
          for (int h = 0; h < KS; ++h)
            if (h < n_here) release(st[h]);  // a warpgroup without rows reads nothing
        }
      }
      if (wg_active) finish_pv();  // the pair's last P V
    };
    if (KSTEP == 2 && num_rows > 64 && num_tiles >= kWgmmaKeys128MinTiles)  // uniform
      consume(WgmmaKeyStep<KSTEP>{});
    else
      consume(WgmmaKeyStep<1>{});
    if (has_next) nrs.load(p, nxt, r0);

    if (cw * 16 < num_rows) store_rows<T, D>(p, lane, rs, num_rows, r0, o, m0, m1, l0, l1);
  }
}

}  // namespace prefixattn
