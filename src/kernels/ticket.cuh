// The last-arrival ticket: how a launch's CTAs (or one job's CTAs) hand their results to the one that arrives
// last, without a second launch. Used by the sampler's split-vocabulary merge (logits_pass.cuh) and by the
// launches that fold the freed-slot collect in (slots_device.cuh). Internal: compiled by nvcc only.
#pragma once

#include <cstdint>

#include <cuda/atomic>

namespace smcgraph::device {

/// Called by every thread of a CTA once its writes are done (no early return before it): true in the CTA that
/// arrives last of `arrivals` at `ticket`, which it resets to 0 so the next launch or graph replay needs no
/// memset (a launch of one CTA does not touch it: a CTA barrier is enough). Thread 0 takes the ticket with
/// one acquire-release atomic at GPU scope: the CTA barrier before it orders the CTA's writes before its
/// release, and the barrier after it orders its acquire of the other CTAs' writes before this CTA's reads of
/// them (which must still bypass L1: __ldcg, as L1 is not coherent across CTAs). No sequentially consistent
/// fence (__threadfence) is needed for this pattern, and none is paid.
__device__ __forceinline__ bool last_to_arrive(uint32_t* ticket, uint32_t arrivals) {
  if (arrivals == 1) { // the only CTA: a barrier makes its threads' writes visible to each other
    __syncthreads();
    return true;
  }
  __shared__ bool last;
  __syncthreads(); // the CTA's writes happen before thread 0's release
  if (threadIdx.x == 0) {
    // atom.add.acq_rel.gpu on sm_70 and later.
    const uint32_t before = cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(*ticket).fetch_add(
        1u, cuda::memory_order_acq_rel);
    last = before == arrivals - 1;
    if (last)
      *ticket = 0u;
  }
  __syncthreads(); // thread 0's acquire happens before the CTA's reads
  return last;
}

} // namespace smcgraph::device
