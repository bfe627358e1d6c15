// How the launcher runs a plan: the flag arguments of the run_plan op as one POD struct.
// Plain C++ (no CUDA, no torch).
#pragma once

#include <cstdint>

namespace prefixattn {

struct LaunchOptions {
  // > 0: prefetch KV this many tiles ahead of the copies into L2.
  int prefetch_tiles = 0;
  // Plan-independent grids that fill the device, as under CUDA-graph capture (which implies
  // it): a replay runs whatever plan the buffers hold by then.
  bool fixed_grid = false;
  // The tile groups run on forked side streams instead of one after another.
  bool concurrent = false;
  // -1: a fixed grid launches every variant and the merge; else only the forward variants of
  // bits 0-3 and the merge (bit 4), for plans known never to use the others.
  int64_t fixed_variants = -1;
  // Each launch after the first may start while the one before it drains (serial groups).
  bool chained = false;
  // The leaf launch runs last and finishes the plan's finished merged tokens.
  bool finish = false;
  // The plan's device counts equal the host's tile groups and merge token count (no device
  // check may zero them), so launches that are not fixed grids take their item ranges from
  // the host.
  bool host_counts = false;
};

}  // namespace prefixattn
