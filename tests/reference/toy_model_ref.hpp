// Host reference of the toy model (src/models/toy_model.cu), bit-exact in float: the same weights
// (make_toy_model_weights), the same clamps and the same operations in the same order, std::fma where the
// device fuses and uncontracted float arithmetic elsewhere.
//
//   smcgraph::reference::ToyModelReference ref(config);
//   std::vector<float> kv(config.pool_size * config.hidden, 0.0f);       // mirrors the device KV
//   std::vector<float> logits(inputs.rows * inputs.tokens_per_row * config.vocab, poison);
//   ref.forward(inputs, kv, logits);   // float logits (round to bf16 for a bf16 model); padding rows
//   untouched
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "smcgraph/toy_model.hpp"

namespace smcgraph::reference {

/// Host copies of ForwardArgs' arrays (same shapes and layouts).
struct ToyForwardInputs {
  int rows = 0;
  int tokens_per_row = 0;
  std::vector<int32_t> tokens;     ///< [rows, tokens_per_row]
  std::vector<int32_t> positions;  ///< [rows, tokens_per_row]
  std::vector<int32_t> slot_table; ///< [rows, max_seq_len]
  std::vector<int32_t> seq_lens;   ///< [rows]
  std::vector<int32_t> out_slots;  ///< [rows, tokens_per_row]
  std::vector<uint8_t> live;       ///< [rows]
};

/// Shape of a random batch for the tests (random_toy_inputs).
struct ToyBatchShape {
  int rows = 1;
  int tokens_per_row = 1;
  double live_fraction = 0.8;    ///< each row is live with this probability (row 0 always is)
  double invalid_fraction = 0.0; ///< per entry: an out-of-range token / position / slot / seq_len instead
  int out_slot_begin = 1;        ///< live tokens' out_slots are distinct, drawn from [begin, end)
  int out_slot_end = 0;          ///< 0: pool_size
  int history_slot_begin = 1;    ///< earlier positions' slots are drawn from [begin, end) (may repeat)
  int history_slot_end = 0;      ///< 0: pool_size
};

/// A random batch for `config`: a live row has consecutive positions p0 .. p0 + tokens_per_row - 1 with
/// p0 uniform in [0, max_seq_len - tokens_per_row], seq_len = p0 + tokens_per_row, its out_slots also at
/// those positions of its slot table, random history slots before them and garbage after them. A padding
/// row holds garbage everywhere except valid-looking out_slots (a kernel that wrongly wrote them would show
/// in the KV). Requires max_seq_len >= tokens_per_row and enough out slots.
ToyForwardInputs random_toy_inputs(const ToyModelConfig& config, const ToyBatchShape& shape,
                                   std::mt19937_64& engine);

class ToyModelReference {
public:
  explicit ToyModelReference(const ToyModelConfig& config);

  const ToyModelConfig& config() const { return config_; }
  const ToyModelWeights& weights() const { return weights_; }

  /// Applies every KV write of the forward to `kv` ([pool_size, hidden]), in token order.
  void write_kv(const ToyForwardInputs& inputs, std::vector<float>& kv) const;

  /// The activations g(x) of token `j` of row `row` ([hidden]); zeros for a padding row. Reads `kv` after
  /// write_kv.
  std::vector<float> activations(const ToyForwardInputs& inputs, const std::vector<float>& kv, int row,
                                 int j) const;

  /// The float logits of token `j` of row `row` into `out` ([vocab]). Reads `kv` after write_kv.
  void token_logits(const ToyForwardInputs& inputs, const std::vector<float>& kv, int row, int j,
                    float* out) const;

  /// write_kv, then the logits of every token of every live row into `logits`
  /// ([rows, tokens_per_row, vocab], float before any bf16 rounding); padding rows are left untouched.
  void forward(const ToyForwardInputs& inputs, std::vector<float>& kv, std::vector<float>& logits) const;

private:
  ToyModelConfig config_;
  ToyModelWeights weights_;
};

} // namespace smcgraph::reference
