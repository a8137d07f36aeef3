// Applies the resampling plan to the slot and token tables (DESIGN.md §2 step 8). Only table entries and
// refcounts move, never KV bytes. The grid is static (one CTA per row) so the graph never depends on the
// plan; CTAs of rows that keep their own state return at once.
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/smc_kernels.hpp"

namespace smcgraph {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads)
    ReshuffleKernel(SlotPoolView pool, RowTablesView tables, const int32_t* ancestor, uint8_t* finished) {
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
  require(pool.pool_size >= 1, kWhere, "pool.pool_size", pool.pool_size,
          "must be >= 1 (slot 0 is the dummy)");
  require(pool.free_stack != nullptr, kWhere, "pool.free_stack", "null", "must be a device pointer");
  require(pool.free_count != nullptr, kWhere, "pool.free_count", "null", "must be a device pointer");
  require(pool.refcount != nullptr, kWhere, "pool.refcount", "null", "must be a device pointer");
  require(tables.rows >= 0, kWhere, "tables.rows", tables.rows, "must be >= 0");
  require(tables.max_seq_len >= 1, kWhere, "tables.max_seq_len", tables.max_seq_len, "must be >= 1");
  if (tables.rows == 0)
    return;
  require(tables.slot_table != nullptr, kWhere, "tables.slot_table", "null", "must be a device pointer");
  require(tables.token_table != nullptr, kWhere, "tables.token_table", "null", "must be a device pointer");
  require(tables.seq_len != nullptr, kWhere, "tables.seq_len", "null", "must be a device pointer");
  require(tables.live != nullptr, kWhere, "tables.live", "null", "must be a device pointer");
  require(ancestor != nullptr, kWhere, "ancestor", "null", "must be a device pointer");
  require(finished != nullptr, kWhere, "finished", "null", "must be a device pointer");
  const NvtxRange range("reshuffle");
  ReshuffleKernel<<<tables.rows, kThreads, 0, stream>>>(pool, tables, ancestor, finished);
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace smcgraph
