// The last-arrival ticket: how a launch's CTAs (or one job's CTAs) hand their results to the one that arrives
// last, without a second launch. Used by the sampler's split-vocabulary merge (logits_pass.cuh) and by the
// launches that fold the freed-slot collect in (slots_device.cuh). Internal: compiled by nvcc only.
#pragma once

#include <cstdint>

namespace smcgraph::device {

/// Called by every thread of a CTA once its writes are done (no early return before it): true in the CTA that
/// arrives last of `arrivals` at `ticket`, which it resets to 0 so the next launch or graph replay needs no
/// memset. The fences make the other CTAs' writes before their arrival visible to that CTA (its loads of
/// them must still bypass L1: __ldcg, as L1 is not coherent across CTAs).
__device__ __forceinline__ bool last_to_arrive(uint32_t* ticket, uint32_t arrivals) {
  __shared__ bool last;
  __syncthreads(); // the CTA's writes happen before thread 0's fence (fences are cumulative)
  if (threadIdx.x == 0) {
    __threadfence(); // publish them before taking a ticket
    last = atomicAdd(ticket, 1u) == arrivals - 1;
    if (last)
      *ticket = 0u;
  }
  __syncthreads();
  if (last)
    __threadfence(); // acquire the other CTAs' writes
  return last;
}

} // namespace smcgraph::device
