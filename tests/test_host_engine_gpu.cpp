// The serving loop of examples/host_engine.cpp (examples/host_engine_loop.hpp) on the GPU: every request
// finishes, result() obeys the EOS / max_new_tokens / max_seq_len rules, statistics are sane, no slot leaks,
// and a request's output does not depend on how it was batched.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "../examples/host_engine_loop.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/toy_model.hpp"
#include "support/engine_test_util.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;
namespace test = smcgraph::test;
namespace examples = smcgraph::examples;

using smcgraph::test::check_invariants;

namespace {

EngineConfig serving_config(int max_requests, bool use_graphs = true) {
  EngineConfig c;
  c.vocab = 64; // small, and hot temperatures below, so EOS (id 5) comes up within a few cycles now and then
  c.particles = 4;
  c.draft_steps = 4;
  c.max_requests = max_requests;
  c.max_seq_len = 160;
  c.slot_pool_size = 1 << 15; // ample: no request may fail for want of slots
  c.draft_temperature = 1.5f;
  c.target_temperature = 1.5f;
  c.tau = 0.5f;
  c.eos_id = 5;
  c.use_graphs = use_graphs;
  return c;
}

ToyModelConfig toy_for(const EngineConfig& c) {
  return test::toy_for(c, /*weight_seed=*/77);
}

struct Setup {
  ToyModelPair models;
  std::unique_ptr<Engine> engine;
  explicit Setup(const EngineConfig& config)
      : models(ToyModel::pair(toy_for(config), 0.3f)),
        engine(std::make_unique<Engine>(config, *models.draft, *models.target)) {}
};

/// Requests with prompts of 1 .. 40 tokens; max_new_tokens mostly 1 .. 100 (1 finishes on the admission
/// token), a few -1 (run to max_seq_len).
std::vector<examples::ServeRequest> make_requests(test::Rng& rng, int count, int vocab) {
  std::vector<examples::ServeRequest> requests(count);
  for (int i = 0; i < count; ++i) {
    requests[i].prompt.resize(rng.integer(1, 40));
    for (int32_t& t : requests[i].prompt)
      t = static_cast<int32_t>(rng.integer(0, vocab - 1));
    requests[i].params.seed = rng.bits();
    requests[i].params.max_new_tokens =
        i % 25 == 7 ? -1 : (i % 10 == 3 ? 1 : static_cast<int>(rng.integer(1, 100)));
  }
  return requests;
}

/// The finish rules, for every particle of a finished request: result() cuts after the first EOS and at
/// max_new_tokens, and a cycle that would pass max_seq_len is refused (so such a request stopped within
/// K + 1 tokens of it).
void check_finish_rules(const EngineConfig& config, const examples::ServeRequest& request,
                        const RequestResult& result) {
  const int max_new = request.params.max_new_tokens;
  const int prompt_length = static_cast<int>(request.prompt.size());
  const int room = config.max_seq_len - prompt_length;
  INFO("reason '" << result.reason << "', prompt " << prompt_length << ", max_new_tokens " << max_new);
  CHECK(result.finished);
  CHECK_FALSE(result.failed);
  REQUIRE(result.particles.size() == static_cast<size_t>(config.particles));
  REQUIRE(result.log_weights.size() == static_cast<size_t>(config.particles));
  REQUIRE((result.chosen >= 0 && result.chosen < config.particles));
  CHECK(result.tokens == result.particles[result.chosen]);
  CHECK(std::isfinite(result.log_evidence));
  const bool known_reason =
      result.reason == "eos" || result.reason == "max_new_tokens" || result.reason == "max sequence length";
  CHECK(known_reason);
  for (const std::vector<int32_t>& tokens : result.particles) {
    const int count = static_cast<int>(tokens.size());
    CAPTURE(count);
    REQUIRE(count >= 1); // the admission token at least
    CHECK(count <= room);
    if (max_new > 0)
      CHECK(count <= max_new);
    for (int j = 0; j < count; ++j) {
      CHECK((tokens[j] >= 0 && tokens[j] < config.vocab));
      if (j + 1 < count)
        CHECK(tokens[j] != config.eos_id); // EOS is absorbing: nothing follows it
    }
    const bool ends_in_eos = tokens.back() == config.eos_id;
    if (result.reason == "max_new_tokens")
      CHECK((count == max_new || ends_in_eos));
    if (result.reason == "eos")
      CHECK((ends_in_eos || count == max_new));
    if (result.reason == "max sequence length")
      CHECK((ends_in_eos || count > room - (config.draft_steps + 1)));
  }
}

} // namespace

TEST_CASE("the host-engine loop serves every request; result() tokens obey the finish rules; no slot leaks") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const EngineConfig config = serving_config(8);
  Setup setup(config);
  Engine& engine = *setup.engine;
  const std::vector<examples::ServeRequest> requests =
      make_requests(rng, test::sanitizer_scaled(200, 40, 20), config.vocab);

  std::set<size_t> finished_indices;
  std::map<RequestId, int> updates_seen;
  int invariant_checks = 0;
  examples::ServeOptions options;
  options.on_update = [&](const RequestUpdate& update) {
    CHECK(update.cycle == updates_seen[update.id]++); // consecutive, starting at 0
    if (update.failed)
      return;
    INFO("request " << update.id << ", cycle " << update.cycle << ", finished " << update.finished << " ("
                    << update.reason << ")");
    REQUIRE(update.tokens.size() == static_cast<size_t>(config.particles));
    for (const auto& tokens : update.tokens) {
      CHECK(tokens.size() <= static_cast<size_t>(config.draft_steps + 1));
      for (int32_t t : tokens)
        CHECK((t >= 0 && t < config.vocab));
    }
  };
  options.on_finish = [&](const examples::ServedRequest& done) {
    REQUIRE(done.index < requests.size());
    CHECK(finished_indices.insert(done.index).second); // each request leaves once
    CHECK(done.id >= 0);
    CHECK(done.latency_ms >= 0.0);
    CHECK(done.cycles == updates_seen[done.id]);
    check_finish_rules(config, requests[done.index], done.result);
    // on_finish runs before release(): result() again must give the same answer.
    const RequestResult again = engine.result(done.id);
    CHECK(again.particles == done.result.particles);
    CHECK(again.tokens == done.result.tokens);
    CHECK(again.chosen == done.result.chosen);
    CHECK(again.reason == done.result.reason);
    if (finished_indices.size() % 16 == 0) { // the pool stays consistent mid-run (this synchronizes)
      const SlotCheck check = check_invariants(engine);
      INFO(check.problem);
      CHECK(check.ok);
      ++invariant_checks;
    }
  };
  const examples::ServeStats stats = examples::serve(engine, requests, options);

  CHECK(finished_indices.size() == requests.size());
  CHECK(stats.requests == requests.size());
  CHECK(stats.served == requests.size());
  CHECK(stats.failed == 0);
  CHECK(stats.served_requests.size() == requests.size());
  int64_t generated = 0;
  for (const examples::ServedRequest& done : stats.served_requests)
    generated += done.result.tokens.size();
  CHECK(stats.generated_tokens == generated);
  CHECK(stats.generated_tokens >= static_cast<int64_t>(requests.size()));
  CHECK(stats.particle_tokens > 0);
  CHECK(stats.tokens_per_s > 0.0);
  CHECK(stats.cycles >= test::sanitizer_scaled(100, 20, 10)); // a few hundred cycles of serving
  CHECK(stats.request_cycles >= stats.cycles);
  CHECK((stats.mean_occupancy > 0.0 && stats.mean_occupancy <= 1.0));
  CHECK((stats.resample_rate >= 0.0 && stats.resample_rate <= 1.0));
  CHECK(stats.latency_p50_ms <= stats.latency_p95_ms);
  CHECK(stats.latency_p95_ms <= stats.latency_p99_ms);
  CHECK(stats.latency_p50_ms > 0.0);
  CHECK(stats.reasons.count("max_new_tokens") == 1); // the max_new_tokens = 1 requests at least
  for (const auto& [reason, count] : stats.reasons)
    MESSAGE("finish reason '" << reason << "': " << count);
  MESSAGE("cycles " << stats.cycles << ", generated " << stats.generated_tokens << " tokens, "
                    << stats.tokens_per_s << " tokens/s, occupancy " << stats.mean_occupancy
                    << ", resample rate " << stats.resample_rate << ", compactions " << stats.compactions
                    << ", eos finishes " << (stats.reasons.count("eos") ? stats.reasons.at("eos") : 0)
                    << ", mid-run checks " << invariant_checks);

  // Everything was released: the engine is empty and every slot is back on the free stack.
  CHECK(engine.live_requests() == 0);
  CHECK(engine.current_bucket() == 0);
  CHECK(engine.poll().empty());
  const SlotCheck check = check_invariants(engine);
  INFO(check.problem);
  CHECK(check.ok);
  CHECK(check.referenced == 0);
  CHECK(check.free == config.slot_pool_size - 1);
}

TEST_CASE("a served request's tokens do not depend on concurrency, compaction or graph vs eager") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  // Overlapped scheduling runs every finishing request for exactly one extra cycle before result() reads it,
  // whatever the batch, so result() is a function of the request alone.
  const std::vector<examples::ServeRequest> requests =
      make_requests(rng, test::sanitizer_scaled(48, 12, 8), serving_config(1).vocab);
  auto serve_with = [&](int max_requests, bool use_graphs, bool compact) {
    Setup setup(serving_config(max_requests, use_graphs));
    examples::ServeOptions options;
    options.compact = compact;
    const examples::ServeStats stats = examples::serve(*setup.engine, requests, options);
    REQUIRE(stats.served == requests.size());
    std::vector<std::vector<int32_t>> tokens(requests.size());
    for (const examples::ServedRequest& done : stats.served_requests)
      tokens[done.index] = done.result.tokens;
    const std::string mode = std::string(use_graphs ? "graphs" : "eager") + (compact ? "" : ", no compact");
    MESSAGE("max_requests " << max_requests << " (" << mode << "): " << stats.cycles
                            << " cycles, compactions " << stats.compactions << ", occupancy "
                            << stats.mean_occupancy);
    return tokens;
  };
  const auto wide = serve_with(8, true, true);
  const auto narrow = serve_with(3, true, true);
  const auto eager = serve_with(5, false, true);
  const auto scattered = serve_with(8, true, false);
  for (size_t i = 0; i < requests.size(); ++i) {
    CAPTURE(i);
    CHECK(wide[i] == narrow[i]);
    CHECK(wide[i] == eager[i]);
    CHECK(wide[i] == scattered[i]);
  }
}

TEST_CASE("a request admit() refuses is reported as failed and the others are served") {
  const EngineConfig config = serving_config(4);
  Setup setup(config);
  std::vector<examples::ServeRequest> requests(5);
  for (int i = 0; i < 5; ++i) {
    requests[i].prompt = {1, 2, 3, static_cast<int32_t>(i)};
    requests[i].params = {.seed = static_cast<uint64_t>(i + 1), .max_new_tokens = 12};
  }
  requests[2].prompt = {1, config.vocab}; // out of range
  std::vector<size_t> failed;
  examples::ServeOptions options;
  options.on_finish = [&](const examples::ServedRequest& done) {
    if (done.result.failed)
      failed.push_back(done.index);
  };
  const examples::ServeStats stats = examples::serve(*setup.engine, requests, options);
  CHECK(stats.served == 4);
  CHECK(stats.failed == 1);
  REQUIRE(failed.size() == 1);
  CHECK(failed[0] == 2);
  CHECK(stats.served_requests.size() == 5);
  for (const examples::ServedRequest& done : stats.served_requests) {
    if (done.index == 2) {
      CHECK(done.id == -1);
      CHECK(done.result.reason.find("token out of range") != std::string::npos);
    } else {
      check_finish_rules(config, requests[done.index], done.result);
    }
  }
  const SlotCheck check = check_invariants(*setup.engine);
  CHECK(check.ok);
  CHECK(check.free == config.slot_pool_size - 1);
}
