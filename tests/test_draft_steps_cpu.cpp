// The adaptive draft length on the host (seed 001, ASBS): the reference rule's behaviours the seed asks for,
// the EngineConfig / RequestParams checks of its fields, and the host side of the device policy and outputs.
// The device decision is compared with this reference in test_draft_steps_gpu.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cycle_io.hpp"
#include "reference/draft_steps_ref.hpp"
#include "runtime/engine_validation.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;

namespace {

EngineConfig adaptive_config(int max_steps = 8) {
  EngineConfig c;
  c.kind = CycleKind::kSpeculative;
  c.particles = 1;
  c.draft_steps = max_steps;
  c.slot_pool_size = 10001; // 10,000 usable slots: the default watermark is 1,500
  c.adaptive.enabled = true;
  return c;
}

/// The config with `edit` applied passes validation (text empty) or is refused with a message holding `text`.
void expect_config(const std::function<void(EngineConfig&)>& edit, const char* text = "") {
  EngineConfig config = adaptive_config();
  edit(config);
  if (*text == '\0')
    CHECK_NOTHROW(validate_engine_config(config));
  else
    CHECK_THROWS_WITH_AS(validate_engine_config(config), doctest::Contains(text), Error);
}

} // namespace

TEST_CASE(
    "the defaults are the seed's: EMA 0.8, smoothing 0.2, thresholds 0.8 / 0.5, K in {1, 4, 8}, cap 2") {
  const reference::DraftStepsRule rule = reference::draft_steps_rule(adaptive_config());
  CHECK(rule.initial == 0.8f);
  CHECK(rule.smoothing == 0.2f);
  CHECK(rule.high == 0.8f);
  CHECK(rule.low == 0.5f);
  CHECK(rule.min_steps == 1);
  CHECK(rule.mid_steps == 4);
  CHECK(rule.max_steps == 8);
  CHECK(rule.pressure_cap == 2);
  CHECK(rule.watermark_slots == 1500.0);           // 15% of 10,000 free: the seed's 85% full
  CHECK(EngineConfig{}.adaptive.enabled == false); // fixed K unless asked for
  expect_config([](auto&) {});
}

TEST_CASE(
    "seed tests: the EMA rises on acceptance, falls to min_steps on rejection, and absorbs one rejection") {
  const reference::DraftStepsRule rule = reference::draft_steps_rule(adaptive_config());
  const int plenty = 9000; // no KV pressure
  SUBCASE("sustained full acceptance keeps K at max and the EMA climbs toward 1") {
    reference::RequestDraftState state = reference::admitted_state(rule, 0);
    CHECK(state.steps == 8);
    float previous = state.ema;
    for (int cycle = 0; cycle < 30; ++cycle) {
      CHECK(reference::advance(rule, state, true, state.steps, plenty) == 8);
      CHECK(state.ema >= previous);
      previous = state.ema;
    }
    CHECK(state.ema > 0.99f);
    CHECK(state.steps == 8);
  }
  SUBCASE("sustained rejection walks K down max -> mid -> min") {
    reference::RequestDraftState state = reference::admitted_state(rule, 0);
    std::vector<int> trajectory;
    for (int cycle = 0; cycle < 12; ++cycle) {
      reference::advance(rule, state, true, 0, plenty);
      trajectory.push_back(state.steps);
    }
    // 0.8 * 0.8^n: 0.64 (mid), 0.512 (mid), 0.4096 (min) ...
    CHECK(trajectory[0] == 4);
    CHECK(trajectory[1] == 4);
    CHECK(trajectory[2] == 1);
    CHECK(std::all_of(trajectory.begin() + 2, trajectory.end(), [](int k) { return k == 1; }));
    CHECK(state.ema < 0.1f);
  }
  SUBCASE("one rejection after ten acceptances does not collapse K") {
    reference::RequestDraftState state = reference::admitted_state(rule, 0);
    for (int cycle = 0; cycle < 10; ++cycle)
      reference::advance(rule, state, true, state.steps, plenty);
    reference::advance(rule, state, true, 0, plenty);
    CHECK(state.ema >= 0.5f); // 0.2 * 0 + 0.8 * (> 0.97)
    CHECK(state.steps == 4);
  }
  SUBCASE("a cycle the request did not draft leaves its EMA alone") {
    reference::RequestDraftState state = reference::admitted_state(rule, 0);
    reference::advance(rule, state, false, 0, plenty);
    CHECK(state.ema == 0.8f);
    CHECK(state.steps == 8);
  }
}

TEST_CASE("without a draft (draft_steps = 0) K stays 0 and the EMA keeps its initial value") {
  EngineConfig config = adaptive_config();
  config.adaptive.enabled = false;
  config.draft_steps = 0;
  const reference::DraftStepsRule rule = reference::draft_steps_rule(config);
  reference::RequestDraftState state = reference::admitted_state(rule, 0);
  CHECK(state.steps == 0);
  for (int cycle = 0; cycle < 5; ++cycle) {
    CHECK(reference::advance(rule, state, true, 0, 9000) == 0);
    CHECK(state.steps == 0);
    CHECK(state.ema == 0.8f); // nothing proposed: no 0 / 0
  }
}

TEST_CASE("KV pressure caps an adaptive K at pressure_cap and never a pinned one") {
  const reference::DraftStepsRule rule = reference::draft_steps_rule(adaptive_config());
  CHECK(reference::kv_pressure(rule, 1499));
  CHECK_FALSE(reference::kv_pressure(rule, 1500));
  test::Rng rng;
  INFO("seed " << rng.seed());
  for (int trial = 0; trial < 10000; ++trial) {
    const float ema = static_cast<float>(rng.uniform());
    const int free_slots = static_cast<int>(rng.integer(0, 3000));
    const int pinned = rng.uniform() < 0.2 ? static_cast<int>(rng.integer(1, 8)) : 0;
    const int steps = reference::choose_steps(rule, ema, reference::kv_pressure(rule, free_slots), pinned);
    if (pinned > 0) {
      CHECK(steps == pinned);
    } else {
      if (free_slots < 1500) {
        CHECK((steps == 1 || steps == 2));
        CHECK(steps == std::min(reference::choose_steps(rule, ema, false, 0), 2));
      } else {
        CHECK((steps == 1 || steps == 4 || steps == 8));
      }
    }
  }
  // Thresholds of 0 pin every adaptive request at K_max, pressure aside.
  EngineConfig config = adaptive_config();
  config.adaptive.high_threshold = config.adaptive.low_threshold = 0.0f;
  const reference::DraftStepsRule pinned_max = reference::draft_steps_rule(config);
  for (float ema : {0.0f, 0.3f, 1.0f})
    CHECK(reference::choose_steps(pinned_max, ema, false, 0) == 8);
}

TEST_CASE("the device policy is built from the same fields as the reference rule") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  for (int trial = 0; trial < 200; ++trial) {
    EngineConfig config = adaptive_config(static_cast<int>(rng.integer(1, 64)));
    config.slot_pool_size = static_cast<int>(rng.integer(2, 1 << 20));
    config.adaptive.mid_steps = static_cast<int>(rng.integer(1, config.draft_steps));
    config.adaptive.min_steps = static_cast<int>(rng.integer(1, config.adaptive.mid_steps));
    config.adaptive.pressure_cap = static_cast<int>(rng.integer(1, config.draft_steps));
    config.adaptive.pressure_free_fraction = static_cast<float>(rng.uniform());
    validate_engine_config(config);
    const detail::DraftStepsPolicy policy = detail::draft_steps_policy(config);
    const reference::DraftStepsRule rule = reference::draft_steps_rule(config);
    CHECK(policy.max_steps == rule.max_steps);
    CHECK(policy.mid_steps == rule.mid_steps);
    CHECK(policy.min_steps == rule.min_steps);
    CHECK(policy.pressure_cap == rule.pressure_cap);
    CHECK(static_cast<double>(policy.pressure_watermark_slots) == rule.watermark_slots);
    CHECK(policy.smoothing == rule.smoothing);
    CHECK(policy.initial_acceptance == rule.initial);
    CHECK(policy.draft_cost == rule.draft_cost);
    CHECK(policy.idle_recovery == rule.idle_recovery);
  }
}

TEST_CASE("min_steps = 0: a request that stops drafting recovers its EMA toward 1 and drafts again") {
  EngineConfig config = adaptive_config();
  config.adaptive.min_steps = 0;
  config.adaptive.mid_steps = 1;
  config.adaptive.draft_cost = 0.93f; // a draft nearly as costly as the target: K = 1 needs a > 0.93
  config.adaptive.idle_recovery = 0.05f;
  validate_engine_config(config);
  const reference::DraftStepsRule rule = reference::draft_steps_rule(config);
  // At the initial EMA (0.8) no K >= 1 pays: the first cycle drafts nothing.
  reference::RequestDraftState state = reference::admitted_state(rule, 0);
  CHECK(state.steps == 0);
  // K = 0 cycles move the EMA a twentieth of the way to 1 each (rounded float steps), until K = 1 pays.
  int idle_cycles = 0;
  float expected = state.ema;
  while (state.steps == 0 && idle_cycles < 1000) {
    CHECK(reference::advance(rule, state, true, 0, 9000) == 0);
    const float gap = 1.0f - expected;
    const float step = 0.05f * gap;
    expected = expected + step;
    CHECK(state.ema == expected);
    ++idle_cycles;
  }
  CHECK(state.steps == 1);
  CHECK(state.ema > 0.93f);
  CHECK(idle_cycles > 10);
  CHECK(idle_cycles < 60);
  // The probe rejects its draft: the EMA falls with the measured rate and the request stops drafting again.
  CHECK(reference::advance(rule, state, true, 0, 9000) == 1);
  CHECK(state.steps == 0);
  CHECK(state.ema < 0.8f);
  // A cycle the request did not run (committed nothing) moves nothing.
  const float before = state.ema;
  reference::advance(rule, state, false, 0, 9000);
  CHECK(state.ema == before);
  // idle_recovery = 0: K = 0 for good.
  config.adaptive.idle_recovery = 0.0f;
  const reference::DraftStepsRule stuck = reference::draft_steps_rule(config);
  reference::RequestDraftState idle = reference::admitted_state(stuck, 0);
  for (int cycle = 0; cycle < 100; ++cycle)
    reference::advance(stuck, idle, true, 0, 9000);
  CHECK(idle.steps == 0);
  CHECK(idle.ema == 0.8f);
}

TEST_CASE("the cost-aware rule picks the K with the most expected tokens per unit of cycle time") {
  EngineConfig config = adaptive_config(4);
  config.adaptive.mid_steps = 2;
  config.adaptive.draft_cost = 0.93f; // a draft of 28 of SmolLM2's 30 layers: a forward ~0.93 of the rest
  reference::DraftStepsRule rule = reference::draft_steps_rule(config);
  // a = 0.5: E = 1.5, 1.75, 1.9375 over 1.93, 2.86, 4.72: K = 1; a = 1: 2 / 1.93 < 5 / 4.72: K = 4.
  CHECK(reference::choose_steps(rule, 0.5f, false, 0) == 1);
  CHECK(reference::choose_steps(rule, 1.0f, false, 0) == 4);
  CHECK(reference::choose_steps(rule, 0.0f, false, 0) == 1); // nothing accepted: the least drafting
  config.adaptive.draft_cost = 0.05f;                        // a cheap draft: K_max from a = 0.5 on
  rule = reference::draft_steps_rule(config);
  CHECK(reference::choose_steps(rule, 0.5f, false, 0) == 4);
  CHECK(reference::choose_steps(rule, 0.3f, false, 0) == 2); // 1.39 / 1.1 > 1.3 / 1.05, > 1.4251 / 1.2
  CHECK(reference::choose_steps(rule, 0.5f, true, 0) == 2);  // the pressure cap still applies
  CHECK(reference::choose_steps(rule, 0.0f, false, 3) == 3); // and a pin still wins
  // A new request starts at the rule's K for the initial EMA (0.8), not at K_max. Yields 1.8, 2.44, 3.3616
  // over 1 + K c: c = 0.05 gives K = 4, c = 0.4 K = 2 (1.356 against 1.286 and 1.293), c = 0.93 K = 1 (0.933
  // against 0.853 and 0.712); the seed's thresholds K_max (0.8 >= high_threshold); a pin its K.
  const std::pair<float, int> first_steps[] = {{0.05f, 4}, {0.4f, 2}, {0.93f, 1}, {0.0f, 4}};
  for (const auto& [cost, steps] : first_steps) {
    EngineConfig first = config;
    first.adaptive.draft_cost = cost;
    const reference::RequestDraftState state =
        reference::admitted_state(reference::draft_steps_rule(first), 0);
    CHECK_MESSAGE(state.steps == steps, "draft_cost " << cost);
    CHECK(state.ema == 0.8f);
    CHECK(reference::admitted_state(reference::draft_steps_rule(first), 3).steps == 3);
  }
  // Against a brute-force argmax over the three candidates, on a grid of EMAs and costs.
  int checked = 0;
  for (int cost_index = 1; cost_index <= 40; ++cost_index) {
    config.adaptive.draft_cost = 0.05f * static_cast<float>(cost_index);
    rule = reference::draft_steps_rule(config);
    for (int e = 0; e <= 100; ++e) {
      const float a = 0.01f * static_cast<float>(e);
      auto yield = [&](int k) {
        double sum = 0.0;
        for (int i = 0; i <= k; ++i)
          sum += std::pow(static_cast<double>(a), i);
        return sum / (1.0 + k * static_cast<double>(config.adaptive.draft_cost));
      };
      int want = 1;
      for (int k : {2, 4})
        if (yield(k) > yield(want) * (1.0 + 1e-12))
          want = k;
      const int got = reference::choose_steps(rule, a, false, 0);
      if (std::abs(yield(got) - yield(want)) > 1e-12 * yield(want)) // equal yields may round either way
        CHECK_MESSAGE(got == want, "a " << a << ", cost " << config.adaptive.draft_cost);
      ++checked;
    }
  }
  CHECK(checked == 40 * 101);
}

TEST_CASE("every adaptive field out of range is named with its value") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  expect_config([](auto& c) { c.adaptive.mid_steps = 9; }, "adaptive.mid_steps = 9");
  expect_config([](auto& c) { c.adaptive.mid_steps = 0; }, "adaptive.mid_steps = 0");
  expect_config([](auto& c) { c.adaptive.min_steps = 5; }, "adaptive.min_steps = 5");
  expect_config([](auto& c) { c.adaptive.min_steps = -1; }, "adaptive.min_steps = -1");
  expect_config([](auto& c) { c.adaptive.min_steps = 0; }); // valid; the Engine checks the draft's KV
  expect_config([](auto& c) { c.adaptive.idle_recovery = 1.5f; }, "adaptive.idle_recovery = 1.5");
  expect_config([nan](auto& c) { c.adaptive.idle_recovery = nan; }, "adaptive.idle_recovery = nan");
  expect_config([](auto& c) { c.adaptive.smoothing = 1.5f; }, "adaptive.smoothing = 1.5");
  expect_config([nan](auto& c) { c.adaptive.smoothing = nan; }, "adaptive.smoothing = nan");
  expect_config([](auto& c) { c.adaptive.initial_acceptance = -0.1f; }, "adaptive.initial_acceptance = -0.1");
  expect_config([](auto& c) { c.adaptive.low_threshold = 0.9f; }, "adaptive.high_threshold = 0.8");
  expect_config([](auto& c) { c.adaptive.low_threshold = -1.0f; }, "adaptive.low_threshold = -1");
  expect_config([](auto& c) { c.adaptive.draft_cost = -0.5f; }, "adaptive.draft_cost = -0.5");
  expect_config([](auto& c) { c.adaptive.draft_cost = 65.0f; }, "adaptive.draft_cost = 65");
  expect_config([nan](auto& c) { c.adaptive.draft_cost = nan; }, "adaptive.draft_cost = nan");
  expect_config([](auto& c) { c.adaptive.draft_cost = 64.0f; });
  expect_config([](auto& c) { c.adaptive.high_threshold = 2.0f; }, "adaptive.high_threshold = 2");
  expect_config([](auto& c) { c.adaptive.pressure_cap = 0; }, "adaptive.pressure_cap = 0");
  expect_config([](auto& c) { c.adaptive.pressure_cap = 9; }, "adaptive.pressure_cap = 9");
  expect_config([](auto& c) { c.adaptive.pressure_free_fraction = 1.5f; },
                "adaptive.pressure_free_fraction = 1.5");
  expect_config(
      [](auto& c) {
        c.kind = CycleKind::kSmc;
        c.particles = 4;
      },
      "adaptive.enabled = 1: needs kind kSpeculative");
  // Off, the K fields are not used and not checked; the EMA fields are (the EMA is always reported).
  expect_config([](auto& c) {
    c.adaptive.enabled = false;
    c.draft_steps = 2;
  });
  expect_config(
      [](auto& c) {
        c.adaptive.enabled = false;
        c.adaptive.smoothing = -1.0f;
      },
      "adaptive.smoothing = -1");
}

TEST_CASE("a request pins its K within [1, draft_steps]; the SMC cycle only at draft_steps") {
  EngineConfig config = adaptive_config(8);
  config.vocab = 512;
  auto error = [](const EngineConfig& c, const RequestParams& params) -> std::string {
    try {
      const auto resolved = detail::validate_request(c, {1, 2, 3}, params);
      return "no error, pinned " + std::to_string(resolved.pinned_draft_steps);
    } catch (const Error& e) {
      return e.what();
    }
  };
  CHECK(error(config, {}) == "no error, pinned 0"); // adaptive
  CHECK(error(config, {.draft_steps = 3}) == "no error, pinned 3");
  CHECK(error(config, {.draft_steps = 9}).find("params.draft_steps = 9: must be -1 or in [1, draft_steps]") !=
        std::string::npos);
  CHECK(error(config, {.draft_steps = 0}).find("params.draft_steps = 0") != std::string::npos);
  config.adaptive.enabled = false;
  CHECK(error(config, {}) == "no error, pinned 8"); // fixed K
  EngineConfig smc;
  smc.vocab = 512;
  CHECK(error(smc, {.draft_steps = 4}) == "no error, pinned 4");
  CHECK(
      error(smc, {.draft_steps = 2}).find("params.draft_steps = 2: must be -1 or draft_steps for the SMC") !=
      std::string::npos);
}

TEST_CASE("the output block holds the draft-length fields inside its bytes, apart from the others") {
  for (int requests : {1, 3, 64}) {
    const detail::OutputLayout layout = detail::output_layout(requests, requests, 8);
    struct Range {
      size_t begin, bytes;
    };
    const std::vector<Range> ranges = {{layout.tokens, sizeof(int32_t) * requests * 9},
                                       {layout.accepted, sizeof(int32_t) * requests},
                                       {layout.status, 4},
                                       {layout.cycle_draft_steps, sizeof(int32_t) * requests},
                                       {layout.next_draft_steps, sizeof(int32_t) * requests},
                                       {layout.acceptance_ema, sizeof(float) * requests},
                                       {layout.resampled, static_cast<size_t>(requests)},
                                       {layout.kv_pressure, 1}};
    for (size_t i = 0; i < ranges.size(); ++i) {
      CHECK(ranges[i].begin + ranges[i].bytes <= layout.bytes);
      for (size_t j = i + 1; j < ranges.size(); ++j)
        CHECK((ranges[i].begin + ranges[i].bytes <= ranges[j].begin ||
               ranges[j].begin + ranges[j].bytes <= ranges[i].begin));
    }
    CHECK(layout.acceptance_ema % alignof(float) == 0);
  }
}
