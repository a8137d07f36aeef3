// The resample stage's device code (resample.cu launches it alone; the SMC cycle's end, commit.cu, composes
// it with the commit and the reshuffle): per-request systematic resampling by one warp, lane l owning the
// contiguous particles l * ceil(N / 32) .., so warp scans walk the particles in order.
#pragma once

#include "kernels/random.cuh"
#include "kernels/warp_in_order.cuh"
#include "smcgraph/runtime.hpp"
#include "smcgraph/smc_kernels.hpp"

namespace smcgraph::device {

/// Shared memory one resampling warp needs.
struct ResampleWarpStorage {
  int dead_particles[kMaxResampleParticles];
};

/// The resampling's warp collectives are warp_in_order.cuh's cub-order loops (sum, max, exclusive_sum,
/// exclusive_max), so the same bits as cub's: the resampling's time in a cycle follows its code size (it runs
/// cold, resample_request below). (SmcCycleEndKernel 7,856 -> 6,832 SASS instructions. Measured on an NVIDIA
/// H200 only together with the sampler pass's loops, logits_pass.cuh; the GPU suite, including the
/// resampling's host-reference and batch-invariance tests, passed, and `generate --kind smc` gave the same
/// text with and without them.)

/// resample_request for requests of up to 32 * PER_LANE particles (lane l owns particles l * ceil(n / 32) ..,
/// at most PER_LANE of them): the same arithmetic, in the same order, for any PER_LANE that covers n.
template <int PER_LANE>
__device__ __forceinline__ void resample_request_lanes(const ResampleInputs& in, double* logw,
                                                       const ResampleOutputs& out, int request,
                                                       ResampleWarpStorage& warp_storage) {
  constexpr int kPerLane = PER_LANE;
  constexpr unsigned kFullMask = 0xffffffffu;
  int* dead_particles = warp_storage.dead_particles;
  const int lane = threadIdx.x % 32;
  const int n = in.particles_per_request;
  const int per_lane = (n + 31) / 32;
  const int first = lane * per_lane;
  const int base_row = request * n;
  auto valid = [&](int t) { return t < per_lane && first + t < n; };
  auto write_identity_plan = [&] {
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      if (valid(t))
        out.ancestor[base_row + first + t] = base_row + first + t;
    }
  };

  double weight[kPerLane]; // logw, then exp(logw - max), then normalised
  bool lane_live = true, lane_nan = false;
  double lane_max = -INFINITY;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    weight[t] = -INFINITY;
    if (!valid(t))
      continue;
    lane_live = lane_live && in.live[base_row + first + t] != 0;
    weight[t] = logw[base_row + first + t];
    lane_nan = lane_nan || isnan(weight[t]);
    lane_max = fmax(lane_max, weight[t]);
  }
  const bool all_live = __all_sync(kFullMask, lane_live);
  const bool any_nan = __any_sync(kFullMask, lane_nan);
  const double max_logw = __shfl_sync(kFullMask, warp_in_order::max(lane_max), 0);
  // Not taking part (padding, a request being torn down) or nothing to normalise: leave it alone.
  if (!all_live || any_nan || !isfinite(max_logw)) {
    write_identity_plan();
    if (lane == 0) {
      out.ess[request] = 0.0;
      out.resampled[request] = 0;
    }
    return;
  }

  double lane_sum = 0.0;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    weight[t] = valid(t) ? exp(weight[t] - max_logw) : 0.0;
    lane_sum += weight[t];
  }
  const double total = __shfl_sync(kFullMask, warp_in_order::sum(lane_sum), 0);
  double lane_normalised = 0.0, lane_squares = 0.0;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    weight[t] /= total;
    lane_normalised += weight[t];
    lane_squares += weight[t] * weight[t];
  }
  const double sum_squares = __shfl_sync(kFullMask, warp_in_order::sum(lane_squares), 0);
  const double ess = 1.0 / sum_squares;
  const bool resample_now = ess < static_cast<double>(in.tau[request]) * n;
  if (lane == 0) {
    out.ess[request] = ess;
    out.resampled[request] = resample_now ? 1 : 0;
  }
  if (!resample_now) {
    write_identity_plan();
    return;
  }

  const uint4 words = device::philox_group(in.seeds[request], 0, in.draw_counters[request], 0,
                                           philox_stream(Salt::kResample, 0));
  const double u = device::uniform_open01(words.x);

  // F_i = #{m : (u + m) / N < C_i} = ceil(N * C_i - u), clamped to [0, N]; count_i = F_i - F_{i-1}. The
  // running max makes F monotone even where the scan's rounding differs from the in-lane sums, so the
  // counts are never negative and always add up to F_{N-1} = N (C_{N-1} is forced to 1).
  double cumulative = warp_in_order::exclusive_sum(lane_normalised);
  int offspring_end[kPerLane];
  int lane_end = 0;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    offspring_end[t] = lane_end;
    if (!valid(t))
      continue;
    cumulative += weight[t];
    const double boundary = first + t == n - 1 ? 1.0 : cumulative;
    const int end = min(max(static_cast<int>(ceil(n * boundary - u)), 0), n);
    lane_end = max(lane_end, end);
    offspring_end[t] = lane_end;
  }
  const int end_before = warp_in_order::exclusive_max(lane_end);
  int count[kPerLane];
  int previous_end = end_before, lane_dead = 0, lane_extra = 0;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    count[t] = 0;
    if (!valid(t))
      continue;
    const int end = max(offspring_end[t], end_before);
    count[t] = end - previous_end;
    previous_end = end;
    lane_dead += count[t] == 0 ? 1 : 0;
    lane_extra += max(count[t] - 1, 0);
  }

  // Dead particles in increasing order receive the extra copies of the survivors in increasing order.
  int dead_rank = warp_in_order::exclusive_sum(lane_dead),
      extra_rank = warp_in_order::exclusive_sum(lane_extra);
  int* dead = dead_particles;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    if (valid(t) && count[t] == 0)
      dead[dead_rank++] = first + t;
  }
  __syncwarp();
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    if (!valid(t))
      continue;
    const int row = base_row + first + t;
    if (count[t] > 0)
      out.ancestor[row] = row;
    for (int copy = 1; copy < count[t]; ++copy)
      out.ancestor[base_row + dead[extra_rank++]] = row;
    logw[row] = 0.0;
  }
  if (lane == 0)
    out.log_evidence[request] += max_logw + log(total) - log(static_cast<double>(n));
}

/// Request `request`'s weights normalised, its ESS, and (ESS < tau N) its systematic resampling plan into
/// out.ancestor (identity rows otherwise), logw reset for a resampled request and log Z-hat advanced. Every
/// lane of the calling warp calls it for the same request. A request of up to 32 particles (a particle a
/// lane) runs the one-particle-a-lane instance: the same results from a fraction of the code (loops of one
/// iteration instead of kMaxResampleParticles / 32 unrolled ones). Its code is cold in the SMC cycle's end
/// kernel (the cycle's other kernels run in between), and fetching it dominates: clock64 stamps in that
/// kernel (H100, toy SMC N 8 K 4 at 1 request) put the normalisation and sum of squares, one particle a lane
/// either way, at 2.9 us in the 8-a-lane instance and 1.1 us in this one, and the whole resampling at 9.2
/// -> 7.6 us.
__device__ __forceinline__ void resample_request(const ResampleInputs& in, double* logw,
                                                 const ResampleOutputs& out, int request,
                                                 ResampleWarpStorage& warp_storage) {
  static_assert(kMaxResampleParticles % 32 == 0, "particles are spread evenly over the lanes");
  if (in.particles_per_request <= 32)
    resample_request_lanes<1>(in, logw, out, request, warp_storage);
  else
    resample_request_lanes<kMaxResampleParticles / 32>(in, logw, out, request, warp_storage);
}

} // namespace smcgraph::device
