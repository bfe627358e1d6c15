// Host-side launch-plan construction: block table -> prefix forest -> packed work items.
//
// A torch-free implementation of prefixattn's `build_forest` (core/forest.py), `pack` and,
// on request, `finish_in_leaf` (core/packer.py). It produces the same arrays, in the same
// order, as those functions:
// see docs/architecture.md for the method and core/plan.py for the meaning of every array.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace prefixattn {
namespace plan {

enum class Packing { kMemory = 0, kNaive = 1, kPerQuery = 2 };

// Parses "memory", "naive" or "per_query"; throws std::invalid_argument otherwise.
Packing parse_packing(const std::string& name);

// Raised when a page id the plan reads does not fit in int32 (IndexError in Python).
class PageIdRangeError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

struct PlanParams {
  // Block table [batch, cols], row-major and contiguous; exactly one of the two is set.
  const int32_t* block_table32 = nullptr;
  const int64_t* block_table64 = nullptr;
  int64_t batch = 0;
  int64_t cols = 0;
  // KV length of each request [batch] (new tokens included) and query layout [batch + 1].
  const int64_t* seq_lens = nullptr;
  const int64_t* qo_indptr = nullptr;
  int64_t page_size = 1;
  // Requests without new tokens are left out of the forest (as PrefixAttention.plan does);
  // with false the forest is built from seq_lens as given.
  bool forest_skips_idle = true;
  // Batch shape (packer.BatchShape).
  int64_t num_qo_heads = 1;
  int64_t num_kv_heads = 1;
  int64_t head_dim = 128;
  int64_t elem_bytes = 2;
  // K and V bytes of `tokens` KV positions (packer.BatchShape.kv_bytes).
  int64_t kv_bytes(int64_t tokens) const {
    return tokens * 2 * num_kv_heads * head_dim * elem_bytes;
  }
  // A partial row's o (cache dtype) and fp32 log-sum-exp for `rows` rows, written once and read
  // once (packer.BatchShape.partial_bytes).
  int64_t partial_bytes(int64_t rows) const {
    return rows * num_qo_heads * (head_dim * elem_bytes + 4) * 2;
  }
  // Tile table (tiles.TileTable): ascending m sizes; n_by_kv_len as two parallel arrays.
  std::vector<int64_t> m_sizes;
  std::vector<int64_t> n_bounds;
  std::vector<int64_t> n_sizes;
  // An item of more than wide_rows rows and at least wide_kv_len KV tokens takes the largest
  // height (tiles.TileTable.wide_rows / wide_kv_len; wide_kv_len 0: off).
  int64_t wide_rows = 0;
  int64_t wide_kv_len = 0;
  Packing packing = Packing::kMemory;
  bool split_kv = true;
  // (item, KV head) pairs the GPU runs at once (its SM count): a long row chunk is split only
  // where its KV is more than twice its launch's share per SM (the KV tokens of the pairs of
  // its tile height / split_target), into parts of at most half that share and at least
  // min_split_tokens tokens. 0 splits every long item.
  int64_t split_target = 0;
  // No split part is shorter than this many KV tokens (PlanOptions.min_split_tokens, >= 1);
  // leaf_split_tokens instead where split_target > 0 and every row chunk takes the leaf kernel
  // (PlanOptions.leaf_split_tokens).
  int64_t min_split_tokens = 256;
  int64_t leaf_split_tokens = 64;
  // With split_target > 0: cut the split chunks of each tile height into fewer parts where the
  // launch's estimated makespan is shorter (packing.fill_waves).
  bool split_waves = true;
  // > 0: after packing, let the leaf launch finish the merged tokens it can
  // (packer.finish_in_leaf with leaf_warps = finish_leaf_warps: the items of 16-row tiles are the
  // leaf items; PlanResult::num_finished); 0: no finishing.
  int64_t finish_leaf_warps = 0;
};

// forest.PrefixForest, plus its children lists in CSR form: the children of node u are
// children[children_indptr[u] : children_indptr[u + 1]], in order.
struct Forest {
  int64_t page_size = 1;
  std::vector<int32_t> parent;
  std::vector<int32_t> page_begin;
  std::vector<int32_t> page_end;
  std::vector<int64_t> token_end;
  std::vector<int32_t> req_begin;
  std::vector<int32_t> req_end;
  std::vector<int32_t> order;
  std::vector<int32_t> ending_indptr;
  std::vector<int32_t> ending_reqs;
  std::vector<int32_t> children_indptr;
  std::vector<int32_t> children;

  // What build_plan built the forest from, checked when a later call reuses it: each
  // request's length in the forest (0: left out), the first page id of its row (0 for a
  // request left out) and the block table's columns.
  std::vector<int64_t> built_lens;
  std::vector<int64_t> built_first_page;
  int64_t built_cols = -1;

  int64_t num_nodes() const { return static_cast<int64_t>(parent.size()); }
  void clear();  // empties every array, keeping its capacity
};

// plan.PlanArrays, the tiles, and the byte accounting of `pack`.
struct PlanResult {
  Forest forest;
  std::vector<int32_t> kv_page_offset;
  std::vector<int32_t> kv_pages;
  std::vector<int32_t> kv_start;
  std::vector<int32_t> kv_len;
  std::vector<int32_t> q_indptr;
  std::vector<int32_t> q_tokens;
  std::vector<int32_t> q_limit;
  std::vector<int32_t> q_out;
  std::vector<int32_t> tile_id;
  std::vector<int32_t> tile_indptr;
  std::vector<int32_t> merge_tokens;
  std::vector<int32_t> merge_indptr;
  std::vector<int32_t> merge_partials;
  std::vector<int64_t> tile_m;  // tiles[t] = (tile_m[t], tile_n[t])
  std::vector<int64_t> tile_n;
  int64_t kv_bytes = 0;
  int64_t partial_bytes = 0;
  int64_t num_partials = 0;
  int64_t num_finished = 0;  // merged tokens the leaf launch finishes (the last of merge_tokens)

  void clear(
      bool keep_forest = false);  // empties every array (but the forest's), keeping its capacity
};

// build_forest(block_table, lens, page_size) on a row-major int32 table.
Forest build_forest(const int32_t* block_table, int64_t batch, int64_t cols, const int64_t* lens,
                    int64_t page_size);

// The same into `forest`, reusing its arrays' capacity.
void build_forest(const int32_t* block_table, int64_t batch, int64_t cols, const int64_t* lens,
                  int64_t page_size, Forest& forest);

// build_forest followed by pack, as PrefixAttention.plan calls them.
PlanResult build_plan(const PlanParams& params);

// The same into `out`, reusing its arrays' capacity (a caller that plans every step can keep
// one PlanResult). With reuse_forest, `out.forest` must be the forest of the same block table,
// lengths, query layout and page size (an earlier call with other tile tables): only the
// packing runs again.
void build_plan(const PlanParams& params, PlanResult& out, bool reuse_forest = false);

}  // namespace plan
}  // namespace prefixattn
