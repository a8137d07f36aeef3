// Device helper of the per-request draft length shared by the cycle's stage kernels (forward inputs, commit,
// the draft-length decision): one definition of K_q.
#pragma once

#include <cstdint>

namespace smcgraph::detail {

/// K_q, the draft length request q runs this cycle: request_draft_steps[q] (decided on the device at the end
/// of the previous cycle, cycle_io.hpp) clamped into [0, max_steps], max_steps the engine's K. 0 (no draft
/// this cycle) comes only from an adaptive rule with min_steps = 0 (or from draft_steps = 0).
__device__ __forceinline__ int request_draft_steps_of(const int32_t* request_draft_steps, int request,
                                                      int max_steps) {
  return min(max(request_draft_steps[request], 0), max_steps);
}

} // namespace smcgraph::detail
