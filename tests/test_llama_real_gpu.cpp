// The real model pair (SmolLM2-135M-Instruct, ./run fetch-model) through the engine: greedy speculative
// decoding with the layer-subset draft equals greedy target-only decoding token for token, over 16 chat
// prompts x 256 tokens, in every bucket, eager and graphed. The target-only reference is a host loop of
// one-token forwards (the prompt prefilled in one forward, as admission does), argmax on the host. LlamaModel
// is batch-invariant (a token's logits do not depend on the rows or tokens around it), so the equality is
// exact, not up to ties. And SMC (N 8, K 4, sampled) with the verify resumed after the 28-layer draft's
// layers gives the every-layer verify's updates and results bit for bit. And SMC with the default draft keeps
// the target's text by log Z-hat per token, which a 22-layer draft fails. Skips with a message when the model
// file is absent (SMCGRAPH_MODEL_PATH or .cache/models/).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "runtime/slot_checker.hpp"
#include "chat_prompts.hpp"
#include "smollm2_drafts.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/tokenizer.hpp"
#include "support/engine_test_util.hpp"
#include "support/test_util.hpp"

namespace {

using namespace smcgraph;

using examples::kChatQuestions;

/// Greedy target-only decoding: the prompt in one forward, then one token per forward; argmax on the host.
std::vector<int32_t> greedy_reference(LlamaModel& model, const std::vector<int32_t>& prompt, int new_tokens,
                                      int max_seq_len, cudaStream_t stream) {
  const int vocab = model.vocab();
  const int P = static_cast<int>(prompt.size());
  std::vector<int32_t> slots(max_seq_len), positions(max_seq_len);
  for (int p = 0; p < max_seq_len; ++p) {
    slots[p] = p + 1; // this model's own KV storage; slot 0 stays the dummy
    positions[p] = p;
  }
  DeviceBuffer<int32_t> d_slots = test::to_device(slots, stream),
                        d_positions = test::to_device(positions, stream);
  DeviceBuffer<int32_t> d_tokens(max_seq_len), d_seq_len(1);
  DeviceBuffer<uint8_t> d_live = test::to_device(std::vector<uint8_t>{1}, stream);
  DeviceBuffer<float> d_logits(static_cast<size_t>(P) * vocab);
  std::vector<int32_t> sequence = prompt, generated;
  int begin = 0;
  while (static_cast<int>(generated.size()) < new_tokens) {
    const int n = static_cast<int>(sequence.size()) - begin;
    d_tokens.copy_from_host(sequence.data() + begin, n, stream);
    const int32_t seq_len = begin + n;
    d_seq_len.copy_from_host(&seq_len, 1, stream);
    const ForwardArgs args{1,
                           n,
                           d_tokens.data(),
                           d_positions.data() + begin,
                           d_slots.data(),
                           d_seq_len.data(),
                           d_slots.data() + begin,
                           d_live.data(),
                           d_logits.data()};
    model.forward(args, stream);
    const std::vector<float> last = test::to_host(d_logits.data() + static_cast<size_t>(n - 1) * vocab,
                                                  static_cast<size_t>(vocab), stream);
    const int32_t next = static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    generated.push_back(next);
    begin = static_cast<int>(sequence.size());
    sequence.push_back(next);
  }
  return generated;
}

/// The real model's weights and the first `count` chat prompts in its chat template.
struct RealModel {
  std::shared_ptr<const LlamaWeights> weights;
  std::vector<std::vector<int32_t>> prompts;
  size_t longest = 0; ///< tokens of the longest prompt
  /// A row length for the prompts, `new_tokens` more and two cycles' K + 1, in multiples of 128.
  int max_seq_len(int new_tokens, int steps) const {
    return static_cast<int>((longest + new_tokens + 2 * (steps + 1) + 127) / 128 * 128);
  }
};

/// The real model, or nothing (after a MESSAGE that the test skips) when its file is absent.
std::optional<RealModel> load_real_model(int count) {
  const std::string path = default_llama_model_path();
  if (!std::filesystem::exists(path)) {
    MESSAGE("skipped: real model file not found (run ./run fetch-model)");
    return std::nullopt;
  }
  const GgufFile file = GgufFile::open(path);
  const Tokenizer tokenizer = Tokenizer::from_gguf(file);
  RealModel model;
  model.weights = load_llama_weights(file);
  for (int i = 0; i < count; ++i) {
    model.prompts.push_back(
        tokenizer.encode(tokenizer.apply_chat_template({{"user", kChatQuestions[i]}}, true)));
    model.longest = std::max(model.longest, model.prompts.back().size());
  }
  return model;
}

/// Runs `ids` to their end, at most `max_cycles` cycles; every update, none of them a failure.
std::vector<RequestUpdate> completed_updates(Engine& engine, const std::vector<RequestId>& ids,
                                             int max_cycles) {
  test::CompletedRun run = test::run_to_completion(engine, ids, max_cycles);
  REQUIRE(run.done);
  for (const RequestUpdate& update : run.updates)
    REQUIRE_MESSAGE(!update.failed, update.reason);
  return std::move(run.updates);
}

/// The SMC cases' particles and draft steps.
constexpr int kSmcParticles = 8, kSmcSteps = 4;

/// An SMC engine's configuration (N kSmcParticles, K kSmcSteps, T_d 0.7 : T_t 1) for `requests` requests over
/// the models of `options`.
EngineConfig smc_config(const LlamaModelOptions& options, int vocab, int requests) {
  EngineConfig config;
  config.kind = CycleKind::kSmc;
  config.vocab = vocab;
  config.particles = kSmcParticles;
  config.draft_steps = kSmcSteps;
  config.max_requests = requests;
  config.max_seq_len = options.max_seq_len;
  config.slot_pool_size = options.pool_size;
  config.draft_temperature = 0.7f;
  config.target_temperature = 1.0f;
  return config;
}

} // namespace

TEST_CASE(
    "real model: greedy speculative decoding equals greedy target-only decoding, every bucket, eager and "
    "graphed") {
  // Sanitizers slow every kernel 10-1000x: fewer prompts, tokens and buckets, same paths.
  const int prompts_used = test::sanitizer_scaled(16, 3, 1);
  const std::optional<RealModel> real = load_real_model(prompts_used);
  if (!real)
    return;
  const auto& weights = real->weights;
  const std::vector<std::vector<int32_t>>& prompts = real->prompts;
  const size_t longest = real->longest;
  const int new_tokens = test::sanitizer_scaled(256, 12, 4);
  const std::vector<int> buckets = test::sanitizer_tool() == test::SanitizerTool::kRacecheck
                                       ? std::vector<int>{1}
                                   : test::under_sanitizer() ? std::vector<int>{1, 2}
                                                             : std::vector<int>{1, 2, 4, 8, 16};
  // racecheck's host memory grows with every kernel launch it watches: on the H100 machine (128 GiB) the full
  // 30-layer pair passed 130 GB after a few cycles, and one eager prefill + decode step of the whole model
  // took 20 GB. Under racecheck the pair is the file's first 2 layers (target) and its first layer (draft):
  // the same kernels on the same real weights and shapes, 15x fewer launches; the property checked
  // (speculative == target-only greedy decoding, the reference built from the same target) is unchanged.
  const bool racecheck = test::sanitizer_tool() == test::SanitizerTool::kRacecheck;
  const std::string target_layers = racecheck ? "0-1" : "", draft_layers = racecheck ? "0" : "0-27";
  constexpr int kSteps = 4;
  const int max_seq_len = real->max_seq_len(new_tokens, kSteps);
  const int max_requests = buckets.back();

  LlamaModelOptions options;
  options.max_seq_len = max_seq_len;
  options.pool_size = max_requests * max_seq_len + 1;
  options.max_tokens_per_forward = std::max<int>(128, max_requests * (kSteps + 1));
  options.logits_dtype = DType::kFloat32;
  if (!target_layers.empty())
    options.layers = parse_llama_layers(target_layers);

  // The reference: target-only greedy decoding of every prompt.
  std::vector<std::vector<int32_t>> reference;
  {
    LlamaModelOptions reference_options = options;
    reference_options.max_tokens_per_forward = static_cast<int>(longest);
    reference_options.pool_size = max_seq_len + 1;
    LlamaModel target(weights, reference_options);
    Stream stream;
    for (const std::vector<int32_t>& prompt : prompts)
      reference.push_back(greedy_reference(target, prompt, new_tokens, max_seq_len, stream));
  }

  for (const bool graphs : {true, false}) {
    LlamaModel target(weights, options);
    LlamaModelOptions draft_options = options;
    draft_options.layers = parse_llama_layers(draft_layers);
    LlamaModel draft(weights, draft_options);
    EngineConfig config;
    config.kind = CycleKind::kSpeculative;
    config.vocab = target.vocab();
    config.particles = 1;
    config.draft_steps = kSteps;
    config.max_requests = max_requests;
    config.buckets = buckets;
    config.max_seq_len = max_seq_len;
    config.slot_pool_size = options.pool_size;
    config.draft_temperature = 0.0f;
    config.target_temperature = 0.0f;
    config.use_graphs = graphs;
    Engine engine(config, draft, target);
    int compared = 0, mismatched = 0;
    for (const int bucket : buckets) {
      std::vector<RequestId> ids;
      for (int i = 0; i < bucket; ++i)
        ids.push_back(engine.admit(prompts[i % prompts_used], {.seed = 1, .max_new_tokens = new_tokens}));
      REQUIRE(engine.current_bucket() == bucket);
      completed_updates(engine, ids, new_tokens + 2);
      for (int i = 0; i < bucket; ++i) {
        const RequestResult result = engine.result(ids[i]);
        REQUIRE(result.tokens.size() >= static_cast<size_t>(new_tokens)); // a cycle may commit past the limit
        const std::vector<int32_t> generated(result.tokens.begin(), result.tokens.begin() + new_tokens);
        const std::vector<int32_t>& expected = reference[i % prompts_used];
        ++compared;
        if (generated != expected) {
          ++mismatched;
          const size_t first =
              std::mismatch(generated.begin(), generated.end(), expected.begin()).first - generated.begin();
          MESSAGE(std::string(graphs ? "graphed" : "eager"), " bucket ", bucket, " prompt ", i % prompts_used,
                  ": first difference at token ", first, " (", generated[first], " vs ", expected[first],
                  ")");
        }
        engine.release(ids[i]);
      }
      const SlotCheck slots = test::check_invariants(engine);
      CHECK_MESSAGE(slots.ok, slots.problem);
    }
    CHECK(mismatched == 0);
    MESSAGE(std::string(graphs ? "graphed" : "eager"), ": ", compared, " requests x ", new_tokens,
            " tokens compared with greedy target-only decoding, ", mismatched, " differ");
  }
}

TEST_CASE(
    "real model: SMC with the verify resumed after the draft's 28 layers gives the every-layer verify's "
    "results bit for bit") {
  // As above: fewer requests and tokens under a sanitizer, and under racecheck the file's first 2 layers
  // (target) and its first (draft).
  const int requests = test::sanitizer_scaled(4, 2, 1);
  const std::optional<RealModel> real = load_real_model(requests);
  if (!real)
    return;
  const auto& weights = real->weights;
  const std::vector<std::vector<int32_t>>& prompts = real->prompts;
  const size_t longest = real->longest;
  const int new_tokens = test::sanitizer_scaled(96, 10, 5);
  const bool racecheck = test::sanitizer_tool() == test::SanitizerTool::kRacecheck;
  constexpr int kParticles = kSmcParticles, kSteps = kSmcSteps;
  const int max_seq_len = real->max_seq_len(new_tokens, kSteps);
  LlamaModelOptions options;
  options.max_seq_len = max_seq_len;
  options.pool_size = requests * kParticles * max_seq_len + 1;
  options.max_tokens_per_forward =
      std::max<int>(static_cast<int>(longest), requests * kParticles * (kSteps + 1));
  options.logits_dtype = DType::kBFloat16;
  if (racecheck)
    options.layers = parse_llama_layers("0-1");

  struct Run {
    std::vector<RequestUpdate> updates;
    std::vector<RequestResult> results;
  };
  const auto run = [&](bool resume) {
    std::optional<test::ScopedEnv> no_resume;
    if (!resume)
      no_resume.emplace("SMCGRAPH_DISABLE_PREFIX_RESUME", "1");
    LlamaModel target(weights, options);
    LlamaModelOptions draft_options = options;
    draft_options.layers = parse_llama_layers(racecheck ? "0" : "0-27");
    draft_options.kv_owner = &target;
    LlamaModel draft(weights, draft_options);
    Engine engine(smc_config(options, target.vocab(), requests), draft, target);
    CHECK(engine.resumed_layers() == (resume ? static_cast<int>(draft.layers().size()) : 0));
    std::vector<RequestId> ids;
    for (int i = 0; i < requests; ++i)
      ids.push_back(
          engine.admit(prompts[i], {.seed = 1000 + static_cast<uint64_t>(i), .max_new_tokens = new_tokens}));
    Run out;
    out.updates = completed_updates(engine, ids, new_tokens + 2);
    for (const RequestId id : ids)
      out.results.push_back(engine.result(id));
    const SlotCheck slots = test::check_invariants(engine);
    CHECK_MESSAGE(slots.ok, slots.problem);
    return out;
  };
  const Run resumed = run(true), every_layer = run(false);
  REQUIRE(resumed.updates.size() == every_layer.updates.size());
  int resampled = 0;
  for (size_t u = 0; u < resumed.updates.size(); ++u) {
    const RequestUpdate &a = resumed.updates[u], &b = every_layer.updates[u];
    CAPTURE(u);
    CHECK(a.id == b.id);
    CHECK(a.tokens == b.tokens);
    CHECK(a.ancestors == b.ancestors);
    CHECK(a.ess == b.ess); // the same bits: the resumed verify's logits are the full verify's
    CHECK(a.resampled == b.resampled);
    resampled += a.resampled ? 1 : 0;
  }
  for (size_t i = 0; i < resumed.results.size(); ++i) {
    CHECK(resumed.results[i].particles == every_layer.results[i].particles);
    CHECK(resumed.results[i].log_weights == every_layer.results[i].log_weights);
    CHECK(resumed.results[i].log_evidence == every_layer.results[i].log_evidence);
  }
  MESSAGE(requests, " SMC requests (N 8, K 4) x ", new_tokens, " tokens: ", resumed.updates.size(),
          " request updates compared, ", resampled, " of them resampled");
}

TEST_CASE("real model: SMC with the default draft keeps the target's text (log Z-hat per token), and a "
          "22-layer draft's particles are caught falling short") {
  // log Z-hat / token (RequestResult::log_evidence over the chosen particle's tokens) is how many nats a
  // token the particle system falls short of the target softmax(l / T_t); an exact sampler gives 0. The
  // 22-29-layer prefixes measured -0.47 to -0.83 at T_d 0.7 : T_t 1 and made no sentences ("At (, S. . ."),
  // while ESS / N stayed at 0.44-0.64, so ESS is no guard: this is (examples/smollm2_drafts.hpp). The seeds
  // are fixed and the engine is batch-invariant, so each mean is one deterministic number per build.
  if (test::under_sanitizer()) {
    MESSAGE("skipped under a sanitizer: a statistical check of the whole model over 16 prompts (the other "
            "cases run the same kernels there)");
    return;
  }
  constexpr int kPrompts = 16, kParticles = kSmcParticles, kSteps = kSmcSteps, kNewTokens = 64;
  const std::optional<RealModel> real = load_real_model(kPrompts);
  if (!real)
    return;
  const int max_seq_len = real->max_seq_len(kNewTokens, kSteps);
  LlamaModelOptions options;
  options.max_seq_len = max_seq_len;
  options.pool_size = kPrompts * kParticles * max_seq_len + 1;
  options.max_tokens_per_forward =
      std::max<int>(static_cast<int>(real->longest), kPrompts * kParticles * (kSteps + 1));
  options.logits_dtype = DType::kBFloat16;
  LlamaModel target(real->weights, options);

  // Mean over the prompts of log Z-hat / token, and the mean ESS / N over the request cycles.
  const auto measure = [&](const std::string& draft_layers, double& ess_over_n) {
    LlamaModelOptions draft_options = options;
    draft_options.layers = parse_llama_layers(draft_layers);
    draft_options.kv_owner = &target;
    LlamaModel draft(real->weights, draft_options);
    Engine engine(smc_config(options, target.vocab(), kPrompts), draft, target);
    std::vector<RequestId> ids;
    for (int i = 0; i < kPrompts; ++i)
      ids.push_back(engine.admit(real->prompts[static_cast<size_t>(i)],
                                 {.seed = 7000 + static_cast<uint64_t>(i), .max_new_tokens = kNewTokens}));
    const std::vector<RequestUpdate> updates = completed_updates(engine, ids, kNewTokens + 2);
    double ess = 0.0;
    for (const RequestUpdate& update : updates)
      ess += update.ess / kParticles;
    ess_over_n = ess / static_cast<double>(updates.size());
    double sum = 0.0;
    for (const RequestId id : ids) {
      const RequestResult result = engine.result(id);
      REQUIRE(!result.tokens.empty());
      CHECK(std::isfinite(result.log_evidence));
      sum += result.log_evidence / static_cast<double>(result.tokens.size());
    }
    return sum / kPrompts;
  };
  double default_ess = 0.0, short_ess = 0.0;
  const double default_draft = measure(examples::kSmcDraftLayers, default_ess);
  const double short_draft = measure("0-21", short_ess);
  MESSAGE("SMC N 8 K 4, T_d 0.7 : T_t 1, 16 chat prompts x ", kNewTokens, " tokens: draft ",
          std::string(examples::kSmcDraftLayers), " log Z-hat ", default_draft, " a token (ESS / N ",
          default_ess, "); draft 0-21 ", short_draft, " (ESS / N ", short_ess, ")");
  CHECK(default_draft > examples::kSmcLogZPerTokenFloor);
  CHECK(short_draft < examples::kSmcLogZPerTokenFloor);
}
