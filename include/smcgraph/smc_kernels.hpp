// The particle stages of the SMC cycle (DESIGN.md §2 steps 6-8): importance weights, per-request
// systematic resampling, and the slot-table reshuffle that applies the resampling plan.
//
// clang-format off
//   smcgraph::WeightInputs in{{d_draft_logq, 1, rows}, {d_target_logp, k, 1}, d_logz,
//                             {d_draft_tokens, 1, rows}, d_alpha, d_live, rows, k, eos_id};
//   smcgraph::accumulate_weights(in, d_logw, d_finished, d_first_eos, stream);
//   smcgraph::ResampleInputs rs{d_live, d_tau, d_seeds, d_draw_counters, requests, n};
//   smcgraph::ResampleOutputs ro{d_ancestor, d_ess, d_resampled, d_log_evidence};
//   smcgraph::resample(rs, d_logw, ro, stream);
//   smcgraph::reshuffle(pool, tables, d_ancestor, d_finished, stream);  // every cycle, even for an identity plan
// clang-format on
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "smcgraph/slots.hpp"

namespace smcgraph {

/// A per-row, per-step matrix: element (row, step) is data[row * row_stride + step * step_stride] (strides
/// in elements). {p, K, 1} reads a dense [rows, K] array; {p + 1, K + 1, 1} columns 1 .. K of a [rows, K + 1]
/// block (the engine's draft block: x_{L-1}, d_1 .. d_K); {p, 1, rows} a step-major [K, rows] array.
template <class T> struct StepMatrix {
  const T* data = nullptr;
  int64_t row_stride = 0;
  int64_t step_stride = 1;
};

/// Inputs of accumulate_weights, all device memory except the shape and the EOS id (a config constant).
struct WeightInputs {
  StepMatrix<float> draft_logprobs;      ///< log q(d_k) of the draft token at step k
  StepMatrix<float> target_logprobs;     ///< tempered log p(d_k) under T_t
  const float* logz = nullptr;           ///< [rows] logZ of the bonus position (0 when alpha = 1)
  StepMatrix<int32_t> draft_tokens;      ///< d_k
  const float* alpha = nullptr;          ///< [rows] power of the target
  const uint8_t* live = nullptr;         ///< [rows]
  const int32_t* bonus_tokens = nullptr; ///< [rows] x_{K+1}; required when eos_id >= 0
  int rows = 0;
  int steps = 0;   ///< K
  int eos_id = -1; ///< -1: no EOS token
};

/// Step 6. For every live row that is not already finished:
///   logw[r] += sum_{k <= e} (alpha * log p_k - log q_k) + (e == K ? logZ : 0)
/// where e is the first k with d_k == eos_id (K when none). EOS is absorbing: the EOS column itself counts,
/// columns after it and the bonus' logZ do not, and the row becomes finished. A bonus token equal to eos_id
/// (when no draft token was EOS) also finishes the row; its logZ counts (the bonus was drawn this cycle).
/// Accumulated in double (no fused multiply-add, so a host double sum reproduces it bit for bit) so 10^4
/// cycles do not drift. first_eos[r] = e (K when none) for rows that count this cycle, -1 for rows that do
/// not (already finished or not live: every token of their cycle is padding). Finished or non-live rows keep
/// logw and finished unchanged.
void accumulate_weights(const WeightInputs& in, double* logw, uint8_t* finished, int32_t* first_eos,
                        cudaStream_t stream);

/// Upper bound on particles_per_request for resample (one warp per request, 8 particles per lane).
inline constexpr int kMaxResampleParticles = 256;

/// Inputs of resample, device memory except the shape.
struct ResampleInputs {
  const uint8_t* live = nullptr;           ///< [rows]; a request takes part only when all its rows are live
  const float* tau = nullptr;              ///< [requests] resample when ESS < tau * N (0: never)
  const uint64_t* seeds = nullptr;         ///< [requests] Philox keys
  const uint32_t* draw_counters = nullptr; ///< [requests] (advanced elsewhere, once per cycle)
  int requests = 0;
  int particles_per_request = 0; ///< N, 1 .. kMaxResampleParticles
};

/// Outputs of resample.
struct ResampleOutputs {
  int32_t* ancestor =
      nullptr; ///< [rows] row whose state row r takes; r itself for every row that keeps its own
  double* ess =
      nullptr; ///< [requests] 1 / sum(wn^2) of the normalised weights; 0 for requests not taking part
  uint8_t* resampled = nullptr;   ///< [requests] 1 when the request resampled this cycle
  double* log_evidence = nullptr; ///< [requests] log Z-hat, += logsumexp(logw) - log N when resampled
};

/// Step 7, one warp per request. Normalises the request's logw (double), ESS = 1 / sum(wn^2); when
/// ESS < tau * N, systematic resampling with one uniform u = uniform_open01(word 0 of Philox under
/// seeds[q] at counter {0, draw_counters[q], 0, philox_stream(Salt::kResample, 0)}): particle i gets
/// count_i = #{m < N : C_{i-1} <= (u + m) / N < C_i} offspring (C = cumulative normalised weights, C_{N-1}
/// forced to 1). Survivors (count >= 1) keep themselves; survivors in increasing order hand their extra
/// copies to the dead particles (count 0) in increasing order, so sources are never destinations. A
/// resampled request's logw are reset to 0. Requests not resampled, not fully live, or whose weights are
/// all -inf / NaN get the identity plan and keep logw and log_evidence.
void resample(const ResampleInputs& in, double* logw, const ResampleOutputs& out, cudaStream_t stream);

/// Step 8, one CTA per row (static grid; a no-op CTA where ancestor[r] == r, so it is launched every cycle).
/// Every row r with a = ancestor[r] != r becomes a copy of row a: slot_table and token_table up to a's
/// length, seq_len, live, finished; each copied slot gains a reference before r's old slot at that position
/// loses one (a shared prefix nets zero and is never transiently freed); slots that reach 0 go back on the
/// free stack. KV bytes never move. Rows whose ancestor is out of range or is itself a destination
/// (ancestor[a] != a) are left alone.
void reshuffle(const SlotPoolView& pool, const RowTablesView& tables, const int32_t* ancestor,
               uint8_t* finished, cudaStream_t stream);

} // namespace smcgraph
