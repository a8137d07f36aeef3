// The engine's host-side argument checks (no CUDA call, no device state): EngineConfig and admit()'s prompt
// and RequestParams. Engine calls them first; the CPU suite and the fuzz target (tests/fuzz/) call them
// alone.
#pragma once

#include <cstdint>
#include <vector>

#include "smcgraph/engine.hpp"

namespace smcgraph::detail {

/// A request's sampling parameters once RequestParams' negative "use the engine's default" values are
/// resolved against the engine's configuration.
struct ResolvedRequestParams {
  float draft_temperature = 0.0f;
  float target_temperature = 0.0f;
  float alpha = 0.0f;
  float tau = 0.0f;
  int pinned_draft_steps = 0; ///< the request's fixed K, or 0: adaptive (chosen on the device every cycle)
};

/// Everything Engine::admit checks before it touches the device, for an engine built with `config` (which
/// validate_engine_config accepted): a prompt of 1 .. max_seq_len - draft_steps - 2 tokens in [0, vocab),
/// finite parameters in range, max_new_tokens -1 or >= 1. Throws smcgraph::Error naming the first bad
/// argument and its value ("Engine::admit: prompt[3] = 70000: token out of range [0, 32000)"). The check that
/// a request slot is free needs the engine's state and stays in admit().
ResolvedRequestParams validate_request(const EngineConfig& config, const std::vector<int32_t>& prompt,
                                       const RequestParams& params);

} // namespace smcgraph::detail
