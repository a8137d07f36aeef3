// Importance weights (DESIGN.md §2 step 6): one thread per row, accumulated in double.
#include "smcgraph/error.hpp"
#include "kernels/pdl.cuh"
#include "kernels/launch_checks.hpp"
#include "kernels/weights_device.cuh"
#include "smcgraph/runtime.hpp"
#include "smcgraph/smc_kernels.hpp"

namespace smcgraph {
namespace {

constexpr int kThreads = 128;

__global__ void AccumulateWeightsKernel(WeightInputs in, double* logw, uint8_t* finished,
                                        int32_t* first_eos) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row < in.rows)
    detail::accumulate_row_weight(in, row, logw, finished, first_eos);
}

template <class T>
void require_matrix(const StepMatrix<T>& matrix, const char* where, const char* parameter) {
  require(matrix.data != nullptr, where, parameter, "null", "must be a device pointer");
  require(matrix.row_stride >= 0 && matrix.step_stride >= 0, where, parameter,
          matrix.row_stride < 0 ? matrix.row_stride : matrix.step_stride, "strides must be >= 0");
}

} // namespace

namespace detail {

void validate_weight_inputs(const WeightInputs& in, const double* logw, const uint8_t* finished,
                            const int32_t* first_eos, const char* where) {
  require(in.rows >= 0, where, "in.rows", in.rows, "must be >= 0");
  require(in.steps >= 1, where, "in.steps", in.steps, "must be >= 1");
  require_matrix(in.draft_logprobs, where, "in.draft_logprobs");
  require_matrix(in.target_logprobs, where, "in.target_logprobs");
  require_matrix(in.draft_tokens, where, "in.draft_tokens");
  require(in.logz != nullptr, where, "in.logz", "null", "must be a device pointer");
  require(in.alpha != nullptr, where, "in.alpha", "null", "must be a device pointer");
  require(in.live != nullptr, where, "in.live", "null", "must be a device pointer");
  require(in.bonus_tokens != nullptr || in.eos_id < 0, where, "in.bonus_tokens", "null",
          "must be a device pointer when eos_id >= 0 (an EOS bonus token finishes its row)");
  require(logw != nullptr, where, "logw", "null", "must be a device pointer");
  require(finished != nullptr, where, "finished", "null", "must be a device pointer");
  require(first_eos != nullptr, where, "first_eos", "null", "must be a device pointer");
}

} // namespace detail

void accumulate_weights(const WeightInputs& in, double* logw, uint8_t* finished, int32_t* first_eos,
                        cudaStream_t stream) {
  constexpr const char* kWhere = "accumulate_weights";
  require(in.rows >= 0, kWhere, "in.rows", in.rows, "must be >= 0");
  require(in.steps >= 1, kWhere, "in.steps", in.steps, "must be >= 1");
  if (in.rows == 0)
    return;
  detail::validate_weight_inputs(in, logw, finished, first_eos, kWhere);
  const NvtxRange range("accumulate_weights");
  detail::launch_pdl(AccumulateWeightsKernel, dim3(static_cast<int>(detail::ceil_div(in.rows, kThreads))),
                     dim3(kThreads), 0, stream, in, logw, finished, first_eos);
}

} // namespace smcgraph
