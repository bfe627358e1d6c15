// The launcher of a LaunchPlan (run_plan.h): one forward launch per query-tile variant, then
// one merge launch. With `chained`, the launches after the first may start while the one before
// drains; with `concurrent`, the variants run on side streams forked from the caller's.
#include "launch/run_plan.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

#include "launch/cuda_check.h"
#include "launch/dispatch.h"
#include "prefixattn/plan_layout.h"

namespace prefixattn {
namespace {

#ifndef PREFIXATTN_CUDA_ARCHS_STR
#define PREFIXATTN_CUDA_ARCHS_STR "?"
#endif

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
    PREFIXATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&g.side[i], cudaStreamNonBlocking));
    PREFIXATTN_CUDA_CHECK(cudaEventCreateWithFlags(&g.join[i], cudaEventDisableTiming));
  }
  PREFIXATTN_CUDA_CHECK(cudaEventCreateWithFlags(&g.fork, cudaEventDisableTiming));
  return sets.emplace(key, g).first->second;
}

// Every forward launch asks the L2 for the plan's index arrays and q as it starts (WarmL2): at
// most kWarmIndexCap bytes of each index array (their buffers' capacity, not the plan's length,
// so that a CUDA graph's replays fetch the same ranges) and kWarmQCap of q.
constexpr int64_t kWarmIndexCap = int64_t{256} << 10, kWarmQCap = int64_t{4} << 20;
void warm_range(WarmL2& w, int r, const void* ptr, int64_t bytes, int64_t cap) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t base = a & ~static_cast<uintptr_t>(kWarmLine - 1);
  bytes = std::min(bytes, cap);
  w.base[r] = reinterpret_cast<const char*>(base);
  w.lines[r] = bytes <= 0
                   ? 0u
                   : static_cast<uint32_t>(
                         (a - base + static_cast<uintptr_t>(bytes) + kWarmLine - 1) / kWarmLine);
}

template <typename T>
void launch_forward_dim(int D, const ForwardParams& p, int pairs, cudaStream_t s, bool chained,
                        int leaf_form) {
  switch (D) {
    case 64: return launch_forward<T, 64>(p, pairs, s, chained, leaf_form);
    case 128: return launch_forward<T, 128>(p, pairs, s, chained, leaf_form);
    case 256: return launch_forward<T, 256>(p, pairs, s, chained, leaf_form);
    default:
      throw std::runtime_error("prefixattn: head_dim " + std::to_string(D) +
                               " unsupported (64, 128, 256)");
  }
}

template <typename T>
void launch_merge_dim(int D, const MergeParams& p, int num_merge, cudaStream_t s, bool chained) {
  switch (D) {
    case 64: return launch_merge<T, 64>(p, num_merge, s, chained);
    case 128: return launch_merge<T, 128>(p, num_merge, s, chained);
    default: return launch_merge<T, 256>(p, num_merge, s, chained);
  }
}

}  // namespace

// The kernels exist only for the architectures the library was built for; on any other GPU
// a launch would fail with CUDA's "no kernel image" error, so say what is wrong instead.
// Only "no image for this device" is remembered; any other error is raised as it is.
void check_device_has_kernels() {
  int device = 0;
  PREFIXATTN_CUDA_CHECK(cudaGetDevice(&device));
  static std::atomic<int8_t> known[64] = {};  // per device: 0 not checked, 1 ok, -1 no code
  std::atomic<int8_t>& state = known[device & 63];
  if (state.load(std::memory_order_relaxed) == 0) {
    cudaFuncAttributes attr;
    const cudaError_t e = merge_kernel_attributes<__nv_bfloat16>(&attr);
    if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
      (void)cudaGetLastError();  // not sticky: clear it
      state.store(-1, std::memory_order_relaxed);
    } else {
      PREFIXATTN_CUDA_CHECK(e);
      state.store(1, std::memory_order_relaxed);
    }
  }
  if (state.load(std::memory_order_relaxed) < 0) {
    int major = 0, minor = 0;
    PREFIXATTN_CUDA_CHECK(
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    PREFIXATTN_CUDA_CHECK(
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    throw std::runtime_error(
        std::string("prefixattn: the CUDA kernels were built for PREFIXATTN_CUDA_ARCHS=") +
        PREFIXATTN_CUDA_ARCHS_STR + " and have no code for this GPU (compute capability " +
        std::to_string(major) + "." + std::to_string(minor) +
        "); they need sm_90a (H100, H200). Set PrefixAttention.use_kernels = False to run the "
        "PyTorch reference instead.");
  }
}

void run_plan(const RunPlanArgs& a, const LaunchOptions& o, cudaStream_t stream) {
  const int D = a.head_dim;
  const int hq = a.num_qo_heads;
  const int hkv = a.num_kv_heads;
  const int page_size = a.page_size;

  ForwardParams p{};
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.out = a.out;
  p.partial_o = a.partial_o;
  p.partial_lse = a.partial_lse;
  p.kv_page_offset = a.kv_page_offset.data;
  p.kv_pages = a.kv_pages.data;
  p.kv_start = a.kv_start.data;
  p.kv_len = a.kv_len.data;
  p.q_indptr = a.q_indptr.data;
  p.q_tokens = a.q_tokens.data;
  p.q_limit = a.q_limit.data;
  p.q_out = a.q_out.data;
  p.merge_partials = a.merge_partials.data;
  p.q_stride_t = a.q_stride_t;
  p.q_stride_h = a.q_stride_h;
  p.o_stride_t = a.o_stride_t;
  p.o_stride_h = a.o_stride_h;
  p.k_stride_page = a.k_stride_page;
  p.k_stride_tok = a.k_stride_tok;
  p.k_stride_head = a.k_stride_head;
  p.v_stride_page = a.v_stride_page;
  p.v_stride_tok = a.v_stride_tok;
  p.v_stride_head = a.v_stride_head;
  p.counts = a.counts.data;
  {
    int r = 0;
    for (const DeviceArray* t :
         {&a.counts, &a.q_indptr, &a.kv_len, &a.kv_start, &a.kv_page_offset, &a.q_limit, &a.q_out,
          &a.q_tokens, &a.kv_pages, &a.merge_partials, &a.merge_tokens, &a.merge_indptr})
      warm_range(p.warm, r++, t->data, t->size * 4, kWarmIndexCap);
    const int64_t q_elems = a.num_tokens == 0 ? 0
                                              : (a.num_tokens - 1) * a.q_stride_t +
                                                    (hq - 1) * a.q_stride_h + a.head_dim;
    warm_range(p.warm, r++, a.q, q_elems * 2, kWarmQCap);  // 2-byte elements
  }
  p.page_size = page_size;
  p.page_shift = (page_size & (page_size - 1)) == 0 ? __builtin_ctz(page_size) : -1;
  p.group_size = hq / hkv;
  p.page_div.init(page_size);
  p.group_div.init(p.group_size);
  p.num_qo_heads = hq;
  p.num_kv_heads = hkv;
  p.prefetch_tiles = o.prefetch_tiles;
  p.scale_log2 = static_cast<float>(a.scale * 1.4426950408889634);

  // Items per variant on the host (launch sizes); the kernels read the bounds from `counts`.
  // Under CUDA-graph capture (or fixed_grid) every variant launches a grid that fills the
  // device, so a replay runs whatever plan the buffers hold by then.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  PREFIXATTN_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool fixed = o.fixed_grid || capture != cudaStreamCaptureStatusNone;
  // A fixed grid launches every variant (and the merge) unless fixed_variants says the plans
  // that will fill these buffers never use some.
  auto fixed_launches = [&](int bit) {
    return fixed && (o.fixed_variants < 0 || ((o.fixed_variants >> bit) & 1));
  };
  int variant_items[kNumVariants] = {0, 0, 0, 0};
  for (int64_t t = 0; t < a.num_tiles; ++t) {
    const int v = static_cast<int>(
        std::find(kVariantRows, kVariantRows + kNumVariants, static_cast<int>(a.tile_m[t])) -
        kVariantRows);
    if (v >= kNumVariants) {
      throw std::runtime_error("prefixattn: query tile of " + std::to_string(a.tile_m[t]) +
                               " rows has no kernel (16, 32, 64, 128)");
    }
    variant_items[v] += static_cast<int>(a.tile_indptr[t + 1] - a.tile_indptr[t]);
  }
  int launches[kNumVariants], num_launches = 0;
  for (int v = 0; v < kNumVariants; ++v) {
    if (D > 128 && v == kNumVariants - 1) {
      if (variant_items[v] != 0) {
        throw std::runtime_error(
            "prefixattn: query tile of 128 rows is not instantiated for head_dim 256 (max 64)");
      }
      continue;
    }
    if (fixed ? fixed_launches(v) : variant_items[v] > 0) launches[num_launches++] = v;
  }
  // Serial: every group on the caller's stream. Concurrent: the first group there, the others
  // on side streams forked from it and joined back before the merge (a graph capture follows
  // the fork and the joins).
  const GroupStreams* groups = nullptr;
  if (o.concurrent && num_launches > 1) {
    int device = 0;
    PREFIXATTN_CUDA_CHECK(cudaGetDevice(&device));
    groups = &group_streams(device, stream);
    PREFIXATTN_CUDA_CHECK(cudaEventRecord(groups->fork, stream));
  }
  // Chained launches: only serial groups, all on the caller's stream.
  const bool chain = o.chained && groups == nullptr;
  // The leaf launch finishes the plan's finished tokens when it runs after every other forward
  // launch: serial groups, the leaf kernel (head_dim <= 128), and a plan with such tokens (under
  // a fixed grid, any plan may have them). Otherwise their slots write partial rows and the
  // merge takes them.
  const bool finishing = o.finish && groups == nullptr && D <= 128 && (fixed || a.num_finished > 0);
  if (finishing) std::reverse(launches, launches + num_launches);
  p.finish = finishing ? 1 : 0;
  // The leaf kernel's one-column-block form, for a plan known on the host to have no 16-row
  // item of more than 8 rows (not under a fixed grid: a replay may run any plan). A finishing
  // leaf launch keeps the general form, which measured faster there (docs/dev/log.md v52).
  // Where the items average at most 3 tiles of 16 tokens (leaf_tiles, also from the host), the
  // short form: more warps, each a tile ahead, beat fewer warps two tiles ahead (v53).
  const bool narrow_leaf = !fixed && !finishing && a.leaf_max_rows >= 0 && a.leaf_max_rows <= 8;
  const bool short_leaf = narrow_leaf && a.leaf_tiles >= 0 &&
                          a.leaf_tiles <= static_cast<int64_t>(kLeafShortTiles) * variant_items[0];
  const int leaf_form = short_leaf ? kLeafShort : narrow_leaf ? kLeafNarrow : kLeafGeneral;
  // Launch bounds from the host's tile groups (items ordered by tile height), where the
  // caller says the device counts hold the same (host_counts) and no fixed grid reads them.
  int variant_begin[kNumVariants + 1] = {0};
  for (int v = 0; v < kNumVariants; ++v) variant_begin[v + 1] = variant_begin[v] + variant_items[v];
  const bool heights_sorted = std::is_sorted(a.tile_m, a.tile_m + a.num_tiles);
  p.host_range = o.host_counts && heights_sorted && !fixed ? 1 : 0;
  p.range_leaf_alone = variant_begin[kNumVariants] == variant_items[0] && a.num_merge_tokens == 0;
  const int64_t merge_tokens_run =
      finishing ? a.num_merge_tokens - a.num_finished : a.num_merge_tokens;
  const bool merge_runs = fixed ? fixed_launches(kNumVariants) : merge_tokens_run > 0;
  const bool half_dtype = a.dtype == DType::kFloat16;
  for (int i = 0; i < num_launches; ++i) {
    const int v = launches[i];
    p.variant = v;
    p.range_begin = variant_begin[v];
    p.range_end = variant_begin[v + 1];
    const int pairs = fixed ? -1 : variant_items[v] * hkv;
    cudaStream_t s = stream;
    if (groups != nullptr && i > 0) {
      s = groups->side[i - 1];
      PREFIXATTN_CUDA_CHECK(cudaStreamWaitEvent(s, groups->fork, 0));
    }
    // Every launch after the run's first is chained to the one before it.
    const bool link = chain && i > 0;
    p.chain_next = chain && (i + 1 < num_launches || merge_runs) ? 1 : 0;
    if (half_dtype)
      launch_forward_dim<half>(D, p, pairs, s, link, leaf_form);
    else
      launch_forward_dim<__nv_bfloat16>(D, p, pairs, s, link, leaf_form);
    if (s != stream) {
      PREFIXATTN_CUDA_CHECK(cudaEventRecord(groups->join[i - 1], s));
      PREFIXATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, groups->join[i - 1], 0));
    }
  }
  if (merge_runs) {
    MergeParams mp{};
    mp.partial_o = p.partial_o;
    mp.partial_lse = p.partial_lse;
    mp.out = p.out;
    mp.merge_tokens = a.merge_tokens.data;
    mp.merge_indptr = a.merge_indptr.data;
    mp.merge_partials = a.merge_partials.data;
    mp.counts = a.counts.data;
    mp.o_stride_t = p.o_stride_t;
    mp.o_stride_h = p.o_stride_h;
    mp.num_qo_heads = hq;
    mp.vec_out = reinterpret_cast<uintptr_t>(a.out) % 16 == 0 && a.o_stride_t % 8 == 0 &&
                 a.o_stride_h % 8 == 0;
    // The merge follows a forward launch of this run on the caller's stream (unless the plan
    // had none).
    const bool link = chain && num_launches > 0;
    mp.finish = p.finish;
    const int num_merge = fixed ? -1 : static_cast<int>(merge_tokens_run);
    if (half_dtype)
      launch_merge_dim<half>(D, mp, num_merge, stream, link);
    else
      launch_merge_dim<__nv_bfloat16>(D, mp, num_merge, stream, link);
  }
  PREFIXATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace prefixattn
