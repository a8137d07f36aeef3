// Device pieces of the slot pool shared by the kernels (slots.cu, reshuffle.cu, commit.cu): reference
// counting and the refcounted row copy. Internal: compiled by nvcc only.
#pragma once

#include <cstdint>

#include "smcgraph/slots.hpp"

namespace smcgraph {

namespace device {

/// Adds a reference to `slot` (ignores the dummy 0 and ids outside the pool).
__device__ __forceinline__ void acquire_slot(const SlotPoolView& pool, int32_t slot) {
  if (slot > 0 && slot < pool.pool_size)
    atomicAdd(&pool.refcount[slot], 1);
}

/// Drops a reference to `slot`; the thread that takes it to 0 pushes it on the free stack (the atomicAdd on
/// free_count hands out distinct positions). Never called in a kernel that also pops.
__device__ __forceinline__ void release_slot(const SlotPoolView& pool, int32_t slot) {
  if (slot <= 0 || slot >= pool.pool_size)
    return;
  if (atomicSub(&pool.refcount[slot], 1) == 1) {
    if (pool.freed != nullptr) { // deferred: collect_freed_slots pushes in id order
      atomicOr(&pool.freed[slot >> 5], 1u << (slot & 31));
      return;
    }
    const int position = atomicAdd(pool.free_count, 1);
    if (position < pool.pool_size - 1)
      pool.free_stack[position] = slot; // full only if the pool is corrupt
  }
}

/// Called by every thread of a CTA: row `dst` becomes a copy of row `source` (slots and tokens up to the
/// source's length, seq_len, live) with the references moved accordingly. Each position acquires its new
/// slot before releasing its old one, and `source` itself keeps its references throughout, so a slot shared
/// by both rows never transiently drops to 0. `source` must not be written by anyone meanwhile.
__device__ __forceinline__ void copy_row_refcounted(const SlotPoolView& pool, const RowTablesView& tables,
                                                    int source, int dst) {
  const int max_len = tables.max_seq_len;
  const int source_len = min(max(tables.seq_len[source], 0), max_len);
  const int dst_len = min(max(tables.seq_len[dst], 0), max_len);
  int32_t* dst_slots = tables.slot_table + static_cast<int64_t>(dst) * max_len;
  int32_t* dst_tokens = tables.token_table + static_cast<int64_t>(dst) * max_len;
  const int32_t* source_slots = tables.slot_table + static_cast<int64_t>(source) * max_len;
  const int32_t* source_tokens = tables.token_table + static_cast<int64_t>(source) * max_len;
  for (int j = threadIdx.x; j < max(source_len, dst_len); j += blockDim.x) {
    const int32_t old_slot = dst_slots[j];
    if (j < source_len) {
      const int32_t new_slot = source_slots[j];
      acquire_slot(pool, new_slot);
      dst_slots[j] = new_slot;
      dst_tokens[j] = source_tokens[j];
    }
    if (j < dst_len)
      release_slot(pool, old_slot);
  }
  __syncthreads(); // every thread has read dst's old length before it changes
  if (threadIdx.x == 0) {
    tables.seq_len[dst] = source_len;
    tables.live[dst] = tables.live[source];
  }
}

} // namespace device

} // namespace smcgraph
