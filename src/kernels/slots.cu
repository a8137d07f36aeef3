// Slot pool: init, the per-cycle bulk pop (DESIGN.md §2 step 1), reference counting, retirement and
// admission fan-out. Every launcher validates before touching CUDA, never allocates or synchronizes, and
// reads lengths, live flags and the free count from device memory, so all of it is capturable.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/types.hpp"
#include "kernels/pdl.cuh"
#include "kernels/launch_checks.hpp"
#include "kernels/slots_device.cuh"

namespace smcgraph {
using detail::ceil_div;
using detail::require_device_pointers;
using detail::require_pool;
using detail::require_tables;
namespace {

constexpr int kThreads = 256;
constexpr int kAllocThreads = 1024; // one CTA; each pass of its loop serves this many requests
constexpr int kRowThreads = 128;    // per-row kernels: one CTA per row striding over positions

__global__ void InitSlotPoolKernel(SlotPoolView pool) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= pool.pool_size)
    return;
  pool.refcount[i] = 0;
  if (i < pool.pool_size - 1)
    pool.free_stack[i] = pool.pool_size - 1 - i;
  if (i == 0)
    *pool.free_count = pool.pool_size - 1;
}

/// Slots each live row of `request` needs: its count from device memory, or slots_per_row without counts.
__device__ __forceinline__ int request_slot_count(const RequestSlotCounts& counts, int request,
                                                  int slots_per_row) {
  if (counts.counts == nullptr)
    return slots_per_row;
  return min(max(counts.counts[request] + counts.add, 1), slots_per_row);
}

// Pass over requests in tiles of kAllocThreads: thread t decides request tile + t (its need, or why it is
// refused), a block scan turns needs into pop offsets, then the whole CTA writes the tile's rows. Slot
// number g of this launch (g = offset of the request + rank of the row among its live rows * slots_per_row
// + j) is free_stack[free - 1 - g]: popped from the top in request order.
__global__ void __launch_bounds__(kAllocThreads)
    AllocCycleSlotsKernel(SlotPoolView pool, RowTablesView tables, int particles, int slots_per_row,
                          RequestSlotCounts counts, int32_t* out_slots, uint32_t* row_flags,
                          uint32_t* status) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  using BlockScan = cub::BlockScan<int, kAllocThreads>;
  using BlockReduce = cub::BlockReduce<int, kAllocThreads>;
  __shared__ union {
    typename BlockScan::TempStorage scan;
    typename BlockReduce::TempStorage reduce;
  } storage;
  __shared__ int tile_first_pop[kAllocThreads]; // pop index of the request's first slot
  __shared__ uint32_t tile_refusal[kAllocThreads];
  __shared__ int free_at_start;

  if (threadIdx.x == 0)
    free_at_start = min(max(*pool.free_count, 0), pool.pool_size - 1);
  __syncthreads();
  const int free = free_at_start;
  const int requests = tables.rows / particles;
  const int max_len = tables.max_seq_len;
  int needed_before_tile = 0; // needs of all earlier requests, granted or not: keeps the order strict
  int granted_total = 0;

  for (int tile = 0; tile < requests; tile += kAllocThreads) {
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

    const int tile_requests = min(kAllocThreads, requests - tile);
    for (int i = threadIdx.x; i < tile_requests * particles; i += kAllocThreads) {
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
}

template <bool INCREMENT>
__global__ void ChangeRefsKernel(SlotPoolView pool, const int32_t* slots, const uint8_t* mask, int count) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count || (mask != nullptr && !mask[i]))
    return;
  if (INCREMENT) {
    device::acquire_slot(pool, slots[i]);
  } else {
    device::release_slot(pool, slots[i]);
  }
}

__global__ void __launch_bounds__(kRowThreads)
    ReleaseRowsKernel(SlotPoolView pool, RowTablesView tables, const uint8_t* release_mask) {
  const int row = blockIdx.x;
  if (!release_mask[row])
    return;
  const int max_len = tables.max_seq_len;
  const int length = min(max(tables.seq_len[row], 0), max_len);
  const int32_t* row_slots = tables.slot_table + static_cast<int64_t>(row) * max_len;
  for (int j = threadIdx.x; j < length; j += blockDim.x)
    device::release_slot(pool, row_slots[j]);
  __syncthreads(); // every thread has read the length before it is cleared
  if (threadIdx.x == 0) {
    tables.seq_len[row] = 0;
    tables.live[row] = 0;
  }
}

__global__ void __launch_bounds__(kRowThreads)
    FanOutRowsKernel(SlotPoolView pool, RowTablesView tables, int particles, const uint8_t* request_mask) {
  const int row = blockIdx.x;
  const int request = row / particles;
  if (row % particles == 0 || !request_mask[request])
    return;
  device::copy_row_refcounted(pool, tables, request * particles, row);
}

void change_refs(bool increment, const SlotPoolView& pool, const int32_t* slots, const uint8_t* mask,
                 int count, cudaStream_t stream) {
  const char* where = increment ? "inc_ref_slots" : "dec_ref_slots";
  require_pool(pool, where);
  require(count >= 0, where, "count", count, "must be >= 0");
  if (count == 0)
    return;
  require(slots != nullptr, where, "slots", "null", "must be a device pointer");
  const NvtxRange range(where);
  const int blocks = static_cast<int>(ceil_div(count, kThreads));
  if (increment) {
    ChangeRefsKernel<true><<<blocks, kThreads, 0, stream>>>(pool, slots, mask, count);
  } else {
    ChangeRefsKernel<false><<<blocks, kThreads, 0, stream>>>(pool, slots, mask, count);
  }
  SMCGRAPH_CHECK_LAUNCH();
}

/// The checks of the launchers that work request by request: the pool, the tables, and rows that form whole
/// requests of `particles_per_request` rows each.
void require_request_rows(const SlotPoolView& pool, const RowTablesView& tables, int particles_per_request,
                          const char* where) {
  require_pool(pool, where);
  require_tables(tables, where);
  require(particles_per_request >= 1, where, "particles_per_request", particles_per_request, "must be >= 1");
  require(tables.rows % particles_per_request == 0, where, "tables.rows", tables.rows,
          "must be a multiple of particles_per_request");
}

constexpr int kCollectThreads = 1024;
constexpr int kCollectWordsPerThread = 4;

// One CTA walks the bitmap in ascending order, kCollectThreads * kCollectWordsPerThread words per pass: a
// block scan of per-thread popcounts gives each thread its first stack position, then each thread pushes
// its marked ids in ascending order and clears its words.
__global__ void __launch_bounds__(kCollectThreads) CollectFreedSlotsKernel(SlotPoolView pool) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  using BlockScan = cub::BlockScan<int, kCollectThreads>;
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ int base;
  if (threadIdx.x == 0)
    base = *pool.free_count;
  __syncthreads();
  const int words = (pool.pool_size + 31) / 32;
  for (int first = 0; first < words; first += kCollectThreads * kCollectWordsPerThread) {
    const int my_first = first + static_cast<int>(threadIdx.x) * kCollectWordsPerThread;
    uint32_t marks[kCollectWordsPerThread];
    int count = 0;
#pragma unroll
    for (int i = 0; i < kCollectWordsPerThread; ++i) {
      marks[i] = my_first + i < words ? pool.freed[my_first + i] : 0u;
      count += __popc(marks[i]);
    }
    int offset = 0, total = 0;
    BlockScan(scan).ExclusiveSum(count, offset, total);
    int position = base + offset;
#pragma unroll
    for (int i = 0; i < kCollectWordsPerThread; ++i) {
      uint32_t bits = marks[i];
      if (bits)
        pool.freed[my_first + i] = 0u;
      while (bits) {
        const int bit = __ffs(bits) - 1;
        bits &= bits - 1;
        if (position < pool.pool_size - 1)
          pool.free_stack[position] = (my_first + i) * 32 + bit;
        ++position;
      }
    }
    __syncthreads(); // every thread has read base before it moves
    if (threadIdx.x == 0)
      base += total;
    __syncthreads();
  }
  if (threadIdx.x == 0)
    *pool.free_count = min(base, pool.pool_size - 1);
}

} // namespace

void collect_freed_slots(const SlotPoolView& pool, cudaStream_t stream) {
  require_pool(pool, "collect_freed_slots");
  if (pool.freed == nullptr)
    return;
  const NvtxRange range("collect_freed_slots");
  detail::launch_pdl(CollectFreedSlotsKernel, dim3(1), dim3(kCollectThreads), 0, stream, pool);
}

void init_slot_pool(const SlotPoolView& pool, cudaStream_t stream) {
  require_pool(pool, "init_slot_pool");
  const NvtxRange range("init_slot_pool");
  InitSlotPoolKernel<<<static_cast<int>(ceil_div(pool.pool_size, kThreads)), kThreads, 0, stream>>>(pool);
  SMCGRAPH_CHECK_LAUNCH();
}

void alloc_cycle_slots(const SlotPoolView& pool, const RowTablesView& tables, int particles_per_request,
                       int slots_per_row, int32_t* out_slots, uint32_t* row_flags, uint32_t* status,
                       cudaStream_t stream) {
  alloc_cycle_slots(pool, tables, particles_per_request, slots_per_row, RequestSlotCounts{}, out_slots,
                    row_flags, status, stream);
}

void alloc_cycle_slots(const SlotPoolView& pool, const RowTablesView& tables, int particles_per_request,
                       int slots_per_row, const RequestSlotCounts& counts, int32_t* out_slots,
                       uint32_t* row_flags, uint32_t* status, cudaStream_t stream) {
  constexpr const char* kWhere = "alloc_cycle_slots";
  require_request_rows(pool, tables, particles_per_request, kWhere);
  require(slots_per_row >= 1 && slots_per_row <= tables.max_seq_len, kWhere, "slots_per_row", slots_per_row,
          "must be in [1, tables.max_seq_len]");
  if (tables.rows == 0)
    return;
  require_device_pointers(kWhere, {{"out_slots", out_slots}, {"row_flags", row_flags}, {"status", status}});
  const NvtxRange range("alloc_cycle_slots");
  detail::launch_pdl(AllocCycleSlotsKernel, dim3(1), dim3(kAllocThreads), 0, stream, pool, tables,
                     particles_per_request, slots_per_row, counts, out_slots, row_flags, status);
}

void dec_ref_slots(const SlotPoolView& pool, const int32_t* slots, const uint8_t* mask_or_null, int count,
                   cudaStream_t stream) {
  change_refs(false, pool, slots, mask_or_null, count, stream);
}

void inc_ref_slots(const SlotPoolView& pool, const int32_t* slots, const uint8_t* mask_or_null, int count,
                   cudaStream_t stream) {
  change_refs(true, pool, slots, mask_or_null, count, stream);
}

void release_rows(const SlotPoolView& pool, const RowTablesView& tables, const uint8_t* release_mask,
                  cudaStream_t stream) {
  constexpr const char* kWhere = "release_rows";
  require_pool(pool, kWhere);
  require_tables(tables, kWhere);
  if (tables.rows == 0)
    return;
  require(release_mask != nullptr, kWhere, "release_mask", "null", "must be a device pointer");
  const NvtxRange range("release_rows");
  ReleaseRowsKernel<<<tables.rows, kRowThreads, 0, stream>>>(pool, tables, release_mask);
  SMCGRAPH_CHECK_LAUNCH();
}

void fan_out_rows(const SlotPoolView& pool, const RowTablesView& tables, int particles_per_request,
                  const uint8_t* request_mask, cudaStream_t stream) {
  constexpr const char* kWhere = "fan_out_rows";
  require_request_rows(pool, tables, particles_per_request, kWhere);
  if (tables.rows == 0)
    return;
  require(request_mask != nullptr, kWhere, "request_mask", "null", "must be a device pointer");
  const NvtxRange range("fan_out_rows");
  FanOutRowsKernel<<<tables.rows, kRowThreads, 0, stream>>>(pool, tables, particles_per_request,
                                                            request_mask);
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace smcgraph
