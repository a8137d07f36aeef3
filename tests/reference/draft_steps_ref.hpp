// Host reference of the per-request draft length (src/kernels/draft_steps.cu; seed 001, ASBS), written from
// the seed's rule and AdaptiveDraftSteps' documentation rather than from the kernel:
//
//   ema' = smoothing * accepted / K + (1 - smoothing) * ema        (every request that drafted this cycle)
//   ema' = ema + idle_recovery * (1 - ema)                           (an adaptive request that ran with K =
//   0) K'   = K_max if ema' >= high, mid if ema' >= low, else min     (adaptive requests, draft_cost = 0) K'
//   = argmax over {min, mid, max} of (1 + ema' + ... + ema'^K) / (1 + K * draft_cost), the smallest
//          on a tie                                                 (adaptive requests, draft_cost > 0)
//   K'   = min(K', pressure_cap) while free slots < floor(fraction * (pool - 1))
//   K'   = the pin for a pinned request (no cap); K_max for every request when adaptive is off
//
//   reference::DraftStepsRule rule = reference::draft_steps_rule(engine_config);
//   reference::RequestDraftState state = reference::admitted_state(rule, /*pinned=*/0);
//   reference::advance(rule, state, /*accepted=*/3, /*free_slots=*/5000);   // one cycle
#pragma once

#include <cstdint>
#include <vector>

#include "smcgraph/engine.hpp"

namespace smcgraph::reference {

/// The rule's constants as EngineConfig states them.
struct DraftStepsRule {
  bool adaptive = false;
  int max_steps = 1, mid_steps = 1, min_steps = 1, pressure_cap = 1;
  double watermark_slots = 0.0; ///< pressure while free slots < this (an integer: floor of the fraction)
  float smoothing = 0.2f, initial = 0.8f, high = 0.8f, low = 0.5f;
  float draft_cost = 0.0f;    ///< > 0: the cost-aware rule
  float idle_recovery = 0.0f; ///< the EMA's step toward 1 after an adaptive K = 0 cycle
};
DraftStepsRule draft_steps_rule(const EngineConfig& config);

/// One request's decision state.
struct RequestDraftState {
  float ema = 0.0f;
  int steps = 0;  ///< K of the next cycle
  int pinned = 0; ///< 0: adaptive
};
RequestDraftState admitted_state(const DraftStepsRule& rule, int pinned);

/// The acceptance-rate EMA after a cycle that accepted `accepted` of `proposed` draft tokens (IEEE float,
/// each operation rounded on its own).
float ema_after(float ema, int accepted, int proposed, float smoothing);
/// The EMA after an adaptive cycle with K = 0: ema + recovery * (1 - ema), each operation rounded on its own.
float ema_after_idle(float ema, float recovery);
bool kv_pressure(const DraftStepsRule& rule, int free_slots);
/// The cost-aware rule's score of K: (1 + a + ... + a^K) / (1 + K * cost) in double.
double cycle_yield(int steps, double a, double cost);
/// K of the next cycle for an EMA (pins and the cap applied).
int choose_steps(const DraftStepsRule& rule, float ema, bool pressure, int pinned);

/// One cycle of one request: drafted (it ran this cycle) moves the EMA with accepted / state.steps, then the
/// next K is chosen. Returns the K this cycle used.
int advance(const DraftStepsRule& rule, RequestDraftState& state, bool drafted, int accepted, int free_slots);

} // namespace smcgraph::reference
