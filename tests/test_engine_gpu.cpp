// The SMC engine end to end on the GPU: invariants, graph vs eager, batch invariance, the KV invariant,
// padding, EOS, and faults.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include "runtime/slot_checker.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/toy_model.hpp"
#include "support/engine_test_util.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;
namespace test = smcgraph::test;
using test::check_invariants;
using test::cycle;
using test::random_prompt;

namespace {

EngineConfig small_config(int particles = 4, int steps = 4, int max_requests = 8) {
  EngineConfig c;
  c.vocab = 512;
  c.particles = particles;
  c.draft_steps = steps;
  c.max_requests = max_requests;
  c.max_seq_len = 256;
  c.slot_pool_size = 1 << 15;
  c.draft_temperature = 0.9f;
  c.target_temperature = 1.0f;
  c.tau = 0.5f;
  return c;
}

ToyModelConfig toy_for(const EngineConfig& c, DType dtype = DType::kFloat32) {
  return test::toy_for(c, /*weight_seed=*/1234, /*hidden=*/32, dtype);
}

/// Models and an engine built together (each engine needs its own models: the KV lives in the model).
struct Setup {
  ToyModelPair models;
  std::unique_ptr<Engine> engine;
  explicit Setup(const EngineConfig& config, float perturbation = 0.3f, DType dtype = DType::kFloat32)
      : models(ToyModel::pair(toy_for(config, dtype), perturbation)),
        engine(std::make_unique<Engine>(config, *models.draft, *models.target)) {}
};

bool same_updates(const std::vector<RequestUpdate>& a, const std::vector<RequestUpdate>& b) {
  if (a.size() != b.size())
    return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].id != b[i].id || a[i].tokens != b[i].tokens || a[i].ancestors != b[i].ancestors ||
        a[i].resampled != b[i].resampled || std::memcmp(&a[i].ess, &b[i].ess, sizeof(double)) != 0 ||
        a[i].finished != b[i].finished || a[i].failed != b[i].failed)
      return false;
  }
  return true;
}

} // namespace

TEST_CASE("cycles commit K + 1 valid tokens per particle and keep the slot invariants") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const EngineConfig config = small_config();
  Setup setup(config);
  Engine& engine = *setup.engine;
  std::vector<RequestId> ids;
  for (int i = 0; i < 5; ++i)
    ids.push_back(engine.admit(random_prompt(rng, config.vocab, 20), {.seed = rng.bits()}));
  REQUIRE(check_invariants(engine).ok);
  const int cycles = test::sanitizer_scaled(30, 30, 10);
  for (int c = 0; c < cycles; ++c) {
    const auto updates = cycle(engine);
    REQUIRE(updates.size() == ids.size());
    for (const auto& update : updates) {
      CHECK_FALSE(update.failed);
      REQUIRE(update.tokens.size() == static_cast<size_t>(config.particles));
      for (const auto& tokens : update.tokens) {
        CHECK(tokens.size() == static_cast<size_t>(config.draft_steps + 1));
        for (int32_t t : tokens)
          CHECK((t >= 0 && t < config.vocab));
      }
      for (int a : update.ancestors)
        CHECK((a >= 0 && a < config.particles));
    }
    const SlotCheck check = check_invariants(engine);
    INFO(check.problem);
    REQUIRE(check.ok);
  }
  for (RequestId id : ids) {
    const RequestResult result = engine.result(id);
    CHECK(result.particles.size() == static_cast<size_t>(config.particles));
    CHECK(result.tokens.size() == static_cast<size_t>(1 + cycles * (config.draft_steps + 1)));
    CHECK(std::isfinite(result.log_evidence));
    engine.release(id);
  }
  const SlotCheck check = check_invariants(engine);
  CHECK(check.ok);
  CHECK(check.referenced == 0);
  CHECK(check.free == config.slot_pool_size - 1);
}

TEST_CASE("graph and eager runs are bit-identical over 50 cycles") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const int cycles = test::sanitizer_scaled(50, 20, 8); // fewer under a sanitizer
  for (int particles : {1, 4, 8}) {
    EngineConfig graphed = small_config(particles, 4, 8);
    EngineConfig eager = graphed;
    eager.use_graphs = false;
    eager.spin_wait = false; // the blocking wait for outputs: same results
    Setup a(graphed), b(eager);
    for (int i = 0; i < 6; ++i) {
      const auto prompt = random_prompt(rng, graphed.vocab, 30);
      const uint64_t seed = rng.bits();
      CHECK(a.engine->admit(prompt, {.seed = seed}) == b.engine->admit(prompt, {.seed = seed}));
    }
    for (int c = 0; c < cycles; ++c) {
      const auto ua = cycle(*a.engine), ub = cycle(*b.engine);
      CAPTURE(c);
      REQUIRE(same_updates(ua, ub));
    }
    for (const char* name : {"token_table", "slot_table", "refcount", "logw"}) { // logw: bit for bit
      CAPTURE(name);
      CHECK(a.engine->inspect(name).bytes == b.engine->inspect(name).bytes);
    }
  }
}

TEST_CASE("profile_step() times every stage of a real cycle and commits what step() commits") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  for (CycleKind kind : {CycleKind::kSmc, CycleKind::kSpeculative}) {
    CAPTURE(static_cast<int>(kind));
    EngineConfig config = small_config(kind == CycleKind::kSmc ? 4 : 1, 4, 8);
    config.kind = kind;
    Setup a(config), b(config);
    for (int i = 0; i < 5; ++i) {
      const auto prompt = random_prompt(rng, config.vocab, 20);
      const uint64_t seed = rng.bits();
      CHECK(a.engine->admit(prompt, {.seed = seed}) == b.engine->admit(prompt, {.seed = seed}));
    }
    const char* prefix = kind == CycleKind::kSmc ? "smc." : "spec.";
    for (int c = 0; c < 3; ++c) {
      CAPTURE(c);
      const auto expected = cycle(*a.engine); // graph replay
      const std::vector<StageTime> stages = b.engine->profile_step();
      const auto got = b.engine->poll();
      REQUIRE(same_updates(expected, got));
      CHECK_FALSE(b.engine->eager()); // profile_step() leaves the engine as it was
      // Every stage of the recipe, in order, each with a positive GPU time and all launches gated.
      // The speculative recipe's six: alloc, draft, verify forward, score, verifier, pack + commit + outputs.
      REQUIRE(stages.size() >= 6);
      CHECK(stages.front().name == std::string(prefix) + "alloc");
      // The last launch packs the outputs straight into the pinned host block (no copy node).
      CHECK(stages.back().name ==
            std::string(prefix) + (kind == CycleKind::kSmc ? "next_k_and_outputs" : "commit_and_outputs"));
      bool has_score = false;
      for (const StageTime& stage : stages) {
        CAPTURE(stage.name);
        CHECK(stage.gpu_us > 0.0);
        if (!test::under_sanitizer()) { // a sanitizer slows launches past the gate's timeout and stages past
                                        // 0.1 s
          CHECK(stage.gpu_us < 1e5);
          CHECK(stage.gated);
        }
        has_score = has_score || stage.name == std::string(prefix) + "score";
      }
      CHECK(has_score);
    }
    CHECK(check_invariants(*b.engine).ok);
  }
}

TEST_CASE("a request's tokens do not depend on its bucket, its neighbours or its request slot") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const auto prompt = random_prompt(rng, 512, 24);
  const uint64_t seed = rng.bits();
  const int cycles = test::sanitizer_scaled(20, 20, 6);
  auto run = [&](int max_requests, int others_before, int others_after) {
    Setup setup(small_config(4, 4, max_requests));
    Engine& engine = *setup.engine;
    for (int i = 0; i < others_before; ++i)
      engine.admit(random_prompt(rng, 512, 24), {.seed = rng.bits()});
    const RequestId id = engine.admit(prompt, {.seed = seed});
    for (int i = 0; i < others_after; ++i)
      engine.admit(random_prompt(rng, 512, 24), {.seed = rng.bits()});
    std::vector<std::vector<std::vector<int32_t>>> history;
    for (int c = 0; c < cycles; ++c)
      for (const auto& update : cycle(engine))
        if (update.id == id)
          history.push_back(update.tokens);
    CHECK(engine.current_bucket() == max_requests);
    const RequestResult result = engine.result(id);
    return std::make_pair(history, result.particles);
  };
  const auto alone = run(1, 0, 0);
  const auto crowd = run(32, 17, 14);
  const auto other_slot = run(8, 5, 0);
  CHECK(alone.first.size() == static_cast<size_t>(cycles));
  CHECK(alone == crowd);
  CHECK(alone == other_slot);
}

TEST_CASE("KV invariant: draft KV for positions < L - 2, target KV for positions < L - 1") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const EngineConfig config = small_config(4, 3, 4);
  Setup setup(config);
  Engine& engine = *setup.engine;
  const ToyModelWeights weights = make_toy_model_weights(setup.models.target->config());
  const int H = setup.models.target->hidden();
  for (int i = 0; i < 3; ++i)
    engine.admit(random_prompt(rng, config.vocab, 40), {.seed = rng.bits()});
  const int rows = config.max_requests * config.particles;
  const int cycles = test::sanitizer_scaled(12, 12, 5);
  for (int c = 0; c < cycles; ++c) {
    cycle(engine);
    engine.synchronize();
    const auto tokens = engine.inspect("token_table").as<int32_t>();
    const auto slots = engine.inspect("slot_table").as<int32_t>();
    const auto lengths = engine.inspect("seq_len").as<int32_t>();
    const auto live = engine.inspect("live").as<uint8_t>();
    const auto draft_kv = test::to_host(setup.models.draft->kv_data(),
                                        static_cast<size_t>(config.slot_pool_size) * H, engine.stream());
    const auto target_kv = test::to_host(setup.models.target->kv_data(),
                                         static_cast<size_t>(config.slot_pool_size) * H, engine.stream());
    long checked = 0;
    for (int r = 0; r < rows; ++r) {
      if (!live[r])
        continue;
      const int L = lengths[r];
      for (int p = 0; p < L - 1; ++p) {
        const int32_t slot = slots[static_cast<size_t>(r) * config.max_seq_len + p];
        const int32_t token = tokens[static_cast<size_t>(r) * config.max_seq_len + p];
        for (int h = 0; h < H; ++h) {
          const float expected = weights.embedding[static_cast<size_t>(token) * H + h] +
                                 weights.position[(p % kToyPositionPeriod) * H + h];
          if (p < L - 2)
            REQUIRE(draft_kv[static_cast<size_t>(slot) * H + h] == expected);
          REQUIRE(target_kv[static_cast<size_t>(slot) * H + h] == expected);
        }
        ++checked;
      }
    }
    CHECK(checked > 0);
  }
}

namespace {

/// Tokens each row committed in each cycle: [cycle][row] (rows of requests that ran; empty otherwise).
using CycleTokens = std::vector<std::vector<std::vector<int32_t>>>;

/// The requests of the EOS tests: slot 1 is released again (padding inside the bucket of 4, as slot 3).
std::vector<RequestId> admit_eos_requests(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                          const std::vector<uint64_t>& seeds) {
  std::vector<RequestId> ids;
  for (size_t i = 0; i < prompts.size(); ++i)
    ids.push_back(engine.admit(prompts[i], {.seed = seeds[i]}));
  engine.release(ids[1]);
  return ids;
}

} // namespace

TEST_CASE("padding rows touch no slot but 0; EOS drafted or drawn as the bonus finishes a particle") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  EngineConfig config = small_config(4, 4, 4);
  config.target_temperature = 2.0f; // flat: many distinct tokens
  config.draft_temperature = 2.0f;
  config.tau = 0.0f; // never resample: particles evolve independently, so an EOS changes only its own row
  const int cycles = test::sanitizer_scaled(16, 16, 8); // 8 under racecheck: EOS hits still come early
  const int N = config.particles, K = config.draft_steps;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> seeds;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(random_prompt(rng, config.vocab, 10));
    seeds.push_back(rng.bits());
  }

  // Probe run without an EOS id: every row's tokens, cycle by cycle.
  CycleTokens probe(cycles);
  std::vector<int32_t> first_tokens;
  {
    Setup setup(config);
    Engine& engine = *setup.engine;
    const std::vector<RequestId> ids = admit_eos_requests(engine, prompts, seeds);
    for (RequestId id : {ids[0], ids[2]})
      first_tokens.push_back(engine.result(id).tokens.at(0));
    for (int c = 0; c < cycles; ++c) {
      probe[c].resize(static_cast<size_t>(config.max_requests) * config.particles);
      for (const RequestUpdate& update : cycle(engine)) {
        REQUIRE_FALSE(update.finished);
        const int q = update.id == ids[0] ? 0 : 2;
        for (int i = 0; i < N; ++i)
          probe[c][q * N + i] = update.tokens[i];
      }
    }
  }
  // The EOS id: a token some row draws first as a bonus token (column K), hitting as many rows as possible;
  // never one of the first tokens (that case has its own test).
  struct Hit {
    int cycle = -1, column = -1;
  };
  const int rows = 4 * N;
  int eos = -1;
  std::vector<Hit> hits;
  {
    size_t best_rows = 0;
    std::set<int32_t> candidates;
    for (const auto& by_row : probe)
      for (const auto& tokens : by_row)
        if (tokens.size() == static_cast<size_t>(K + 1))
          candidates.insert(tokens[K]);
    for (int32_t t : candidates) {
      if (std::find(first_tokens.begin(), first_tokens.end(), t) != first_tokens.end())
        continue;
      std::vector<Hit> at(rows);
      bool bonus_first = false;
      size_t hit_rows = 0;
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cycles && at[r].cycle < 0; ++c)
          for (size_t k = 0; k < probe[c][r].size() && at[r].cycle < 0; ++k)
            if (probe[c][r][k] == t) {
              at[r] = {c, static_cast<int>(k)};
              bonus_first = bonus_first || static_cast<int>(k) == K;
              ++hit_rows;
            }
      if (bonus_first && hit_rows > best_rows) {
        best_rows = hit_rows;
        eos = t;
        hits = at;
      }
    }
  }
  REQUIRE(eos >= 0);
  config.eos_id = eos;
  int drafted = 0, bonus = 0;
  for (const Hit& hit : hits)
    if (hit.cycle >= 0)
      ++(hit.column == K ? bonus : drafted);
  MESSAGE("EOS id " << eos << ": rows hit at a draft column " << drafted << ", as the bonus " << bonus);

  Setup setup(config);
  Engine& engine = *setup.engine;
  const std::vector<RequestId> ids = admit_eos_requests(engine, prompts, seeds);
  std::vector<double> frozen(static_cast<size_t>(config.max_requests) * config.particles, std::nan(""));
  int frozen_checks = 0;
  for (int c = 0; c < cycles && engine.live_requests() > 0; ++c) {
    CAPTURE(c);
    const std::vector<RequestUpdate> updates = cycle(engine);
    engine.synchronize();
    const auto lengths = engine.inspect("seq_len").as<int32_t>();
    const auto live = engine.inspect("live").as<uint8_t>();
    for (int slot_index : {1, 3})
      for (int i = 0; i < N; ++i) {
        CHECK(lengths[slot_index * N + i] == 0);
        CHECK(live[slot_index * N + i] == 0);
      }
    const auto finished = engine.inspect("finished").as<uint8_t>();
    const auto logw = engine.inspect("logw").as<double>();
    for (const RequestUpdate& update : updates) {
      const int q = update.id == ids[0] ? 0 : 2;
      for (int i = 0; i < N; ++i) {
        const int r = q * N + i;
        CAPTURE(r);
        const Hit hit = hits[r];
        std::vector<int32_t> expected = probe[c][r];
        if (hit.cycle >= 0 && c > hit.cycle)
          expected.clear(); // finished before: nothing counts
        else if (hit.cycle == c)
          expected.resize(hit.column + 1); // cut after the EOS (all K + 1 when it is the bonus)
        CHECK(update.tokens[i] == expected);
        CHECK(finished[r] == (hit.cycle >= 0 && c >= hit.cycle ? 1 : 0));
      }
      const bool all_hit = std::all_of(hits.begin() + q * N, hits.begin() + (q + 1) * N,
                                       [&](const Hit& h) { return h.cycle >= 0 && h.cycle <= c; });
      CHECK(update.finished == all_hit);
    }
    for (int r = 0; r < static_cast<int>(frozen.size()); ++r) {
      if (!finished[r])
        continue;
      if (std::isnan(frozen[r])) {
        frozen[r] = logw[r];
      } else {
        CHECK(std::memcmp(&frozen[r], &logw[r], sizeof(double)) == 0);
        ++frozen_checks;
      }
    }
    REQUIRE(check_invariants(engine).ok);
  }
  // The dummy slot was never written by either model.
  const int H = setup.models.target->hidden();
  for (const ToyModel* model : {setup.models.draft.get(), setup.models.target.get()}) {
    const auto kv0 = test::to_host(model->kv_data(), H, engine.stream());
    for (float x : kv0)
      CHECK(x == 0.0f);
  }
  MESSAGE("frozen-weight checks: " << frozen_checks);
  CHECK(bonus > 0);
  CHECK(frozen_checks > 0);
}

TEST_CASE("EOS as the first token finishes the request at admission (SMC and speculative)") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  for (const CycleKind kind : {CycleKind::kSmc, CycleKind::kSpeculative}) {
    CAPTURE(static_cast<int>(kind));
    EngineConfig config = small_config(kind == CycleKind::kSmc ? 4 : 1, 4, 2);
    config.kind = kind;
    const std::vector<int32_t> prompt = random_prompt(rng, config.vocab, 12);
    const uint64_t seed = rng.bits();
    int32_t first = -1;
    {
      Setup probe(config);
      first = probe.engine->result(probe.engine->admit(prompt, {.seed = seed})).tokens.at(0);
    }
    config.eos_id = first;
    Setup setup(config);
    Engine& engine = *setup.engine;
    const RequestId id = engine.admit(prompt, {.seed = seed});
    const std::vector<RequestUpdate> updates = cycle(engine);
    REQUIRE(updates.size() == 1);
    CHECK(updates[0].finished);
    CHECK(updates[0].reason == "eos");
    for (const auto& tokens : updates[0].tokens)
      CHECK(tokens.empty());
    const RequestResult result = engine.result(id);
    CHECK(result.finished);
    for (int i = 0; i < config.particles; ++i) {
      CHECK(result.particles[i] == std::vector<int32_t>{first});
      CHECK(result.log_weights[i] == 0.0);
    }
    engine.release(id);
    REQUIRE(check_invariants(engine).ok);
  }
}

TEST_CASE("randomized churn: admissions, EOS, releases and compaction keep every invariant") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  EngineConfig config = small_config(4, 4, 8);
  config.eos_id = 3;
  config.max_seq_len = 160;
  config.slot_pool_size = 1 << 14;
  Setup setup(config);
  Engine& engine = *setup.engine;
  std::set<RequestId> live;
  int finished = 0, admitted = 0, compactions = 0;
  const int cycles = test::sanitizer_scaled(2000, 200, 40); // racecheck: 60 did not finish in 330 s
  for (int c = 0; c < cycles; ++c) {
    if (live.size() < 8 && rng.uniform() < 0.3) {
      live.insert(
          engine.admit(random_prompt(rng, config.vocab, 30),
                       {.seed = rng.bits(), .max_new_tokens = static_cast<int>(rng.integer(5, 100))}));
      ++admitted;
    }
    for (const auto& update : cycle(engine)) {
      if (update.finished || update.failed) {
        CHECK_FALSE(update.failed);
        const RequestResult result = engine.result(update.id);
        CHECK(result.finished);
        engine.release(update.id);
        live.erase(update.id);
        ++finished;
      }
    }
    if (rng.uniform() < 0.05) {
      engine.compact();
      ++compactions;
    }
    const SlotCheck check = check_invariants(engine);
    INFO("cycle " << c << ": " << check.problem);
    REQUIRE(check.ok);
  }
  for (RequestId id : live)
    engine.release(id);
  const SlotCheck check = check_invariants(engine);
  CHECK(check.ok);
  CHECK(check.free == config.slot_pool_size - 1);
  MESSAGE("admitted " << admitted << ", finished " << finished << ", compactions " << compactions);
  CHECK(finished > test::sanitizer_scaled(50, 5, 1));
}

TEST_CASE("bad requests get clear errors") {
  const EngineConfig config = small_config(2, 2, 2);
  Setup setup(config);
  Engine& engine = *setup.engine;
  CHECK_THROWS_WITH_AS(engine.admit({}), doctest::Contains("prompt.size() = 0"), Error);
  CHECK_THROWS_WITH_AS(engine.admit(std::vector<int32_t>(config.max_seq_len, 1)),
                       doctest::Contains("prompt.size() = 256: leaves no room"), Error);
  CHECK_THROWS_WITH_AS(engine.admit({1, 2, 512}), doctest::Contains("prompt[2] = 512: token out of range"),
                       Error);
  CHECK_THROWS_WITH_AS(engine.admit({1, -4}), doctest::Contains("prompt[1] = -4"), Error);
  CHECK_THROWS_WITH_AS(engine.admit({1}, {.alpha = 0.0f}), doctest::Contains("params.alpha = 0"), Error);
  engine.admit({1});
  engine.admit({2});
  CHECK_THROWS_WITH_AS(engine.admit({3}), doctest::Contains("every request slot is taken"), Error);
  CHECK_THROWS_WITH_AS(engine.release(99), doctest::Contains("id = 99: unknown"), Error);
  CHECK_THROWS_WITH_AS(engine.result(99), doctest::Contains("id = 99"), Error);
  engine.release(0);
  CHECK_THROWS_WITH_AS(engine.release(0), doctest::Contains("id = 0: unknown or already released"), Error);
}

namespace {

/// Wraps a model and breaks it: NaN logits on one row, or a synchronization inside forward().
class FaultyModel final : public test::ForwardingModel {
public:
  enum class Fault { kNanRow, kSynchronize };
  FaultyModel(Model& inner, Fault fault, int row) : ForwardingModel(inner), fault_(fault), row_(row) {}
  void forward(const ForwardArgs& args, cudaStream_t stream) override {
    ForwardingModel::forward(args, stream);
    if (fault_ == Fault::kNanRow && row_ < args.rows) {
      // The row's tokens_per_row logits rows, io_stride() rows apart from the next row's (ForwardArgs).
      const size_t token_bytes = static_cast<size_t>(vocab()) * dtype_bytes(logits_dtype());
      SMCGRAPH_CUDA_CHECK(
          cudaMemsetAsync(static_cast<uint8_t*>(args.logits) + row_ * args.io_stride() * token_bytes, 0xff,
                          args.tokens_per_row * token_bytes, stream));
    }
    if (fault_ == Fault::kSynchronize)
      SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

private:
  Fault fault_;
  int row_;
};

} // namespace

TEST_CASE("a model writing NaN logits fails its request; the others match a clean run") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const EngineConfig config = small_config(4, 4, 4);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> seeds;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(random_prompt(rng, config.vocab, 12));
    seeds.push_back(rng.bits());
  }
  auto run = [&](bool faulty) {
    ToyModelPair models = ToyModel::pair(toy_for(config), 0.3f);
    // Row 4 is particle 0 of request slot 1: the target's verify logits of that row turn NaN.
    FaultyModel broken(*models.target, FaultyModel::Fault::kNanRow, 4);
    Engine engine(config, *models.draft, faulty ? static_cast<Model&>(broken) : *models.target);
    for (int i = 0; i < 3; ++i)
      engine.admit(prompts[i], {.seed = seeds[i]});
    std::vector<std::vector<RequestUpdate>> history;
    for (int c = 0; c < 6; ++c)
      history.push_back(cycle(engine));
    return history;
  };
  const auto clean = run(false);
  const auto broken = run(true);
  bool failed_seen = false;
  for (size_t c = 0; c < clean.size(); ++c) {
    for (const auto& update : broken[c]) {
      if (update.id == 1) {
        CHECK(update.failed);
        CHECK(update.reason.find("nan") != std::string::npos);
        failed_seen = true;
        continue;
      }
      const auto match =
          std::find_if(clean[c].begin(), clean[c].end(), [&](auto& u) { return u.id == update.id; });
      REQUIRE(match != clean[c].end());
      CHECK(match->tokens == update.tokens);
      CHECK(match->ancestors == update.ancestors);
    }
  }
  CHECK(failed_seen);
}

TEST_CASE("slot pool exhaustion fails the starved request; the others continue") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  EngineConfig config = small_config(2, 4, 2);
  config.slot_pool_size = 200; // room for the prompts and a few cycles only
  Setup setup(config);
  Engine& engine = *setup.engine;
  const RequestId a = engine.admit(random_prompt(rng, config.vocab, 20), {.seed = 1});
  const RequestId b = engine.admit(random_prompt(rng, config.vocab, 20), {.seed = 2});
  bool exhausted = false;
  int a_cycles_after = 0;
  for (int c = 0; c < 40; ++c) {
    for (const auto& update : cycle(engine)) {
      if (update.failed) {
        CHECK(update.reason.find("slot pool exhausted") != std::string::npos);
        exhausted = true;
        engine.release(update.id); // frees its slots: the survivor continues
      } else if (exhausted && update.id == a) {
        ++a_cycles_after;
      }
    }
    REQUIRE(check_invariants(engine).ok);
    if (engine.live_requests() == 0)
      break;
  }
  (void)b;
  CHECK(exhausted);
}

TEST_CASE("a model that synchronizes during capture fails the capture with the step named") {
  const EngineConfig config = small_config(2, 2, 2);
  ToyModelPair models = ToyModel::pair(toy_for(config), 0.3f);
  FaultyModel syncing(*models.draft, FaultyModel::Fault::kSynchronize, 0);
  CHECK_THROWS_WITH_AS(Engine(config, syncing, *models.target),
                       doctest::Contains("capture of bucket 2 failed at step smc.draft"), Error);
  EngineConfig eager = config;
  eager.use_graphs = false; // the same model runs fine eagerly
  Engine engine(eager, syncing, *models.target);
  engine.admit({1, 2, 3});
  CHECK(cycle(engine).size() == 1);
}

TEST_CASE(
    "Engine::inspect copies the cycle state's buffers by name; unknown names and wrong types are errors") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const EngineConfig config = small_config(4, 3, 4);
  Setup setup(config);
  Engine& engine = *setup.engine;
  const std::vector<int32_t> prompt = random_prompt(rng, config.vocab, 20); // 1 to 20 tokens
  const std::vector<RequestId> ids = {engine.admit(prompt, {.seed = rng.bits()})};
  cycle(engine);
  const std::vector<std::string> names = engine.state_buffer_names();
  auto has = [&](const char* name) { return std::find(names.begin(), names.end(), name) != names.end(); };
  CHECK(has("token_table"));
  CHECK(has("logw"));
  CHECK_FALSE(has("accepted")); // a speculative-cycle buffer: this engine runs SMC
  for (const std::string& name : names) {
    CAPTURE(name);
    const StateBufferCopy copy = engine.inspect(name);
    CHECK(copy.name == name);
    CHECK(copy.element_bytes >= 1);
    CHECK(copy.size() >= 1);
    CHECK(copy.bytes.size() == copy.size() * copy.element_bytes);
  }
  const std::vector<int32_t> lengths = engine.inspect("seq_len").as<int32_t>();
  REQUIRE(lengths.size() == static_cast<size_t>(config.max_requests * config.particles));
  // the prompt, the first token, one cycle of K + 1
  CHECK(lengths[0] == static_cast<int32_t>(prompt.size()) + 1 + config.draft_steps + 1);
  CHECK(engine.inspect("live").as<uint8_t>().at(0) == 1);
  CHECK(engine.polled_all()); // cycle() = step() + poll()
  engine.step();
  CHECK_FALSE(engine.polled_all());
  engine.poll();
  CHECK(engine.polled_all());
  std::string message;
  try {
    engine.inspect("no_such_buffer");
  } catch (const smcgraph::Error& e) {
    message = e.what();
  }
  CHECK_MESSAGE(message.find("no_such_buffer") != std::string::npos, message);
  CHECK_THROWS_AS(engine.inspect("seq_len").as<double>(), smcgraph::Error);
  CHECK_THROWS_AS(engine.inspect("accepted"), smcgraph::Error);
  engine.release(ids[0]);
}
