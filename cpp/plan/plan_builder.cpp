// Launch-plan construction on the host; see plan_builder.h.
//
// Every step mirrors core/forest.py `build_forest` and core/packer.py `pack`, including their
// orderings and tie-breaks (stable sorts, lexsorts, greedy merge order), so that both produce
// identical arrays. Integer divisions use Python's floor semantics.
#include "plan_builder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

namespace prefixattn {
namespace plan {

namespace {

inline int64_t floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

inline int64_t ceildiv(int64_t a, int64_t b) { return -floordiv(-a, b); }

// core/packer.py MIN_SPLIT_TOKENS and SPLIT_SLACK.
constexpr int64_t kMinSplitTokens = 256;
constexpr int64_t kSplitSlack = 2;
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

void pack(const PlanParams& p, const std::vector<int64_t>& lens,
          const std::vector<int64_t>& qo_indptr, PlanResult& out) {
  const Forest& f = out.forest;
  const int64_t ps = p.page_size;
  const int64_t batch = p.batch;
  std::vector<int64_t> qo_len(batch);
  for (int64_t b = 0; b < batch; ++b) qo_len[b] = qo_indptr[b + 1] - qo_indptr[b];
  if (p.m_sizes.empty() || p.n_bounds.empty() || p.n_sizes.size() != p.n_bounds.size()) {
    throw std::invalid_argument("tile table needs m sizes and matching n bounds and sizes");
  }
  if (p.num_kv_heads <= 0 || p.num_qo_heads <= 0) {
    throw std::invalid_argument("head counts must be positive");
  }
  const int64_t max_rows = p.m_sizes.back();

  // Long-KV split length: the mean KV length of the nodes that serve tokens (of the requests
  // with new tokens for per_query), at least kMinSplitTokens.
  double split_len = std::numeric_limits<double>::infinity();
  if (p.split_kv) {
    int64_t total = 0, count = 0;
    if (p.packing == Packing::kPerQuery) {
      for (int64_t b = 0; b < batch; ++b) {
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
          total += f.token_end[u] - static_cast<int64_t>(f.page_begin[u]) * ps;
          ++count;
        }
      }
    }
    if (count > 0) {
      split_len = std::max(static_cast<double>(total) / static_cast<double>(count),
                           static_cast<double>(kMinSplitTokens));
    }
  }
  // Merges are held back from items that would be cut only when every long item is cut.
  const double hold_len =
      p.split_target == 0 ? split_len : std::numeric_limits<double>::infinity();

  Items items;
  std::vector<int32_t> pq_rows;
  switch (p.packing) {
    case Packing::kMemory:
      items_memory(f, p, qo_len, max_rows, hold_len, items);
      break;
    case Packing::kNaive:
      items_naive(f, items);
      break;
    case Packing::kPerQuery:
      for (int64_t b = 0; b < batch; ++b) {
        if (floordiv(lens[b] + ps - 1, ps) > 0) pq_rows.push_back(static_cast<int32_t>(b));
      }
      items_per_query(pq_rows, lens, items);
      break;
  }

  const int64_t g = p.num_qo_heads / p.num_kv_heads;
  const int64_t max_tokens = std::max<int64_t>(1, floordiv(max_rows, g));
  const int64_t num_tokens = qo_indptr[batch];
  const int64_t n_items = static_cast<int64_t>(items.page_begin.size());
  std::vector<int64_t> it_begin(n_items);
  for (int64_t i = 0; i < n_items; ++i) it_begin[i] = items.page_begin[i] * ps;
  const std::vector<int64_t>& it_tok_end = items.token_end;

  // 1. Query slots, item by item (runs stably sorted by item).
  const int64_t n_runs = static_cast<int64_t>(items.run_item.size());
  std::vector<int64_t> run_order(n_runs);
  {
    std::vector<int64_t> fill(n_items + 1, 0);
    for (int64_t r = 0; r < n_runs; ++r) ++fill[items.run_item[r] + 1];
    for (int64_t i = 0; i < n_items; ++i) fill[i + 1] += fill[i];
    for (int64_t r = 0; r < n_runs; ++r) run_order[fill[items.run_item[r]]++] = r;
  }
  std::vector<int64_t> slot_item, slot_tok, slot_lim, slot_req;
  for (auto* v : {&slot_item, &slot_tok, &slot_lim, &slot_req}) {
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
          slot_item.push_back(item);
          slot_tok.push_back(qo_indptr[req] + within);
          slot_lim.push_back(lim);
          slot_req.push_back(req);
        }
      }
    }
  }
  const int64_t n_slots = static_cast<int64_t>(slot_item.size());

  // 2. Row chunks of at most max_tokens tokens per item.
  std::vector<int64_t> chunk_item, chunk_req, chunk_begin, chunk_end, chunk_first;
  for (auto* v : {&chunk_item, &chunk_req, &chunk_begin, &chunk_end, &chunk_first}) {
    v->reserve(static_cast<size_t>(n_items) + 1);
  }
  {
    int64_t prev = -1, rank = 0;
    for (int64_t s = 0; s < n_slots; ++s) {
      if (slot_item[s] != prev) {
        prev = slot_item[s];
        rank = 0;
      }
      if (rank == max_tokens) rank = 0;
      if (rank == 0) {
        chunk_item.push_back(prev);
        chunk_req.push_back(slot_req[s]);
        chunk_begin.push_back(it_begin[prev]);
        chunk_end.push_back(slot_lim[s]);
        chunk_first.push_back(s);
      } else {
        chunk_end.back() = std::max(chunk_end.back(), slot_lim[s]);
      }
      ++rank;
    }
  }
  const int64_t n_chunks = static_cast<int64_t>(chunk_item.size());
  chunk_first.push_back(n_slots);
  for (int64_t c = 0; c < n_chunks; ++c) {
    chunk_end[c] = std::min(it_tok_end[chunk_item[c]], chunk_end[c]);
  }

  // 3. Long-KV split into equal page-aligned parts; each part's visible slots. With a split
  // target, only chunks whose KV is more than kSplitSlack times their launch's share per SM
  // (the KV tokens of the chunks of their tile height x KV heads / split_target) are cut, into
  // parts no longer than 1 / kSplitSlack of that share and no shorter than kMinSplitTokens.
  const int64_t n_heights = static_cast<int64_t>(p.m_sizes.size());
  // The height of an item of `rows` rows and `len` KV tokens (tiles.TileTable.height_index).
  auto height_of = [&](int64_t rows, int64_t len) {
    if (p.wide_kv_len > 0 && rows > p.wide_rows && len >= p.wide_kv_len) return n_heights - 1;
    return std::min<int64_t>(
        std::lower_bound(p.m_sizes.begin(), p.m_sizes.end(), rows) - p.m_sizes.begin(),
        n_heights - 1);
  };
  std::vector<int64_t> launch_len(n_heights, 0);
  if (p.split_kv && p.split_target > 0) {
    for (int64_t c = 0; c < n_chunks; ++c) {
      launch_len[height_of((chunk_first[c + 1] - chunk_first[c]) * g,
                           chunk_end[c] - chunk_begin[c])] += chunk_end[c] - chunk_begin[c];
    }
  }
  std::vector<int64_t> part_chunk, part_begin, part_end, part_slots, pair_first;
  std::vector<int64_t> pair_slot;
  for (auto* v : {&part_chunk, &part_begin, &part_end, &part_slots, &pair_first}) {
    v->reserve(2 * static_cast<size_t>(n_chunks) + 1);
  }
  pair_slot.reserve(2 * static_cast<size_t>(n_slots));
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t len = chunk_end[c] - chunk_begin[c];
    const int64_t pages = ceildiv(len, ps);
    int64_t parts = 1;
    if (p.split_kv) {
      parts = std::max<int64_t>(
          std::min(static_cast<int64_t>(std::ceil(static_cast<double>(len) / split_len)), pages),
          1);
      if (p.split_target > 0) {
        const int64_t h = height_of((chunk_first[c + 1] - chunk_first[c]) * g, len);
        const int64_t share = p.num_kv_heads * launch_len[h];  // x slots
        const int64_t per_sm = pairs_per_sm(p.m_sizes[h], p.head_dim);
        const int64_t slots = p.split_target * per_sm;
        if (len * slots > kSplitSlack * share) {
          // Leaf chunks (one warp per pair) are cut by the balance alone, not by the split
          // length: one long request would otherwise keep a single part.
          const int64_t cap = per_sm > 1 ? pages : parts;
          const int64_t balanced = ceildiv(kSplitSlack * slots * len, std::max<int64_t>(share, 1));
          parts = std::min({cap, balanced, std::max<int64_t>(floordiv(len, kMinSplitTokens), 1)});
        } else {
          parts = 1;
        }
      }
    }
    for (int64_t k = 0; k < parts; ++k) {
      const int64_t begin = chunk_begin[c] + floordiv(k * pages, parts) * ps;
      int64_t end = std::min(chunk_end[c], chunk_begin[c] + floordiv((k + 1) * pages, parts) * ps);
      const int64_t first_pair = static_cast<int64_t>(pair_slot.size());
      int64_t furthest = std::numeric_limits<int64_t>::min();
      for (int64_t s = chunk_first[c]; s < chunk_first[c + 1]; ++s) {
        if (slot_lim[s] > begin) {
          pair_slot.push_back(s);
          furthest = std::max(furthest, slot_lim[s]);
        }
      }
      const int64_t count = static_cast<int64_t>(pair_slot.size()) - first_pair;
      if (count > 0) end = std::min(end, furthest);
      part_chunk.push_back(c);
      part_begin.push_back(begin);
      part_end.push_back(end);
      part_slots.push_back(count);
      pair_first.push_back(first_pair);
    }
  }
  const int64_t n_parts = static_cast<int64_t>(part_begin.size());
  pair_first.push_back(static_cast<int64_t>(pair_slot.size()));

  // 4. Tiles: group by tile, longest first inside a group.
  std::vector<int64_t> alive, alive_key;
  for (int64_t q = 0; q < n_parts; ++q) {
    if (part_slots[q] <= 0) continue;
    const int64_t rows = part_slots[q] * g;
    const int64_t len = part_end[q] - part_begin[q];
    const int64_t nn = static_cast<int64_t>(p.n_bounds.size());
    const int64_t mi = height_of(rows, len);
    const int64_t ni = std::min<int64_t>(
        std::lower_bound(p.n_bounds.begin(), p.n_bounds.end(), len) - p.n_bounds.begin(), nn - 1);
    alive.push_back(q);
    alive_key.push_back(p.m_sizes[mi] * 65536 + p.n_sizes[ni]);
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
    by_tile[k] = {tid_alive[k], part_begin[alive[k]] - part_end[alive[k]], k};
  }
  std::sort(by_tile.begin(), by_tile.end());
  std::vector<int64_t> perm_pos(n_alive);
  for (int64_t k = 0; k < n_alive; ++k) perm_pos[k] = by_tile[k].pos;
  const int64_t num_items = n_alive;
  const int64_t num_tiles = static_cast<int64_t>(used.size());
  for (int64_t k : used) {
    out.tile_m.push_back(floordiv(k, 65536));
    out.tile_n.push_back(k - floordiv(k, 65536) * 65536);
  }
  out.tile_id.resize(num_items);
  out.tile_indptr.assign(num_tiles + 1, 0);
  for (int64_t w = 0; w < num_items; ++w) {
    out.tile_id[w] = static_cast<int32_t>(tid_alive[perm_pos[w]]);
    ++out.tile_indptr[tid_alive[perm_pos[w]] + 1];
  }
  for (int64_t t = 0; t < num_tiles; ++t) out.tile_indptr[t + 1] += out.tile_indptr[t];

  // 5. Pages of each item: its representative request's block-table row.
  out.kv_page_indptr.assign(num_items + 1, 0);
  out.kv_start.resize(num_items);
  out.kv_len.resize(num_items);
  int64_t total_len = 0;
  for (int64_t w = 0; w < num_items; ++w) {
    const int64_t q = alive[perm_pos[w]];
    const int64_t len = part_end[q] - part_begin[q];
    out.kv_start[w] = static_cast<int32_t>(part_begin[q]);
    out.kv_len[w] = static_cast<int32_t>(len);
    total_len += len;
    out.kv_page_indptr[w + 1] = static_cast<int32_t>(out.kv_page_indptr[w] + ceildiv(len, ps));
  }
  {
    int64_t total_pages = 0;
    for (int64_t w = 0; w < num_items; ++w) {
      const int64_t q = alive[perm_pos[w]];
      total_pages += std::max<int64_t>(ceildiv(part_end[q] - part_begin[q], ps), 0);
    }
    out.kv_pages.clear();
    out.kv_pages.reserve(total_pages);
    int64_t max_id = std::numeric_limits<int64_t>::min();
    for (int64_t w = 0; w < num_items; ++w) {
      const int64_t q = alive[perm_pos[w]];
      const int64_t npages = ceildiv(part_end[q] - part_begin[q], ps);
      const int64_t row = chunk_req[part_chunk[q]];
      const int64_t col = floordiv(part_begin[q], ps);
      if (npages <= 0) continue;
      if (col < 0 || col + npages > p.cols || row < 0 || row >= batch) {
        throw std::out_of_range("work item reads past the block table");
      }
      if (p.block_table32 != nullptr) {
        const int32_t* src = p.block_table32 + row * p.cols + col;
        out.kv_pages.insert(out.kv_pages.end(), src, src + npages);
      } else {
        const int64_t* src = p.block_table64 + row * p.cols + col;
        for (int64_t k = 0; k < npages; ++k) {
          max_id = std::max(max_id, src[k]);
          out.kv_pages.push_back(static_cast<int32_t>(src[k]));
        }
      }
    }
    if (max_id >= (int64_t{1} << 31)) {
      throw PageIdRangeError("block_table holds page id " + std::to_string(max_id) +
                             ", beyond int32 range");
    }
  }

  // 6. Query slots in item order.
  out.q_indptr.assign(num_items + 1, 0);
  const int64_t n_pairs = static_cast<int64_t>(pair_slot.size());
  out.q_tokens.resize(n_pairs);
  out.q_limit.resize(n_pairs);
  {
    int64_t at = 0;
    for (int64_t w = 0; w < num_items; ++w) {
      const int64_t q = alive[perm_pos[w]];
      for (int64_t k = pair_first[q]; k < pair_first[q + 1]; ++k) {
        const int64_t s = pair_slot[k];
        out.q_tokens[at] = static_cast<int32_t>(slot_tok[s]);
        out.q_limit[at] = static_cast<int32_t>(slot_lim[s]);
        ++at;
      }
      out.q_indptr[w + 1] = static_cast<int32_t>(at);
    }
  }

  // 7. Partials only for tokens covered by several slots, grouped by token.
  int64_t cover_len = std::max<int64_t>(num_tokens, 0);
  for (int64_t k = 0; k < n_pairs; ++k) {
    cover_len = std::max<int64_t>(cover_len, static_cast<int64_t>(slot_tok[pair_slot[k]]) + 1);
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
    out.q_out[k] = cover[t] > 1 ? static_cast<int32_t>(next_row[t]++) : -1;
  }
  out.merge_partials.resize(num_partials);
  std::iota(out.merge_partials.begin(), out.merge_partials.end(), 0);

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
constexpr int64_t kMaxFinishOthers = 15;
constexpr int64_t kFinishMaxPairsPerWarp = 2;
constexpr int64_t kFinishMinTilesPerPair = 8;
constexpr int64_t kLeafRows = 16;

void finish_in_leaf(const PlanParams& p, int64_t num_tokens, PlanResult& out) {
  out.num_finished = 0;
  const int64_t m_count = static_cast<int64_t>(out.merge_tokens.size());
  const int64_t num_items = static_cast<int64_t>(out.kv_len.size());
  if (m_count == 0 || static_cast<int64_t>(out.merge_partials.size()) >= (int64_t{1} << 27)) return;
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
  if (pairs > kFinishMaxPairsPerWarp * p.finish_leaf_warps && tiles < kFinishMinTilesPerPair * pairs) {
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
        partials.insert(partials.end(), out.merge_partials.begin() + b, out.merge_partials.begin() + e);
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
        out.q_out[s] = static_cast<int32_t>(-2 - (16 * j + (e - b - 1)));
      }
      indptr.push_back(static_cast<int32_t>(partials.size()));
    }
  }
  out.merge_tokens.swap(tokens);
  out.merge_indptr.swap(indptr);
  out.merge_partials.swap(partials);
  out.num_finished = count;
}

}  // namespace

void build_plan(const PlanParams& p, PlanResult& out, bool reuse_forest) {
  out.clear(/*keep_forest=*/reuse_forest);
  if ((p.block_table32 == nullptr) == (p.block_table64 == nullptr)) {
    throw std::invalid_argument("exactly one of block_table32 / block_table64 must be set");
  }
  if (p.batch < 0 || p.cols < 0) throw std::invalid_argument("bad block_table shape");
  if (p.page_size <= 0) throw std::invalid_argument("page_size must be positive");
  std::vector<int64_t> lens(p.seq_lens, p.seq_lens + p.batch);
  std::vector<int64_t> qo_indptr(p.qo_indptr, p.qo_indptr + p.batch + 1);
  if (qo_indptr[0] < 0) throw std::invalid_argument("qo_indptr must not start below 0");
  for (int64_t b = 0; b < p.batch; ++b) {
    if (qo_indptr[b + 1] < qo_indptr[b]) {
      throw std::invalid_argument("qo_indptr is decreasing at request " + std::to_string(b));
    }
  }
  if (!reuse_forest) {
    std::vector<int64_t> forest_lens(lens.begin(), lens.end());
    if (p.forest_skips_idle) {
      for (int64_t b = 0; b < p.batch; ++b) {
        if (qo_indptr[b + 1] - qo_indptr[b] <= 0) forest_lens[b] = 0;
      }
    }
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
    build_forest(table, p.batch, p.cols, forest_lens.data(), p.page_size, out.forest);
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
}

void PlanResult::clear(bool keep_forest) {
  if (!keep_forest) forest.clear();
  for (auto* v : {&kv_page_indptr, &kv_pages, &kv_start, &kv_len, &q_indptr, &q_tokens, &q_limit,
                  &q_out, &tile_id, &tile_indptr, &merge_tokens, &merge_indptr, &merge_partials}) {
    v->clear();
  }
  tile_m.clear();
  tile_n.clear();
  kv_bytes = partial_bytes = num_partials = num_finished = 0;
}

}  // namespace plan
}  // namespace prefixattn
