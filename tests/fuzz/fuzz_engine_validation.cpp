// Fuzz target: the engine's host-side validation (EngineConfig and admit()'s prompt and RequestParams,
// src/runtime/engine_validation.cpp) on arbitrary bytes (layout: engine_fuzz_input.hpp). Every input either
// passes or throws smcgraph::Error naming what it rejects; what passes satisfies everything the engine
// assumes afterwards (checked here: a violation aborts, which the fuzzer reports as a crash). No GPU.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz/engine_fuzz_input.hpp"
#include "runtime/engine_validation.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"

namespace {

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_engine_validation: broken guarantee: %s\n", what);
    std::abort();
  }
}

bool starts_with(const std::string& text, const char* prefix) {
  return text.rfind(prefix, 0) == 0;
}

/// What Engine's constructor relies on once validate_engine_config accepted `c`.
void check_accepted_config(const smcgraph::EngineConfig& c) {
  using smcgraph::CycleKind;
  expect(c.kind == CycleKind::kSmc || c.kind == CycleKind::kSpeculative, "kind is known");
  expect(c.vocab >= 1, "vocab >= 1");
  // 0 only for the speculative cycle (no draft: the target alone), never adaptive.
  expect(c.draft_steps >= (c.kind == CycleKind::kSpeculative ? 0 : 1) && c.draft_steps <= 64,
         "draft_steps in [1, 64] ([0, 64] speculative)");
  expect(c.draft_steps >= 1 || !c.adaptive.enabled, "adaptive needs a draft");
  expect(c.particles >= 1 && c.particles <= 256, "particles in [1, 256]");
  expect(c.kind == CycleKind::kSmc || c.particles == 1, "speculative: one particle");
  expect(c.max_requests >= 1 && c.max_requests <= 4096, "max_requests in [1, 4096]");
  // rows = max_requests * particles and the per-row tables must not overflow int.
  expect(static_cast<int64_t>(c.max_requests) * c.particles <= (int64_t{1} << 20), "rows fit");
  expect(c.max_seq_len >= c.draft_steps + 4, "room for a 1-token prompt and one cycle");
  expect(c.slot_pool_size >= 2, "a dummy slot and one more");
  // The device counts slots, and the freed-slot bitmap's words ((pool + 31) / 32), in 32-bit ints.
  expect(c.slot_pool_size <= (1 << 30), "slot ids, counts and bitmap words fit int");
  expect(std::isfinite(c.draft_temperature) && c.draft_temperature >= 0.0f, "draft temperature");
  expect(c.kind == CycleKind::kSpeculative || c.draft_temperature > 0.0f, "SMC drafts sample");
  expect(std::isfinite(c.target_temperature) && c.target_temperature >= 0.0f, "target temperature");
  expect(std::isfinite(c.alpha) && c.alpha > 0.0f, "alpha");
  expect(c.tau >= 0.0f && c.tau <= 1.0f, "tau in [0, 1]");
  expect(c.eos_id >= -1 && c.eos_id < c.vocab, "eos_id");
  // The engine's bucket list (as Engine's constructor derives it): strictly increasing, ending at
  // max_requests.
  std::vector<int> buckets = c.buckets;
  if (buckets.empty()) {
    for (int requests = 1; requests < c.max_requests; requests *= 2)
      buckets.push_back(requests);
    buckets.push_back(c.max_requests);
  }
  for (size_t i = 0; i < buckets.size(); ++i) {
    expect(buckets[i] >= 1 && buckets[i] <= c.max_requests, "bucket in range");
    expect(i == 0 || buckets[i] > buckets[i - 1], "buckets increase");
  }
  expect(buckets.back() == c.max_requests, "the largest bucket is max_requests");
  // The device's EMA and K choice (src/kernels/draft_steps.cu) read these for every request.
  const smcgraph::AdaptiveDraftSteps& a = c.adaptive;
  auto unit = [](float value) { return std::isfinite(value) && value >= 0.0f && value <= 1.0f; };
  expect(unit(a.smoothing) && unit(a.initial_acceptance), "EMA smoothing and start in [0, 1]");
  if (a.enabled) {
    expect(c.kind == CycleKind::kSpeculative, "adaptive K: the speculative cycle only");
    expect(a.min_steps >= 0 && a.min_steps <= a.mid_steps && a.mid_steps >= 1 && a.mid_steps <= c.draft_steps,
           "0 <= min_steps <= mid_steps, 1 <= mid_steps <= draft_steps");
    expect(unit(a.idle_recovery), "idle_recovery in [0, 1]");
    expect(unit(a.low_threshold) && unit(a.high_threshold) && a.low_threshold <= a.high_threshold,
           "0 <= low_threshold <= high_threshold <= 1");
    expect(a.pressure_cap >= 1 && a.pressure_cap <= c.draft_steps, "pressure_cap in [1, draft_steps]");
    expect(unit(a.pressure_free_fraction), "pressure_free_fraction in [0, 1]");
  }
}

/// What Engine::admit relies on once validate_request accepted the request.
void check_accepted_request(const smcgraph::EngineConfig& c, const std::vector<int32_t>& prompt,
                            const smcgraph::RequestParams& params,
                            const smcgraph::detail::ResolvedRequestParams& r) {
  expect(!prompt.empty(), "a prompt token");
  expect(static_cast<int64_t>(prompt.size()) + c.draft_steps + 2 <= c.max_seq_len, "room for one cycle");
  for (int32_t token : prompt)
    expect(token >= 0 && token < c.vocab, "prompt token in range");
  expect(std::isfinite(r.draft_temperature) && r.draft_temperature >= 0.0f, "resolved draft temperature");
  expect(c.kind == smcgraph::CycleKind::kSpeculative || r.draft_temperature > 0.0f, "SMC draft samples");
  expect(std::isfinite(r.target_temperature) && r.target_temperature >= 0.0f, "resolved target temperature");
  expect(std::isfinite(r.alpha) && r.alpha > 0.0f, "resolved alpha");
  expect(r.tau >= 0.0f && r.tau <= 1.0f, "resolved tau in [0, 1]");
  expect(params.max_new_tokens == -1 || params.max_new_tokens >= 1, "max_new_tokens");
  // The request's K: a pin in [1, draft_steps] (SMC: draft_steps), or 0 = chosen on the device, which needs
  // the adaptive rule, or 0 = no draft at all (draft_steps = 0).
  expect(r.pinned_draft_steps >= 0 && r.pinned_draft_steps <= c.draft_steps, "pinned K in [0, draft_steps]");
  expect(r.pinned_draft_steps > 0 || c.adaptive.enabled || c.draft_steps == 0,
         "an unpinned K needs the adaptive rule (or no draft)");
  expect(c.kind == smcgraph::CycleKind::kSpeculative || r.pinned_draft_steps == c.draft_steps,
         "SMC drafts K_max");
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const smcgraph::fuzz::EngineFuzzInput input = smcgraph::fuzz::decode_engine_fuzz_input(data, size);
  try {
    smcgraph::validate_engine_config(input.config);
  } catch (const smcgraph::Error& e) {
    expect(starts_with(e.what(), "EngineConfig: ") && std::string(e.what()).find(" = ") != std::string::npos,
           "a configuration error names the field and its value");
    expect(e.cuda_error() == cudaSuccess, "a validation error carries no CUDA error");
    return 0;
  }
  check_accepted_config(input.config);
  try {
    const smcgraph::detail::ResolvedRequestParams resolved =
        smcgraph::detail::validate_request(input.config, input.prompt, input.params);
    check_accepted_request(input.config, input.prompt, input.params, resolved);
  } catch (const smcgraph::Error& e) {
    expect(starts_with(e.what(), "Engine::admit: ") && std::string(e.what()).find(" = ") != std::string::npos,
           "a request error names the argument and its value");
    expect(e.cuda_error() == cudaSuccess, "a validation error carries no CUDA error");
  }
  return 0;
}
