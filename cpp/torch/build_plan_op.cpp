// prefixattn::build_plan: the host plan builder (cpp/plan/plan_builder.h) as a CPU torch op.
//
// Returns three CPU tensors:
//   ints:     int32, the int32 arrays of the forest and the plan except kv_pages,
//             concatenated in the order of int32_fields() below;
//   meta:     int64, [sizes of those arrays (kNumInt32Fields), kv_bytes, partial_bytes,
//             num_partials, num_tiles, tile m sizes (num_tiles), tile n sizes (num_tiles),
//             forest token_end (num_nodes)];
//   kv_pages: int32, the plan's page ids (the largest array, handed over without a copy).
// core/native_plan.py splits them back into a PrefixForest, PlanArrays, tiles, tile_indptr
// and the accounting dict.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <vector>

#include "plan/plan_builder.h"

namespace prefixattn {
namespace plan {
namespace {

// Order of the int32 arrays in the `ints` output (mirrored in core/native_plan.py).
constexpr int kNumInt32Fields = 22;

std::vector<const std::vector<int32_t>*> int32_fields(const PlanResult& r) {
  const Forest& f = r.forest;
  return {&f.parent,         &f.page_begin,    &f.page_end,    &f.req_begin,       &f.req_end,
          &f.order,          &f.ending_indptr, &f.ending_reqs, &f.children_indptr, &f.children,
          &r.kv_page_offset, &r.kv_start,      &r.kv_len,      &r.q_indptr,        &r.q_tokens,
          &r.q_limit,        &r.q_out,         &r.tile_id,     &r.tile_indptr,     &r.merge_tokens,
          &r.merge_indptr,   &r.merge_partials};
}

at::Tensor as_long(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "build_plan: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == dim, "build_plan: ", name, " must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type()) &&
                  t.scalar_type() != at::kBool,
              "build_plan: ", name, " must be an integer tensor, got ", t.scalar_type());
  return t.to(at::kLong).contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_plan_op(
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& qo_indptr,
    int64_t page_size, int64_t num_qo_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t elem_bytes, at::IntArrayRef m_sizes, at::IntArrayRef n_bounds, at::IntArrayRef n_sizes,
    c10::string_view packing, bool split_kv, int64_t split_target, bool forest_skips_idle,
    int64_t wide_rows, int64_t wide_kv_len, bool reuse_forest, int64_t finish_leaf_warps,
    bool split_waves, int64_t min_split_tokens, int64_t leaf_split_tokens) {
  TORCH_CHECK(block_table.device().is_cpu(), "build_plan: block_table must be a CPU tensor");
  TORCH_CHECK(block_table.dim() == 2, "build_plan: block_table must be 2-D, got ",
              block_table.dim(), "-D");
  at::Tensor table = block_table;
  if (table.scalar_type() != at::kInt && table.scalar_type() != at::kLong) {
    table = as_long(table, "block_table", 2);
  }
  table = table.contiguous();
  const at::Tensor lens = as_long(seq_lens, "seq_lens", 1);
  const at::Tensor indptr = as_long(qo_indptr, "qo_indptr", 1);
  const int64_t batch = table.size(0);
  TORCH_CHECK(lens.size(0) == batch, "build_plan: seq_lens has ", lens.size(0),
              " entries but block_table has ", batch, " rows");
  TORCH_CHECK(indptr.size(0) == batch + 1, "build_plan: qo_indptr must have B+1 = ", batch + 1,
              " entries, got ", indptr.size(0));
  TORCH_CHECK(page_size > 0, "build_plan: page_size must be positive");
  TORCH_CHECK(num_qo_heads > 0 && num_kv_heads > 0 && num_qo_heads % num_kv_heads == 0,
              "build_plan: num_qo_heads must be a positive multiple of num_kv_heads");

  PlanParams p;
  if (table.scalar_type() == at::kInt) {
    p.block_table32 = table.data_ptr<int32_t>();
  } else {
    p.block_table64 = table.data_ptr<int64_t>();
  }
  p.batch = batch;
  p.cols = table.size(1);
  p.seq_lens = lens.data_ptr<int64_t>();
  p.qo_indptr = indptr.data_ptr<int64_t>();
  p.page_size = page_size;
  p.forest_skips_idle = forest_skips_idle;
  p.num_qo_heads = num_qo_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.elem_bytes = elem_bytes;
  p.m_sizes.assign(m_sizes.begin(), m_sizes.end());
  p.n_bounds.assign(n_bounds.begin(), n_bounds.end());
  p.n_sizes.assign(n_sizes.begin(), n_sizes.end());
  TORCH_CHECK_VALUE(wide_rows >= 0 && wide_kv_len >= 0,
                    "build_plan: wide_rows and wide_kv_len "
                    "must be >= 0, got ",
                    wide_rows, " and ", wide_kv_len);
  p.wide_rows = wide_rows;
  p.wide_kv_len = wide_kv_len;
  p.split_kv = split_kv;
  TORCH_CHECK_VALUE(split_target >= 0, "build_plan: split_target must be >= 0, got ", split_target);
  p.split_target = split_target;
  p.split_waves = split_waves;
  TORCH_CHECK_VALUE(min_split_tokens >= 1, "build_plan: min_split_tokens must be >= 1, got ",
                    min_split_tokens);
  p.min_split_tokens = min_split_tokens;
  TORCH_CHECK_VALUE(leaf_split_tokens >= 1, "build_plan: leaf_split_tokens must be >= 1, got ",
                    leaf_split_tokens);
  p.leaf_split_tokens = leaf_split_tokens;
  TORCH_CHECK_VALUE(finish_leaf_warps >= 0, "build_plan: finish_leaf_warps must be >= 0, got ",
                    finish_leaf_warps);
  p.finish_leaf_warps = finish_leaf_warps;

  // Kept across calls: the next plan reuses its arrays' memory, and with reuse_forest the
  // forest of this thread's previous call (PrefixAttention.plan packs one batch with up to three
  // tile tables). The key is a guard: a call whose inputs are not the previous call's buffers
  // and sizes builds its forest anew.
  static thread_local PlanResult r;
  struct ForestKey {
    const void* table = nullptr;
    const void* lens = nullptr;
    const void* indptr = nullptr;
    int64_t batch = -1, cols = -1, page_size = -1;
    bool wide = false, skips = false;
    bool operator==(const ForestKey& o) const {
      return table == o.table && lens == o.lens && indptr == o.indptr && batch == o.batch &&
             cols == o.cols && page_size == o.page_size && wide == o.wide && skips == o.skips;
    }
  };
  static thread_local ForestKey last;
  static thread_local bool have_last = false;
  const ForestKey key{block_table.data_ptr(),
                      seq_lens.data_ptr(),
                      qo_indptr.data_ptr(),
                      batch,
                      p.cols,
                      page_size,
                      table.scalar_type() == at::kLong,
                      forest_skips_idle};
  const bool reuse = reuse_forest && have_last && key == last;
  have_last = false;  // until this call has built its forest
  try {
    p.packing = parse_packing(std::string(packing.data(), packing.size()));
    build_plan(p, r, reuse);
  } catch (const PageIdRangeError& e) {
    TORCH_CHECK_INDEX(false, e.what());
  } catch (const std::out_of_range& e) {
    TORCH_CHECK_INDEX(false, "build_plan: ", e.what());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "build_plan: ", e.what());
  }
  last = key;
  have_last = true;

  const auto fields = int32_fields(r);
  int64_t total = 0;
  for (const auto* v : fields) total += static_cast<int64_t>(v->size());
  at::Tensor ints = at::empty({total}, at::TensorOptions().dtype(at::kInt));
  int32_t* dst = ints.data_ptr<int32_t>();
  for (const auto* v : fields) {
    if (!v->empty()) std::memcpy(dst, v->data(), v->size() * sizeof(int32_t));
    dst += v->size();
  }
  const int64_t num_tiles = static_cast<int64_t>(r.tile_m.size());
  const int64_t num_nodes = r.forest.num_nodes();
  at::Tensor meta = at::empty({kNumInt32Fields + 5 + 2 * num_tiles + num_nodes},
                              at::TensorOptions().dtype(at::kLong));
  int64_t* m = meta.data_ptr<int64_t>();
  for (const auto* v : fields) *m++ = static_cast<int64_t>(v->size());
  *m++ = r.kv_bytes;
  *m++ = r.partial_bytes;
  *m++ = r.num_partials;
  *m++ = r.num_finished;
  *m++ = num_tiles;
  for (int64_t t = 0; t < num_tiles; ++t) *m++ = r.tile_m[t];
  for (int64_t t = 0; t < num_tiles; ++t) *m++ = r.tile_n[t];
  if (num_nodes > 0) std::memcpy(m, r.forest.token_end.data(), num_nodes * sizeof(int64_t));
  at::Tensor pages;
  if (r.kv_pages.empty()) {
    pages = at::empty({0}, at::TensorOptions().dtype(at::kInt));
  } else {
    // Handed over without a copy (the next call grows a new array).
    auto* owner = new std::vector<int32_t>(std::move(r.kv_pages));
    r.kv_pages = std::vector<int32_t>();
    pages = at::from_blob(
        owner->data(), {static_cast<int64_t>(owner->size())}, [owner](void*) { delete owner; },
        at::TensorOptions().dtype(at::kInt));
  }
  return {ints, meta, pages};
}

}  // namespace
}  // namespace plan
}  // namespace prefixattn

TORCH_LIBRARY_FRAGMENT(prefixattn, m) {
  m.def(
      "build_plan(Tensor block_table, Tensor seq_lens, Tensor qo_indptr, int page_size, "
      "int num_qo_heads, int num_kv_heads, int head_dim, int elem_bytes, int[] m_sizes, "
      "int[] n_bounds, int[] n_sizes, str packing, bool split_kv, int split_target, "
      "bool forest_skips_idle, int wide_rows=0, int wide_kv_len=0, bool reuse_forest=False, "
      "int finish_leaf_warps=0, bool split_waves=False, int min_split_tokens=256, "
      "int leaf_split_tokens=64) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(prefixattn, CPU, m) { m.impl("build_plan", &prefixattn::plan::build_plan_op); }
