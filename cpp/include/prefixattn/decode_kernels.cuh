// Forward and merge kernels that execute a prefixattn LaunchPlan. Torch-free: raw pointers and
// one params struct per stage.
//
// Forward: one thread block per (work item, KV head). The block streams the item's KV run
// through shared memory once (64 tokens per tile, cp.async double buffered, zero-filled past
// the end) and computes every query row of the item against it: rows = tokens x GQA group,
// token-major (row r -> slot r / group, q head kv_head * group + r % group). Eight warps; warp w
// owns rows w, w + 8, ... (ROWS_PER_WARP of them, a compile-time bound from the tile height m).
// Scores: lane j owns keys j and j + 32 of the tile; output: lane owns D / 32 contiguous dims.
// Online softmax in the log2 domain; a slot with q_out == -1 writes the output directly in the
// input dtype, otherwise fp32 partial o (normalised) and natural-log log-sum-exp.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace prefixattn {

struct ForwardParams {
  const void* q;  // [T, Hq, D]
  const void* k;  // paged cache, element strides below
  const void* v;
  void* out;            // [T, Hq, D], q's dtype
  float* partial_o;     // [num_partials, Hq, D]
  float* partial_lse;   // [num_partials, Hq]
  const int32_t* kv_page_indptr;
  const int32_t* kv_pages;
  const int32_t* kv_start;
  const int32_t* kv_len;
  const int32_t* q_indptr;
  const int32_t* q_tokens;
  const int32_t* q_limit;
  const int32_t* q_out;
  int64_t q_stride_t, q_stride_h;
  int64_t o_stride_t, o_stride_h;
  int64_t k_stride_page, k_stride_tok, k_stride_head;
  int64_t v_stride_page, v_stride_tok, v_stride_head;
  int page_size;
  int group_size;
  int num_qo_heads;
  int item_offset;  // first work item of this launch
  float scale_log2;  // softmax scale * log2(e)
};

struct MergeParams {
  const float* partial_o;
  const float* partial_lse;
  void* out;
  const int32_t* merge_tokens;
  const int32_t* merge_indptr;
  const int32_t* merge_partials;
  const int32_t* counts;  // device counts; [3] = number of merge tokens
  int64_t o_stride_t, o_stride_h;
  int num_qo_heads;
};

namespace detail {

constexpr int kTileN = 64;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
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

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
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

}  // namespace detail

template <int D, int ROWS_PER_WARP>
constexpr int forward_smem_bytes() {
  return 2 * 2 * detail::kTileN * (D + detail::kPad) * 2  // K, V x 2 stages
         + detail::kWarps * ROWS_PER_WARP * D * 2         // q tile
         + detail::kWarps * ROWS_PER_WARP * detail::kTileN * 4;  // probabilities
}

template <typename T, int D, int ROWS_PER_WARP>
__global__ void __launch_bounds__(detail::kThreads)
    forward_kernel(const ForwardParams p) {
  using namespace detail;
  constexpr int kRow = D + kPad;   // smem KV row, halfs
  constexpr int kChunks = D / 8;   // 16-byte chunks per row
  constexpr int kDpl = D / 32;     // output dims per lane
  constexpr int kRows = kWarps * ROWS_PER_WARP;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);                   // [2][kTileN][kRow]
  T* v_s = k_s + 2 * kTileN * kRow;                          // [2][kTileN][kRow]
  T* q_s = v_s + 2 * kTileN * kRow;                          // [kRows][D]
  float* p_s = reinterpret_cast<float*>(q_s + kRows * D);    // [kRows][kTileN]

  const int item = p.item_offset + blockIdx.x;
  const int kv_head = blockIdx.y;
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
      int page = valid ? pages[pos / p.page_size] : 0;
      int slot = valid ? pos % p.page_size : 0;
      const T* kg = k_base + page * p.k_stride_page + slot * p.k_stride_tok + ch * 8;
      const T* vg = v_base + page * p.v_stride_page + slot * p.v_stride_tok + ch * 8;
      cp_async_16(k_s + (stage * kTileN + t) * kRow + ch * 8, kg, valid);
      cp_async_16(v_s + (stage * kTileN + t) * kRow + ch * 8, vg, valid);
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
      int token = p.q_tokens[slot0 + r / g];
      int head = kv_head * g + r % g;
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
    limit[i] = r < num_rows ? p.q_limit[slot0 + r / g] - kv_start : 0;
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
    int slot = slot0 + r / g;
    int head = kv_head * g + r % g;
    int dst = p.q_out[slot];
    if (dst < 0) {
      T* o = static_cast<T*>(p.out) + p.q_tokens[slot] * p.o_stride_t + head * p.o_stride_h +
             lane * kDpl;
#pragma unroll
      for (int d = 0; d < kDpl; ++d) o[d] = Vec<T>::from_float(o_acc[i][d] * inv);
    } else {
      float* o = p.partial_o + (static_cast<int64_t>(dst) * p.num_qo_heads + head) * D + lane * kDpl;
#pragma unroll
      for (int d = 0; d < kDpl; ++d) o[d] = o_acc[i][d] * inv;
      if (lane == 0) {
        // m_run is in log2 units: lse = ln(sum exp(scale * qk)) = (m + log2(l)) * ln(2).
        p.partial_lse[static_cast<int64_t>(dst) * p.num_qo_heads + head] =
            l > 0.f ? (m_run[i] + log2f(l)) * 0.69314718055994531f : -INFINITY;
      }
    }
  }
}

// One block per merged token (grid capacity >= count; extra blocks exit); threads over heads x
// dims. Combines the token's partial rows by log-sum-exp and writes q's dtype.
template <typename T, int D>
__global__ void __launch_bounds__(256) merge_kernel(const MergeParams p) {
  const int i = blockIdx.x;
  if (i >= p.counts[3]) return;
  const int token = p.merge_tokens[i];
  const int begin = p.merge_indptr[i], end = p.merge_indptr[i + 1];
  for (int idx = threadIdx.x; idx < p.num_qo_heads * D; idx += blockDim.x) {
    int h = idx / D, d = idx % D;
    float m = -INFINITY;
    for (int j = begin; j < end; ++j)
      m = fmaxf(m, p.partial_lse[static_cast<int64_t>(p.merge_partials[j]) * p.num_qo_heads + h]);
    float acc = 0.f, wsum = 0.f;
    if (m != -INFINITY) {
      for (int j = begin; j < end; ++j) {
        int64_t row = static_cast<int64_t>(p.merge_partials[j]) * p.num_qo_heads + h;
        float w = __expf(p.partial_lse[row] - m);
        wsum += w;
        acc += w * p.partial_o[row * D + d];
      }
    }
    T* o = static_cast<T*>(p.out) + token * p.o_stride_t + h * p.o_stride_h + d;
    *o = detail::Vec<T>::from_float(wsum > 0.f ? acc / wsum : 0.f);
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core forward (mma.sync m16n8k16, fp32 accumulate), head_dim <= 128. Same contract as
// forward_kernel. WARPS warps (4 or 8); warp w computes query rows 16w .. 16w+15 against the
// whole 64-token tile; all warps share the cp.async KV loads. Fragment layouts (PTX ISA,
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
template <typename T>
__device__ __forceinline__ uint32_t pack_halves(T lo, T hi) {
  uint16_t a = *reinterpret_cast<uint16_t*>(&lo), b = *reinterpret_cast<uint16_t*>(&hi);
  return static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
}
}  // namespace detail

template <int D, int WARPS>
constexpr int forward_mma_smem_bytes() {
  return 2 * 2 * detail::kTileN * (D + detail::kPad) * 2 + WARPS * 16 * (D + detail::kPad) * 2;
}

template <typename T, int D, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) forward_mma_kernel(const ForwardParams p) {
  using namespace detail;
  constexpr int kRow = D + kPad;
  constexpr int kChunks = D / 8;
  constexpr int kThreadsM = WARPS * 32;
  constexpr int kNB = kTileN / 8;  // key blocks of 8
  constexpr int kDB = D / 8;       // output dim blocks of 8
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + 2 * kTileN * kRow;
  T* q_s = v_s + 2 * kTileN * kRow;  // [WARPS*16][kRow]

  const int item = p.item_offset + blockIdx.x;
  const int kv_head = blockIdx.y;
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
    for (int c = tid; c < kTileN * kChunks; c += kThreadsM) {
      int t = c / kChunks, ch = c % kChunks;
      int pos = tile * kTileN + t;
      bool valid = pos < kv_len;
      int page = valid ? pages[pos / p.page_size] : 0;
      int slot = valid ? pos % p.page_size : 0;
      cp_async_16(k_s + (stage * kTileN + t) * kRow + ch * 8,
                  k_base + page * p.k_stride_page + slot * p.k_stride_tok + ch * 8, valid);
      cp_async_16(v_s + (stage * kTileN + t) * kRow + ch * 8,
                  v_base + page * p.v_stride_page + slot * p.v_stride_tok + ch * 8, valid);
    }
    cp_async_commit();
  };
  const int num_tiles = (kv_len + kTileN - 1) / kTileN;
  if (num_tiles > 0) load_tile(0, 0);
  for (int c = tid; c < WARPS * 16 * kChunks; c += kThreadsM) {
    int r = c / kChunks, ch = c % kChunks;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < num_rows) {
      int token = p.q_tokens[slot0 + r / g];
      int head = kv_head * g + r % g;
      val = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + token * p.q_stride_t +
                                            head * p.q_stride_h + ch * 8);
    }
    *reinterpret_cast<uint4*>(q_s + r * kRow + ch * 8) = val;
  }

  const bool active = warp * 16 < num_rows;  // warp-uniform
  const int r0 = warp * 16 + lane / 4, r1 = r0 + 8;
  const int lim0 = r0 < num_rows ? p.q_limit[slot0 + r0 / g] - kv_start : 0;
  const int lim1 = r1 < num_rows ? p.q_limit[slot0 + r1 / g] - kv_start : 0;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  float o[kDB][4];
#pragma unroll
  for (int i = 0; i < kDB; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  const int qc = 2 * (lane % 4);

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_tiles) {
      load_tile(tile + 1, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (active) {
      const T* kt = k_s + stage * kTileN * kRow;
      const T* vt = v_s + stage * kTileN * kRow;
      float s[kNB][4];
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t a[4];
        const T* qa = q_s + r0 * kRow + kc * 16 + qc;
        a[0] = *reinterpret_cast<const uint32_t*>(qa);
        a[1] = *reinterpret_cast<const uint32_t*>(qa + 8 * kRow);
        a[2] = *reinterpret_cast<const uint32_t*>(qa + 8);
        a[3] = *reinterpret_cast<const uint32_t*>(qa + 8 * kRow + 8);
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
          const T* kb = kt + (nb * 8 + lane / 4) * kRow + kc * 16 + qc;
          mma16816<T>(s[nb], a, *reinterpret_cast<const uint32_t*>(kb),
                      *reinterpret_cast<const uint32_t*>(kb + 8));
        }
      }
      const int base = tile * kTileN;
      const int b0 = min(lim0, kv_len) - base, b1 = min(lim1, kv_len) - base;
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
      for (int kc = 0; kc < kTileN / 16; ++kc) {
        uint32_t a[4];
        a[0] = pack2<T>(s[2 * kc][0], s[2 * kc][1]);
        a[1] = pack2<T>(s[2 * kc][2], s[2 * kc][3]);
        a[2] = pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        a[3] = pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3]);
        // ldmatrix.x4.trans: lane l addresses row l % 8 of 8x8 matrix l / 8 = (keys
        // +8 * (i & 1), dims +8 * (i >> 1)); the results are b0, b1 of two dim blocks.
        const T* vrow = vt + (kc * 16 + (lane & 8) + (lane & 7)) * kRow + ((lane >> 4) << 3);
#pragma unroll
        for (int db = 0; db < kDB; db += 2) {
          uint32_t b[4];
          uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(vrow + db * 8));
          asm volatile(
              "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
              : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
              : "r"(addr));
          mma16816<T>(o[db], a, b[0], b[1]);
          mma16816<T>(o[db + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }
  if (!active) return;
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = h ? r1 : r0;
    if (r >= num_rows) continue;
    const float l = h ? l1 : l0, m = h ? m1 : m0;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int slot = slot0 + r / g;
    const int head = kv_head * g + r % g;
    const int dst = p.q_out[slot];
    if (dst < 0) {
      T* out = static_cast<T*>(p.out) + p.q_tokens[slot] * p.o_stride_t + head * p.o_stride_h;
#pragma unroll
      for (int db = 0; db < kDB; ++db)
        *reinterpret_cast<uint32_t*>(out + db * 8 + qc) =
            pack2<T>(o[db][2 * h] * inv, o[db][2 * h + 1] * inv);
    } else {
      float* out = p.partial_o + (static_cast<int64_t>(dst) * p.num_qo_heads + head) * D;
#pragma unroll
      for (int db = 0; db < kDB; ++db)
        *reinterpret_cast<float2*>(out + db * 8 + qc) =
            make_float2(o[db][2 * h] * inv, o[db][2 * h + 1] * inv);
      if (lane % 4 == 0)
        p.partial_lse[static_cast<int64_t>(dst) * p.num_qo_heads + head] =
            l > 0.f ? (m + log2f(l)) * 0.69314718055994531f : -INFINITY;
    }
  }
}

}  // namespace prefixattn
