// Launcher validation (runs before any CUDA call, so it needs no GPU) and host-reference self-checks.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "reference/sample_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/sample.hpp"
#include "support/test_util.hpp"

namespace {

// Fake device pointers: validation must reject bad arguments before touching them.
const void* const kLogits = reinterpret_cast<const void*>(0x1000);
float* const kFloats = reinterpret_cast<float*>(0x2000);
int32_t* const kInts = reinterpret_cast<int32_t*>(0x3000);
uint32_t* const kWords = reinterpret_cast<uint32_t*>(0x4000);
const uint64_t* const kSeeds = reinterpret_cast<const uint64_t*>(0x5000);

struct Call {
  smcgraph::LogitsView logits{kLogits, smcgraph::DType::kBFloat16, 4, 1, 1000, 1000, 1000};
  smcgraph::RowParams params{kFloats, kFloats};
  smcgraph::RowRandom random{kSeeds, kWords, 1};
  smcgraph::SampleOutputs out{kInts, kFloats, kFloats, kWords, kWords};
  void run() {
    smcgraph::SampleWorkspace workspace;
    smcgraph::sample(logits, params, random, 0u, out, workspace, nullptr);
  }
};

std::string error_of(Call call) {
  try {
    call.run();
  } catch (const smcgraph::Error& e) {
    return e.what();
  }
  return "no error";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

} // namespace

TEST_CASE("sample() names the bad parameter and its value") {
  {
    Call call;
    call.logits.data = nullptr;
    CHECK(contains(error_of(call), "smcgraph::sample: logits.data = null"));
  }
  {
    Call call;
    call.logits.rows = 0;
    CHECK(contains(error_of(call), "logits.rows = 0: must be >= 1"));
  }
  {
    Call call;
    call.logits.vocab = -3;
    CHECK(contains(error_of(call), "logits.vocab = -3"));
  }
  {
    Call call;
    call.logits.positions = 2;
    CHECK(contains(error_of(call), "logits.positions = 2: must be 1 (use score())"));
  }
  {
    Call call;
    call.logits.row_stride = 999;
    CHECK(contains(error_of(call), "logits.row_stride = 999"));
  }
  {
    Call call;
    call.logits.dtype = static_cast<smcgraph::DType>(7);
    CHECK(contains(error_of(call), "logits.dtype = 7"));
  }
  {
    Call call;
    call.params.temperature = nullptr;
    CHECK(contains(error_of(call), "params.temperature = null"));
  }
  {
    Call call;
    call.random.seeds = nullptr;
    CHECK(contains(error_of(call), "random.seeds = null"));
  }
  {
    Call call;
    call.random.particles_per_request = 0;
    CHECK(contains(error_of(call), "random.particles_per_request = 0"));
  }
  {
    Call call;
    call.out.tokens = nullptr;
    CHECK(contains(error_of(call), "out.tokens = null"));
  }
  {
    Call call; // a default workspace has room for no job
    CHECK(contains(error_of(call), "rows * positions = 4: exceeds the workspace"));
  }
}

TEST_CASE("score() validates its token inputs") {
  smcgraph::LogitsView logits{kLogits, smcgraph::DType::kFloat32, 2, 5, 100, 500, 100};
  smcgraph::ScoreOutputs out{kFloats, kInts, kFloats, kFloats, kWords, kWords};
  smcgraph::SampleWorkspace workspace;
  const smcgraph::RowParams params{kFloats, nullptr};
  const smcgraph::RowRandom random{kSeeds, kWords, 1};
  CHECK_THROWS_WITH_AS(smcgraph::score(logits, nullptr, 4, params, random, 0u, out, workspace, nullptr),
                       doctest::Contains("tokens = null"), smcgraph::Error);
  CHECK_THROWS_WITH_AS(smcgraph::score(logits, kInts, 3, params, random, 0u, out, workspace, nullptr),
                       doctest::Contains("token_row_stride = 3: must be >= positions - 1"), smcgraph::Error);
  logits.position_stride = 99;
  CHECK_THROWS_WITH_AS(smcgraph::score(logits, kInts, 4, params, random, 0u, out, workspace, nullptr),
                       doctest::Contains("logits.position_stride = 99"), smcgraph::Error);
}

TEST_CASE("advance_draw_counters and philox_words validate") {
  CHECK_THROWS_WITH_AS(smcgraph::advance_draw_counters(nullptr, -1, nullptr), doctest::Contains("count = -1"),
                       smcgraph::Error);
  CHECK_THROWS_WITH_AS(smcgraph::advance_draw_counters(nullptr, 3, nullptr),
                       doctest::Contains("draw_counters = null"), smcgraph::Error);
  CHECK_THROWS_WITH_AS(smcgraph::philox_words(1, 0, 0, 0, nullptr, 4, nullptr),
                       doctest::Contains("out = null"), smcgraph::Error);
}

TEST_CASE("reference sampler: Gumbel-max over Philox draws follows softmax(alpha l / T)") {
  smcgraph::test::Rng rng;
  INFO("seed " << rng.seed());
  const int vocab = 6;
  std::vector<float> logits(vocab);
  for (float& l : logits)
    l = static_cast<float>(rng.normal(0.0, 1.0));
  logits[2] = -std::numeric_limits<float>::infinity(); // masked: never sampled
  const float temperature = 0.8f, alpha = 1.5f;
  const int draws = 200000;
  std::vector<double> counts(vocab, 0.0);
  const uint64_t seed = rng.bits();
  for (int d = 0; d < draws; ++d) {
    const auto result = smcgraph::reference::sample(logits.data(), vocab, temperature, alpha, seed,
                                                    static_cast<uint32_t>(d), 0, 7);
    REQUIRE(result.flags == 0);
    counts[result.token] += 1.0;
  }
  CHECK(counts[2] == 0.0);
  double norm = 0.0;
  std::vector<double> p(vocab);
  for (int v = 0; v < vocab; ++v)
    norm += p[v] = std::exp(alpha * logits[v] / temperature);
  double chi2 = 0.0;
  for (int v = 0; v < vocab; ++v) {
    if (v == 2)
      continue;
    const double expected = draws * p[v] / norm;
    chi2 += (counts[v] - expected) * (counts[v] - expected) / expected;
  }
  CHECK(smcgraph::test::chi_square_p_value(chi2, vocab - 2) > 1e-4);
}

TEST_CASE("reference sampler: flags and sentinels") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> with_nan{0.f, nan, 1.f};
  auto r = smcgraph::reference::sample(with_nan.data(), 3, 1.0f, 1.0f, 1, 0, 0, 0);
  CHECK(r.flags == smcgraph::kFlagNanLogit);
  CHECK(r.token == smcgraph::kInvalidToken);
  std::vector<float> masked{-inf, -inf};
  CHECK(smcgraph::reference::sample(masked.data(), 2, 1.0f, 1.0f, 1, 0, 0, 0).flags ==
        smcgraph::kFlagAllMasked);
  std::vector<float> fine{0.f, 1.f};
  CHECK(smcgraph::reference::sample(fine.data(), 2, -1.0f, 1.0f, 1, 0, 0, 0).flags ==
        smcgraph::kFlagBadParameter);
  CHECK(smcgraph::reference::sample(fine.data(), 2, 1.0f, 0.0f, 1, 0, 0, 0).flags ==
        smcgraph::kFlagBadParameter);
  std::vector<float> ties{3.f, 5.f, 5.f, 1.f};
  CHECK(smcgraph::reference::sample(ties.data(), 4, 0.0f, 1.0f, 1, 0, 0, 0).token == 1);
}
