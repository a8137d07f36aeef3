// The alloc stage's device code (DESIGN.md §2 step 1): slots for this cycle's positions, popped from the free
// stack in request order by one CTA. Its home launch is alloc_cycle_slots (slots.cu); a recipe may run it
// at the top of another one-CTA launch (forward_inputs.cu: alloc_and_prepare_draft_inputs). Internal:
// compiled by nvcc only.
#pragma once

#include <cstdint>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "smcgraph/slots.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::device {

/// Threads of the one CTA that allocates: each pass of its loop serves this many requests.
inline constexpr int kAllocThreads = 1024;

/// Slots each live row of `request` needs: its count from device memory, or slots_per_row without counts.
__device__ __forceinline__ int request_slot_count(const RequestSlotCounts& counts, int request,
                                                  int slots_per_row) {
  if (counts.counts == nullptr)
    return slots_per_row;
  return min(max(counts.counts[request] + counts.add, 1), slots_per_row);
}

/// The alloc stage of one cycle, run by a whole CTA of THREADS threads (the only CTA touching the pool):
/// passes over requests in tiles of THREADS, thread t deciding request tile + t (its need, or why it is
/// refused); a block scan turns needs into pop offsets, then the whole CTA writes the tile's rows. Slot
/// number g of this launch (g = offset of the request + rank of the row among its live rows * slots_per_row
/// + j) is free_stack[free - 1 - g]: popped from the top in request order. Ends with a barrier, so the CTA
/// may read the rows it wrote (slot tables, live flags) right after.
template <int THREADS>
__device__ __forceinline__ void alloc_cycle_slots_block(const SlotPoolView& pool, const RowTablesView& tables,
                                                        int particles, int slots_per_row,
                                                        const RequestSlotCounts& counts, int32_t* out_slots,
                                                        uint32_t* row_flags, uint32_t* status) {
  using BlockScan = cub::BlockScan<int, THREADS>;
  using BlockReduce = cub::BlockReduce<int, THREADS>;
  __shared__ union {
    typename BlockScan::TempStorage scan;
    typename BlockReduce::TempStorage reduce;
  } storage;
  __shared__ int tile_first_pop[THREADS]; // pop index of the request's first slot
  __shared__ uint32_t tile_refusal[THREADS];
  __shared__ int free_at_start;

  if (threadIdx.x == 0)
    free_at_start = min(max(*pool.free_count, 0), pool.pool_size - 1);
  __syncthreads();
  const int free = free_at_start;
  const int requests = tables.rows / particles;
  const int max_len = tables.max_seq_len;
  int needed_before_tile = 0; // needs of all earlier requests, granted or not: keeps the order strict
  int granted_total = 0;

  for (int tile = 0; tile < requests; tile += THREADS) {
    const int request = tile + static_cast<int>(threadIdx.x);
    int need = 0;
    uint32_t refusal = kFlagNone;
    if (request < requests) {
      const int row_need = request_slot_count(counts, request, slots_per_row);
      int live_rows = 0;
      for (int p = 0; p < particles; ++p) {
        const int row = request * particles + p;
        if (!tables.live[row])
          continue;
        ++live_rows;
        const int length = tables.seq_len[row];
        if (length < 0 || length > max_len - row_need)
          refusal = kFlagMaxLength;
      }
      if (refusal == kFlagNone)
        need = live_rows * row_need;
    }
    int first_pop = 0, tile_need = 0;
    BlockScan(storage.scan).ExclusiveSum(need, first_pop, tile_need);
    first_pop += needed_before_tile;
    // The prefix counts refused needs too, so once one request does not fit no later one (with need > 0)
    // fits either: service stops at the first refusal.
    if (need > 0 && first_pop + need > free)
      refusal = kFlagSlotsExhausted;
    tile_first_pop[threadIdx.x] = first_pop;
    tile_refusal[threadIdx.x] = refusal;
    __syncthreads(); // scan storage is reused by the reduce; the tile arrays are read below
    granted_total += BlockReduce(storage.reduce).Sum(refusal == kFlagNone ? need : 0); // valid in thread 0
    needed_before_tile += tile_need;

    const int tile_requests = min(THREADS, requests - tile);
    for (int i = threadIdx.x; i < tile_requests * particles; i += THREADS) {
      const int local_request = i / particles;
      const int row = (tile + local_request) * particles + i % particles;
      int32_t* row_out = out_slots + static_cast<int64_t>(row) * slots_per_row;
      const uint32_t row_refusal = tile_refusal[local_request];
      if (!tables.live[row] || row_refusal != kFlagNone) {
        for (int j = 0; j < slots_per_row; ++j)
          row_out[j] = 0;
        // Refused. A request's rows are all refused or all granted, so clearing live here never changes
        // the live flags a granted row counts for its rank below.
        if (tables.live[row]) {
          row_flags[row] |= row_refusal;
          atomicOr(status, row_refusal);
          tables.live[row] = 0;
        }
        continue;
      }
      int rank = 0;
      for (int row_before = (tile + local_request) * particles; row_before < row; ++row_before) {
        rank += tables.live[row_before] ? 1 : 0;
      }
      const int row_need = request_slot_count(counts, tile + local_request, slots_per_row);
      const int first = tile_first_pop[local_request] + rank * row_need;
      const int length = tables.seq_len[row];
      int32_t* row_table = tables.slot_table + static_cast<int64_t>(row) * max_len + length;
      for (int j = 0; j < row_need; ++j) {
        const int32_t slot = pool.free_stack[free - 1 - (first + j)];
        row_out[j] = slot;
        row_table[j] = slot;
        if (slot > 0 && slot < pool.pool_size)
          pool.refcount[slot] = 1;
      }
      for (int j = row_need; j < slots_per_row; ++j)
        row_out[j] = 0; // positions past the request's count take no slot: the dummy
    }
    __syncthreads(); // the tile arrays and the reduce storage are rewritten by the next tile
  }
  if (threadIdx.x == 0)
    *pool.free_count = free - granted_total;
  __syncthreads();
}

} // namespace smcgraph::device
