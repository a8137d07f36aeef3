// cub's warp collectives (cub::WarpReduce / cub::WarpScan on shuffles, CUDA 13.0) in their order of
// operations, written as short loops: cub unrolls them, and the cycle's stage kernels run from cold
// instruction caches and, in the real model's cycle, a flushed L2, where their time follows their code size
// (sample_bench's cold columns; docs/toy_and_kernel_results.md, "Thirty-third session"). The same operations
// in the same order give the same bits. Used by the resampling (resample_device.cuh); the sampler pass
// (logits_pass.cuh) used them for its block reductions until the fifty-second session moved those to
// redux.sync, and still takes shuffle_from. Internal: compiled by nvcc only.
#pragma once

#include <cstdint>

#include <cuda/functional>
#include <cuda/std/functional>

namespace smcgraph::device::warp_in_order {

constexpr unsigned kFullMask = 0xffffffffu;

/// Every 32-bit word of `value` (any type of a 4-byte-multiple size) through `move`, one warp shuffle of a
/// word.
template <class T, class Move> __device__ __forceinline__ T shuffle_words(const T& value, const Move& move) {
  static_assert(sizeof(T) % 4 == 0, "shuffled as 32-bit words");
  T out;
  const uint32_t* in = reinterpret_cast<const uint32_t*>(&value);
  uint32_t* words = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i)
    words[i] = move(in[i]);
  return out;
}

/// `value` shuffled up (UP) or down by `offset` lanes.
template <bool UP, class T> __device__ __forceinline__ T shuffle(const T& value, int offset) {
  return shuffle_words(value, [offset](uint32_t word) {
    return UP ? __shfl_up_sync(kFullMask, word, offset) : __shfl_down_sync(kFullMask, word, offset);
  });
}

/// `value` of lane `lane`.
template <class T> __device__ __forceinline__ T shuffle_from(const T& value, int lane) {
  return shuffle_words(value, [lane](uint32_t word) { return __shfl_sync(kFullMask, word, lane); });
}

/// cub's reduction tree: lane l folds lane l + offset into itself (op(mine, other)) for offset 1, 2, 4, 8,
/// 16, while l + offset <= last_lane (the warp's last valid lane; 31: all of them); lane 0's result. UNROLL >
/// 1 unrolls the loop (the same operations).
template <int UNROLL = 1, class T, class Op>
__device__ __forceinline__ T reduce_down(T x, const Op& op, int last_lane = 31) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll(UNROLL)
  for (int offset = 1; offset < 32; offset *= 2) {
    const T other = shuffle<false>(x, offset);
    if (lane + offset <= last_lane)
      x = op(x, other);
  }
  return x;
}

/// cub's inclusive scan: lane l folds lane l - offset into itself (op(other, mine), the lower lane first) for
/// offset 1, 2, 4, 8, 16.
template <class T, class Op> __device__ __forceinline__ T inclusive_scan_up(T x, const Op& op) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll 1
  for (int offset = 1; offset < 32; offset *= 2) {
    const T other = shuffle<true>(x, offset);
    if (lane >= offset)
      x = op(other, x);
  }
  return x;
}

/// The inclusive scan `x` (lane l) shifted up a lane, `first` in lane 0 (an exclusive scan).
template <class T> __device__ __forceinline__ T shift_up(T x, T first) {
  const T exclusive = shuffle<true>(x, 1);
  return threadIdx.x % 32 == 0 ? first : exclusive;
}

/// cub's warp collectives by name, for a full 32-lane warp (the resampling's, resample_device.cuh). Sums of
/// doubles depend on the order; the maxima and the integer scans do not, but keep it too.

/// cub::WarpReduce<double>::Sum; lane 0's result.
__device__ __forceinline__ double sum(double x) {
  return reduce_down(x, cuda::std::plus<>{});
}

/// cub::WarpReduce<double>::Reduce(x, cuda::maximum<>{}); lane 0's result.
__device__ __forceinline__ double max(double x) {
  return reduce_down(x, cuda::maximum<>{});
}

/// cub::WarpScan<double>::ExclusiveSum: the inclusive scan, 0.0 + it, shifted up a lane; lane 0 gets 0.0.
__device__ __forceinline__ double exclusive_sum(double x) {
  return shift_up(0.0 + inclusive_scan_up(x, cuda::std::plus<>{}), 0.0);
}

/// cub::WarpScan<int>::ExclusiveSum: the inclusive scan, minus the lane's own input.
__device__ __forceinline__ int exclusive_sum(int x) {
  return inclusive_scan_up(x, cuda::std::plus<>{}) - x;
}

/// cub::WarpScan<int>::ExclusiveScan(x, out, 0, cuda::maximum<>{}): the running max of the lanes below, 0 in
/// lane 0 (the inclusive scan, max(0, it), shifted up a lane).
__device__ __forceinline__ int exclusive_max(int x) {
  return shift_up(cuda::maximum<>{}(0, inclusive_scan_up(x, cuda::maximum<>{})), 0);
}

} // namespace smcgraph::device::warp_in_order
