// Graph-safe, stateless Philox4x32-10 keying (DESIGN.md §4) and its host implementation.
//
// Every random number smcgraph draws is one 32-bit word of Philox4x32-10(counter, key):
//
//   key     = the request's 64-bit seed              (k.x = low 32 bits, k.y = high 32 bits)
//   counter = { element / 4,                         (c.x: vocab id / 4 for Gumbel noise, else 0)
//               draw counter of the request,         (c.y: advanced in-graph, once per cycle)
//               particle index within the request,   (c.z)
//               salt << 24 | step }                  (c.w: which draw of the cycle)
//   word    = element % 4
//
// The sampler's two-level race (sample.hpp) draws, under one (c.y, c.z, c.w), one word per sub-tile t of the
// row (sample_subtile(); element = kTileDrawElement + t, so c.x = 2^31 | t / 4) and one word per rank j
// inside the winning sub-tile (element = kRankDrawElement + j, so c.x = 2^31 | 2^30 | j / 4). Other draws of
// one value per vocab id (the stochastic verifier, verify.hpp) use element = v, so c.x < 2^31: the top two
// bits of c.x keep the three kinds apart.
//
// Limits: vocab ids < 2^33, sub-tiles and ranks < 2^32; 2^32 cycles per request before the draw counter wraps
// (a wrap would repeat numbers: at 10^4 cycles/s that is 5 days of one request); particles < 2^32; steps <
// 2^24, 255 salts. Distinct (salt, step) pairs keep the draws of one cycle apart, the draw counter keeps
// cycles apart, the particle keeps particles apart and the key keeps requests apart: no two draws share a
// counter.
//
// Device code calls cuRAND's curand_Philox4x32_10 (see src/kernels/random.cuh); the host
// implementation below is bit-for-bit the same function (tests compare them, and check the Random123
// known-answer vectors).
#pragma once

#include <array>
#include <cstdint>

#include "smcgraph/host_device.hpp"

namespace smcgraph {

/// Which draw of a cycle a random number belongs to (the high byte of counter word w).
enum class Salt : uint32_t {
  kDraft = 1,      ///< draft token d_{step+1}
  kBonus = 2,      ///< bonus token from the target's last column
  kAcceptCoin = 3, ///< speculative accept/reject coins
  kResidual = 4,   ///< speculative residual sample after a rejection
  kResample = 5,   ///< the systematic-resampling uniform
  kAdmission = 6,  ///< first token at admission
  kResult = 7,     ///< drawing the returned particle by weight
  kUser = 8,       ///< free for callers of the standalone sampler
};

inline constexpr uint32_t kMaxStep = (1u << 24) - 1;

/// Counter word w: salt in the high byte, step (< 2^24) below it.
SMCGRAPH_HOST_DEVICE constexpr uint32_t philox_stream(Salt salt, uint32_t step) {
  return (static_cast<uint32_t>(salt) << 24) | (step & kMaxStep);
}

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

/// Host Philox4x32-10 (Salmon et al., SC'11), identical to cuRAND's curand_Philox4x32_10.
inline PhiloxCounter philox4x32_10(PhiloxCounter counter, PhiloxKey key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t product0 = static_cast<uint64_t>(kMul0) * counter[0];
    const uint64_t product1 = static_cast<uint64_t>(kMul1) * counter[2];
    const uint32_t hi0 = static_cast<uint32_t>(product0 >> 32), lo0 = static_cast<uint32_t>(product0);
    const uint32_t hi1 = static_cast<uint32_t>(product1 >> 32), lo1 = static_cast<uint32_t>(product1);
    counter = {hi1 ^ counter[1] ^ key[0], lo1, hi0 ^ counter[3] ^ key[1], lo0};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return counter;
}

inline PhiloxKey philox_key(uint64_t seed) {
  return {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
}

/// Element id of the first tile draw of the two-level sampler: sub-tile t (< 2^32) draws the word of element
/// kTileDrawElement + t (counter word c.x = 2^31 | t / 4, word t % 4). Vocab ids stay below it.
inline constexpr uint64_t kTileDrawElement = uint64_t{1} << 33;
static_assert((kTileDrawElement >> 2) == 0x80000000u, "tile draws own the high bit of counter word c.x");

/// Element id of the first rank draw of the two-level sampler's second level: the element of rank j (< 2^32;
/// its place by ascending vocab id) inside the winning sub-tile draws the word of element kRankDrawElement +
/// j (counter word c.x = 2^31 | 2^30 | j / 4, word j % 4), whichever sub-tile won. Tile draws stay below it.
inline constexpr uint64_t kRankDrawElement = kTileDrawElement + (uint64_t{1} << 32);
static_assert((kRankDrawElement >> 2) == 0xC0000000u, "rank draws own the top two bits of counter word c.x");

/// The word smcgraph draws for (seed, element, draw counter, particle, stream) per the layout above.
inline uint32_t philox_word(uint64_t seed, uint64_t element, uint32_t draw_counter, uint32_t particle,
                            uint32_t stream) {
  const PhiloxCounter out =
      philox4x32_10({static_cast<uint32_t>(element >> 2), draw_counter, particle, stream}, philox_key(seed));
  return out[element & 3];
}

/// A uniform in the open interval (0, 1) from the top 23 bits of a Philox word: (2k + 1) * 2^-24, exact
/// in float, so never 0 or 1 (both would make the exponential race degenerate).
SMCGRAPH_HOST_DEVICE inline float uniform_open01(uint32_t word) {
  const uint32_t k = word >> 9;
  return (static_cast<float>(k) * 2.0f + 1.0f) * 5.9604644775390625e-08f; // 2^-24
}

static_assert(static_cast<uint32_t>(Salt::kUser) < 256, "salts live in one byte");

} // namespace smcgraph
