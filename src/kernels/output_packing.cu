// Output packing (cycle_io.hpp): one cycle's outputs into the pinned buffer the host reads (layout below).
#include "kernels/pdl.cuh"
#include "kernels/cycle_io.hpp"
#include "kernels/draft_steps_decide.cuh"
#include "kernels/row_launch.cuh"

#include <algorithm>

#include "smcgraph/error.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::detail {
namespace {

size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

/// What the packing kernel reads: a narrow, read-only view of CycleBuffers, filled by name (designated
/// initializers, packed: a line per field would repeat one shape in every stage file).
struct OutputsView {
  RowTablesView tables; ///< read: live, seq_len
  int particles = 1, draft_steps = 1;
  const int32_t *cycle_tokens, *first_eos, *ancestor, *committed;
  const int32_t* accepted; ///< null in the SMC cycle
  const uint32_t *row_flags, *status;
  const uint8_t *finished, *resampled;
  const double* ess;
  const int32_t *cycle_draft_steps, *request_draft_steps;
  const float* acceptance_ema;
  const uint8_t* kv_pressure;
};

OutputsView outputs_view(const CycleBuffers& b) {
  // clang-format off
  return {.tables = b.tables, .particles = b.particles, .draft_steps = b.draft_steps,
          .cycle_tokens = b.cycle_tokens, .first_eos = b.first_eos, .ancestor = b.ancestor,
          .committed = b.committed, .accepted = b.accepted, .row_flags = b.row_flags, .status = b.status,
          .finished = b.finished, .resampled = b.resampled, .ess = b.ess,
          .cycle_draft_steps = b.cycle_draft_steps, .request_draft_steps = b.request_draft_steps,
          .acceptance_ema = b.acceptance_ema, .kv_pressure = b.kv_pressure};
  // clang-format on
}

/// The draft-length decision folded into the packing launch (decide_and_pack_outputs); `decide` false: none.
struct FoldedDecision {
  bool decide = false;
  DecideView view;
  const int32_t* accepted = nullptr; ///< null in the SMC cycle
};

__global__ void PackOutputsKernel(OutputsView b, int rows, uint8_t* out, OutputLayout layout,
                                  FoldedDecision decision) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  const int requests = rows / b.particles;
  // Thread q decides request q first, so the per-request values it packs below are the decision's (the
  // same thread wrote them); thread 0 writes the pressure flag it packs.
  if (decision.decide) {
    const bool pressure = decide_pressure(decision.view, r == 0);
    if (r < requests)
      decide_request(decision.view, r, decision.accepted, pressure);
  }
  if (r < rows) {
    const int stride = b.draft_steps + 1;
    int32_t* tokens = reinterpret_cast<int32_t*>(out + layout.tokens) + r * stride;
    for (int k = 0; k < stride; ++k)
      tokens[k] = b.cycle_tokens[r * stride + k];
    reinterpret_cast<int32_t*>(out + layout.first_eos)[r] = b.first_eos[r];
    reinterpret_cast<int32_t*>(out + layout.ancestor)[r] = b.particles > 1 ? b.ancestor[r] : r;
    reinterpret_cast<uint32_t*>(out + layout.row_flags)[r] = b.row_flags[r];
    reinterpret_cast<int32_t*>(out + layout.seq_len)[r] = b.tables.seq_len[r];
    reinterpret_cast<int32_t*>(out + layout.committed)[r] = b.committed[r];
    reinterpret_cast<int32_t*>(out + layout.accepted)[r] = b.accepted != nullptr ? b.accepted[r] : 0;
    out[layout.finished + r] = b.finished[r];
    out[layout.live + r] = b.tables.live[r];
  }
  if (r < requests) {
    out[layout.resampled + r] = b.resampled[r];
    reinterpret_cast<double*>(out + layout.ess)[r] = b.ess[r];
    reinterpret_cast<int32_t*>(out + layout.cycle_draft_steps)[r] = b.cycle_draft_steps[r];
    reinterpret_cast<int32_t*>(out + layout.next_draft_steps)[r] = b.request_draft_steps[r];
    reinterpret_cast<float*>(out + layout.acceptance_ema)[r] = b.acceptance_ema[r];
  }
  if (r == 0) {
    *reinterpret_cast<uint32_t*>(out + layout.status) = *b.status;
    out[layout.kv_pressure] = *b.kv_pressure;
  }
}

} // namespace

OutputLayout output_layout(int rows, int requests, int draft_steps) {
  OutputLayout layout;
  size_t offset = 0;
  auto take = [&](size_t bytes, size_t alignment) {
    offset = align_up(offset, alignment);
    const size_t at = offset;
    offset += bytes;
    return at;
  };
  layout.ess = take(sizeof(double) * requests, 8);
  layout.tokens = take(sizeof(int32_t) * rows * (draft_steps + 1), 4);
  layout.first_eos = take(sizeof(int32_t) * rows, 4);
  layout.ancestor = take(sizeof(int32_t) * rows, 4);
  layout.row_flags = take(sizeof(uint32_t) * rows, 4);
  layout.seq_len = take(sizeof(int32_t) * rows, 4);
  layout.committed = take(sizeof(int32_t) * rows, 4);
  layout.accepted = take(sizeof(int32_t) * rows, 4);
  layout.status = take(sizeof(uint32_t), 4);
  layout.cycle_draft_steps = take(sizeof(int32_t) * requests, 4);
  layout.next_draft_steps = take(sizeof(int32_t) * requests, 4);
  layout.acceptance_ema = take(sizeof(float) * requests, 4);
  layout.finished = take(rows, 1);
  layout.live = take(rows, 1);
  layout.resampled = take(requests, 1);
  layout.kv_pressure = take(1, 1);
  layout.bytes = align_up(offset, 8);
  return layout;
}

void pack_outputs(const CycleBuffers& b, int rows, uint8_t* out, cudaStream_t stream) {
  const OutputLayout layout = output_layout(rows, rows / b.particles, b.draft_steps);
  launch_per_row(PackOutputsKernel, rows, stream, outputs_view(b), rows, out, layout, FoldedDecision{});
}

void decide_and_pack_outputs(const CycleBuffers& b, int requests, const int32_t* accepted, uint8_t* out,
                             cudaStream_t stream) {
  constexpr const char* kWhere = "decide_and_pack_outputs";
  require(requests >= 1 && requests * b.particles <= b.max_rows, kWhere, "requests", requests,
          "must be in [1, max_rows / particles]");
  const int rows = requests * b.particles;
  const OutputLayout layout = output_layout(rows, requests, b.draft_steps);
  const FoldedDecision decision{true, decide_view(b, /*advance_draw_counters=*/true), accepted};
  launch_per_row(PackOutputsKernel, rows, stream, outputs_view(b), rows, out, layout, decision);
}

} // namespace smcgraph::detail
