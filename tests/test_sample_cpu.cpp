// Launcher validation (runs before any CUDA call, so it needs no GPU) and host-reference self-checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "reference/sample_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/philox.hpp"
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

TEST_CASE("tiles of the two-level sampler: 4096 fp32, 8192 bf16 / fp16 logits, one CTA each") {
  CHECK(smcgraph::sample_tile_length(smcgraph::DType::kFloat32) == 4096);
  CHECK(smcgraph::sample_tile_length(smcgraph::DType::kBFloat16) == 8192);
  CHECK(smcgraph::sample_tile_length(smcgraph::DType::kFloat16) == 8192);
  CHECK(smcgraph::sample_splits(4096, smcgraph::DType::kFloat32) == 1);
  CHECK(smcgraph::sample_splits(4097, smcgraph::DType::kFloat32) == 2);
  CHECK(smcgraph::sample_splits(128256, smcgraph::DType::kBFloat16) == 16);
  std::vector<float> logits{0.f, 1.f};
  CHECK_THROWS_WITH_AS(smcgraph::reference::sample(logits.data(), 2, 0, 1.0f, 1.0f, 1, 0, 0, 0),
                       doctest::Contains("tile_length = 0"), smcgraph::Error);
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

namespace {

/// Draws `draws` tokens from the reference (draw counter d for draw d) and returns the chi-square fit of
/// their counts to softmax(alpha l / T).
smcgraph::test::ChiSquare reference_fit(const std::vector<float>& logits, int tile_length, float temperature,
                                        float alpha, uint64_t seed, int draws) {
  const int vocab = static_cast<int>(logits.size());
  std::vector<double> counts(vocab, 0.0), weights(vocab);
  for (int d = 0; d < draws; ++d) {
    const auto result = smcgraph::reference::sample(logits.data(), vocab, tile_length, temperature, alpha,
                                                    seed, static_cast<uint32_t>(d), 0, 7);
    REQUIRE(result.flags == 0);
    REQUIRE(result.token >= 0);
    REQUIRE(result.token < vocab);
    REQUIRE(result.tile == result.token / tile_length);
    counts[result.token] += 1.0;
  }
  const double max_l = *std::max_element(logits.begin(), logits.end());
  for (int v = 0; v < vocab; ++v)
    weights[v] = std::exp(alpha * (logits[v] - max_l) / temperature);
  return smcgraph::test::chi_square_fit(counts, weights);
}

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

} // namespace

TEST_CASE("reference sampler: Gumbel-max over Philox draws follows softmax(alpha l / T)") {
  smcgraph::test::Rng rng;
  INFO("seed " << rng.seed());
  const int vocab = 6;
  std::vector<float> logits(vocab);
  for (float& l : logits)
    l = static_cast<float>(rng.normal(0.0, 1.0));
  logits[2] = kNegativeInfinity; // masked: never sampled (a draw of it fails the fit)
  const auto fit = reference_fit(logits, vocab, 0.8f, 1.5f, rng.bits(), 200000); // one tile
  INFO("chi2 " << fit.statistic << " bins " << fit.bins);
  CHECK(fit.bins == vocab - 1);
  CHECK(fit.p_value > 1e-4);
}

TEST_CASE("reference sampler: the two-level race follows softmax(alpha l / T) whatever the tiles hold") {
  smcgraph::test::Rng rng;
  INFO("seed " << rng.seed());
  const int vocab = 30, tile_length = 4; // 8 tiles, the last one of 2 logits
  enum class Layout { kOneTile, kAllTiles, kMostTilesMasked };
  for (Layout layout : {Layout::kOneTile, Layout::kAllTiles, Layout::kMostTilesMasked}) {
    std::vector<float> logits(vocab);
    for (int v = 0; v < vocab; ++v) {
      const int tile = v / tile_length;
      const double normal = rng.normal(0.0, 1.0);
      switch (layout) {
      case Layout::kOneTile: // tile 3 holds ~99% of the mass
        logits[v] = static_cast<float>(tile == 3 ? normal : normal - 6.0);
        break;
      case Layout::kAllTiles: // every tile a different share
        logits[v] = static_cast<float>(normal + 0.25 * tile);
        break;
      case Layout::kMostTilesMasked: // tiles 1 and 7 only; one logit of tile 5
        logits[v] = tile == 1 || tile == 7 ? static_cast<float>(normal) : kNegativeInfinity;
        break;
      }
    }
    if (layout == Layout::kMostTilesMasked)
      logits[5 * tile_length + 2] = 0.5f;
    for (const auto& [temperature, alpha] : {std::pair{1.0f, 1.0f}, std::pair{0.7f, 2.0f}}) {
      const auto fit = reference_fit(logits, tile_length, temperature, alpha, rng.bits(), 100000);
      INFO("layout " << static_cast<int>(layout) << " T " << temperature << " alpha " << alpha << " chi2 "
                     << fit.statistic << " bins " << fit.bins);
      CHECK(fit.bins > 2);
      CHECK(fit.p_value > 1e-4);
    }
  }
}

TEST_CASE("reference sampler: the tile draw is element kTileDrawElement + t, the token draw element v") {
  smcgraph::test::Rng rng;
  INFO("seed " << rng.seed());
  const int tile_length = 5, tiles = 7, vocab = tile_length * tiles;
  const uint32_t stream_word = smcgraph::philox_stream(smcgraph::Salt::kBonus, 3);
  const auto uniform = [&](uint64_t seed, uint64_t element, uint32_t counter, uint32_t particle) {
    return smcgraph::uniform_open01(smcgraph::philox_word(seed, element, counter, particle, stream_word));
  };
  for (int trial = 0; trial < 2000; ++trial) {
    const uint64_t seed = rng.bits();
    const uint32_t counter = static_cast<uint32_t>(rng.bits()), particle = static_cast<uint32_t>(trial % 4);
    // Equal tiles (one finite logit each, at a different offset): Z_t is the same for every tile, so the
    // tile with the largest tile uniform wins, whatever the logits.
    std::vector<float> logits(vocab, kNegativeInfinity);
    std::vector<int> offset(tiles);
    for (int t = 0; t < tiles; ++t) {
      offset[t] = static_cast<int>(rng.integer(0, tile_length - 1));
      logits[t * tile_length + offset[t]] = 1.25f;
    }
    int best_tile = 0;
    for (int t = 1; t < tiles; ++t)
      if (uniform(seed, smcgraph::kTileDrawElement + t, counter, particle) >
          uniform(seed, smcgraph::kTileDrawElement + best_tile, counter, particle))
        best_tile = t;
    auto result = smcgraph::reference::sample(logits.data(), vocab, tile_length, 0.9f, 1.0f, seed, counter,
                                              particle, stream_word);
    if (!result.near_tie()) {
      CHECK(result.tile == best_tile);
      CHECK(result.token == best_tile * tile_length + offset[best_tile]);
    }
    // One finite tile of equal logits: the element with the largest uniform of its own vocab id wins.
    const int tile = static_cast<int>(rng.integer(0, tiles - 1));
    std::fill(logits.begin(), logits.end(), kNegativeInfinity);
    int best_token = tile * tile_length;
    for (int v = tile * tile_length; v < (tile + 1) * tile_length; ++v) {
      logits[v] = -0.5f;
      if (uniform(seed, v, counter, particle) > uniform(seed, best_token, counter, particle))
        best_token = v;
    }
    result = smcgraph::reference::sample(logits.data(), vocab, tile_length, 1.3f, 2.0f, seed, counter,
                                         particle, stream_word);
    CHECK(result.tile == tile);
    if (!result.near_tie())
      CHECK(result.token == best_token);
  }
}

TEST_CASE("reference sampler: flags and sentinels") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> with_nan{0.f, nan, 1.f};
  auto r = smcgraph::reference::sample(with_nan.data(), 3, 2, 1.0f, 1.0f, 1, 0, 0, 0);
  CHECK(r.flags == smcgraph::kFlagNanLogit);
  CHECK(r.token == smcgraph::kInvalidToken);
  std::vector<float> masked{-inf, -inf};
  CHECK(smcgraph::reference::sample(masked.data(), 2, 1, 1.0f, 1.0f, 1, 0, 0, 0).flags ==
        smcgraph::kFlagAllMasked);
  std::vector<float> fine{0.f, 1.f};
  CHECK(smcgraph::reference::sample(fine.data(), 2, 1, -1.0f, 1.0f, 1, 0, 0, 0).flags ==
        smcgraph::kFlagBadParameter);
  CHECK(smcgraph::reference::sample(fine.data(), 2, 1, 1.0f, 0.0f, 1, 0, 0, 0).flags ==
        smcgraph::kFlagBadParameter);
  std::vector<float> ties{3.f, 5.f, 5.f, 1.f};
  CHECK(smcgraph::reference::sample(ties.data(), 4, 2, 0.0f, 1.0f, 1, 0, 0, 0).token == 1);
}
