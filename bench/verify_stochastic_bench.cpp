// verify_stochastic_bench: smcgraph::verify_stochastic() on LLM-sized rows (bf16 logits, V = 49152 as
// SmolLM2's and 128256 as Llama 3's; K = 4 draft tokens a row), validated against the host reference token
// for token (a near tie, which float rounding may flip, is allowed), then timed as graph replays over
// rotating logits buffers (more bytes than 3x L2, so it measures HBM, not L2).
//
//   build/bench/verify_stochastic_bench [results/verify_stochastic.csv] [--quick]
//
// Laws: "sampled" (T_t = T_d = 1: the coins, then the residual max(0, p - q) at a rejection or p after a
// full acceptance, by the two-level Gumbel-max of verify.hpp) and "greedy" (T_t = 0: the target's argmax).
// Floor: the logits the draw reads (the drawn position's target row, and its draft row after a rejection)
// over the copy bandwidth (which counts bytes read + written, so a read-only stream may pass 1.0), and the
// node floor (a chain of empty kernels) for the small launches.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/types.hpp"
#include "smcgraph/verify.hpp"

// The bench links no test library: it compiles the host reference in to validate before timing.
#include "../tests/reference/verify_ref.cpp"
#include "reference/sample_ref.hpp"

namespace {

using smcgraph::DType;
using smcgraph::bench::format;

constexpr DType kDType = DType::kBFloat16;
constexpr int kDraftSteps = 4;
constexpr int kMaxRotation = 64;
constexpr int kMinLaunchesPerGraph = 20;

struct Config {
  const char* law;
  int rows, vocab;
  float target_t, draft_t;
};

/// Host problem: logits rounded to bf16 as floats, the draft = the target plus noise (so some tokens are
/// accepted and some rejected), draft tokens drawn from q, their log-probs exact.
struct Problem {
  int rows = 0, vocab = 0;
  std::vector<float> target, draft; ///< [rows, K + 1, V], [rows, K, V]
  std::vector<int32_t> tokens;      ///< [rows, K]
  std::vector<float> target_logprobs, draft_logprobs, target_t, draft_t;
  std::vector<uint64_t> seeds;
  std::vector<uint32_t> counters;
};

float round_bf16(float x) {
  return smcgraph::bench::bf16_to_float(smcgraph::bench::float_to_bf16(x));
}

Problem make_problem(const Config& config, std::mt19937_64& engine) {
  Problem p;
  p.rows = config.rows;
  p.vocab = config.vocab;
  const int V = config.vocab, R = config.rows;
  std::normal_distribution<float> logit(0.0f, 3.0f), noise(0.0f, 0.7f);
  p.target.resize(static_cast<size_t>(R) * (kDraftSteps + 1) * V);
  p.draft.resize(static_cast<size_t>(R) * kDraftSteps * V);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j <= kDraftSteps; ++j)
      for (int v = 0; v < V; ++v) {
        const float x = logit(engine);
        p.target[(static_cast<size_t>(r) * (kDraftSteps + 1) + j) * V + v] = round_bf16(x);
        if (j < kDraftSteps)
          p.draft[(static_cast<size_t>(r) * kDraftSteps + j) * V + v] = round_bf16(x + noise(engine));
      }
  // log softmax(l / T) of a token, and at T = 0 the one-hot law at the argmax (ties to the smallest id) that
  // the sampler's score() gives: the reference's, so inputs and the device agree on both laws.
  const auto logprob = [&](const float* row, float temperature, int v) {
    uint32_t flags = 0;
    return static_cast<float>(smcgraph::reference::token_logprob(row, V, temperature, v, &flags));
  };
  p.tokens.resize(static_cast<size_t>(R) * kDraftSteps);
  p.target_logprobs.resize(p.tokens.size());
  p.draft_logprobs.resize(p.tokens.size());
  std::uniform_real_distribution<double> uniform(1e-12, 1.0);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kDraftSteps; ++j) {
      const float* q = &p.draft[(static_cast<size_t>(r) * kDraftSteps + j) * V];
      const float* t = &p.target[(static_cast<size_t>(r) * (kDraftSteps + 1) + j) * V];
      int best = 0;
      double best_score = -INFINITY;
      for (int v = 0; v < V; ++v) { // d ~ q by Gumbel-max
        const double score = q[v] / config.draft_t - std::log(-std::log(uniform(engine)));
        if (score > best_score) {
          best_score = score;
          best = v;
        }
      }
      const size_t i = static_cast<size_t>(r) * kDraftSteps + j;
      p.tokens[i] = best;
      p.draft_logprobs[i] = logprob(q, config.draft_t, best);
      p.target_logprobs[i] = logprob(t, config.target_t, best);
    }
  p.target_t.assign(R, config.target_t);
  p.draft_t.assign(R, config.draft_t);
  for (int r = 0; r < R; ++r) {
    p.seeds.push_back(engine());
    p.counters.push_back(static_cast<uint32_t>(engine()));
  }
  return p;
}

/// Runs one configuration; returns false (with `failure`) when the device disagrees with the reference.
bool run_config(const Config& config, smcgraph::Stream& stream, int64_t rotation_bytes, double copy_gbs,
                double node_floor, smcgraph::bench::Csv& csv, const std::string& device_name,
                std::string* failure) {
  std::mt19937_64 engine(0x5eed + config.rows * 131 + config.vocab);
  const Problem p = make_problem(config, engine);
  const int R = p.rows, V = p.vocab;
  const int64_t target_elements = static_cast<int64_t>(R) * (kDraftSteps + 1) * V;
  const int64_t draft_elements = static_cast<int64_t>(R) * kDraftSteps * V;
  const int64_t set_elements = target_elements + draft_elements;
  const int64_t set_bytes = set_elements * 2;
  const int sets =
      static_cast<int>(std::clamp<int64_t>((rotation_bytes + set_bytes - 1) / set_bytes, 1, kMaxRotation));
  std::vector<uint16_t> bits(set_elements);
  for (int64_t i = 0; i < target_elements; ++i)
    bits[i] = smcgraph::bench::float_to_bf16(p.target[i]);
  for (int64_t i = 0; i < draft_elements; ++i)
    bits[target_elements + i] = smcgraph::bench::float_to_bf16(p.draft[i]);
  smcgraph::DeviceBuffer<uint16_t> logits(static_cast<size_t>(set_elements) * sets);
  for (int s = 0; s < sets; ++s)
    SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(logits.data() + s * set_elements, bits.data(), set_bytes,
                                        cudaMemcpyHostToDevice, stream));
  const auto to_device = [&](const auto& host) {
    using T = typename std::decay_t<decltype(host)>::value_type;
    smcgraph::DeviceBuffer<T> buffer(host.size());
    buffer.copy_from_host(host.data(), host.size(), stream);
    return buffer;
  };
  auto d_tokens = to_device(p.tokens);
  auto d_target_logprobs = to_device(p.target_logprobs), d_draft_logprobs = to_device(p.draft_logprobs);
  auto d_target_t = to_device(p.target_t), d_draft_t = to_device(p.draft_t);
  auto d_seeds = to_device(p.seeds);
  auto d_counters = to_device(p.counters);
  smcgraph::DeviceBuffer<int32_t> accepted(R), next_tokens(R);
  smcgraph::DeviceBuffer<uint32_t> row_flags(R), status(1);
  smcgraph::SampleWorkspace workspace(R, V, stream);

  int next_set = 0;
  const auto launch = [&](cudaStream_t s) {
    const uint16_t* set = logits.data() + (next_set++ % sets) * set_elements;
    smcgraph::StochasticVerifyInputs in;
    in.draft_tokens = d_tokens.data();
    in.draft_token_row_stride = kDraftSteps;
    in.draft_logprobs = d_draft_logprobs.data();
    in.draft_logprob_row_stride = kDraftSteps;
    in.target_logprobs = d_target_logprobs.data();
    in.target_logprob_row_stride = kDraftSteps;
    in.target_logits = {set, kDType, R, kDraftSteps + 1, V, int64_t{kDraftSteps + 1} * V, V};
    in.draft_logits = {set + target_elements, kDType, R, kDraftSteps, V, int64_t{kDraftSteps} * V, V};
    in.draft_temperature = d_draft_t.data();
    in.target_temperature = d_target_t.data();
    in.random = {d_seeds.data(), d_counters.data(), 1};
    in.draft_steps = kDraftSteps;
    smcgraph::verify_stochastic(
        in, {accepted.data(), next_tokens.data(), nullptr, row_flags.data(), status.data()}, workspace, s);
  };

  // Validate (eagerly, set 0) before timing.
  row_flags.fill_bytes(0, stream);
  status.fill_bytes(0, stream);
  next_tokens.fill_bytes(0xff, stream);
  next_set = 0;
  launch(stream);
  std::vector<int32_t> h_accepted(R), h_next(R);
  std::vector<uint32_t> h_flags(R);
  accepted.copy_to_host(h_accepted.data(), R, stream);
  next_tokens.copy_to_host(h_next.data(), R, stream);
  row_flags.copy_to_host(h_flags.data(), R, stream);
  stream.synchronize();
  smcgraph::reference::StochasticProblem host;
  host.draft_tokens = p.tokens.data();
  host.draft_token_row_stride = kDraftSteps;
  host.draft_logprobs = p.draft_logprobs.data();
  host.draft_logprob_row_stride = kDraftSteps;
  host.target_logprobs = p.target_logprobs.data();
  host.target_logprob_row_stride = kDraftSteps;
  host.draft_logits = p.draft.data();
  host.draft_row_stride = int64_t{kDraftSteps} * V;
  host.draft_position_stride = V;
  host.target_logits = p.target.data();
  host.target_row_stride = int64_t{kDraftSteps + 1} * V;
  host.target_position_stride = V;
  host.draft_temperature = p.draft_t.data();
  host.target_temperature = p.target_t.data();
  host.seeds = p.seeds.data();
  host.draw_counters = p.counters.data();
  host.rows = R;
  host.draft_steps = kDraftSteps;
  host.vocab = V;
  host.dtype = kDType;
  const auto expected = smcgraph::reference::verify_stochastic(host);
  int near_ties = 0, rejected = 0;
  for (int r = 0; r < R; ++r) {
    rejected += expected.accepted[r] < kDraftSteps;
    if (h_flags[r] != expected.row_flags[r] || h_accepted[r] != expected.accepted[r] ||
        h_next[r] != expected.next_tokens[r]) {
      if (!expected.near_tie(r)) {
        *failure = "row " + std::to_string(r) + ": accepted " + std::to_string(h_accepted[r]) + " next " +
                   std::to_string(h_next[r]) + " flags " + std::to_string(h_flags[r]) + ", reference " +
                   std::to_string(expected.accepted[r]) + " / " + std::to_string(expected.next_tokens[r]) +
                   " / " + std::to_string(expected.row_flags[r]);
        return false;
      }
      ++near_ties;
    }
  }

  // Bytes the draw reads: the drawn position's target row; after a rejection of a sampled draw, its draft
  // row too (the coins' inputs are a few bytes a row).
  const bool sampled = config.target_t > 0.0f;
  const double bytes = (static_cast<double>(R) + (sampled ? rejected : 0)) * V * 2;
  const smcgraph::bench::Timing timing =
      smcgraph::bench::time_graph(launch, stream, std::max(sets, kMinLaunchesPerGraph));
  const double gbs = bytes / (timing.median_us * 1e3);
  const int tiles =
      (V + smcgraph::verify_tile_length(V, kDType) - 1) / smcgraph::verify_tile_length(V, kDType);
  std::printf("%-8s %5d %7d %6d %6d %10s %10s %9s %8s %6s %5d\n", config.law, R, V, tiles, rejected,
              format(timing.median_us, 2).c_str(), format(timing.p90_us, 2).c_str(), format(gbs, 1).c_str(),
              format(gbs / copy_gbs, 3).c_str(), format(node_floor / timing.median_us, 2).c_str(), near_ties);
  std::fflush(stdout);
  csv.row({config.law, std::to_string(R), std::to_string(V), "bf16", std::to_string(rejected),
           format(timing.median_us, 3), format(timing.min_us, 3), format(timing.p90_us, 3), format(gbs, 2),
           format(gbs / copy_gbs, 4), device_name});
  return true;
}

} // namespace

int main(int argc, char** argv) {
  std::string csv_path = "results/verify_stochastic.csv";
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--help" || arg == "-h") {
      std::printf("usage: %s [csv_path (default results/verify_stochastic.csv)] [--quick]\n", argv[0]);
      return 0;
    } else {
      csv_path = arg;
    }
  }
  try {
    if (!smcgraph::bench::have_cuda_device("verify_stochastic_bench"))
      return 2;
    smcgraph::Stream stream;
    const int64_t rotation_bytes = smcgraph::bench::l2_rotation_bytes();
    const double copy_gbs = smcgraph::bench::measure_copy_bandwidth_gbs(stream);
    const double node_floor = smcgraph::bench::node_floor_us(stream);
    const std::string device_name = smcgraph::bench::device_name();
    std::printf(
        "verify_stochastic_bench on %s: copy %s GB/s (read + write), node floor %s us; bf16 logits, K = "
        "%d\n",
        device_name.c_str(), format(copy_gbs, 0).c_str(), format(node_floor, 2).c_str(), kDraftSteps);
    smcgraph::bench::Csv csv(csv_path);
    csv.row({"law", "rows", "vocab", "dtype", "rejected_rows", "median_us", "min_us", "p90_us", "gbs",
             "fraction_of_copy", "device"});
    std::printf("%-8s %5s %7s %6s %6s %10s %10s %9s %8s %6s %5s\n", "law", "rows", "vocab", "tiles", "reject",
                "median_us", "p90_us", "GB/s", "of_copy", "floor", "ties");
    std::vector<Config> configs;
    for (const int vocab : {49152, 128256})
      for (const int rows : quick ? std::vector<int>{1, 64} : std::vector<int>{1, 8, 64, 256}) {
        configs.push_back({"sampled", rows, vocab, 1.0f, 1.0f});
        configs.push_back({"greedy", rows, vocab, 0.0f, 1.0f});
      }
    bool all_valid = true;
    for (const Config& config : configs) {
      std::string failure;
      if (!run_config(config, stream, rotation_bytes, copy_gbs, node_floor, csv, device_name, &failure)) {
        all_valid = false;
        std::printf("INVALID %s rows %d vocab %d: %s (not timed)\n", config.law, config.rows, config.vocab,
                    failure.c_str());
      }
    }
    std::printf(
        "of_copy: bytes read / time / copy bandwidth; floor: node floor / time (1.00 = launch-bound); "
        "ties: rows whose reference outcome a float near tie could flip. CSV: %s\n",
        csv_path.c_str());
    return all_valid ? 0 : 1;
  } catch (const smcgraph::Error& error) {
    std::fprintf(stderr, "verify_stochastic_bench: %s\n", error.what());
    return 1;
  }
}
