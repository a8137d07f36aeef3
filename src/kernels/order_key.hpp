// Integer keys for the sampler's warp reductions (logits_pass.cuh), which reduce 32-bit integers only
// (redux.sync, sm_80+): floats and doubles as order-preserving integers, and a sub-tile's sums as fixed-point
// parts whose integer sums are exact. Host and device: the CPU tests (test_sample_cpu) check the properties
// the sampler relies on, with the same code the kernels run.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "smcgraph/host_device.hpp"

namespace smcgraph::detail {

/// A float as an int that orders like max.NaN.f32 orders floats: its bits, the low 31 flipped when it is
/// negative (so -0 sits just below +0), any NaN as INT32_MAX. The max of two keys is the key of max.NaN of
/// the two floats, and from_order_key maps it back to the same bits (INT32_MAX to 0x7fffffff, the canonical
/// NaN that max.NaN returns).
SMCGRAPH_HOST_DEVICE constexpr int32_t order_key(float value) {
  const int32_t bits = std::bit_cast<int32_t>(value);
  return value != value ? INT32_MAX : bits >= 0 ? bits : bits ^ INT32_MAX;
}

SMCGRAPH_HOST_DEVICE constexpr float from_order_key(int32_t key) {
  return std::bit_cast<float>(key >= 0 ? key : key ^ INT32_MAX);
}

/// order_key for a double (the sub-tile race's keys): 64-bit keys, any NaN as INT64_MAX. A caller that needs
/// -0 and +0 to tie passes value + 0.0 (which is +0 for either).
SMCGRAPH_HOST_DEVICE constexpr int64_t order_key(double value) {
  const int64_t bits = std::bit_cast<int64_t>(value);
  return value != value ? INT64_MAX : bits >= 0 ? bits : bits ^ INT64_MAX;
}

/// The fixed-point warp sum of values in [0, TERMS] (a lane's sum of TERMS terms, each in [0, 1]): each lane
/// splits its value into `high` multiples of 2^-S and `low` multiples of 2^-2S (S as large as 32 lanes'
/// totals of either part fit in an int: 32 x TERMS x 2^S <= 2^30), the warp adds the parts as integers
/// (exact), and fixed_point_join rounds the total once to a float.
template <int TERMS> struct FixedPointSum {
  static constexpr int kLaneBits = 5; // 32 lanes
  static constexpr int kTermBits = TERMS <= 1 ? 0 : std::bit_width(static_cast<unsigned>(TERMS - 1));
  static constexpr int kShift = 30 - kLaneBits - kTermBits;
  static_assert(kShift >= 12, "too many terms a lane for the fixed-point warp sum");
  static constexpr float kScale = static_cast<float>(1u << kShift);
  static constexpr float kUnit = 1.0f / kScale;

  struct Parts {
    int32_t high, low;
  };

  /// value * 2^S = high + fraction, exactly (a power-of-two scale, and a float's fraction is a float);
  /// low = the fraction in units of 2^-S, rounded to nearest even.
  SMCGRAPH_HOST_DEVICE static Parts split(float value) {
    const float scaled = value * kScale;
#if defined(__CUDA_ARCH__)
    const float whole = truncf(scaled);
    return Parts{static_cast<int32_t>(whole), __float2int_rn((scaled - whole) * kScale)};
#else
    const float whole = std::trunc(scaled);
    return Parts{static_cast<int32_t>(whole),
                 static_cast<int32_t>(std::nearbyint((scaled - whole) * kScale))};
#endif
  }

  /// The warp's total from the sums of its lanes' parts: high 2^-S + low 2^-2S, one FMA.
  SMCGRAPH_HOST_DEVICE static float join(int32_t high_total, int32_t low_total) {
#if defined(__CUDA_ARCH__)
    return fmaf(static_cast<float>(high_total), kUnit, static_cast<float>(low_total) * (kUnit * kUnit));
#else
    return std::fma(static_cast<float>(high_total), kUnit, static_cast<float>(low_total) * (kUnit * kUnit));
#endif
  }
};

} // namespace smcgraph::detail
