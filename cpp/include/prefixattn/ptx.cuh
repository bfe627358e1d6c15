// PTX primitives of the kernels: cp.async copies and L2 hints, chained-launch control,
// warp reductions, mma.sync / ldmatrix / movmatrix fragments, and the sm_90a warpgroup
// instructions (wgmma, mbarrier, setmaxnreg) with their shared-memory descriptors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace prefixattn {

namespace detail {

// Chained launches (programmatic dependent launch, sm_90): the host may launch a run's forward
// launches after the first, and its merge, with the programmatic-serialization attribute, so
// each may start while the one before drains. A forward launch whose next launch is chained
// (ForwardParams::chain_next) lets it start at once; otherwise it signals nothing early, so a
// kernel that follows the run (launched by others, perhaps with the attribute) never starts
// before the run's last launch ends. The next launch's blocks find room on an SM only as this
// launch's blocks leave, so the launches overlap at their tails, not at their cores. They write
// disjoint rows, so none waits for another's data. Block 0 of every forward launch waits for the
// launch before it to finish before it exits, so a launch finishes only after every launch before
// it, and the merge waits for the last forward launch before it reads a partial row. Launched
// without the attribute, both instructions return at once.
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
// hint; 64 and 256 bytes gained nothing, docs/dev/log.md v44).
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

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// D (+)= A B for one warpgroup: A (64 x 16) from registers in the mma.sync A-fragment layout
// of each warp's 16 rows, B (16 x N) through a shared-memory descriptor, TNSP = 1 when B is
// MN-major. d holds N / 2 fp32 accumulators per thread (n8 block j at d[4 j .. 4 j + 3]).
// scale_d = 0 overwrites D.
template <typename T, int N, int TNSP>
struct Wgmma;
// One specialization per (type, N): the PTX instruction names the operand type and the
// accumulator count, so each shape is written once for both types.
#define PREFIXATTN_WGMMA_M64N64K16(CTYPE, PTX)                                                     \
  template <int TNSP>                                                                              \
  struct Wgmma<CTYPE, 64, TNSP> {                                                                  \
    static __device__ __forceinline__ void run(float* d, const uint32_t* a, uint64_t desc,         \
                                               int scale_d) {                                      \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\n"                                                                     \
          "setp.ne.b32 p, %37, 0;\n"                                                               \
          "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX                                \
          " "                                                                                      \
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
          "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                     \
          "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                          \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),    \
            "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),             \
            "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),          \
            "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),          \
            "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),          \
            "+f"(d[31])                                                                            \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TNSP));       \
    }                                                                                              \
  };
#define PREFIXATTN_WGMMA_M64N128K16(CTYPE, PTX)                                                    \
  template <int TNSP>                                                                              \
  struct Wgmma<CTYPE, 128, TNSP> {                                                                 \
    static __device__ __forceinline__ void run(float* d, const uint32_t* a, uint64_t desc,         \
                                               int scale_d) {                                      \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\n"                                                                     \
          "setp.ne.b32 p, %69, 0;\n"                                                               \
          "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX                               \
          " "                                                                                      \
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
          "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
          "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
          "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                               \
          "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                          \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),    \
            "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),             \
            "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),          \
            "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),          \
            "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),          \
            "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),          \
            "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),          \
            "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),          \
            "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),          \
            "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),          \
            "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                  \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TNSP));       \
    }                                                                                              \
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

}  // namespace detail

}  // namespace prefixattn
