// Forward inputs (cycle_io.hpp): the draft head's, draft steps' and target verify's tokens, positions,
// lengths and KV slots of every row, gathered from the tables inside the captured cycle.
#include "kernels/pdl.cuh"
#include "kernels/alloc_device.cuh"
#include "kernels/cycle_io.hpp"
#include "kernels/draft_steps_device.cuh"
#include "kernels/row_launch.cuh"

#include <algorithm>

#include <cub/block/block_reduce.cuh>
#include <cuda/functional>

#include "smcgraph/error.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::detail {
namespace {

// What each kernel reads and writes (pointers to const are read only): narrow views of CycleBuffers, filled
// by name (designated initializers, packed: a line per field would repeat one shape in every stage file).
struct DraftInputsView {
  RowTablesView tables; ///< read: live, seq_len, slot_table, token_table
  int draft_steps = 1, max_rows = 0, particles = 1;
  const int32_t* request_draft_steps; ///< K_q of each request
  int32_t *head_tokens, *head_positions, *head_out_slots, *head_seq_lens;
  int32_t *step_positions, *step_out_slots, *step_seq_lens;
  uint8_t* step_live;
  int32_t *verify_positions, *verify_out_slots, *verify_seq_lens;
  bool hand_over_last_draft;
};

DraftInputsView draft_inputs_view(const CycleBuffers& b) {
  // clang-format off
  return {.tables = b.tables, .draft_steps = b.draft_steps, .max_rows = b.max_rows,
          .particles = b.particles, .request_draft_steps = b.request_draft_steps,
          .head_tokens = b.head_tokens, .head_positions = b.head_positions,
          .head_out_slots = b.head_out_slots, .head_seq_lens = b.head_seq_lens,
          .step_positions = b.step_positions, .step_out_slots = b.step_out_slots,
          .step_seq_lens = b.step_seq_lens, .step_live = b.step_live, .verify_positions = b.verify_positions,
          .verify_out_slots = b.verify_out_slots, .verify_seq_lens = b.verify_seq_lens,
          .hand_over_last_draft = b.hand_over_last_draft};
  // clang-format on
}

/// K_q of row r's request, within [0, K].
template <class View> __device__ __forceinline__ int row_draft_steps(const View& b, int r) {
  return request_draft_steps_of(b.request_draft_steps, r / b.particles, b.draft_steps);
}

/// The captured cycle's conditions (cycle_io.hpp, DraftLoopConditions): a CTA of THREADS threads reduces
/// m = max K_q over the live rows of the bucket and sets condition s to s < m (the head's to m > 0). Every
/// thread of the CTA takes part (no early return before it).
template <int THREADS>
__device__ void set_draft_loop(const DraftInputsView& b, int rows, const DraftLoopConditions& conditions) {
#if CUDART_VERSION >= 12080
  using BlockReduce = cub::BlockReduce<int, THREADS>;
  __shared__ typename BlockReduce::TempStorage storage;
  int longest = 0;
  for (int r = threadIdx.x; r < rows; r += THREADS)
    if (b.tables.live[r])
      longest = max(longest, row_draft_steps(b, r));
  longest = BlockReduce(storage).Reduce(longest, cuda::maximum<>{});
  if (threadIdx.x == 0) {
    if (conditions.head != 0) // the draft head drafts d_1: needed when some live row drafts at all
      cudaGraphSetConditional(static_cast<cudaGraphConditionalHandle>(conditions.head),
                              longest > 0 ? 1u : 0u);
    for (int s = 1; s <= conditions.count; ++s) // step s (after the head) drafts d_{s+1}: needed when K > s
      cudaGraphSetConditional(static_cast<cudaGraphConditionalHandle>(conditions.handles[s - 1]),
                              s < longest ? 1u : 0u);
  }
#else
  (void)b;
  (void)rows;
  (void)conditions;
#endif
}

/// Whether the launch sets conditional-node handles (the draft head's or the steps').
__device__ __forceinline__ bool sets_conditions(const DraftLoopConditions& conditions) {
  return conditions.count > 0 || conditions.head != 0;
}

/// Row r's forward inputs (the draft head's, the steps' and the verify's), from the tables after alloc.
__device__ void prepare_draft_row(const DraftInputsView& b, int r) {
  const int max_len = b.tables.max_seq_len;
  const bool live = b.tables.live[r] != 0;
  const int L = b.tables.seq_len[r];
  const int32_t* slots = b.tables.slot_table + static_cast<int64_t>(r) * max_len;
  const int32_t* tokens = b.tables.token_table + static_cast<int64_t>(r) * max_len;
  // Live rows have L >= 2 and slots for positions < L + K_q + 1 (alloc ran first); padding rows point at the
  // dummy slot 0 and position 0, and so do the steps a row does not draft (s >= K_q; s > K_q when step K_q
  // hands d_{K_q} over to a resumed verify).
  const int steps = row_draft_steps(b, r);
  for (int j = 0; j < 2; ++j) {
    const int position = L - 2 + j;
    b.head_tokens[2 * r + j] = live ? tokens[position] : 0;
    b.head_positions[2 * r + j] = live ? position : 0;
    b.head_out_slots[2 * r + j] = live ? slots[position] : 0;
  }
  b.head_seq_lens[r] = live ? L : 0;
  for (int s = 1; s < b.draft_steps; ++s) {
    const bool drafts = live && (s < steps || (b.hand_over_last_draft && s == steps));
    const int position = L + s - 1;
    b.step_positions[(s - 1) * b.max_rows + r] = drafts ? position : 0;
    b.step_out_slots[(s - 1) * b.max_rows + r] = drafts ? slots[position] : 0;
    b.step_seq_lens[(s - 1) * b.max_rows + r] = drafts ? position + 1 : 0;
    b.step_live[(s - 1) * b.max_rows + r] = drafts ? 1 : 0;
  }
  // Columns past K_q are computed but never read: they repeat the last drafted position (so they read only
  // the row's own slots) and write the dummy slot.
  for (int j = 0; j <= b.draft_steps; ++j) {
    const int position = L - 1 + min(j, steps);
    b.verify_positions[r * (b.draft_steps + 1) + j] = live ? position : 0;
    b.verify_out_slots[r * (b.draft_steps + 1) + j] = live && j <= steps ? slots[position] : 0;
  }
  b.verify_seq_lens[r] = live ? L + steps : 0;
}

__global__ void __launch_bounds__(kRowThreads)
    PrepareDraftInputsKernel(DraftInputsView b, int rows, DraftLoopConditions conditions) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  if (sets_conditions(conditions) && blockIdx.x == 0)
    set_draft_loop<kRowThreads>(b, rows, conditions);
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < rows)
    prepare_draft_row(b, r);
}

struct VerifyInputsView {
  RowTablesView tables; ///< read: live, seq_len, token_table
  int draft_steps = 1, particles = 1;
  const int32_t* request_draft_steps;
  int32_t* draft_tokens; ///< written: column 0 (x_{L-1}) and the columns not drafted this cycle
};

VerifyInputsView verify_inputs_view(const CycleBuffers& b) {
  // clang-format off
  return {.tables = b.tables, .draft_steps = b.draft_steps, .particles = b.particles,
          .request_draft_steps = b.request_draft_steps, .draft_tokens = b.draft_tokens};
  // clang-format on
}

__global__ void PrepareVerifyInputsKernel(VerifyInputsView b, int rows) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows)
    return;
  const bool live = b.tables.live[r] != 0;
  const int L = b.tables.seq_len[r];
  const int steps = row_draft_steps(b, r);
  // The draft block already holds d_1 .. d_{K_q} of live rows (the samplers wrote them in place).
  int32_t* block = b.draft_tokens + r * (b.draft_steps + 1);
  block[0] = live ? b.tables.token_table[static_cast<int64_t>(r) * b.tables.max_seq_len + L - 1] : 0;
  // Draft positions past K_q were not drafted this cycle (a masked step sampled junk there; a captured
  // cycle may have skipped the step): token 0, as for padding rows.
  for (int k = live ? steps : 0; k < b.draft_steps; ++k)
    block[1 + k] = 0;
}

/// The top of a cycle in one CTA: the cycle's status word cleared, alloc (alloc_device.cuh), then every
/// row's forward inputs and the conditions, from the tables alloc just wrote (its closing barrier makes them
/// visible to the whole CTA).
__global__ void __launch_bounds__(device::kAllocThreads)
    AllocAndPrepareDraftInputsKernel(DraftInputsView b, SlotPoolView pool, int particles, int slots_per_row,
                                     RequestSlotCounts counts, int32_t* out_slots, uint32_t* row_flags,
                                     uint32_t* status, int rows, DraftLoopConditions conditions) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  if (threadIdx.x == 0)
    *status = 0u; // before alloc's first barrier, so every later OR into it lands on the cleared word
  RowTablesView tables = b.tables;
  tables.rows = rows;
  device::alloc_cycle_slots_block<device::kAllocThreads>(pool, tables, particles, slots_per_row, counts,
                                                         out_slots, row_flags, status);
  if (sets_conditions(conditions))
    set_draft_loop<device::kAllocThreads>(b, rows, conditions);
  for (int r = threadIdx.x; r < rows; r += device::kAllocThreads)
    prepare_draft_row(b, r);
}

} // namespace

namespace {

/// The checks both draft-inputs launchers share.
void require_draft_inputs(const char* where, const CycleBuffers& b, int rows,
                          const DraftLoopConditions& conditions) {
  require(rows >= 1 && rows <= b.max_rows, where, "rows", rows, "must be in [1, max_rows]");
  require(conditions.count >= 0 && conditions.count <= kMaxDraftSteps, where, "conditions.count",
          conditions.count, "must be in [0, kMaxDraftSteps]");
}

} // namespace

void prepare_draft_inputs(const CycleBuffers& b, int rows, cudaStream_t stream,
                          const DraftLoopConditions& conditions) {
  require_draft_inputs("prepare_draft_inputs", b, rows, conditions);
  launch_per_row(PrepareDraftInputsKernel, rows, stream, draft_inputs_view(b), rows, conditions);
}

void alloc_and_prepare_draft_inputs(const CycleBuffers& b, int rows, int slots_per_row,
                                    const RequestSlotCounts& counts, cudaStream_t stream,
                                    const DraftLoopConditions& conditions) {
  constexpr const char* kWhere = "alloc_and_prepare_draft_inputs";
  require_draft_inputs(kWhere, b, rows, conditions);
  require(rows % b.particles == 0, kWhere, "rows", rows, "must be a multiple of particles");
  require(slots_per_row >= 1 && slots_per_row <= b.tables.max_seq_len, kWhere, "slots_per_row", slots_per_row,
          "must be in [1, tables.max_seq_len]");
  launch_pdl(AllocAndPrepareDraftInputsKernel, dim3(1), dim3(device::kAllocThreads), 0, stream,
             draft_inputs_view(b), b.pool, b.particles, slots_per_row, counts, b.cycle_slots, b.row_flags,
             b.status, rows, conditions);
}

void prepare_verify_inputs(const CycleBuffers& b, int rows, cudaStream_t stream) {
  launch_per_row(PrepareVerifyInputsKernel, rows, stream, verify_inputs_view(b), rows);
}

} // namespace smcgraph::detail
