// Applies the resampling plan to the slot and token tables (DESIGN.md §2 step 8). Only table entries and
// refcounts move, never KV bytes. The grid is static (one CTA per row) so the graph never depends on the
// plan; CTAs of rows that keep their own state return at once.
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/smc_kernels.hpp"
#include "kernels/pdl.cuh"
#include "kernels/cycle_io.hpp"
#include "kernels/launch_checks.hpp"
#include "kernels/reshuffle_device.cuh"
#include "kernels/slots_device.cuh"

namespace smcgraph {
namespace {

constexpr int kThreads = 128;

/// The public stage: one CTA per row.
__global__ void __launch_bounds__(kThreads)
    ReshuffleKernel(SlotPoolView pool, RowTablesView tables, const int32_t* ancestor, uint8_t* finished) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  device::reshuffle_row(pool, tables, ancestor, finished, static_cast<int>(blockIdx.x),
                        cooperative_groups::this_thread_block());
}

/// With collect_freed_slots folded in: a warp per row, kCollectThreads a CTA, and the launch's last CTA
/// pushes the freed slots (slots_device.cuh), with as many threads as the standalone collect.
constexpr int kCollectThreads = device::kCollectThreads;
constexpr int kRowsPerCollectCta = kCollectThreads / 32;
__global__ void __launch_bounds__(kCollectThreads)
    ReshuffleCollectKernel(SlotPoolView pool, RowTablesView tables, const int32_t* ancestor,
                           uint8_t* finished, uint32_t* collect_ticket) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const auto warp = cooperative_groups::tiled_partition<32>(cooperative_groups::this_thread_block());
  const int dst = static_cast<int>(blockIdx.x) * kRowsPerCollectCta + static_cast<int>(threadIdx.x) / 32;
  if (dst < tables.rows) // uniform across the warp
    device::reshuffle_row(pool, tables, ancestor, finished, dst, warp);
  device::collect_freed_after_launch<kCollectThreads>(pool, collect_ticket);
}

void check_reshuffle(const SlotPoolView& pool, const RowTablesView& tables, const int32_t* ancestor,
                     const uint8_t* finished, const char* where) {
  detail::require_pool(pool, where);
  detail::require_tables(tables, where);
  if (tables.rows == 0)
    return;
  require(ancestor != nullptr, where, "ancestor", "null", "must be a device pointer");
  require(finished != nullptr, where, "finished", "null", "must be a device pointer");
}

} // namespace

void reshuffle(const SlotPoolView& pool, const RowTablesView& tables, const int32_t* ancestor,
               uint8_t* finished, cudaStream_t stream) {
  check_reshuffle(pool, tables, ancestor, finished, "reshuffle");
  if (tables.rows == 0)
    return;
  const NvtxRange range("reshuffle");
  detail::launch_pdl(ReshuffleKernel, dim3(tables.rows), dim3(kThreads), 0, stream, pool, tables, ancestor,
                     finished);
}

namespace detail {

void check_reshuffle_and_collect(const CycleBuffers& b, const RowTablesView& tables, const char* where) {
  check_reshuffle(b.pool, tables, b.ancestor, b.finished, where);
  require(tables.rows >= 1, where, "tables.rows", tables.rows, "must be >= 1");
  require(b.collect_ticket != nullptr, where, "b.collect_ticket", "null", "must be a device pointer");
}

void reshuffle_and_collect(const CycleBuffers& b, const RowTablesView& tables, cudaStream_t stream) {
  check_reshuffle_and_collect(b, tables, "reshuffle_and_collect");
  const NvtxRange range("reshuffle_and_collect");
  const auto blocks = static_cast<unsigned>(ceil_div(tables.rows, kRowsPerCollectCta));
  launch_pdl(ReshuffleCollectKernel, dim3(blocks), dim3(kCollectThreads), 0, stream, b.pool, tables,
             b.ancestor, b.finished, b.collect_ticket);
}

} // namespace detail

} // namespace smcgraph
