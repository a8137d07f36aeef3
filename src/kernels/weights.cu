// Importance weights (DESIGN.md §2 step 6): one thread per row, accumulated in double.
#include "smcgraph/error.hpp"
#include "kernels/pdl.cuh"
#include "kernels/launch_checks.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/smc_kernels.hpp"

namespace smcgraph {
namespace {

constexpr int kThreads = 128;

template <class T> __device__ __forceinline__ T at(const StepMatrix<T>& matrix, int row, int step) {
  return matrix.data[row * matrix.row_stride + step * matrix.step_stride];
}

__global__ void AccumulateWeightsKernel(WeightInputs in, double* logw, uint8_t* finished,
                                        int32_t* first_eos) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= in.rows)
    return;
  if (!in.live[row] || finished[row]) {
    first_eos[row] = -1; // nothing of this cycle counts: the weight stays frozen
    return;
  }
  const double alpha = in.alpha[row];
  double increment = 0.0;
  int eos_step = in.steps;
  for (int k = 0; k < in.steps; ++k) {
    // Explicit _rn operations: no FMA contraction, so the host reference's plain double arithmetic matches.
    const double term = __dsub_rn(__dmul_rn(alpha, static_cast<double>(at(in.target_logprobs, row, k))),
                                  static_cast<double>(at(in.draft_logprobs, row, k)));
    increment = __dadd_rn(increment, term);
    if (at(in.draft_tokens, row, k) == in.eos_id) {
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

template <class T> void require_matrix(const StepMatrix<T>& matrix, const char* parameter) {
  require(matrix.data != nullptr, "accumulate_weights", parameter, "null", "must be a device pointer");
  require(matrix.row_stride >= 0 && matrix.step_stride >= 0, "accumulate_weights", parameter,
          matrix.row_stride < 0 ? matrix.row_stride : matrix.step_stride, "strides must be >= 0");
}

} // namespace

void accumulate_weights(const WeightInputs& in, double* logw, uint8_t* finished, int32_t* first_eos,
                        cudaStream_t stream) {
  constexpr const char* kWhere = "accumulate_weights";
  require(in.rows >= 0, kWhere, "in.rows", in.rows, "must be >= 0");
  require(in.steps >= 1, kWhere, "in.steps", in.steps, "must be >= 1");
  if (in.rows == 0)
    return;
  require_matrix(in.draft_logprobs, "in.draft_logprobs");
  require_matrix(in.target_logprobs, "in.target_logprobs");
  require_matrix(in.draft_tokens, "in.draft_tokens");
  require(in.logz != nullptr, kWhere, "in.logz", "null", "must be a device pointer");
  require(in.alpha != nullptr, kWhere, "in.alpha", "null", "must be a device pointer");
  require(in.live != nullptr, kWhere, "in.live", "null", "must be a device pointer");
  require(in.bonus_tokens != nullptr || in.eos_id < 0, kWhere, "in.bonus_tokens", "null",
          "must be a device pointer when eos_id >= 0 (an EOS bonus token finishes its row)");
  require(logw != nullptr, kWhere, "logw", "null", "must be a device pointer");
  require(finished != nullptr, kWhere, "finished", "null", "must be a device pointer");
  require(first_eos != nullptr, kWhere, "first_eos", "null", "must be a device pointer");
  const NvtxRange range("accumulate_weights");
  detail::launch_pdl(AccumulateWeightsKernel, dim3(static_cast<int>(detail::ceil_div(in.rows, kThreads))),
                     dim3(kThreads), 0, stream, in, logw, finished, first_eos);
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace smcgraph
