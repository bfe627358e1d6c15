// Definitions of the launch functions of dispatch.h: which kernel, block size and shared
// memory each variant of a (dtype, head_dim) runs. Included only by inst/*.cu, each of which
// instantiates one dtype and head_dim.
#pragma once

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

#include "launch/cuda_check.h"
#include "launch/dispatch.h"
#include "prefixattn/forward_leaf.cuh"
#include "prefixattn/forward_mma.cuh"
#include "prefixattn/forward_simt.cuh"
#include "prefixattn/forward_wgmma.cuh"
#include "prefixattn/merge.cuh"

namespace prefixattn {
namespace launch_detail {

// Thread blocks that fill the device once (SMs x resident blocks): the fixed grid of a
// launch whose size must not depend on the plan (CUDA-graph capture).
template <typename K>
int fill_grid(K kernel, int threads, int smem) {
  int device = 0, sms = 0, per_sm = 0;
  PREFIXATTN_CUDA_CHECK(cudaGetDevice(&device));
  PREFIXATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  PREFIXATTN_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return sms * (per_sm > 0 ? per_sm : 1);
}

// Launches `kernel` on `stream`; `chained` adds the programmatic-serialization attribute, so
// it may start while the launch before it on the stream drains (the kernels' ChainLink and
// chain_wait_prev keep the order that matters: work.cuh, ptx.cuh).
template <typename Params>
void launch_kernel(void (*kernel)(Params), int grid, int threads, int smem, cudaStream_t stream,
                   bool chained, const Params& p) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = chained ? 1 : 0;
  PREFIXATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

// One forward launch of `kernel`. The shared-memory opt-in applies to the current device only
// and the full grid depends on the device, so both are set up once per device.
template <auto kernel>
void launch(int threads, int smem, const ForwardParams& p, int pairs, cudaStream_t stream,
            bool chained) {
  static std::atomic<int> full_per_device[64] = {};  // 0: not set up on that device yet
  int device = 0;
  PREFIXATTN_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = full_per_device[device & 63];
  int full = slot.load(std::memory_order_relaxed);
  if (full == 0) {
    PREFIXATTN_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    full = fill_grid(kernel, threads, smem);
    slot.store(full, std::memory_order_relaxed);
  }
  int grid = pairs < 0 ? full : std::min(pairs, full);
  // Balanced grid: where the grid stride runs several rounds, as many blocks as give every
  // block the same number of rounds (8192 pairs on 1056 warp slots: 1024 warps of 8 pairs, not
  // 800 of 8 and 256 of 7).
  if (pairs > full) {
    const int rounds = (pairs + full - 1) / full;
    grid = (pairs + rounds - 1) / rounds;
  }
  if (grid > 0) launch_kernel(kernel, grid, threads, smem, stream, chained, p);
}

}  // namespace launch_detail

template <typename T, int D>
void launch_forward(const ForwardParams& p, int pairs, cudaStream_t stream, bool chained,
                    int leaf_form) {
  using launch_detail::launch;
  if constexpr (D <= 128) {
    // Tensor cores: the 16-row tiles run the leaf kernel, one warp per (item, KV head) pair
    // (forward_leaf.cuh); 4 warps split the keys of a 32-row tile 2 ways (mma.sync); 64 rows
    // use 4 warps of 16 rows each (mma.sync) at head_dim 64 and one consumer warpgroup
    // (wgmma) at 128; 128 rows two warpgroups of 64 rows (wgmma).
    constexpr int S = D <= 64 ? 4 : 3;
    constexpr int kLeafStages = D <= 64 ? 4 : 3;  // the leaf kernel's 16-token stages per warp
    switch (p.variant) {
      case 0: {
        const int grid = pairs < 0 ? -1 : (pairs + kLeafWarps - 1) / kLeafWarps;
        constexpr int smem = forward_leaf_smem_bytes<D, kLeafStages>();
        if constexpr (D == 128) {
          if (leaf_form == kLeafShort)
            return launch<forward_leaf_kernel<T, D, 2, 1>>(
                kLeafWarps * 32, forward_leaf_smem_bytes<D, 2>(), p, grid, stream, chained);
        }
        if (leaf_form != kLeafGeneral)
          return launch<forward_leaf_kernel<T, D, kLeafStages, 1>>(kLeafWarps * 32, smem, p, grid,
                                                                   stream, chained);
        return launch<forward_leaf_kernel<T, D, kLeafStages, 2>>(kLeafWarps * 32, smem, p, grid,
                                                                 stream, chained);
      }
      case 1:
        return launch<forward_mma_kernel<T, D, 4, 2, S>>(128, forward_mma_smem_bytes<D, 4, 2, S>(),
                                                         p, pairs, stream, chained);
      case 2:
        // The warp-specialized kernel with one consumer warpgroup (3 stages, two blocks per
        // SM): its producer keeps the copies going while the consumers compute, where the
        // mma.sync tile's warps issue both (docs/dev/log.md, v56). Measured at D = 128.
        if constexpr (D == 128) {
          return launch<forward_wgmma_kernel<T, D, 3, 1>>(
              wgmma_threads<1>(), forward_wgmma_smem_bytes<D, 3>(), p, pairs, stream, chained);
        } else {
          return launch<forward_mma_kernel<T, D, 4, 1, S>>(
              128, forward_mma_smem_bytes<D, 4, 1, S>(), p, pairs, stream, chained);
        }
      default:
        // 128 keys per consumer step (two stages; docs/dev/log.md v64).
        return launch<forward_wgmma_kernel<T, D, 6, 2, 2>>(
            kWgmmaThreads, forward_wgmma_smem_bytes<D, 6>(), p, pairs, stream, chained);
    }
  } else {
    // CUDA cores (head_dim 256): 8 warps, ROWS_PER_WARP = rows / 8; at most 64 rows.
    switch (p.variant) {
      case 0:
        return launch<forward_kernel<T, D, 2>>(detail::kThreads, forward_smem_bytes<D, 2>(), p,
                                               pairs, stream, chained);
      case 1:
        return launch<forward_kernel<T, D, 4>>(detail::kThreads, forward_smem_bytes<D, 4>(), p,
                                               pairs, stream, chained);
      case 2:
        return launch<forward_kernel<T, D, 8>>(detail::kThreads, forward_smem_bytes<D, 8>(), p,
                                               pairs, stream, chained);
      default:
        if (pairs > 0) {
          throw std::runtime_error(
              "prefixattn: query tile of 128 rows is not instantiated for head_dim 256 (max 64)");
        }
    }
  }
}

template <typename T, int D>
void launch_merge(const MergeParams& p, int num_merge, cudaStream_t stream, bool chained) {
  const int full = merge_full_grid<T>();
  // A warp per (token, head) when the grid has one for each (the kernel picks that path
  // itself from the plan's token count), else a block per token.
  constexpr int kWarps = kMergeThreads / 32;
  const int grid =
      num_merge < 0 ? full : std::min((num_merge * p.num_qo_heads + kWarps - 1) / kWarps, full);
  if (grid > 0) {
    launch_detail::launch_kernel(merge_kernel<T, D>, grid, kMergeThreads,
                                 merge_smem_bytes(p.num_qo_heads), stream, chained, p);
  }
}

template <typename T>
int merge_full_grid() {
  static std::atomic<int> full_per_device[64] = {};  // SMs x resident blocks, per device
  int device = 0;
  PREFIXATTN_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = full_per_device[device & 63];
  int full = slot.load(std::memory_order_relaxed);
  if (full == 0) {
    // Blocks per SM with the largest weight table (kMergeMaxHeads).
    full = launch_detail::fill_grid(merge_kernel<T, 128>, kMergeThreads,
                                    merge_smem_bytes(kMergeMaxHeads));
    slot.store(full, std::memory_order_relaxed);
  }
  return full;
}

template <typename T>
cudaError_t merge_kernel_attributes(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, merge_kernel<T, 128>);
}

}  // namespace prefixattn

// Explicit instantiations of one dtype and head_dim (inst/*.cu).
#define PREFIXATTN_INSTANTIATE(T, D)                                                      \
  namespace prefixattn {                                                                  \
  template void launch_forward<T, D>(const ForwardParams&, int, cudaStream_t, bool, int); \
  template void launch_merge<T, D>(const MergeParams&, int, cudaStream_t, bool);          \
  }
