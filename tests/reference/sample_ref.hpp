// Host references of sample() and score() in double precision, drawing the same Philox numbers.
#pragma once

#include <cstdint>

namespace smcgraph::reference {

struct SampleResult {
  int32_t token = -1;
  double logprob = 0.0;
  double logz = 0.0;
  uint32_t flags = 0;
  double best_score = 0.0;      ///< race score (alpha l / T + Gumbel) of the winner
  double runner_up_score = 0.0; ///< of the second best; a near tie when the two are within 1e-6 relative
  bool near_tie() const;
};

/// Samples from softmax(alpha * logits / T) exactly as the device does (Gumbel noise from the Philox word
/// of (seed, vocab id, draw_counter, particle, stream_word), uniform_open01), in double.
SampleResult sample(const float* logits, int vocab, float temperature, float alpha, uint64_t seed,
                    uint32_t draw_counter, uint32_t particle, uint32_t stream_word);

/// log softmax(logits / T)[token] in double (T = 0: 0 for the argmax, -inf otherwise); flags as the device.
double token_logprob(const float* logits, int vocab, float temperature, int32_t token, uint32_t* flags);

} // namespace smcgraph::reference
