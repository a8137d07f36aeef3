// Per-request draft length (cycle_io.hpp; seed 001, ASBS): the decision at the end of a speculative cycle
// (EMA of the acceptance rate -> K of the next cycle, capped under KV pressure). It reads every value that
// changes between replays from device memory; the policy is fixed for the engine's lifetime. The captured
// cycle's conditions (max K over the live rows) are set by prepare_draft_inputs (forward_inputs.cu).
#include "kernels/pdl.cuh"
#include "kernels/random.cuh"
#include "kernels/cycle_io.hpp"
#include "kernels/draft_steps_decide.cuh"
#include "kernels/launch_checks.hpp"

#include <algorithm>
#include <cmath>

#include "smcgraph/error.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::detail {
namespace {

constexpr int kThreads = 128;

__global__ void DecideDraftStepsKernel(DecideView b, int requests, const int32_t* accepted) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const int q = blockIdx.x * blockDim.x + threadIdx.x;
  const bool pressure = decide_pressure(b, q == 0);
  if (q < requests)
    decide_request(b, q, accepted, pressure);
}

} // namespace

DraftStepsPolicy draft_steps_policy(const EngineConfig& config) {
  const AdaptiveDraftSteps& a = config.adaptive;
  const int watermark_slots = static_cast<int>(
      std::floor(static_cast<double>(a.pressure_free_fraction) * (config.slot_pool_size - 1)));
  // validate_engine_config has checked 0 <= min_steps <= mid_steps <= draft_steps and the cap's range when
  // adaptive; without it the three are never read.
  return {.adaptive = a.enabled,
          .min_steps = a.min_steps,
          .mid_steps = a.mid_steps,
          .max_steps = config.draft_steps,
          .pressure_cap = a.pressure_cap,
          .pressure_watermark_slots = watermark_slots,
          .smoothing = a.smoothing,
          .initial_acceptance = a.initial_acceptance,
          .high_threshold = a.high_threshold,
          .low_threshold = a.low_threshold,
          .draft_cost = a.draft_cost,
          .idle_recovery = a.idle_recovery};
}

void decide_draft_steps(const CycleBuffers& b, int requests, const int32_t* accepted, cudaStream_t stream,
                        bool advance_draw_counters) {
  constexpr const char* kWhere = "decide_draft_steps";
  require(requests >= 0 && requests * b.particles <= b.max_rows, kWhere, "requests", requests,
          "must be in [0, max_rows / particles]");
  const int blocks = std::max(1, static_cast<int>(ceil_div(requests, kThreads)));
  launch_pdl(DecideDraftStepsKernel, dim3(blocks), dim3(kThreads), 0, stream,
             decide_view(b, advance_draw_counters), requests, accepted);
}

} // namespace smcgraph::detail
