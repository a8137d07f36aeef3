// Device side of the stateless Philox keying (include/smcgraph/philox.hpp has the layout and limits).
#pragma once

#include <cstdint>

#include <curand_philox4x32_x.h>

#include "smcgraph/philox.hpp"

namespace smcgraph::device {

/// Philox4x32-10 of the counter {element / 4, draw_counter, particle, stream_word} under `seed`; the
/// four words are the draws of elements 4 * group .. 4 * group + 3 (include/smcgraph/philox.hpp's host
/// version is the reference). cuRAND's round and key schedule, as a loop: curand_Philox4x32_10 unrolls its
/// ten rounds, about ten times the code at each call site, which matters where a kernel runs from cold
/// instruction caches and a flushed L2, as the cycle's kernels do (sample_bench's cold columns). UNROLL > 1
/// unrolls them (UNROLL >= 10: all ten), for a kernel whose launches are bound by instruction issue rather
/// than by fetching its code. The same words either way.
template <int UNROLL = 1>
__device__ __forceinline__ uint4 philox_group(uint64_t seed, uint32_t group, uint32_t draw_counter,
                                              uint32_t particle, uint32_t stream_word) {
  uint4 counter = make_uint4(group, draw_counter, particle, stream_word);
  uint2 key = make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
#pragma unroll(UNROLL)
  for (int round = 0; round < 10; ++round) {
    counter = _philox4x32round(counter, key);
    key.x += PHILOX_W32_0;
    key.y += PHILOX_W32_1;
  }
  return counter;
}

/// Word `lane` (0..3) of a Philox group.
__device__ __forceinline__ uint32_t group_word(const uint4& words, uint32_t lane) {
  return lane == 0 ? words.x : lane == 1 ? words.y : lane == 2 ? words.z : words.w;
}

/// The sampler's sub-tile draw (philox.hpp): the word of element kTileDrawElement + tile (the row's sub-tile
/// index), i.e. word tile % 4 of
/// the counter {2^31 | tile / 4, draw_counter, particle, stream_word}. Vocab draws keep c.x < 2^31.
template <int UNROLL = 1>
__device__ __forceinline__ uint32_t philox_tile_word(uint64_t seed, uint32_t tile, uint32_t draw_counter,
                                                     uint32_t particle, uint32_t stream_word) {
  constexpr uint32_t kTileGroupBase = static_cast<uint32_t>(kTileDrawElement >> 2);
  return group_word(
      philox_group<UNROLL>(seed, kTileGroupBase | (tile >> 2), draw_counter, particle, stream_word),
      tile & 3u);
}

/// The sampler's rank draws (philox.hpp): Philox group `group` of element kRankDrawElement + 4 group, i.e.
/// the counter {2^31 | 2^30 | group, draw_counter, particle, stream_word}: the words of ranks 4 group .. 4
/// group + 3 of the winning sub-tile.
template <int UNROLL = 1>
__device__ __forceinline__ uint4 philox_rank_group(uint64_t seed, uint32_t group, uint32_t draw_counter,
                                                   uint32_t particle, uint32_t stream_word) {
  constexpr uint32_t kRankGroupBase = static_cast<uint32_t>(kRankDrawElement >> 2);
  return philox_group<UNROLL>(seed, kRankGroupBase | group, draw_counter, particle, stream_word);
}

/// Same value as smcgraph::uniform_open01 ((2k + 1) * 2^-24 from the top 23 bits), without an int->float
/// conversion: 1 + k * 2^-23 built from bits, minus (1 - 2^-24), is exact (Sterbenz).
__device__ __forceinline__ float uniform_open01(uint32_t word) {
  return __uint_as_float(0x3f800000u | (word >> 9)) - 0.99999994039535522f;
}

/// The draw-counter stage for request q: its next cycle draws fresh Philox words (advance_draw_counters()
/// launches it alone; a recipe may fold it into another per-request kernel that runs after the cycle's last
/// draw). `loaded` is draw_counters[q] as the caller read it (with its other loads, before its first store).
__device__ __forceinline__ void advance_draw_counter(uint32_t* draw_counters, int q, uint32_t loaded) {
  draw_counters[q] = loaded + 1u;
}
__device__ __forceinline__ void advance_draw_counter(uint32_t* draw_counters, int q) {
  advance_draw_counter(draw_counters, q, draw_counters[q]);
}

} // namespace smcgraph::device
