// Per-request draft length (cycle_io.hpp; seed 001, ASBS): the decision at the end of a speculative cycle
// (EMA of the acceptance rate -> K of the next cycle, capped under KV pressure). It reads every value that
// changes between replays from device memory; the policy is fixed for the engine's lifetime. The captured
// cycle's conditions (max K over the live rows) are set by prepare_draft_inputs (forward_inputs.cu).
#include "kernels/pdl.cuh"
#include "kernels/random.cuh"
#include "kernels/cycle_io.hpp"
#include "kernels/draft_steps_device.cuh"
#include "kernels/launch_checks.hpp"

#include <algorithm>
#include <cmath>

#include "smcgraph/error.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::detail {
namespace {

constexpr int kThreads = 128;

// What each kernel reads and writes (pointers to const are read only): narrow views of CycleBuffers.
struct DecideView {
  DraftStepsPolicy policy;
  int particles = 1;
  SlotPoolView pool; ///< read: free_count
  const int32_t *committed, *pinned_draft_steps;
  int32_t *request_draft_steps, *cycle_draft_steps, *decision_free_slots;
  float* acceptance_ema;
  uint8_t* kv_pressure;
  uint32_t* draw_counters; ///< advanced by one per request when not null (the cycle's last draw is done)
};

DecideView decide_view(const CycleBuffers& b, bool advance_draw_counters) {
  // clang-format off
  return {.policy = b.policy, .particles = b.particles, .pool = b.pool, .committed = b.committed,
          .pinned_draft_steps = b.pinned_draft_steps, .request_draft_steps = b.request_draft_steps,
          .cycle_draft_steps = b.cycle_draft_steps, .decision_free_slots = b.decision_free_slots,
          .acceptance_ema = b.acceptance_ema, .kv_pressure = b.kv_pressure,
          .draw_counters = advance_draw_counters ? b.draw_counters : nullptr};
  // clang-format on
}

/// The seed's rule on the EMA after this cycle. Rounded operations (no FMA contraction), so a host reference
/// that does the same IEEE float steps gets the same bits.
__device__ __forceinline__ float next_ema(float ema, int accepted, int proposed, float smoothing) {
  const float rate = __fdiv_rn(static_cast<float>(accepted), static_cast<float>(proposed));
  return __fadd_rn(__fmul_rn(smoothing, rate), __fmul_rn(__fsub_rn(1.0f, smoothing), ema));
}

/// The cost-aware rule's score of K: expected tokens a cycle commits, 1 + a + ... + a^K, over its time in
/// units of the rest of the cycle, 1 + K * cost. Double, rounded operations in a fixed order (the host
/// reference does the same steps).
__device__ __forceinline__ double cycle_yield(int steps, double a, double cost) {
  double expected = 1.0, term = 1.0;
  for (int i = 0; i < steps; ++i) {
    term = __dmul_rn(term, a);
    expected = __dadd_rn(expected, term);
  }
  return __ddiv_rn(expected, __dadd_rn(1.0, __dmul_rn(static_cast<double>(steps), cost)));
}

__device__ __forceinline__ int choose_steps(const DraftStepsPolicy& policy, float ema, bool pressure) {
  int steps;
  if (policy.draft_cost > 0.0f) { // min <= mid <= max: a later candidate must do strictly better
    steps = policy.min_steps;
    double best = cycle_yield(steps, ema, policy.draft_cost);
    const int candidates[] = {policy.mid_steps, policy.max_steps};
    for (const int candidate : candidates) {
      const double yield = cycle_yield(candidate, ema, policy.draft_cost);
      if (yield > best) {
        best = yield;
        steps = candidate;
      }
    }
  } else {
    steps = ema >= policy.high_threshold  ? policy.max_steps
            : ema >= policy.low_threshold ? policy.mid_steps
                                          : policy.min_steps;
  }
  if (pressure)
    steps = min(steps, policy.pressure_cap);
  return steps;
}

__global__ void DecideDraftStepsKernel(DecideView b, int requests, const int32_t* accepted) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const int q = blockIdx.x * blockDim.x + threadIdx.x;
  const int free = *b.pool.free_count;
  const bool pressure = free < b.policy.pressure_watermark_slots;
  if (q == 0) {
    *b.decision_free_slots = free;
    *b.kv_pressure = pressure ? 1 : 0;
  }
  if (q >= requests)
    return;
  if (b.draw_counters != nullptr) // the draw-counter stage (random.cuh), folded into this launch
    device::advance_draw_counter(b.draw_counters, q);
  const int steps = request_draft_steps_of(b.request_draft_steps, q, b.policy.max_steps);
  b.cycle_draft_steps[q] = steps;
  bool drafted = false;
  for (int p = 0; p < b.particles; ++p)
    drafted = drafted || b.committed[q * b.particles + p] > 0;
  float ema = b.acceptance_ema[q];
  if (drafted && accepted != nullptr) { // the EMA moves only for a request that ran this cycle
    const int row_accepted = min(max(accepted[q * b.particles], 0), steps);
    ema = next_ema(ema, row_accepted, steps, b.policy.smoothing);
    b.acceptance_ema[q] = ema;
  }
  const int pinned = b.pinned_draft_steps[q];
  int next;
  if (pinned > 0)
    next = min(pinned, b.policy.max_steps); // a pin is the caller's choice: no pressure cap
  else if (!b.policy.adaptive)
    next = b.policy.max_steps;
  else
    next = choose_steps(b.policy, ema, pressure);
  b.request_draft_steps[q] = next;
}

} // namespace

DraftStepsPolicy draft_steps_policy(const EngineConfig& config) {
  const AdaptiveDraftSteps& a = config.adaptive;
  const int watermark_slots = static_cast<int>(
      std::floor(static_cast<double>(a.pressure_free_fraction) * (config.slot_pool_size - 1)));
  // validate_engine_config has checked 1 <= min_steps <= mid_steps <= draft_steps and the cap's range when
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
          .draft_cost = a.draft_cost};
}

void decide_draft_steps(const CycleBuffers& b, int requests, const int32_t* accepted, cudaStream_t stream,
                        bool advance_draw_counters) {
  constexpr const char* kWhere = "decide_draft_steps";
  require(requests >= 0 && requests * b.particles <= b.max_rows, kWhere, "requests", requests,
          "must be in [0, max_rows / particles]");
  const int blocks = std::max(1, static_cast<int>(ceil_div(requests, kThreads)));
  launch_pdl(DecideDraftStepsKernel, dim3(blocks), dim3(kThreads), 0, stream,
             decide_view(b, advance_draw_counters), requests, accepted);
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace smcgraph::detail
