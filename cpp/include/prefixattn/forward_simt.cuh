// ---------------------------------------------------------------------------------------------
// CUDA-core forward (head_dim 256): 8 warps; warp w owns rows w, w + 8, ... (ROWS_PER_WARP of
// them); lane j scores keys j and j + 32 of the tile; lane owns D / 32 contiguous output dims;
// online softmax in the log2 domain; two-stage cp.async pipeline.
#pragma once

#include "prefixattn/work.cuh"

namespace prefixattn {

namespace detail {
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
}  // namespace detail

template <int D, int ROWS_PER_WARP>
constexpr int forward_smem_bytes() {
  return 2 * 2 * detail::kTileN * (D + detail::kPad) * 2         // K, V x 2 stages
         + detail::kWarps * ROWS_PER_WARP * D * 2                // q tile
         + detail::kWarps * ROWS_PER_WARP * detail::kTileN * 4;  // probabilities
}

template <typename T, int D, int ROWS_PER_WARP>
__device__ __forceinline__ void forward_item(const ForwardParams& p, int item, int kv_head,
                                             unsigned char* smem_raw) {
  using namespace detail;
  constexpr int kRow = D + kPad;  // smem KV row, halfs
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kDpl = D / 32;    // output dims per lane
  constexpr int kRows = kWarps * ROWS_PER_WARP;
  T* k_s = reinterpret_cast<T*>(smem_raw);                 // [2][kTileN][kRow]
  T* v_s = k_s + 2 * kTileN * kRow;                        // [2][kTileN][kRow]
  T* q_s = v_s + 2 * kTileN * kRow;                        // [kRows][D]
  float* p_s = reinterpret_cast<float*>(q_s + kRows * D);  // [kRows][kTileN]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = p.group_size;
  const int slot0 = p.q_indptr[item];
  const int num_rows = (p.q_indptr[item + 1] - slot0) * g;
  const int kv_len = p.kv_len[item];
  const int kv_start = p.kv_start[item];
  const int32_t* pages = p.kv_pages + p.kv_page_offset[item];
  const T* k_base = static_cast<const T*>(p.k) + kv_head * p.k_stride_head;
  const T* v_base = static_cast<const T*>(p.v) + kv_head * p.v_stride_head;

  auto load_tile = [&](int tile, int stage) {
    for (int c = tid; c < kTileN * kChunks; c += kThreads) {
      int t = c / kChunks, ch = c % kChunks;
      int pos = tile * kTileN + t;
      bool valid = pos < kv_len;
      int64_t ko =
          valid ? kv_offset(pages, pos, p.page_size, p.page_shift, p.k_stride_page, p.k_stride_tok)
                : 0;
      int64_t vo =
          valid ? kv_offset(pages, pos, p.page_size, p.page_shift, p.v_stride_page, p.v_stride_tok)
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
                   : static_cast<T*>(p.partial_o) +
                         (static_cast<int64_t>(dst) * p.num_qo_heads + head) * D;
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

}  // namespace prefixattn
