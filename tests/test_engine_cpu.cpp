// Engine configuration and request validation: every field out of range gets an error naming it and its
// value; the message of a sticky CUDA error. No GPU needed (validation runs before any CUDA call). With
// SMCGRAPH_FUZZ_CORPUS_DIR set, the inputs below are also written as seeds of the engine fuzz target
// (tests/fuzz/fuzz_engine_validation.cpp).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "fuzz/engine_fuzz_input.hpp"
#include "reference/cycle_ref.hpp"
#include "runtime/cycle_state.hpp"
#include "runtime/env.hpp"
#include "runtime/engine_validation.hpp"
#include "runtime/request_outcome.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "support/fuzz_corpus.hpp"

namespace {

/// Writes the input as a seed of the engine fuzz target (when SMCGRAPH_FUZZ_CORPUS_DIR is set).
void seed(const smcgraph::EngineConfig& config, const smcgraph::RequestParams& params = {},
          const std::vector<int32_t>& prompt = {1, 2, 3}) {
  static int count = 0;
  const std::vector<uint8_t> bytes = smcgraph::fuzz::encode_engine_fuzz_input(config, params, prompt);
  CHECK(smcgraph::test::write_fuzz_seed("engine", "seed-" + std::to_string(count++), bytes));
  // The layout round-trips (the fuzz target reads what the seeds say).
  const smcgraph::fuzz::EngineFuzzInput decoded =
      smcgraph::fuzz::decode_engine_fuzz_input(bytes.data(), bytes.size());
  CHECK(decoded.config.vocab == config.vocab);
  CHECK(decoded.config.buckets == config.buckets);
  CHECK(decoded.params.max_new_tokens == params.max_new_tokens);
  CHECK(decoded.params.draft_steps == params.draft_steps);
  CHECK(decoded.config.adaptive.enabled == config.adaptive.enabled);
  CHECK(decoded.config.adaptive.mid_steps == config.adaptive.mid_steps);
  CHECK(std::memcmp(&decoded.config.adaptive.pressure_free_fraction, &config.adaptive.pressure_free_fraction,
                    sizeof(float)) == 0); // bit for bit (a NaN seed too)
  CHECK(decoded.config.prefill_chunk == config.prefill_chunk);
  CHECK(decoded.prompt == prompt);
}

std::string error_of(const std::function<void(smcgraph::EngineConfig&)>& edit) {
  smcgraph::EngineConfig config;
  edit(config);
  seed(config);
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
  // draft_steps = 0 is the speculative cycle without a draft (the target alone); not adaptive, not SMC.
  auto no_draft = [](smcgraph::EngineConfig& c) {
    c.kind = smcgraph::CycleKind::kSpeculative;
    c.particles = 1;
    c.draft_steps = 0;
  };
  CHECK(error_of(no_draft) == "no error");
  CHECK(contains(error_of([&](auto& c) {
                   no_draft(c);
                   c.adaptive.enabled = true;
                 }),
                 "needs draft_steps >= 1"));
  CHECK(contains(error_of([](auto& c) { c.particles = 0; }), "particles = 0"));
  CHECK(contains(error_of([](auto& c) { c.particles = 257; }), "particles = 257"));
  CHECK(contains(error_of([](auto& c) { c.max_requests = 0; }), "max_requests = 0"));
  CHECK(contains(error_of([](auto& c) { c.max_seq_len = 5; }), "max_seq_len = 5"));
  CHECK(contains(error_of([](auto& c) { c.slot_pool_size = 1; }), "slot_pool_size = 1"));
  CHECK(contains(error_of([](auto& c) { c.slot_pool_size = (1 << 30) + 1; }),
                 "slot_pool_size = 1073741825: must be <= 2^30"));
  CHECK(error_of([](auto& c) { c.slot_pool_size = 1 << 30; }) == "no error");
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
  CHECK(contains(error_of([](auto& c) { c.draft_loop = static_cast<smcgraph::DraftLoop>(7); }),
                 "draft_loop = 7: must be kAuto, kConditional or kMasked"));
  CHECK(contains(error_of([](auto& c) { c.prefill_chunk = -1; }),
                 "prefill_chunk = -1: must be in [0, 2^20] (0: by the models)"));
  CHECK(contains(error_of([](auto& c) { c.prefill_chunk = (1 << 20) + 1; }), "prefill_chunk = 1048577"));
  CHECK(error_of([](auto& c) { c.prefill_chunk = 1 << 20; }) == "no error");
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

namespace {

/// The error validate_request throws for `prompt` / `params` on `config`, or "no error".
std::string request_error(const smcgraph::EngineConfig& config, const std::vector<int32_t>& prompt,
                          const smcgraph::RequestParams& params = {}) {
  seed(config, params, prompt);
  try {
    smcgraph::detail::validate_request(config, prompt, params);
  } catch (const smcgraph::Error& e) {
    CHECK(e.cuda_error() == cudaSuccess);
    return e.what();
  }
  return "no error";
}

} // namespace

TEST_CASE("admit() arguments: the prompt and every RequestParams field out of range are named") {
  smcgraph::EngineConfig config;
  config.vocab = 512;
  config.max_seq_len = 256;
  config.draft_steps = 4;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(request_error(config, {1, 2, 3}) == "no error");
  CHECK(request_error(config, std::vector<int32_t>(250, 7)) == "no error"); // 250 + 4 + 2 = max_seq_len
  CHECK(contains(request_error(config, {}), "Engine::admit: prompt.size() = 0: the prompt must hold"));
  CHECK(contains(request_error(config, std::vector<int32_t>(251, 7)), "prompt.size() = 251: leaves no room"));
  CHECK(contains(request_error(config, {1, 2, 512}),
                 "Engine::admit: prompt[2] = 512: token out of range [0, 512)"));
  CHECK(contains(request_error(config, {1, -4}), "prompt[1] = -4"));
  CHECK(contains(request_error(config, {1}, {.alpha = 0.0f}), "params.alpha = 0"));
  CHECK(contains(request_error(config, {1}, {.alpha = inf}), "params.alpha = inf"));
  CHECK(contains(request_error(config, {1}, {.draft_temperature = 0.0f}), "params.draft_temperature = 0"));
  CHECK(contains(request_error(config, {1}, {.draft_temperature = nan}), "params.draft_temperature = nan"));
  CHECK(contains(request_error(config, {1}, {.target_temperature = inf}), "params.target_temperature = inf"));
  CHECK(contains(request_error(config, {1}, {.tau = 1.5f}), "params.tau = 1.5"));
  CHECK(contains(request_error(config, {1}, {.tau = nan}), "params.tau = nan"));
  CHECK(contains(request_error(config, {1}, {.max_new_tokens = 0}), "params.max_new_tokens = 0"));
  CHECK(contains(request_error(config, {1}, {.max_new_tokens = -2}), "params.max_new_tokens = -2"));
  // Negative values take the engine's defaults; 0 is a legal target temperature (greedy) and, for
  // speculative decoding only, a legal draft temperature.
  CHECK(request_error(config, {1}, {.target_temperature = 0.0f}) == "no error");
  const auto resolved =
      smcgraph::detail::validate_request(config, {1}, {.draft_temperature = -1.0f, .tau = 0.25f});
  CHECK(resolved.draft_temperature == config.draft_temperature);
  CHECK(resolved.target_temperature == config.target_temperature);
  CHECK(resolved.alpha == config.alpha);
  CHECK(resolved.tau == 0.25f);
  smcgraph::EngineConfig speculative = config;
  speculative.kind = smcgraph::CycleKind::kSpeculative;
  speculative.particles = 1;
  CHECK(request_error(speculative, {1}, {.draft_temperature = 0.0f}) == "no error");
}

TEST_CASE("a sticky CUDA error's message says the context is unusable; other errors do not") {
  using smcgraph::kStickyErrorNote;
  for (const cudaError_t error :
       {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorIllegalInstruction,
        cudaErrorMisalignedAddress, cudaErrorHardwareStackError, cudaErrorAssert, cudaErrorInvalidPc,
        cudaErrorInvalidAddressSpace, cudaErrorLaunchTimeout}) {
    CAPTURE(static_cast<int>(error));
    CHECK(smcgraph::is_sticky(error));
    const std::string message =
        smcgraph::detail::cuda_error_message(error, "cudaStreamSynchronize(stream)", "engine.cpp", 42);
    CHECK(contains(message, "CUDA error in cudaStreamSynchronize(stream) at engine.cpp:42: "));
    CHECK(contains(message, cudaGetErrorName(error)));
    CHECK(contains(message, std::string("; ") + kStickyErrorNote));
  }
  for (const cudaError_t error : {cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorNotReady,
                                  cudaErrorStreamCaptureUnsupported, cudaErrorInvalidResourceHandle}) {
    CAPTURE(static_cast<int>(error));
    CHECK_FALSE(smcgraph::is_sticky(error));
    const std::string message = smcgraph::detail::cuda_error_message(error, "cudaMalloc(&p, n)", "x.cpp", 1);
    CHECK(contains(message, cudaGetErrorName(error)));
    CHECK(message.find(kStickyErrorNote) == std::string::npos);
  }
  CHECK_FALSE(smcgraph::is_sticky(cudaSuccess));
  // The check macro throws the same message, carrying the error code.
  try {
    SMCGRAPH_CUDA_CHECK(cudaErrorIllegalAddress);
    FAIL("SMCGRAPH_CUDA_CHECK did not throw");
  } catch (const smcgraph::Error& e) {
    CHECK(e.cuda_error() == cudaErrorIllegalAddress);
    CHECK(contains(e.what(), "CUDA error in cudaErrorIllegalAddress at "));
    CHECK(contains(e.what(), kStickyErrorNote));
  }
}

TEST_CASE("classify_request: each outcome, its reason, and the order in which causes win") {
  using smcgraph::detail::classify_request;
  using smcgraph::detail::RequestCycleReport;
  using smcgraph::detail::RequestOutcome;
  // flags, all_finished, any_live, length, prompt_length, max_new_tokens
  const RequestCycleReport running{0, false, true, 20, 10, 16};
  CHECK(classify_request(running).outcome == RequestOutcome::kRunning);
  CHECK(classify_request(running).reason.empty());
  CHECK(!classify_request(running).finished());
  CHECK(!classify_request(running).failed());

  RequestCycleReport r = running;
  r.flags = smcgraph::kFlagNanLogit | smcgraph::kFlagSlotsExhausted | smcgraph::kFlagMaxLength;
  r.all_finished = true;
  auto v = classify_request(r); // a fault outranks every finish cause, and names only the faults
  CHECK(v.outcome == RequestOutcome::kFailed);
  CHECK(v.failed());
  CHECK(v.reason == "nan or +inf logit, slot pool exhausted");

  r = running;
  r.flags = smcgraph::kFlagMaxLength;
  r.all_finished = true;
  r.length = 26; // also at the token budget
  v = classify_request(r);
  CHECK(v.outcome == RequestOutcome::kMaxLength);
  CHECK(v.finished());
  CHECK(v.reason == "max sequence length");

  r = running;
  r.all_finished = true;
  r.length = 26;
  CHECK(classify_request(r).outcome == RequestOutcome::kEos);
  CHECK(classify_request(r).reason == "eos");

  r = running;
  r.length = 26; // 16 generated: the budget
  r.any_live = false;
  CHECK(classify_request(r).outcome == RequestOutcome::kMaxNewTokens);
  CHECK(classify_request(r).reason == "max_new_tokens");
  r.length = 25; // one short of it
  CHECK(classify_request(r).outcome == RequestOutcome::kRowsNotLive);
  CHECK(classify_request(r).failed());
  CHECK(classify_request(r).reason == "rows not live");

  r = running;
  r.max_new_tokens = 0; // no limit
  r.length = 1000;
  CHECK(classify_request(r).outcome == RequestOutcome::kRunning);
  r.flags = 1u << 6; // a flag that is neither a fault nor max length changes nothing
  CHECK(classify_request(r).outcome == RequestOutcome::kRunning);
}

TEST_CASE("classify_request agrees with the reference's independent decision on every combination") {
  int compared = 0;
  for (uint32_t flags = 0; flags < (1u << 7); ++flags) {
    for (int finished_live = 0; finished_live < 4; ++finished_live) {
      for (int generated = 0; generated <= 4; ++generated) {
        for (const int max_new_tokens : {-1, 0, 1, 3, 4}) {
          const bool all_finished = finished_live & 1, any_live = (finished_live & 2) != 0;
          const smcgraph::detail::RequestVerdict got = smcgraph::detail::classify_request(
              {flags, all_finished, any_live, 7 + generated, 7, max_new_tokens});
          const smcgraph::reference::RequestDecision want =
              smcgraph::reference::decide_request(flags, all_finished, any_live, generated, max_new_tokens);
          CAPTURE(flags);
          CAPTURE(all_finished);
          CAPTURE(any_live);
          CAPTURE(generated);
          CAPTURE(max_new_tokens);
          REQUIRE(got.finished() == want.finished);
          REQUIRE(got.failed() == want.failed);
          REQUIRE(got.reason == want.reason);
          ++compared;
        }
      }
    }
  }
  CHECK(compared == 128 * 4 * 5 * 5);
}

TEST_CASE("the cycle-state table is consistent: unique names, members and views; compaction per request") {
  using smcgraph::detail::Extent;
  const std::string problems = smcgraph::detail::cycle_state_problems();
  CHECK_MESSAGE(problems.empty(), problems);
  const auto table = smcgraph::detail::describe_cycle_state();
  REQUIRE(table.size() >= 40);
  smcgraph::detail::StateDims dims;
  dims.rows = 12;
  dims.requests = 3;
  dims.particles = 4;
  dims.draft_steps = 5;
  dims.max_seq_len = 64;
  dims.pool = 100;
  int views = 0, compacted = 0;
  for (const auto& row : table) {
    CAPTURE(row.name);
    CHECK(row.element_bytes >= 1);
    CHECK(row.element_bytes <= 8);
    views += row.has_view;
    compacted += row.compacted;
    if (row.compacted)
      CHECK(smcgraph::detail::elements_per_request(row.extent, dims) > 0);
  }
  // CycleBuffers' 49 buffer pointers are each wired by one row; compact() moves the 20 per-request buffers
  // (the draft length's four among them: request_draft_steps, pinned_draft_steps, acceptance_ema,
  // cycle_draft_steps).
  CHECK(views == 49);
  CHECK(compacted == 20);
  CHECK(smcgraph::detail::extent_count(Extent::kRowsByDraftSteps, dims) == 12 * 4);
  dims.draft_steps = 1; // one draft step: the step buffers keep one row each
  CHECK(smcgraph::detail::extent_count(Extent::kRowsByDraftSteps, dims) == 12);
  CHECK(smcgraph::detail::extent_count(Extent::kPoolWords, dims) == 4);
  CHECK(smcgraph::detail::elements_per_request(Extent::kRowsBySeq, dims) == 4 * 64);
}

TEST_CASE("StateBufferCopy::as reads the elements back and rejects a type of another size") {
  smcgraph::StateBufferCopy copy;
  copy.name = "seq_len";
  copy.element_bytes = sizeof(int32_t);
  const std::vector<int32_t> values = {3, -1, 70000};
  copy.bytes.resize(values.size() * sizeof(int32_t));
  std::memcpy(copy.bytes.data(), values.data(), copy.bytes.size());
  CHECK(copy.size() == 3);
  CHECK(copy.as<int32_t>() == values);
  CHECK(copy.as<uint32_t>().at(1) == 0xffffffffu); // same size: the bits as they are
  std::string message;
  try {
    (void)copy.as<double>();
  } catch (const smcgraph::Error& e) {
    message = e.what();
  }
  CHECK_MESSAGE(message.find("seq_len") != std::string::npos, message);
  CHECK_MESSAGE(message.find("element size") != std::string::npos, message);
}

TEST_CASE("adaptive draft length: bad fields and pins are errors naming them (and seed the engine fuzzer)") {
  auto speculative = [](smcgraph::EngineConfig& c) {
    c.kind = smcgraph::CycleKind::kSpeculative;
    c.particles = 1;
    c.draft_steps = 8;
    c.adaptive.enabled = true;
  };
  CHECK(error_of(speculative) == "no error");
  CHECK(contains(error_of([&](smcgraph::EngineConfig& c) {
                   speculative(c);
                   c.adaptive.mid_steps = 9;
                 }),
                 "adaptive.mid_steps = 9"));
  CHECK(contains(error_of([&](smcgraph::EngineConfig& c) {
                   speculative(c);
                   c.adaptive.low_threshold = 0.9f;
                 }),
                 "adaptive.high_threshold = 0.8"));
  CHECK(contains(error_of([&](smcgraph::EngineConfig& c) {
                   speculative(c);
                   c.adaptive.pressure_free_fraction = std::nanf("");
                 }),
                 "adaptive.pressure_free_fraction = nan"));
  CHECK(contains(error_of([](smcgraph::EngineConfig& c) { c.adaptive.enabled = true; }), "adaptive.enabled"));
  // Pins: seeded with a valid speculative config, checked by admit's validation.
  smcgraph::EngineConfig config;
  speculative(config);
  for (const int pin : {-1, 1, 8, 0, 9}) {
    const smcgraph::RequestParams params{.draft_steps = pin};
    seed(config, params);
    bool rejected = false;
    try {
      smcgraph::detail::validate_request(config, {1, 2, 3}, params);
    } catch (const smcgraph::Error& e) {
      rejected = true;
      CHECK(contains(e.what(), "params.draft_steps = " + std::to_string(pin)));
    }
    CHECK(rejected == (pin == 0 || pin == 9));
  }
}

TEST_CASE("environment switches: flags are exactly \"1\", integers in range, words from a list, or an error "
          "naming the variable") {
  const char* name = "SMCGRAPH_TEST_ENV_SWITCH";
  ::unsetenv(name);
  CHECK_FALSE(smcgraph::detail::env_flag(name));
  CHECK_FALSE(smcgraph::detail::env_integer(name, 0, 10, "must be 0-10").has_value());
  ::setenv(name, "", 1);
  CHECK_FALSE(smcgraph::detail::env_flag(name));
  CHECK_FALSE(smcgraph::detail::env_integer(name, 0, 10, "must be 0-10").has_value());
  ::setenv(name, "1", 1);
  CHECK(smcgraph::detail::env_flag(name));
  CHECK(smcgraph::detail::env_integer(name, 0, 10, "must be 0-10") == 1L);
  ::setenv(name, "10", 1);
  CHECK_FALSE(smcgraph::detail::env_flag(name)); // only "1" turns a switch on
  CHECK(smcgraph::detail::env_integer(name, 0, 10, "must be 0-10") == 10L);
  ::setenv(name, "0x1f", 1);
  CHECK(smcgraph::detail::env_integer(name, 0, 255, "must be a byte", 0) == 31L); // base 0: hex too
  for (const char* bad : {"11", "-1", "3x", "0x1f", "99999999999999999999999"}) {
    CAPTURE(bad);
    ::setenv(name, bad, 1);
    try {
      (void)smcgraph::detail::env_integer(name, 0, 10, "must be 0-10");
      FAIL("accepted");
    } catch (const smcgraph::Error& e) {
      CHECK(contains(e.what(), std::string(name) + " = \"" + bad + "\": must be 0-10"));
    }
  }
  // Word choices (LlamaModel's kernel-choice variables): unset or empty is the first, a listed word its own,
  // anything else an error naming the owner, the variable, the value and the words.
  enum class Pick { kFirst, kSecond };
  const auto pick = [&] {
    return smcgraph::detail::env_choice<Pick>("Owner", name,
                                              {{"first", Pick::kFirst}, {"second", Pick::kSecond}});
  };
  ::unsetenv(name);
  CHECK(pick() == Pick::kFirst);
  ::setenv(name, "", 1);
  CHECK(pick() == Pick::kFirst);
  ::setenv(name, "second", 1);
  CHECK(pick() == Pick::kSecond);
  ::setenv(name, "first", 1);
  CHECK(pick() == Pick::kFirst);
  ::setenv(name, "Second", 1);
  try {
    (void)pick();
    FAIL("accepted");
  } catch (const smcgraph::Error& e) {
    CHECK(contains(e.what(), "Owner: " + std::string(name) + " = 'Second' must be one of first, second"));
  }
  ::unsetenv(name);
}
