#include "reference/sample_ref.hpp"

#include <cmath>
#include <limits>

#include "smcgraph/philox.hpp"
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

bool SampleResult::near_tie() const {
  return std::abs(best_score - runner_up_score) <= 1e-6 * std::max(1.0, std::abs(best_score));
}

SampleResult sample(const float* logits, int vocab, float temperature, float alpha, uint64_t seed,
                    uint32_t draw_counter, uint32_t particle, uint32_t stream_word) {
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
    result.best_score = logits[best];
    result.runner_up_score = second;
    return result;
  }
  const double scale = 1.0 / static_cast<double>(temperature);
  const double a = alpha;
  double best = -kInf, second = -kInf;
  int best_index = -1;
  for (int v = 0; v < vocab; ++v) {
    if (logits[v] == -std::numeric_limits<float>::infinity())
      continue;
    const double u =
        uniform_open01(philox_word(seed, static_cast<uint64_t>(v), draw_counter, particle, stream_word));
    const double score = a * logits[v] * scale - std::log(-std::log(u));
    if (score > best) {
      second = best;
      best = score;
      best_index = v;
    } else if (score > second) {
      second = score;
    }
  }
  double m = 0.0;
  const double lse = log_sum_exp(logits, vocab, scale, &m);
  const double lse_power = log_sum_exp(logits, vocab, a * scale, &m);
  result.token = best_index;
  result.best_score = best;
  result.runner_up_score = second;
  result.logprob = a * logits[best_index] * scale - lse_power;
  result.logz = lse_power - a * lse;
  return result;
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
  for (int v = 0; v < vocab; ++v)
    m = std::max(m, static_cast<double>(logits[v]));
  if (temperature == 0.0f)
    return logits[token] == m ? 0.0 : -kInf;
  const double scale = 1.0 / static_cast<double>(temperature);
  const double lse = log_sum_exp(logits, vocab, scale, &m);
  return logits[token] * scale - lse;
}

} // namespace smcgraph::reference
