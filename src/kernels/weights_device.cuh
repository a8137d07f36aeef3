// The importance-weight update of one row (smc_kernels.hpp, accumulate_weights: DESIGN.md §2 step 6) as a
// device function: its stage (weights.cu) and the SMC commit launch it is folded into (commit.cu) run the
// same code.
#pragma once

#include "smcgraph/smc_kernels.hpp"

namespace smcgraph::detail {

template <class T> __device__ __forceinline__ T step_at(const StepMatrix<T>& matrix, int row, int step) {
  return matrix.data[row * matrix.row_stride + step * matrix.step_stride];
}

/// Row `row` (< in.rows) of accumulate_weights: logw, finished and first_eos of that row; returns the
/// first_eos it wrote. Every value the row may need is loaded before the first store and before any load
/// depends on another (the first kPrefetchSteps steps' log-probs and tokens in registers, the steps past an
/// EOS included), so the row costs one memory latency instead of one a step; the arithmetic is the same.
__device__ __forceinline__ int accumulate_row_weight(const WeightInputs& in, int row, double* logw,
                                                     uint8_t* finished, int32_t* first_eos) {
  constexpr int kPrefetchSteps = 8;
  const bool live = in.live[row] != 0, was_finished = finished[row] != 0;
  const double alpha = in.alpha[row];
  const float logz = in.logz[row];
  const int32_t bonus = in.bonus_tokens != nullptr ? in.bonus_tokens[row] : -1;
  const double logw_before = logw[row];
  float target[kPrefetchSteps], draft[kPrefetchSteps];
  int32_t token[kPrefetchSteps];
#pragma unroll
  for (int k = 0; k < kPrefetchSteps; ++k) {
    if (k < in.steps) {
      target[k] = step_at(in.target_logprobs, row, k);
      draft[k] = step_at(in.draft_logprobs, row, k);
      token[k] = step_at(in.draft_tokens, row, k);
    }
  }
  if (!live || was_finished) {
    first_eos[row] = -1; // nothing of this cycle counts: the weight stays frozen
    return -1;
  }
  double increment = 0.0;
  int eos_step = in.steps;
  const auto add_step = [&](int k, float target_logprob, float draft_logprob, int32_t draft_token) {
    // Explicit _rn operations: no FMA contraction, so the host reference's plain double arithmetic matches.
    const double term =
        __dsub_rn(__dmul_rn(alpha, static_cast<double>(target_logprob)), static_cast<double>(draft_logprob));
    increment = __dadd_rn(increment, term);
    if (draft_token == in.eos_id)
      eos_step = k;
  };
#pragma unroll
  for (int k = 0; k < kPrefetchSteps; ++k)
    if (k < in.steps && eos_step == in.steps)
      add_step(k, target[k], draft[k], token[k]);
  for (int k = kPrefetchSteps; k < in.steps && eos_step == in.steps; ++k)
    add_step(k, step_at(in.target_logprobs, row, k), step_at(in.draft_logprobs, row, k),
             step_at(in.draft_tokens, row, k));
  if (eos_step == in.steps) {
    increment = __dadd_rn(increment, static_cast<double>(logz)); // the bonus comes after an EOS
    if (in.eos_id >= 0 && bonus == in.eos_id)
      finished[row] = 1; // EOS drawn as the bonus: counted this cycle, absorbing from the next
  } else {
    finished[row] = 1;
  }
  logw[row] = __dadd_rn(logw_before, increment);
  first_eos[row] = eos_step;
  return eos_step;
}

/// Host checks of accumulate_weights' arguments (weights.cu); throws smcgraph::Error naming the parameter.
void validate_weight_inputs(const WeightInputs& in, const double* logw, const uint8_t* finished,
                            const int32_t* first_eos, const char* where);

} // namespace smcgraph::detail
