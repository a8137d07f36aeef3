// Per-request systematic resampling (DESIGN.md §2 step 7): one warp per request (resample_device.cuh, the
// stage's device code).
#include "kernels/pdl.cuh"
#include "kernels/cycle_io.hpp"
#include "kernels/launch_checks.hpp"
#include "kernels/resample_device.cuh"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/smc_kernels.hpp"

namespace smcgraph {
namespace {

constexpr int kWarpsPerBlock = 4;

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    ResampleKernel(ResampleInputs in, double* logw, ResampleOutputs out) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  __shared__ device::ResampleWarpStorage storage[kWarpsPerBlock];
  const int warp = threadIdx.x / 32;
  const int request = blockIdx.x * kWarpsPerBlock + warp;
  if (request >= in.requests)
    return; // warp-uniform: only warp collectives follow
  device::resample_request(in, logw, out, request, storage[warp]);
}

} // namespace

namespace detail {

void check_resample(const ResampleInputs& in, const double* logw, const ResampleOutputs& out,
                    const char* where) {
  require(in.requests >= 0, where, "in.requests", in.requests, "must be >= 0");
  require(in.particles_per_request >= 1 && in.particles_per_request <= kMaxResampleParticles, where,
          "in.particles_per_request", in.particles_per_request,
          "must be in [1, kMaxResampleParticles = 256]");
  require(static_cast<int64_t>(in.requests) * in.particles_per_request <= INT32_MAX, where, "in.requests",
          in.requests, "times particles_per_request must fit in int32");
  if (in.requests == 0)
    return;
  require_device_pointers(where, {{"in.live", in.live},
                                  {"in.tau", in.tau},
                                  {"in.seeds", in.seeds},
                                  {"in.draw_counters", in.draw_counters},
                                  {"logw", logw},
                                  {"out.ancestor", out.ancestor},
                                  {"out.ess", out.ess},
                                  {"out.resampled", out.resampled},
                                  {"out.log_evidence", out.log_evidence}});
}

} // namespace detail

void resample(const ResampleInputs& in, double* logw, const ResampleOutputs& out, cudaStream_t stream) {
  detail::check_resample(in, logw, out, "resample");
  if (in.requests == 0)
    return;
  const int blocks = (in.requests + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const NvtxRange range("resample");
  detail::launch_pdl(ResampleKernel, dim3(blocks), dim3(kWarpsPerBlock * 32), 0, stream, in, logw, out);
}

} // namespace smcgraph
