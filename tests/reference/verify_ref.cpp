// Included by path (not only through the test library): the benches compile it in to validate before timing.
#include "verify_ref.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "smcgraph/philox.hpp"
#include "smcgraph/types.hpp"
#include "smcgraph/verify.hpp"

namespace smcgraph::reference {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool out_of_range(int32_t token, int vocab) {
  return token < 0 || token >= vocab;
}
bool bad_value(float x) {
  return std::isnan(x) || x == std::numeric_limits<float>::infinity();
}

void resize(Verdict& verdict, int rows) {
  verdict.accepted.assign(rows, 0);
  verdict.next_tokens.assign(rows, kInvalidToken);
  verdict.mismatch.assign(rows, 0);
  verdict.row_flags.assign(rows, 0);
  verdict.status = 0;
}

void record(Verdict& verdict, int row, int accepted, int draft_steps, int32_t next_token, uint32_t flags) {
  verdict.accepted[row] = accepted;
  verdict.next_tokens[row] = next_token;
  verdict.mismatch[row] = accepted < draft_steps ? 1 : 0;
  verdict.row_flags[row] |= flags;
  verdict.status |= flags;
}

/// log(1 - e^x), x <= 0.
double log1mexp(double x) {
  return x > -std::log(2.0) ? std::log(-std::expm1(x)) : std::log1p(-std::exp(x));
}

double log_sum_exp(const float* row, int vocab, double scale) {
  double m = -kInf;
  for (int v = 0; v < vocab; ++v)
    m = std::max(m, row[v] * scale);
  if (m == -kInf)
    return -kInf;
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v)
    sum += std::exp(row[v] * scale - m);
  return m + std::log(sum);
}

/// The best and second best scores of a draw (ties to the smaller id, as on the device).
struct Race {
  double best = -kInf, second = -kInf;
  int32_t best_index = -1, second_index = -1;
  void offer(double score, int32_t index) {
    if (score > best) {
      second = best;
      second_index = best_index;
      best = score;
      best_index = index;
    } else if (score > second) {
      second = score;
      second_index = index;
    }
  }
};

enum class Draw { kResidual, kTarget, kTargetExcept, kArgmax };

struct DrawInputs {
  const float* target_row;
  const float* draft_row;
  double inverse_target_t, target_lse, inverse_draft_t, draft_lse;
  int32_t excluded;
  int vocab;
  uint64_t seed;
  uint32_t draw_counter, particle, stream_word;
};

/// The log-weight of v under `mode` before noise (-inf: never drawn).
double log_weight(Draw mode, const DrawInputs& in, int v) {
  const float x = in.target_row[v];
  switch (mode) {
  case Draw::kArgmax:
    return x;
  case Draw::kTarget:
    return x * in.inverse_target_t;
  case Draw::kTargetExcept:
    return v == in.excluded ? -kInf : x * in.inverse_target_t;
  case Draw::kResidual: {
    const double log_p = x * in.inverse_target_t - in.target_lse;
    const double log_q = in.draft_row[v] * in.inverse_draft_t - in.draft_lse;
    return log_p > log_q ? log_p + log1mexp(log_q - log_p) : -kInf;
  }
  }
  return -kInf;
}

double gumbel(const DrawInputs& in, uint64_t element) {
  return gumbel_noise(in.seed, element, in.draw_counter, in.particle, in.stream_word);
}

/// A draw as the device does it: the argmax for kArgmax; otherwise the two-level Gumbel-max (a sub-tile by
/// log Z_s + Gumbel of element kTileDrawElement + s, then v inside it by weight + Gumbel of element v), from
/// p when a residual has no mass left. `level_gap`: the sub-tile race's best minus its runner-up.
Race draw(Draw mode, const DrawInputs& in, DType dtype, double* level_gap) {
  *level_gap = kInf;
  Race race;
  if (mode == Draw::kArgmax) {
    for (int v = 0; v < in.vocab; ++v) {
      const double score = log_weight(mode, in, v);
      if (score > -kInf)
        race.offer(score, v);
    }
    return race;
  }
  const TileLayout layout = verify_draw_layout(in.vocab, dtype);
  const int sub_tiles =
      (in.vocab + layout.tile_length - 1) / layout.tile_length * layout.sub_tiles_per_tile();
  auto sub_tile_race = [&](Draw how) {
    std::vector<double> max(sub_tiles, -kInf), sum(sub_tiles, 0.0);
    for (int v = 0; v < in.vocab; ++v) {
      const int s = layout.sub_tile(v);
      max[s] = std::max(max[s], log_weight(how, in, v));
    }
    for (int v = 0; v < in.vocab; ++v) {
      const int s = layout.sub_tile(v);
      const double w = log_weight(how, in, v);
      if (w > -kInf)
        sum[s] += std::exp(w - max[s]);
    }
    Race level;
    for (int s = 0; s < sub_tiles; ++s)
      if (max[s] > -kInf)
        level.offer(max[s] + std::log(sum[s]) + gumbel(in, kTileDrawElement + static_cast<uint64_t>(s)), s);
    return level;
  };
  Race level = sub_tile_race(mode);
  if (level.best_index < 0 && mode == Draw::kResidual) {
    mode = Draw::kTarget; // no residual mass: p
    level = sub_tile_race(mode);
  }
  if (level.best_index < 0)
    return race;
  *level_gap = level.second_index < 0 ? kInf : level.best - level.second;
  for (int v = 0; v < in.vocab; ++v) {
    if (layout.sub_tile(v) != level.best_index)
      continue;
    const double score = log_weight(mode, in, v);
    if (score > -kInf)
      race.offer(score + gumbel(in, static_cast<uint64_t>(v)), v);
  }
  return race;
}

bool any_bad(const float* row, int vocab) {
  for (int v = 0; v < vocab; ++v)
    if (bad_value(row[v]))
      return true;
  return false;
}

} // namespace

TileLayout verify_draw_layout(int vocab, DType dtype) {
  return TileLayout{verify_tile_length(vocab, dtype), 16 / dtype_bytes(dtype), verify_threads(vocab), 32};
}

Verdict verify_greedy(const int32_t* draft, int64_t draft_row_stride, const int32_t* target,
                      int64_t target_row_stride, int rows, int draft_steps, int vocab) {
  Verdict verdict;
  resize(verdict, rows);
  for (int row = 0; row < rows; ++row) {
    const int32_t* d = draft + row * draft_row_stride;
    const int32_t* t = target + row * target_row_stride;
    int accepted = draft_steps;
    uint32_t flags = 0;
    for (int j = 0; j < draft_steps; ++j) {
      const bool bad = out_of_range(d[j], vocab);
      if (bad || d[j] != t[j]) {
        accepted = j;
        if (bad)
          flags |= kFlagTokenOutOfRange;
        break;
      }
    }
    int32_t next = t[accepted];
    if (out_of_range(next, vocab)) {
      flags |= kFlagTokenOutOfRange;
      next = kInvalidToken;
    }
    record(verdict, row, accepted, draft_steps, next, flags);
  }
  return verdict;
}

bool StochasticVerdict::near_tie(int row, double coin_tolerance, double gap_tolerance) const {
  return coin_margin[row] < coin_tolerance || draw_gap[row] < gap_tolerance;
}

StochasticVerdict verify_stochastic(const StochasticProblem& p) {
  StochasticVerdict verdict;
  resize(verdict, p.rows);
  verdict.coin_margin.assign(p.rows, kInf);
  verdict.draw_gap.assign(p.rows, kInf);
  verdict.runner_up.assign(p.rows, -1);
  for (int row = 0; row < p.rows; ++row) {
    const int request = row / p.particles_per_request;
    const uint64_t seed = p.seeds[request];
    const uint32_t draw_counter = p.draw_counters[request];
    const uint32_t particle = static_cast<uint32_t>(row % p.particles_per_request);
    const float target_t = p.target_temperature[row];
    const float draft_t = p.draft_temperature[row];
    if (!(target_t >= 0.0f) || std::isinf(target_t) || !(draft_t >= 0.0f) || std::isinf(draft_t)) {
      record(verdict, row, 0, p.draft_steps, kInvalidToken, kFlagBadParameter);
      continue;
    }
    const int32_t* tokens = p.draft_tokens + row * p.draft_token_row_stride;
    const float* target_logprobs = p.target_logprobs + row * p.target_logprob_row_stride;
    const float* draft_logprobs = p.draft_logprobs + row * p.draft_logprob_row_stride;

    int accepted = p.draft_steps;
    uint32_t flags = 0;
    for (int j = 0; j < p.draft_steps; ++j) {
      const float log_p = target_logprobs[j], log_q = draft_logprobs[j];
      if (out_of_range(tokens[j], p.vocab)) {
        accepted = j;
        flags |= kFlagTokenOutOfRange;
        break;
      }
      if (bad_value(log_p) || bad_value(log_q)) {
        accepted = j;
        flags |= kFlagNanLogit;
        break;
      }
      if (log_p == -std::numeric_limits<float>::infinity()) {
        accepted = j;
        break;
      }
      if (log_p < log_q) {
        const double u = uniform_open01(philox_word(
            seed, 0, draw_counter, particle, philox_stream(Salt::kAcceptCoin, static_cast<uint32_t>(j))));
        const double log_ratio = static_cast<double>(log_p) - static_cast<double>(log_q);
        verdict.coin_margin[row] = std::min(verdict.coin_margin[row], std::abs(std::log(u) - log_ratio));
        if (!(std::log(u) < log_ratio)) {
          accepted = j;
          break;
        }
      }
    }

    int32_t next = kInvalidToken;
    if (!(flags & kFlagNanLogit)) {
      DrawInputs in{};
      in.target_row = p.target_logits + row * p.target_row_stride + accepted * p.target_position_stride;
      in.draft_row = p.draft_logits + row * p.draft_row_stride + accepted * p.draft_position_stride;
      in.inverse_target_t = target_t > 0.0f ? 1.0 / target_t : 0.0;
      in.inverse_draft_t = draft_t > 0.0f ? 1.0 / draft_t : 0.0;
      in.vocab = p.vocab;
      in.seed = seed;
      in.draw_counter = draw_counter;
      in.particle = particle;
      in.stream_word = philox_stream(Salt::kResidual, static_cast<uint32_t>(accepted));
      bool bad = any_bad(in.target_row, p.vocab);
      Race race;
      double level_gap = kInf;
      if (target_t == 0.0f) {
        race = draw(Draw::kArgmax, in, p.dtype, &level_gap);
      } else if (accepted == p.draft_steps) {
        race = draw(Draw::kTarget, in, p.dtype, &level_gap);
      } else if (draft_t == 0.0f) {
        in.excluded = tokens[accepted];
        race = draw(Draw::kTargetExcept, in, p.dtype, &level_gap);
      } else {
        bad = bad || any_bad(in.draft_row, p.vocab);
        in.target_lse = log_sum_exp(in.target_row, p.vocab, in.inverse_target_t);
        in.draft_lse = log_sum_exp(in.draft_row, p.vocab, in.inverse_draft_t);
        race = draw(Draw::kResidual, in, p.dtype, &level_gap); // from p when no residual mass is left
      }
      if (bad) {
        flags |= kFlagNanLogit;
      } else if (race.best_index < 0) {
        flags |= kFlagAllMasked;
      } else {
        next = race.best_index;
        verdict.draw_gap[row] = std::min(level_gap, race.second_index < 0 ? kInf : race.best - race.second);
        verdict.runner_up[row] = race.second_index;
      }
    }
    record(verdict, row, accepted, p.draft_steps, next, flags);
  }
  return verdict;
}

Packed pack(const int32_t* accepted, const int32_t* next_tokens, const int32_t* draft_tokens,
            int64_t draft_row_stride, const uint8_t* payload, int64_t payload_row_stride, int rows,
            int draft_steps, int width, int element_bytes, bool include_next) {
  Packed packed;
  packed.offsets.resize(rows);
  const int64_t position_bytes = static_cast<int64_t>(width) * element_bytes;
  for (int row = 0; row < rows; ++row) {
    const int k = std::clamp(accepted[row], 0, draft_steps);
    const int count = k + (include_next ? 1 : 0);
    packed.offsets[row] = packed.total;
    const uint8_t* source = payload + row * payload_row_stride * element_bytes;
    packed.bytes.insert(packed.bytes.end(), source, source + count * position_bytes);
    for (int j = 0; j < count; ++j) {
      const int32_t next = next_tokens ? next_tokens[row] : kInvalidToken;
      packed.tokens.push_back(
          j < k ? (draft_tokens ? draft_tokens[row * draft_row_stride + j] : kInvalidToken) : next);
    }
    packed.total += count;
  }
  return packed;
}

OracleBatch make_oracle_batch(std::mt19937_64& engine, int rows, int draft_steps, int vocab, double alpha) {
  OracleBatch batch;
  batch.rows = rows;
  batch.draft_steps = draft_steps;
  batch.vocab = vocab;
  batch.draft.resize(static_cast<size_t>(rows) * draft_steps);
  batch.target.resize(static_cast<size_t>(rows) * (draft_steps + 1));
  batch.accepted.resize(rows);
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  std::uniform_int_distribution<int32_t> shift(1, std::max(1, vocab - 1));
  std::binomial_distribution<int> accepted(draft_steps, alpha);
  for (int row = 0; row < rows; ++row) {
    const int k = accepted(engine);
    batch.accepted[row] = k;
    int32_t* d = batch.draft.data() + static_cast<size_t>(row) * draft_steps;
    int32_t* t = batch.target.data() + static_cast<size_t>(row) * (draft_steps + 1);
    for (int j = 0; j < draft_steps; ++j)
      d[j] = token(engine);
    for (int j = 0; j <= draft_steps; ++j)
      t[j] = j < k ? d[j] : token(engine);
    if (k < draft_steps)
      t[k] = (d[k] + shift(engine)) % vocab; // differs from the draft (vocab >= 2)
  }
  return batch;
}

} // namespace smcgraph::reference
