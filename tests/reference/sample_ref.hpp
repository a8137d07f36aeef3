// Host references of sample() and score() in double precision, drawing the same Philox numbers.
#pragma once

#include <cstdint>

namespace smcgraph::reference {

struct SampleResult {
  int32_t token = -1;
  double logprob = 0.0;
  double logz = 0.0;
  uint32_t flags = 0;
  int32_t tile = -1;                 ///< the tile the token came from (0 when there is one tile, or greedy)
  double best_score = 0.0;           ///< element race score (alpha l / T + Gumbel) of the winner in its tile
  double runner_up_score = 0.0;      ///< of the second best in that tile
  double tile_best_score = 0.0;      ///< tile race score (log Z_t + Gumbel) of the winning tile
  double tile_runner_up_score = 0.0; ///< of the second best tile (-inf with one tile)
  /// A near tie at either level: the two best scores within 1e-6 relative (the device, in float, may
  /// pick either).
  bool near_tie() const;
};

/// Samples from softmax(alpha * logits / T) exactly as the device does, in double: the two-level
/// Gumbel-max over tiles of `tile_length` logits (smcgraph::sample_tile_length(dtype) for the device's),
/// tile t scored log Z_t + Gumbel from the Philox word of element kTileDrawElement + t, then the tokens of
/// the winning tile alone scored alpha l_v / T + Gumbel from the word of element v, all under (seed,
/// draw_counter, particle, stream_word) and uniform_open01. One tile: no tile draw.
SampleResult sample(const float* logits, int vocab, int tile_length, float temperature, float alpha,
                    uint64_t seed, uint32_t draw_counter, uint32_t particle, uint32_t stream_word);

/// log softmax(logits / T)[token] in double (T = 0: 0 for the argmax, -inf otherwise); flags as the device.
double token_logprob(const float* logits, int vocab, float temperature, int32_t token, uint32_t* flags);

} // namespace smcgraph::reference
