// CUDA implementation of prefixattn::run_plan: one forward launch per query-tile variant on the
// current stream, then one merge launch; sizes come from the plan's device `counts`. With
// `chained`, the launches after the first may start while the one before drains.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

#include "prefixattn/decode_kernels.cuh"
#include "prefixattn/leaf_forward.cuh"
#include "prefixattn/wgmma_forward.cuh"

namespace prefixattn {
namespace {

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous(), "prefixattn: ",
              name, " must be a contiguous int32 CUDA tensor");
}

#ifndef PREFIXATTN_CUDA_ARCHS_STR
#define PREFIXATTN_CUDA_ARCHS_STR "?"
#endif

// The kernels exist only for the architectures the library was built for; on any other GPU
// a launch would fail with CUDA's "no kernel image" error, so say what is wrong instead.
// Only "no image for this device" is remembered; any other error is raised as it is.
void check_device_has_kernels() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::atomic<int8_t> known[64] = {};  // per device: 0 not checked, 1 ok, -1 no code
  std::atomic<int8_t>& state = known[device & 63];
  if (state.load(std::memory_order_relaxed) == 0) {
    cudaFuncAttributes attr;
    const cudaError_t e = cudaFuncGetAttributes(&attr, merge_kernel<__nv_bfloat16, 128>);
    if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
      (void)cudaGetLastError();  // not sticky: clear it
      state.store(-1, std::memory_order_relaxed);
    } else {
      C10_CUDA_CHECK(e);
      state.store(1, std::memory_order_relaxed);
    }
  }
  if (state.load(std::memory_order_relaxed) < 0) {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    TORCH_CHECK(false, "prefixattn: the CUDA kernels were built for PREFIXATTN_CUDA_ARCHS=",
                PREFIXATTN_CUDA_ARCHS_STR, " and have no code for this GPU (compute capability ",
                major, ".", minor, "); they need sm_90a (H100, H200). Set "
                "PrefixAttention.use_kernels = False to run the PyTorch reference instead.");
  }
}

// Side streams and events for concurrent tile groups, one set per (thread, device, caller
// stream): a side stream that joined one stream's graph capture is never used for another
// stream's work. Created on first use (never per call), non-blocking.
struct GroupStreams {
  cudaStream_t side[kNumVariants - 1] = {};
  cudaEvent_t fork = nullptr;
  cudaEvent_t join[kNumVariants - 1] = {};
};

const GroupStreams& group_streams(int device, cudaStream_t caller) {
  thread_local std::map<std::pair<int, cudaStream_t>, GroupStreams> sets;
  const auto key = std::make_pair(device, caller);
  auto it = sets.find(key);
  if (it != sets.end()) return it->second;
  GroupStreams g;
  for (int i = 0; i < kNumVariants - 1; ++i) {
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&g.side[i], cudaStreamNonBlocking));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&g.join[i], cudaEventDisableTiming));
  }
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&g.fork, cudaEventDisableTiming));
  return sets.emplace(key, g).first->second;
}

// Thread blocks that fill the device once (SMs x resident blocks): the fixed grid of a
// launch whose size must not depend on the plan (CUDA-graph capture).
template <typename K>
int fill_grid(K kernel, int threads, int smem) {
  int device = 0, sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return sms * (per_sm > 0 ? per_sm : 1);
}

// Launches `kernel` on `stream`; `chained` adds the programmatic-serialization attribute, so
// it may start while the launch before it on the stream drains (the kernels' ChainLink and
// chain_wait_prev keep the order that matters: decode_kernels.cuh).
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
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

// A launcher switch that is on unless the environment variable `name` is "0" (read per call,
// so a benchmark or a test can time or compare both settings in one process).
bool switch_on(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// Balanced grids for launches of several rounds (launch), unless PREFIXATTN_BALANCED_GRID is "0".
bool balanced_grid_enabled() { return switch_on("PREFIXATTN_BALANCED_GRID"); }

// Launch sizes of one variant: `pairs` (item, KV head) pairs known on the host (an upper bound
// where the 16-row kernel packs several KV heads per pair: surplus blocks return at once), or
// -1 when the launch must run any plan (fixed grid). The shared-memory opt-in applies to the current device
// only and the full grid depends on the device, so both are set up once per device.
template <auto kernel>
void launch(int threads, int smem, const ForwardParams& p, int pairs, cudaStream_t stream,
            bool chained) {
  static std::atomic<int> full_per_device[64] = {};  // 0: not set up on that device yet
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = full_per_device[device & 63];
  int full = slot.load(std::memory_order_relaxed);
  if (full == 0) {
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    full = fill_grid(kernel, threads, smem);
    slot.store(full, std::memory_order_relaxed);
  }
  int grid = pairs < 0 ? full : std::min(pairs, full);
  // Balanced grid: where the grid stride runs several rounds, as many blocks as give every
  // block the same number of rounds (8192 pairs on 1056 warp slots: 1024 warps of 8 pairs, not
  // 800 of 8 and 256 of 7). PREFIXATTN_BALANCED_GRID=0 keeps the full grid.
  if (pairs > full && balanced_grid_enabled()) {
    const int rounds = (pairs + full - 1) / full;
    grid = (pairs + rounds - 1) / rounds;
  }
  if (grid > 0) launch_kernel(kernel, grid, threads, smem, stream, chained, p);
}

// The leaf kernel runs the 16-row variant unless PREFIXATTN_LEAF_KERNEL is "0".
bool leaf_kernel_enabled() { return switch_on("PREFIXATTN_LEAF_KERNEL"); }

// At head_dim 128 the 64-row tiles run forward_wgmma_kernel with one consumer warpgroup
// unless PREFIXATTN_WGMMA64 is "0" (then forward_mma_kernel's 64-row tile).
bool wgmma64_enabled() { return switch_on("PREFIXATTN_WGMMA64"); }

// Every forward launch asks the L2 for the plan's index arrays and q as it starts (WarmL2),
// unless PREFIXATTN_WARM_L2 is "0". At most kWarmIndexCap bytes of each index array (their
// buffers' capacity, not the plan's length, so that a CUDA graph's replays fetch the same
// ranges) and kWarmQCap of q.
bool warm_l2_enabled() { return switch_on("PREFIXATTN_WARM_L2"); }
constexpr int64_t kWarmIndexCap = int64_t{256} << 10, kWarmQCap = int64_t{4} << 20;
void warm_range(WarmL2& w, int r, const void* ptr, int64_t bytes, int64_t cap) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t base = a & ~static_cast<uintptr_t>(kWarmLine - 1);
  bytes = std::min(bytes, cap);
  w.base[r] = reinterpret_cast<const char*>(base);
  w.lines[r] = bytes <= 0 ? 0u
                          : static_cast<uint32_t>((a - base + static_cast<uintptr_t>(bytes) +
                                                   kWarmLine - 1) / kWarmLine);
}

// The wgmma producer's stages signal full as their copies land (ForwardParams::async_full)
// unless PREFIXATTN_WGMMA_ASYNC_FULL is "0".
bool async_full_enabled() { return switch_on("PREFIXATTN_WGMMA_ASYNC_FULL"); }
// The wgmma producer stages each pair's page ids in shared memory
// (ForwardParams::smem_pages) unless PREFIXATTN_WGMMA_SMEM_PAGES is "0".
bool smem_pages_enabled() { return switch_on("PREFIXATTN_WGMMA_SMEM_PAGES"); }
// Forward launches take their item range from the host (ForwardParams::host_range) where the
// caller allows it, unless PREFIXATTN_HOST_RANGE is "0".
bool host_range_enabled() { return switch_on("PREFIXATTN_HOST_RANGE"); }
// The 128-row `wgmma` launch's consumers take two 64-key stages (128 keys) per step unless
// PREFIXATTN_WGMMA_KEYS128 is "0" (docs/kernel-notes.md v64).
bool wgmma_keys128_enabled() { return switch_on("PREFIXATTN_WGMMA_KEYS128"); }

// Variant v runs query tiles of kVariantRows[v] rows.
constexpr int kVariantRows[kNumVariants] = {16, 32, 64, 128};

// The leaf launch of a plan whose 16-row items have at most 8 rows runs the 8-column leaf
// kernel unless PREFIXATTN_LEAF_NARROW is "0".
bool narrow_leaf_enabled() { return switch_on("PREFIXATTN_LEAF_NARROW"); }

// The leaf kernel's forms (forward_leaf_kernel): every item of the 16-row variant has at most
// 8 query rows (kLeafNarrow: one column block), and its items are also short (kLeafShort: 2
// stages, 3 blocks per SM at head_dim 128).
constexpr int kLeafGeneral = 0, kLeafNarrow = 1, kLeafShort = 2;
constexpr int kLeafShortTiles = 3;  // the short form's largest mean tiles per item

template <typename T, int D>
void launch_variant(const ForwardParams& p, int pairs, cudaStream_t stream, bool chained,
                    int leaf_form) {
  if constexpr (D <= 128) {
    // Tensor cores: 4 warps split the keys of a 16-row tile 4 ways, a 32-row tile 2 ways; 64
    // rows use 4 warps of 16 rows each (mma.sync); 128 rows two warpgroups of 64 rows (wgmma).
    constexpr int S = D <= 64 ? 4 : 3;
    constexpr int kLeafStages = D <= 64 ? 4 : 3;  // the leaf kernel's 16-token stages per warp
    switch (p.variant) {
      case 0:
        // One warp per (item, KV head) pair (leaf_forward.cuh); PREFIXATTN_LEAF_KERNEL=0 runs
        // the 16-row tile of forward_mma_kernel instead (key-split warps, packed heads).
        if (leaf_kernel_enabled()) {
          const int grid = pairs < 0 ? -1 : (pairs + kLeafWarps - 1) / kLeafWarps;
          constexpr int smem = forward_leaf_smem_bytes<D, kLeafStages>();
          if constexpr (D == 128) {
            if (leaf_form == kLeafShort)
              return launch<forward_leaf_kernel<T, D, 2, 1>>(
                  kLeafWarps * 32, forward_leaf_smem_bytes<D, 2>(), p, grid, stream, chained);
          }
          if (leaf_form != kLeafGeneral)
            return launch<forward_leaf_kernel<T, D, kLeafStages, 1>>(kLeafWarps * 32, smem, p,
                                                                     grid, stream, chained);
          return launch<forward_leaf_kernel<T, D, kLeafStages, 2>>(kLeafWarps * 32, smem, p,
                                                                   grid, stream, chained);
        }
        return launch<forward_mma_kernel<T, D, 4, 4, S>>(128,
                            forward_mma_smem_bytes<D, 4, 4, S>(), p, pairs, stream, chained);
      case 1: return launch<forward_mma_kernel<T, D, 4, 2, S>>(128,
                            forward_mma_smem_bytes<D, 4, 2, S>(), p, pairs, stream, chained);
      case 2:
        // The warp-specialized kernel with one consumer warpgroup (3 stages, two blocks per
        // SM): its producer keeps the copies going while the consumers compute, where the
        // mma.sync tile's warps issue both (docs/kernel-notes.md, v56). Measured at D = 128.
        if constexpr (D == 128) {
          if (wgmma64_enabled())
            return launch<forward_wgmma_kernel<T, D, 3, 1>>(
                wgmma_threads<1>(), forward_wgmma_smem_bytes<D, 3>(), p, pairs, stream, chained);
        }
        return launch<forward_mma_kernel<T, D, 4, 1, S>>(128,
                            forward_mma_smem_bytes<D, 4, 1, S>(), p, pairs, stream, chained);
      default:
        // 128 keys per consumer step (two stages) unless PREFIXATTN_WGMMA_KEYS128 is "0".
        if (wgmma_keys128_enabled())
          return launch<forward_wgmma_kernel<T, D, 6, 2, 2>>(
              kWgmmaThreads, forward_wgmma_smem_bytes<D, 6>(), p, pairs, stream, chained);
        return launch<forward_wgmma_kernel<T, D, 6>>(
            kWgmmaThreads, forward_wgmma_smem_bytes<D, 6>(), p, pairs, stream, chained);
    }
  } else {
    // CUDA cores (head_dim 256): 8 warps, ROWS_PER_WARP = rows / 8; at most 64 rows.
    switch (p.variant) {
      case 0: return launch<forward_kernel<T, D, 2>>(detail::kThreads, forward_smem_bytes<D, 2>(),
                            p, pairs, stream, chained);
      case 1: return launch<forward_kernel<T, D, 4>>(detail::kThreads, forward_smem_bytes<D, 4>(),
                            p, pairs, stream, chained);
      case 2: return launch<forward_kernel<T, D, 8>>(detail::kThreads, forward_smem_bytes<D, 8>(),
                            p, pairs, stream, chained);
      default: TORCH_CHECK(pairs <= 0, "prefixattn: query tile of 128 rows is not instantiated "
                                       "for head_dim 256 (max 64)");
    }
  }
}

template <typename T>
void launch_variant_dim(int D, const ForwardParams& p, int pairs, cudaStream_t s, bool chained,
                        int leaf_form) {
  switch (D) {
    case 64: return launch_variant<T, 64>(p, pairs, s, chained, leaf_form);
    case 128: return launch_variant<T, 128>(p, pairs, s, chained, leaf_form);
    case 256: return launch_variant<T, 256>(p, pairs, s, chained, leaf_form);
    default: TORCH_CHECK(false, "prefixattn: head_dim ", D, " unsupported (64, 128, 256)");
  }
}

// Merge (merge_kernel): `num_merge` tokens known on the host, or -1 for the fixed grid.
template <typename T>
void launch_merge(const MergeParams& p, int D, int num_merge, cudaStream_t s, bool chained) {
  auto kernel = D == 64 ? merge_kernel<T, 64> : D == 128 ? merge_kernel<T, 128> : merge_kernel<T, 256>;
  static std::atomic<int> full_per_device[64] = {};  // SMs x resident blocks, per device
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = full_per_device[device & 63];
  int full = slot.load(std::memory_order_relaxed);
  if (full == 0) {
    // Blocks per SM with the largest weight table (kMergeMaxHeads).
    full = fill_grid(merge_kernel<T, 128>, kMergeThreads, merge_smem_bytes(kMergeMaxHeads));
    slot.store(full, std::memory_order_relaxed);
  }
  // A warp per (token, head) when the grid has one for each (the kernel picks that path
  // itself from the plan's token count), else a block per token.
  constexpr int kWarps = kMergeThreads / 32;
  const int grid = num_merge < 0 ? full
                                 : std::min((num_merge * p.num_qo_heads + kWarps - 1) / kWarps, full);
  if (grid > 0)
    launch_kernel(kernel, grid, kMergeThreads, merge_smem_bytes(p.num_qo_heads), s, chained, p);
}

void run_plan_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   at::Tensor& out, at::Tensor& partial_o, at::Tensor& partial_lse,
                   const at::Tensor& kv_page_indptr, const at::Tensor& kv_pages,
                   const at::Tensor& kv_start, const at::Tensor& kv_len,
                   const at::Tensor& q_indptr, const at::Tensor& q_tokens,
                   const at::Tensor& q_limit, const at::Tensor& q_out,
                   const at::Tensor& merge_tokens, const at::Tensor& merge_indptr,
                   const at::Tensor& merge_partials, const at::Tensor& counts,
                   at::IntArrayRef tile_indptr, at::IntArrayRef tile_m, int64_t num_merge_tokens,
                   bool hnd, double scale, int64_t prefetch_tiles, bool fixed_grid,
                   bool concurrent, int64_t fixed_variants, bool chained, int64_t num_finished,
                   bool finish, int64_t leaf_max_rows, int64_t leaf_tiles, bool host_counts) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 3, "prefixattn: q must be a 3-D CUDA tensor");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "prefixattn: CUDA kernels support float16 and bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "prefixattn: q, caches and out must share a dtype");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "prefixattn: caches must be 4-D");
  TORCH_CHECK(out.sizes() == q.sizes(), "prefixattn: out must have q's shape ", q.sizes(),
              ", got ", out.sizes());
  TORCH_CHECK(k_cache.size(3) == q.size(2) && v_cache.size(3) == q.size(2),
              "prefixattn: the caches' head_dim must be q's (", q.size(2), "), got ",
              k_cache.size(3), " and ", v_cache.size(3));
  TORCH_CHECK(k_cache.size(1) == v_cache.size(1) && k_cache.size(2) == v_cache.size(2),
              "prefixattn: k_cache and v_cache must have the same page size and KV heads, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "prefixattn: last dims must be contiguous");
  TORCH_CHECK(partial_o.scalar_type() == q.scalar_type() && partial_lse.scalar_type() == at::kFloat,
              "prefixattn: partial_o must have q's dtype (", q.scalar_type(), "), got ",
              partial_o.scalar_type(), "; partial_lse must be float32, got ", partial_lse.scalar_type());
  // Partial rows are written two elements (4 bytes) at a time by the forward kernels and read
  // 16 bytes at a time by the merge.
  TORCH_CHECK(partial_o.is_cuda() && partial_lse.is_cuda() && partial_o.is_contiguous() &&
                  partial_lse.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(partial_o.data_ptr()) % 16 == 0,
              "prefixattn: partial buffers must be contiguous CUDA tensors, partial_o 16-byte aligned");
  for (auto* t : {&kv_page_indptr, &kv_pages, &kv_start, &kv_len, &q_indptr, &q_tokens, &q_limit,
                  &q_out, &merge_tokens, &merge_indptr, &merge_partials, &counts})
    check_index(*t, "plan index arrays");
  TORCH_CHECK(num_finished >= 0 && num_finished <= num_merge_tokens,
              "prefixattn: num_finished (", num_finished, ") must lie in [0, num_merge_tokens = ",
              num_merge_tokens, "]");
  TORCH_CHECK(tile_indptr.size() == tile_m.size() + 1, "prefixattn: tile_indptr/tile_m mismatch");
  TORCH_CHECK(counts.numel() >= kCountsLen, "prefixattn: counts must hold ", kCountsLen,
              " entries (plan sizes and variant bounds)");
  const int D = q.size(2);
  const int hq = q.size(1);
  const int hkv = hnd ? k_cache.size(1) : k_cache.size(2);
  const int page_size = hnd ? k_cache.size(2) : k_cache.size(1);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "prefixattn: num_qo_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(hq / hkv <= 16, "prefixattn: GQA group size ", hq / hkv, " > 16 unsupported");
  // 16-byte copies: every stride a multiple of 8 elements, base pointers 16-byte aligned.
  auto aligned = [](const at::Tensor& t) {
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16) return false;
    for (int i = 0; i < t.dim() - 1; ++i)
      if (t.stride(i) % 8) return false;
    return true;
  };
  TORCH_CHECK(aligned(q) && aligned(k_cache) && aligned(v_cache),
              "prefixattn: q and caches need 16-byte aligned rows (strides multiple of 8 elements)");
  // The output is written two elements at a time.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0 && out.stride(0) % 2 == 0 &&
                  out.stride(1) % 2 == 0,
              "prefixattn: out needs 4-byte aligned rows (even strides)");

  const c10::cuda::CUDAGuard guard(q.device());
  check_device_has_kernels();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  ForwardParams p{};
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.partial_o = partial_o.data_ptr();
  p.partial_lse = partial_lse.data_ptr<float>();
  p.kv_page_indptr = kv_page_indptr.data_ptr<int32_t>();
  p.kv_pages = kv_pages.data_ptr<int32_t>();
  p.kv_start = kv_start.data_ptr<int32_t>();
  p.kv_len = kv_len.data_ptr<int32_t>();
  p.q_indptr = q_indptr.data_ptr<int32_t>();
  p.q_tokens = q_tokens.data_ptr<int32_t>();
  p.q_limit = q_limit.data_ptr<int32_t>();
  p.q_out = q_out.data_ptr<int32_t>();
  p.merge_partials = merge_partials.data_ptr<int32_t>();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  const int tok_dim = hnd ? 2 : 1, head_dim_idx = hnd ? 1 : 2;
  p.k_stride_page = k_cache.stride(0);
  p.k_stride_tok = k_cache.stride(tok_dim);
  p.k_stride_head = k_cache.stride(head_dim_idx);
  p.v_stride_page = v_cache.stride(0);
  p.v_stride_tok = v_cache.stride(tok_dim);
  p.v_stride_head = v_cache.stride(head_dim_idx);
  // The kernels form row offsets as page x page stride + slot x token stride in 32-bit factors.
  for (int64_t stride : {p.k_stride_page, p.k_stride_tok, p.v_stride_page, p.v_stride_tok})
    TORCH_CHECK(stride >= 0 && stride <= INT32_MAX, "prefixattn: KV cache page and token strides must "
                "be non-negative and below 2^31 elements, got ", stride);
  for (int64_t stride : {p.k_stride_tok, p.v_stride_tok})
    TORCH_CHECK(static_cast<int64_t>(page_size - 1) * stride <= INT32_MAX,
                "prefixattn: a page's last token must sit below 2^31 elements from its first "
                "(page size ", page_size, ", token stride ", stride, ")");
  p.counts = counts.data_ptr<int32_t>();
  if (warm_l2_enabled()) {
    int r = 0;
    for (const at::Tensor* t : {&counts, &q_indptr, &kv_len, &kv_start, &kv_page_indptr, &q_limit,
                                &q_out, &q_tokens, &kv_pages, &merge_partials, &merge_tokens,
                                &merge_indptr})
      warm_range(p.warm, r++, t->data_ptr(), t->numel() * 4, kWarmIndexCap);
    const int64_t q_elems = q.size(0) == 0 ? 0
                            : (q.size(0) - 1) * q.stride(0) + (q.size(1) - 1) * q.stride(1) + q.size(2);
    warm_range(p.warm, r++, q.data_ptr(), q_elems * q.element_size(), kWarmQCap);
  }
  p.async_full = async_full_enabled() ? 1 : 0;
  p.smem_pages = smem_pages_enabled() ? 1 : 0;
  p.page_size = page_size;
  p.page_shift = (page_size & (page_size - 1)) == 0 ? __builtin_ctz(page_size) : -1;
  p.group_size = hq / hkv;
  p.page_div.init(page_size);
  p.group_div.init(p.group_size);
  p.num_qo_heads = hq;
  p.num_kv_heads = hkv;
  p.prefetch_tiles = static_cast<int>(prefetch_tiles);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);

  // Items per variant on the host (launch sizes); the kernels read the bounds from `counts`.
  // Under CUDA-graph capture (or fixed_grid) every variant launches a grid that fills the
  // device, so a replay runs whatever plan the buffers hold by then.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool fixed = fixed_grid || capture != cudaStreamCaptureStatusNone;
  // A fixed grid launches every variant (and the merge) unless fixed_variants says the plans
  // that will fill these buffers never use some.
  auto fixed_launches = [&](int bit) {
    return fixed && (fixed_variants < 0 || ((fixed_variants >> bit) & 1));
  };
  int variant_items[kNumVariants] = {0, 0, 0, 0};
  for (size_t t = 0; t < tile_m.size(); ++t) {
    const int v = static_cast<int>(std::find(kVariantRows, kVariantRows + kNumVariants,
                                             static_cast<int>(tile_m[t])) - kVariantRows);
    TORCH_CHECK(v < kNumVariants, "prefixattn: query tile of ", tile_m[t],
                " rows has no kernel (16, 32, 64, 128)");
    variant_items[v] += static_cast<int>(tile_indptr[t + 1] - tile_indptr[t]);
  }
  int launches[kNumVariants], num_launches = 0;
  for (int v = 0; v < kNumVariants; ++v) {
    if (D > 128 && v == kNumVariants - 1) {
      TORCH_CHECK(variant_items[v] == 0, "prefixattn: query tile of 128 rows is not "
                                         "instantiated for head_dim 256 (max 64)");
      continue;
    }
    if (fixed ? fixed_launches(v) : variant_items[v] > 0) launches[num_launches++] = v;
  }
  // Serial: every group on the caller's stream. Concurrent: the first group there, the others
  // on side streams forked from it and joined back before the merge (a graph capture follows
  // the fork and the joins).
  const GroupStreams* groups = nullptr;
  if (concurrent && num_launches > 1) {
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    groups = &group_streams(device, stream);
    C10_CUDA_CHECK(cudaEventRecord(groups->fork, stream));
  }
  // Chained launches: only serial groups, all on the caller's stream.
  const bool chain = chained && groups == nullptr;
  // The leaf launch finishes the plan's finished tokens when it runs after every other forward
  // launch: serial groups, the leaf kernel, and a plan with such tokens (under a fixed grid, any
  // plan may have them). Otherwise their slots write partial rows and the merge takes them.
  const bool finishing = finish && groups == nullptr && D <= 128 && leaf_kernel_enabled() &&
                         (fixed || num_finished > 0);
  if (finishing) std::reverse(launches, launches + num_launches);
  p.finish = finishing ? 1 : 0;
  // The leaf kernel's one-column-block form, for a plan known on the host to have no 16-row
  // item of more than 8 rows (not under a fixed grid: a replay may run any plan). A finishing
  // leaf launch keeps the general form, which measured faster there (docs/kernel-notes.md v52).
  // Where the items average at most 3 tiles of 16 tokens (leaf_tiles, also from the host), the
  // short form: more warps, each a tile ahead, beat fewer warps two tiles ahead (v53).
  const bool narrow_leaf = !fixed && !finishing && leaf_max_rows >= 0 && leaf_max_rows <= 8 &&
                           narrow_leaf_enabled();
  const bool short_leaf = narrow_leaf && leaf_tiles >= 0 &&
                          leaf_tiles <= static_cast<int64_t>(kLeafShortTiles) * variant_items[0];
  const int leaf_form = short_leaf ? kLeafShort : narrow_leaf ? kLeafNarrow : kLeafGeneral;
  // Launch bounds from the host's tile groups (items ordered by tile height), where the
  // caller says the device counts hold the same (host_counts) and no fixed grid reads them.
  int variant_begin[kNumVariants + 1] = {0};
  for (int v = 0; v < kNumVariants; ++v) variant_begin[v + 1] = variant_begin[v] + variant_items[v];
  const bool heights_sorted = std::is_sorted(tile_m.begin(), tile_m.end());
  p.host_range = host_counts && heights_sorted && !fixed && host_range_enabled() ? 1 : 0;
  p.range_leaf_alone = variant_begin[kNumVariants] == variant_items[0] && num_merge_tokens == 0;
  const int64_t merge_tokens_run = finishing ? num_merge_tokens - num_finished : num_merge_tokens;
  const bool merge_runs = fixed ? fixed_launches(kNumVariants) : merge_tokens_run > 0;
  for (int i = 0; i < num_launches; ++i) {
    const int v = launches[i];
    p.variant = v;
    p.range_begin = variant_begin[v];
    p.range_end = variant_begin[v + 1];
    const int pairs = fixed ? -1 : variant_items[v] * hkv;
    cudaStream_t s = stream;
    if (groups != nullptr && i > 0) {
      s = groups->side[i - 1];
      C10_CUDA_CHECK(cudaStreamWaitEvent(s, groups->fork, 0));
    }
    // Every launch after the run's first is chained to the one before it.
    const bool link = chain && i > 0;
    p.chain_next = chain && (i + 1 < num_launches || merge_runs) ? 1 : 0;
    if (q.scalar_type() == at::kHalf)
      launch_variant_dim<half>(D, p, pairs, s, link, leaf_form);
    else
      launch_variant_dim<__nv_bfloat16>(D, p, pairs, s, link, leaf_form);
    if (s != stream) {
      C10_CUDA_CHECK(cudaEventRecord(groups->join[i - 1], s));
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream, groups->join[i - 1], 0));
    }
  }
  if (merge_runs) {
    MergeParams mp{};
    mp.partial_o = p.partial_o;
    mp.partial_lse = p.partial_lse;
    mp.out = p.out;
    mp.merge_tokens = merge_tokens.data_ptr<int32_t>();
    mp.merge_indptr = merge_indptr.data_ptr<int32_t>();
    mp.merge_partials = merge_partials.data_ptr<int32_t>();
    mp.counts = counts.data_ptr<int32_t>();
    mp.o_stride_t = p.o_stride_t;
    mp.o_stride_h = p.o_stride_h;
    mp.num_qo_heads = hq;
    mp.vec_out = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && out.stride(0) % 8 == 0 &&
                 out.stride(1) % 8 == 0;
    // The merge follows a forward launch of this run on the caller's stream (unless the plan
    // had none).
    const bool link = chain && num_launches > 0;
    mp.finish = p.finish;
    const int num_merge = fixed ? -1 : static_cast<int>(merge_tokens_run);
    if (q.scalar_type() == at::kHalf)
      launch_merge<half>(mp, D, num_merge, stream, link);
    else
      launch_merge<__nv_bfloat16>(mp, D, num_merge, stream, link);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace prefixattn

TORCH_LIBRARY_IMPL(prefixattn, CUDA, m) { m.impl("run_plan", &prefixattn::run_plan_cuda); }
