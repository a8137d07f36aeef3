// Host references of sample() and score() in double precision, drawing the same Philox numbers.
#pragma once

#include <cstdint>

#include "smcgraph/types.hpp"

namespace smcgraph::reference {

/// How the two-level sampler cuts a row: tiles of `tile_length` logits (one CTA each on the device), each
/// read as vectors of `vector_length` consecutive logits, vector q of a tile by thread q % threads; the
/// threads' groups of `lanes` (warps) make the tile's threads / lanes sub-tiles, numbered over the row
/// (tile t holds sub-tiles t * sub_tiles_per_tile() ...). A sub-tile is thus not contiguous: sub-tile w of a
/// tile holds the vectors w * lanes + i + threads * k, i < lanes.
struct TileLayout {
  int tile_length = 1;
  int vector_length = 1;
  int threads = 1;
  int lanes = 1;

  /// The device's layout for `dtype` (sample_tile_length(dtype), 16-byte vectors, 256 threads, warps of 32):
  /// sub_tile() agrees with smcgraph::sample_subtile().
  static TileLayout device(DType dtype);
  int sub_tiles_per_tile() const { return threads / lanes; }
  /// The row-wide sub-tile of vocab id v.
  int sub_tile(int v) const;
  /// Throws smcgraph::Error unless every field is >= 1, vector_length * threads divides tile_length and
  /// lanes divides threads.
  void validate(const char* where) const;
};

struct SampleResult {
  int32_t token = -1;
  double logprob = 0.0;
  double logz = 0.0;
  uint32_t flags = 0;
  int32_t tile = -1;            ///< the tile the token came from (0 when greedy)
  int32_t sub_tile = -1;        ///< the row-wide sub-tile it came from (0 when greedy)
  double best_score = 0.0;      ///< element race score (alpha l / T + Gumbel) of the winner in its sub-tile
  double runner_up_score = 0.0; ///< of the second best in that sub-tile
  double sub_tile_best_score = 0.0;      ///< sub-tile race score (log Z_s + Gumbel) of the winning sub-tile
  double sub_tile_runner_up_score = 0.0; ///< of the second best sub-tile (-inf when only one has mass)
  /// A near tie at either level: the two best scores within 1e-6 relative (the device, in float, may
  /// pick either).
  bool near_tie() const;
};

/// Gumbel noise -log(-log u), in double, of the Philox word of `element` (a vocab id, kTileDrawElement + a
/// sub-tile, or kRankDrawElement + a rank) under (seed, draw_counter, particle, stream_word): the noise of
/// the sampler's and the stochastic verifier's races.
double gumbel_noise(uint64_t seed, uint64_t element, uint32_t draw_counter, uint32_t particle,
                    uint32_t stream_word);

/// Samples from softmax(alpha * logits / T) exactly as the device does, in double: the two-level Gumbel-max
/// over the sub-tiles of `layout`, sub-tile s (the row-wide index, TileLayout::sub_tile) scored
/// log Z_s + Gumbel from the Philox word of element kTileDrawElement + s, then the tokens of the winning
/// sub-tile alone scored alpha l_v / T + Gumbel from the word of element kRankDrawElement + j, j the token's
/// rank in the sub-tile by ascending id (0 for its smallest id), all under (seed, draw_counter,
/// particle, stream_word) and uniform_open01. Sub-tiles that are all -inf (or empty) never win; ties go to
/// the smaller index at both levels.
SampleResult sample(const float* logits, int vocab, const TileLayout& layout, float temperature, float alpha,
                    uint64_t seed, uint32_t draw_counter, uint32_t particle, uint32_t stream_word);

/// The device's sampler for tiles of `tile_length` logits: tile_length must be sample_tile_length(dtype) of
/// some dtype (4096 fp32, 8192 bf16 / fp16), whose TileLayout::device(dtype) it uses.
SampleResult sample(const float* logits, int vocab, int tile_length, float temperature, float alpha,
                    uint64_t seed, uint32_t draw_counter, uint32_t particle, uint32_t stream_word);

/// log softmax(logits / T)[token] in double (T = 0: 0 for the argmax, ties to the smallest id, -inf for every
/// other token, one that ties the maximum included); flags as the device.
double token_logprob(const float* logits, int vocab, float temperature, int32_t token, uint32_t* flags);

} // namespace smcgraph::reference
