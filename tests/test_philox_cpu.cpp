// Philox4x32-10 known-answer vectors (Random123 kat_vectors) and the uniform construction.
#include <doctest/doctest.h>

#include <bit>
#include <cstring>

#include "smcgraph/philox.hpp"

using smcgraph::PhiloxCounter;
using smcgraph::PhiloxKey;

TEST_CASE("philox4x32_10 matches the Random123 known-answer vectors") {
  const PhiloxCounter zero = smcgraph::philox4x32_10({0, 0, 0, 0}, {0, 0});
  CHECK(zero == PhiloxCounter{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  const PhiloxCounter ones = smcgraph::philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                                                     {0xffffffffu, 0xffffffffu});
  CHECK(ones == PhiloxCounter{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
  const PhiloxCounter pi = smcgraph::philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                                                   {0xa4093822u, 0x299f31d0u});
  CHECK(pi == PhiloxCounter{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});
}

TEST_CASE("philox_word follows the documented counter layout") {
  const uint64_t seed = 0x0123456789abcdefull;
  const uint32_t stream = smcgraph::philox_stream(smcgraph::Salt::kDraft, 3);
  CHECK(stream == ((1u << 24) | 3u));
  for (uint64_t element : {0ull, 1ull, 5ull, 131071ull, (1ull << 33) + 2}) {
    const PhiloxCounter block = smcgraph::philox4x32_10({static_cast<uint32_t>(element / 4), 17u, 2u, stream},
                                                        smcgraph::philox_key(seed));
    CHECK(smcgraph::philox_word(seed, element, 17u, 2u, stream) == block[element % 4]);
  }
  // Any field change gives different words (no two draws share a counter).
  const uint32_t base = smcgraph::philox_word(seed, 8, 1, 0, stream);
  CHECK(base != smcgraph::philox_word(seed + 1, 8, 1, 0, stream));
  CHECK(base != smcgraph::philox_word(seed, 8, 2, 0, stream));
  CHECK(base != smcgraph::philox_word(seed, 8, 1, 1, stream));
  CHECK(base != smcgraph::philox_word(seed, 8, 1, 0, smcgraph::philox_stream(smcgraph::Salt::kBonus, 3)));
  CHECK(base != smcgraph::philox_word(seed, 12, 1, 0, stream));
}

TEST_CASE("uniform_open01 is (2k + 1) 2^-24, strictly inside (0, 1), equal to the device bit construction") {
  CHECK(smcgraph::uniform_open01(0u) == 0x1p-24f);
  CHECK(smcgraph::uniform_open01(0xffffffffu) == 1.0f - 0x1p-24f);
  for (uint32_t k = 0; k < (1u << 23); k += 977) {
    const uint32_t word = (k << 9) | (k & 0x1ff);
    const float host = smcgraph::uniform_open01(word);
    // Device: bits 0x3f800000 | (word >> 9) as float, minus (1 - 2^-24).
    const float device = std::bit_cast<float>(0x3f800000u | (word >> 9)) - 0.99999994039535522f;
    REQUIRE(host == device);
    REQUIRE(host > 0.0f);
    REQUIRE(host < 1.0f);
  }
}
