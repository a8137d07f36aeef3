// sample() and score() on the GPU against the double-precision host reference, eagerly and in graphs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <vector>

#include "kernels/walk_plan.hpp"
#include "runtime/env.hpp"
#include "reference/sample_ref.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/sample.hpp"
#include "support/test_util.hpp"

using smcgraph::DeviceBuffer;
using smcgraph::DType;
namespace test = smcgraph::test;
namespace reference = smcgraph::reference;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr uint32_t kStream = smcgraph::philox_stream(smcgraph::Salt::kUser, 5);

/// One batch of rows for sample(): host inputs, device buffers, outputs.
struct Batch {
  DType dtype = DType::kFloat32;
  int rows = 0, vocab = 0;
  int64_t row_stride = 0;
  int particles = 1;
  std::vector<float> logits; // [rows, row_stride] values as the device sees them (after rounding)
  std::vector<float> temperature, alpha;
  std::vector<uint64_t> seeds;    // [rows / particles]
  std::vector<uint32_t> counters; // [rows / particles]
};

struct Outputs {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs, logz;
  std::vector<uint32_t> flags;
  uint32_t status = 0;
  bool bitwise_equal(const Outputs& other) const {
    return tokens == other.tokens && flags == other.flags && status == other.status &&
           std::memcmp(logprobs.data(), other.logprobs.data(), logprobs.size() * 4) == 0 &&
           std::memcmp(logz.data(), other.logz.data(), logz.size() * 4) == 0;
  }
};

Batch random_batch(test::Rng& rng, DType dtype, int rows, int vocab, int64_t row_stride,
                   double mask_fraction) {
  Batch batch;
  batch.dtype = dtype;
  batch.rows = rows;
  batch.vocab = vocab;
  batch.row_stride = row_stride;
  batch.logits.assign(static_cast<size_t>(rows) * row_stride, 0.0f);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int r = 0; r < rows; ++r) {
    float* row = batch.logits.data() + static_cast<size_t>(r) * row_stride;
    for (int v = 0; v < vocab; ++v)
      row[v] = test::round_to(dtype, normal(rng.engine()));
    if (vocab > 1)
      for (int v = 0; v < vocab; ++v)
        if (unit(rng.engine()) < mask_fraction)
          row[v] = -kInf;
    row[rng.integer(0, vocab - 1)] = test::round_to(dtype, 6.0f + normal(rng.engine())); // a clear favourite
  }
  const float temperatures[] = {0.0f, 0.5f, 1.0f, 1.7f};
  for (int r = 0; r < rows; ++r) {
    batch.temperature.push_back(temperatures[rng.integer(0, 3)]);
    batch.alpha.push_back(rng.integer(0, 1) ? 2.0f : 1.0f);
    batch.seeds.push_back(rng.bits());
    batch.counters.push_back(static_cast<uint32_t>(rng.integer(0, 1000000)));
  }
  return batch;
}

/// Device copies of what sample() and score() both take (the logits as `dtype`, the row parameters and the
/// per-request keys), the row flags and status word, and a workspace for `jobs` jobs, on a stream of their
/// own.
struct DeviceRowInputs {
  smcgraph::Stream stream;
  DeviceBuffer<uint8_t> logits;
  DeviceBuffer<float> temperature, alpha;
  DeviceBuffer<uint64_t> seeds;
  DeviceBuffer<uint32_t> counters;
  DeviceBuffer<uint32_t> flags, status;
  smcgraph::SampleWorkspace workspace;

  DeviceRowInputs(DType dtype, const std::vector<float>& host_logits,
                  const std::vector<float>& host_temperature, const std::vector<float>& host_alpha,
                  const std::vector<uint64_t>& host_seeds, const std::vector<uint32_t>& host_counters,
                  int rows, int jobs, int vocab)
      : temperature(test::to_device(host_temperature, stream)), alpha(test::to_device(host_alpha, stream)),
        seeds(test::to_device(host_seeds, stream)), counters(test::to_device(host_counters, stream)),
        flags(rows), status(1), workspace(jobs, vocab) {
    const std::vector<uint8_t> bytes = test::encode_logits(dtype, host_logits).bytes;
    logits = DeviceBuffer<uint8_t>(bytes.size());
    logits.copy_from_host(bytes.data(), bytes.size(), stream);
  }
};

/// Device copies of a batch plus output buffers; run() launches sample() eagerly or in a graph.
struct DeviceBatch : DeviceRowInputs {
  const Batch& batch;
  DeviceBuffer<int32_t> tokens;
  DeviceBuffer<float> logprobs, logz;

  explicit DeviceBatch(const Batch& b)
      : DeviceRowInputs(b.dtype, b.logits, b.temperature, b.alpha, b.seeds, b.counters, b.rows, b.rows,
                        b.vocab),
        batch(b), tokens(b.rows), logprobs(b.rows), logz(b.rows) {}

  void launch(cudaStream_t s) {
    const smcgraph::LogitsView view{logits.data(), batch.dtype,      batch.rows,      1,
                                    batch.vocab,   batch.row_stride, batch.row_stride};
    smcgraph::sample(
        view, {temperature.data(), alpha.data()}, {seeds.data(), counters.data(), batch.particles}, kStream,
        {tokens.data(), logprobs.data(), logz.data(), flags.data(), status.data()}, workspace, s);
  }

  Outputs run(bool captured) {
    tokens.fill_bytes(0xff, stream); // poison: every output must be written
    logprobs.fill_bytes(0xff, stream);
    logz.fill_bytes(0xff, stream);
    flags.fill_bytes(0, stream);
    status.fill_bytes(0, stream);
    test::run_on_stream(captured, stream, [&](cudaStream_t s) { launch(s); });
    Outputs out;
    out.tokens = test::to_host(tokens.data(), batch.rows, stream);
    out.logprobs = test::to_host(logprobs.data(), batch.rows, stream);
    out.logz = test::to_host(logz.data(), batch.rows, stream);
    out.flags = test::to_host(flags.data(), batch.rows, stream);
    out.status = test::to_host(status.data(), 1, stream)[0];
    return out;
  }
};

struct Tally {
  long checked = 0, near_ties = 0, mismatches = 0;
};

/// Compares row r of `out` with the reference; returns false on a hard failure (already reported).
void check_row(const Batch& batch, const Outputs& out, int r, Tally& tally) {
  const int request = r / batch.particles;
  const auto expected = reference::sample(
      batch.logits.data() + static_cast<size_t>(r) * batch.row_stride, batch.vocab,
      smcgraph::sample_tile_length(batch.dtype), batch.temperature[r], batch.alpha[r], batch.seeds[request],
      batch.counters[request], static_cast<uint32_t>(r % batch.particles), kStream);
  ++tally.checked;
  INFO("row " << r << " of " << batch.rows << ", V " << batch.vocab << ", "
              << smcgraph::dtype_name(batch.dtype) << ", T " << batch.temperature[r] << ", alpha "
              << batch.alpha[r]);
  REQUIRE(out.flags[r] == expected.flags);
  if (expected.flags) {
    CHECK(out.tokens[r] == smcgraph::kInvalidToken);
    return;
  }
  if (batch.temperature[r] == 0.0f) { // greedy is exact, ties go to the smallest id
    CHECK(out.tokens[r] == expected.token);
    CHECK(out.logprobs[r] == 0.0f);
    CHECK(out.logz[r] == 0.0f);
    return;
  }
  if (out.tokens[r] != expected.token) {
    if (expected.near_tie()) {
      ++tally.near_ties;
    } else {
      ++tally.mismatches;
      MESSAGE("token " << out.tokens[r] << " vs reference " << expected.token << " (scores "
                       << expected.best_score << ", " << expected.runner_up_score << ")");
    }
    return;
  }
  CHECK(test::close_to(out.logprobs[r], expected.logprob, 1e-5));
  CHECK(test::close_to(out.logz[r], expected.logz, 1e-5));
}

} // namespace

TEST_CASE("device Philox equals the host implementation bit for bit") {
  smcgraph::Stream stream;
  const int count = 100003;
  DeviceBuffer<uint32_t> words(count);
  test::Rng rng;
  INFO("seed " << rng.seed());
  for (int trial = 0; trial < 4; ++trial) {
    const uint64_t seed = rng.bits();
    const uint32_t counter = static_cast<uint32_t>(rng.bits()),
                   particle = static_cast<uint32_t>(rng.integer(0, 63));
    const uint32_t stream_word =
        smcgraph::philox_stream(smcgraph::Salt::kDraft, static_cast<uint32_t>(trial));
    words.fill_bytes(0xff, stream);
    smcgraph::philox_words(seed, counter, particle, stream_word, words.data(), count, stream);
    const auto device = test::to_host(words.data(), count, stream);
    for (int i = 0; i < count; ++i)
      REQUIRE(device[i] ==
              smcgraph::philox_word(seed, static_cast<uint64_t>(i), counter, particle, stream_word));
  }
}

TEST_CASE("sample() matches the host reference across dtypes, vocabularies and row counts") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  Tally tally;
  struct Shape {
    int vocab, rows;
  };
  std::vector<Shape> shapes;
  for (int vocab : {1, 7, 32000, 32001, 128256, 151936, 262144})
    for (int rows : {1, 3, 64})
      shapes.push_back({vocab, rows});
  // Many rows (one block per row and vocabulary split, whatever the count): fewer under racecheck.
  for (int vocab : {7, 1000, 32001})
    shapes.push_back({vocab, test::sanitizer_scaled(1024, 1024, 128)});
  for (int vocab : {32000, 128256})
    shapes.push_back({vocab, test::sanitizer_scaled(256, 256, 32)});
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const Shape& shape : shapes) {
      // Contiguous rows (misaligned whenever V * bytes is not a multiple of 16) and, for some, a padded
      // stride.
      const int64_t stride =
          (shape.vocab % 16 == 0 || shape.rows != 3) ? shape.vocab : (shape.vocab + 15) / 16 * 16;
      Batch batch = random_batch(rng, dtype, shape.rows, shape.vocab, stride, 0.01);
      DeviceBatch device(batch);
      const Outputs eager = device.run(false);
      const Outputs graphed = device.run(true);
      CAPTURE(shape.vocab);
      CAPTURE(shape.rows);
      REQUIRE(eager.bitwise_equal(graphed));
      CHECK(eager.status == 0);
      // Check every row of small launches, a sample of the rest.
      const int stride_rows = std::max(1, shape.rows / 24);
      for (int r = 0; r < shape.rows; r += stride_rows)
        check_row(batch, eager, r, tally);
      check_row(batch, eager, shape.rows - 1, tally);
    }
  }
  MESSAGE("rows checked " << tally.checked << ", near ties " << tally.near_ties << ", other mismatches "
                          << tally.mismatches);
  CHECK(tally.mismatches * 10000 <= tally.checked);
}

TEST_CASE("greedy rows: ties across a sub-tile's lanes and tiles, signed zeros, +inf, NaN and all -inf") {
  // The greedy fold reduces a sub-tile's lanes with redux.sync (warp_merge_greedy): the largest max, then the
  // smallest id among the lanes holding it, where -0 ties +0. Each row below is built so that a wrong tie
  // rule, a lost NaN or a wrong empty state gives a different token or flag than the reference's.
  test::Rng rng;
  INFO("seed " << rng.seed());
  Tally tally;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int vocab : {1000, 49152, 128256}) {
      CAPTURE(dtype);
      CAPTURE(vocab);
      const int per_vector = dtype == DType::kFloat32 ? 4 : 8; // one lane's 16-byte vector
      Batch batch = random_batch(rng, dtype, 12, vocab, vocab, 0.0);
      auto row = [&](int r) { return batch.logits.data() + static_cast<size_t>(r) * vocab; };
      for (int r = 0; r < batch.rows; ++r) {
        batch.temperature[r] = 0.0f;
        std::fill(row(r), row(r) + vocab, -5.0f);
      }
      const int far = vocab - 3;
      // 0: ties in three lanes of one sub-tile (vectors 0, 1 and 31), the smallest id in lane 1.
      row(0)[31 * per_vector + 2] = row(0)[per_vector + 1] = row(0)[7 * per_vector + 3] = 3.0f;
      row(0)[31 * per_vector] = 2.0f;
      // 1: a tie inside one lane's vector and one in the last tile.
      row(1)[far] = row(1)[2] = row(1)[3] = 4.0f;
      // 2, 3: the max is zero: -0 at the smaller id, +0 at the larger, and the other way round.
      for (int r : {2, 3})
        std::fill(row(r), row(r) + vocab, -1.0f);
      row(2)[per_vector + 2] = -0.0f;
      row(2)[5 * per_vector] = 0.0f;
      row(3)[per_vector + 2] = 0.0f;
      row(3)[5 * per_vector] = -0.0f;
      // 4: every logit -inf. 5: one finite logit, the rest -inf, in the last lane of a sub-tile.
      std::fill(row(4), row(4) + vocab, -kInf);
      std::fill(row(5), row(5) + vocab, -kInf);
      row(5)[31 * per_vector + per_vector - 1] = -7.0f;
      // 6: +inf beside a finite max. 7: NaN beside the max. 8: NaN in a row of -inf.
      row(6)[10] = 9.0f;
      row(6)[far] = kInf;
      row(7)[10] = 9.0f;
      row(7)[per_vector * 3] = std::numeric_limits<float>::quiet_NaN();
      std::fill(row(8), row(8) + vocab, -kInf);
      row(8)[far] = std::numeric_limits<float>::quiet_NaN();
      // 9-11: random rows with many exact ties at the max (bf16-exact values).
      for (int r = 9; r < batch.rows; ++r) {
        for (int v = 0; v < vocab; ++v)
          row(r)[v] = static_cast<float>(rng.integer(-8, 2));
        row(r)[rng.integer(0, vocab - 1)] = 3.0f;
        row(r)[rng.integer(0, vocab - 1)] = 3.0f;
      }
      DeviceBatch device(batch);
      const Outputs eager = device.run(false);
      const Outputs graphed = device.run(true);
      REQUIRE(eager.bitwise_equal(graphed));
      for (int r = 0; r < batch.rows; ++r)
        check_row(batch, eager, r, tally);
      CHECK(eager.tokens[0] == per_vector + 1);
      CHECK(eager.tokens[1] == 2);
      CHECK(eager.tokens[2] == per_vector + 2);
      CHECK(eager.tokens[3] == per_vector + 2);
      CHECK(eager.tokens[5] == 31 * per_vector + per_vector - 1);
      for (int r : {6, 7, 8})
        CHECK(eager.flags[r] != 0);
    }
  }
  CHECK(tally.mismatches == 0);
}

TEST_CASE("a workspace zeroed on the caller's stream (CUB style) serves the next launch on it") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Batch batch = random_batch(rng, dtype, 48, 128256, 128256, 0.01);
    DeviceBatch waited(batch); // the constructor that waits for its zeroing
    const Outputs want = waited.run(false);
    DeviceBatch device(batch);
    // Replaced by one zeroed on the batch's non-blocking stream, not waited for: the launch right after it
    // on that stream must see the zeros.
    device.workspace = smcgraph::SampleWorkspace(batch.rows, batch.vocab, device.stream);
    const Outputs eager = device.run(false);
    CHECK(eager.bitwise_equal(want));
    device.workspace = smcgraph::SampleWorkspace(batch.rows, batch.vocab, device.stream);
    const Outputs graphed = device.run(true);
    CHECK(graphed.bitwise_equal(want));
  }
}

TEST_CASE("sample() tokens match the reference on >= 10^4 rows (near-tie rate)") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  Tally tally;
  // 2 x 8192 rows; 2 x 2048 (2 x 512 under racecheck) under a sanitizer, where the rate is measured less
  // finely (the allowed mismatch count scales with the rows checked).
  const int rows = test::sanitizer_scaled(8192, 2048, 512);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Batch batch = random_batch(rng, dtype, rows, 2000, 2000, 0.0);
    for (float& t : batch.temperature)
      t = 1.0f;
    DeviceBatch device(batch);
    const Outputs out = device.run(true);
    for (int r = 0; r < batch.rows; ++r)
      check_row(batch, out, r, tally);
  }
  MESSAGE("rows checked " << tally.checked << ", near ties " << tally.near_ties << ", other mismatches "
                          << tally.mismatches);
  CHECK(tally.checked >= test::sanitizer_scaled(10000, 4000, 1000));
  CHECK(tally.mismatches * 10000 <= tally.checked);
}

namespace {

/// `rows` copies of one row of logits (already in the dtype's values) with parameters T and alpha and a key
/// per row: each row is an independent draw.
Batch replicated_batch(test::Rng& rng, DType dtype, const std::vector<float>& row, int rows,
                       float temperature, float alpha) {
  Batch batch;
  batch.dtype = dtype;
  batch.rows = rows;
  batch.vocab = batch.row_stride = static_cast<int>(row.size());
  batch.logits.reserve(static_cast<size_t>(rows) * row.size());
  for (int r = 0; r < rows; ++r)
    batch.logits.insert(batch.logits.end(), row.begin(), row.end());
  batch.temperature.assign(rows, temperature);
  batch.alpha.assign(rows, alpha);
  for (int r = 0; r < rows; ++r) {
    batch.seeds.push_back(rng.bits());
    batch.counters.push_back(static_cast<uint32_t>(rng.integer(0, 1000000)));
  }
  return batch;
}

/// Samples `rows` copies of `row` in `launches` launches (the draw counters advanced in between) and fits
/// the token counts to softmax(alpha l / T).
test::ChiSquare fit_draws(test::Rng& rng, DType dtype, const std::vector<float>& row, float temperature,
                          float alpha, int rows, int launches) {
  const int vocab = static_cast<int>(row.size());
  Batch batch = replicated_batch(rng, dtype, row, rows, temperature, alpha);
  DeviceBatch device(batch);
  std::vector<double> counts(vocab, 0.0), weights(vocab);
  device.status.fill_bytes(0, device.stream); // the kernels only OR error bits into it
  for (int launch = 0; launch < launches; ++launch) {
    device.tokens.fill_bytes(0xff, device.stream); // poison: every launch writes every token
    device.launch(device.stream);
    smcgraph::advance_draw_counters(device.counters.data(), rows, device.stream);
    const auto tokens = test::to_host(device.tokens.data(), rows, device.stream);
    for (int32_t t : tokens) {
      REQUIRE(t >= 0);
      REQUIRE(t < vocab);
      counts[t] += 1.0;
    }
  }
  REQUIRE(test::to_host(device.status.data(), 1, device.stream)[0] == 0u);
  const double max_l = *std::max_element(row.begin(), row.end());
  for (int v = 0; v < vocab; ++v)
    weights[v] = std::exp(static_cast<double>(alpha) * (row[v] - max_l) / temperature);
  return test::chi_square_fit(counts, weights);
}

/// One setting of the chi-square layout tests: dtype, where the mass sits (the test's own enum), T, alpha
/// and V (0: the test's default).
template <class Layout> struct LayoutSetting {
  DType dtype;
  Layout layout;
  float temperature, alpha;
  int vocab = 0;
};

/// The draws fit the law (p > 1e-4) and, outside the sanitizers (whose draw counts fill too few bins for
/// this power check), over more than 100 bins.
void check_fit(const test::ChiSquare& fit) {
  if (!test::under_sanitizer())
    CHECK(fit.bins > 100);
  CHECK(fit.p_value > 1e-4);
}

} // namespace

TEST_CASE("sample() draws follow softmax(alpha l / T): chi-square over 10^6 draws") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  // 1,007,616 draws per setting; 65,536 under a sanitizer and 4,096 under racecheck, with the same test (bins
  // of expected count < 5 pooled, so the chi-square approximation holds at every count).
  const int rows = test::sanitizer_scaled(8192, 4096, 1024), launches = test::sanitizer_scaled(123, 16, 4);
  for (int vocab : {2, 64, 1000}) {
    for (float temperature : {0.5f, 1.0f, 1.7f}) {
      for (float alpha : {1.0f, 2.0f}) {
        std::vector<float> row(vocab);
        for (float& l : row)
          l = static_cast<float>(rng.normal(0.0, 1.0));
        const auto fit = test::confirmed_fit<test::ChiSquare>(
            [&] { return fit_draws(rng, DType::kFloat32, row, temperature, alpha, rows, launches); });
        INFO("V " << vocab << " T " << temperature << " alpha " << alpha << " chi2 " << fit.statistic
                  << " bins " << fit.bins);
        CHECK(fit.p_value > 1e-4);
      }
    }
  }
}

TEST_CASE("two-level race: chi-square over 10^6 draws with the mass in one tile, all tiles, or few tiles") {
  // Tiles (CTAs) here; the sub-tile layouts (the first level's unit) are the next test.
  test::Rng rng;
  INFO("seed " << rng.seed());
  // 1,007,616 draws per setting (1024 rows x 984 launches); fewer under a sanitizer, same test.
  const int rows = test::sanitizer_scaled(1024, 256, 64), launches = test::sanitizer_scaled(984, 64, 16);
  enum class Layout { kOneTile, kAllTiles, kMostTilesMasked };
  const char* const names[] = {"mass in one tile", "mass over all tiles", "most tiles -inf"};
  using Setting = LayoutSetting<Layout>;
  std::vector<Setting> settings;
  for (Layout layout : {Layout::kOneTile, Layout::kAllTiles, Layout::kMostTilesMasked})
    for (const auto& [temperature, alpha] : {std::pair{1.0f, 1.0f}, std::pair{0.7f, 2.0f}})
      settings.push_back({DType::kFloat32, layout, temperature, alpha});
  settings.push_back({DType::kBFloat16, Layout::kAllTiles, 1.0f, 1.0f});
  settings.push_back({DType::kBFloat16, Layout::kMostTilesMasked, 0.7f, 2.0f});
  for (const Setting& setting : settings) {
    const int tile = smcgraph::sample_tile_length(setting.dtype);
    const int vocab = 8 * tile + 1000; // 9 tiles, the last one partial
    std::vector<float> row(vocab);
    for (int v = 0; v < vocab; ++v) {
      const int t = v / tile;
      const float normal = static_cast<float>(rng.normal(0.0, 1.0));
      switch (setting.layout) {
      case Layout::kOneTile: // tile 3 holds all but ~0.3% of the mass (at T = 1)
        row[v] = t == 3 ? normal : normal - 8.0f;
        break;
      case Layout::kAllTiles: // every tile a different share
        row[v] = normal + 0.25f * static_cast<float>(t);
        break;
      case Layout::kMostTilesMasked: // tiles 1 and 8 (the partial one), and one logit of tile 5
        row[v] = t == 1 || t == 8 ? normal : -kInf;
        break;
      }
      row[v] = test::round_to(setting.dtype, row[v]);
    }
    if (setting.layout == Layout::kMostTilesMasked)
      row[5 * tile + 77] = 2.0f;
    const auto fit = test::confirmed_fit<test::ChiSquare>([&] {
      return fit_draws(rng, setting.dtype, row, setting.temperature, setting.alpha, rows, launches);
    });
    INFO(names[static_cast<int>(setting.layout)] << ", " << smcgraph::dtype_name(setting.dtype) << ", T "
                                                 << setting.temperature << " alpha " << setting.alpha
                                                 << ": chi2 " << fit.statistic << " bins " << fit.bins);
    check_fit(fit);
  }
}

TEST_CASE("two-level race: chi-square over 10^6 draws with the mass in one sub-tile, all, or few sub-tiles") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  // As the tile test above, at the granularity of the first level: sub-tiles (one warp's share of a tile,
  // not contiguous: smcgraph::sample_subtile). 1,007,616 draws per setting; fewer under a sanitizer.
  const int rows = test::sanitizer_scaled(1024, 256, 64), launches = test::sanitizer_scaled(984, 64, 16);
  enum class Layout { kOneSubTile, kAllSubTiles, kMostSubTilesMasked };
  const char* const names[] = {"mass in one sub-tile", "mass over all sub-tiles", "most sub-tiles -inf"};
  using Setting = LayoutSetting<Layout>;
  // Two tiles and 500 logits (a partial last tile: some of its sub-tiles partial, the rest empty), or one
  // tile of 8000 bf16 logits, whose two levels run over its 8 sub-tiles from shared memory.
  const auto two_tiles = [](DType dtype) { return 2 * smcgraph::sample_tile_length(dtype) + 500; };
  std::vector<Setting> settings;
  for (Layout layout : {Layout::kOneSubTile, Layout::kAllSubTiles, Layout::kMostSubTilesMasked})
    for (const auto& [temperature, alpha] : {std::pair{1.0f, 1.0f}, std::pair{0.7f, 2.0f}})
      settings.push_back({DType::kBFloat16, layout, temperature, alpha, two_tiles(DType::kBFloat16)});
  settings.push_back({DType::kFloat32, Layout::kOneSubTile, 1.0f, 1.0f, two_tiles(DType::kFloat32)});
  settings.push_back({DType::kFloat32, Layout::kAllSubTiles, 0.7f, 2.0f, two_tiles(DType::kFloat32)});
  settings.push_back({DType::kFloat16, Layout::kMostSubTilesMasked, 1.0f, 1.0f, two_tiles(DType::kFloat16)});
  settings.push_back({DType::kBFloat16, Layout::kAllSubTiles, 1.0f, 1.0f, 8000});
  settings.push_back({DType::kBFloat16, Layout::kMostSubTilesMasked, 0.7f, 2.0f, 8000});
  for (const Setting& setting : settings) {
    const int vocab = setting.vocab;
    int last = 0; // the last non-empty sub-tile (not always the one of vocab id V - 1)
    for (int v = 0; v < vocab; ++v)
      last = std::max(last, smcgraph::sample_subtile(v, setting.dtype));
    REQUIRE(last > 2);
    const int heavy = std::min(last - 1, 11); // tile 1, warp 3 (two tiles)
    std::vector<float> row(vocab);
    int lone = -1; // kMostSubTilesMasked: the one finite logit of a third sub-tile
    for (int v = 0; v < vocab; ++v) {
      const int s = smcgraph::sample_subtile(v, setting.dtype);
      const float normal = static_cast<float>(rng.normal(0.0, 1.0));
      switch (setting.layout) {
      case Layout::kOneSubTile: // sub-tile 11 holds all but ~1% of the mass (at T = 1)
        row[v] = s == heavy ? normal : normal - 8.0f;
        break;
      case Layout::kAllSubTiles: // every sub-tile a different share
        row[v] = normal + 0.125f * static_cast<float>(s % 8) - 0.25f * static_cast<float>(s / 8);
        break;
      case Layout::kMostSubTilesMasked: // sub-tile 1 and the last (partial) one, one logit of sub-tile 2
        row[v] = s == 1 || s == last ? normal : -kInf;
        if (s == 2 && lone < 0)
          lone = v;
        break;
      }
      row[v] = test::round_to(setting.dtype, row[v]);
    }
    if (setting.layout == Layout::kMostSubTilesMasked) {
      REQUIRE(lone >= 0);
      row[lone] = 2.0f;
    }
    const auto fit = test::confirmed_fit<test::ChiSquare>([&] {
      return fit_draws(rng, setting.dtype, row, setting.temperature, setting.alpha, rows, launches);
    });
    INFO(names[static_cast<int>(setting.layout)]
         << ", " << smcgraph::dtype_name(setting.dtype) << ", V " << vocab << ", T " << setting.temperature
         << " alpha " << setting.alpha << ": chi2 " << fit.statistic << " bins " << fit.bins);
    check_fit(fit);
  }
}

TEST_CASE("two-level race: the sub-tile draw is element kTileDrawElement + s, the token draws element "
          "kRankDrawElement + its rank in the sub-tile") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    CAPTURE(smcgraph::dtype_name(dtype));
    // bf16: 16 tiles (128 sub-tiles), the last of 5376 logits, whose sub-tiles hold 768 or 512; fp32: 32
    // tiles (256 sub-tiles), the last of 1280, whose sub-tiles hold 256 or 128 logits.
    const int vocab = 128256, rows = 64;
    const int sub_tiles = smcgraph::sample_splits(vocab, dtype) * smcgraph::kSampleSubTilesPerTile;
    std::vector<std::vector<int>> members(sub_tiles);
    for (int v = 0; v < vocab; ++v)
      members[smcgraph::sample_subtile(v, dtype)].push_back(v);
    for (const auto& m : members)
      REQUIRE(!m.empty());
    const auto uniform = [](const Batch& batch, int r, uint64_t element) {
      return smcgraph::uniform_open01(
          smcgraph::philox_word(batch.seeds[r], element, batch.counters[r], 0, kStream));
    };
    Batch batch = replicated_batch(rng, dtype, std::vector<float>(vocab, -kInf), rows, 0.8f, 1.0f);
    std::vector<int> expected(rows);
    for (int r = 0; r < rows; ++r) {
      float* logits = batch.logits.data() + static_cast<size_t>(r) * vocab;
      if (r % 2 == 0) {
        // Equal sub-tiles (one logit 1.5 each, at a random member): Z_s is the same for every sub-tile, so
        // the sub-tile with the largest sub-tile uniform wins, and within it its one finite logit.
        int best = 0;
        std::vector<int> chosen(sub_tiles);
        for (int s = 0; s < sub_tiles; ++s) {
          chosen[s] = members[s][rng.integer(0, static_cast<int64_t>(members[s].size()) - 1)];
          logits[chosen[s]] = 1.5f;
          if (uniform(batch, r, smcgraph::kTileDrawElement + s) >
              uniform(batch, r, smcgraph::kTileDrawElement + best))
            best = s;
        }
        expected[r] = chosen[best];
      } else {
        // One finite sub-tile of equal logits: the member with the largest uniform of its rank draw wins (its
        // rank: its index in members[s], which ascends; the device races it over all 256 threads, ties to the
        // smaller id).
        const int s = static_cast<int>(rng.integer(0, sub_tiles - 1));
        size_t best_rank = 0;
        for (size_t j = 0; j < members[s].size(); ++j) {
          logits[members[s][j]] = -0.75f;
          if (uniform(batch, r, smcgraph::kRankDrawElement + j) >
              uniform(batch, r, smcgraph::kRankDrawElement + best_rank))
            best_rank = j;
        }
        expected[r] = members[s][best_rank];
      }
    }
    DeviceBatch device(batch);
    long checked = 0;
    for (bool captured : {false, true}) {
      const Outputs out = device.run(captured);
      CAPTURE(captured);
      CHECK(out.status == 0);
      for (int r = 0; r < rows; ++r) {
        CAPTURE(r);
        const auto reference_result = reference::sample(
            batch.logits.data() + static_cast<size_t>(r) * vocab, vocab, smcgraph::sample_tile_length(dtype),
            batch.temperature[r], batch.alpha[r], batch.seeds[r], batch.counters[r], 0, kStream);
        if (reference_result.near_tie()) // equal uniforms: both sides take the smaller index, by a float key
          continue;
        CHECK(reference_result.token == expected[r]);
        CHECK(out.tokens[r] == expected[r]);
        ++checked;
      }
    }
    CHECK(checked >= rows);
  }
}

TEST_CASE("a row's result does not depend on its batch, its row index, or graph vs eager") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    for (int vocab : {32000, 128256}) {
      Batch alone = random_batch(rng, dtype, 1, vocab, vocab, 0.01);
      alone.temperature[0] = 0.7f;
      alone.alpha[0] = 2.0f;
      Outputs reference_out = DeviceBatch(alone).run(false);
      REQUIRE(reference_out.flags[0] == 0);
      const int crowd_rows = test::sanitizer_scaled(1024, 1024, 128);
      for (int rows : {crowd_rows, 64}) {
        const int index = rows == 64 ? 3 : rows / 2 + 5; // 517 of 1024
        Batch crowd = random_batch(rng, dtype, rows, vocab, vocab, 0.01);
        std::copy(alone.logits.begin(), alone.logits.end(),
                  crowd.logits.begin() + static_cast<size_t>(index) * vocab);
        crowd.temperature[index] = alone.temperature[0];
        crowd.alpha[index] = alone.alpha[0];
        crowd.seeds[index] = alone.seeds[0];
        crowd.counters[index] = alone.counters[0];
        DeviceBatch device(crowd);
        for (bool captured : {false, true}) {
          const Outputs out = device.run(captured);
          CAPTURE(rows);
          CAPTURE(captured);
          CHECK(out.tokens[index] == reference_out.tokens[0]);
          CHECK(std::memcmp(&out.logprobs[index], &reference_out.logprobs[0], 4) == 0);
          CHECK(std::memcmp(&out.logz[index], &reference_out.logz[0], 4) == 0);
        }
      }
    }
  }
}

TEST_CASE("sample() with an output row stride writes the dense result into one column and nothing else") {
  // The engine's draft steps sample d_k straight into column k of its [rows, K + 1] draft block.
  test::Rng rng;
  INFO("seed " << rng.seed());
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    const Batch batch = random_batch(rng, dtype, 37, 3001, 3001, 0.01);
    DeviceBatch device(batch);
    const Outputs dense = device.run(false);
    constexpr int64_t kStride = 5;
    constexpr int kColumn = 2;
    const size_t cells = static_cast<size_t>(batch.rows) * kStride;
    DeviceBuffer<int32_t> tokens(cells);
    DeviceBuffer<float> logprobs(cells);
    for (bool captured : {false, true}) {
      CAPTURE(captured);
      tokens.fill_bytes(0xab, device.stream); // poison: the other columns must keep it
      logprobs.fill_bytes(0xab, device.stream);
      device.flags.fill_bytes(0, device.stream);
      device.status.fill_bytes(0, device.stream);
      test::run_on_stream(captured, device.stream, [&](cudaStream_t s) {
        const smcgraph::LogitsView view{device.logits.data(), dtype,           batch.rows, 1, batch.vocab,
                                        batch.row_stride,     batch.row_stride};
        smcgraph::sample(view, {device.temperature.data(), device.alpha.data()},
                         {device.seeds.data(), device.counters.data(), batch.particles}, kStream,
                         {tokens.data() + kColumn, logprobs.data() + kColumn, device.logz.data(),
                          device.flags.data(), device.status.data(), kStride},
                         device.workspace, s);
      });
      const std::vector<int32_t> got_tokens = test::to_host(tokens.data(), cells, device.stream);
      const std::vector<float> got_logprobs = test::to_host(logprobs.data(), cells, device.stream);
      int32_t poison_token;
      float poison_logprob;
      std::memset(&poison_token, 0xab, 4);
      std::memset(&poison_logprob, 0xab, 4);
      size_t wrong = 0, touched = 0;
      for (int r = 0; r < batch.rows; ++r) {
        for (int c = 0; c < kStride; ++c) {
          const size_t i = static_cast<size_t>(r) * kStride + c;
          if (c == kColumn) {
            wrong +=
                got_tokens[i] != dense.tokens[r] || std::memcmp(&got_logprobs[i], &dense.logprobs[r], 4) != 0;
          } else {
            touched +=
                got_tokens[i] != poison_token || std::memcmp(&got_logprobs[i], &poison_logprob, 4) != 0;
          }
        }
      }
      CHECK_MESSAGE(wrong == 0, wrong << " rows differ from the dense launch");
      CHECK_MESSAGE(touched == 0, touched << " cells outside the column were written");
    }
    const smcgraph::LogitsView view{device.logits.data(), dtype,           batch.rows, 1, batch.vocab,
                                    batch.row_stride,     batch.row_stride};
    CHECK_THROWS_WITH_AS(smcgraph::sample(view, {device.temperature.data(), device.alpha.data()},
                                          {device.seeds.data(), device.counters.data(), batch.particles},
                                          kStream,
                                          {tokens.data(), logprobs.data(), device.logz.data(),
                                           device.flags.data(), device.status.data(), 0},
                                          device.workspace, device.stream),
                         doctest::Contains("out.row_stride"), smcgraph::Error);
  }
}

TEST_CASE("graph replays draw fresh numbers and reproduce exactly after the counters are reset") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  Batch batch = random_batch(rng, DType::kBFloat16, 64, 32000, 32000, 0.0);
  std::fill(batch.temperature.begin(), batch.temperature.end(), 1.0f);
  for (int r = 0; r < batch.rows; ++r) // flat rows: every draw is a fresh guess
    for (int v = 0; v < batch.vocab; ++v)
      batch.logits[static_cast<size_t>(r) * batch.vocab + v] = 0.0f;
  DeviceBatch device(batch);
  const test::GraphExec exec = test::instantiate_graph(device.stream, [&](cudaStream_t s) {
    device.launch(s);
    smcgraph::advance_draw_counters(device.counters.data(), batch.rows, s);
  });
  std::vector<std::vector<int32_t>> replays;
  for (int i = 0; i < 3; ++i) {
    test::launch(exec, device.stream);
    replays.push_back(test::to_host(device.tokens.data(), batch.rows, device.stream));
  }
  int differing = 0;
  for (int r = 0; r < batch.rows; ++r)
    differing += replays[0][r] != replays[1][r];
  CHECK(differing > batch.rows / 2);
  // Replay k used draw counter c + k: the host reference agrees.
  for (int r = 0; r < batch.rows; ++r) {
    const auto expected =
        reference::sample(batch.logits.data() + static_cast<size_t>(r) * batch.vocab, batch.vocab,
                          smcgraph::sample_tile_length(batch.dtype), 1.0f, batch.alpha[r], batch.seeds[r],
                          batch.counters[r] + 2, 0, kStream);
    CHECK(replays[2][r] == expected.token);
  }
  device.counters.copy_from_host(batch.counters.data(), batch.counters.size(), device.stream);
  test::launch(exec, device.stream);
  CHECK(test::to_host(device.tokens.data(), batch.rows, device.stream) == replays[0]);
  const auto counters = test::to_host(device.counters.data(), batch.rows, device.stream);
  for (int r = 0; r < batch.rows; ++r)
    CHECK(counters[r] == batch.counters[r] + 1);
}

TEST_CASE("bad rows get flags and sentinels; the other rows are untouched") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const int vocab = 20000, rows = 16;
    Batch clean = random_batch(rng, dtype, rows, vocab, vocab, 0.0);
    for (float& t : clean.temperature)
      t = t == 0.0f ? 0.8f : t;
    Batch faulty = clean;
    auto row = [&](int r) { return faulty.logits.begin() + static_cast<size_t>(r) * vocab; };
    row(1)[1234] = nan;                       // NaN logit
    std::fill(row(3), row(3) + vocab, -kInf); // all masked
    row(5)[vocab - 1] = kInf;                 // +inf logit
    faulty.temperature[7] = -1.0f;            // bad temperature
    faulty.temperature[9] = nan;
    faulty.alpha[11] = 0.0f;       // bad alpha
    faulty.temperature[13] = 0.0f; // greedy row with a NaN
    row(13)[17] = nan;
    const std::map<int, uint32_t> expected_flags = {
        {1, smcgraph::kFlagNanLogit},     {3, smcgraph::kFlagAllMasked},    {5, smcgraph::kFlagNanLogit},
        {7, smcgraph::kFlagBadParameter}, {9, smcgraph::kFlagBadParameter}, {11, smcgraph::kFlagBadParameter},
        {13, smcgraph::kFlagNanLogit}};
    const Outputs good = DeviceBatch(clean).run(false);
    for (bool captured : {false, true}) {
      const Outputs out = DeviceBatch(faulty).run(captured);
      uint32_t status = 0;
      for (int r = 0; r < rows; ++r) {
        CAPTURE(r);
        const auto it = expected_flags.find(r);
        if (it != expected_flags.end()) {
          CHECK(out.flags[r] == it->second);
          CHECK(out.tokens[r] == smcgraph::kInvalidToken);
          CHECK(out.logprobs[r] == -kInf);
          CHECK(out.logz[r] == 0.0f);
          status |= it->second;
        } else {
          CHECK(out.flags[r] == 0);
          CHECK(out.tokens[r] == good.tokens[r]);
          CHECK(std::memcmp(&out.logprobs[r], &good.logprobs[r], 4) == 0);
        }
      }
      CHECK(out.status == status);
    }
  }
}

namespace {

/// One score() call over host inputs: logits [rows, positions, vocab] (as the device sees them), per row
/// temperature and alpha, per request seeds and counters (rows / particles requests), tokens [rows,
/// token_stride] and per request s_q (request_steps; empty: P - 1 for every row). stream_word: the bonus
/// sample's.
struct ScoreInputs {
  DType dtype;
  int rows, positions, vocab, particles, token_stride;
  const std::vector<float>& logits;
  const std::vector<float>& temperature;
  const std::vector<float>& alpha;
  const std::vector<uint64_t>& seeds;
  const std::vector<uint32_t>& counters;
  const std::vector<int32_t>& tokens;
  const std::vector<int32_t>& steps;
  uint32_t stream_word = smcgraph::philox_stream(smcgraph::Salt::kBonus, 0);
};

/// score()'s outputs, read back: token log-probs [rows, P - 1] and the bonus sample per row.
struct ScoreResults {
  std::vector<float> token_logprobs, bonus_logprobs, logz;
  std::vector<int32_t> bonus;
  std::vector<uint32_t> flags;
};

/// Device copies of a ScoreInputs and score()'s output buffers; run() poisons the outputs (every one must be
/// written) and launches score() eagerly or in a graph.
struct DeviceScore : DeviceRowInputs {
  const ScoreInputs& in;
  DeviceBuffer<int32_t> tokens, steps;
  DeviceBuffer<float> token_logprobs, bonus_logprobs, logz;
  DeviceBuffer<int32_t> bonus;

  explicit DeviceScore(const ScoreInputs& inputs)
      : DeviceRowInputs(inputs.dtype, inputs.logits, inputs.temperature, inputs.alpha, inputs.seeds,
                        inputs.counters, inputs.rows, inputs.rows * inputs.positions, inputs.vocab),
        in(inputs), tokens(test::to_device(in.tokens, stream)), steps(test::to_device(in.steps, stream)),
        token_logprobs(static_cast<size_t>(in.rows) * std::max(1, in.positions - 1)), bonus_logprobs(in.rows),
        logz(in.rows), bonus(in.rows) {}

  ScoreResults run(bool captured) {
    token_logprobs.fill_bytes(0xff, stream); // NaN / -1: every output must be written
    bonus_logprobs.fill_bytes(0xff, stream);
    logz.fill_bytes(0xff, stream);
    bonus.fill_bytes(0xff, stream);
    flags.fill_bytes(0, stream);
    status.fill_bytes(0, stream);
    const int64_t row_stride = static_cast<int64_t>(in.positions) * in.vocab;
    test::run_on_stream(captured, stream, [&](cudaStream_t s) {
      smcgraph::score({logits.data(), in.dtype, in.rows, in.positions, in.vocab, row_stride, in.vocab},
                      tokens.data(), in.token_stride, {temperature.data(), alpha.data()},
                      {seeds.data(), counters.data(), in.particles}, in.stream_word,
                      {token_logprobs.data(), bonus.data(), bonus_logprobs.data(), logz.data(), flags.data(),
                       status.data()},
                      workspace, s, in.steps.empty() ? nullptr : steps.data());
    });
    return ScoreResults{
        test::to_host(token_logprobs.data(), token_logprobs.size(), stream),
        test::to_host(bonus_logprobs.data(), in.rows, stream), test::to_host(logz.data(), in.rows, stream),
        test::to_host(bonus.data(), in.rows, stream), test::to_host(flags.data(), in.rows, stream)};
  }
};

} // namespace

TEST_CASE("score() gives token log-probs and a bonus sample in one pass") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  // per_request: each request scores its own s_q positions (request_steps) and samples at s_q; its logits
  // past s_q are NaN, which must never be read (no NaN flag) and its log-probs there are -inf.
  for (bool per_request : {false, true})
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      // 517: one-tile jobs whose last vector is partial (in 16-byte-aligned and unaligned positions), the
      // shape of cycle_gpu's failure in the forty-eighth session; 32001: jobs of several tiles.
      for (int positions : {1, 2, 5, 9})
        for (int vocab : {517, 32001}) {
          CAPTURE(per_request);
          CAPTURE(vocab);
          const int rows = 12, particles = 4;
          Batch batch = random_batch(rng, dtype, rows * positions, vocab, vocab, 0.01);
          batch.particles = particles;
          // s_q per request (clamped by score() to [0, P - 1]: -1 and P + 3 test the clamp).
          std::vector<int32_t> steps(rows / particles, positions - 1);
          if (per_request) {
            for (int32_t& q : steps)
              q = static_cast<int32_t>(rng.integer(0, positions - 1));
            steps[0] = -1;
            steps.back() = positions + 3;
            for (int r = 0; r < rows; ++r) {
              const int last = std::clamp(steps[r / particles], 0, positions - 1);
              for (int p = last + 1; p < positions; ++p)
                std::fill_n(batch.logits.begin() + (static_cast<size_t>(r) * positions + p) * vocab, vocab,
                            std::numeric_limits<float>::quiet_NaN());
            }
          }
          auto row_last = [&](int r) { return std::clamp(steps[r / particles], 0, positions - 1); };
          // Per row (not per position) parameters and per request keys.
          std::vector<float> temperature(rows), alpha(rows);
          for (int r = 0; r < rows; ++r) {
            temperature[r] = batch.temperature[r];
            alpha[r] = batch.alpha[r];
          }
          std::vector<uint64_t> seeds(rows / particles);
          std::vector<uint32_t> counters(rows / particles);
          for (size_t q = 0; q < seeds.size(); ++q) {
            seeds[q] = rng.bits();
            counters[q] = static_cast<uint32_t>(rng.bits());
          }
          const int token_stride = std::max(1, positions - 1);
          std::vector<int32_t> tokens(static_cast<size_t>(rows) * token_stride);
          for (int32_t& t : tokens)
            t = static_cast<int32_t>(rng.integer(0, vocab - 1));
          if (positions > 1)
            tokens[token_stride * 2] = vocab; // out of range: row 2 flagged
          const std::vector<int32_t> no_steps;
          const ScoreInputs inputs{dtype,
                                   rows,
                                   positions,
                                   vocab,
                                   particles,
                                   token_stride,
                                   batch.logits,
                                   temperature,
                                   alpha,
                                   seeds,
                                   counters,
                                   tokens,
                                   per_request ? steps : no_steps};
          const uint32_t stream_word = inputs.stream_word;
          DeviceScore device(inputs);
          for (bool captured : {false, true}) {
            const ScoreResults out = device.run(captured);
            const std::vector<float>& h_token_logprobs = out.token_logprobs;
            const std::vector<int32_t>& h_bonus = out.bonus;
            const std::vector<float>& h_bonus_logprobs = out.bonus_logprobs;
            const std::vector<uint32_t>& h_flags = out.flags;
            for (int r = 0; r < rows; ++r) {
              CAPTURE(r);
              CAPTURE(positions);
              uint32_t row_flags = 0;
              const int last = row_last(r);
              for (int p = 0; p + 1 < positions; ++p) {
                if (p >= last) { // past the request's s_q: not scored
                  CHECK(h_token_logprobs[r * (positions - 1) + p] == -kInf);
                  continue;
                }
                uint32_t f = 0;
                const double expected = reference::token_logprob(
                    batch.logits.data() + (static_cast<size_t>(r) * positions + p) * vocab, vocab,
                    temperature[r], tokens[r * token_stride + p], &f);
                row_flags |= f;
                const float got = h_token_logprobs[r * (positions - 1) + p];
                if (f) {
                  CHECK(got == -kInf);
                } else if (std::isinf(expected)) {
                  CHECK(got == -kInf);
                } else {
                  CHECK(test::close_to(got, expected, 1e-5));
                }
              }
              const auto expected_bonus = reference::sample(
                  batch.logits.data() + (static_cast<size_t>(r) * positions + last) * vocab, vocab,
                  smcgraph::sample_tile_length(dtype), temperature[r], alpha[r], seeds[r / particles],
                  counters[r / particles], static_cast<uint32_t>(r % particles), stream_word);
              row_flags |= expected_bonus.flags;
              CHECK(h_flags[r] == row_flags);
              if (!expected_bonus.flags && !expected_bonus.near_tie()) {
                CHECK(h_bonus[r] == expected_bonus.token);
                if (h_bonus[r] == expected_bonus.token && temperature[r] > 0.0f)
                  CHECK(test::close_to(h_bonus_logprobs[r], expected_bonus.logprob, 1e-5));
              }
            }
            if (positions > 1 && row_last(2) > 0)
              CHECK((h_flags[2] & smcgraph::kFlagTokenOutOfRange) != 0);
          }
        }
    }
}

TEST_CASE("score() at T = 0 is one-hot at the argmax with ties to the smallest id, across tiles") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  // Greedy verification accepts a draft token exactly when its log-prob is 0: a token that only ties the
  // maximum at a larger id must get -inf, or the engine emits it where greedy decoding emits the smaller id.
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    CAPTURE(dtype);
    const int vocab = 32001, positions = 4, rows = 3, token_stride = positions - 1;
    // Per row: two ids sharing the maximum (in one tile, or tiles apart), and a third id below it.
    const int ties[rows][2] = {{5, 20000}, {30000, 31000}, {7, 8}};
    std::vector<float> logits(static_cast<size_t>(rows) * positions * vocab);
    for (float& l : logits)
      l = static_cast<float>(rng.uniform() * 4.0 - 2.0); // bf16-exact values below: the ties survive encoding
    std::vector<int32_t> tokens(static_cast<size_t>(rows) * token_stride);
    for (int r = 0; r < rows; ++r)
      for (int p = 0; p < positions; ++p) {
        float* row = logits.data() + (static_cast<size_t>(r) * positions + p) * vocab;
        row[ties[r][0]] = row[ties[r][1]] = 8.0f;
        if (p < token_stride) // the larger tied id, the smaller one, and neither
          tokens[r * token_stride + p] = p == 0 ? ties[r][1] : (p == 1 ? ties[r][0] : ties[r][0] + 1);
      }
    const std::vector<float> temperature(rows, 0.0f), alpha(rows, 1.0f);
    const std::vector<uint64_t> seeds(rows, 1);
    const std::vector<uint32_t> counters(rows, 0);
    const std::vector<int32_t> no_steps;
    const ScoreInputs inputs{dtype,       rows,  positions, vocab,    1,      token_stride, logits,
                             temperature, alpha, seeds,     counters, tokens, no_steps};
    DeviceScore device(inputs);
    for (bool captured : {false, true}) {
      CAPTURE(captured);
      const ScoreResults out = device.run(captured);
      const std::vector<float>& h_logprobs = out.token_logprobs;
      const std::vector<int32_t>& h_bonus = out.bonus;
      const std::vector<uint32_t>& h_flags = out.flags;
      for (int r = 0; r < rows; ++r) {
        CAPTURE(r);
        CHECK(h_flags[r] == 0);
        CHECK(h_bonus[r] == ties[r][0]); // the greedy draw: the smaller tied id
        for (int p = 0; p < token_stride; ++p) {
          CAPTURE(p);
          uint32_t f = 0;
          const double expected =
              reference::token_logprob(logits.data() + (static_cast<size_t>(r) * positions + p) * vocab,
                                       vocab, 0.0f, tokens[r * token_stride + p], &f);
          CHECK(expected == (p == 1 ? 0.0 : -kInf));
          CHECK(h_logprobs[r * token_stride + p] == static_cast<float>(expected));
        }
      }
    }
  }
}

namespace {

/// Restores the sampler's cluster switch as the case found it (SMCGRAPH_DISABLE_SAMPLER_CLUSTER may have
/// turned it off) when the case ends.
struct ClusterModeGuard {
  const bool enabled = smcgraph::sample_clusters_enabled();
  ~ClusterModeGuard() { smcgraph::set_sample_clusters(enabled); }
};

/// Restores the sampler's walk-mode settings as the case found them when the case ends.
struct WalkModeGuard {
  const int min_jobs = smcgraph::sample_walk_min_jobs();
  const int max_walkers = smcgraph::sample_walk_max_walkers();
  ~WalkModeGuard() {
    smcgraph::set_sample_walk_min_jobs(min_jobs);
    smcgraph::set_sample_walk_max_walkers(max_walkers);
  }
};

constexpr int kWalkOff = std::numeric_limits<int>::max();

bool device_has_clusters() {
  int device = 0, major = 0;
  SMCGRAPH_CUDA_CHECK(cudaGetDevice(&device));
  SMCGRAPH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9;
}

} // namespace

TEST_CASE("sample(): cluster, walk and ticket modes give the same bits, and the reference's tokens") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const ClusterModeGuard guard;
  const WalkModeGuard walk_guard;
  struct Shape {
    DType dtype;
    int vocab, rows;
    double mask_fraction;
  };
  // Shapes inside cluster mode's limits (2-8 tiles, <= 64 CTAs): SmolLM2's 49152 bf16 (6 tiles), 8 fp32 tiles
  // the last 7 logits short, 5 fp16 tiles, two tiles and a sliver, one row of 4 tiles, and rows whose tiles
  // are mostly -inf. (A device of compute capability >= 9 schedules 8-CTA clusters: the portable size.)
  const Shape shapes[] = {{DType::kBFloat16, 49152, 8, 0.01}, {DType::kFloat32, 8 * 4096 - 7, 8, 0.01},
                          {DType::kFloat16, 40000, 9, 0.01},  {DType::kBFloat16, 2 * 8192 + 5, 16, 0.01},
                          {DType::kBFloat16, 32000, 1, 0.01}, {DType::kFloat32, 32001 - 7, 8, 0.999}};
  for (const Shape& shape : shapes) {
    CAPTURE(smcgraph::dtype_name(shape.dtype));
    CAPTURE(shape.vocab);
    CAPTURE(shape.rows);
    smcgraph::set_sample_clusters(true);
    // Hopper and later schedule every cluster these shapes need (at most 8 CTAs).
    REQUIRE(smcgraph::sample_uses_clusters(shape.rows, shape.vocab, shape.dtype) == device_has_clusters());
    Batch batch = random_batch(rng, shape.dtype, shape.rows, shape.vocab, shape.vocab, shape.mask_fraction);
    if (shape.rows > 2)
      batch.temperature[2] = -1.0f; // a bad parameter: flagged, sentinels, in both modes
    DeviceBatch device(batch);
    Tally tally;
    for (bool captured : {false, true}) {
      CAPTURE(captured);
      smcgraph::set_sample_clusters(true);
      const Outputs clustered = device.run(captured);
      smcgraph::set_sample_clusters(false);
      smcgraph::set_sample_walk_min_jobs(kWalkOff);
      REQUIRE_FALSE(smcgraph::sample_uses_clusters(shape.rows, shape.vocab, shape.dtype));
      REQUIRE_FALSE(smcgraph::sample_uses_walk(shape.rows, shape.vocab, shape.dtype));
      const Outputs ticketed = device.run(captured);
      CHECK(clustered.bitwise_equal(ticketed));
      smcgraph::set_sample_walk_min_jobs(1);
      REQUIRE(smcgraph::sample_uses_walk(shape.rows, shape.vocab, shape.dtype));
      CHECK(device.run(captured).bitwise_equal(ticketed));
      smcgraph::set_sample_walk_min_jobs(kWalkOff);
      for (int r = 0; r < batch.rows; ++r)
        check_row(batch, clustered, r, tally);
    }
    CHECK(tally.mismatches == 0);
  }
}

TEST_CASE(
    "score(): cluster, walk and ticket modes give the same bits (scored, unscored and sample positions)") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const ClusterModeGuard guard;
  const WalkModeGuard walk_guard;
  // 4 rows x 4 positions of 32001 bf16 logits: 16 jobs of 4 tiles, 64 CTAs (cluster mode's largest launch).
  // Rows sample at T > 0 or T = 0 (score positions in kScore or greedy mode), alpha 1 or 2; request 0 samples
  // at position 1 (positions 2, 3 are not read: NaN there), request 1 at position 3; one token out of range.
  const DType dtype = DType::kBFloat16;
  const int rows = 4, positions = 4, vocab = 32001, particles = 2, token_stride = positions - 1;
  // On, whatever SMCGRAPH_DISABLE_SAMPLER_CLUSTER=1 set (the guard restores it), as the sample() case does.
  smcgraph::set_sample_clusters(true);
  REQUIRE(smcgraph::sample_uses_clusters(rows * positions, vocab, dtype) == device_has_clusters());
  Batch batch = random_batch(rng, dtype, rows * positions, vocab, vocab, 0.01);
  const std::vector<int32_t> steps = {1, positions - 1};
  for (int r = 0; r < particles; ++r) // request 0's rows: NaN past s_q, never read
    for (int p = steps[0] + 1; p < positions; ++p)
      std::fill_n(batch.logits.begin() + (static_cast<size_t>(r) * positions + p) * vocab, vocab,
                  std::numeric_limits<float>::quiet_NaN());
  const std::vector<float> temperature = {0.7f, 0.0f, 1.3f, 0.5f}, alpha = {1.0f, 1.0f, 2.0f, 1.0f};
  const std::vector<uint64_t> seeds = {rng.bits(), rng.bits()};
  const std::vector<uint32_t> counters = {static_cast<uint32_t>(rng.bits()),
                                          static_cast<uint32_t>(rng.bits())};
  std::vector<int32_t> tokens(static_cast<size_t>(rows) * token_stride);
  for (int32_t& t : tokens)
    t = static_cast<int32_t>(rng.integer(0, vocab - 1));
  tokens[3 * token_stride + 1] = vocab; // out of range: row 3 flagged
  const ScoreInputs inputs{dtype,       rows,  positions, vocab,    particles, token_stride, batch.logits,
                           temperature, alpha, seeds,     counters, tokens,    steps};
  const uint32_t stream_word = inputs.stream_word;
  DeviceScore device(inputs);
  const auto run = [&](bool clusters, int walk_min_jobs, bool captured) {
    smcgraph::set_sample_clusters(clusters);
    smcgraph::set_sample_walk_min_jobs(walk_min_jobs);
    REQUIRE(smcgraph::sample_uses_walk(rows * positions, vocab, dtype) == (!clusters && walk_min_jobs == 1));
    return device.run(captured);
  };
  for (bool captured : {false, true}) {
    CAPTURE(captured);
    const ScoreResults clustered = run(true, kWalkOff, captured);
    const ScoreResults ticketed = run(false, kWalkOff, captured);
    const ScoreResults walked = run(false, 1, captured);
    for (const ScoreResults* other : {&ticketed, &walked}) {
      CHECK(clustered.bonus == other->bonus);
      CHECK(clustered.flags == other->flags);
      CHECK(std::memcmp(clustered.token_logprobs.data(), other->token_logprobs.data(),
                        clustered.token_logprobs.size() * 4) == 0);
      CHECK(std::memcmp(clustered.bonus_logprobs.data(), other->bonus_logprobs.data(), rows * 4) == 0);
      CHECK(std::memcmp(clustered.logz.data(), other->logz.data(), rows * 4) == 0);
    }
    // And the cluster mode's values are the reference's.
    CHECK((clustered.flags[3] & smcgraph::kFlagTokenOutOfRange) != 0);
    for (int r = 0; r < rows; ++r) {
      CAPTURE(r);
      const int last = steps[r / particles];
      for (int p = 0; p < token_stride; ++p) {
        const float got = clustered.token_logprobs[r * token_stride + p];
        if (p >= last || (r == 3 && p == 1)) {
          CHECK(got == -kInf);
          continue;
        }
        uint32_t f = 0;
        const double expected =
            reference::token_logprob(batch.logits.data() + (static_cast<size_t>(r) * positions + p) * vocab,
                                     vocab, temperature[r], tokens[r * token_stride + p], &f);
        CHECK(f == 0);
        if (std::isinf(expected))
          CHECK(got == -kInf);
        else
          CHECK(test::close_to(got, expected, 1e-5));
      }
      const auto expected_bonus = reference::sample(
          batch.logits.data() + (static_cast<size_t>(r) * positions + last) * vocab, vocab,
          smcgraph::sample_tile_length(dtype), temperature[r], alpha[r], seeds[r / particles],
          counters[r / particles], static_cast<uint32_t>(r % particles), stream_word);
      CHECK(expected_bonus.flags == 0);
      if (!expected_bonus.near_tie())
        CHECK(clustered.bonus[r] == expected_bonus.token);
    }
  }
}

TEST_CASE("sample(): walk mode gives ticket mode's bits on rows of many tiles, and the reference's tokens") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  const ClusterModeGuard guard;
  const WalkModeGuard walk_guard;
  smcgraph::set_sample_clusters(false);
  struct Shape {
    DType dtype;
    int vocab, rows;
    int64_t row_stride; ///< vocab + 1: every other row starts off a 16-byte boundary
    double mask_fraction;
  };
  // Llama 3's 128256 bf16 (16 tiles) and fp32 (32), fp16 with a partial last vector, unaligned rows, rows
  // that are mostly -inf, and walk mode's largest job (64 tiles).
  const Shape shapes[] = {{DType::kBFloat16, 128256, 12, 128256, 0.01},
                          {DType::kFloat32, 128256, 5, 128256, 0.01},
                          {DType::kFloat16, 9 * 8192 - 3, 7, 9 * 8192 - 3, 0.01},
                          {DType::kBFloat16, 3 * 8192 + 5, 6, 3 * 8192 + 6, 0.01},
                          {DType::kFloat32, 20 * 4096 + 1, 8, 20 * 4096 + 1, 0.999},
                          {DType::kBFloat16, 64 * 8192, 2, 64 * 8192, 0.01}};
  for (const Shape& shape : shapes) {
    CAPTURE(smcgraph::dtype_name(shape.dtype));
    CAPTURE(shape.vocab);
    CAPTURE(shape.rows);
    Batch batch =
        random_batch(rng, shape.dtype, shape.rows, shape.vocab, shape.row_stride, shape.mask_fraction);
    if (shape.rows > 2)
      batch.temperature[2] = -1.0f; // a bad parameter: flagged, sentinels, in both modes
    batch.temperature[0] = 0.0f;    // a greedy row
    batch.temperature[1] = 0.9f;    // a sampled one
    DeviceBatch device(batch);
    Tally tally;
    for (bool captured : {false, true}) {
      CAPTURE(captured);
      smcgraph::set_sample_walk_min_jobs(kWalkOff);
      REQUIRE_FALSE(smcgraph::sample_uses_walk(shape.rows, shape.vocab, shape.dtype));
      const Outputs ticketed = device.run(captured);
      smcgraph::set_sample_walk_min_jobs(1);
      REQUIRE(smcgraph::sample_uses_walk(shape.rows, shape.vocab, shape.dtype));
      // These few rows take several walkers a job, two tiles each; one walker a job walks every tile
      // (the staging's stages go round several times).
      for (const int max_walkers : {0, 1}) {
        CAPTURE(max_walkers);
        smcgraph::set_sample_walk_max_walkers(max_walkers);
        const Outputs walked = device.run(captured);
        CHECK(walked.bitwise_equal(ticketed));
        for (int r = 0; r < batch.rows; ++r)
          check_row(batch, walked, r, tally);
      }
      smcgraph::set_sample_walk_max_walkers(0);
    }
    CHECK(tally.mismatches == 0);
  }
  // Past 64 tiles a job, or at one tile, the launch does not walk.
  smcgraph::set_sample_walk_min_jobs(1);
  CHECK_FALSE(smcgraph::sample_uses_walk(4, 64 * 8192 + 1, DType::kBFloat16));
  CHECK_FALSE(smcgraph::sample_uses_walk(4, 8192, DType::kBFloat16));
  CHECK(smcgraph::sample_uses_walk(4, 8193, DType::kBFloat16));
  smcgraph::set_sample_walk_min_jobs(5);
  CHECK_FALSE(smcgraph::sample_uses_walk(4, 8193, DType::kBFloat16));
  CHECK_THROWS_AS(smcgraph::set_sample_walk_min_jobs(-1), smcgraph::Error);
  CHECK_THROWS_AS(smcgraph::set_sample_walk_max_walkers(-1), smcgraph::Error);
  // By default, kernels/walk_plan.hpp's rule (tested on the host in test_sample_cpu) on this device: the
  // register walk (2 CTAs an SM) or the staged walk (4) where their CTAs fill at least 95% of their waves
  // (short walks are off unless SMCGRAPH_SAMPLER_SHORT_WALK_TILES sets them).
  smcgraph::set_sample_walk_min_jobs(0);
  int device = 0, sms = 0;
  SMCGRAPH_CUDA_CHECK(cudaGetDevice(&device));
  SMCGRAPH_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  smcgraph::detail::WalkPlanContext context;
  context.sms = sms;
  context.register_blocks = 2; // kPassMinBlocksWalk
  context.staged_blocks = 4;   // kPassMinBlocksStaged
  context.max_subtiles = 512;  // kMaxWalkSubTiles
  context.subtiles_per_tile = 8;
  context.short_walk_tiles = static_cast<int>(
      smcgraph::detail::env_integer("SMCGRAPH_SAMPLER_SHORT_WALK_TILES", 0, 512, "tiles").value_or(0));
  for (const int jobs :
       {1, 8, sms / 2, 3 * sms / 4, sms, 2 * sms - 1, 2 * sms, 2 * sms + 1, 4 * sms - 1, 4 * sms + 1}) {
    CAPTURE(jobs);
    if (jobs < 1)
      continue;
    const bool expected = smcgraph::detail::plan_walk(jobs, 16, context).walk; // 128256 bf16: 16 tiles
    CHECK(smcgraph::sample_uses_walk(jobs, 128256, DType::kBFloat16) == expected);
  }
  if (sms == 132) { // an H100 SXM or H200: the shapes the rule was measured at
    CHECK(smcgraph::sample_uses_walk(256, 128256, DType::kBFloat16)); // register walk
    CHECK(smcgraph::sample_uses_walk(128, 128256, DType::kBFloat16)); // 4 walkers a job
    CHECK(smcgraph::sample_uses_walk(64, 128256, DType::kBFloat16));  // 8 walkers a job
    CHECK_FALSE(smcgraph::sample_uses_walk(8, 128256, DType::kBFloat16));
    CHECK_FALSE(smcgraph::sample_uses_walk(192, 128256, DType::kBFloat16)); // 384 CTAs of 8 tiles
    if (context.short_walk_tiles == 0) {
      CHECK_FALSE(smcgraph::sample_uses_walk(96, 128256, DType::kBFloat16)); // 384 CTAs of 4 tiles
      CHECK_FALSE(smcgraph::sample_uses_walk(64, 49152, DType::kBFloat16));  // 192 CTAs of 2 tiles
    } else if (context.short_walk_tiles >= 4) {                              // short walks
      CHECK(smcgraph::sample_uses_walk(96, 128256, DType::kBFloat16));
      CHECK(smcgraph::sample_uses_walk(64, 49152, DType::kBFloat16));
    }
  }
}
