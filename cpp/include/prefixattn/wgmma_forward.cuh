// Warpgroup (`wgmma`) forward for the 128-row query tiles (variant 3) of head_dim 64 and 128
// and, with one consumer warpgroup, the 64-row tiles (variant 2) of head_dim 128.
// Torch-free, sm_90a only. Same plan and pairs as forward_mma_kernel (decode_kernels.cuh); the
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

#include "prefixattn/decode_kernels.cuh"

namespace prefixattn {
namespace detail {

// D (+)= A B for one warpgroup: A (64 x 16) from registers in the mma.sync A-fragment layout
// of each warp's 16 rows, B (16 x N) through a shared-memory descriptor, TNSP = 1 when B is
// MN-major. d holds N / 2 fp32 accumulators per thread (n8 block j at d[4 j .. 4 j + 3]).
// scale_d = 0 overwrites D.
template <typename T, int N, int TNSP>
struct Wgmma;
// One specialization per (type, N): the PTX instruction names the operand type and the
// accumulator count, so each shape is written once for both types.
#define PREFIXATTN_WGMMA_M64N64K16(CTYPE, PTX)  \
template <int TNSP>  \
struct Wgmma<CTYPE, 64, TNSP> {  \
  static __device__ __forceinline__ void run(float* d, const uint32_t* a, uint64_t desc,  \
                                             int scale_d) {  \
    asm volatile(  \
    "{\n.reg .pred p;\n"  \
    "setp.ne.b32 p, %37, 0;\n"  \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " "  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
    "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"  \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),  \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),  \
      "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),  \
      "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),  \
      "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])  \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TNSP));  \
  }  \
};
#define PREFIXATTN_WGMMA_M64N128K16(CTYPE, PTX)  \
template <int TNSP>  \
struct Wgmma<CTYPE, 128, TNSP> {  \
  static __device__ __forceinline__ void run(float* d, const uint32_t* a, uint64_t desc,  \
                                             int scale_d) {  \
    asm volatile(  \
    "{\n.reg .pred p;\n"  \
    "setp.ne.b32 p, %69, 0;\n"  \
    "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " "  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
    "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
    "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"  \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),  \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),  \
      "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),  \
      "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),  \
      "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),  \
      "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),  \
      "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),  \
      "+f"(d[62]), "+f"(d[63])  \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TNSP));  \
  }  \
};
PREFIXATTN_WGMMA_M64N64K16(__nv_bfloat16, "bf16")
PREFIXATTN_WGMMA_M64N128K16(__nv_bfloat16, "bf16")
PREFIXATTN_WGMMA_M64N64K16(half, "f16")
PREFIXATTN_WGMMA_M64N128K16(half, "f16")
#undef PREFIXATTN_WGMMA_M64N64K16
#undef PREFIXATTN_WGMMA_M64N128K16

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy writes to shared memory (cp.async copies) visible to the
// async proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma
// fence or wait.
template <int N>
__device__ __forceinline__ void pin_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Shared-memory matrix descriptor with the 128-byte swizzle (layout type 1 in bits 62-63):
// start address, leading and stride byte offsets, each in 16-byte units (PTX ISA, "Matrix
// Descriptor Format"); base offset 0, since every atom is 1024-byte aligned.
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}
// The descriptors of one operand over all stages and k steps, formed once: the start address
// is the low 14 bits of the low word (address / 16; shared memory stays below 256 KB), so the
// descriptor of a location `off16` 16-byte units past the base is the base plus off16, one
// 32-bit add (no carry leaves the address field).
struct SmemDescBase {
  uint32_t lo, hi;
  __device__ __forceinline__ SmemDescBase(const void* smem, uint32_t lbo, uint32_t sbo) {
    const uint64_t d = smem_desc_sw128(smem, lbo, sbo);
    lo = static_cast<uint32_t>(d);
    hi = static_cast<uint32_t>(d >> 32);
  }
  __device__ __forceinline__ uint64_t at(uint32_t off16) const {
    return (static_cast<uint64_t>(hi) << 32) | (lo + off16);
  }
};

// mbarrier phases (shared::cta): init, plain arrive, and a wait on the phase of a given parity.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Returns once the phase of parity `parity` has completed (for a fresh barrier, parity 1 names
// the phase before its first, which counts as completed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  const uint32_t addr = smem_u32(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}
// An arrival on `bar` once every cp.async this thread has issued so far has landed (the
// thread goes on at once; .noinc: the arrival counts against the barrier's expected count).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
               : "memory");
}
// Warpgroup register budgets of the warp-specialized kernel (setmaxnreg: all warps of the
// warpgroup execute it).
template <int N>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

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
// they gain (docs/kernel-notes.md v64).
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
  constexpr int kChunks = D / 8;            // 16-byte chunks (8-dim core matrices) per key
  constexpr int kKC = D / 16;               // k16 steps of q.k
  constexpr int kTileElems = kTileN * D;    // one K or V tile
  constexpr int kAtomElems = kTileN * 64;   // one [64 keys][64 dims] atom
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
    // "full" barrier as they land (or, with async_full off, once the next tile is issued).
    regs_dec<kWgmmaProducerRegs<CWG, KSTEP>>();
    constexpr int kLdStep = kProducerThreads / kChunks;
    constexpr int kLdRows = kTileN / kLdStep;
    static_assert(kLdStep % 8 == 0, "a thread's rows share their swizzle");
    // Both consumer warpgroups compute every key of a tile; the pair's page ids are staged in
    // shared memory when p.smem_pages is set.
    KvCopier<T, kLdRows, kTileN, /*kEvictFirst=*/false, /*kSmemPages=*/true> cp;
    cp.row0 = tid / kChunks;
    cp.step = kLdStep;
    cp.col = (tid % kChunks) * 8;
    {
      const int ch = tid % kChunks;
      cp.dst0 = (ch >> 3) * kAtomElems + cp.row0 * 64 + (((ch & 7) ^ (cp.row0 & 7)) << 3);
      cp.dst_step = kLdStep * 64;
    }
    if (p.smem_pages) {
      cp.spg = reinterpret_cast<int32_t*>(kv_s + STAGES * 2 * kTileElems);
      cp.spg_cap = kWgmmaPageIds;
      cp.spg_threads = kProducerThreads;
    }
    cp.start(p, range);
    int phase = 0, landing = -1;  // `landing`: the stage whose copies are in flight
    if (p.async_full) {
      // Each thread's copies of a stage signal "full" as they land
      // (cp.async.mbarrier.arrive), so the producer runs ahead as far as the "empty" barriers
      // let it: up to STAGES tiles in flight (docs/kernel-notes.md v59). The consumers fence
      // the landed bytes for the async proxy after their wait.
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
    // Otherwise a stage is signalled full once the next stage's copies are issued and its own
    // have landed: two tiles in flight.
    while (!cp.done) {
      const int st = cp.stage;
      mbar_wait(&empty_bar[st], phase ^ 1);
      cp.template issue<D, STAGES, kProducerThreads>(p, range, k_stage(0), v_stage(0),
                                                     2 * kTileElems);
      if (landing >= 0) {
        cp_async_wait<1>();
        fence_proxy_async_smem();
        mbar_arrive(&full_bar[landing]);
      }
      landing = st;
      if (cp.stage == 0) phase ^= 1;
    }
    cp_async_wait<0>();
    fence_proxy_async_smem();
    mbar_arrive(&full_bar[landing]);
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
          Wgmma<T, D, 1>::run(o, pa[kc],
                              vdesc.at(static_cast<uint32_t>(pv_st[kc / 4]) * kStage16 + v_off(kc % 4)), 1);
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
              Wgmma<T, kTileN, 0>::run(s + h * (kTileN / 2), qa[kc], kdesc.at(st16 + k_off(kc)), kc > 0);
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
          const bool fold =
              __all_sync(0xffffffffu, min(b0, b1) >= kKeys) && p.scale_log2 > 0.f;
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

    if (cw * 16 < num_rows)
      store_rows<T, D>(p, lane, rs, num_rows, r0, o, m0, m1, l0, l1);
  }
}

}  // namespace prefixattn
