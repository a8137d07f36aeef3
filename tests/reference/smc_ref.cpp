#include "reference/smc_ref.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "smcgraph/philox.hpp"

namespace smcgraph::reference {

void accumulate_weights_ref(const std::vector<float>& draft_logprobs,
                            const std::vector<float>& target_logprobs, const std::vector<float>& logz,
                            const std::vector<int32_t>& draft_tokens,
                            const std::vector<int32_t>& bonus_tokens, const std::vector<float>& alpha,
                            const std::vector<uint8_t>& live, int rows, int steps, int eos_id,
                            std::vector<double>& logw, std::vector<uint8_t>& finished,
                            std::vector<int32_t>& first_eos) {
  first_eos.assign(rows, -1);
  for (int row = 0; row < rows; ++row) {
    if (!live[row] || finished[row])
      continue;
    double increment = 0.0;
    int eos_step = steps;
    for (int k = 0; k < steps; ++k) {
      const size_t at = static_cast<size_t>(row) * steps + k;
      // Two separate roundings, as the kernel's __dmul_rn / __dsub_rn (volatile keeps a compiler from
      // fusing).
      volatile double product = static_cast<double>(alpha[row]) * static_cast<double>(target_logprobs[at]);
      increment += product - static_cast<double>(draft_logprobs[at]);
      if (draft_tokens[at] == eos_id) {
        eos_step = k;
        break;
      }
    }
    if (eos_step == steps) {
      increment += static_cast<double>(logz[row]);
      if (!bonus_tokens.empty() && bonus_tokens[row] == eos_id)
        finished[row] = 1;
    } else {
      finished[row] = 1;
    }
    logw[row] += increment;
    first_eos[row] = eos_step;
  }
}

double resample_uniform(uint64_t seed, uint32_t draw_counter) {
  return uniform_open01(philox_word(seed, 0, draw_counter, 0, philox_stream(Salt::kResample, 0)));
}

std::vector<int> systematic_counts(const std::vector<double>& normalised, double u) {
  const int n = static_cast<int>(normalised.size());
  std::vector<int> counts(n);
  double cumulative = 0.0;
  int previous_end = 0;
  for (int i = 0; i < n; ++i) {
    cumulative += normalised[i];
    const double boundary = i == n - 1 ? 1.0 : cumulative;
    const int end = std::max(previous_end, std::clamp(static_cast<int>(std::ceil(n * boundary - u)), 0, n));
    counts[i] = end - previous_end;
    previous_end = end;
  }
  return counts;
}

std::vector<int> plan_from_counts(const std::vector<int>& counts) {
  const int n = static_cast<int>(counts.size());
  std::vector<int> ancestor(n), dead;
  for (int i = 0; i < n; ++i) {
    ancestor[i] = i;
    if (counts[i] == 0)
      dead.push_back(i);
  }
  size_t next_dead = 0;
  for (int i = 0; i < n; ++i) {
    for (int copy = 1; copy < counts[i]; ++copy)
      ancestor[dead.at(next_dead++)] = i;
  }
  return ancestor;
}

void resample_ref(const std::vector<uint8_t>& live, const std::vector<float>& tau,
                  const std::vector<uint64_t>& seeds, const std::vector<uint32_t>& draw_counters,
                  int requests, int n, std::vector<double>& logw, std::vector<int32_t>& ancestor,
                  std::vector<double>& ess, std::vector<uint8_t>& resampled,
                  std::vector<double>& log_evidence) {
  ancestor.resize(static_cast<size_t>(requests) * n);
  ess.resize(requests);
  resampled.resize(requests);
  for (int request = 0; request < requests; ++request) {
    const int base = request * n;
    for (int i = 0; i < n; ++i)
      ancestor[base + i] = base + i;
    ess[request] = 0.0;
    resampled[request] = 0;
    bool all_live = true, any_nan = false;
    double max_logw = -std::numeric_limits<double>::infinity();
    for (int i = 0; i < n; ++i) {
      all_live = all_live && live[base + i] != 0;
      any_nan = any_nan || std::isnan(logw[base + i]);
      max_logw = std::max(max_logw, logw[base + i]);
    }
    if (!all_live || any_nan || !std::isfinite(max_logw))
      continue;
    std::vector<double> weight(n);
    double total = 0.0;
    for (int i = 0; i < n; ++i)
      total += weight[i] = std::exp(logw[base + i] - max_logw);
    double sum_squares = 0.0;
    for (double& w : weight) {
      w /= total;
      sum_squares += w * w;
    }
    ess[request] = 1.0 / sum_squares;
    if (!(ess[request] < static_cast<double>(tau[request]) * n))
      continue;
    resampled[request] = 1;
    const std::vector<int> plan =
        plan_from_counts(systematic_counts(weight, resample_uniform(seeds[request], draw_counters[request])));
    for (int i = 0; i < n; ++i) {
      ancestor[base + i] = base + plan[i];
      logw[base + i] = 0.0;
    }
    log_evidence[request] += max_logw + std::log(total) - std::log(static_cast<double>(n));
  }
}

void reshuffle_ref(HostSlots& state, const std::vector<int32_t>& ancestor, std::vector<uint8_t>& finished) {
  for (int dst = 0; dst < state.rows; ++dst) {
    const int source = ancestor[dst];
    if (source == dst || source < 0 || source >= state.rows || ancestor[source] != source)
      continue;
    copy_row_refcounted_ref(state, source, dst);
    finished[dst] = finished[source];
  }
}

std::vector<int32_t> random_plan(std::mt19937_64& rng, int requests, int n) {
  std::vector<int32_t> ancestor(static_cast<size_t>(requests) * n);
  std::bernoulli_distribution survives(0.5);
  for (int request = 0; request < requests; ++request) {
    const int base = request * n;
    std::vector<int> survivors;
    for (int i = 0; i < n; ++i) {
      if (survives(rng))
        survivors.push_back(i);
    }
    if (survivors.empty())
      survivors.push_back(std::uniform_int_distribution<int>(0, n - 1)(rng));
    std::uniform_int_distribution<size_t> pick(0, survivors.size() - 1);
    for (int i = 0; i < n; ++i) {
      const bool survivor = std::find(survivors.begin(), survivors.end(), i) != survivors.end();
      ancestor[base + i] = base + (survivor ? i : survivors[pick(rng)]);
    }
  }
  return ancestor;
}

} // namespace smcgraph::reference
