// The reshuffle stage's device code (reshuffle.cu launches it alone, or with the freed-slot collect; the SMC
// cycle's end, commit.cu, composes it with the commit and the resampling): a row's part of the plan.
#pragma once

#include <cstdint>

#include "kernels/slots_device.cuh"
#include "smcgraph/slots.hpp"

namespace smcgraph::device {

/// Whether row dst copies row `source` under the plan: another row of the bucket whose own plan entry
/// (ancestor_of(source), asked only for a source in range) is itself, so no row is both a source and a
/// destination.
template <class AncestorOf>
__device__ __forceinline__ bool plan_copies(int source, int dst, int rows, const AncestorOf& ancestor_of) {
  return source != dst && source >= 0 && source < rows && ancestor_of(source) == source;
}

/// Row dst's part of the plan, by `group` (a CTA or a warp). A source is never a destination, so no group
/// reads a row another one writes (no snapshot needed); a plan that breaks this is ignored rather than raced
/// on.
template <class Group>
__device__ __forceinline__ void reshuffle_row(const SlotPoolView& pool, const RowTablesView& tables,
                                              const int32_t* ancestor, uint8_t* finished, int dst,
                                              const Group& group) {
  const int source = ancestor[dst];
  if (!plan_copies(source, dst, tables.rows, [&](int s) { return ancestor[s]; }))
    return; // uniform across the group
  device::copy_row_refcounted(pool, tables, source, dst, group);
  if (group.thread_rank() == 0)
    finished[dst] = finished[source];
}

/// Scratch of reshuffle_request: a request's rows as they were (plan entry, length, flags) and what each row
/// copies.
template <int MAX_ROWS> struct ReshuffleRequestStorage {
  int ancestor[MAX_ROWS], length[MAX_ROWS]; ///< the row's plan entry; its seq_len, clamped
  uint8_t live[MAX_ROWS], finished[MAX_ROWS];
  int source[MAX_ROWS], source_length[MAX_ROWS]; ///< the row's source (-1: none), its clamped seq_len
  uint8_t source_live[MAX_ROWS], source_finished[MAX_ROWS];
};

/// Rows first_row .. first_row + n - 1 (one request, n <= MAX_ROWS) reshuffled by the whole CTA of THREADS
/// threads, each row as reshuffle_row does it, with the same results. A thread a row reads the row's plan
/// entry, length and flags together (one memory latency, not reshuffle_row's three in a chain), then each
/// row that copies gets THREADS / n' threads (n' = n rounded up to a power of two, at least a warp), so a row
/// of up to that many positions copies in one pass, and after a CTA barrier its thread writes its length and
/// flags. Every thread of the CTA calls it.
template <int THREADS, int MAX_ROWS>
__device__ __forceinline__ void reshuffle_request(const SlotPoolView& pool, const RowTablesView& tables,
                                                  const int32_t* ancestor, uint8_t* finished, int first_row,
                                                  int n, ReshuffleRequestStorage<MAX_ROWS>& storage) {
  static_assert(THREADS >= MAX_ROWS && THREADS % 32 == 0, "a thread per row, whole warps");
  const int tid = static_cast<int>(threadIdx.x), max_len = tables.max_seq_len;
  const auto clamp_length = [&](int length) { return min(max(length, 0), max_len); };
  // A source outside the request (no resampling plan makes one, but reshuffle_row allows it): its values
  // straight from memory, by the thread of the row that names it.
  int outside_ancestor = -1, outside_length = 0;
  uint8_t outside_live = 0, outside_finished = 0;
  if (tid < n) {
    const int dst = first_row + tid, source = ancestor[dst];
    storage.ancestor[tid] = source;
    storage.length[tid] = clamp_length(tables.seq_len[dst]);
    storage.live[tid] = tables.live[dst];
    storage.finished[tid] = finished[dst];
    if ((source < first_row || source >= first_row + n) && source >= 0 && source < tables.rows) {
      outside_ancestor = ancestor[source];
      outside_length = clamp_length(tables.seq_len[source]);
      outside_live = tables.live[source];
      outside_finished = finished[source];
    }
  }
  __syncthreads(); // the request's rows as they were
  if (tid < n) {
    const int dst = first_row + tid, source = storage.ancestor[tid], s = source - first_row;
    const bool inside = s >= 0 && s < n;
    const bool copies = plan_copies(source, dst, tables.rows,
                                    [&](int) { return inside ? storage.ancestor[s] : outside_ancestor; });
    storage.source[tid] = copies ? source : -1;
    storage.source_length[tid] = inside ? storage.length[s] : outside_length;
    storage.source_live[tid] = inside ? storage.live[s] : outside_live;
    storage.source_finished[tid] = inside ? storage.finished[s] : outside_finished;
  }
  __syncthreads(); // what every row copies
  int rows_pow2 = 1;
  while (rows_pow2 < n)
    rows_pow2 *= 2;
  const int group_size = max(32, THREADS / rows_pow2), groups = THREADS / group_size;
  for (int i = tid / group_size; i < n; i += groups) {
    if (storage.source[i] >= 0)
      copy_row_positions(pool, tables, storage.source[i], first_row + i, storage.source_length[i],
                         storage.length[i], tid % group_size, group_size);
  }
  __syncthreads(); // every position copied before the lengths change
  if (tid < n && storage.source[tid] >= 0) {
    const int dst = first_row + tid;
    tables.seq_len[dst] = storage.source_length[tid];
    tables.live[dst] = storage.source_live[tid];
    finished[dst] = storage.source_finished[tid];
  }
}

} // namespace smcgraph::device
