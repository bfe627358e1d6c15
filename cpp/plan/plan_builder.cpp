// Launch-plan construction on the host; see plan_builder.h.
//
// Every step mirrors core/forest.py `build_forest` and core/packer.py `pack`, including their
// orderings and tie-breaks (stable sorts, lexsorts, greedy merge order), so that both produce
// identical arrays. Integer divisions use Python's floor semantics.
#include "plan/plan_builder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

#include "prefixattn/plan_layout.h"

namespace prefixattn {
namespace plan {

namespace {

inline int64_t floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

inline int64_t ceildiv(int64_t a, int64_t b) { return -floordiv(-a, b); }

// packing.py SPLIT_SLACK.
constexpr int64_t kSplitSlack = 2;
// packing.py WAVE_PAIR_TOKENS: what a pair costs beside its KV tokens in split_waves' estimate.
constexpr int64_t kWavePairTokens = 256;
// packing.py WAVE_MAX_ROUNDS: split_waves looks only at launches of at most this many rounds.
constexpr int64_t kWaveMaxRounds = 8;
// Pairs per SM the split rule assumes for a tile height: the leaf kernel (16-row tiles at
// head_dim <= 128) runs 8 at once (2 blocks of 4 warps, a pair per warp); core/packer.py
// (pairs_per_sm) is the same rule.
constexpr int64_t kLeafPairsPerSm = 8;
inline int64_t pairs_per_sm(int64_t m, int64_t head_dim) {
  return m == 16 && head_dim <= 128 ? kLeafPairsPerSm : 1;
}

inline uint32_t bswap32(uint32_t x) {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_bswap32(x);
#else
  return (x >> 24) | ((x >> 8) & 0xff00u) | ((x << 8) & 0xff0000u) | (x << 24);
#endif
}

// First index in [c, e) where a and b differ, or e.
inline int64_t mismatch(const int32_t* a, const int32_t* b, int64_t c, int64_t e) {
  // Long equal runs are the common case (shared prefixes): compare in large blocks first.
  for (const int64_t block : {1024, 64}) {
    while (c + block <= e && std::memcmp(a + c, b + c, block * sizeof(int32_t)) == 0) c += block;
  }
  // Inside the block that differs: two ids at a time, then one.
  uint64_t x, y;
  while (c + 2 <= e) {
    std::memcpy(&x, a + c, sizeof(x));
    std::memcpy(&y, b + c, sizeof(y));
    if (x != y) break;
    c += 2;
  }
  while (c < e && a[c] == b[c]) ++c;
  return c;
}

// The rows of the table with pages, as forest.py sorts them: page ids + 1 as uint32, zero
// past each row's end, compared as little-endian byte strings.
class SortRows {
 public:
  SortRows(const int32_t* table, int64_t cols, const std::vector<int32_t>& rows,
           const std::vector<int64_t>& npg, int64_t width)
      : table_(table), cols_(cols), rows_(rows), npg_(npg), width_(width) {}

  const int32_t* row(int32_t r) const { return table_ + static_cast<int64_t>(rows_[r]) * cols_; }

  uint32_t key(int32_t r, int64_t c) const {
    return c < npg_[r] ? static_cast<uint32_t>(row(r)[c]) + 1u : 0u;
  }

  // First column in [from, to) where the keys of rows a and b differ, or `to`.
  int64_t first_diff(int32_t a, int32_t b, int64_t from, int64_t to) const {
    const int64_t na = npg_[a], nb = npg_[b];
    const int64_t m = std::min(na, nb), big = std::max(na, nb);
    const int64_t e1 = std::min(to, m);
    if (from < e1) {
      const int64_t c = mismatch(row(a), row(b), from, e1);
      if (c < e1) return c;
    }
    // Past the shorter row its keys are 0: equal only where the longer row holds id -1.
    const int32_t* longer = na > nb ? row(a) : row(b);
    const int64_t e2 = std::min(to, big);
    for (int64_t c = std::max(from, m); c < e2; ++c) {
      if (longer[c] != -1) return c;
    }
    return to;
  }

  // Stable sort of rows 0..n-1 (MSD, column by column); `first` gets, for each sorted
  // neighbour pair (i, i+1), the first column where their keys differ (width if none).
  void sort(std::vector<int32_t>& idx, std::vector<int64_t>& first) const {
    const int32_t n = static_cast<int32_t>(rows_.size());
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), 0);
    first.assign(n > 0 ? n - 1 : 0, width_);
    struct Task {
      int32_t lo, hi;
      int64_t depth;
    };
    std::vector<Task> todo;
    if (n > 1) todo.push_back({0, n, 0});
    struct Run {
      uint32_t key;
      int32_t begin, end;
    };
    std::vector<Run> runs;
    std::vector<int32_t> saved;
    while (!todo.empty()) {
      const Task t = todo.back();
      todo.pop_back();
      // Rows of a group agree on columns [0, depth) and are in ascending (input) order.
      const int32_t a = idx[t.lo];
      int64_t e = width_;
      for (int32_t k = t.lo + 1; k < t.hi && e > t.depth; ++k) {
        e = first_diff(a, idx[k], t.depth, e);
      }
      if (e >= width_) {
        for (int32_t k = t.lo; k + 1 < t.hi; ++k) first[k] = width_;
        continue;
      }
      // Order by the key at column e, ties in input order. Neighbours with equal keys (rows
      // sharing a deeper prefix usually sit together) move as one run.
      runs.clear();
      for (int32_t k = t.lo; k < t.hi; ++k) {
        const uint32_t kk = bswap32(key(idx[k], e));
        if (runs.empty() || runs.back().key != kk) {
          runs.push_back({kk, k, k + 1});
        } else {
          runs.back().end = k + 1;
        }
      }
      std::sort(runs.begin(), runs.end(), [](const Run& x, const Run& y) {
        return x.key != y.key ? x.key < y.key : x.begin < y.begin;
      });
      saved.assign(idx.begin() + t.lo, idx.begin() + t.hi);
      int32_t at = t.lo;
      for (size_t r = 0; r < runs.size();) {
        const int32_t start = at;
        size_t q = r;
        for (; q < runs.size() && runs[q].key == runs[r].key; ++q) {
          for (int32_t k = runs[q].begin; k < runs[q].end; ++k) idx[at++] = saved[k - t.lo];
        }
        if (at < t.hi) first[at - 1] = e;
        if (at - start > 1) todo.push_back({start, at, e + 1});
        r = q;
      }
    }
  }

 private:
  const int32_t* table_;
  int64_t cols_;
  const std::vector<int32_t>& rows_;
  const std::vector<int64_t>& npg_;
  int64_t width_;
};

}  // namespace

Packing parse_packing(const std::string& name) {
  if (name == "memory") return Packing::kMemory;
  if (name == "naive") return Packing::kNaive;
  if (name == "per_query") return Packing::kPerQuery;
  throw std::invalid_argument("unknown packing '" + name +
                              "'; expected one of memory, naive, per_query");
}

void build_forest(const int32_t* block_table, int64_t batch, int64_t cols, const int64_t* lens,
                  int64_t page_size, Forest& f) {
  if (page_size <= 0) throw std::invalid_argument("page_size must be positive");
  f.clear();
  f.page_size = page_size;
  std::vector<int32_t> rows;
  std::vector<int64_t> npg;
  rows.reserve(batch);
  npg.reserve(batch);
  int64_t width = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = floordiv(lens[b] + page_size - 1, page_size);
    if (n > 0) {
      rows.push_back(static_cast<int32_t>(b));
      npg.push_back(n);
      width = std::max(width, n);
    }
  }
  if (width > cols) {
    throw std::invalid_argument("seq_lens need " + std::to_string(width) +
                                " pages but block_table rows hold " + std::to_string(cols));
  }
  const int32_t n = static_cast<int32_t>(rows.size());

  std::vector<int32_t> idx;
  std::vector<int64_t> first;
  SortRows(block_table, cols, rows, npg, width).sort(idx, first);

  f.order.resize(n);
  std::vector<int64_t> npg_sorted(n);
  for (int32_t i = 0; i < n; ++i) {
    f.order[i] = rows[idx[i]];
    npg_sorted[i] = npg[idx[i]];
  }

  // The compressed trie from the LCPs of sorted neighbours, with a stack of the open path.
  auto& parent = f.parent;
  auto& pb = f.page_begin;
  auto& pe = f.page_end;
  auto& rb = f.req_begin;
  auto& re = f.req_end;
  for (auto* v : {&parent, &pb, &pe, &rb, &re}) v->reserve(2 * static_cast<size_t>(n));
  auto new_node = [&](int32_t par, int64_t begin, int64_t end, int32_t first_req) {
    const int32_t u = static_cast<int32_t>(parent.size());
    parent.push_back(par);
    pb.push_back(static_cast<int32_t>(begin));
    pe.push_back(static_cast<int32_t>(end));
    rb.push_back(first_req);
    re.push_back(-1);
    return u;
  };
  std::vector<int32_t> stack;
  std::vector<int32_t> end_node(n);
  for (int32_t i = 0; i < n; ++i) {
    int64_t shared = 0;
    if (i > 0) {
      shared = std::min(first[i - 1], std::min(npg_sorted[i], npg_sorted[i - 1]));
    }
    while (!stack.empty() && pb[stack.back()] >= shared) {
      re[stack.back()] = i;
      stack.pop_back();
    }
    if (!stack.empty() && pe[stack.back()] > shared) {
      // Split the node the two rows diverge inside: its shared head becomes a parent.
      const int32_t v = stack.back();
      stack.pop_back();
      const int32_t head = new_node(parent[v], pb[v], shared, rb[v]);
      parent[v] = head;
      pb[v] = static_cast<int32_t>(shared);
      re[v] = i;
      stack.push_back(head);
    }
    if (npg_sorted[i] > shared) {
      stack.push_back(new_node(stack.empty() ? -1 : stack.back(), shared, npg_sorted[i], i));
    }
    end_node[i] = stack.back();
  }
  for (int32_t u : stack) re[u] = n;
  const int32_t num_nodes = static_cast<int32_t>(parent.size());

  // Children in order: siblings cover disjoint runs of rows, listed by their first row.
  f.children_indptr.assign(num_nodes + 1, 0);
  for (int32_t u = 0; u < num_nodes; ++u) {
    if (parent[u] >= 0) ++f.children_indptr[parent[u] + 1];
  }
  for (int32_t u = 0; u < num_nodes; ++u) f.children_indptr[u + 1] += f.children_indptr[u];
  {
    std::vector<int32_t> by_first(n + 1, 0);
    for (int32_t u = 0; u < num_nodes; ++u) ++by_first[rb[u] + 1];
    for (int32_t i = 0; i < n; ++i) by_first[i + 1] += by_first[i];
    std::vector<int32_t> sorted(num_nodes);
    for (int32_t u = 0; u < num_nodes; ++u) sorted[by_first[rb[u]]++] = u;
    std::vector<int32_t> fill(f.children_indptr.begin(), f.children_indptr.end() - 1);
    f.children.resize(num_nodes > 0 ? f.children_indptr[num_nodes] : 0);
    for (int32_t u : sorted) {
      if (parent[u] >= 0) f.children[fill[parent[u]]++] = u;
    }
  }

  // Requests ending at each node, and each node's token end.
  f.ending_indptr.assign(num_nodes + 1, 0);
  std::vector<int64_t> max_len(num_nodes, 0);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t u = end_node[i];
    ++f.ending_indptr[u + 1];
    max_len[u] = std::max(max_len[u], lens[f.order[i]]);
  }
  for (int32_t u = 0; u < num_nodes; ++u) f.ending_indptr[u + 1] += f.ending_indptr[u];
  f.ending_reqs.resize(n);
  {
    std::vector<int32_t> fill(f.ending_indptr.begin(), f.ending_indptr.end() - 1);
    for (int32_t i = 0; i < n; ++i) f.ending_reqs[fill[end_node[i]]++] = f.order[i];
  }
  f.token_end.resize(num_nodes);
  for (int32_t u = 0; u < num_nodes; ++u) {
    const bool has_kids = f.children_indptr[u + 1] > f.children_indptr[u];
    f.token_end[u] = has_kids ? static_cast<int64_t>(pe[u]) * page_size : max_len[u];
  }
}

Forest build_forest(const int32_t* block_table, int64_t batch, int64_t cols, const int64_t* lens,
                    int64_t page_size) {
  Forest f;
  build_forest(block_table, batch, cols, lens, page_size, f);
  return f;
}

namespace {

// Work items before layout (packer._Items).
struct Items {
  const int32_t* members = nullptr;
  std::vector<int64_t> page_begin;
  std::vector<int64_t> token_end;
  std::vector<int64_t> run_item;
  std::vector<int64_t> run_begin;
  std::vector<int64_t> run_end;

  void add_run(int64_t item, int64_t begin, int64_t end) {
    run_item.push_back(item);
    run_begin.push_back(begin);
    run_end.push_back(end);
  }
  void add_item(int64_t begin, int64_t end) {
    page_begin.push_back(begin);
    token_end.push_back(end);
  }
};

void items_memory(const Forest& f, const PlanParams& p, const std::vector<int64_t>& qo_len,
                  int64_t max_rows, double hold_len, Items& items) {
  items.members = f.order.data();
  const int64_t ps = f.page_size;
  const int64_t g = p.num_qo_heads / p.num_kv_heads;
  const int64_t partial_per_token = p.partial_bytes(1);
  const int64_t kv_per_position = p.kv_bytes(1);
  const int64_t num_nodes = f.num_nodes();
  const int64_t n = static_cast<int64_t>(f.order.size());
  std::vector<int64_t> csum(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) csum[i + 1] = csum[i] + qo_len[f.order[i]];
  std::vector<int64_t> below(num_nodes);
  for (int64_t u = 0; u < num_nodes; ++u) below[u] = csum[f.req_end[u]] - csum[f.req_begin[u]];
  const auto& ci = f.children_indptr;
  auto has_kids = [&](int32_t u) { return ci[u + 1] > ci[u]; };

  struct Frame {
    int32_t u;
    int64_t carried_begin, carried, rows, cursor, w;
    int32_t next;  // position of the next child in f.children
  };
  std::vector<Frame> frames;
  auto open = [&](int32_t u, int64_t carried_begin) {
    Frame fr;
    fr.u = u;
    fr.carried_begin = carried_begin;
    fr.carried = (f.token_end[u] - carried_begin * ps) * kv_per_position;
    fr.rows = below[u] * g;
    fr.cursor = f.req_begin[u];
    fr.w = static_cast<int64_t>(items.page_begin.size());
    fr.next = ci[u];
    items.add_item(carried_begin, f.token_end[u]);
    frames.push_back(fr);
  };
  auto leaf = [&](int32_t c, int64_t start) {
    items.add_run(static_cast<int64_t>(items.page_begin.size()), f.req_begin[c], f.req_end[c]);
    items.add_item(start, f.token_end[c]);
  };
  for (int32_t root = 0; root < num_nodes; ++root) {
    if (f.parent[root] >= 0) continue;
    if (!has_kids(root)) {
      leaf(root, f.page_begin[root]);
      continue;
    }
    open(root, f.page_begin[root]);
    while (!frames.empty()) {
      Frame& fr = frames.back();
      if (fr.next == ci[fr.u + 1]) {
        items.add_run(fr.w, fr.cursor, f.req_end[fr.u]);
        frames.pop_back();
        continue;
      }
      const int32_t c = f.children[fr.next++];
      const int64_t rows_c = below[c] * g;
      const int64_t saved =
          (ceildiv(fr.rows, max_rows) - ceildiv(fr.rows - rows_c, max_rows)) * fr.carried +
          below[c] * partial_per_token;
      int64_t start;
      if (static_cast<double>(f.token_end[c] - fr.carried_begin * ps) <= hold_len &&
          saved > ceildiv(rows_c, max_rows) * fr.carried) {
        fr.rows -= rows_c;
        items.add_run(fr.w, fr.cursor, f.req_begin[c]);
        fr.cursor = f.req_end[c];
        start = fr.carried_begin;
      } else {
        start = f.page_begin[c];
      }
      if (has_kids(c)) {
        open(c, start);  // invalidates fr
      } else {
        leaf(c, start);
      }
    }
  }
}

void items_naive(const Forest& f, Items& items) {
  items.members = f.order.data();
  const int64_t num_nodes = f.num_nodes();
  for (int64_t u = 0; u < num_nodes; ++u) {
    items.add_item(f.page_begin[u], f.token_end[u]);
    items.add_run(u, f.req_begin[u], f.req_end[u]);
  }
}

void items_per_query(const std::vector<int32_t>& rows, const std::vector<int64_t>& lens,
                     Items& items) {
  items.members = rows.data();
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t i = 0; i < n; ++i) {
    items.add_item(0, lens[rows[i]]);
    items.add_run(i, i, i + 1);
  }
}

// The tile table (tiles.TileTable): which height and width an item of `rows` rows and `len` KV
// tokens takes.
class TileTable {
 public:
  explicit TileTable(const PlanParams& p) : p_(p) {}
  int64_t num_heights() const { return static_cast<int64_t>(p_.m_sizes.size()); }
  int64_t max_rows() const { return p_.m_sizes.back(); }
  // tiles.TileTable.height_index.
  int64_t height_of(int64_t rows, int64_t len) const {
    const int64_t last = num_heights() - 1;
    if (p_.wide_kv_len > 0 && rows > p_.wide_rows && len >= p_.wide_kv_len) return last;
    return std::min<int64_t>(
        std::lower_bound(p_.m_sizes.begin(), p_.m_sizes.end(), rows) - p_.m_sizes.begin(), last);
  }
  int64_t width_of(int64_t len) const {
    const int64_t last = static_cast<int64_t>(p_.n_bounds.size()) - 1;
    return std::min<int64_t>(
        std::lower_bound(p_.n_bounds.begin(), p_.n_bounds.end(), len) - p_.n_bounds.begin(), last);
  }
  // Tiles are keyed m * kTileKey + n (n < kTileKey, checked by check_tile_table).
  int64_t key(int64_t height, int64_t width) const {
    return p_.m_sizes[height] * kTileKey + p_.n_sizes[width];
  }
  static constexpr int64_t kTileKey = 65536;

 private:
  const PlanParams& p_;
};

// Long-KV split length: the mean KV length of the nodes that serve tokens (of the requests with
// new tokens for per_query), at least min_split_tokens; infinite without split_kv.
double split_length(const PlanParams& p, const Forest& f, const std::vector<int64_t>& lens,
                    const std::vector<int64_t>& qo_len) {
  if (!p.split_kv) return std::numeric_limits<double>::infinity();
  int64_t total = 0, count = 0;
  if (p.packing == Packing::kPerQuery) {
    for (int64_t b = 0; b < p.batch; ++b) {
      if (qo_len[b] > 0) {
        total += lens[b];
        ++count;
      }
    }
  } else {
    const int64_t n = static_cast<int64_t>(f.order.size());
    std::vector<int64_t> csum(n + 1, 0);
    for (int64_t i = 0; i < n; ++i) csum[i + 1] = csum[i] + qo_len[f.order[i]];
    for (int64_t u = 0; u < f.num_nodes(); ++u) {
      if (csum[f.req_end[u]] - csum[f.req_begin[u]] > 0) {
        total += f.token_end[u] - static_cast<int64_t>(f.page_begin[u]) * p.page_size;
        ++count;
      }
    }
  }
  if (count == 0) return std::numeric_limits<double>::infinity();
  return std::max(static_cast<double>(total) / static_cast<double>(count),
                  static_cast<double>(p.min_split_tokens));
}

// The work items of the packing strategy (packer._Items).
void collect_items(const PlanParams& p, const Forest& f, const std::vector<int64_t>& lens,
                   const std::vector<int64_t>& qo_len, int64_t max_rows, double hold_len,
                   std::vector<int32_t>& pq_rows, Items& items) {
  switch (p.packing) {
    case Packing::kMemory: items_memory(f, p, qo_len, max_rows, hold_len, items); break;
    case Packing::kNaive: items_naive(f, items); break;
    case Packing::kPerQuery:
      for (int64_t b = 0; b < p.batch; ++b) {
        if (floordiv(lens[b] + p.page_size - 1, p.page_size) > 0) {
          pq_rows.push_back(static_cast<int32_t>(b));
        }
      }
      items_per_query(pq_rows, lens, items);
      break;
  }
}

// Query slots (token, causal limit) of every item, item by item.
struct Slots {
  std::vector<int64_t> item, tok, lim, req;
  int64_t size() const { return static_cast<int64_t>(item.size()); }
};

// Step 1: the slots of each item's runs of requests (runs stably sorted by item); a token
// whose causal limit does not reach past the item's first position sees none of its KV.
void query_slots(const Items& items, const std::vector<int64_t>& it_begin,
                 const std::vector<int64_t>& lens, const std::vector<int64_t>& qo_indptr,
                 const std::vector<int64_t>& qo_len, int64_t num_tokens, Slots& slots) {
  const int64_t n_items = static_cast<int64_t>(items.page_begin.size());
  const int64_t n_runs = static_cast<int64_t>(items.run_item.size());
  std::vector<int64_t> run_order(n_runs);
  {
    std::vector<int64_t> fill(n_items + 1, 0);
    for (int64_t r = 0; r < n_runs; ++r) ++fill[items.run_item[r] + 1];
    for (int64_t i = 0; i < n_items; ++i) fill[i + 1] += fill[i];
    for (int64_t r = 0; r < n_runs; ++r) run_order[fill[items.run_item[r]]++] = r;
  }
  for (auto* v : {&slots.item, &slots.tok, &slots.lim, &slots.req}) {
    v->reserve(2 * static_cast<size_t>(std::max<int64_t>(num_tokens, 0)) + 16);
  }
  for (int64_t r : run_order) {
    const int64_t item = items.run_item[r];
    const int64_t first_pos = it_begin[item];
    for (int64_t pos = items.run_begin[r]; pos < items.run_end[r]; ++pos) {
      const int64_t req = items.members[pos];
      const int64_t nq = qo_len[req];
      const int64_t base_lim = lens[req] - nq + 1;
      for (int64_t within = 0; within < nq; ++within) {
        const int64_t lim = base_lim + within;
        if (lim > first_pos) {
          slots.item.push_back(item);
          slots.tok.push_back(qo_indptr[req] + within);
          slots.lim.push_back(lim);
          slots.req.push_back(req);
        }
      }
    }
  }
}

// Row chunks: runs of at most max_tokens consecutive slots of one item. Chunk c holds slots
// first[c] .. first[c + 1] - 1 and reads the item's KV [begin[c], end[c]).
struct Chunks {
  std::vector<int64_t> item, req, begin, end, first;
  int64_t size() const { return static_cast<int64_t>(item.size()); }
  int64_t len(int64_t c) const { return end[c] - begin[c]; }
  int64_t slots(int64_t c) const { return first[c + 1] - first[c]; }
};

// Step 2.
void row_chunks(const Slots& slots, const std::vector<int64_t>& it_begin,
                const std::vector<int64_t>& it_tok_end, int64_t max_tokens, Chunks& chunks) {
  for (auto* v : {&chunks.item, &chunks.req, &chunks.begin, &chunks.end, &chunks.first}) {
    v->reserve(it_begin.size() + 1);
  }
  const int64_t n_slots = slots.size();
  int64_t prev = -1, rank = 0;
  for (int64_t s = 0; s < n_slots; ++s) {
    if (slots.item[s] != prev) {
      prev = slots.item[s];
      rank = 0;
    }
    if (rank == max_tokens) rank = 0;
    if (rank == 0) {
      chunks.item.push_back(prev);
      chunks.req.push_back(slots.req[s]);
      chunks.begin.push_back(it_begin[prev]);
      chunks.end.push_back(slots.lim[s]);
      chunks.first.push_back(s);
    } else {
      chunks.end.back() = std::max(chunks.end.back(), slots.lim[s]);
    }
    ++rank;
  }
  chunks.first.push_back(n_slots);
  for (int64_t c = 0; c < chunks.size(); ++c) {
    chunks.end[c] = std::min(it_tok_end[chunks.item[c]], chunks.end[c]);
  }
}

// Parts of chunks after the long-KV split: part q of chunk chunk[q] reads [begin[q], end[q])
// for its num_slots[q] slots pair_slot[pair_first[q] .. pair_first[q + 1]).
struct Parts {
  std::vector<int64_t> chunk, begin, end, num_slots, pair_first;
  std::vector<int64_t> pair_slot;
  int64_t size() const { return static_cast<int64_t>(begin.size()); }
};

// How many parts the split rule cuts chunk `c` into (step 3). The products are formed in 128
// bits: split_target is the caller's, and len * slots exceeds int64 from about 1e13 on.
int64_t num_parts(const PlanParams& p, const TileTable& tiles, const Chunks& chunks, int64_t c,
                  int64_t g, double split_len, const std::vector<int64_t>& launch_len,
                  int64_t floor_tokens) {
  if (!p.split_kv) return 1;
  const int64_t len = chunks.len(c);
  const int64_t pages = ceildiv(len, p.page_size);
  const int64_t parts = std::max<int64_t>(
      std::min(static_cast<int64_t>(std::ceil(static_cast<double>(len) / split_len)), pages), 1);
  if (p.split_target <= 0) return parts;
  using wide = __int128;
  const int64_t h = tiles.height_of(chunks.slots(c) * g, len);
  const int64_t share = p.num_kv_heads * launch_len[h];  // x slots
  const int64_t per_sm = pairs_per_sm(p.m_sizes[h], p.head_dim);
  const wide slots = static_cast<wide>(p.split_target) * per_sm;
  if (static_cast<wide>(len) * slots <= static_cast<wide>(kSplitSlack) * share) return 1;
  // Leaf chunks (one warp per pair) are cut by the balance alone, not by the split length:
  // one long request would otherwise keep a single part.
  const int64_t cap = per_sm > 1 ? pages : parts;
  const wide divisor = std::max<int64_t>(share, 1);
  const wide balanced = (static_cast<wide>(kSplitSlack) * slots * len + divisor - 1) / divisor;
  const int64_t bound = std::min<int64_t>(cap, std::max<int64_t>(floordiv(len, floor_tokens), 1));
  return balanced < bound ? static_cast<int64_t>(balanced) : bound;
}

// packing.part_bounds: part k of `n` page-aligned parts (equal page counts, +-1) of a chunk of
// `len` KV tokens, as [begin, end) relative to the chunk's start.
std::pair<int64_t, int64_t> part_bounds(int64_t len, int64_t n, int64_t k, int64_t page_size) {
  const int64_t pages = ceildiv(len, page_size);
  return {floordiv(k * pages, n) * page_size,
          std::min(len, floordiv((k + 1) * pages, n) * page_size)};
}

// packing.launch_makespan: the estimated makespan, in KV tokens, of one launch whose chunks of
// KV lengths `lens` are cut into `parts` page-aligned parts, `heads` pairs per part run
// item-fastest in longest-first order over ceil(pairs / rounds) blocks, rounds = ceil(pairs /
// slots); each pair costs its tokens plus kWavePairTokens.
int64_t launch_makespan(const std::vector<int64_t>& lens, const std::vector<int64_t>& parts,
                        int64_t heads, int64_t slots, int64_t page_size) {
  std::vector<int64_t> cost;
  for (size_t c = 0; c < lens.size(); ++c) {
    for (int64_t k = 0; k < parts[c]; ++k) {
      const auto [begin, end] = part_bounds(lens[c], parts[c], k, page_size);
      cost.push_back(end - begin + kWavePairTokens);
    }
  }
  const int64_t items = static_cast<int64_t>(cost.size());
  const int64_t n = items * heads;
  if (n == 0) return 0;
  std::sort(cost.begin(), cost.end(), std::greater<int64_t>());
  const int64_t rounds = ceildiv(n, std::min(slots, n));
  const int64_t blocks = ceildiv(n, rounds);
  std::vector<int64_t> load(blocks, 0);
  for (int64_t j = 0; j < n; ++j) load[j % blocks] += cost[j % items];
  return *std::max_element(load.begin(), load.end());
}

// packing.fill_waves: for each tile height with split chunks whose launch takes 2 to
// kWaveMaxRounds rounds, scale every split chunk's parts by k x slots / pairs (k = 1 .. rounds -
// 1: k full rounds; at least 1, at most the rule's) and keep the choice with the shortest
// launch_makespan (ties: fewer parts).
void fill_waves(const PlanParams& p, const std::vector<int64_t>& height,
                const std::vector<int64_t>& len, std::vector<int64_t>& parts) {
  using wide = __int128;
  const int64_t n_chunks = static_cast<int64_t>(parts.size());
  for (int64_t h = 0; h < static_cast<int64_t>(p.m_sizes.size()); ++h) {
    std::vector<int64_t> member;
    bool split = false;
    for (int64_t c = 0; c < n_chunks; ++c) {
      if (height[c] != h) continue;
      member.push_back(c);
      split = split || parts[c] > 1;
    }
    if (!split) continue;
    std::vector<int64_t> lens, pp;
    int64_t total = 0;
    for (int64_t c : member) {
      lens.push_back(len[c]);
      pp.push_back(parts[c]);
      total += parts[c];
    }
    const int64_t n = p.num_kv_heads * total;
    const wide slots_w = static_cast<wide>(p.split_target) * pairs_per_sm(p.m_sizes[h], p.head_dim);
    if (slots_w >= n) continue;  // one round already
    const int64_t s = static_cast<int64_t>(slots_w);
    const int64_t rounds = ceildiv(n, s);
    if (rounds > kWaveMaxRounds) continue;
    std::vector<int64_t> best = pp;
    int64_t best_cost = launch_makespan(lens, pp, p.num_kv_heads, s, p.page_size);
    int64_t best_sum = total;
    for (int64_t k = 1; k < rounds; ++k) {
      std::vector<int64_t> cand(pp.size());
      int64_t sum = 0;
      for (size_t i = 0; i < pp.size(); ++i) {
        cand[i] = pp[i] > 1 ? std::clamp<int64_t>(pp[i] * k * s / n, 1, pp[i]) : pp[i];
        sum += cand[i];
      }
      const int64_t cost = launch_makespan(lens, cand, p.num_kv_heads, s, p.page_size);
      if (cost < best_cost || (cost == best_cost && sum < best_sum)) {
        best = cand;
        best_cost = cost;
        best_sum = sum;
      }
    }
    for (size_t i = 0; i < member.size(); ++i) parts[member[i]] = best[i];
  }
}

// Step 3: long-KV split into equal page-aligned parts; each part's visible slots. With a split
// target, only chunks whose KV is more than kSplitSlack times their launch's share per SM (the
// KV tokens of the chunks of their tile height x KV heads / split_target) are cut, into parts
// no longer than 1 / kSplitSlack of that share and no shorter than the split floor
// (leaf_split_tokens where every chunk takes the leaf kernel, else min_split_tokens); with
// split_waves, fill_waves may then cut them into fewer.
void split_parts(const PlanParams& p, const TileTable& tiles, const Slots& slots,
                 const Chunks& chunks, int64_t g, double split_len, Parts& parts) {
  const int64_t ps = p.page_size;
  const int64_t n_chunks = chunks.size();
  std::vector<int64_t> launch_len(tiles.num_heights(), 0);
  // The split floor: leaf_split_tokens where every chunk takes the leaf kernel (one warp per
  // pair), else min_split_tokens (packing.pack, the same rule).
  bool leaf_only = n_chunks > 0;
  if (p.split_kv && p.split_target > 0) {
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int64_t h = tiles.height_of(chunks.slots(c) * g, chunks.len(c));
      launch_len[h] += chunks.len(c);
      leaf_only = leaf_only && pairs_per_sm(p.m_sizes[h], p.head_dim) > 1;
    }
  }
  const int64_t floor_tokens = leaf_only ? p.leaf_split_tokens : p.min_split_tokens;
  std::vector<int64_t> chunk_parts(n_chunks);
  for (int64_t c = 0; c < n_chunks; ++c) {
    chunk_parts[c] = num_parts(p, tiles, chunks, c, g, split_len, launch_len, floor_tokens);
  }
  if (p.split_kv && p.split_target > 0 && p.split_waves) {
    std::vector<int64_t> height(n_chunks), len(n_chunks);
    for (int64_t c = 0; c < n_chunks; ++c) {
      len[c] = chunks.len(c);
      height[c] = tiles.height_of(chunks.slots(c) * g, len[c]);
    }
    fill_waves(p, height, len, chunk_parts);
  }
  for (auto* v : {&parts.chunk, &parts.begin, &parts.end, &parts.num_slots, &parts.pair_first}) {
    v->reserve(2 * static_cast<size_t>(n_chunks) + 1);
  }
  parts.pair_slot.reserve(2 * static_cast<size_t>(slots.size()));
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t n = chunk_parts[c];
    for (int64_t k = 0; k < n; ++k) {
      const auto [rel_begin, rel_end] = part_bounds(chunks.len(c), n, k, ps);
      const int64_t begin = chunks.begin[c] + rel_begin;
      int64_t end = chunks.begin[c] + rel_end;
      const int64_t first_pair = static_cast<int64_t>(parts.pair_slot.size());
      int64_t furthest = std::numeric_limits<int64_t>::min();
      for (int64_t s = chunks.first[c]; s < chunks.first[c + 1]; ++s) {
        if (slots.lim[s] > begin) {
          parts.pair_slot.push_back(s);
          furthest = std::max(furthest, slots.lim[s]);
        }
      }
      const int64_t count = static_cast<int64_t>(parts.pair_slot.size()) - first_pair;
      if (count > 0) end = std::min(end, furthest);
      parts.chunk.push_back(c);
      parts.begin.push_back(begin);
      parts.end.push_back(end);
      parts.num_slots.push_back(count);
      parts.pair_first.push_back(first_pair);
    }
  }
  parts.pair_first.push_back(static_cast<int64_t>(parts.pair_slot.size()));
}

// Step 4: the work items are the parts with slots, grouped by tile, longest first inside a
// group. Returns the parts in item order; fills the plan's tiles, tile_id and tile_indptr.
std::vector<int64_t> group_tiles(const TileTable& tiles, const Parts& parts, int64_t g,
                                 PlanResult& out) {
  std::vector<int64_t> alive, alive_key;
  for (int64_t q = 0; q < parts.size(); ++q) {
    if (parts.num_slots[q] <= 0) continue;
    const int64_t len = parts.end[q] - parts.begin[q];
    alive.push_back(q);
    alive_key.push_back(
        tiles.key(tiles.height_of(parts.num_slots[q] * g, len), tiles.width_of(len)));
  }
  std::vector<int64_t> used(alive_key.begin(), alive_key.end());
  std::sort(used.begin(), used.end());
  used.erase(std::unique(used.begin(), used.end()), used.end());
  const int64_t n_alive = static_cast<int64_t>(alive.size());
  std::vector<int64_t> tid_alive(n_alive);
  for (int64_t k = 0; k < n_alive; ++k) {
    tid_alive[k] = std::lower_bound(used.begin(), used.end(), alive_key[k]) - used.begin();
  }
  // By tile, then longest first, then position (a stable sort on the first two).
  struct Order {
    int64_t tid, neg_len, pos;
    bool operator<(const Order& o) const {
      if (tid != o.tid) return tid < o.tid;
      if (neg_len != o.neg_len) return neg_len < o.neg_len;
      return pos < o.pos;
    }
  };
  std::vector<Order> by_tile(n_alive);
  for (int64_t k = 0; k < n_alive; ++k) {
    by_tile[k] = {tid_alive[k], parts.begin[alive[k]] - parts.end[alive[k]], k};
  }
  std::sort(by_tile.begin(), by_tile.end());
  const int64_t num_tiles = static_cast<int64_t>(used.size());
  for (int64_t k : used) {
    out.tile_m.push_back(floordiv(k, TileTable::kTileKey));
    out.tile_n.push_back(k - floordiv(k, TileTable::kTileKey) * TileTable::kTileKey);
  }
  std::vector<int64_t> item_part(n_alive);
  out.tile_id.resize(n_alive);
  out.tile_indptr.assign(num_tiles + 1, 0);
  for (int64_t w = 0; w < n_alive; ++w) {
    const int64_t k = by_tile[w].pos;
    item_part[w] = alive[k];
    out.tile_id[w] = static_cast<int32_t>(tid_alive[k]);
    ++out.tile_indptr[tid_alive[k] + 1];
  }
  for (int64_t t = 0; t < num_tiles; ++t) out.tile_indptr[t + 1] += out.tile_indptr[t];
  return item_part;
}

// Step 5: each item's KV run and pages: a run of its representative request's block-table row.
// Items that read overlapping or adjacent columns of one row share one stored run (runs in
// (row, first column) order), so the page ids stored are at most the block table's used
// entries. Returns the KV tokens of all items. Throws PageIdRangeError for a page id the plan
// reads that is negative or beyond int32.
int64_t gather_pages(const PlanParams& p, const Parts& parts, const Chunks& chunks,
                     const std::vector<int64_t>& item_part, PlanResult& out) {
  const int64_t ps = p.page_size;
  const int64_t num_items = static_cast<int64_t>(item_part.size());
  out.kv_page_offset.assign(num_items, 0);
  out.kv_start.resize(num_items);
  out.kv_len.resize(num_items);
  struct Read {
    int64_t row, col, end, item;
  };
  std::vector<Read> reads;
  reads.reserve(num_items);
  int64_t total_len = 0;
  for (int64_t w = 0; w < num_items; ++w) {
    const int64_t q = item_part[w];
    const int64_t len = parts.end[q] - parts.begin[q];
    out.kv_start[w] = static_cast<int32_t>(parts.begin[q]);
    out.kv_len[w] = static_cast<int32_t>(len);
    total_len += len;
    const int64_t npages = ceildiv(len, ps);
    if (npages <= 0) continue;
    const int64_t row = chunks.req[parts.chunk[q]];
    const int64_t col = floordiv(parts.begin[q], ps);
    if (col < 0 || col + npages > p.cols || row < 0 || row >= p.batch) {
      throw std::out_of_range("work item reads past the block table");
    }
    reads.push_back({row, col, col + npages, w});
  }
  std::sort(reads.begin(), reads.end(), [](const Read& a, const Read& b) {
    return a.row != b.row ? a.row < b.row : a.col < b.col;
  });
  auto bad_page = [&](int64_t row, int64_t col, int64_t id) {
    const char* what = id < 0 ? "a negative page id" : "a page id beyond int32 range";
    return PageIdRangeError("block_table[" + std::to_string(row) + ", " + std::to_string(col) +
                            "] = " + std::to_string(id) + " is " + what);
  };
  auto store_run = [&](int64_t row, int64_t col, int64_t end) {
    const int64_t npages = end - col;
    if (p.block_table32 != nullptr) {
      const int32_t* src = p.block_table32 + row * p.cols + col;
      const int32_t low = *std::min_element(src, src + npages);
      if (low < 0) {
        const int64_t k = std::find_if(src, src + npages, [](int32_t x) { return x < 0; }) - src;
        throw bad_page(row, col + k, src[k]);
      }
      out.kv_pages.insert(out.kv_pages.end(), src, src + npages);
    } else {
      const int64_t* src = p.block_table64 + row * p.cols + col;
      for (int64_t k = 0; k < npages; ++k) {
        if (src[k] < 0 || src[k] > std::numeric_limits<int32_t>::max()) {
          throw bad_page(row, col + k, src[k]);
        }
        out.kv_pages.push_back(static_cast<int32_t>(src[k]));
      }
    }
  };
  out.kv_pages.clear();
  size_t i = 0;
  while (i < reads.size()) {
    // One run: the reads of this row from reads[i] on while each starts within the run.
    const int64_t row = reads[i].row, col = reads[i].col;
    int64_t end = reads[i].end;
    size_t j = i + 1;
    while (j < reads.size() && reads[j].row == row && reads[j].col <= end) {
      end = std::max(end, reads[j].end);
      ++j;
    }
    const int64_t base = static_cast<int64_t>(out.kv_pages.size());
    if (base + (end - col) > std::numeric_limits<int32_t>::max()) {
      throw std::length_error("the plan's page ids exceed int32 offsets");
    }
    for (size_t k = i; k < j; ++k) {
      out.kv_page_offset[reads[k].item] = static_cast<int32_t>(base + reads[k].col - col);
    }
    store_run(row, col, end);
    i = j;
  }
  return total_len;
}

// Step 6: query slots in item order.
void lay_out_slots(const Parts& parts, const Slots& slots, const std::vector<int64_t>& item_part,
                   PlanResult& out) {
  const int64_t num_items = static_cast<int64_t>(item_part.size());
  const int64_t n_pairs = static_cast<int64_t>(parts.pair_slot.size());
  out.q_indptr.assign(num_items + 1, 0);
  out.q_tokens.resize(n_pairs);
  out.q_limit.resize(n_pairs);
  int64_t at = 0;
  for (int64_t w = 0; w < num_items; ++w) {
    const int64_t q = item_part[w];
    for (int64_t k = parts.pair_first[q]; k < parts.pair_first[q + 1]; ++k) {
      const int64_t s = parts.pair_slot[k];
      out.q_tokens[at] = static_cast<int32_t>(slots.tok[s]);
      out.q_limit[at] = static_cast<int32_t>(slots.lim[s]);
      ++at;
    }
    out.q_indptr[w + 1] = static_cast<int32_t>(at);
  }
}

// Step 7: partial rows only for tokens covered by several slots, grouped by token. Returns the
// number of partial rows.
int64_t assign_partials(const Parts& parts, const Slots& slots, int64_t num_tokens,
                        PlanResult& out) {
  const int64_t n_pairs = static_cast<int64_t>(parts.pair_slot.size());
  int64_t cover_len = std::max<int64_t>(num_tokens, 0);
  for (int64_t k = 0; k < n_pairs; ++k) {
    cover_len = std::max<int64_t>(cover_len, slots.tok[parts.pair_slot[k]] + 1);
  }
  std::vector<int64_t> cover(cover_len, 0);
  for (int64_t k = 0; k < n_pairs; ++k) ++cover[out.q_tokens[k]];
  std::vector<int64_t> next_row(cover_len, 0);
  out.merge_indptr.push_back(0);
  int64_t num_partials = 0;
  for (int64_t t = 0; t < cover_len; ++t) {
    if (cover[t] > 1) {
      next_row[t] = num_partials;
      num_partials += cover[t];
      out.merge_tokens.push_back(static_cast<int32_t>(t));
      out.merge_indptr.push_back(static_cast<int32_t>(num_partials));
    }
  }
  out.q_out.resize(n_pairs);
  for (int64_t k = 0; k < n_pairs; ++k) {
    const int32_t t = out.q_tokens[k];
    out.q_out[k] = cover[t] > 1 ? static_cast<int32_t>(next_row[t]++) : kQOutOutput;
  }
  out.merge_partials.resize(num_partials);
  std::iota(out.merge_partials.begin(), out.merge_partials.end(), 0);
  return num_partials;
}

// packer.pack on the forest in `out.forest` (checked inputs, see build_plan).
void pack(const PlanParams& p, const std::vector<int64_t>& lens,
          const std::vector<int64_t>& qo_indptr, PlanResult& out) {
  const Forest& f = out.forest;
  const int64_t ps = p.page_size;
  std::vector<int64_t> qo_len(p.batch);
  for (int64_t b = 0; b < p.batch; ++b) qo_len[b] = qo_indptr[b + 1] - qo_indptr[b];
  const TileTable tiles(p);
  const int64_t max_rows = tiles.max_rows();

  const double split_len = split_length(p, f, lens, qo_len);
  // Merges are held back from items that would be cut only when every long item is cut.
  const double hold_len = p.split_target == 0 ? split_len : std::numeric_limits<double>::infinity();
  Items items;
  std::vector<int32_t> pq_rows;
  collect_items(p, f, lens, qo_len, max_rows, hold_len, pq_rows, items);

  const int64_t g = p.num_qo_heads / p.num_kv_heads;
  const int64_t max_tokens = std::max<int64_t>(1, floordiv(max_rows, g));
  const int64_t num_tokens = qo_indptr[p.batch];
  const int64_t n_items = static_cast<int64_t>(items.page_begin.size());
  std::vector<int64_t> it_begin(n_items);
  for (int64_t i = 0; i < n_items; ++i) it_begin[i] = items.page_begin[i] * ps;

  Slots slots;
  query_slots(items, it_begin, lens, qo_indptr, qo_len, num_tokens, slots);
  Chunks chunks;
  row_chunks(slots, it_begin, items.token_end, max_tokens, chunks);
  Parts parts;
  split_parts(p, tiles, slots, chunks, g, split_len, parts);
  const std::vector<int64_t> item_part = group_tiles(tiles, parts, g, out);
  const int64_t total_len = gather_pages(p, parts, chunks, item_part, out);
  lay_out_slots(parts, slots, item_part, out);
  const int64_t num_partials = assign_partials(parts, slots, num_tokens, out);

  out.kv_bytes = p.kv_bytes(total_len);
  out.partial_bytes = p.partial_bytes(num_partials);
  out.num_partials = num_partials;
}

// packer.finish_in_leaf on the packed arrays (the same gate, order and encoding): a merged
// token with exactly one slot in a leaf item (16-row tile) and at most kMaxFinishOthers other
// partial rows is finished by that item. Finished tokens go last in merge_tokens, each keeping
// its relative order; a finished token's own row goes last among its rows, at position j after
// its n others, and its leaf slot gets q_out = -2 - (16 j + n). The constants are packer.py's
// LEAF_TILE_TOKENS, MAX_FINISH_OTHERS, FINISH_MAX_PAIRS_PER_WARP and FINISH_MIN_TILES_PER_PAIR
// (tests/test_native_plan.py compares the two implementations).
constexpr int64_t kLeafTileTokens = 16;
constexpr int64_t kMaxFinishOthers = kFinishRadix - 1;
constexpr int64_t kFinishMaxPairsPerWarp = 2;
constexpr int64_t kFinishMinTilesPerPair = 8;
constexpr int64_t kLeafRows = kVariantRows[0];

void finish_in_leaf(const PlanParams& p, int64_t num_tokens, PlanResult& out) {
  out.num_finished = 0;
  const int64_t m_count = static_cast<int64_t>(out.merge_tokens.size());
  const int64_t num_items = static_cast<int64_t>(out.kv_len.size());
  if (m_count == 0 || static_cast<int64_t>(out.merge_partials.size()) >= kFinishMaxPartials) {
    return;
  }
  std::vector<char> leaf(static_cast<size_t>(num_items), 0);
  int64_t leaf_items = 0, leaf_tiles = 0;
  for (int64_t w = 0; w < num_items; ++w) {
    if (out.tile_m[out.tile_id[w]] == kLeafRows) {
      leaf[w] = 1;
      ++leaf_items;
      leaf_tiles += (out.kv_len[w] + kLeafTileTokens - 1) / kLeafTileTokens;
    }
  }
  if (leaf_items == 0) return;
  const int64_t pairs = leaf_items * p.num_kv_heads;
  const int64_t tiles = leaf_tiles * p.num_kv_heads;
  if (pairs > kFinishMaxPairsPerWarp * p.finish_leaf_warps &&
      tiles < kFinishMinTilesPerPair * pairs) {
    return;
  }
  std::vector<int64_t> tok2m(static_cast<size_t>(num_tokens), -1);
  for (int64_t m = 0; m < m_count; ++m) tok2m[out.merge_tokens[m]] = m;
  // The leaf slot of each merged token (-1: none), and how many it has.
  std::vector<int64_t> leaf_slot(static_cast<size_t>(m_count), -1);
  std::vector<int32_t> per_token(static_cast<size_t>(m_count), 0);
  for (int64_t w = 0; w < num_items; ++w) {
    if (!leaf[w]) continue;
    for (int32_t s = out.q_indptr[w]; s < out.q_indptr[w + 1]; ++s) {
      if (out.q_out[s] < 0) continue;
      const int64_t m = tok2m[out.q_tokens[s]];
      ++per_token[m];
      leaf_slot[m] = s;
    }
  }
  std::vector<char> finished(static_cast<size_t>(m_count), 0);
  int64_t count = 0;
  for (int64_t m = 0; m < m_count; ++m) {
    const int64_t size = out.merge_indptr[m + 1] - out.merge_indptr[m];
    if (per_token[m] == 1 && size <= kMaxFinishOthers + 1) {
      finished[m] = 1;
      ++count;
    }
  }
  if (count == 0) return;
  std::vector<int32_t> tokens, indptr, partials;
  tokens.reserve(m_count);
  indptr.reserve(m_count + 1);
  partials.reserve(out.merge_partials.size());
  indptr.push_back(0);
  for (int pass = 0; pass < 2; ++pass) {  // open tokens, then finished ones
    for (int64_t m = 0; m < m_count; ++m) {
      if (finished[m] != pass) continue;
      tokens.push_back(out.merge_tokens[m]);
      const int32_t b = out.merge_indptr[m], e = out.merge_indptr[m + 1];
      if (!pass) {
        partials.insert(partials.end(), out.merge_partials.begin() + b,
                        out.merge_partials.begin() + e);
      } else {
        const int64_t s = leaf_slot[m];
        const int32_t own = out.q_out[s];
        for (int32_t i = b; i < e; ++i) {
          if (out.merge_partials[i] != own) partials.push_back(out.merge_partials[i]);
        }
        for (int32_t i = b; i < e; ++i) {
          if (out.merge_partials[i] == own) partials.push_back(own);
        }
        const int64_t j = static_cast<int64_t>(partials.size()) - 1;  // the own row's position
        out.q_out[s] = static_cast<int32_t>(kQOutFinishBase - (kFinishRadix * j + (e - b - 1)));
      }
      indptr.push_back(static_cast<int32_t>(partials.size()));
    }
  }
  out.merge_tokens.swap(tokens);
  out.merge_indptr.swap(indptr);
  out.merge_partials.swap(partials);
  out.num_finished = count;
}

// The tile table must give every item a positive height (heights divide row counts) and keep
// the tile keys m * 65536 + n apart.
void check_tile_table(const PlanParams& p) {
  if (p.m_sizes.empty() || p.n_bounds.empty() || p.n_sizes.size() != p.n_bounds.size()) {
    throw std::invalid_argument("tile table needs m sizes and matching n bounds and sizes");
  }
  for (size_t i = 0; i < p.m_sizes.size(); ++i) {
    const int64_t m = p.m_sizes[i];
    if (m <= 0 || m > std::numeric_limits<int32_t>::max() || (i > 0 && m <= p.m_sizes[i - 1])) {
      throw std::invalid_argument("tile table m sizes must be positive and ascending, got m[" +
                                  std::to_string(i) + "] = " + std::to_string(m));
    }
  }
  for (size_t i = 0; i < p.n_sizes.size(); ++i) {
    const int64_t n = p.n_sizes[i];
    if (n <= 0 || n >= TileTable::kTileKey) {
      throw std::invalid_argument("tile table n sizes must lie in [1, 65535], got n[" +
                                  std::to_string(i) + "] = " + std::to_string(n));
    }
    if (i > 0 && p.n_bounds[i] < p.n_bounds[i - 1]) {
      throw std::invalid_argument("tile table n bounds must be ascending");
    }
  }
}

// Lengths and query layout the plan arrays can hold (int32 positions and token indices), as
// PrefixAttention.plan checks them.
void check_lengths(const PlanParams& p, const std::vector<int64_t>& lens,
                   const std::vector<int64_t>& qo_indptr) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (qo_indptr[0] < 0) throw std::invalid_argument("qo_indptr must not start below 0");
  for (int64_t b = 0; b < p.batch; ++b) {
    if (lens[b] < 0 || lens[b] > kInt32Max) {
      throw std::invalid_argument("seq_lens[" + std::to_string(b) +
                                  "] = " + std::to_string(lens[b]) +
                                  (lens[b] < 0 ? " is negative" : " is beyond int32 range"));
    }
    const int64_t qo_len = qo_indptr[b + 1] - qo_indptr[b];
    if (qo_len < 0) {
      throw std::invalid_argument("qo_indptr is decreasing at request " + std::to_string(b));
    }
    if (qo_len > lens[b]) {
      throw std::invalid_argument("qo_indptr gives request " + std::to_string(b) + " " +
                                  std::to_string(qo_len) + " new tokens but seq_lens[" +
                                  std::to_string(b) + "] is " + std::to_string(lens[b]) +
                                  "; seq_lens must include the new tokens");
    }
  }
  if (qo_indptr[p.batch] > kInt32Max) {
    throw std::invalid_argument("qo_indptr holds " + std::to_string(qo_indptr[p.batch]) +
                                " query tokens, beyond int32 range");
  }
}

// Each request's length in the forest (0: left out) and the first page id of its row.
void forest_inputs(const PlanParams& p, const std::vector<int64_t>& lens,
                   const std::vector<int64_t>& qo_indptr, std::vector<int64_t>& forest_lens,
                   std::vector<int64_t>& first_page) {
  forest_lens.assign(lens.begin(), lens.end());
  if (p.forest_skips_idle) {
    for (int64_t b = 0; b < p.batch; ++b) {
      if (qo_indptr[b + 1] - qo_indptr[b] <= 0) forest_lens[b] = 0;
    }
  }
  first_page.assign(p.batch, 0);
  for (int64_t b = 0; b < p.batch; ++b) {
    if (forest_lens[b] > 0 && p.cols > 0) {
      first_page[b] =
          p.block_table32 != nullptr ? p.block_table32[b * p.cols] : p.block_table64[b * p.cols];
    }
  }
}

}  // namespace

void build_plan(const PlanParams& p, PlanResult& out, bool reuse_forest) {
  out.clear(/*keep_forest=*/reuse_forest);
  if ((p.block_table32 == nullptr) == (p.block_table64 == nullptr)) {
    throw std::invalid_argument("exactly one of block_table32 / block_table64 must be set");
  }
  if (p.batch < 0 || p.cols < 0) throw std::invalid_argument("bad block_table shape");
  if (p.page_size <= 0) throw std::invalid_argument("page_size must be positive");
  if (p.num_kv_heads <= 0 || p.num_qo_heads <= 0) {
    throw std::invalid_argument("head counts must be positive");
  }
  if (p.split_target < 0) throw std::invalid_argument("split_target must be >= 0");
  check_tile_table(p);
  std::vector<int64_t> lens(p.seq_lens, p.seq_lens + p.batch);
  std::vector<int64_t> qo_indptr(p.qo_indptr, p.qo_indptr + p.batch + 1);
  check_lengths(p, lens, qo_indptr);
  std::vector<int64_t> forest_lens, first_page;
  forest_inputs(p, lens, qo_indptr, forest_lens, first_page);
  Forest& f = out.forest;
  if (reuse_forest) {
    // A forest of other lengths, idle requests or first pages than this call's is stale.
    if (f.built_cols != p.cols || f.page_size != p.page_size || f.built_lens != forest_lens ||
        f.built_first_page != first_page) {
      throw std::invalid_argument(
          "reuse_forest: the kept forest was built from another block table, seq_lens or "
          "qo_indptr (or another page size); build without reuse_forest");
    }
  } else {
    // The forest compares page ids as int32 (wider ids wrap, as the Python cast does).
    std::vector<int32_t> narrowed;
    const int32_t* table = p.block_table32;
    if (table == nullptr) {
      narrowed.resize(static_cast<size_t>(p.batch * p.cols));
      for (size_t i = 0; i < narrowed.size(); ++i) {
        narrowed[i] = static_cast<int32_t>(p.block_table64[i]);
      }
      table = narrowed.data();
    }
    build_forest(table, p.batch, p.cols, forest_lens.data(), p.page_size, f);
    f.built_lens.swap(forest_lens);
    f.built_first_page.swap(first_page);
    f.built_cols = p.cols;
  }
  pack(p, lens, qo_indptr, out);
  if (p.finish_leaf_warps > 0) finish_in_leaf(p, qo_indptr[p.batch], out);
}

PlanResult build_plan(const PlanParams& p) {
  PlanResult out;
  build_plan(p, out);
  return out;
}

void Forest::clear() {
  for (auto* v : {&parent, &page_begin, &page_end, &req_begin, &req_end, &order, &ending_indptr,
                  &ending_reqs, &children_indptr, &children}) {
    v->clear();
  }
  token_end.clear();
  built_lens.clear();
  built_first_page.clear();
  built_cols = -1;
}

void PlanResult::clear(bool keep_forest) {
  if (!keep_forest) forest.clear();
  for (auto* v : {&kv_page_offset, &kv_pages, &kv_start, &kv_len, &q_indptr, &q_tokens, &q_limit,
                  &q_out, &tile_id, &tile_indptr, &merge_tokens, &merge_indptr, &merge_partials}) {
    v->clear();
  }
  tile_m.clear();
  tile_n.clear();
  kv_bytes = partial_bytes = num_partials = num_finished = 0;
}

}  // namespace plan
}  // namespace prefixattn
