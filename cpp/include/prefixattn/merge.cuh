// The merge kernel: combines the partial rows of tokens covered by several work items.
#pragma once

#include "prefixattn/params.cuh"
#include "prefixattn/ptx.cuh"

namespace prefixattn {

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
        x = j < end ? __ldcg(p.partial_lse + static_cast<int64_t>(r) * p.num_qo_heads + h)
                    : -INFINITY;
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
              static_cast<const T*>(p.partial_o) +
              (static_cast<int64_t>(rk) * p.num_qo_heads + h) * D + lane * kDpl);
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
          x[u] = ok ? __ldcg(reinterpret_cast<const uint4*>(src + rows[jj] * elems))
                    : make_uint4(0, 0, 0, 0);
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

}  // namespace prefixattn
