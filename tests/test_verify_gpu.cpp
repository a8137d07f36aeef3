// verify_greedy() and verify_stochastic() on the GPU: parity with the host references (eager and captured,
// poisoned outputs), row flags, exactness of speculative sampling (chi-square over 10^6 draws, also with
// q = 0 and p = 0 entries), and fresh but host-reproducible draws across graph replays.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "reference/sample_ref.hpp"
#include "reference/verify_ref.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/types.hpp"
#include "smcgraph/verify.hpp"
#include "support/test_util.hpp"

using smcgraph::DeviceBuffer;
using smcgraph::DType;
namespace reference = smcgraph::reference;
namespace test = smcgraph::test;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct VerdictOut {
  std::vector<int32_t> accepted, next_tokens;
  std::vector<uint8_t> mismatch;
  std::vector<uint32_t> flags;
  uint32_t status = 0;
};

/// Output buffers of one verification, poisoned before every run.
struct DeviceVerdict {
  int rows;
  DeviceBuffer<int32_t> accepted, next_tokens;
  DeviceBuffer<uint8_t> mismatch;
  DeviceBuffer<uint32_t> flags, status;
  explicit DeviceVerdict(int r) : rows(r), accepted(r), next_tokens(r), mismatch(r), flags(r), status(1) {}
  smcgraph::VerifyOutputs view() {
    return {accepted.data(), next_tokens.data(), mismatch.data(), flags.data(), status.data()};
  }
  void poison(cudaStream_t stream) {
    accepted.fill_bytes(0xff, stream);
    next_tokens.fill_bytes(0xff, stream);
    mismatch.fill_bytes(0xff, stream);
    flags.fill_bytes(0, stream);
    status.fill_bytes(0, stream);
  }
  VerdictOut read(cudaStream_t stream) {
    VerdictOut out;
    out.accepted = test::to_host(accepted.data(), rows, stream);
    out.next_tokens = test::to_host(next_tokens.data(), rows, stream);
    out.mismatch = test::to_host(mismatch.data(), rows, stream);
    out.flags = test::to_host(flags.data(), rows, stream);
    out.status = test::to_host(status.data(), 1, stream)[0];
    return out;
  }
};

// --- greedy ------------------------------------------------------------------------------------------------

void check_greedy(const std::vector<int32_t>& draft, int64_t draft_stride, const std::vector<int32_t>& target,
                  int64_t target_stride, int rows, int draft_steps, int vocab, smcgraph::Stream& stream) {
  const auto expected = reference::verify_greedy(draft.data(), draft_stride, target.data(), target_stride,
                                                 rows, draft_steps, vocab);
  auto d_draft = test::to_device(draft, stream);
  auto d_target = test::to_device(target, stream);
  DeviceVerdict verdict(rows);
  for (bool captured : {false, true}) {
    INFO("rows " << rows << " draft_steps " << draft_steps << (captured ? " captured" : " eager"));
    verdict.poison(stream);
    test::run_on_stream(captured, stream, [&](cudaStream_t s) {
      smcgraph::verify_greedy(
          {d_draft.data(), draft_stride, d_target.data(), target_stride, rows, draft_steps, vocab},
          verdict.view(), s);
    });
    const VerdictOut out = verdict.read(stream);
    CHECK(out.accepted == expected.accepted);
    CHECK(out.next_tokens == expected.next_tokens);
    CHECK(out.mismatch == expected.mismatch);
    CHECK(out.flags == expected.row_flags);
    CHECK(out.status == expected.status);
  }
}

TEST_CASE("verify_greedy matches seed 000's oracle and the reference") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  const int draft_step_counts[] = {1, 8, 31, 32, 33, 64, 128, 255, 256, 300};
  const int batch_sizes[] = {1, 4, 16, 32, 256, test::sanitizer_scaled(4096, 4096, 512)};
  const double alphas[] = {0.3, 0.6, 0.9};
  int index = 0;
  for (int rows : batch_sizes) {
    for (int draft_steps : draft_step_counts) {
      if (rows > 256 && draft_steps > 64)
        continue;
      const double alpha = alphas[index++ % 3];
      const auto batch = reference::make_oracle_batch(rng.engine(), rows, draft_steps, 4096, alpha);
      const auto expected = reference::verify_greedy(batch.draft.data(), draft_steps, batch.target.data(),
                                                     draft_steps + 1, rows, draft_steps, 4096);
      REQUIRE(expected.accepted == batch.accepted);
      check_greedy(batch.draft, draft_steps, batch.target, draft_steps + 1, rows, draft_steps, 4096, stream);
    }
  }
}

TEST_CASE("verify_greedy: row strides, -1 padding and ids out of range") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  for (int draft_steps : {5, 40}) {
    const int rows = 70, vocab = 300;
    const int64_t draft_stride = draft_steps + 3,
                  target_stride = draft_steps + 7; // e.g. views into wider token buffers
    auto batch = reference::make_oracle_batch(rng.engine(), rows, draft_steps, vocab, 0.8);
    std::vector<int32_t> draft(rows * draft_stride, 77), target(rows * target_stride, 77);
    for (int row = 0; row < rows; ++row) {
      std::copy_n(&batch.draft[row * draft_steps], draft_steps, &draft[row * draft_stride]);
      std::copy_n(&batch.target[row * (draft_steps + 1)], draft_steps + 1, &target[row * target_stride]);
    }
    for (int row = 0; row < rows; row += 2) { // -1 padding from a random position on, or one id >= vocab
      const int j = static_cast<int>(rng.integer(0, draft_steps - 1));
      if (row % 4 == 0) {
        std::fill_n(&draft[row * draft_stride + j], draft_steps - j, -1);
      } else {
        draft[row * draft_stride + j] = vocab + static_cast<int>(rng.integer(0, 5));
      }
    }
    for (int row = 1; row < rows; row += 7)
      target[row * target_stride + draft_steps] = -3; // a bad bonus
    check_greedy(draft, draft_stride, target, target_stride, rows, draft_steps, vocab, stream);
  }
}

// --- stochastic: parity with the reference
// -------------------------------------------------------------------

/// softmax(logits / T) in double; T = 0: weight 1 on every maximum (what a log-prob of 0 / -inf means).
std::vector<double> probabilities(const float* logits, int vocab, float temperature) {
  double m = -std::numeric_limits<double>::infinity();
  for (int v = 0; v < vocab; ++v)
    m = std::max(m, static_cast<double>(logits[v]));
  std::vector<double> p(vocab);
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) {
    p[v] = temperature == 0.0f ? (logits[v] == m ? 1.0 : 0.0) : std::exp((logits[v] - m) / temperature);
    sum += p[v];
  }
  for (double& x : p)
    x /= sum;
  return p;
}

/// A stochastic verification problem: per-row logits as the device sees them, draft tokens drawn from q on
/// the host, and the log-probs score() / sample() would have written (from the reference, in float).
struct Problem {
  DType dtype = DType::kFloat32;
  int rows = 0, draft_steps = 0, vocab = 0, particles = 1;
  int64_t target_row_stride = 0, draft_row_stride = 0; // 0: every row shares row 0's logits
  std::vector<float> target_logits, draft_logits;      // [rows or 1, draft_steps (+1), V]
  std::vector<float> target_t, draft_t;
  std::vector<int32_t> tokens;
  std::vector<float> target_logprobs, draft_logprobs;
  std::vector<uint64_t> seeds;
  std::vector<uint32_t> counters;

  const float* target_row(int row, int j) const {
    return &target_logits[row * target_row_stride + static_cast<int64_t>(j) * vocab];
  }
  const float* draft_row(int row, int j) const {
    return &draft_logits[row * draft_row_stride + static_cast<int64_t>(j) * vocab];
  }

  /// Draws d_j ~ q_j per row (T_d = 0: the draft's argmax) and fills the log-probs.
  void draw_tokens(std::mt19937_64& engine) {
    tokens.resize(static_cast<size_t>(rows) * draft_steps);
    target_logprobs.resize(tokens.size());
    draft_logprobs.resize(tokens.size());
    for (int row = 0; row < rows; ++row) {
      for (int j = 0; j < draft_steps; ++j) {
        const std::vector<double> q = probabilities(draft_row(row, j), vocab, draft_t[row]);
        tokens[row * draft_steps + j] = std::discrete_distribution<int>(q.begin(), q.end())(engine);
      }
      refresh_logprobs(row);
    }
  }

  /// log p(d_j) and log q(d_j) of a row as score() / sample() would write them (after a change to the row).
  void refresh_logprobs(int row) {
    for (int j = 0; j < draft_steps; ++j) {
      uint32_t flags = 0;
      const int32_t d = tokens[row * draft_steps + j];
      target_logprobs[row * draft_steps + j] =
          static_cast<float>(reference::token_logprob(target_row(row, j), vocab, target_t[row], d, &flags));
      draft_logprobs[row * draft_steps + j] =
          static_cast<float>(reference::token_logprob(draft_row(row, j), vocab, draft_t[row], d, &flags));
    }
  }

  reference::StochasticProblem host_view() const {
    reference::StochasticProblem p;
    p.draft_tokens = tokens.data();
    p.draft_token_row_stride = draft_steps;
    p.draft_logprobs = draft_logprobs.data();
    p.draft_logprob_row_stride = draft_steps;
    p.target_logprobs = target_logprobs.data();
    p.target_logprob_row_stride = draft_steps;
    p.draft_logits = draft_logits.data();
    p.draft_row_stride = draft_row_stride;
    p.draft_position_stride = vocab;
    p.target_logits = target_logits.data();
    p.target_row_stride = target_row_stride;
    p.target_position_stride = vocab;
    p.draft_temperature = draft_t.data();
    p.target_temperature = target_t.data();
    p.seeds = seeds.data();
    p.draw_counters = counters.data();
    p.particles_per_request = particles;
    p.rows = rows;
    p.draft_steps = draft_steps;
    p.vocab = vocab;
    p.dtype = dtype;
    return p;
  }
};

/// Device copies of a Problem and one launch of verify_stochastic().
struct DeviceProblem {
  const Problem& problem;
  DeviceBuffer<uint8_t> target_logits, draft_logits;
  DeviceBuffer<int32_t> tokens;
  DeviceBuffer<float> target_logprobs, draft_logprobs, target_t, draft_t;
  DeviceBuffer<uint64_t> seeds;
  DeviceBuffer<uint32_t> counters;
  /// Where a row's tiles meet (rows longer than one tile, verify_tile_length()); a token one otherwise.
  smcgraph::SampleWorkspace workspace;
  DeviceProblem(const Problem& p, cudaStream_t stream)
      : problem(p), tokens(test::to_device(p.tokens, stream)),
        target_logprobs(test::to_device(p.target_logprobs, stream)),
        draft_logprobs(test::to_device(p.draft_logprobs, stream)),
        target_t(test::to_device(p.target_t, stream)), draft_t(test::to_device(p.draft_t, stream)),
        seeds(test::to_device(p.seeds, stream)), counters(test::to_device(p.counters, stream)) {
    target_logits = test::to_device(test::encode_logits(p.dtype, p.target_logits).bytes, stream);
    draft_logits = test::to_device(test::encode_logits(p.dtype, p.draft_logits).bytes, stream);
    workspace = p.vocab > 1024 ? smcgraph::SampleWorkspace(p.rows, p.vocab, stream)
                               : smcgraph::SampleWorkspace(1, 1, stream);
  }
  void launch(const smcgraph::VerifyOutputs& out, cudaStream_t stream) {
    const Problem& p = problem;
    smcgraph::StochasticVerifyInputs in;
    in.draft_tokens = tokens.data();
    in.draft_token_row_stride = p.draft_steps;
    in.draft_logprobs = draft_logprobs.data();
    in.draft_logprob_row_stride = p.draft_steps;
    in.target_logprobs = target_logprobs.data();
    in.target_logprob_row_stride = p.draft_steps;
    in.target_logits = {target_logits.data(), p.dtype, p.rows, p.draft_steps + 1, p.vocab,
                        p.target_row_stride,  p.vocab};
    in.draft_logits = {draft_logits.data(), p.dtype, p.rows, p.draft_steps, p.vocab,
                       p.draft_row_stride,  p.vocab};
    in.draft_temperature = draft_t.data();
    in.target_temperature = target_t.data();
    in.random = {seeds.data(), counters.data(), p.particles};
    in.draft_steps = p.draft_steps;
    smcgraph::verify_stochastic(in, out, workspace, stream);
  }
};

/// Random per-row logits: the draft is the target plus noise (so acceptance is neither ~0 nor ~1), both with
/// a few masked (-inf) entries; temperatures vary per row, some 0 (greedy).
Problem random_problem(test::Rng& rng, DType dtype, int rows, int draft_steps, int vocab) {
  Problem p;
  p.dtype = dtype;
  p.rows = rows;
  p.draft_steps = draft_steps;
  p.vocab = vocab;
  p.target_row_stride = int64_t{draft_steps + 1} * vocab;
  p.draft_row_stride = int64_t{draft_steps} * vocab;
  p.target_logits.resize(rows * p.target_row_stride);
  p.draft_logits.resize(rows * p.draft_row_stride);
  for (int row = 0; row < rows; ++row) {
    for (int j = 0; j <= draft_steps; ++j) {
      float* target = &p.target_logits[row * p.target_row_stride + j * vocab];
      for (int v = 0; v < vocab; ++v) {
        target[v] = test::round_to(dtype, static_cast<float>(rng.normal(0.0, 2.0)));
        if (rng.uniform() < 0.05)
          target[v] = -kInf;
      }
      target[rng.integer(0, vocab - 1)] = test::round_to(dtype, static_cast<float>(5.0 + rng.normal()));
      if (j == draft_steps)
        break;
      float* draft = &p.draft_logits[row * p.draft_row_stride + j * vocab];
      for (int v = 0; v < vocab; ++v) {
        const float base = target[v] == -kInf ? static_cast<float>(rng.normal(0.0, 2.0)) : target[v];
        draft[v] = test::round_to(dtype, static_cast<float>(base + rng.normal(0.0, 0.8)));
        if (rng.uniform() < 0.05)
          draft[v] = -kInf;
      }
    }
    const float target_temperatures[] = {1.0f, 0.8f, 1.3f, 0.6f, 1.0f, 1.0f, 1.0f, 0.0f};
    const float draft_temperatures[] = {0.7f, 1.0f, 0.9f, 0.7f, 1.2f, 0.7f, 0.7f, 0.0f};
    p.target_t.push_back(target_temperatures[rng.integer(0, 7)]);
    p.draft_t.push_back(draft_temperatures[rng.integer(0, 7)]);
  }
  p.draw_tokens(rng.engine());
  for (int row = 0; row < rows; ++row) {
    p.seeds.push_back(rng.bits());
    p.counters.push_back(static_cast<uint32_t>(rng.integer(0, 1 << 30)));
  }
  return p;
}

/// Compares with the reference; rows whose outcome a near tie could flip may differ.
void check_stochastic(const Problem& p, const VerdictOut& out, int* near_ties) {
  const auto expected = reference::verify_stochastic(p.host_view());
  for (int row = 0; row < p.rows; ++row) {
    INFO("row " << row << " T_t " << p.target_t[row] << " T_d " << p.draft_t[row] << " expected k "
                << expected.accepted[row] << " next " << expected.next_tokens[row] << " flags "
                << expected.row_flags[row] << " coin margin " << expected.coin_margin[row] << " gap "
                << expected.draw_gap[row] << " runner-up " << expected.runner_up[row]);
    if (out.accepted[row] != expected.accepted[row] || out.next_tokens[row] != expected.next_tokens[row]) {
      CHECK(expected.near_tie(row));
      ++*near_ties;
      continue;
    }
    CHECK(out.mismatch[row] == expected.mismatch[row]);
    CHECK(out.flags[row] == expected.row_flags[row]);
  }
}

TEST_CASE("verify_stochastic matches the reference token for token") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  struct Config {
    DType dtype;
    int vocab, draft_steps;
  };
  const Config configs[] = {
      {DType::kFloat32, 50, 1},     {DType::kBFloat16, 50, 33},  {DType::kFloat16, 1001, 4},
      {DType::kFloat32, 1001, 33},  {DType::kBFloat16, 5000, 1}, {DType::kFloat16, 5000, 4},
      {DType::kBFloat16, 40000, 4}, {DType::kFloat32, 40001, 1}, {DType::kFloat16, 50, 4},
      {DType::kBFloat16, 128256, 2}}; // rows longer than a tile (4096 bf16) are split: 32 tiles here
  int near_ties = 0, rows_checked = 0;
  for (const Config& config : configs) {
    INFO(smcgraph::dtype_name(config.dtype)
         << " V " << config.vocab << " draft_steps " << config.draft_steps);
    const int rows = 48;
    Problem p = random_problem(rng, config.dtype, rows, config.draft_steps, config.vocab);
    // Rows that must fail cleanly, and two exact corner cases.
    p.target_t[0] = -1.0f;                      // bad temperature
    p.target_logprobs[1 * p.draft_steps] = NAN; // NaN log-prob at position 0
    p.target_t[2] = p.draft_t[2] = 1.0f; // -1 padding at position 0: rejected there, the residual still drawn
    p.refresh_logprobs(2);
    p.tokens[2 * p.draft_steps] = -1;
    for (int j = 0; j <= p.draft_steps; ++j)
      p.target_logits[3 * p.target_row_stride + j * p.vocab + 7] = NAN;
    p.refresh_logprobs(3); // a NaN logit in every target row of row 3
    // Row 4 accepts every draft token and finds its bonus row fully masked. Its tokens are the draft rows'
    // argmax at T_d = 1 and log p = log q: a greedy draft (T_d = 0) whose drawn token tied the row's maximum
    // but was not its smallest id had log q = -inf, so log p = -inf rejected it (seen once: bf16, V 128256).
    p.target_t[4] = p.draft_t[4] = 1.0f;
    for (int j = 0; j < p.draft_steps; ++j) {
      const float* draft = &p.draft_logits[4 * p.draft_row_stride + j * p.vocab];
      p.tokens[4 * p.draft_steps + j] =
          static_cast<int32_t>(std::max_element(draft, draft + p.vocab) - draft);
    }
    p.refresh_logprobs(4);
    for (int j = 0; j < p.draft_steps; ++j) {
      REQUIRE(std::isfinite(p.draft_logprobs[4 * p.draft_steps + j]));
      p.target_logprobs[4 * p.draft_steps + j] = p.draft_logprobs[4 * p.draft_steps + j];
    }
    for (int v = 0; v < p.vocab; ++v)
      p.target_logits[4 * p.target_row_stride + p.draft_steps * p.vocab + v] = -kInf;
    p.target_t[5] = p.draft_t[5] = 1.0f; // row 5: the draft proposes a token the target masks (p(d) = 0)
    p.target_logits[5 * p.target_row_stride + p.tokens[5 * p.draft_steps]] = -kInf;
    p.refresh_logprobs(5);
    REQUIRE(p.target_logprobs[5 * p.draft_steps] == -kInf);

    DeviceProblem device(p, stream);
    DeviceVerdict verdict(rows);
    for (bool captured : {false, true}) {
      verdict.poison(stream);
      test::run_on_stream(captured, stream, [&](cudaStream_t s) { device.launch(verdict.view(), s); });
      const VerdictOut out = verdict.read(stream);
      check_stochastic(p, out, &near_ties);
      rows_checked += rows;
      CHECK(out.flags[0] == smcgraph::kFlagBadParameter);
      CHECK(out.next_tokens[0] == smcgraph::kInvalidToken);
      CHECK(out.flags[1] == smcgraph::kFlagNanLogit);
      CHECK(out.flags[2] == smcgraph::kFlagTokenOutOfRange);
      CHECK(out.next_tokens[2] >= 0);
      CHECK((out.flags[3] & smcgraph::kFlagNanLogit) != 0);
      CHECK(out.accepted[4] == p.draft_steps);
      CHECK(out.flags[4] == smcgraph::kFlagAllMasked);
      CHECK(out.accepted[5] == 0);
      CHECK(out.next_tokens[5] != p.tokens[5 * p.draft_steps]);
      uint32_t all_flags = 0;
      for (uint32_t f : out.flags)
        all_flags |= f;
      CHECK(out.status == all_flags);
    }
  }
  MESSAGE(near_ties << " near ties in " << rows_checked << " rows");
  CHECK(near_ties <= rows_checked / 50);
}

// --- stochastic: exactness
// ----------------------------------------------------------------------------------

/// Chi-square p-value of counts against p (expected < 5 merged into one bin); tokens with p = 0 must not
/// occur.
double goodness_of_fit(const std::vector<long>& counts, const std::vector<double>& p) {
  const long n = std::accumulate(counts.begin(), counts.end(), 0L);
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

TEST_CASE("verify_stochastic is exact: emitted tokens follow p (10^6 draws per case)") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  // 2^20 draws per case; 2^17 under a sanitizer and 2^14 under racecheck, with the same test (bins of
  // expected count < 5 merged, so the chi-square approximation holds at every count).
  const int rows = test::sanitizer_scaled(1 << 20, 1 << 17, 1 << 14), draft_steps = 2;
  for (int variant = 0; variant < 9; ++variant) {
    Problem p;
    p.dtype = variant >= 6 ? DType::kBFloat16 : DType::kFloat32;
    p.rows = rows;
    p.draft_steps = draft_steps;
    // Variants 7 and 8: 5000 bf16 logits are 2 tiles of 4 sub-tiles (verify.hpp), so both levels decide.
    p.vocab = variant >= 7 ? 5000 : variant % 2 == 0 ? 8 : 50;
    p.particles = variant == 1 ? 4 : 1; // rows r and r + 1 of one request: distinct particles
    float target_t = 1.0f, draft_t = 0.7f;
    const double spread = variant >= 7 ? 3.0 : 1.5;
    for (int i = 0; i < (draft_steps + 1) * p.vocab; ++i)
      p.target_logits.push_back(test::round_to(p.dtype, static_cast<float>(rng.normal(0.0, spread))));
    for (int i = 0; i < draft_steps * p.vocab; ++i)
      p.draft_logits.push_back(test::round_to(p.dtype, static_cast<float>(rng.normal(0.0, spread))));
    std::string name;
    switch (variant) {
    case 0:
      name = "V 8";
      break;
    case 1: // the draft masks tokens: only the residual emits them (q_v = 0)
      name = "q = 0 entries";
      for (int j = 0; j < draft_steps; ++j)
        for (int v = 0; v < p.vocab; v += 5)
          p.draft_logits[j * p.vocab + v] = -kInf;
      break;
    case 2: // the target masks tokens the draft proposes: always rejected, never emitted (p_v = 0)
      name = "p = 0 entries";
      for (int j = 0; j <= draft_steps; ++j)
        p.target_logits[j * p.vocab + 1] = p.target_logits[j * p.vocab + 6] = -kInf;
      break;
    case 3: // q = p: every draft token accepted
      name = "q = p";
      draft_t = target_t;
      std::copy_n(p.target_logits.begin(), draft_steps * p.vocab, p.draft_logits.begin());
      break;
    case 4: // disjoint supports: always rejected, the residual is p
      name = "disjoint supports";
      for (int j = 0; j <= draft_steps; ++j)
        for (int v = 0; v < p.vocab; ++v) {
          if (v % 2 == 0 && j < draft_steps)
            p.draft_logits[j * p.vocab + v] = -kInf;
          if (v % 2 == 1)
            p.target_logits[j * p.vocab + v] = -kInf;
        }
      break;
    case 5: // greedy draft (T_d = 0): q is one-hot at the draft's argmax
      name = "T_d = 0";
      draft_t = 0.0f;
      break;
    case 6:
      name = "bf16 V 8, T_t 0.6";
      target_t = 0.6f;
      break;
    case 7:
      name = "bf16 V 5000: mass over every sub-tile";
      break;
    case 8: { // only sub-tiles 1 and 6 (one in each tile) hold finite logits: the others never win level 1
      name = "bf16 V 5000: 6 of 8 sub-tiles entirely -inf";
      const reference::TileLayout layout = reference::verify_draw_layout(p.vocab, p.dtype);
      for (int v = 0; v < p.vocab; ++v) {
        const int sub_tile = layout.sub_tile(v);
        if (sub_tile == 1 || sub_tile == 6)
          continue;
        for (int j = 0; j <= draft_steps; ++j) {
          p.target_logits[j * p.vocab + v] = -kInf;
          if (j < draft_steps)
            p.draft_logits[j * p.vocab + v] = -kInf;
        }
      }
      break;
    }
    }
    INFO(name);
    p.target_t.assign(rows, target_t);
    p.draft_t.assign(rows, draft_t);
    // One shared logits block (row stride 0); draft tokens ~ q from host tables.
    std::vector<std::vector<double>> q(draft_steps), log_p(draft_steps), log_q(draft_steps);
    for (int j = 0; j < draft_steps; ++j) {
      q[j] = probabilities(&p.draft_logits[j * p.vocab], p.vocab, draft_t);
      for (int v = 0; v < p.vocab; ++v) {
        uint32_t flags = 0;
        log_p[j].push_back(
            reference::token_logprob(&p.target_logits[j * p.vocab], p.vocab, target_t, v, &flags));
        log_q[j].push_back(
            reference::token_logprob(&p.draft_logits[j * p.vocab], p.vocab, draft_t, v, &flags));
      }
    }
    p.tokens.resize(static_cast<size_t>(rows) * draft_steps);
    p.target_logprobs.resize(p.tokens.size());
    p.draft_logprobs.resize(p.tokens.size());
    for (int j = 0; j < draft_steps; ++j) {
      std::discrete_distribution<int> from_q(q[j].begin(), q[j].end());
      for (int row = 0; row < rows; ++row) {
        const int d = from_q(rng.engine());
        p.tokens[row * draft_steps + j] = d;
        p.target_logprobs[row * draft_steps + j] = static_cast<float>(log_p[j][d]);
        p.draft_logprobs[row * draft_steps + j] = static_cast<float>(log_q[j][d]);
      }
    }
    const int requests = rows / p.particles;
    p.seeds.assign(requests, rng.bits()); // one key, a distinct draw counter per request
    p.counters.resize(requests);
    std::iota(p.counters.begin(), p.counters.end(), static_cast<uint32_t>(rng.integer(0, 1 << 20)));

    DeviceProblem device(p, stream);
    DeviceVerdict verdict(rows);
    verdict.poison(stream);
    test::run_on_stream(variant % 2 == 1, stream, [&](cudaStream_t s) { device.launch(verdict.view(), s); });
    const VerdictOut out = verdict.read(stream);
    CHECK(out.status == 0u);
    std::vector<long> first(p.vocab, 0), second(p.vocab, 0);
    long accepted_first = 0;
    for (int row = 0; row < rows; ++row) {
      const int k = out.accepted[row];
      REQUIRE((k >= 0 && k <= draft_steps));
      REQUIRE((out.next_tokens[row] >= 0 && out.next_tokens[row] < p.vocab));
      first[k == 0 ? out.next_tokens[row] : p.tokens[row * draft_steps]]++;
      if (k >= 1) {
        ++accepted_first;
        second[k == 1 ? out.next_tokens[row] : p.tokens[row * draft_steps + 1]]++;
      }
    }
    const double p_first = goodness_of_fit(first, probabilities(&p.target_logits[0], p.vocab, target_t));
    const double p_second =
        goodness_of_fit(second, probabilities(&p.target_logits[p.vocab], p.vocab, target_t));
    MESSAGE(name << ": p-values " << p_first << " (first token), " << p_second << " (second, "
                 << accepted_first << " draws)");
    CHECK(p_first > 1e-4);
    CHECK(p_second > 1e-4);
    if (variant == 3)
      CHECK(accepted_first == rows);
    if (variant == 4)
      CHECK(accepted_first == 0);
  }
}

TEST_CASE("captured verify_stochastic draws fresh, host-reproducible numbers on every replay") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  Problem p = random_problem(rng, DType::kBFloat16, 64, 4, 30000); // 8 tiles a row: the tickets replay too
  p.particles = 2;
  p.seeds.resize(32);
  p.counters.resize(32);
  DeviceProblem device(p, stream);
  DeviceVerdict verdict(64);
  const test::GraphExec exec = test::instantiate_graph(stream, [&](cudaStream_t s) {
    device.launch(verdict.view(), s);
    smcgraph::advance_draw_counters(device.counters.data(), 32, s);
  });
  int near_ties = 0, changed = 0;
  std::vector<int32_t> previous;
  for (int replay = 0; replay < 4; ++replay) {
    verdict.poison(stream);
    test::launch(exec, stream);
    const VerdictOut out = verdict.read(stream);
    check_stochastic(p, out, &near_ties); // p.counters hold this replay's draw counters
    for (uint32_t& counter : p.counters)
      ++counter;
    if (!previous.empty())
      for (int row = 0; row < 64; ++row)
        changed += out.next_tokens[row] != previous[row];
    previous = out.next_tokens;
  }
  CHECK(near_ties <= 2);
  CHECK(changed > 0);
}

} // namespace
