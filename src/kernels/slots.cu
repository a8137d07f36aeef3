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
#include "kernels/alloc_device.cuh"
#include "kernels/slots_device.cuh"

namespace smcgraph {
using detail::ceil_div;
using detail::require_device_pointers;
using detail::require_pool;
using detail::require_tables;
namespace {

constexpr int kThreads = 256;
constexpr int kAllocThreads = device::kAllocThreads;
constexpr int kRowThreads = 128; // per-row kernels: one CTA per row striding over positions

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

__global__ void __launch_bounds__(kAllocThreads)
    AllocCycleSlotsKernel(SlotPoolView pool, RowTablesView tables, int particles, int slots_per_row,
                          RequestSlotCounts counts, int32_t* out_slots, uint32_t* row_flags,
                          uint32_t* status) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  device::alloc_cycle_slots_block<kAllocThreads>(pool, tables, particles, slots_per_row, counts, out_slots,
                                                 row_flags, status);
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

constexpr int kCollectThreads = device::kCollectThreads;

// One CTA: collect_freed_block (slots_device.cuh).
__global__ void __launch_bounds__(kCollectThreads) CollectFreedSlotsKernel(SlotPoolView pool) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  device::collect_freed_block<kCollectThreads>(pool);
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
