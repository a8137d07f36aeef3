// Output packing's device code (cycle_io.hpp: pack_outputs, decide_and_pack_outputs): the view it reads and
// one thread's share of the packing. Its home launch is output_packing.cu; the speculative recipe also runs
// it at the end of its one-CTA commit launch (commit.cu: commit_speculative_and_pack_outputs). Internal:
// compiled by nvcc only.
#pragma once

#include <cstdint>

#include "kernels/cycle_io.hpp"
#include "kernels/draft_steps_decide.cuh"
#include "kernels/prefix_load.cuh"

namespace smcgraph::detail {

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

inline OutputsView outputs_view(const CycleBuffers& b) {
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

/// Thread r's share of the packing (every thread of the launch calls it, r its index over the launch): with
/// a folded decision, request r's draft length first (thread 0 also writes the pressure flag), then row r's
/// values, request r's values, and (r = 0) the status word and the pressure flag into `out`.
__device__ __forceinline__ void pack_row(const OutputsView& b, int r, int rows, uint8_t* out,
                                         const OutputLayout& layout, const FoldedDecision& decision) {
  const int requests = rows / b.particles;
  // Thread q decides request q first, so the per-request values it packs below are the decision's (the
  // same thread wrote them); thread 0 writes the pressure flag it packs.
  if (decision.decide) {
    const bool pressure = decide_pressure(decision.view, r == 0);
    if (r < requests)
      decide_request(decision.view, r, decision.accepted, pressure);
  }
  // Every value first, then the stores into `out`: the compiler must assume a byte buffer aliases the
  // sources, so a load after a store to it would wait for that store's data, one memory latency after
  // another (about 16 of them in a row for thread 0).
  const bool row = r < rows, request = r < requests;
  const int stride = b.draft_steps + 1;
  // The row's cycle tokens (the first 8 with the rest).
  const device::PrefixLoad<8, int32_t> cycle_tokens(b.cycle_tokens + r * stride, row ? stride : 0);
  int32_t first_eos = 0, ancestor = 0, seq_len = 0, committed = 0, accepted = 0;
  uint32_t row_flags = 0;
  uint8_t finished = 0, live = 0;
  if (row) {
    first_eos = b.first_eos[r];
    ancestor = b.particles > 1 ? b.ancestor[r] : r;
    row_flags = b.row_flags[r];
    seq_len = b.tables.seq_len[r];
    committed = b.committed[r];
    accepted = b.accepted != nullptr ? b.accepted[r] : 0;
    finished = b.finished[r];
    live = b.tables.live[r];
  }
  uint8_t resampled = 0;
  double ess = 0.0;
  int32_t cycle_draft_steps = 0, next_draft_steps = 0;
  float acceptance_ema = 0.0f;
  if (request) {
    resampled = b.resampled[r];
    ess = b.ess[r];
    cycle_draft_steps = b.cycle_draft_steps[r];
    next_draft_steps = b.request_draft_steps[r];
    acceptance_ema = b.acceptance_ema[r];
  }
  uint32_t status = 0;
  uint8_t kv_pressure = 0;
  if (r == 0) {
    status = *b.status;
    kv_pressure = *b.kv_pressure;
  }
  if (row) {
    int32_t* tokens = reinterpret_cast<int32_t*>(out + layout.tokens) + r * stride;
    cycle_tokens.for_each([&](int k, int32_t token) { tokens[k] = token; });
    reinterpret_cast<int32_t*>(out + layout.first_eos)[r] = first_eos;
    reinterpret_cast<int32_t*>(out + layout.ancestor)[r] = ancestor;
    reinterpret_cast<uint32_t*>(out + layout.row_flags)[r] = row_flags;
    reinterpret_cast<int32_t*>(out + layout.seq_len)[r] = seq_len;
    reinterpret_cast<int32_t*>(out + layout.committed)[r] = committed;
    reinterpret_cast<int32_t*>(out + layout.accepted)[r] = accepted;
    out[layout.finished + r] = finished;
    out[layout.live + r] = live;
  }
  if (request) {
    out[layout.resampled + r] = resampled;
    reinterpret_cast<double*>(out + layout.ess)[r] = ess;
    reinterpret_cast<int32_t*>(out + layout.cycle_draft_steps)[r] = cycle_draft_steps;
    reinterpret_cast<int32_t*>(out + layout.next_draft_steps)[r] = next_draft_steps;
    reinterpret_cast<float*>(out + layout.acceptance_ema)[r] = acceptance_ema;
  }
  if (r == 0) {
    *reinterpret_cast<uint32_t*>(out + layout.status) = status;
    out[layout.kv_pressure] = kv_pressure;
  }
}

} // namespace smcgraph::detail
