#include "reference/draft_steps_ref.hpp"

#include <algorithm>
#include <cmath>

namespace smcgraph::reference {

DraftStepsRule draft_steps_rule(const EngineConfig& config) {
  const AdaptiveDraftSteps& a = config.adaptive;
  DraftStepsRule rule;
  rule.adaptive = a.enabled;
  rule.max_steps = config.draft_steps;
  rule.mid_steps = a.mid_steps;
  rule.min_steps = a.min_steps;
  rule.pressure_cap = a.pressure_cap;
  rule.watermark_slots =
      std::floor(static_cast<double>(a.pressure_free_fraction) * (config.slot_pool_size - 1));
  rule.smoothing = a.smoothing;
  rule.initial = a.initial_acceptance;
  rule.high = a.high_threshold;
  rule.low = a.low_threshold;
  rule.draft_cost = a.draft_cost;
  rule.idle_recovery = a.idle_recovery;
  return rule;
}

RequestDraftState admitted_state(const DraftStepsRule& rule, int pinned) {
  // The first K: the pin, or the rule's choice at the initial EMA without a pressure cap (K_max with the
  // seed's thresholds).
  return {rule.initial, choose_steps(rule, rule.initial, false, pinned), pinned};
}

float ema_after(float ema, int accepted, int proposed, float smoothing) {
  // Separate statements, each result a float: the same IEEE roundings as the device's __f*_rn operations.
  const float rate = static_cast<float>(accepted) / static_cast<float>(proposed);
  const float recent = smoothing * rate;
  const float keep = 1.0f - smoothing;
  const float kept = keep * ema;
  return recent + kept;
}

float ema_after_idle(float ema, float recovery) {
  const float gap = 1.0f - ema;
  const float step = recovery * gap;
  return ema + step;
}

bool kv_pressure(const DraftStepsRule& rule, int free_slots) {
  return static_cast<double>(free_slots) < rule.watermark_slots;
}

double cycle_yield(int steps, double a, double cost) {
  // One IEEE double operation a statement, in the order the sum is written: no contraction to FMA.
  double expected = 1.0, power = 1.0;
  for (int i = 1; i <= steps; ++i) {
    power = power * a; // a^i
    expected = expected + power;
  }
  const double spent = static_cast<double>(steps) * cost;
  const double time = 1.0 + spent;
  return expected / time;
}

int choose_steps(const DraftStepsRule& rule, float ema, bool pressure, int pinned) {
  if (pinned > 0)
    return pinned;
  if (!rule.adaptive)
    return rule.max_steps;
  int steps = rule.min_steps;
  if (rule.draft_cost > 0.0f) {
    // The largest yield wins; equal yields keep the smaller K (candidates in increasing K).
    double best = cycle_yield(rule.min_steps, ema, rule.draft_cost);
    for (int candidate : {rule.mid_steps, rule.max_steps}) {
      const double yield = cycle_yield(candidate, ema, rule.draft_cost);
      if (yield > best) {
        best = yield;
        steps = candidate;
      }
    }
  } else {
    if (ema >= rule.low)
      steps = rule.mid_steps;
    if (ema >= rule.high)
      steps = rule.max_steps;
  }
  return pressure ? std::min(steps, rule.pressure_cap) : steps;
}

int advance(const DraftStepsRule& rule, RequestDraftState& state, bool drafted, int accepted,
            int free_slots) {
  const int used = state.steps;
  if (drafted && used > 0)
    state.ema = ema_after(state.ema, std::clamp(accepted, 0, used), used, rule.smoothing);
  else if (drafted && used == 0 && rule.adaptive) // an adaptive K = 0 cycle: a step toward 1
    state.ema = ema_after_idle(state.ema, rule.idle_recovery);
  // (draft_steps = 0, not adaptive, proposes nothing: the EMA stays)
  state.steps = choose_steps(rule, state.ema, kv_pressure(rule, free_slots), state.pinned);
  return used;
}

} // namespace smcgraph::reference
