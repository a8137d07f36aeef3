// A thread's first N values of a run it stores elsewhere, loaded into registers with its other loads, before
// its first store: the compiler keeps a load after a store it cannot tell apart from the load's buffer, so
// each load interleaved with the stores would wait one memory latency for the store before it. Used by the
// end of each cycle (the speculative commit, the output packing). Internal: compiled by nvcc only.
#pragma once

#include <cub/block/block_load.cuh>

namespace smcgraph::device {

/// src[0 .. min(count, N)) in registers (cub::LoadDirectBlocked, guarded); for_each() visits all `count`
/// values in order, the ones past N read from src then.
template <int N, class T> struct PrefixLoad {
  const T* src;
  int count;
  T head[N];

  __device__ __forceinline__ PrefixLoad(const T* values, int n) : src(values), count(n) {
    cub::LoadDirectBlocked(0, src, head, count); // head[k] = src[k] for k < min(count, N)
  }

  /// f(k, value) for k = 0 .. count - 1.
  template <class F> __device__ __forceinline__ void for_each(F&& f) const {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (k < count)
        f(k, head[k]);
    for (int k = N; k < count; ++k)
      f(k, src[k]);
  }
};

} // namespace smcgraph::device
