// Output packing (cycle_io.hpp): one cycle's outputs into the pinned buffer the host reads (layout below).
#include "kernels/pdl.cuh"
#include "kernels/cycle_io.hpp"
#include "kernels/output_packing_device.cuh"
#include "kernels/row_launch.cuh"

#include <algorithm>

#include "smcgraph/error.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::detail {
namespace {

size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

__global__ void PackOutputsKernel(OutputsView b, int rows, uint8_t* out, OutputLayout layout,
                                  FoldedDecision decision) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  pack_row(b, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), rows, out, layout, decision);
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
