// Host references of verify / stochastic verify / pack on seed 000's oracle construction, their exactness,
// and launcher validation (which runs before any CUDA call, so it needs no GPU).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "reference/sample_ref.hpp"
#include "reference/verify_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/types.hpp"
#include "smcgraph/verify.hpp"
#include "support/test_util.hpp"

namespace reference = smcgraph::reference;
namespace test = smcgraph::test;
using smcgraph::DType;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST_CASE("greedy reference reproduces seed 000's oracle") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  for (int draft_steps : {1, 3, 8, 31, 32, 33, 64, 128, 256}) {
    for (double alpha : {0.0, 0.3, 0.6, 0.9, 1.0}) {
      const auto batch = reference::make_oracle_batch(rng.engine(), 64, draft_steps, 4096, alpha);
      const auto verdict = reference::verify_greedy(batch.draft.data(), draft_steps, batch.target.data(),
                                                    draft_steps + 1, 64, draft_steps, 4096);
      for (int row = 0; row < 64; ++row) {
        INFO("draft_steps " << draft_steps << " alpha " << alpha << " row " << row);
        const int k = batch.accepted[row];
        CHECK(verdict.accepted[row] == k);
        CHECK(verdict.mismatch[row] == (k < draft_steps ? 1 : 0));
        CHECK(verdict.next_tokens[row] == batch.target[row * (draft_steps + 1) + k]);
        CHECK(verdict.row_flags[row] == 0u);
      }
      CHECK(verdict.status == 0u);
    }
  }
}

TEST_CASE("greedy reference: out-of-range ids count as a mismatch and raise kFlagTokenOutOfRange") {
  const int draft_steps = 5, vocab = 10;
  // row 0: -1 padding after two matches; row 1: id == vocab first; row 2: a real mismatch before the padding
  // (the padding is never reached: no flag); row 3: all match but the bonus is out of range.
  const std::vector<int32_t> draft = {1,      2, -1, -1, -1, /**/ 10, 2, 3, 4, 5,
                                      /**/ 1, 2, 3,  -1, -1, /**/ 1,  2, 3, 4, 5};
  const std::vector<int32_t> target = {1,      2, 7, 7, 7, 7, /**/ 10, 2, 3, 4, 5, 6, /**/ 1, 9, 3, 4, 5, 6,
                                       /**/ 1, 2, 3, 4, 5, 12};
  const auto verdict = reference::verify_greedy(draft.data(), draft_steps, target.data(), draft_steps + 1, 4,
                                                draft_steps, vocab);
  CHECK(verdict.accepted == std::vector<int32_t>{2, 0, 1, 5});
  CHECK(verdict.next_tokens == std::vector<int32_t>{7, smcgraph::kInvalidToken, 9, smcgraph::kInvalidToken});
  CHECK(verdict.row_flags == std::vector<uint32_t>{smcgraph::kFlagTokenOutOfRange,
                                                   smcgraph::kFlagTokenOutOfRange, 0u,
                                                   smcgraph::kFlagTokenOutOfRange});
  CHECK(verdict.mismatch == std::vector<uint8_t>{1, 1, 1, 0});
  CHECK(verdict.status == smcgraph::kFlagTokenOutOfRange);
}

TEST_CASE("pack reference gathers kv[i, 0:k_i] (+ position k_i) at exclusive offsets") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  const int rows = 9, draft_steps = 6, width = 3;
  const auto batch = reference::make_oracle_batch(rng.engine(), rows, draft_steps, 100, 0.6);
  const auto verdict = reference::verify_greedy(batch.draft.data(), draft_steps, batch.target.data(),
                                                draft_steps + 1, rows, draft_steps, 100);
  const int64_t row_stride = (draft_steps + 1) * width; // a [rows, draft_steps + 1, D] tensor
  std::vector<float> payload(rows * row_stride);
  for (size_t i = 0; i < payload.size(); ++i)
    payload[i] = static_cast<float>(i);
  for (bool include_next : {false, true}) {
    const auto packed =
        reference::pack(verdict.accepted.data(), verdict.next_tokens.data(), batch.draft.data(), draft_steps,
                        reinterpret_cast<const uint8_t*>(payload.data()), row_stride, rows, draft_steps,
                        width, 4, include_next);
    int32_t offset = 0;
    for (int row = 0; row < rows; ++row) {
      const int count = batch.accepted[row] + (include_next ? 1 : 0);
      CHECK(packed.offsets[row] == offset);
      for (int j = 0; j < count; ++j) {
        float value[3];
        std::memcpy(value, packed.bytes.data() + (offset + j) * width * 4, sizeof(value));
        for (int e = 0; e < width; ++e)
          CHECK(value[e] == payload[row * row_stride + j * width + e]);
        const int32_t expected_token =
            j < batch.accepted[row] ? batch.draft[row * draft_steps + j] : verdict.next_tokens[row];
        CHECK(packed.tokens[offset + j] == expected_token);
      }
      offset += count;
    }
    CHECK(packed.total == offset);
    CHECK(packed.bytes.size() == static_cast<size_t>(offset) * width * 4);
  }
  // Counts outside [0, draft_steps] are clamped.
  const std::vector<int32_t> wild = {-3, 99};
  const auto clamped =
      reference::pack(wild.data(), nullptr, nullptr, 0, reinterpret_cast<const uint8_t*>(payload.data()),
                      row_stride, 2, draft_steps, width, 4, false);
  CHECK(clamped.offsets == std::vector<int32_t>{0, 0});
  CHECK(clamped.total == draft_steps);
}

/// Host-side stochastic problem with one shared logits block [positions, V] for every row (row stride 0).
struct SharedProblem {
  int rows = 0, draft_steps = 0, vocab = 0;
  std::vector<float> target_logits, draft_logits; // [draft_steps + 1, V], [draft_steps, V]
  float target_t = 1.0f, draft_t = 1.0f;
  std::vector<int32_t> tokens;
  std::vector<float> target_logprobs, draft_logprobs;
  std::vector<float> target_temperature, draft_temperature;
  std::vector<uint64_t> seeds;
  std::vector<uint32_t> counters;

  /// Draft tokens drawn from q on the host (independent of Philox), log-probs from the reference.
  void draw_tokens(std::mt19937_64& engine) {
    std::vector<std::vector<double>> q(draft_steps), log_p(draft_steps), log_q(draft_steps);
    for (int j = 0; j < draft_steps; ++j) {
      for (int v = 0; v < vocab; ++v) {
        uint32_t flags = 0;
        log_q[j].push_back(reference::token_logprob(&draft_logits[j * vocab], vocab, draft_t, v, &flags));
        log_p[j].push_back(reference::token_logprob(&target_logits[j * vocab], vocab, target_t, v, &flags));
        q[j].push_back(std::exp(log_q[j].back()));
      }
    }
    tokens.resize(static_cast<size_t>(rows) * draft_steps);
    target_logprobs.resize(tokens.size());
    draft_logprobs.resize(tokens.size());
    for (int j = 0; j < draft_steps; ++j) {
      std::discrete_distribution<int> from_q(q[j].begin(), q[j].end());
      for (int row = 0; row < rows; ++row) {
        const int d = from_q(engine);
        tokens[row * draft_steps + j] = d;
        target_logprobs[row * draft_steps + j] = static_cast<float>(log_p[j][d]);
        draft_logprobs[row * draft_steps + j] = static_cast<float>(log_q[j][d]);
      }
    }
    target_temperature.assign(rows, target_t);
    draft_temperature.assign(rows, draft_t);
  }

  reference::StochasticProblem view() const {
    reference::StochasticProblem p;
    p.draft_tokens = tokens.data();
    p.draft_token_row_stride = draft_steps;
    p.draft_logprobs = draft_logprobs.data();
    p.draft_logprob_row_stride = draft_steps;
    p.target_logprobs = target_logprobs.data();
    p.target_logprob_row_stride = draft_steps;
    p.draft_logits = draft_logits.data();
    p.draft_position_stride = vocab;
    p.target_logits = target_logits.data();
    p.target_position_stride = vocab;
    p.draft_temperature = draft_temperature.data();
    p.target_temperature = target_temperature.data();
    p.seeds = seeds.data();
    p.draw_counters = counters.data();
    p.rows = rows;
    p.draft_steps = draft_steps;
    p.vocab = vocab;
    return p;
  }
};

std::vector<double> softmax(const float* logits, int vocab, double temperature) {
  std::vector<double> p(vocab);
  double m = -INFINITY;
  for (int v = 0; v < vocab; ++v)
    m = std::max(m, logits[v] / temperature);
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v)
    sum += p[v] = std::exp(logits[v] / temperature - m);
  for (double& x : p)
    x /= sum;
  return p;
}

/// Chi-square p-value of `counts` against probabilities `p` (bins with expectation < 5 merged); counts where
/// p = 0 must be 0.
double goodness_of_fit(const std::vector<long>& counts, const std::vector<double>& p) {
  long n = std::accumulate(counts.begin(), counts.end(), 0L);
  double statistic = 0.0, small_expected = 0.0;
  long small_observed = 0;
  int bins = 0;
  for (size_t v = 0; v < p.size(); ++v) {
    if (p[v] == 0.0) {
      CHECK(counts[v] == 0);
      continue;
    }
    const double expected = n * p[v];
    if (expected < 5.0) {
      small_expected += expected;
      small_observed += counts[v];
      continue;
    }
    statistic += (counts[v] - expected) * (counts[v] - expected) / expected;
    ++bins;
  }
  if (small_expected > 0.0) {
    statistic += (small_observed - small_expected) * (small_observed - small_expected) / small_expected;
    ++bins;
  }
  return bins > 1 ? test::chi_square_p_value(statistic, bins - 1) : 1.0;
}

TEST_CASE("stochastic reference: emitted tokens follow p, also with q = 0 and p = 0 entries") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  const int draft_steps = 2, rows = 40000;
  for (int variant = 0; variant < 4; ++variant) {
    INFO("variant " << variant);
    // Variant 3: a row of 2500 fp32 logits is 2 tiles of 4 sub-tiles (verify.hpp), so both levels of the
    // draw decide; wider logits keep the expected counts of the likely tokens large.
    const int vocab = variant == 3 ? 2500 : 8;
    const double spread = variant == 3 ? 3.0 : 1.5;
    // The p-values of both positions for one fresh problem; the smaller one is confirmed on a second problem
    // when it is <= 1e-4 (test::confirmed_fit).
    struct Fits {
      double first, second, p_value;
    };
    const Fits fits = test::confirmed_fit<Fits>([&] {
      SharedProblem problem;
      problem.rows = rows;
      problem.draft_steps = draft_steps;
      problem.vocab = vocab;
      problem.target_t = 1.0f;
      problem.draft_t = 0.7f;
      for (int j = 0; j < draft_steps + 1; ++j)
        for (int v = 0; v < vocab; ++v)
          problem.target_logits.push_back(static_cast<float>(rng.normal(0.0, spread)));
      for (int j = 0; j < draft_steps; ++j)
        for (int v = 0; v < vocab; ++v)
          problem.draft_logits.push_back(static_cast<float>(rng.normal(0.0, spread)));
      if (variant == 1) // the draft masks tokens the target likes: only the residual can emit them
        for (int j = 0; j < draft_steps; ++j)
          problem.draft_logits[j * vocab + 0] = problem.draft_logits[j * vocab + 3] = -kInf;
      if (variant == 2) // the target masks tokens the draft proposes: always rejected, never emitted
        for (int j = 0; j <= draft_steps; ++j)
          problem.target_logits[j * vocab + 1] = problem.target_logits[j * vocab + 5] = -kInf;
      problem.draw_tokens(rng.engine());
      problem.seeds.assign(rows, rng.bits());
      problem.counters.resize(rows);
      std::iota(problem.counters.begin(), problem.counters.end(), 0u);
      const auto verdict = reference::verify_stochastic(problem.view());
      std::vector<long> first(vocab, 0), second(vocab, 0);
      for (int row = 0; row < rows; ++row) {
        REQUIRE(verdict.row_flags[row] == 0u);
        const int k = verdict.accepted[row];
        first[k == 0 ? verdict.next_tokens[row] : problem.tokens[row * draft_steps]]++;
        if (k >= 1)
          second[k == 1 ? verdict.next_tokens[row] : problem.tokens[row * draft_steps + 1]]++;
      }
      const double p_first = goodness_of_fit(first, softmax(&problem.target_logits[0], vocab, 1.0));
      const double p_second = goodness_of_fit(second, softmax(&problem.target_logits[vocab], vocab, 1.0));
      return Fits{p_first, p_second, std::min(p_first, p_second)};
    });
    CHECK(fits.first > 1e-4);
    CHECK(fits.second > 1e-4);
  }
}

TEST_CASE("stochastic reference: p == q accepts every draft token and draws the bonus from p") {
  test::Rng rng;
  SharedProblem problem;
  problem.rows = 200;
  problem.draft_steps = 3;
  problem.vocab = 6;
  for (int i = 0; i < 4 * 6; ++i)
    problem.target_logits.push_back(static_cast<float>(rng.normal()));
  problem.draft_logits.assign(problem.target_logits.begin(), problem.target_logits.begin() + 3 * 6);
  problem.draw_tokens(rng.engine());
  problem.seeds.assign(200, rng.bits());
  problem.counters.assign(200, 7u);
  const auto verdict = reference::verify_stochastic(problem.view());
  for (int row = 0; row < 200; ++row) {
    CHECK(verdict.accepted[row] == 3);
    CHECK(verdict.mismatch[row] == 0);
    CHECK(verdict.coin_margin[row] == std::numeric_limits<double>::infinity()); // no coin was needed
    CHECK(verdict.next_tokens[row] >= 0);
  }
}

TEST_CASE("stochastic reference: row failures are flagged and stay in bounds") {
  SharedProblem problem;
  problem.rows = 5;
  problem.draft_steps = 2;
  problem.vocab = 4;
  problem.target_logits = {0, 1, 2, 3, /**/ 1, 1, 1, 1, /**/ 0, 0, 0, 0};
  problem.draft_logits = {3, 2, 1, 0, /**/ 1, 1, 1, 1};
  std::mt19937_64 engine(1);
  problem.draw_tokens(engine);
  problem.seeds.assign(5, 11u);
  problem.counters.assign(5, 3u);
  problem.target_temperature[0] = -1.0f;    // bad temperature
  problem.target_logprobs[1 * 2 + 0] = NAN; // NaN log-prob at the first position
  problem.tokens[2 * 2 + 0] = -1;           // -1 padding: rejected at 0, residual still drawn
  problem.target_logprobs[3 * 2 + 0] = problem.draft_logprobs[3 * 2 + 0]; // accept position 0 surely...
  problem.target_logprobs[3 * 2 + 1] = problem.draft_logprobs[3 * 2 + 1]; // ...and 1: the bonus reads row 2
  problem.target_logits[2 * 4 + 2] = NAN; // a NaN in the bonus row (shared by every row)
  const auto verdict = reference::verify_stochastic(problem.view());
  CHECK(verdict.row_flags[0] == smcgraph::kFlagBadParameter);
  CHECK(verdict.accepted[0] == 0);
  CHECK(verdict.next_tokens[0] == smcgraph::kInvalidToken);
  CHECK(verdict.row_flags[1] == smcgraph::kFlagNanLogit);
  CHECK(verdict.accepted[1] == 0);
  CHECK(verdict.next_tokens[1] == smcgraph::kInvalidToken);
  CHECK(verdict.row_flags[2] == smcgraph::kFlagTokenOutOfRange);
  CHECK(verdict.accepted[2] == 0);
  CHECK(verdict.next_tokens[2] >= 0);
  CHECK(verdict.accepted[3] == 2);
  CHECK(verdict.row_flags[3] == smcgraph::kFlagNanLogit);
  CHECK(verdict.next_tokens[3] == smcgraph::kInvalidToken);
  CHECK(verdict.status ==
        (smcgraph::kFlagBadParameter | smcgraph::kFlagNanLogit | smcgraph::kFlagTokenOutOfRange));
}

TEST_CASE("stochastic reference: T = 0 is greedy on either side") {
  SharedProblem problem;
  problem.rows = 50;
  problem.draft_steps = 1;
  problem.vocab = 5;
  problem.target_logits = {0, 4, 1, 2, 3, /**/ 5, 0, 0, 0, 1};
  problem.draft_logits = {1, 1, 1, 1, 1};
  problem.target_t = 0.0f; // p one-hot at 1 (position 0) and 0 (position 1)
  std::mt19937_64 engine(2);
  problem.draw_tokens(engine);
  problem.seeds.assign(50, 5u);
  problem.counters.resize(50);
  std::iota(problem.counters.begin(), problem.counters.end(), 0u);
  const auto verdict = reference::verify_stochastic(problem.view());
  for (int row = 0; row < 50; ++row) {
    if (problem.tokens[row] == 1) {
      CHECK(verdict.accepted[row] == 1);
      CHECK(verdict.next_tokens[row] == 0);
    } else {
      CHECK(verdict.accepted[row] == 0);
      CHECK(verdict.next_tokens[row] == 1);
    }
  }
}

// --- launcher validation -----------------------------------------------------------------------------------

const int32_t* const kTokens = reinterpret_cast<const int32_t*>(0x1000);
int32_t* const kInts = reinterpret_cast<int32_t*>(0x2000);
const float* const kFloats = reinterpret_cast<const float*>(0x3000);
uint8_t* const kBytes = reinterpret_cast<uint8_t*>(0x4000);
void* const kPacked = reinterpret_cast<void*>(0x5000);
const void* const kLogits = reinterpret_cast<const void*>(0x6000);
const uint64_t* const kSeeds = reinterpret_cast<const uint64_t*>(0x7000);
const uint32_t* const kCounters = reinterpret_cast<const uint32_t*>(0x8000);

template <class F> std::string error_of(F&& call) {
  try {
    call();
  } catch (const smcgraph::Error& e) {
    return e.what();
  }
  return "no error";
}

smcgraph::TokenVerifyInputs good_tokens() {
  return {kTokens, 8, kTokens, 9, 4, 8, 1000};
}
smcgraph::VerifyOutputs good_verdict() {
  return {kInts, kInts, kBytes};
}
smcgraph::PayloadView good_payload() {
  return {kLogits, DType::kFloat16, 128, 8 * 128};
}
smcgraph::PackOutputs good_pack() {
  return {kPacked, 4 * 8, kInts, kInts};
}

TEST_CASE("verify_greedy names the bad parameter and its value") {
  auto run = [](smcgraph::TokenVerifyInputs in, smcgraph::VerifyOutputs out) {
    return error_of([&] { smcgraph::verify_greedy(in, out, nullptr); });
  };
  auto in = good_tokens();
  in.draft_steps = 0;
  CHECK(run(in, good_verdict()) ==
        "smcgraph::verify_greedy: draft_steps = 0: must be in [1, kMaxVerifyDraftSteps]");
  in = good_tokens();
  in.rows = -2;
  CHECK(run(in, good_verdict()) == "smcgraph::verify_greedy: rows = -2: must be >= 1");
  in = good_tokens();
  in.vocab = 0;
  CHECK(run(in, good_verdict()) == "smcgraph::verify_greedy: vocab = 0: must be >= 1");
  in = good_tokens();
  in.draft_tokens = nullptr;
  CHECK(run(in, good_verdict()) == "smcgraph::verify_greedy: draft_tokens = null: must be a device pointer");
  in = good_tokens();
  in.target_tokens = nullptr;
  CHECK(run(in, good_verdict()) == "smcgraph::verify_greedy: target_tokens = null: must be a device pointer");
  in = good_tokens();
  in.target_row_stride = 8;
  CHECK(run(in, good_verdict()) ==
        "smcgraph::verify_greedy: target_row_stride = 8: must be >= draft_steps + 1");
  in = good_tokens();
  in.draft_row_stride = 7;
  CHECK(run(in, good_verdict()) == "smcgraph::verify_greedy: draft_row_stride = 7: must be >= draft_steps");
  auto out = good_verdict();
  out.accepted = nullptr;
  CHECK(run(good_tokens(), out) == "smcgraph::verify_greedy: out.accepted = null: must be a device pointer");
  out = good_verdict();
  out.next_tokens = nullptr;
  CHECK(run(good_tokens(), out) ==
        "smcgraph::verify_greedy: out.next_tokens = null: must be a device pointer");
}

TEST_CASE("verify_and_pack and pack_accepted name the bad parameter and its value") {
  smcgraph::PackWorkspace workspace; // never reached: validation fails first, or on max_rows
  auto fused = [&](smcgraph::TokenVerifyInputs in, smcgraph::PayloadView payload, smcgraph::PackOutputs out,
                   bool include_next = false) {
    return error_of([&] {
      smcgraph::verify_and_pack(in, payload, include_next, good_verdict(), out, workspace, nullptr);
    });
  };
  const std::string where = "smcgraph::verify_and_pack: ";
  auto in = good_tokens();
  in.draft_steps = -1;
  CHECK(fused(in, good_payload(), good_pack()) ==
        where + "draft_steps = -1: must be in [1, kMaxVerifyDraftSteps]");
  in = good_tokens();
  in.rows = 0;
  CHECK(fused(in, good_payload(), good_pack()) == where + "rows = 0: must be >= 1");
  auto payload = good_payload();
  payload.width = 0;
  CHECK(fused(good_tokens(), payload, good_pack()) == where + "payload.width = 0: must be >= 1");
  payload = good_payload();
  payload.data = nullptr;
  CHECK(fused(good_tokens(), payload, good_pack()) ==
        where + "payload.data = null: must be a device pointer");
  payload = good_payload();
  CHECK(fused(good_tokens(), payload, good_pack(), true) ==
        where + "payload.row_stride = 1024: must be >= (draft_steps + include_next) * width");
  payload.data = reinterpret_cast<const void*>(0x6001);
  CHECK(fused(good_tokens(), payload, good_pack()).find("payload.data = 0x6001: must be aligned") !=
        std::string::npos);
  payload = good_payload();
  payload.expected_packed_fraction = 1.5f;
  CHECK(fused(good_tokens(), payload, good_pack()) ==
        where + "payload.expected_packed_fraction = 1.5: must be in [0, 1]");
  payload.expected_packed_fraction = -0.25f;
  CHECK(fused(good_tokens(), payload, good_pack()) ==
        where + "payload.expected_packed_fraction = -0.25: must be in [0, 1]");
  payload.expected_packed_fraction = std::nanf("");
  CHECK(fused(good_tokens(), payload, good_pack()).find("payload.expected_packed_fraction = nan") !=
        std::string::npos);
  // The copy-plan queries check the copy unit before asking the device anything.
  const smcgraph::PayloadView odd{nullptr, smcgraph::DType::kFloat16, 3, 0, true, 0.9f}; // 6-byte positions
  CHECK(error_of([&] { smcgraph::pack_source_order(4, 8, odd, false, false, 4); }) ==
        "smcgraph::pack_source_order: vector_bytes = 4: must divide a position's bytes (width * dtype size)");
  CHECK(error_of([&] { smcgraph::pack_source_order(4, 8, odd, false, false, 32); }) ==
        "smcgraph::pack_source_order: vector_bytes = 32: must be 16, 8, 4 or 2");
  CHECK(error_of([&] { smcgraph::pack_preloads(4, 8, 3, smcgraph::DType::kFloat16, false, false, 4); }) ==
        "smcgraph::pack_preloads: vector_bytes = 4: must divide a position's bytes (width * dtype size)");
  auto out = good_pack();
  out.packed = nullptr;
  CHECK(fused(good_tokens(), good_payload(), out) == where + "out.packed = null: must be a device pointer");
  out = good_pack();
  out.offsets = nullptr;
  CHECK(fused(good_tokens(), good_payload(), out) == where + "out.offsets = null: must be a device pointer");
  out = good_pack();
  out.total = nullptr;
  CHECK(fused(good_tokens(), good_payload(), out) == where + "out.total = null: must be a device pointer");
  out = good_pack();
  out.capacity_rows = 31;
  CHECK(fused(good_tokens(), good_payload(), out) ==
        where + "out.capacity_rows = 31: must be >= rows * (draft_steps + include_next)");
  CHECK(fused(good_tokens(), good_payload(), good_pack()) ==
        where + "workspace.max_rows = 0: must be >= rows");
  in = good_tokens();
  in.rows = 1 << 27;
  CHECK(fused(in, good_payload(), good_pack()) ==
        where + "rows * (draft_steps + include_next) = 1073741824: must be < 2^30");

  auto counts = [&](smcgraph::AcceptedRows accepted, smcgraph::PackOutputs out, bool include_next = false) {
    return error_of(
        [&] { smcgraph::pack_accepted(accepted, good_payload(), include_next, out, workspace, nullptr); });
  };
  const std::string where_counts = "smcgraph::pack_accepted: ";
  const smcgraph::AcceptedRows good_counts{kTokens, 4, 8};
  auto accepted = good_counts;
  accepted.accepted = nullptr;
  CHECK(counts(accepted, good_pack()) == where_counts + "accepted.accepted = null: must be a device pointer");
  accepted = good_counts;
  accepted.draft_steps = 0;
  CHECK(counts(accepted, good_pack()) ==
        where_counts + "accepted.draft_steps = 0: must be in [1, kMaxVerifyDraftSteps]");
  out = good_pack();
  out.packed_tokens = kInts;
  CHECK(counts(good_counts, out) ==
        where_counts +
            "accepted.draft_tokens = null: must be a device pointer when out.packed_tokens is given");
  accepted = good_counts;
  accepted.draft_tokens = kTokens;
  accepted.draft_row_stride = 8;
  out.capacity_rows = 4 * 9;
  CHECK(counts(accepted, out, true) == where_counts +
                                           "accepted.next_tokens = null: must be a device pointer when "
                                           "out.packed_tokens and include_next are given");
  CHECK(counts(good_counts, good_pack()) == where_counts + "workspace.max_rows = 0: must be >= rows");
  CHECK(error_of([] { smcgraph::PackWorkspace bad(0); }) ==
        "smcgraph::PackWorkspace: max_rows = 0: must be >= 1");
  // pack_preloads() checks its copy unit before it asks the device anything.
  CHECK(error_of([] { smcgraph::pack_preloads(32, 8, 128, DType::kFloat16, false, false, 32); }) ==
        "smcgraph::pack_preloads: vector_bytes = 32: must be 16, 8, 4 or 2");
  CHECK(error_of([] { smcgraph::pack_preloads(32, 8, 3, DType::kFloat16, false, false, 4); }) ==
        "smcgraph::pack_preloads: vector_bytes = 4: must divide a position's bytes (width * dtype size)");
}

TEST_CASE("verify_stochastic names the bad parameter and its value") {
  const smcgraph::LogitsView target{kLogits, DType::kBFloat16, 4, 9, 1000, 9000, 1000};
  const smcgraph::LogitsView draft{kLogits, DType::kBFloat16, 4, 8, 1000, 8000, 1000};
  smcgraph::StochasticVerifyInputs good;
  good.draft_tokens = kTokens;
  good.draft_token_row_stride = 8;
  good.draft_logprobs = kFloats;
  good.draft_logprob_row_stride = 8;
  good.target_logprobs = kFloats;
  good.target_logprob_row_stride = 8;
  good.draft_logits = draft;
  good.target_logits = target;
  good.draft_temperature = kFloats;
  good.target_temperature = kFloats;
  good.random = {kSeeds, kCounters, 1};
  good.draft_steps = 8;
  auto run = [](smcgraph::StochasticVerifyInputs in, smcgraph::VerifyOutputs out = good_verdict()) {
    smcgraph::SampleWorkspace none; // vocab 1000: one CTA a row, which uses no workspace
    return error_of([&] { smcgraph::verify_stochastic(in, out, none, nullptr); });
  };
  const std::string where = "smcgraph::verify_stochastic: ";
  auto in = good;
  in.draft_steps = 0;
  CHECK(run(in) == where + "draft_steps = 0: must be in [1, kMaxVerifyDraftSteps]");
  in = good;
  in.target_logits.positions = 8;
  CHECK(run(in) == where + "target_logits.positions = 8: must be >= draft_steps + 1");
  in = good;
  in.draft_logits.positions = 7;
  CHECK(run(in) == where + "draft_logits.positions = 7: must be >= draft_steps");
  in = good;
  in.target_logits.data = nullptr;
  CHECK(run(in) == where + "target_logits.data = null: must be a device pointer");
  in = good;
  in.draft_logits.vocab = 999;
  in.draft_logits.position_stride = 999;
  CHECK(run(in) == where + "draft_logits.vocab = 999: must equal target_logits.vocab");
  in = good;
  in.draft_logits.dtype = DType::kFloat16;
  CHECK(run(in) == where + "draft_logits.dtype = fp16: must equal target_logits.dtype");
  in = good;
  in.target_logits.row_stride = 100;
  CHECK(
      run(in) ==
      where +
          "target_logits.row_stride = 100: must be 0 (one shared row) or lay rows and positions out without "
          "overlap");
  in = good;
  in.draft_logprobs = nullptr;
  CHECK(run(in) == where + "draft_logprobs = null: must be a device pointer");
  in = good;
  in.target_logprobs = nullptr;
  CHECK(run(in) == where + "target_logprobs = null: must be a device pointer");
  in = good;
  in.draft_tokens = nullptr;
  CHECK(run(in) == where + "draft_tokens = null: must be a device pointer");
  in = good;
  in.target_temperature = nullptr;
  CHECK(run(in) == where + "target_temperature = null: must be a device pointer");
  in = good;
  in.random.seeds = nullptr;
  CHECK(run(in) == where + "random.seeds = null: must be a device pointer");
  in = good;
  in.random.particles_per_request = 0;
  CHECK(run(in) == where + "random.particles_per_request = 0: must be >= 1");
  auto out = good_verdict();
  out.next_tokens = nullptr;
  CHECK(run(good, out) == where + "out.next_tokens = null: must be a device pointer");
  // A row longer than one tile (4096 bf16) is split over CTAs, which meet in the workspace: it must be there.
  in = good;
  in.target_logits.vocab = in.draft_logits.vocab = 5000;
  in.target_logits.position_stride = in.draft_logits.position_stride = 5000;
  in.target_logits.row_stride = 9 * 5000;
  in.draft_logits.row_stride = 8 * 5000;
  CHECK(run(in) ==
        where + "workspace.max_jobs = 0: must be >= rows (a row of this vocabulary is split over several "
                "CTAs)");
}

TEST_CASE("pack_launch_shape validates before asking the device") {
  CHECK(error_of([] { smcgraph::pack_launch_shape(0, 8, 128, DType::kFloat16, false, false); }) ==
        "smcgraph::pack_launch_shape: rows = 0: must be >= 1");
  CHECK(error_of([] { smcgraph::pack_launch_shape(4, 8, -1, DType::kFloat16, false, false); }) ==
        "smcgraph::pack_launch_shape: width = -1: must be >= 1");
}

} // namespace
