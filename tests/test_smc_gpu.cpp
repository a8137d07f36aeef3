// Particle kernels (weights, resample, reshuffle) against the host reference, eagerly and inside a captured
// graph, plus the statistical and long-run properties: unbiased systematic resampling, tau = 0, 10^4
// cycles of weights without drift, EOS freezing.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>

#include "kernels/cycle_io.hpp"
#include "reference/smc_ref.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/smc_kernels.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;
using reference::DeviceSlots;
using reference::HostSlots;
using test::close_to;
using test::run_on_stream;
using test::to_device;
using test::to_host;

namespace {

constexpr bool kModes[] = {false, true}; // eager, captured

// Dense [rows, steps] host inputs of accumulate_weights.
struct WeightCase {
  int rows = 0, steps = 0, eos_id = -1;
  std::vector<float> logq, logp, logz, alpha;
  std::vector<int32_t> tokens, bonus; ///< [rows, steps], [rows]
  std::vector<uint8_t> live;
};

WeightCase random_weight_case(test::Rng& rng, int rows, int steps, int eos_id, int vocab) {
  WeightCase c;
  c.rows = rows;
  c.steps = steps;
  c.eos_id = eos_id;
  const size_t cells = static_cast<size_t>(rows) * steps;
  c.logq.resize(cells);
  c.logp.resize(cells);
  c.tokens.resize(cells);
  for (size_t i = 0; i < cells; ++i) {
    c.logq[i] = static_cast<float>(rng.uniform(-20.0, 0.0));
    c.logp[i] = static_cast<float>(rng.uniform(-20.0, 0.0));
    c.tokens[i] = static_cast<int32_t>(rng.integer(0, vocab - 1));
  }
  c.logz.resize(rows);
  c.alpha.resize(rows);
  c.live.resize(rows);
  c.bonus.resize(rows);
  for (int r = 0; r < rows; ++r) {
    c.bonus[r] = static_cast<int32_t>(rng.integer(0, vocab - 1));
    c.logz[r] = static_cast<float>(rng.uniform(-1.0, 1.0));
    c.alpha[r] = static_cast<float>(rng.uniform(0.5, 2.0));
    c.live[r] = rng.uniform() < 0.9;
  }
  return c;
}

template <class T> std::vector<T> transpose(const std::vector<T>& dense, int rows, int steps) {
  std::vector<T> out(dense.size());
  for (int r = 0; r < rows; ++r) {
    for (int k = 0; k < steps; ++k)
      out[static_cast<size_t>(k) * rows + r] = dense[static_cast<size_t>(r) * steps + k];
  }
  return out;
}

// Device copies of a WeightCase, dense ([rows, K]) or step-major ([K, rows]).
struct DeviceWeightCase {
  DeviceBuffer<float> logq, logp, logz, alpha;
  DeviceBuffer<int32_t> tokens, bonus;
  DeviceBuffer<uint8_t> live;
  WeightInputs in;

  DeviceWeightCase(const WeightCase& c, bool step_major, cudaStream_t stream)
      : logq(to_device(step_major ? transpose(c.logq, c.rows, c.steps) : c.logq, stream)),
        logp(to_device(step_major ? transpose(c.logp, c.rows, c.steps) : c.logp, stream)),
        logz(to_device(c.logz, stream)), alpha(to_device(c.alpha, stream)),
        tokens(to_device(step_major ? transpose(c.tokens, c.rows, c.steps) : c.tokens, stream)),
        bonus(to_device(c.bonus, stream)), live(to_device(c.live, stream)) {
    const int64_t row_stride = step_major ? 1 : c.steps, step_stride = step_major ? c.rows : 1;
    in.draft_logprobs = {logq.data(), row_stride, step_stride};
    in.target_logprobs = {logp.data(), row_stride, step_stride};
    in.logz = logz.data();
    in.draft_tokens = {tokens.data(), row_stride, step_stride};
    in.alpha = alpha.data();
    in.live = live.data();
    in.bonus_tokens = bonus.data();
    in.rows = c.rows;
    in.steps = c.steps;
    in.eos_id = c.eos_id;
  }
};

struct ResampleCase {
  int requests = 0, n = 0;
  std::vector<double> logw, evidence;
  std::vector<uint8_t> live;
  std::vector<float> tau;
  std::vector<uint64_t> seeds;
  std::vector<uint32_t> counters;
};

struct ResampleRun {
  std::vector<int32_t> ancestor;
  std::vector<double> ess, logw, evidence;
  std::vector<uint8_t> resampled;
};

ResampleRun run_resample(const ResampleCase& c, bool captured, cudaStream_t stream) {
  DeviceBuffer<double> d_logw = to_device(c.logw, stream), d_evidence = to_device(c.evidence, stream);
  DeviceBuffer<uint8_t> d_live = to_device(c.live, stream);
  DeviceBuffer<float> d_tau = to_device(c.tau, stream);
  DeviceBuffer<uint64_t> d_seeds = to_device(c.seeds, stream);
  DeviceBuffer<uint32_t> d_counters = to_device(c.counters, stream);
  DeviceBuffer<int32_t> d_ancestor(c.logw.size());
  DeviceBuffer<double> d_ess(c.requests);
  DeviceBuffer<uint8_t> d_resampled(c.requests);
  d_ancestor.fill_bytes(0xff, stream);
  d_ess.fill_bytes(0xff, stream);
  d_resampled.fill_bytes(0xff, stream);
  run_on_stream(captured, stream, [&](cudaStream_t s) {
    resample({d_live.data(), d_tau.data(), d_seeds.data(), d_counters.data(), c.requests, c.n}, d_logw.data(),
             {d_ancestor.data(), d_ess.data(), d_resampled.data(), d_evidence.data()}, s);
  });
  ResampleRun run;
  run.ancestor = to_host(d_ancestor.data(), d_ancestor.size(), stream);
  run.ess = to_host(d_ess.data(), d_ess.size(), stream);
  run.resampled = to_host(d_resampled.data(), d_resampled.size(), stream);
  run.logw = to_host(d_logw.data(), d_logw.size(), stream);
  run.evidence = to_host(d_evidence.data(), d_evidence.size(), stream);
  return run;
}

ResampleRun reference_resample(const ResampleCase& c) {
  ResampleRun run;
  run.logw = c.logw;
  run.evidence = c.evidence;
  reference::resample_ref(c.live, c.tau, c.seeds, c.counters, c.requests, c.n, run.logw, run.ancestor,
                          run.ess, run.resampled, run.evidence);
  return run;
}

void require_same_resample(const ResampleRun& expected, const ResampleRun& actual) {
  REQUIRE(actual.ancestor == expected.ancestor);
  REQUIRE(actual.resampled == expected.resampled);
  for (size_t q = 0; q < expected.ess.size(); ++q) {
    CAPTURE(q);
    REQUIRE(close_to(actual.ess[q], expected.ess[q], 1e-12));
    REQUIRE(close_to(actual.evidence[q], expected.evidence[q], 1e-12));
  }
  for (size_t r = 0; r < expected.logw.size(); ++r) {
    CAPTURE(r);
    if (std::isnan(expected.logw[r])) {
      REQUIRE(std::isnan(actual.logw[r]));
    } else {
      REQUIRE(close_to(actual.logw[r], expected.logw[r], 1e-12));
    }
  }
}

// Offspring counts per particle of one request, from its rows' ancestors.
std::vector<int> offspring_counts(const std::vector<int32_t>& ancestor, int request, int n) {
  std::vector<int> counts(n, 0);
  for (int i = 0; i < n; ++i)
    ++counts[ancestor[request * n + i] - request * n];
  return counts;
}

} // namespace

TEST_CASE("accumulate_weights matches the reference in both input layouts") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  for (int trial = 0; trial < 10; ++trial) {
    const int rows = static_cast<int>(rng.integer(1, 3000));
    const int steps = static_cast<int>(rng.integer(1, 16));
    CAPTURE(rows);
    CAPTURE(steps);
    const WeightCase c = random_weight_case(rng, rows, steps, /*eos_id=*/5, /*vocab=*/40);
    std::vector<double> logw(rows);
    std::vector<uint8_t> finished(rows);
    for (auto& w : logw)
      w = rng.normal(0.0, 10.0);
    for (auto& f : finished)
      f = rng.uniform() < 0.1;
    std::vector<double> expected_logw = logw;
    std::vector<uint8_t> expected_finished = finished;
    std::vector<int32_t> expected_first_eos;
    reference::accumulate_weights_ref(c.logq, c.logp, c.logz, c.tokens, c.bonus, c.alpha, c.live, rows, steps,
                                      c.eos_id, expected_logw, expected_finished, expected_first_eos);
    for (const bool step_major : {false, true}) {
      CAPTURE(step_major);
      DeviceWeightCase device(c, step_major, stream);
      for (const bool captured : kModes) {
        CAPTURE(captured);
        DeviceBuffer<double> d_logw = to_device(logw, stream);
        DeviceBuffer<uint8_t> d_finished = to_device(finished, stream);
        DeviceBuffer<int32_t> d_first_eos(rows);
        d_first_eos.fill_bytes(0xff, stream);
        run_on_stream(captured, stream, [&](cudaStream_t s) {
          accumulate_weights(device.in, d_logw.data(), d_finished.data(), d_first_eos.data(), s);
        });
        const std::vector<double> actual_logw = to_host(d_logw.data(), rows, stream);
        for (int r = 0; r < rows; ++r)
          REQUIRE(close_to(actual_logw[r], expected_logw[r], 1e-12));
        REQUIRE(to_host(d_finished.data(), rows, stream) == expected_finished);
        REQUIRE(to_host(d_first_eos.data(), rows, stream) == expected_first_eos);
      }
    }
  }
}

TEST_CASE("weights over 10^4 cycles accumulate without drift") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  // 16 x 625 = 10^4 cycles; 1,600 under a sanitizer, 400 under racecheck (the same graph, replayed less).
  constexpr int kRows = 256, kSteps = 8, kSets = 16;
  const int replays = test::sanitizer_scaled(625, 100, 25);
  std::vector<WeightCase> cases;
  std::vector<std::unique_ptr<DeviceWeightCase>> device_cases;
  for (int set = 0; set < kSets; ++set) {
    WeightCase c = random_weight_case(rng, kRows, kSteps, /*eos_id=*/-1, /*vocab=*/1000);
    std::fill(c.live.begin(), c.live.end(), 1);
    cases.push_back(c);
    device_cases.push_back(std::make_unique<DeviceWeightCase>(c, set % 2 == 1, stream));
  }
  DeviceBuffer<double> d_logw(kRows);
  DeviceBuffer<uint8_t> d_finished(kRows);
  DeviceBuffer<int32_t> d_first_eos(kRows);
  d_logw.fill_bytes(0, stream);
  d_finished.fill_bytes(0, stream);

  // One graph of 16 cycles, replayed `replays` times: also checks that replays read fresh device values.
  const test::GraphExec exec = test::instantiate_graph(stream, [&](cudaStream_t s) {
    for (const auto& device : device_cases)
      accumulate_weights(device->in, d_logw.data(), d_finished.data(), d_first_eos.data(), s);
  });
  for (int replay = 0; replay < replays; ++replay)
    test::launch(exec, stream);
  const std::vector<double> actual = to_host(d_logw.data(), kRows, stream);

  std::vector<double> expected(kRows, 0.0);
  std::vector<long double> exact(kRows, 0.0L);
  std::vector<uint8_t> finished(kRows, 0);
  std::vector<int32_t> first_eos;
  for (int replay = 0; replay < replays; ++replay) {
    for (const WeightCase& c : cases) {
      reference::accumulate_weights_ref(c.logq, c.logp, c.logz, c.tokens, c.bonus, c.alpha, c.live, kRows,
                                        kSteps, -1, expected, finished, first_eos);
      for (int r = 0; r < kRows; ++r) {
        long double increment = 0.0L;
        for (int k = 0; k < kSteps; ++k) {
          const size_t at = static_cast<size_t>(r) * kSteps + k;
          increment +=
              static_cast<long double>(c.alpha[r]) * c.logp[at] - static_cast<long double>(c.logq[at]);
        }
        exact[r] += increment + c.logz[r];
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    CAPTURE(r);
    REQUIRE(close_to(actual[r], expected[r], 1e-9));
    REQUIRE(close_to(actual[r], static_cast<double>(exact[r]), 1e-9));
  }
  REQUIRE(to_host(d_first_eos.data(), kRows, stream) == std::vector<int32_t>(kRows, kSteps));
}

TEST_CASE("EOS freezes weights") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  constexpr int kRows = 70, kSteps = 6, kEos = 3;
  // Row r puts its first EOS at column r % (K + 2): a draft column, K the bonus token, K + 1 none; other
  // tokens avoid the EOS id.
  WeightCase first = random_weight_case(rng, kRows, kSteps, kEos, 100);
  std::fill(first.live.begin(), first.live.end(), 1);
  for (int r = 0; r < kRows; ++r) {
    const int eos_at = r % (kSteps + 2);
    first.bonus[r] = eos_at == kSteps ? kEos : (first.bonus[r] == kEos ? kEos + 1 : first.bonus[r]);
    for (int k = 0; k < kSteps; ++k) {
      int32_t& token = first.tokens[static_cast<size_t>(r) * kSteps + k];
      if (k == eos_at) {
        token = kEos;
      } else if (token == kEos) {
        token = kEos + 1;
      }
    }
  }
  std::vector<double> logw(kRows);
  for (auto& w : logw)
    w = rng.normal(0.0, 3.0);
  for (const bool captured : kModes) {
    CAPTURE(captured);
    DeviceBuffer<double> d_logw = to_device(logw, stream);
    DeviceBuffer<uint8_t> d_finished = to_device(std::vector<uint8_t>(kRows, 0), stream);
    DeviceBuffer<int32_t> d_first_eos(kRows);
    d_first_eos.fill_bytes(0xff, stream);
    DeviceWeightCase device_first(first, false, stream);
    run_on_stream(captured, stream, [&](cudaStream_t s) {
      accumulate_weights(device_first.in, d_logw.data(), d_finished.data(), d_first_eos.data(), s);
    });
    const std::vector<double> after_eos = to_host(d_logw.data(), kRows, stream);
    const std::vector<uint8_t> finished = to_host(d_finished.data(), kRows, stream);
    const std::vector<int32_t> first_eos = to_host(d_first_eos.data(), kRows, stream);
    std::vector<double> expected = logw;
    std::vector<uint8_t> expected_finished(kRows, 0);
    std::vector<int32_t> expected_first_eos;
    reference::accumulate_weights_ref(first.logq, first.logp, first.logz, first.tokens, first.bonus,
                                      first.alpha, first.live, kRows, kSteps, kEos, expected,
                                      expected_finished, expected_first_eos);
    for (int r = 0; r < kRows; ++r) {
      CAPTURE(r);
      const int eos_at = r % (kSteps + 2);
      REQUIRE(first_eos[r] == std::min(eos_at, kSteps)); // a bonus EOS: every column of the cycle counts
      REQUIRE(finished[r] == (eos_at <= kSteps ? 1 : 0));
      REQUIRE(close_to(after_eos[r], expected[r], 1e-12));
    }
    // More cycles (with EOS tokens here and there): finished rows never move again.
    for (int cycle = 0; cycle < 5; ++cycle) {
      const WeightCase next = random_weight_case(rng, kRows, kSteps, kEos, 8);
      DeviceWeightCase device_next(next, cycle % 2 == 0, stream);
      d_first_eos.fill_bytes(0xff, stream);
      std::vector<double> before = to_host(d_logw.data(), kRows, stream);
      std::vector<uint8_t> finished_before = to_host(d_finished.data(), kRows, stream);
      std::vector<uint8_t> expected_finished_next = finished_before;
      std::vector<double> expected_next = before;
      reference::accumulate_weights_ref(next.logq, next.logp, next.logz, next.tokens, next.bonus, next.alpha,
                                        next.live, kRows, kSteps, kEos, expected_next, expected_finished_next,
                                        expected_first_eos);
      run_on_stream(captured, stream, [&](cudaStream_t s) {
        accumulate_weights(device_next.in, d_logw.data(), d_finished.data(), d_first_eos.data(), s);
      });
      const std::vector<double> now = to_host(d_logw.data(), kRows, stream);
      const std::vector<int32_t> eos_now = to_host(d_first_eos.data(), kRows, stream);
      REQUIRE(to_host(d_finished.data(), kRows, stream) == expected_finished_next);
      REQUIRE(eos_now == expected_first_eos);
      for (int r = 0; r < kRows; ++r) {
        CAPTURE(r);
        if (finished_before[r]) {
          REQUIRE(now[r] == before[r]); // bit for bit
          REQUIRE(eos_now[r] == -1);
        }
        REQUIRE(close_to(now[r], expected_next[r], 1e-12));
      }
    }
  }
}

TEST_CASE("resample matches the reference") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  const int particle_counts[] = {1, 2, 3, 4, 8, 16, 31, 32, 33, 64, 100, 256};
  for (int trial = 0; trial < 24; ++trial) {
    ResampleCase c;
    c.n = particle_counts[trial % 12];
    c.requests = static_cast<int>(rng.integer(1, 300));
    CAPTURE(c.n);
    CAPTURE(c.requests);
    const size_t rows = static_cast<size_t>(c.requests) * c.n;
    c.logw.resize(rows);
    c.live.assign(rows, 1);
    const double spread = rng.uniform(0.05, 6.0);
    for (auto& w : c.logw)
      w = rng.normal(3.0, spread);
    for (int q = 0; q < c.requests; ++q) {
      const double kind = rng.uniform();
      const size_t base = static_cast<size_t>(q) * c.n;
      if (kind < 0.05) { // padding
        for (int i = 0; i < c.n; ++i)
          c.live[base + i] = 0;
      } else if (kind < 0.08) { // partly live: not taking part
        c.live[base + rng.integer(0, c.n - 1)] = 0;
      } else if (kind < 0.11) { // every particle impossible
        for (int i = 0; i < c.n; ++i)
          c.logw[base + i] = -INFINITY;
      } else if (kind < 0.16) { // some impossible particles
        c.logw[base + rng.integer(0, c.n - 1)] = -INFINITY;
      } else if (kind < 0.20) { // large offset: normalisation must subtract the max
        for (int i = 0; i < c.n; ++i)
          c.logw[base + i] += 5000.0;
      }
    }
    c.tau.resize(c.requests);
    c.seeds.resize(c.requests);
    c.counters.resize(c.requests);
    c.evidence.resize(c.requests);
    for (int q = 0; q < c.requests; ++q) {
      c.tau[q] = std::vector<float>{0.0f, 0.25f, 0.5f, 0.9f, 2.0f}[rng.integer(0, 4)];
      c.seeds[q] = rng.bits();
      c.counters[q] = static_cast<uint32_t>(rng.bits());
      c.evidence[q] = rng.normal();
    }
    const ResampleRun expected = reference_resample(c);
    for (const bool captured : kModes) {
      CAPTURE(captured);
      const ResampleRun actual = run_resample(c, captured, stream);
      require_same_resample(expected, actual);
      // Plan shape: sources keep themselves, counts are floor or ceil of N * w.
      for (int q = 0; q < c.requests; ++q) {
        for (int i = 0; i < c.n; ++i) {
          const int row = q * c.n + i;
          REQUIRE(actual.ancestor[row] / c.n == q);
          REQUIRE(actual.ancestor[actual.ancestor[row]] == actual.ancestor[row]);
        }
      }
    }
  }
}

TEST_CASE("tau = 0 never resamples") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  ResampleCase c;
  c.n = 8;
  c.requests = 200;
  c.logw.resize(c.requests * c.n);
  for (auto& w : c.logw)
    w = rng.normal(0.0, 50.0); // ESS close to 1 everywhere
  c.live.assign(c.logw.size(), 1);
  c.tau.assign(c.requests, 0.0f);
  c.seeds.resize(c.requests);
  for (auto& seed : c.seeds)
    seed = rng.bits();
  c.counters.assign(c.requests, 7);
  c.evidence.assign(c.requests, 1.5);
  std::vector<int32_t> identity(c.logw.size());
  std::iota(identity.begin(), identity.end(), 0);
  for (const bool captured : kModes) {
    const ResampleRun actual = run_resample(c, captured, stream);
    CHECK(actual.resampled == std::vector<uint8_t>(c.requests, 0));
    CHECK(actual.ancestor == identity);
    CHECK(actual.logw == c.logw);
    CHECK(actual.evidence == c.evidence);
    for (const double ess : actual.ess)
      CHECK(ess < 0.5 * c.n);
  }
}

TEST_CASE("a request's plan depends on its seed and inputs only, not on its position or neighbours") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  constexpr int kN = 16;
  ResampleCase single;
  single.n = kN;
  single.requests = 1;
  single.logw.resize(kN);
  for (auto& w : single.logw)
    w = rng.normal(0.0, 2.0);
  single.live.assign(kN, 1);
  single.tau = {2.0f};
  single.seeds = {rng.bits()};
  single.counters = {static_cast<uint32_t>(rng.bits())};
  single.evidence = {0.0};
  const ResampleRun alone = run_resample(single, false, stream);
  REQUIRE(alone.resampled[0] == 1);

  ResampleCase batch;
  batch.n = kN;
  batch.requests = 9;
  batch.logw.resize(batch.requests * kN);
  for (auto& w : batch.logw)
    w = rng.normal(0.0, 2.0);
  batch.live.assign(batch.logw.size(), 1);
  batch.tau.assign(batch.requests, 2.0f);
  for (int q = 0; q < batch.requests; ++q) {
    batch.seeds.push_back(rng.bits());
    batch.counters.push_back(static_cast<uint32_t>(rng.bits()));
  }
  batch.evidence.assign(batch.requests, 0.0);
  constexpr int kAt = 6;
  std::copy(single.logw.begin(), single.logw.end(), batch.logw.begin() + kAt * kN);
  batch.seeds[kAt] = single.seeds[0];
  batch.counters[kAt] = single.counters[0];
  const ResampleRun together = run_resample(batch, true, stream);
  for (int i = 0; i < kN; ++i)
    CHECK(together.ancestor[kAt * kN + i] - kAt * kN == alone.ancestor[i]);
  CHECK(together.ess[kAt] == alone.ess[0]);
  CHECK(together.evidence[kAt] == alone.evidence[0]);
}

TEST_CASE("resampling ancestor counts match the normalised weights (chi-square, fresh draw counters)") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  // 65,536 resampling trials; 16,384 under a sanitizer, 4,096 under racecheck (cells of expected count < 5
  // pooled, so the chi-square approximation holds at every count).
  constexpr int kN = 8, kLaunches = 4;
  const int requests = test::sanitizer_scaled(16384, 4096, 1024);
  // Small weights first so that several particles compete for each systematic position.
  std::vector<double> logw(kN);
  for (int i = 0; i < kN; ++i)
    logw[i] = std::log(rng.uniform(0.2, 1.0) * (i < 3 ? 0.2 : 1.0));
  std::vector<double> weights(kN);
  const double max_logw = *std::max_element(logw.begin(), logw.end());
  for (int i = 0; i < kN; ++i)
    weights[i] = std::exp(logw[i] - max_logw);
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  for (double& w : weights)
    w /= total;
  std::vector<double> cumulative(kN + 1, 0.0);
  for (int i = 0; i < kN; ++i)
    cumulative[i + 1] = cumulative[i] + weights[i];
  cumulative[kN] = 1.0;

  ResampleCase c;
  c.n = kN;
  c.requests = requests;
  c.live.assign(requests * kN, 1);
  c.tau.assign(requests, 2.0f); // ESS <= N < 2N: always resample
  c.seeds.assign(requests, rng.bits());
  c.evidence.assign(requests, 0.0);
  c.logw.resize(requests * kN);
  for (int q = 0; q < requests; ++q)
    std::copy(logw.begin(), logw.end(), c.logw.begin() + q * kN);
  c.counters.resize(requests);

  // Position m = (u + m) / N goes to particle i with probability N * |[C_i, C_{i+1}) & [m / N, (m + 1) / N)|:
  // one categorical variable per position and trial, independent across trials (fresh draw counters).
  std::vector<std::vector<double>> observed(kN, std::vector<double>(kN, 0.0));
  std::vector<double> total_offspring(kN, 0.0);
  const uint32_t first_counter = static_cast<uint32_t>(rng.bits());
  for (int launch = 0; launch < kLaunches; ++launch) {
    for (int q = 0; q < requests; ++q)
      c.counters[q] = first_counter + static_cast<uint32_t>(launch * requests + q);
    const ResampleRun run = run_resample(c, launch % 2 == 1, stream);
    for (int q = 0; q < requests; ++q) {
      REQUIRE(run.resampled[q] == 1);
      const std::vector<int> counts = offspring_counts(run.ancestor, q, kN);
      int position = 0;
      for (int i = 0; i < kN; ++i) {
        REQUIRE(counts[i] >= std::floor(kN * weights[i] - 1e-9));
        REQUIRE(counts[i] <= std::ceil(kN * weights[i] + 1e-9));
        total_offspring[i] += counts[i];
        for (int copy = 0; copy < counts[i]; ++copy)
          observed[position++][i] += 1.0;
      }
      REQUIRE(position == kN);
    }
  }
  const double trials = static_cast<double>(requests) * kLaunches;
  for (int m = 0; m < kN; ++m) {
    CAPTURE(m);
    double statistic = 0.0, other_expected = 0.0, other_observed = 0.0;
    int cells = 0;
    for (int i = 0; i < kN; ++i) {
      const double lo = std::max(cumulative[i], static_cast<double>(m) / kN);
      const double hi = std::min(cumulative[i + 1], static_cast<double>(m + 1) / kN);
      const double expected = trials * kN * std::max(0.0, hi - lo);
      if (expected < 5.0) { // pooled so every cell of the statistic is large enough
        other_expected += expected;
        other_observed += observed[m][i];
        continue;
      }
      statistic += (observed[m][i] - expected) * (observed[m][i] - expected) / expected;
      ++cells;
    }
    if (other_expected >= 5.0) {
      statistic += (other_observed - other_expected) * (other_observed - other_expected) / other_expected;
      ++cells;
    } else {
      CHECK(other_observed <=
            5.0 + 10.0 * other_expected); // essentially impossible cells stay (almost) empty
    }
    if (cells > 1) {
      const double p = test::chi_square_p_value(statistic, cells - 1);
      CHECK_MESSAGE(p >= 1e-4 / kN, "position " << m << ": chi-square " << statistic << ", p = " << p);
    }
  }
  // Total offspring against N * w (systematic resampling has less variance than the multinomial this
  // statistic assumes, so this is conservative: it catches bias, not excess regularity).
  double statistic = 0.0;
  for (int i = 0; i < kN; ++i) {
    const double expected = trials * kN * weights[i];
    statistic += (total_offspring[i] - expected) * (total_offspring[i] - expected) / expected;
  }
  const double p = test::chi_square_p_value(statistic, kN - 1);
  CHECK_MESSAGE(p >= 1e-4, "total offspring chi-square " << statistic << ", p = " << p);
}

TEST_CASE(
    "collect_freed_slots and reshuffle_and_collect push the freed slots in ascending id order, with and "
    "without the summary bitmap") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  const int trials = test::sanitizer_scaled(24, 6, 3);
  for (int trial = 0; trial < trials; ++trial) {
    const int requests = static_cast<int>(rng.integer(1, 48));
    const int n = static_cast<int>(rng.integer(1, 12));
    const int max_seq_len = static_cast<int>(rng.integer(4, 300));
    // Pools past one pass of the 1024-thread collect (4096 bitmap words = 131072 slots) in some trials.
    const int pool_size = trial % 3 == 0
                              ? static_cast<int>(rng.integer(131073, 400000))
                              : static_cast<int>(rng.integer(requests * n * 2, requests * n * max_seq_len));
    const bool summary = trial % 2 == 0;
    CAPTURE(trial);
    CAPTURE(requests);
    CAPTURE(n);
    CAPTURE(pool_size);
    CAPTURE(summary);
    const HostSlots initial = reference::random_slot_state(rng.engine(), requests, n, max_seq_len, pool_size);
    std::vector<int32_t> plan = reference::random_plan(rng.engine(), requests, n);
    std::vector<uint8_t> finished(initial.rows);
    for (auto& f : finished)
      f = rng.uniform() < 0.3;
    // The reference pushes freed slots as it meets them; the deferred path pushes them in id order.
    HostSlots expected = initial;
    std::vector<uint8_t> expected_finished = finished;
    reference::reshuffle_ref(expected, plan, expected_finished);
    std::sort(expected.free_stack.begin() + initial.free_count,
              expected.free_stack.begin() + expected.free_count);
    const int words = (pool_size + 31) / 32, summary_words = (words + 31) / 32;
    DeviceBuffer<int32_t> d_plan = to_device(plan, stream);
    DeviceBuffer<uint32_t> d_ticket(1);
    d_ticket.fill_bytes(0, stream);
    for (const bool fused : {false, true}) {
      for (const bool captured : kModes) {
        CAPTURE(fused);
        CAPTURE(captured);
        DeviceSlots device(pool_size, initial.rows, max_seq_len);
        device.upload(initial, stream);
        DeviceBuffer<uint8_t> d_finished = to_device(finished, stream);
        DeviceBuffer<uint32_t> d_freed(words), d_summary(summary_words);
        d_freed.fill_bytes(0, stream);
        d_summary.fill_bytes(0, stream);
        SlotPoolView pool = device.pool();
        pool.freed = d_freed.data();
        pool.freed_summary = summary ? d_summary.data() : nullptr;
        detail::CycleBuffers b;
        b.pool = pool;
        b.ancestor = d_plan.data();
        b.finished = d_finished.data();
        b.collect_ticket = d_ticket.data();
        run_on_stream(captured, stream, [&](cudaStream_t s) {
          if (fused) {
            detail::reshuffle_and_collect(b, device.tables(), s);
          } else {
            reshuffle(pool, device.tables(), d_plan.data(), d_finished.data(), s);
            collect_freed_slots(pool, s);
          }
        });
        const HostSlots actual = device.download(stream);
        const std::string difference = reference::compare_slots(expected, actual, /*exact_order=*/true);
        REQUIRE_MESSAGE(difference.empty(), difference);
        REQUIRE(to_host(d_finished.data(), initial.rows, stream) == expected_finished);
        const auto freed = to_host(d_freed.data(), words, stream);
        const auto summary_left = to_host(d_summary.data(), summary_words, stream);
        CHECK(std::all_of(freed.begin(), freed.end(), [](uint32_t w) { return w == 0; }));
        CHECK(std::all_of(summary_left.begin(), summary_left.end(), [](uint32_t w) { return w == 0; }));
        CHECK(to_host(d_ticket.data(), 1, stream)[0] == 0u); // reset for the next launch
        const SlotCheck check = actual.check();
        REQUIRE_MESSAGE(check.ok, check.problem);
      }
    }
  }
}

TEST_CASE("reshuffle matches the reference, and an identity plan is a no-op") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  for (int trial = 0; trial < 30; ++trial) {
    const int requests = static_cast<int>(rng.integer(1, 40));
    const int n = static_cast<int>(rng.integer(1, 16));
    const int max_seq_len = static_cast<int>(rng.integer(4, 300)); // > 128: CTAs loop over positions
    const int pool_size = static_cast<int>(rng.integer(requests * n * 2, requests * n * max_seq_len));
    CAPTURE(trial);
    CAPTURE(requests);
    CAPTURE(n);
    const HostSlots initial = reference::random_slot_state(rng.engine(), requests, n, max_seq_len, pool_size);
    std::vector<int32_t> plan = reference::random_plan(rng.engine(), requests, n);
    for (int q = 0; q < requests; ++q) {
      if (rng.uniform() < 0.3)
        std::iota(plan.begin() + q * n, plan.begin() + (q + 1) * n, q * n);
    }
    std::vector<uint8_t> finished(initial.rows);
    for (auto& f : finished)
      f = rng.uniform() < 0.3;
    std::vector<int32_t> identity(initial.rows);
    std::iota(identity.begin(), identity.end(), 0);

    HostSlots expected = initial;
    std::vector<uint8_t> expected_finished = finished;
    reference::reshuffle_ref(expected, plan, expected_finished);
    DeviceBuffer<int32_t> d_plan = to_device(plan, stream), d_identity = to_device(identity, stream);
    for (const bool captured : kModes) {
      CAPTURE(captured);
      DeviceSlots device(pool_size, initial.rows, max_seq_len);
      device.upload(initial, stream);
      DeviceBuffer<uint8_t> d_finished = to_device(finished, stream);
      run_on_stream(captured, stream, [&](cudaStream_t s) {
        reshuffle(device.pool(), device.tables(), d_plan.data(), d_finished.data(), s);
      });
      const HostSlots actual = device.download(stream);
      const std::string difference = reference::compare_slots(expected, actual, false);
      REQUIRE_MESSAGE(difference.empty(), difference);
      for (int i = 0; i < std::min(initial.free_count, actual.free_count); ++i) {
        REQUIRE(actual.free_stack[i] == initial.free_stack[i]); // pushes only append
      }
      REQUIRE(to_host(d_finished.data(), initial.rows, stream) == expected_finished);
      const SlotCheck check = actual.check();
      REQUIRE_MESSAGE(check.ok, check.problem);

      device.upload(initial, stream);
      DeviceBuffer<uint8_t> d_finished_identity = to_device(finished, stream);
      run_on_stream(captured, stream, [&](cudaStream_t s) {
        reshuffle(device.pool(), device.tables(), d_identity.data(), d_finished_identity.data(), s);
      });
      const std::string unchanged = reference::compare_slots(initial, device.download(stream), true);
      REQUIRE_MESSAGE(unchanged.empty(), unchanged);
      REQUIRE(to_host(d_finished_identity.data(), initial.rows, stream) == finished);
    }
  }
}
