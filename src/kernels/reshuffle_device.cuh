// The reshuffle stage's device code (reshuffle.cu launches it alone, or with the freed-slot collect; the SMC
// cycle's end, commit.cu, composes it with the commit and the resampling): a row's part of the plan.
#pragma once

#include <cstdint>

#include "kernels/slots_device.cuh"
#include "smcgraph/slots.hpp"

namespace smcgraph::device {

/// Row dst's part of the plan, by `group` (a CTA or a warp). A source is never a destination, so no group
/// reads a row another one writes (no snapshot needed); a plan that breaks this is ignored rather than raced
/// on.
template <class Group>
__device__ __forceinline__ void reshuffle_row(const SlotPoolView& pool, const RowTablesView& tables,
                                              const int32_t* ancestor, uint8_t* finished, int dst,
                                              const Group& group) {
  const int source = ancestor[dst];
  if (source == dst || source < 0 || source >= tables.rows || ancestor[source] != source)
    return; // uniform across the group
  device::copy_row_refcounted(pool, tables, source, dst, group);
  if (group.thread_rank() == 0)
    finished[dst] = finished[source];
}

} // namespace smcgraph::device
