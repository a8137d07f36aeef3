// Engine configuration validation: every field out of range gets an error naming it and its value. No GPU
// needed (validation runs before any CUDA call).
#include <doctest/doctest.h>

#include <functional>
#include <limits>
#include <string>

#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"

namespace {

std::string error_of(const std::function<void(smcgraph::EngineConfig&)>& edit) {
  smcgraph::EngineConfig config;
  edit(config);
  try {
    smcgraph::validate_engine_config(config);
  } catch (const smcgraph::Error& e) {
    return e.what();
  }
  return "no error";
}

bool contains(const std::string& text, const std::string& part) {
  const bool found = text.find(part) != std::string::npos;
  if (!found)
    MESSAGE("'" << text << "' does not contain '" << part << "'");
  return found;
}

} // namespace

TEST_CASE("the default configuration is valid") {
  CHECK(error_of([](auto&) {}) == "no error");
}

TEST_CASE("every EngineConfig field out of range is named with its value") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(contains(error_of([](auto& c) { c.vocab = 0; }), "EngineConfig: vocab = 0"));
  CHECK(contains(error_of([](auto& c) { c.draft_steps = 0; }), "draft_steps = 0"));
  CHECK(contains(error_of([](auto& c) { c.draft_steps = 65; }), "draft_steps = 65"));
  CHECK(contains(error_of([](auto& c) { c.particles = 0; }), "particles = 0"));
  CHECK(contains(error_of([](auto& c) { c.particles = 257; }), "particles = 257"));
  CHECK(contains(error_of([](auto& c) { c.max_requests = 0; }), "max_requests = 0"));
  CHECK(contains(error_of([](auto& c) { c.max_seq_len = 5; }), "max_seq_len = 5"));
  CHECK(contains(error_of([](auto& c) { c.slot_pool_size = 1; }), "slot_pool_size = 1"));
  CHECK(contains(error_of([](auto& c) { c.draft_temperature = 0.0f; }), "draft_temperature = 0"));
  CHECK(contains(error_of([nan](auto& c) { c.draft_temperature = nan; }), "draft_temperature = nan"));
  CHECK(contains(error_of([](auto& c) { c.target_temperature = -1.0f; }), "target_temperature = -1"));
  CHECK(contains(error_of([inf](auto& c) { c.target_temperature = inf; }), "target_temperature = inf"));
  CHECK(contains(error_of([](auto& c) { c.alpha = 0.0f; }), "alpha = 0"));
  CHECK(contains(error_of([](auto& c) { c.tau = 1.5f; }), "tau = 1.5"));
  CHECK(contains(error_of([](auto& c) { c.tau = -0.1f; }), "tau = -0.1"));
  CHECK(contains(error_of([](auto& c) { c.eos_id = 32000; }), "eos_id = 32000"));
  CHECK(contains(error_of([](auto& c) { c.eos_id = -2; }), "eos_id = -2"));
  CHECK(contains(error_of([](auto& c) { c.kind = static_cast<smcgraph::CycleKind>(9); }), "kind = 9"));
}

TEST_CASE("buckets must be sorted, unique, in range and end at max_requests") {
  CHECK(error_of([](auto& c) { c.buckets = {1, 4, 16}; }) == "no error");
  CHECK(contains(error_of([](auto& c) {
                   c.buckets = {4, 1, 16};
                 }),
                 "buckets = [4, 1, 16]: must be strictly"));
  CHECK(contains(error_of([](auto& c) {
                   c.buckets = {1, 1, 16};
                 }),
                 "buckets = [1, 1, 16]: must be strictly"));
  CHECK(contains(error_of([](auto& c) { c.buckets = {0, 16}; }), "buckets = [0, 16]: every bucket"));
  CHECK(contains(error_of([](auto& c) { c.buckets = {1, 32}; }), "buckets = [1, 32]: every bucket"));
  CHECK(contains(error_of([](auto& c) { c.buckets = {1, 8}; }), "buckets = [1, 8]: the largest bucket"));
}
