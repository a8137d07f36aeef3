// Launcher validation (runs before any CUDA call, so it needs no GPU) and host-reference self-checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "kernels/order_key.hpp"
#include "kernels/walk_plan.hpp"
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
  // The int overload is the device's layout: other tile lengths need an explicit TileLayout.
  CHECK_THROWS_WITH_AS(smcgraph::reference::sample(logits.data(), 2, 100, 1.0f, 1.0f, 1, 0, 0, 0),
                       doctest::Contains("tile_length = 100: must be sample_tile_length() of a dtype"),
                       smcgraph::Error);
  const smcgraph::reference::TileLayout ragged{10, 2, 4, 2}; // 10 is not a multiple of 2 * 4
  CHECK_THROWS_WITH_AS(smcgraph::reference::sample(logits.data(), 2, ragged, 1.0f, 1.0f, 1, 0, 0, 0),
                       doctest::Contains("must be a multiple of vector_length * threads"), smcgraph::Error);
  const smcgraph::reference::TileLayout odd_lanes{16, 1, 4, 3};
  CHECK_THROWS_WITH_AS(smcgraph::reference::sample(logits.data(), 2, odd_lanes, 1.0f, 1.0f, 1, 0, 0, 0),
                       doctest::Contains("lanes = 3"), smcgraph::Error);
}

TEST_CASE("sub-tiles: sub-tile w of a tile is what warp w of its CTA folds (512 fp32, 1024 bf16 / fp16)") {
  using smcgraph::DType;
  CHECK(smcgraph::kSampleSubTilesPerTile == 8);
  CHECK(smcgraph::sample_subtile_length(DType::kFloat32) == 512);
  CHECK(smcgraph::sample_subtile_length(DType::kBFloat16) == 1024);
  CHECK(smcgraph::sample_subtile_length(DType::kFloat16) == 1024);
  CHECK_THROWS_WITH_AS(smcgraph::sample_subtile(-1, DType::kFloat32), doctest::Contains("vocab_id = -1"),
                       smcgraph::Error);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    CAPTURE(smcgraph::dtype_name(dtype));
    const int tile = smcgraph::sample_tile_length(dtype), vector = 16 / smcgraph::dtype_bytes(dtype);
    const auto layout = smcgraph::reference::TileLayout::device(dtype);
    CHECK(layout.tile_length == tile);
    CHECK(layout.sub_tiles_per_tile() == smcgraph::kSampleSubTilesPerTile);
    // The pass's fold (logits_pass.cuh, for_each_vector): thread t of a tile's CTA loads vectors t, t + 256,
    // ... of the tile; warp t / 32 merges what its lanes folded. Every vocab id of three tiles, once.
    std::vector<int> expected(3 * tile, -1), members(3 * smcgraph::kSampleSubTilesPerTile, 0);
    for (int t = 0; t < 3; ++t)
      for (int thread = 0; thread < 256; ++thread)
        for (int q = thread; q < tile / vector; q += 256)
          for (int i = 0; i < vector; ++i) {
            const int v = t * tile + q * vector + i;
            REQUIRE(expected[v] == -1);
            expected[v] = t * smcgraph::kSampleSubTilesPerTile + thread / 32;
          }
    int wrong = 0;
    for (int v = 0; v < 3 * tile; ++v) {
      wrong += smcgraph::sample_subtile(v, dtype) != expected[v] || layout.sub_tile(v) != expected[v];
      ++members[expected[v]];
    }
    CHECK(wrong == 0);
    for (int count : members)
      CHECK(count == smcgraph::sample_subtile_length(dtype));
    // Spot checks of the formula in sample.hpp.
    CHECK(smcgraph::sample_subtile(0, dtype) == 0);
    CHECK(smcgraph::sample_subtile(32 * vector - 1, dtype) == 0);
    CHECK(smcgraph::sample_subtile(32 * vector, dtype) == 1);
    CHECK(smcgraph::sample_subtile(256 * vector, dtype) == 0); // thread 0's second vector
    CHECK(smcgraph::sample_subtile(tile - 1, dtype) == 7);
    CHECK(smcgraph::sample_subtile(tile, dtype) == 8);
    CHECK(smcgraph::sample_subtile(15 * tile + 255 * vector, dtype) == 15 * 8 + 7);
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

namespace {

/// Draws `draws` tokens from the reference (draw counter d for draw d) and returns the chi-square fit of
/// their counts to softmax(alpha l / T).
smcgraph::test::ChiSquare reference_fit(const std::vector<float>& logits,
                                        const smcgraph::reference::TileLayout& layout, float temperature,
                                        float alpha, uint64_t seed, int draws) {
  const int vocab = static_cast<int>(logits.size());
  std::vector<double> counts(vocab, 0.0), weights(vocab);
  for (int d = 0; d < draws; ++d) {
    const auto result = smcgraph::reference::sample(logits.data(), vocab, layout, temperature, alpha, seed,
                                                    static_cast<uint32_t>(d), 0, 7);
    REQUIRE(result.flags == 0);
    REQUIRE(result.token >= 0);
    REQUIRE(result.token < vocab);
    REQUIRE(result.tile == result.token / layout.tile_length);
    REQUIRE(result.sub_tile == layout.sub_tile(result.token));
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
  const smcgraph::reference::TileLayout one_sub_tile{vocab, 1, 1, 1};
  const auto fit = smcgraph::test::confirmed_fit<smcgraph::test::ChiSquare>(
      [&] { return reference_fit(logits, one_sub_tile, 0.8f, 1.5f, rng.bits(), 200000); });
  INFO("chi2 " << fit.statistic << " bins " << fit.bins);
  CHECK(fit.bins == vocab - 1);
  CHECK(fit.p_value > 1e-4);
}

TEST_CASE("reference sampler: the two-level race follows softmax(alpha l / T) whatever the sub-tiles hold") {
  smcgraph::test::Rng rng;
  INFO("seed " << rng.seed());
  const int vocab = 30;
  // Small layouts shaped like the device's: tiles of 8 (4 threads of 2 lanes, elements t and t + 4: 2
  // sub-tiles {0, 1, 4, 5} and {2, 3, 6, 7}; 8 sub-tiles, the last tile's partial) and tiles of 16 read as
  // vectors of 2 (sub-tiles {0-3, 8-11} and {4-7, 12-15}; 4 sub-tiles).
  using smcgraph::reference::TileLayout;
  for (const TileLayout& layout : {TileLayout{8, 1, 4, 2}, TileLayout{16, 2, 4, 2}}) {
    const int sub_tiles = (vocab + layout.tile_length - 1) / layout.tile_length * layout.sub_tiles_per_tile();
    enum class Layout { kOneSubTile, kAllSubTiles, kMostSubTilesMasked };
    for (Layout mass : {Layout::kOneSubTile, Layout::kAllSubTiles, Layout::kMostSubTilesMasked}) {
      std::vector<float> logits(vocab);
      int lone = -1; // kMostSubTilesMasked: the one finite logit of a third sub-tile
      for (int v = 0; v < vocab; ++v) {
        const int s = layout.sub_tile(v);
        const double normal = rng.normal(0.0, 1.0);
        switch (mass) {
        case Layout::kOneSubTile: // sub-tile 2 holds ~99% of the mass
          logits[v] = static_cast<float>(s == 2 ? normal : normal - 6.0);
          break;
        case Layout::kAllSubTiles: // every sub-tile a different share
          logits[v] = static_cast<float>(normal + 0.25 * s);
          break;
        case Layout::kMostSubTilesMasked: // the first and the last sub-tile only, and one logit of sub-tile 2
          logits[v] = s == 0 || s == sub_tiles - 1 ? static_cast<float>(normal) : kNegativeInfinity;
          if (s == 2 && lone < 0)
            lone = v;
          break;
        }
      }
      if (mass == Layout::kMostSubTilesMasked)
        logits[lone] = 0.5f;
      for (const auto& [temperature, alpha] : {std::pair{1.0f, 1.0f}, std::pair{0.7f, 2.0f}}) {
        const auto fit = smcgraph::test::confirmed_fit<smcgraph::test::ChiSquare>(
            [&] { return reference_fit(logits, layout, temperature, alpha, rng.bits(), 100000); });
        INFO("tile " << layout.tile_length << " mass " << static_cast<int>(mass) << " T " << temperature
                     << " alpha " << alpha << " chi2 " << fit.statistic << " bins " << fit.bins);
        CHECK(fit.bins > 2);
        CHECK(fit.p_value > 1e-4);
      }
    }
  }
}

TEST_CASE("reference sampler: the sub-tile draw is element kTileDrawElement + s, the token draw element "
          "kRankDrawElement + its rank in the sub-tile") {
  smcgraph::test::Rng rng;
  INFO("seed " << rng.seed());
  // Tiles of 12 as 6 vectors of 2, 2 threads of one lane: sub-tiles {0, 1, 4, 5, 8, 9} and
  // {2, 3, 6, 7, 10, 11} of each tile; 4 tiles, 8 sub-tiles.
  const smcgraph::reference::TileLayout layout{12, 2, 2, 1};
  const int vocab = 4 * layout.tile_length, sub_tiles = 8;
  std::vector<std::vector<int>> members(sub_tiles);
  for (int v = 0; v < vocab; ++v)
    members[layout.sub_tile(v)].push_back(v);
  for (const auto& m : members)
    REQUIRE(m.size() == 6);
  CHECK(members[1] == std::vector<int>{2, 3, 6, 7, 10, 11});
  const uint32_t stream_word = smcgraph::philox_stream(smcgraph::Salt::kBonus, 3);
  const auto uniform = [&](uint64_t seed, uint64_t element, uint32_t counter, uint32_t particle) {
    return smcgraph::uniform_open01(smcgraph::philox_word(seed, element, counter, particle, stream_word));
  };
  for (int trial = 0; trial < 2000; ++trial) {
    const uint64_t seed = rng.bits();
    const uint32_t counter = static_cast<uint32_t>(rng.bits()), particle = static_cast<uint32_t>(trial % 4);
    // Equal sub-tiles (one finite logit each, at a random member): Z_s is the same for every sub-tile, so the
    // sub-tile with the largest sub-tile uniform wins, whatever the logits.
    std::vector<float> logits(vocab, kNegativeInfinity);
    std::vector<int> chosen(sub_tiles);
    for (int s = 0; s < sub_tiles; ++s) {
      chosen[s] = members[s][rng.integer(0, 5)];
      logits[chosen[s]] = 1.25f;
    }
    int best_sub_tile = 0;
    for (int s = 1; s < sub_tiles; ++s)
      if (uniform(seed, smcgraph::kTileDrawElement + s, counter, particle) >
          uniform(seed, smcgraph::kTileDrawElement + best_sub_tile, counter, particle))
        best_sub_tile = s;
    auto result = smcgraph::reference::sample(logits.data(), vocab, layout, 0.9f, 1.0f, seed, counter,
                                              particle, stream_word);
    if (!result.near_tie()) {
      CHECK(result.sub_tile == best_sub_tile);
      CHECK(result.tile == best_sub_tile / 2);
      CHECK(result.token == chosen[best_sub_tile]);
    }
    // One finite sub-tile of equal logits: the member with the largest uniform of its rank in the sub-tile
    // (its index in members[s], which ascends) wins.
    const int s = static_cast<int>(rng.integer(0, sub_tiles - 1));
    std::fill(logits.begin(), logits.end(), kNegativeInfinity);
    size_t best_rank = 0;
    for (size_t j = 0; j < members[s].size(); ++j) {
      logits[members[s][j]] = -0.5f;
      if (uniform(seed, smcgraph::kRankDrawElement + j, counter, particle) >
          uniform(seed, smcgraph::kRankDrawElement + best_rank, counter, particle))
        best_rank = j;
    }
    const int best_token = members[s][best_rank];
    result = smcgraph::reference::sample(logits.data(), vocab, layout, 1.3f, 2.0f, seed, counter, particle,
                                         stream_word);
    CHECK(result.sub_tile == s);
    if (!result.near_tie())
      CHECK(result.token == best_token);
  }
}

TEST_CASE("reference sampler: flags and sentinels") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const smcgraph::reference::TileLayout pairs{2, 1, 2, 1}; // tiles of 2, a sub-tile per logit
  const int device_tile = smcgraph::sample_tile_length(smcgraph::DType::kFloat32);
  std::vector<float> with_nan{0.f, nan, 1.f};
  auto r = smcgraph::reference::sample(with_nan.data(), 3, pairs, 1.0f, 1.0f, 1, 0, 0, 0);
  CHECK(r.flags == smcgraph::kFlagNanLogit);
  CHECK(r.token == smcgraph::kInvalidToken);
  std::vector<float> masked{-inf, -inf};
  CHECK(smcgraph::reference::sample(masked.data(), 2, device_tile, 1.0f, 1.0f, 1, 0, 0, 0).flags ==
        smcgraph::kFlagAllMasked);
  std::vector<float> fine{0.f, 1.f};
  CHECK(smcgraph::reference::sample(fine.data(), 2, pairs, -1.0f, 1.0f, 1, 0, 0, 0).flags ==
        smcgraph::kFlagBadParameter);
  CHECK(smcgraph::reference::sample(fine.data(), 2, device_tile, 1.0f, 0.0f, 1, 0, 0, 0).flags ==
        smcgraph::kFlagBadParameter);
  std::vector<float> ties{3.f, 5.f, 5.f, 1.f};
  CHECK(smcgraph::reference::sample(ties.data(), 4, pairs, 0.0f, 1.0f, 1, 0, 0, 0).token == 1);
  // One finite logit: it is drawn, from its sub-tile (1 of the pairs layout).
  std::vector<float> lone{-inf, -inf, -inf, 2.5f};
  r = smcgraph::reference::sample(lone.data(), 4, pairs, 0.6f, 1.0f, 9, 1, 0, 0);
  CHECK(r.token == 3);
  CHECK(r.sub_tile == 3);
  CHECK(r.tile == 1);
}

// ---------------------------------------------------------------------------------------------------------
// Walk mode's rule (kernels/walk_plan.hpp), on the host: an H200's 132 SMs, the pass's instance constants.

namespace {

smcgraph::detail::WalkPlanContext h200_walk_context(int min_jobs = 0, int max_walkers = 0,
                                                    int short_walk_tiles = 0) {
  smcgraph::detail::WalkPlanContext context;
  context.sms = 132;
  context.register_blocks = 2;
  context.staged_blocks = 4;
  context.max_subtiles = 512;
  context.subtiles_per_tile = 8;
  context.min_wave_fill = 0.95;
  context.short_walk_tiles = short_walk_tiles; // kShortWalkTiles: off
  context.min_jobs_setting = min_jobs;
  context.max_walkers_setting = max_walkers;
  return context;
}

/// A launch shape and the plan the rule must give it.
struct ExpectedPlan {
  int64_t jobs;
  int splits;
  bool walk;
  int walkers, tiles;
};

void check_plans(std::initializer_list<ExpectedPlan> cases,
                 const smcgraph::detail::WalkPlanContext& context) {
  for (const ExpectedPlan& e : cases) {
    CAPTURE(e.jobs);
    CAPTURE(e.splits);
    const auto plan = smcgraph::detail::plan_walk(e.jobs, e.splits, context);
    CHECK(plan.walk == e.walk);
    CHECK(plan.walkers == e.walkers);
    CHECK(plan.tiles == e.tiles);
  }
}

} // namespace

TEST_CASE("walk plan: the register walk, the staged walk and tickets at the shapes they were measured at") {
  // 16 tiles: 128256 bf16; 6: 49152 bf16; 32: 128256 fp32.
  check_plans(
      {
          {256, 16, true, 1, 16},  // the register walk: 256 CTAs of 264 slots
          {264, 16, true, 1, 16},  // a full wave
          {512, 16, true, 1, 16},  // two waves at 97%
          {2560, 16, true, 1, 16}, // the toy SMC score at 64 requests: ten waves at 97%
          {265, 16, false, 1, 16}, // two waves at 50%, and one walker a job is not the staged walk
          {128, 16, true, 4, 4},   // the staged walk: 512 CTAs of 528 slots
          {64, 16, true, 8, 2},    // eight walkers of two tiles
          {64, 32, true, 8, 4},    // fp32: eight walkers of four tiles
          {96, 16, false, 4, 4},   // 384 CTAs: 73% of a wave
          {192, 16, false, 2, 8},  // 384 CTAs
          {8, 16, false, 8, 2},    // 64 CTAs
          {64, 6, false, 3, 2},    // SmolLM2's vocabulary at 8 requests: 192 CTAs
          {256, 6, true, 1, 6},    // the register walk
          {1, 1, false, 1, 0},     // one tile: nothing to walk
          {4, 65, false, 1, 0},    // past 512 sub-tiles
      },
      h200_walk_context());
}

TEST_CASE("walk plan: short walks (SMCGRAPH_SAMPLER_SHORT_WALK_TILES) need few tiles and a CTA an SM") {
  using smcgraph::detail::plan_walk;
  check_plans(
      {
          {96, 16, true, 4, 4},   // 384 CTAs (73% of a wave), four tiles a walker
          {80, 16, true, 6, 3},   // 480 CTAs (91%), three tiles a walker
          {24, 16, true, 8, 2},   // 192 CTAs
          {16, 16, false, 8, 2},  // 128 CTAs: fewer than one an SM
          {16, 32, true, 16, 2},  // fp32: 256 CTAs of two tiles
          {80, 32, false, 6, 6},  // fp32: six tiles a walker is not short, 480 CTAs do not fill
          {160, 16, false, 3, 6}, // 480 CTAs of six tiles
          {192, 16, false, 2, 8}, // 384 CTAs of eight tiles
          {8, 16, false, 8, 2},   // 64 CTAs
          {64, 6, true, 3, 2},    // SmolLM2's vocabulary at 8 requests: 192 CTAs of two tiles
          {48, 6, true, 3, 2},    // 144 CTAs
          {40, 6, false, 3, 2},   // 120 CTAs
          {256, 16, true, 1, 16}, // the register walk still comes first
          {128, 16, true, 4, 4},  // and the filling staged walk
      },
      h200_walk_context(0, 0, 4));
  // A setting of 2 tiles takes the two-tile walks only.
  CHECK(plan_walk(24, 16, h200_walk_context(0, 0, 2)).walk);
  CHECK_FALSE(plan_walk(80, 16, h200_walk_context(0, 0, 2)).walk);
}

TEST_CASE("walk plan: the settings force a walk and cap its walkers") {
  using smcgraph::detail::plan_walk;
  // Forced from one job: the staged walk's walkers, one walker the register walk.
  auto plan = plan_walk(12, 16, h200_walk_context(1));
  CHECK(plan.walk);
  CHECK(plan.staged());
  CHECK(plan.walkers == 8);
  CHECK(plan.tiles == 2);
  plan = plan_walk(12, 16, h200_walk_context(1, 1));
  CHECK(plan.walk);
  CHECK_FALSE(plan.staged());
  CHECK(plan.tiles == 16);
  plan = plan_walk(12, 16, h200_walk_context(1, 3)); // three walkers of 6, 6 and 4 tiles
  CHECK(plan.walkers == 3);
  CHECK(plan.tiles == 6);
  plan = plan_walk(4, 2, h200_walk_context(1)); // two tiles: one walker
  CHECK(plan.walk);
  CHECK(plan.walkers == 1);
  CHECK_FALSE(plan_walk(4, 16, h200_walk_context(5)).walk); // below the setting
  // The cap applies under the default rule too: 64 jobs with at most 2 walkers fill no wave, and walk 8
  // tiles each.
  CHECK_FALSE(plan_walk(64, 16, h200_walk_context(0, 2)).walk);
  CHECK(plan_walk(128, 16, h200_walk_context(0, 4)).walkers == 4);
}

TEST_CASE("walk plan: every plan covers the job's tiles with non-empty walkers, and a default walk fills") {
  using smcgraph::detail::plan_walk;
  for (const int sms : {1, 8, 78, 132}) {
    for (const int max_walkers : {0, 1, 3}) {
      for (const int min_jobs : {0, 1}) {
        for (const int short_tiles : {0, 4}) {
          auto context = h200_walk_context(min_jobs, max_walkers, short_tiles);
          context.sms = sms;
          for (int splits = 1; splits <= 70; ++splits) {
            for (int64_t jobs = 1; jobs <= 1200; jobs += (jobs < 300 ? 1 : 37)) {
              const auto plan = plan_walk(jobs, splits, context);
              if (!plan.walk)
                continue;
              CAPTURE(sms);
              CAPTURE(max_walkers);
              CAPTURE(short_tiles);
              CAPTURE(min_jobs);
              CAPTURE(splits);
              CAPTURE(jobs);
              REQUIRE(splits >= 2);
              REQUIRE(splits * 8 <= 512);
              REQUIRE(plan.walkers >= 1);
              REQUIRE(int64_t{plan.walkers} * plan.tiles >= splits);    // every tile has a walker
              REQUIRE(int64_t{plan.walkers - 1} * plan.tiles < splits); // and every walker a tile
              if (plan.staged()) {
                REQUIRE(plan.tiles >= 2);
                REQUIRE((max_walkers == 0 || plan.walkers <= max_walkers));
              }
              if (min_jobs == 0) { // the default rule walks launches that fill their waves, and short walks
                const int64_t slots = int64_t{sms} * (plan.staged() ? 4 : 2);
                const int64_t ctas = jobs * plan.walkers;
                const int64_t waves = (ctas + slots - 1) / slots;
                const bool fills = static_cast<double>(ctas) >= 0.95 * static_cast<double>(waves * slots);
                const bool short_walk = plan.staged() && plan.tiles <= short_tiles && ctas >= sms;
                REQUIRE((fills || short_walk));
              }
            }
          }
        }
      }
    }
  }
}

namespace {

/// max.NaN.f32 as NVIDIA GPUs compute it: a NaN operand gives the canonical NaN 0x7fffffff, -0 is below +0
/// (IEEE 754-2019 maximum), otherwise the larger operand.
float max_nan_reference(float a, float b) {
  if (a != a || b != b)
    return std::bit_cast<float>(0x7fffffff);
  if (a == b)
    return std::signbit(a) ? b : a; // equal values differ only in a zero's sign: +0 wins
  return a > b ? a : b;
}

/// Values that matter to order keys: signed zeros, infinities, the smallest subnormals and normals, the
/// extremes and +-1.
template <class T> std::vector<T> special_values() {
  using limits = std::numeric_limits<T>;
  return {T(0),
          -T(0),
          limits::infinity(),
          -limits::infinity(),
          limits::denorm_min(),
          -limits::denorm_min(),
          limits::min(),
          -limits::min(),
          limits::max(),
          -limits::max(),
          T(1),
          T(-1)};
}

/// special_values, NaNs of both signs and several payloads, and random bit patterns.
std::vector<float> key_test_floats(smcgraph::test::Rng& rng, int random_count) {
  std::vector<float> values = special_values<float>();
  for (uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffffffffu, 0x7fffffffu})
    values.push_back(std::bit_cast<float>(nan));
  for (int i = 0; i < random_count; ++i)
    values.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng.bits())));
  return values;
}

} // namespace

TEST_CASE("order keys: the larger of two float keys is max.NaN of the floats, bit for bit") {
  // The sampler's warp max and warp argmax reduce these keys with redux.sync (logits_pass.cuh): the max key
  // must map back to max.NaN's bits, and keys must order as the floats do.
  using smcgraph::detail::from_order_key;
  using smcgraph::detail::order_key;
  smcgraph::test::Rng rng;
  INFO("seed " << rng.seed());
  const std::vector<float> values = key_test_floats(rng, 3000);
  long pairs = 0;
  for (float a : values) {
    for (float b : values) {
      const float from_keys = from_order_key(std::max(order_key(a), order_key(b)));
      const uint32_t want = std::bit_cast<uint32_t>(max_nan_reference(a, b));
      if (std::bit_cast<uint32_t>(from_keys) != want) {
        INFO("a " << std::bit_cast<uint32_t>(a) << ", b " << std::bit_cast<uint32_t>(b));
        REQUIRE(std::bit_cast<uint32_t>(from_keys) == want);
      }
      if (a == a && b == b && a < b && !(order_key(a) < order_key(b))) {
        INFO("a " << a << ", b " << b);
        REQUIRE(order_key(a) < order_key(b));
      }
      ++pairs;
    }
    if (a == a) // a key maps back to its float's bits
      REQUIRE(std::bit_cast<uint32_t>(from_order_key(order_key(a))) == std::bit_cast<uint32_t>(a));
  }
  CHECK(pairs == static_cast<long>(values.size() * values.size()));
}

TEST_CASE("order keys: double keys order as the doubles do, and value + 0.0 makes the zeros tie") {
  // warp_best_subtile reduces the sub-tile race's double keys by their 64-bit order keys: equal keys must
  // mean equal doubles (better_subtile's ties go by index), larger keys larger doubles.
  using smcgraph::detail::order_key;
  smcgraph::test::Rng rng;
  INFO("seed " << rng.seed());
  std::vector<double> values = special_values<double>();
  for (int i = 0; i < 2000; ++i) {
    const double v = std::bit_cast<double>(rng.bits());
    if (v == v)
      values.push_back(v);
    values.push_back(rng.normal(0.0, 100.0)); // near-equal values, the keys of real races
  }
  for (double a : values)
    for (double b : values) {
      const int64_t ka = order_key(a + 0.0), kb = order_key(b + 0.0);
      if ((a < b) != (ka < kb) || (a == b) != (ka == kb)) {
        INFO("a " << a << ", b " << b);
        REQUIRE((a < b) == (ka < kb));
        REQUIRE((a == b) == (ka == kb));
      }
    }
  CHECK(order_key(std::bit_cast<double>(0x7ff8000000000000ull)) == INT64_MAX);
  CHECK(order_key(-0.0) < order_key(0.0));
  CHECK(order_key(-0.0 + 0.0) == order_key(0.0));
}

namespace {

/// 32 lanes' values through FixedPointSum: the integer totals fit, the join is within 2 ulp of the
/// quantized values' exact total, and that is within 32 half-units of 2^-2S of the values' own total.
template <int TERMS> void check_fixed_point_sums(smcgraph::test::Rng& rng) {
  using Sum = smcgraph::detail::FixedPointSum<TERMS>;
  const double unit = std::ldexp(1.0, -Sum::kShift), unit2 = unit * unit;
  for (int trial = 0; trial < 20000; ++trial) {
    float lanes[32];
    const int kind = trial % 4;
    for (float& v : lanes) {
      switch (kind) {
      case 0: // a sub-tile's sums: up to TERMS terms in [0, 1]
        v = static_cast<float>(rng.uniform(0.0, TERMS));
        break;
      case 1: // every term 1 (all logits at the max): the largest totals
        v = static_cast<float>(TERMS);
        break;
      case 2: // tiny sums beside one large one
        v = static_cast<float>(std::ldexp(rng.uniform(), -static_cast<int>(rng.integer(0, 60))));
        break;
      default: // few lanes hold anything (masked logits)
        v = rng.integer(0, 3) == 0 ? static_cast<float>(rng.uniform(0.0, TERMS)) : 0.0f;
      }
    }
    if (kind == 2)
      lanes[rng.integer(0, 31)] = 1.0f; // the sub-tile's max: its own term is 1
    int64_t high_total = 0, low_total = 0;
    double values_total = 0.0;
    for (float v : lanes) {
      const typename Sum::Parts parts = Sum::split(v);
      CHECK(parts.high >= 0);
      CHECK(parts.low >= 0);
      CHECK(parts.low <= (1 << Sum::kShift));
      // the split is exact up to the rounding of the remainder to 2^-2S
      CHECK(std::fabs(parts.high * unit + parts.low * unit2 - static_cast<double>(v)) <= 0.5 * unit2);
      high_total += parts.high;
      low_total += parts.low;
      values_total += v;
    }
    REQUIRE(high_total <= INT32_MAX); // the warp's redux.sync.add does not overflow
    REQUIRE(low_total <= INT32_MAX);
    const double quantized_total =
        static_cast<double>(high_total) * unit + static_cast<double>(low_total) * unit2;
    const float joined = Sum::join(static_cast<int32_t>(high_total), static_cast<int32_t>(low_total));
    const double ulp = std::ldexp(1.0, std::ilogb(quantized_total == 0.0 ? 1.0 : quantized_total) - 23);
    INFO("trial " << trial << ", kind " << kind << ", total " << values_total);
    CHECK(std::fabs(static_cast<double>(joined) - quantized_total) <= 2.0 * ulp);
    CHECK(std::fabs(quantized_total - values_total) <= 32 * 0.5 * unit2);
    if (values_total == 0.0)
      CHECK(joined == 0.0f);
  }
}

} // namespace

TEST_CASE("fixed-point warp sums: exact integer parts, no overflow, one rounding") {
  // warp_sum_unit_terms (logits_pass.cuh) adds a sub-tile's lane sums as these parts with redux.sync.add:
  // 32 bf16 / fp16 terms a lane (4 vectors of 8), 16 fp32 (4 of 4).
  smcgraph::test::Rng rng;
  INFO("seed " << rng.seed());
  CHECK(smcgraph::detail::FixedPointSum<32>::kShift == 20);
  CHECK(smcgraph::detail::FixedPointSum<16>::kShift == 21);
  check_fixed_point_sums<32>(rng);
  check_fixed_point_sums<16>(rng);
}
