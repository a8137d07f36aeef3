// The importance-weight update of one row (smc_kernels.hpp, accumulate_weights: DESIGN.md §2 step 6) as a
// device function: its stage (weights.cu) and the SMC commit launch it is folded into (commit.cu) run the
// same code.
#pragma once

#include "smcgraph/smc_kernels.hpp"

namespace smcgraph::detail {

template <class T> __device__ __forceinline__ T step_at(const StepMatrix<T>& matrix, int row, int step) {
  return matrix.data[row * matrix.row_stride + step * matrix.step_stride];
}

/// Row `row` (< in.rows) of accumulate_weights: logw, finished and first_eos of that row.
__device__ __forceinline__ void accumulate_row_weight(const WeightInputs& in, int row, double* logw,
                                                      uint8_t* finished, int32_t* first_eos) {
  if (!in.live[row] || finished[row]) {
    first_eos[row] = -1; // nothing of this cycle counts: the weight stays frozen
    return;
  }
  const double alpha = in.alpha[row];
  double increment = 0.0;
  int eos_step = in.steps;
  for (int k = 0; k < in.steps; ++k) {
    // Explicit _rn operations: no FMA contraction, so the host reference's plain double arithmetic matches.
    const double term = __dsub_rn(__dmul_rn(alpha, static_cast<double>(step_at(in.target_logprobs, row, k))),
                                  static_cast<double>(step_at(in.draft_logprobs, row, k)));
    increment = __dadd_rn(increment, term);
    if (step_at(in.draft_tokens, row, k) == in.eos_id) {
      eos_step = k;
      break;
    }
  }
  if (eos_step == in.steps) {
    increment = __dadd_rn(increment, static_cast<double>(in.logz[row])); // the bonus comes after an EOS
    if (in.eos_id >= 0 && in.bonus_tokens[row] == in.eos_id)
      finished[row] = 1; // EOS drawn as the bonus: counted this cycle, absorbing from the next
  } else {
    finished[row] = 1;
  }
  logw[row] = __dadd_rn(logw[row], increment);
  first_eos[row] = eos_step;
}

/// Host checks of accumulate_weights' arguments (weights.cu); throws smcgraph::Error naming the parameter.
void validate_weight_inputs(const WeightInputs& in, const double* logw, const uint8_t* finished,
                            const int32_t* first_eos, const char* where);

} // namespace smcgraph::detail
