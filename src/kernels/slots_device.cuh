// Device pieces of the slot pool shared by the kernels (slots.cu, reshuffle.cu, commit.cu): reference
// counting and the refcounted row copy. Internal: compiled by nvcc only.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include "kernels/ticket.cuh"
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
      if (pool.freed_summary != nullptr)
        atomicOr(&pool.freed_summary[slot >> 10], 1u << ((slot >> 5) & 31));
      return;
    }
    const int position = atomicAdd(pool.free_count, 1);
    if (position < pool.pool_size - 1)
      pool.free_stack[position] = slot; // full only if the pool is corrupt
  }
}

/// The positions part of copy_row_refcounted for lengths read before: the caller's thread `rank` of `size`
/// takes positions rank, rank + size, ... A position's loads (dst's old slot, the source's slot and token)
/// are issued together before its first store or atomic, so it costs one memory latency and then its
/// reference moves.
__device__ __forceinline__ void copy_row_positions(const SlotPoolView& pool, const RowTablesView& tables,
                                                   int source, int dst, int source_len, int dst_len, int rank,
                                                   int size) {
  const int max_len = tables.max_seq_len;
  int32_t* dst_slots = tables.slot_table + static_cast<int64_t>(dst) * max_len;
  int32_t* dst_tokens = tables.token_table + static_cast<int64_t>(dst) * max_len;
  const int32_t* source_slots = tables.slot_table + static_cast<int64_t>(source) * max_len;
  const int32_t* source_tokens = tables.token_table + static_cast<int64_t>(source) * max_len;
  for (int j = rank; j < max(source_len, dst_len); j += size) {
    const bool taken = j < source_len; // the position exists in the source
    const int32_t old_slot = dst_slots[j];
    const int32_t new_slot = taken ? source_slots[j] : 0;
    const int32_t token = taken ? source_tokens[j] : 0;
    if (taken) {
      if (j < dst_len && new_slot == old_slot) { // shared (a common prefix): its references do not change
        dst_tokens[j] = token;
        continue;
      }
      acquire_slot(pool, new_slot);
      dst_slots[j] = new_slot;
      dst_tokens[j] = token;
    }
    if (j < dst_len)
      release_slot(pool, old_slot);
  }
}

/// Called by every thread of `group` (a CTA or a warp: cooperative_groups' thread_block or
/// thread_block_tile<32>): row `dst` becomes a copy of row `source` (slots and tokens up to the
/// source's length, seq_len, live) with the references moved accordingly. Each position acquires its new
/// slot before releasing its old one, and `source` itself keeps its references throughout, so a slot shared
/// by both rows never transiently drops to 0. A position whose slot the two rows already share (the prompt
/// and any prefix since their common ancestor) keeps its references as they are: acquiring and releasing it
/// would cancel. `source` must not be written by anyone meanwhile.
template <class Group>
__device__ __forceinline__ void copy_row_refcounted(const SlotPoolView& pool, const RowTablesView& tables,
                                                    int source, int dst, const Group& group) {
  const int max_len = tables.max_seq_len;
  const int source_len = min(max(tables.seq_len[source], 0), max_len);
  const int dst_len = min(max(tables.seq_len[dst], 0), max_len);
  copy_row_positions(pool, tables, source, dst, source_len, dst_len, static_cast<int>(group.thread_rank()),
                     static_cast<int>(group.size()));
  group.sync(); // every thread has read dst's old length before it changes
  if (group.thread_rank() == 0) {
    tables.seq_len[dst] = source_len;
    tables.live[dst] = tables.live[source];
  }
}

/// The CTA-wide copy (every thread of the CTA calls it).
__device__ __forceinline__ void copy_row_refcounted(const SlotPoolView& pool, const RowTablesView& tables,
                                                    int source, int dst) {
  copy_row_refcounted(pool, tables, source, dst, cooperative_groups::this_thread_block());
}

/// Threads of a CTA that collects (collect_freed_slots' one CTA, and the launches that fold the collect in).
inline constexpr int kCollectThreads = 1024;

/// The collect stage (collect_freed_slots) run by a whole CTA of THREADS threads, the only one touching the
/// pool: every slot marked in pool.freed goes onto the free stack in ascending id order and the marks are
/// cleared. Without pool.freed_summary it reads every bitmap word (passes of THREADS x 4 words, each thread
/// a contiguous run); with it, the summary in chunks of THREADS words, and of each chunk only the bitmap
/// words of its marked summary words (listed in ascending order in shared memory, a bitmap word per thread).
/// Either way a block scan of per-thread counts gives each thread its first stack position, so the order is
/// ascending ids, and every thread's loads of a pass are independent of each other. Loads bypass L1
/// (__ldcg): the marks may come from other CTAs of the same launch (collect_freed_after_launch).
template <int THREADS> __device__ __forceinline__ void collect_freed_block(const SlotPoolView& pool) {
  constexpr int kWordsPerThread = 4;
  using BlockScan = cub::BlockScan<int, THREADS>;
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ int base;
  __shared__ int listed[THREADS]; // marked summary words of the chunk, ascending
  if (threadIdx.x == 0)
    base = __ldcg(pool.free_count);
  __syncthreads();
  const int words = (pool.pool_size + 31) / 32;
  // One pass over N words per thread (word -1: none): count, scan, push in ascending order, clear.
  auto pass = [&](auto const& word_of, auto count_tag) {
    constexpr int N = decltype(count_tag)::value;
    uint32_t marks[N];
    int count = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int word = word_of(i);
      marks[i] = word >= 0 ? __ldcg(&pool.freed[word]) : 0u;
      count += __popc(marks[i]);
    }
    int offset = 0, total = 0;
    BlockScan(scan).ExclusiveSum(count, offset, total);
    int position = base + offset;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      uint32_t bits = marks[i];
      if (bits)
        pool.freed[word_of(i)] = 0u;
      while (bits) {
        const int bit = __ffs(bits) - 1;
        bits &= bits - 1;
        if (position < pool.pool_size - 1)
          pool.free_stack[position] = word_of(i) * 32 + bit;
        ++position;
      }
    }
    __syncthreads(); // every thread has read base before it moves
    if (threadIdx.x == 0)
      base += total;
    __syncthreads();
  };
  if (pool.freed_summary != nullptr) {
    const int summary_words = (words + 31) / 32;
    for (int chunk = 0; chunk < summary_words; chunk += THREADS) {
      const int s = chunk + static_cast<int>(threadIdx.x);
      const int marked = s < summary_words && __ldcg(&pool.freed_summary[s]) != 0u ? 1 : 0;
      int index = 0, listed_count = 0;
      BlockScan(scan).ExclusiveSum(marked, index, listed_count);
      if (marked) {
        listed[index] = s;
        pool.freed_summary[s] = 0u;
      }
      __syncthreads();
      for (int first = 0; first < listed_count * 32; first += THREADS) {
        const int i = first + static_cast<int>(threadIdx.x);
        const int word = i < listed_count * 32 ? listed[i / 32] * 32 + i % 32 : -1;
        pass([&](int) { return word < words ? word : -1; }, std::integral_constant<int, 1>{});
      }
    }
  } else {
    for (int first = 0; first < words; first += THREADS * kWordsPerThread) {
      const int my_first = first + static_cast<int>(threadIdx.x) * kWordsPerThread;
      pass([&](int i) { return my_first + i < words ? my_first + i : -1; },
           std::integral_constant<int, kWordsPerThread>{});
    }
  }
  if (threadIdx.x == 0)
    *pool.free_count = min(base, pool.pool_size - 1);
}

/// The end of a launch whose CTAs release slots, folding collect_freed_slots into it: every thread of every
/// CTA calls this last (no early return before it). The launch's last CTA (ticket.cuh) runs
/// collect_freed_block. A no-op when pool.freed is null.
template <int THREADS>
__device__ __forceinline__ void collect_freed_after_launch(const SlotPoolView& pool, uint32_t* ticket) {
  if (pool.freed != nullptr && last_to_arrive(ticket, gridDim.x * gridDim.y * gridDim.z))
    collect_freed_block<THREADS>(pool);
}

} // namespace device

} // namespace smcgraph
