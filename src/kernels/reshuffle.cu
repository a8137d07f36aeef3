// Applies the resampling plan to the slot and token tables (DESIGN.md §2 step 8). Only table entries and
// refcounts move, never KV bytes. The grid is static (one CTA per row) so the graph never depends on the
// plan; CTAs of rows that keep their own state return at once.
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/smc_kernels.hpp"
#include "kernels/pdl.cuh"
#include "kernels/launch_checks.hpp"
#include "kernels/slots_device.cuh"

namespace smcgraph {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads)
    ReshuffleKernel(SlotPoolView pool, RowTablesView tables, const int32_t* ancestor, uint8_t* finished) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const int dst = blockIdx.x;
  const int source = ancestor[dst];
  // A source is never a destination, so no CTA reads a row another one writes (no snapshot needed); a plan
  // that breaks this is ignored rather than raced on.
  if (source == dst || source < 0 || source >= tables.rows || ancestor[source] != source)
    return;
  device::copy_row_refcounted(pool, tables, source, dst);
  if (threadIdx.x == 0)
    finished[dst] = finished[source];
}

} // namespace

void reshuffle(const SlotPoolView& pool, const RowTablesView& tables, const int32_t* ancestor,
               uint8_t* finished, cudaStream_t stream) {
  constexpr const char* kWhere = "reshuffle";
  detail::require_pool(pool, kWhere);
  detail::require_tables(tables, kWhere);
  if (tables.rows == 0)
    return;
  require(ancestor != nullptr, kWhere, "ancestor", "null", "must be a device pointer");
  require(finished != nullptr, kWhere, "finished", "null", "must be a device pointer");
  const NvtxRange range("reshuffle");
  detail::launch_pdl(ReshuffleKernel, dim3(tables.rows), dim3(kThreads), 0, stream, pool, tables, ancestor,
                     finished);
}

} // namespace smcgraph
