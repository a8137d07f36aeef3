// Host references of verify_greedy(), verify_stochastic() and the pack of verify_and_pack() /
// pack_accepted(), plus seed 000's synthetic oracle batches. Double precision; the stochastic reference
// draws the same Philox numbers as the device, so results match token for token except near ties (which
// it reports).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "reference/sample_ref.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::reference {

/// Per-row results of a verification, as the device writes them (row_flags as OR-ed into zeroed flags).
struct Verdict {
  std::vector<int32_t> accepted;
  std::vector<int32_t> next_tokens;
  std::vector<uint8_t> mismatch;
  std::vector<uint32_t> row_flags;
  uint32_t status = 0;
};

/// Greedy verification: k = first j with draft[j] != target[j] or draft[j] outside [0, vocab) (draft_steps
/// when none), next = target[k].
Verdict verify_greedy(const int32_t* draft, int64_t draft_row_stride, const int32_t* target,
                      int64_t target_row_stride, int rows, int draft_steps, int vocab);

/// Host mirror of StochasticVerifyInputs; logits are the floats the device sees (after dtype rounding).
/// A logits row stride of 0 repeats one row for every row.
struct StochasticProblem {
  const int32_t* draft_tokens = nullptr;
  int64_t draft_token_row_stride = 0;
  const float* draft_logprobs = nullptr;
  int64_t draft_logprob_row_stride = 0;
  const float* target_logprobs = nullptr;
  int64_t target_logprob_row_stride = 0;
  const float* draft_logits = nullptr;
  int64_t draft_row_stride = 0, draft_position_stride = 0;
  const float* target_logits = nullptr;
  int64_t target_row_stride = 0, target_position_stride = 0;
  const float* draft_temperature = nullptr;
  const float* target_temperature = nullptr;
  const uint64_t* seeds = nullptr;
  const uint32_t* draw_counters = nullptr;
  int particles_per_request = 1;
  int rows = 0, draft_steps = 0, vocab = 0;
  /// The logits' dtype on the device: it decides the draw's tiles and sub-tiles (verify_tile_length()).
  DType dtype = DType::kFloat32;
};

struct StochasticVerdict : Verdict {
  std::vector<double>
      coin_margin; ///< per row: min |log u - log(p/q)| over coins a uniform decided (inf: none)
  /// per row: the smaller gap of the draw's two levels, best minus runner-up (sub-tile keys log Z_s + Gumbel,
  /// then element scores inside the chosen sub-tile); inf: no runner-up at either level
  std::vector<double> draw_gap;
  std::vector<int32_t> runner_up; ///< per row: the runner-up inside the chosen sub-tile (-1: none)
  /// True when float rounding on the device could flip this row's outcome.
  bool near_tie(int row, double coin_tolerance = 1e-5, double gap_tolerance = 1e-3) const;
};

/// How verify_stochastic() cuts a row for its two-level draw (verify.hpp): tiles of verify_tile_length()
/// logits, read as 16-byte vectors by verify_threads() threads, a sub-tile per warp.
TileLayout verify_draw_layout(int vocab, DType dtype);

/// Exact speculative sampling as the device does it: the same coins, the same two-level Gumbel-max over the
/// same sub-tiles with the same Philox words (verify.hpp), exact log-sum-exps.
StochasticVerdict verify_stochastic(const StochasticProblem& problem);

/// The pack: offsets (exclusive prefix of k_i + include_next, k_i clamped to [0, draft_steps]), total, the
/// packed payload bytes and tokens (d_j for j < k_i; next_tokens[i] at j = k_i, -1 when next_tokens is null).
struct Packed {
  std::vector<int32_t> offsets;
  int32_t total = 0;
  std::vector<uint8_t> bytes;  ///< [total, width * element_bytes]
  std::vector<int32_t> tokens; ///< [total]
};
Packed pack(const int32_t* accepted, const int32_t* next_tokens, const int32_t* draft_tokens,
            int64_t draft_row_stride, const uint8_t* payload, int64_t payload_row_stride, int rows,
            int draft_steps, int width, int element_bytes, bool include_next);

/// Seed 000's synthetic workload: draft tokens uniform in [0, vocab); k_i ~ Binomial(draft_steps, alpha); the
/// target agrees with the draft before k_i and differs at k_i (its other positions and the bonus uniform).
struct OracleBatch {
  int rows = 0, draft_steps = 0, vocab = 0;
  std::vector<int32_t> draft;    ///< [rows, draft_steps]
  std::vector<int32_t> target;   ///< [rows, draft_steps + 1]
  std::vector<int32_t> accepted; ///< [rows] the oracle k_i
};
OracleBatch make_oracle_batch(std::mt19937_64& engine, int rows, int draft_steps, int vocab, double alpha);

} // namespace smcgraph::reference
