// The plan/kernel contract: the layout of the plan's int32 `counts` device array, the query-tile
// heights of the kernel variants, and the encodings of the plan's index arrays. Shared by the
// host planner (cpp/plan/), the launcher (cpp/launch/) and the kernels; plain C++ (no CUDA, no
// torch). python/prefixattn reads the integer constants of this file with a regular expression:
// keep each on one line, its value an integer literal or an expression of earlier names.
#pragma once

namespace prefixattn {

// Layout of the plan's int32 `counts` device array.
constexpr int kCountItems = 0;        // work items
constexpr int kCountMergeTokens = 3;  // tokens the merge stage combines
constexpr int kVariantBase = 6;       // counts[6 + v] .. counts[7 + v]: items of variant v
constexpr int kNumVariants = 4;       // query-tile heights 16, 32, 64, 128
// KV heads one pair of the 16-row variant covers (1, 2, 4, ...; a divisor of the KV heads):
// items whose rows fit that many times in 16 rows (one decode token of a small GQA group)
// stack the heads' rows in one tile and stream the heads' KV one after another.
constexpr int kCountPackedHeads = kVariantBase + kNumVariants + 1;
// Merged tokens the merge launch takes when the leaf launch finishes the others (the last
// entries of merge_tokens; ForwardParams::finish).
constexpr int kCountMergeOpen = kCountPackedHeads + 1;
constexpr int kCountsLen = kCountMergeOpen + 1;

// Variant v runs query tiles of kVariantRows[v] rows.
constexpr int kVariantRows[kNumVariants] = {16, 32, 64, 128};

// q_out, per query slot: its partial row (>= 0), kQOutOutput (the slot writes the output), or
// a leaf slot that finishes its merged token: kQOutFinishBase - (kFinishRadix j + n), where
// merge_partials[j] is the slot's own partial row and merge_partials[j - n .. j - 1] the n
// other partial rows of its token (n < kFinishRadix). Example: j = 5, n = 2 -> -2 - 82 = -84.
constexpr int kQOutOutput = -1;
constexpr int kQOutFinishBase = -2;
constexpr int kFinishRadix = 16;
// Partial rows of a plan whose tokens may be finished in the leaf launch (j < 2^27 keeps the
// encoding in int32).
constexpr int kFinishMaxPartials = 134217728;

}  // namespace prefixattn
