// Helpers the engine-level GPU suites share: random prompts, one synchronous cycle, the slot invariants.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/engine_state.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/slots.hpp"
#include "support/test_util.hpp"

namespace smcgraph::test {

/// A prompt of 1 .. max_length tokens drawn uniformly from [0, vocab).
inline std::vector<int32_t> random_prompt(Rng& rng, int vocab, int max_length) {
  std::vector<int32_t> prompt(rng.integer(1, max_length));
  for (auto& t : prompt)
    t = static_cast<int32_t>(rng.integer(0, vocab - 1));
  return prompt;
}

/// Waits for the engine and checks its slot pool against its tables.
inline SlotCheck check_invariants(Engine& engine) {
  engine.synchronize();
  auto& s = engine.state();
  return check_slot_invariants_device(s.pool_view(), s.tables_view(), engine.stream());
}

/// Steps and polls one cycle (no overlap), returning its updates.
inline std::vector<RequestUpdate> cycle(Engine& engine) {
  engine.step();
  return engine.poll();
}

} // namespace smcgraph::test
