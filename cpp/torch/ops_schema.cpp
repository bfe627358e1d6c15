// Schemas of the attention ops. Always compiled, so a CPU-only build still knows the ops (and
// torch.library fake registrations can refer to them); the CUDA implementation is
// run_plan_op.cpp (cpp/launch/ underneath), built only with CUDA. Every argument is used.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(prefixattn, m) {
  // Executes a LaunchPlan: forward over every tile group, then the merge. Mutates out and the
  // partial buffers (partial_o in q's dtype, partial_lse fp32). tile_indptr / tile_m: host tile
  // groups of the plan (items tile_indptr[t]..tile_indptr[t+1]-1 run with query tile height
  // tile_m[t]); the kernels read the item bounds of each height from `counts`. prefetch_tiles > 0
  // prefetches KV that many tiles ahead into L2; fixed_grid launches plan-independent grids (as
  // under graph capture); concurrent runs the tile groups on forked streams instead of one after
  // another; fixed_variants (-1: all) limits the plan-independent launches to the forward variants
  // of its bits 0-3 and the merge (bit 4), for a plan known never to use the others; chained lets
  // each launch after the first start while the one before it drains (serial groups); finish lets
  // the leaf launch run last and finish the plan's num_finished merged tokens (q_out = -2 - (16 j +
  // n)), the merge launch taking the others (counts[kCountMergeOpen]). leaf_max_rows: the most
  // query rows of an item of the 16-row tile group (-1: not known); at most 8 lets the leaf launch
  // run the leaf kernel's narrower form. leaf_tiles: the 16-token tiles of those items, summed (-1:
  // not known); short items take a third form. host_counts: the plan's device counts equal what
  // tile_indptr / tile_m and num_merge_tokens say (no device check may zero them), so launches that
  // are not fixed grids take their item ranges from the host.
  m.def(
      "run_plan(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, Tensor(b!) partial_o, "
      "Tensor(c!) partial_lse, Tensor kv_page_offset, Tensor kv_pages, Tensor kv_start, "
      "Tensor kv_len, Tensor q_indptr, Tensor q_tokens, Tensor q_limit, Tensor q_out, "
      "Tensor merge_tokens, Tensor merge_indptr, Tensor merge_partials, Tensor counts, "
      "int[] tile_indptr, int[] tile_m, int num_merge_tokens, bool hnd, float scale, "
      "int prefetch_tiles=0, bool fixed_grid=False, bool concurrent=False, "
      "int fixed_variants=-1, bool chained=False, int num_finished=0, bool finish=False, "
      "int leaf_max_rows=-1, int leaf_tiles=-1, bool host_counts=False) -> ()");
}
