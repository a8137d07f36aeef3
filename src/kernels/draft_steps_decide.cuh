// The draft-length decision of one request at the end of a speculative cycle (seed 001, ASBS: EMA of the
// acceptance rate -> K of the next cycle, capped under KV pressure), as device functions: its stage
// (draft_steps.cu, decide_draft_steps) and the fused end-of-cycle launch (output_packing.cu,
// decide_and_pack_outputs) run the same code.
#pragma once

#include "kernels/cycle_io.hpp"
#include "kernels/draft_steps_device.cuh"
#include "kernels/random.cuh"

namespace smcgraph::detail {

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

inline DecideView decide_view(const CycleBuffers& b, bool advance_draw_counters) {
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

/// The EMA after a cycle in which the request drafted nothing (K = 0): a step of `recovery` toward 1, rounded
/// operations as in next_ema.
__device__ __forceinline__ float idle_ema(float ema, float recovery) {
  return __fadd_rn(ema, __fmul_rn(recovery, __fsub_rn(1.0f, ema)));
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

/// Reads free_count (after the cycle's frees were collected) and returns the KV-pressure flag; `write` (one
/// thread of the launch) also stores decision_free_slots and kv_pressure.
__device__ __forceinline__ bool decide_pressure(const DecideView& b, bool write) {
  const int free = *b.pool.free_count;
  const bool pressure = free < b.policy.pressure_watermark_slots;
  if (write) {
    *b.decision_free_slots = free;
    *b.kv_pressure = pressure ? 1 : 0;
  }
  return pressure;
}

/// Request q's decision: cycle_draft_steps[q] = this cycle's K_q, the EMA moved by accepted / K_q if the
/// request drafted (accepted null: SMC, it does not move) or toward 1 after an adaptive K_q = 0 cycle,
/// request_draft_steps[q] = the next K (pins kept), and draw_counters[q] += 1 when the view has them.
__device__ __forceinline__ void decide_request(const DecideView& b, int q, const int32_t* accepted,
                                               bool pressure) {
  // Every value first, then the stores: a load the compiler must keep after a store (it cannot tell the
  // buffers apart) would wait for the store's data, one memory latency after another.
  const int steps = request_draft_steps_of(b.request_draft_steps, q, b.policy.max_steps);
  bool drafted = false;
  for (int p = 0; p < b.particles; ++p) // every load issued (no short circuit)
    drafted |= b.committed[q * b.particles + p] > 0;
  const float ema_before = b.acceptance_ema[q];
  const int row_accepted = accepted != nullptr ? accepted[q * b.particles] : 0;
  const int pinned = b.pinned_draft_steps[q];
  const uint32_t draw_counter = b.draw_counters != nullptr ? b.draw_counters[q] : 0u;
  // The EMA moves with the acceptance rate for a request that drafted this cycle (ran, and K_q > 0:
  // draft_steps = 0 drafts none); an adaptive request that ran with K_q = 0 recovers toward 1 instead.
  const bool acceptance_moves = drafted && accepted != nullptr && steps > 0;
  const bool recovers = !acceptance_moves && drafted && b.policy.adaptive && steps == 0;
  float ema = ema_before;
  if (acceptance_moves)
    ema = next_ema(ema, min(max(row_accepted, 0), steps), steps, b.policy.smoothing);
  else if (recovers)
    ema = idle_ema(ema, b.policy.idle_recovery);
  int next;
  if (pinned > 0)
    next = min(pinned, b.policy.max_steps); // a pin is the caller's choice: no pressure cap
  else if (!b.policy.adaptive)
    next = b.policy.max_steps;
  else
    next = choose_steps(b.policy, ema, pressure);
  if (b.draw_counters != nullptr) // the draw-counter stage (random.cuh), folded into this launch
    device::advance_draw_counter(b.draw_counters, q, draw_counter);
  b.cycle_draft_steps[q] = steps;
  if (acceptance_moves || recovers)
    b.acceptance_ema[q] = ema;
  b.request_draft_steps[q] = next;
}

} // namespace smcgraph::detail
