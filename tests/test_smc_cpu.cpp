// Particle stages: host reference self-checks (weights, systematic resampling, reshuffle) and launcher
// validation (no GPU needed).
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>

#include "reference/smc_ref.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/smc_kernels.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;

namespace {

std::vector<double> normalise(std::vector<double> weights) {
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  for (double& w : weights)
    w /= total;
  return weights;
}

} // namespace

TEST_CASE("reference weights: alpha * log p - log q per column, logZ, EOS absorbing, finished frozen") {
  constexpr int kRows = 5, kSteps = 3, kEos = 7;
  const std::vector<float> logq = {-0.5f, -1.0f, -1.5f, -0.5f, -1.0f, -1.5f, -0.5f, -1.0f,
                                   -1.5f, -0.5f, -1.0f, -1.5f, -0.5f, -1.0f, -1.5f};
  const std::vector<float> logp = {-1.0f, -2.0f, -3.0f, -1.0f, -2.0f, -3.0f, -1.0f, -2.0f,
                                   -3.0f, -1.0f, -2.0f, -3.0f, -1.0f, -2.0f, -3.0f};
  const std::vector<float> logz = {0.25f, 0.25f, 0.25f, 0.25f, 0.5f};
  const std::vector<int32_t> tokens = {1, 2, 3, 1, kEos, kEos, 1, 2, 3, kEos, 2, 3, 4, 5, 6};
  const std::vector<int32_t> bonus = {8, 9, 10, 11, kEos}; // row 4 draws EOS as its bonus token
  const std::vector<float> alpha = {1.0f, 2.0f, 1.0f, 1.0f, 1.0f};
  const std::vector<uint8_t> live = {1, 1, 1, 0, 1};
  std::vector<double> logw = {10.0, 20.0, 30.0, 40.0, 50.0};
  std::vector<uint8_t> finished = {0, 0, 1, 0, 0};
  std::vector<int32_t> first_eos;
  reference::accumulate_weights_ref(logq, logp, logz, tokens, bonus, alpha, live, kRows, kSteps, kEos, logw,
                                    finished, first_eos);
  CHECK(logw[0] == 10.0 + (-0.5 - 1.0 - 1.5 + 0.25));
  CHECK(logw[1] == 20.0 + (-1.5 - 3.0));             // stops at the EOS column (counted), no logZ
  CHECK(logw[2] == 30.0);                            // already finished: frozen
  CHECK(logw[3] == 40.0);                            // not live
  CHECK(logw[4] == 50.0 + (-0.5 - 1.0 - 1.5 + 0.5)); // a bonus EOS: every column and logZ count
  CHECK(finished == std::vector<uint8_t>{0, 1, 1, 0, 1});
  CHECK(first_eos == std::vector<int32_t>{3, 1, -1, -1, 3});
  // The reference without bonus tokens (only meaningful without an EOS id for the kernel) leaves row 4
  // unfinished.
  std::vector<double> logw_plain = {10.0, 20.0, 30.0, 40.0, 50.0};
  std::vector<uint8_t> finished_plain = {0, 0, 1, 0, 0};
  reference::accumulate_weights_ref(logq, logp, logz, tokens, {}, alpha, live, kRows, kSteps, kEos,
                                    logw_plain, finished_plain, first_eos);
  CHECK(finished_plain == std::vector<uint8_t>{0, 1, 1, 0, 0});
  CHECK(logw_plain == logw);
}

TEST_CASE("systematic counts for known weights") {
  // C = [0.5, 0.75, 1, 1]: positions (u + m) / 4 give counts [2, 1, 1, 0] whatever u is.
  for (double u : {1e-7, 0.25, 0.5, 0.999}) {
    const std::vector<int> counts = reference::systematic_counts({0.5, 0.25, 0.25, 0.0}, u);
    CHECK(counts == std::vector<int>{2, 1, 1, 0});
    CHECK(reference::plan_from_counts(counts) == std::vector<int>{0, 1, 2, 0});
  }
  // C = [0.1, 0.7, 0.8, 1], u = 0.5: positions 0.125, 0.375, 0.625, 0.875 -> [0, 3, 0, 1].
  const std::vector<int> counts = reference::systematic_counts({0.1, 0.6, 0.1, 0.2}, 0.5);
  CHECK(counts == std::vector<int>{0, 3, 0, 1});
  // Dead 0 and 2 take survivor 1's two extra copies, in order.
  CHECK(reference::plan_from_counts(counts) == std::vector<int>{1, 1, 1, 3});
  CHECK(reference::plan_from_counts({1, 1, 1}) == std::vector<int>{0, 1, 2});
  CHECK(reference::plan_from_counts({0, 0, 3}) == std::vector<int>{2, 2, 2});
  CHECK(reference::plan_from_counts({0, 2, 0, 2}) == std::vector<int>{1, 1, 3, 3});
}

TEST_CASE("systematic resampling reference is unbiased and keeps counts at floor or ceil of N w") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  for (int trial = 0; trial < 20; ++trial) {
    const int n = static_cast<int>(rng.integer(1, 64));
    std::vector<double> weights(n);
    for (double& w : weights)
      w = rng.uniform() < 0.2 ? 0.0 : std::exp(rng.normal(0.0, 2.0));
    weights[rng.integer(0, n - 1)] += 1.0; // never all zero
    weights = normalise(weights);
    // E[count_i] over u ~ U(0, 1) is exactly N w_i; a midpoint grid of M values of u approximates it within
    // a couple of jumps of 1 / M per particle.
    constexpr int kGrid = 20000;
    std::vector<double> mean(n, 0.0);
    int bad_totals = 0, outside_floor_ceil = 0, dead_sources = 0;
    for (int k = 0; k < kGrid; ++k) {
      const std::vector<int> counts = reference::systematic_counts(weights, (k + 0.5) / kGrid);
      bad_totals += std::accumulate(counts.begin(), counts.end(), 0) != n;
      for (int i = 0; i < n; ++i) {
        const double expected = n * weights[i];
        outside_floor_ceil +=
            counts[i] < std::floor(expected - 1e-9) || counts[i] > std::ceil(expected + 1e-9);
        mean[i] += counts[i] / static_cast<double>(kGrid);
      }
      const std::vector<int> plan = reference::plan_from_counts(counts);
      for (int i = 0; i < n; ++i)
        dead_sources += counts[plan[i]] == 0; // sources must be survivors
    }
    CHECK(bad_totals == 0);
    CHECK(outside_floor_ceil == 0);
    CHECK(dead_sources == 0);
    for (int i = 0; i < n; ++i)
      CHECK(std::abs(mean[i] - n * weights[i]) < 3.0 / kGrid);
  }
}

TEST_CASE("resampling uniform is keyed by (seed, draw counter) and in (0, 1)") {
  double sum = 0.0;
  constexpr int kDraws = 100000;
  for (uint32_t counter = 0; counter < kDraws; ++counter) {
    const double u = reference::resample_uniform(0x1234567890abcdefull, counter);
    REQUIRE(u > 0.0);
    REQUIRE(u < 1.0);
    sum += u;
  }
  CHECK(std::abs(sum / kDraws - 0.5) < 5.0 * std::sqrt(1.0 / 12.0 / kDraws));
  CHECK(reference::resample_uniform(1, 0) != reference::resample_uniform(2, 0));
  CHECK(reference::resample_uniform(1, 0) != reference::resample_uniform(1, 1));
  CHECK(reference::resample_uniform(1, 5) == reference::resample_uniform(1, 5));
}

TEST_CASE("reference resample: ESS, threshold, reset, evidence, untouched requests") {
  constexpr int kN = 4;
  // Request 0: equal weights (ESS = N, kept at tau = 0.5). Request 1: one dominant particle (ESS ~ 1,
  // resampled). Request 2: same weights as 1 with tau = 0 (never). Request 3: not live. Request 4: all -inf.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> logw = {1,   1,   1, 1, 0, -30, -30,  -30,  0,    -30,
                              -30, -30, 5, 6, 7, 8,   -inf, -inf, -inf, -inf};
  const std::vector<double> before = logw;
  std::vector<uint8_t> live(20, 1);
  for (int i = 12; i < 16; ++i)
    live[i] = 0;
  const std::vector<float> tau = {0.5f, 0.5f, 0.0f, 0.5f, 0.5f};
  const std::vector<uint64_t> seeds = {1, 2, 3, 4, 5};
  const std::vector<uint32_t> counters = {0, 0, 0, 0, 0};
  std::vector<int32_t> ancestor;
  std::vector<double> ess, evidence = {0.5, 0.5, 0.5, 0.5, 0.5};
  std::vector<uint8_t> resampled;
  reference::resample_ref(live, tau, seeds, counters, 5, kN, logw, ancestor, ess, resampled, evidence);
  CHECK(ess[0] == doctest::Approx(4.0).epsilon(1e-15));
  CHECK(ess[1] == doctest::Approx(1.0).epsilon(1e-9));
  CHECK(ess[2] == doctest::Approx(1.0).epsilon(1e-9));
  CHECK(ess[3] == 0.0);
  CHECK(ess[4] == 0.0);
  CHECK(resampled == std::vector<uint8_t>{0, 1, 0, 0, 0});
  CHECK(ancestor ==
        std::vector<int32_t>{0, 1, 2, 3, 4, 4, 4, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19});
  for (int i = 0; i < 20; ++i) {
    if (i >= 4 && i < 8) {
      CHECK(logw[i] == 0.0);
    } else if (i < 16) {
      CHECK(logw[i] == before[i]);
    } else {
      CHECK(std::isinf(logw[i]));
    }
  }
  const double lse = std::log(1.0 + 3.0 * std::exp(-30.0));
  CHECK(evidence[1] == doctest::Approx(0.5 + lse - std::log(4.0)).epsilon(1e-15));
  CHECK(evidence == std::vector<double>{0.5, evidence[1], 0.5, 0.5, 0.5});
}

TEST_CASE("reference reshuffle copies rows, moves refcounts and keeps the invariants") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  for (int trial = 0; trial < 200; ++trial) {
    const int requests = static_cast<int>(rng.integer(1, 10));
    const int n = static_cast<int>(rng.integer(1, 8));
    const int max_seq_len = static_cast<int>(rng.integer(4, 32));
    const int pool_size = static_cast<int>(rng.integer(requests * n * 2, requests * n * max_seq_len + 2));
    reference::HostSlots state =
        reference::random_slot_state(rng.engine(), requests, n, max_seq_len, pool_size);
    const reference::HostSlots before = state;
    std::vector<uint8_t> finished(state.rows);
    for (auto& bit : finished)
      bit = rng.uniform() < 0.3;
    const std::vector<uint8_t> finished_before = finished;
    const std::vector<int32_t> plan = reference::random_plan(rng.engine(), requests, n);
    reference::reshuffle_ref(state, plan, finished);
    const SlotCheck check = state.check();
    REQUIRE_MESSAGE(check.ok, check.problem);
    for (int row = 0; row < state.rows; ++row) {
      const int source = plan[row];
      CHECK(plan[source] == source);
      CHECK(state.seq_len[row] == before.seq_len[source]);
      CHECK(state.live[row] == before.live[source]);
      CHECK(finished[row] == finished_before[source]);
      for (int j = 0; j < state.seq_len[row]; ++j) {
        CHECK(state.slot(row, j) == before.slot_table[static_cast<size_t>(source) * max_seq_len + j]);
        CHECK(state.token(row, j) == before.token_table[static_cast<size_t>(source) * max_seq_len + j]);
      }
    }
  }
}

TEST_CASE("particle launchers name the bad parameter before any CUDA call") {
  using doctest::Contains;
  static float fake_float[4];
  static int32_t fake_int[4];
  static uint8_t fake_byte[4];
  static double fake_double[4];
  static uint64_t fake_seed[4];
  static uint32_t fake_counter[4];

  WeightInputs good;
  good.draft_logprobs = {fake_float, 4, 1};
  good.target_logprobs = {fake_float, 4, 1};
  good.logz = fake_float;
  good.draft_tokens = {fake_int, 4, 1};
  good.alpha = fake_float;
  good.live = fake_byte;
  good.bonus_tokens = fake_int;
  good.rows = 8;
  good.steps = 4;
  good.eos_id = 2;
  {
    WeightInputs bad = good;
    bad.bonus_tokens = nullptr; // with an EOS id the bonus must be checked
    CHECK_THROWS_WITH_AS(accumulate_weights(bad, fake_double, fake_byte, fake_int, nullptr),
                         Contains("accumulate_weights: in.bonus_tokens = null"), Error);
  }
  {
    WeightInputs bad = good;
    bad.steps = 0;
    CHECK_THROWS_WITH_AS(accumulate_weights(bad, fake_double, fake_byte, fake_int, nullptr),
                         Contains("accumulate_weights: in.steps = 0"), Error);
  }
  {
    WeightInputs bad = good;
    bad.rows = -1;
    CHECK_THROWS_WITH_AS(accumulate_weights(bad, fake_double, fake_byte, fake_int, nullptr),
                         Contains("accumulate_weights: in.rows = -1"), Error);
  }
  {
    WeightInputs bad = good;
    bad.draft_logprobs.data = nullptr;
    CHECK_THROWS_WITH_AS(accumulate_weights(bad, fake_double, fake_byte, fake_int, nullptr),
                         Contains("accumulate_weights: in.draft_logprobs"), Error);
  }
  {
    WeightInputs bad = good;
    bad.target_logprobs.row_stride = -3;
    CHECK_THROWS_WITH_AS(accumulate_weights(bad, fake_double, fake_byte, fake_int, nullptr),
                         Contains("accumulate_weights: in.target_logprobs = -3"), Error);
  }
  {
    WeightInputs bad = good;
    bad.alpha = nullptr;
    CHECK_THROWS_WITH_AS(accumulate_weights(bad, fake_double, fake_byte, fake_int, nullptr),
                         Contains("accumulate_weights: in.alpha"), Error);
  }
  CHECK_THROWS_WITH_AS(accumulate_weights(good, nullptr, fake_byte, fake_int, nullptr),
                       Contains("accumulate_weights: logw"), Error);
  CHECK_THROWS_WITH_AS(accumulate_weights(good, fake_double, nullptr, fake_int, nullptr),
                       Contains("accumulate_weights: finished"), Error);
  CHECK_THROWS_WITH_AS(accumulate_weights(good, fake_double, fake_byte, nullptr, nullptr),
                       Contains("accumulate_weights: first_eos"), Error);

  ResampleInputs in{fake_byte, fake_float, fake_seed, fake_counter, 2, 4};
  ResampleOutputs out{fake_int, fake_double, fake_byte, fake_double};
  {
    ResampleInputs bad = in;
    bad.particles_per_request = 0;
    CHECK_THROWS_WITH_AS(resample(bad, fake_double, out, nullptr),
                         Contains("resample: in.particles_per_request = 0"), Error);
    bad.particles_per_request = kMaxResampleParticles + 1;
    CHECK_THROWS_WITH_AS(resample(bad, fake_double, out, nullptr),
                         Contains("resample: in.particles_per_request = 257"), Error);
  }
  {
    ResampleInputs bad = in;
    bad.tau = nullptr;
    CHECK_THROWS_WITH_AS(resample(bad, fake_double, out, nullptr), Contains("resample: in.tau"), Error);
    bad = in;
    bad.seeds = nullptr;
    CHECK_THROWS_WITH_AS(resample(bad, fake_double, out, nullptr), Contains("resample: in.seeds"), Error);
    bad = in;
    bad.requests = -2;
    CHECK_THROWS_WITH_AS(resample(bad, fake_double, out, nullptr), Contains("resample: in.requests = -2"),
                         Error);
  }
  {
    ResampleOutputs bad = out;
    bad.log_evidence = nullptr;
    CHECK_THROWS_WITH_AS(resample(in, fake_double, bad, nullptr), Contains("resample: out.log_evidence"),
                         Error);
    bad = out;
    bad.ancestor = nullptr;
    CHECK_THROWS_WITH_AS(resample(in, fake_double, bad, nullptr), Contains("resample: out.ancestor"), Error);
  }
  CHECK_THROWS_WITH_AS(resample(in, nullptr, out, nullptr), Contains("resample: logw"), Error);

  const SlotPoolView pool{fake_int, fake_int, fake_int, 16};
  const RowTablesView tables{fake_int, fake_int, fake_int, fake_byte, 8, 8};
  CHECK_THROWS_WITH_AS(reshuffle(pool, tables, nullptr, fake_byte, nullptr), Contains("reshuffle: ancestor"),
                       Error);
  CHECK_THROWS_WITH_AS(reshuffle(pool, tables, fake_int, nullptr, nullptr), Contains("reshuffle: finished"),
                       Error);
  CHECK_THROWS_WITH_AS(reshuffle({fake_int, fake_int, fake_int, 0}, tables, fake_int, fake_byte, nullptr),
                       Contains("reshuffle: pool.pool_size = 0"), Error);
  RowTablesView bad_tables = tables;
  bad_tables.slot_table = nullptr;
  CHECK_THROWS_WITH_AS(reshuffle(pool, bad_tables, fake_int, fake_byte, nullptr),
                       Contains("reshuffle: tables.slot_table"), Error);

  // Empty launches are valid no-ops.
  WeightInputs empty = good;
  empty.rows = 0;
  CHECK_NOTHROW(accumulate_weights(empty, nullptr, nullptr, nullptr, nullptr));
  ResampleInputs no_requests = in;
  no_requests.requests = 0;
  CHECK_NOTHROW(resample(no_requests, nullptr, out, nullptr));
}
