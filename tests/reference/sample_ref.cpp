#include "reference/sample_ref.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "smcgraph/error.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::reference {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

uint32_t logit_flags(const float* logits, int vocab, bool* all_masked) {
  uint32_t flags = 0;
  bool any_finite_or_masked_only = true;
  *all_masked = true;
  for (int v = 0; v < vocab; ++v) {
    const float l = logits[v];
    if (std::isnan(l) || l == std::numeric_limits<float>::infinity())
      flags |= kFlagNanLogit;
    if (l != -std::numeric_limits<float>::infinity())
      *all_masked = false;
  }
  (void)any_finite_or_masked_only;
  return flags;
}

double log_sum_exp(const float* logits, int vocab, double scale, double* max_out) {
  double m = -kInf;
  for (int v = 0; v < vocab; ++v)
    m = std::max(m, static_cast<double>(logits[v]));
  *max_out = m;
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v)
    sum += std::exp((logits[v] - m) * scale);
  return m * scale + std::log(sum);
}

bool parameters_bad(float temperature, float alpha) {
  return !(temperature >= 0.0f) || std::isinf(temperature) || !(alpha > 0.0f) || std::isinf(alpha);
}

} // namespace

TileLayout TileLayout::device(DType dtype) {
  constexpr int kWarp = 32; // a warp per sub-tile
  return TileLayout{sample_tile_length(dtype), 16 / dtype_bytes(dtype), kSampleSubTilesPerTile * kWarp,
                    kWarp};
}

void TileLayout::validate(const char* where) const {
  require(tile_length >= 1, where, "tile_length", tile_length, "must be >= 1");
  require(vector_length >= 1, where, "vector_length", vector_length, "must be >= 1");
  require(threads >= 1, where, "threads", threads, "must be >= 1");
  require(lanes >= 1 && threads % lanes == 0, where, "lanes", lanes, "must be >= 1 and divide threads");
  require(tile_length % (static_cast<int64_t>(vector_length) * threads) == 0, where, "tile_length",
          tile_length, "must be a multiple of vector_length * threads");
}

int TileLayout::sub_tile(int v) const {
  const int vector = (v % tile_length) / vector_length;
  return (v / tile_length) * sub_tiles_per_tile() + (vector % threads) / lanes;
}

bool SampleResult::near_tie() const {
  const auto close = [](double best, double second) {
    return std::abs(best - second) <= 1e-6 * std::max(1.0, std::abs(best));
  };
  return close(best_score, runner_up_score) || close(sub_tile_best_score, sub_tile_runner_up_score);
}

namespace {

/// Keeps the best and second best score of a race (ties keep the first, i.e. the smaller index).
struct Race {
  double best = -kInf, second = -kInf;
  int index = -1;
  void offer(double score, int i) {
    if (score > best) {
      second = best;
      best = score;
      index = i;
    } else if (score > second) {
      second = score;
    }
  }
};

} // namespace

double gumbel_noise(uint64_t seed, uint64_t element, uint32_t draw_counter, uint32_t particle,
                    uint32_t stream_word) {
  const double u = uniform_open01(philox_word(seed, element, draw_counter, particle, stream_word));
  return -std::log(-std::log(u));
}

SampleResult sample(const float* logits, int vocab, const TileLayout& layout, float temperature, float alpha,
                    uint64_t seed, uint32_t draw_counter, uint32_t particle, uint32_t stream_word) {
  layout.validate("reference::sample");
  SampleResult result;
  if (parameters_bad(temperature, alpha)) {
    result.flags = kFlagBadParameter;
  } else {
    bool all_masked = false;
    result.flags = logit_flags(logits, vocab, &all_masked);
    if (!result.flags && all_masked)
      result.flags = kFlagAllMasked;
  }
  if (result.flags) {
    result.token = kInvalidToken;
    result.logprob = -kInf;
    return result;
  }
  if (temperature == 0.0f) { // greedy: argmax, ties to the smallest id
    int best = 0;
    for (int v = 1; v < vocab; ++v)
      if (logits[v] > logits[best])
        best = v;
    double second = -kInf;
    for (int v = 0; v < vocab; ++v)
      if (v != best)
        second = std::max(second, static_cast<double>(logits[v]));
    result.token = best;
    result.tile = 0;
    result.sub_tile = 0;
    result.best_score = logits[best];
    result.runner_up_score = second;
    result.sub_tile_runner_up_score = -kInf;
    return result;
  }
  const double scale = 1.0 / static_cast<double>(temperature);
  const double a = alpha;
  const double power_scale = a * scale;
  // Level 1: a sub-tile by Gumbel-max over log Z_s (of alpha l / T); a sub-tile that is all -inf (or empty:
  // the last tile's may be) has Z_s = 0 and never wins.
  const int tiles = (vocab + layout.tile_length - 1) / layout.tile_length;
  const int sub_tiles = tiles * layout.sub_tiles_per_tile();
  std::vector<int> sub_tile_of(vocab);
  std::vector<double> sub_max(sub_tiles, -kInf), sub_sum(sub_tiles, 0.0);
  for (int v = 0; v < vocab; ++v) {
    sub_tile_of[v] = layout.sub_tile(v);
    sub_max[sub_tile_of[v]] = std::max(sub_max[sub_tile_of[v]], static_cast<double>(logits[v]));
  }
  for (int v = 0; v < vocab; ++v) {
    const double m = sub_max[sub_tile_of[v]];
    if (m != -kInf)
      sub_sum[sub_tile_of[v]] += std::exp((logits[v] - m) * power_scale);
  }
  Race sub_race;
  for (int s = 0; s < sub_tiles; ++s) {
    if (sub_max[s] == -kInf)
      continue;
    const double log_z = sub_max[s] * power_scale + std::log(sub_sum[s]);
    sub_race.offer(log_z + gumbel_noise(seed, kTileDrawElement + static_cast<uint64_t>(s), draw_counter,
                                        particle, stream_word),
                   s);
  }
  // Level 2: the token by Gumbel-max over alpha l / T inside the winning sub-tile only (by ascending id), the
  // element of rank j (its place in the sub-tile by ascending id) with the word of element kRankDrawElement +
  // j.
  Race race;
  uint64_t rank = 0;
  for (int v = 0; v < vocab; ++v) {
    if (sub_tile_of[v] != sub_race.index)
      continue;
    const uint64_t element = kRankDrawElement + rank++;
    if (logits[v] == -std::numeric_limits<float>::infinity())
      continue;
    race.offer(power_scale * logits[v] + gumbel_noise(seed, element, draw_counter, particle, stream_word), v);
  }
  double m = 0.0;
  const double lse = log_sum_exp(logits, vocab, scale, &m);
  const double lse_power = log_sum_exp(logits, vocab, power_scale, &m);
  result.token = race.index;
  result.tile = race.index / layout.tile_length;
  result.sub_tile = sub_race.index;
  result.best_score = race.best;
  result.runner_up_score = race.second;
  result.sub_tile_best_score = sub_race.best;
  result.sub_tile_runner_up_score = sub_race.second;
  result.logprob = power_scale * logits[race.index] - lse_power;
  result.logz = lse_power - a * lse;
  return result;
}

SampleResult sample(const float* logits, int vocab, int tile_length, float temperature, float alpha,
                    uint64_t seed, uint32_t draw_counter, uint32_t particle, uint32_t stream_word) {
  require(tile_length >= 1, "reference::sample", "tile_length", tile_length, "must be >= 1");
  DType dtype = DType::kFloat32;
  if (tile_length == sample_tile_length(DType::kBFloat16))
    dtype = DType::kBFloat16; // fp16 has the same layout
  else
    require(tile_length == sample_tile_length(DType::kFloat32), "reference::sample", "tile_length",
            tile_length, "must be sample_tile_length() of a dtype (or pass a TileLayout)");
  return sample(logits, vocab, TileLayout::device(dtype), temperature, alpha, seed, draw_counter, particle,
                stream_word);
}

double token_logprob(const float* logits, int vocab, float temperature, int32_t token, uint32_t* flags) {
  *flags = 0;
  if (!(temperature >= 0.0f) || std::isinf(temperature)) {
    *flags = kFlagBadParameter;
    return -kInf;
  }
  bool all_masked = false;
  *flags = logit_flags(logits, vocab, &all_masked);
  if (!*flags && all_masked)
    *flags = kFlagAllMasked;
  if (token < 0 || token >= vocab)
    *flags |= kFlagTokenOutOfRange;
  if (*flags)
    return -kInf;
  double m = -kInf;
  int32_t argmax = -1; // ties to the smallest id
  for (int v = 0; v < vocab; ++v)
    if (static_cast<double>(logits[v]) > m) {
      m = logits[v];
      argmax = v;
    }
  if (temperature == 0.0f) // one-hot at the argmax (a tie at a larger id has p = 0), as a greedy draw emits
    return token == argmax ? 0.0 : -kInf;
  const double scale = 1.0 / static_cast<double>(temperature);
  const double lse = log_sum_exp(logits, vocab, scale, &m);
  return logits[token] * scale - lse;
}

} // namespace smcgraph::reference
