// Exactness: the only products below go through std::fma (one rounding, like __fmaf_rn); the rest are
// float additions and divisions with no multiply to fuse into, so no compiler contraction can change them.
// Reductions run in the device's order: the window in increasing position, the head in increasing h.
#include "reference/toy_model_ref.hpp"

#include <algorithm>
#include <climits>
#include <cmath>

#include "smcgraph/error.hpp"

#if defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace smcgraph::reference {

namespace {
int clamp_int(int value, int lo, int hi) {
  return std::min(std::max(value, lo), hi);
}
} // namespace

ToyForwardInputs random_toy_inputs(const ToyModelConfig& config, const ToyBatchShape& shape,
                                   std::mt19937_64& engine) {
  constexpr const char* where = "random_toy_inputs";
  const int rows = shape.rows;
  const int per_row = shape.tokens_per_row;
  const int max_seq_len = config.max_seq_len;
  const int out_end = shape.out_slot_end > 0 ? shape.out_slot_end : config.pool_size;
  const int history_end = shape.history_slot_end > 0 ? shape.history_slot_end : config.pool_size;
  require(rows >= 1 && per_row >= 1, where, "rows * tokens_per_row", rows * per_row, "must be >= 1");
  require(max_seq_len >= per_row, where, "max_seq_len", max_seq_len, "must be >= tokens_per_row");
  require(out_end - shape.out_slot_begin >= rows * per_row, where, "out slot range",
          out_end - shape.out_slot_begin, "must hold rows * tokens_per_row distinct slots");
  require(history_end > shape.history_slot_begin, where, "history slot range",
          history_end - shape.history_slot_begin, "must be non-empty");

  auto integer = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(engine);
  };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(engine) < p; };
  auto garbage = [&] { return static_cast<int32_t>(integer(INT32_MIN, INT32_MAX)); };
  auto invalid_slot = [&] {
    const int32_t choices[4] = {0, -1, config.pool_size, config.pool_size + 1000};
    return choices[integer(0, 3)];
  };

  std::vector<int32_t> free_slots(out_end - shape.out_slot_begin);
  for (size_t i = 0; i < free_slots.size(); ++i)
    free_slots[i] = shape.out_slot_begin + static_cast<int32_t>(i);
  std::shuffle(free_slots.begin(), free_slots.end(), engine);
  size_t next_free = 0;

  ToyForwardInputs in;
  in.rows = rows;
  in.tokens_per_row = per_row;
  const size_t tokens = static_cast<size_t>(rows) * per_row;
  in.tokens.resize(tokens);
  in.positions.resize(tokens);
  in.out_slots.resize(tokens);
  in.slot_table.resize(static_cast<size_t>(rows) * max_seq_len);
  in.seq_lens.resize(rows);
  in.live.resize(rows);
  for (int row = 0; row < rows; ++row) {
    int32_t* table = in.slot_table.data() + static_cast<size_t>(row) * max_seq_len;
    const size_t base = static_cast<size_t>(row) * per_row;
    const bool live = row == 0 ? shape.live_fraction > 0.0 : chance(shape.live_fraction);
    in.live[row] = live ? 1 : 0;
    if (!live) {
      for (int q = 0; q < max_seq_len; ++q)
        table[q] = garbage();
      for (int j = 0; j < per_row; ++j) {
        in.tokens[base + j] = garbage();
        in.positions[base + j] = garbage();
        in.out_slots[base + j] = static_cast<int32_t>(integer(1, config.pool_size - 1));
      }
      in.seq_lens[row] = garbage();
      continue;
    }
    const int first = static_cast<int>(integer(0, max_seq_len - per_row));
    in.seq_lens[row] = first + per_row;
    if (chance(shape.invalid_fraction))
      in.seq_lens[row] = chance(0.5) ? 0 : static_cast<int32_t>(integer(1, first + per_row));
    for (int q = 0; q < first; ++q) {
      table[q] = chance(shape.invalid_fraction)
                     ? invalid_slot()
                     : static_cast<int32_t>(integer(shape.history_slot_begin, history_end - 1));
    }
    for (int q = first + per_row; q < max_seq_len; ++q)
      table[q] = garbage();
    for (int j = 0; j < per_row; ++j) {
      in.tokens[base + j] = static_cast<int32_t>(integer(0, config.vocab - 1));
      if (chance(shape.invalid_fraction))
        in.tokens[base + j] = chance(0.5) ? -1 - static_cast<int32_t>(integer(0, 5))
                                          : config.vocab + static_cast<int32_t>(integer(0, 5));
      in.positions[base + j] = first + j;
      if (chance(shape.invalid_fraction))
        in.positions[base + j] = chance(0.5) ? -static_cast<int32_t>(integer(1, 100))
                                             : max_seq_len + static_cast<int32_t>(integer(0, 100));
      in.out_slots[base + j] = chance(shape.invalid_fraction) ? invalid_slot() : free_slots[next_free++];
      table[first + j] = in.out_slots[base + j];
    }
  }
  return in;
}

ToyModelReference::ToyModelReference(const ToyModelConfig& config)
    : config_(config), weights_(make_toy_model_weights(config)) {}

void ToyModelReference::write_kv(const ToyForwardInputs& inputs, std::vector<float>& kv) const {
  const int hidden = config_.hidden;
  require(kv.size() == static_cast<size_t>(config_.pool_size) * hidden, "ToyModelReference::write_kv",
          "kv.size()", kv.size(), "must be pool_size * hidden");
  for (int row = 0; row < inputs.rows; ++row) {
    if (!inputs.live[row])
      continue;
    for (int j = 0; j < inputs.tokens_per_row; ++j) {
      const size_t token = static_cast<size_t>(row) * inputs.tokens_per_row + j;
      const int slot = inputs.out_slots[token];
      if (slot <= 0 || slot >= config_.pool_size)
        continue;
      const int token_id = clamp_int(inputs.tokens[token], 0, config_.vocab - 1);
      const int position = clamp_int(inputs.positions[token], 0, config_.max_seq_len - 1);
      for (int h = 0; h < hidden; ++h) {
        kv[static_cast<size_t>(slot) * hidden + h] =
            weights_.embedding[static_cast<size_t>(token_id) * hidden + h] +
            weights_.position[static_cast<size_t>(position % kToyPositionPeriod) * hidden + h];
      }
    }
  }
}

std::vector<float> ToyModelReference::activations(const ToyForwardInputs& inputs,
                                                  const std::vector<float>& kv, int row, int j) const {
  const int hidden = config_.hidden;
  std::vector<float> g(hidden, 0.0f);
  if (!inputs.live[row])
    return g;
  const size_t token = static_cast<size_t>(row) * inputs.tokens_per_row + j;
  const int position = clamp_int(inputs.positions[token], 0, config_.max_seq_len - 1);
  const int seq_len = inputs.seq_lens[row];
  const int last = seq_len <= 0 ? -1 : std::min(position, seq_len - 1);
  const int first = std::max(0, position - config_.window + 1);
  if (last < first)
    return g;
  const int32_t* slots = inputs.slot_table.data() + static_cast<size_t>(row) * config_.max_seq_len;
  for (int h = 0; h < hidden; ++h) {
    float sum = 0.0f;
    for (int q = first; q <= last; ++q) {
      int slot = slots[q];
      if (slot < 0 || slot >= config_.pool_size)
        slot = 0;
      sum = sum + kv[static_cast<size_t>(slot) * hidden + h];
    }
    const float mean = sum / static_cast<float>(last - first + 1);
    g[h] = mean / (1.0f + std::fabs(mean));
  }
  return g;
}

void ToyModelReference::token_logits(const ToyForwardInputs& inputs, const std::vector<float>& kv, int row,
                                     int j, float* out) const {
  const int hidden = config_.hidden;
  const std::vector<float> g = activations(inputs, kv, row, j);
  for (int v = 0; v < config_.vocab; ++v) {
    const float* w = weights_.head.data() + static_cast<size_t>(v) * hidden;
    float accumulator = weights_.bias[v];
    for (int h = 0; h < hidden; ++h)
      accumulator = std::fma(w[h], g[h], accumulator);
    out[v] = accumulator;
  }
}

void ToyModelReference::forward(const ToyForwardInputs& inputs, std::vector<float>& kv,
                                std::vector<float>& logits) const {
  const size_t vocab = static_cast<size_t>(config_.vocab);
  require(logits.size() == static_cast<size_t>(inputs.rows) * inputs.tokens_per_row * vocab,
          "ToyModelReference::forward", "logits.size()", logits.size(),
          "must be rows * tokens_per_row * vocab");
  write_kv(inputs, kv);
  for (int row = 0; row < inputs.rows; ++row) {
    if (!inputs.live[row])
      continue;
    for (int j = 0; j < inputs.tokens_per_row; ++j) {
      token_logits(inputs, kv, row, j,
                   logits.data() + (static_cast<size_t>(row) * inputs.tokens_per_row + j) * vocab);
    }
  }
}

} // namespace smcgraph::reference
