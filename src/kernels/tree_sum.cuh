// A fixed pairwise sum of a thread's register values: short dependency chains and the same order everywhere,
// so a sum's bits depend on its inputs alone. Used by the sampler's first read (logits_pass.cuh) and by the
// Llama GEMM's partial accumulators (models/llama/llama_gemm.cu). Internal: compiled by nvcc only.
#pragma once

namespace smcgraph::device {

/// Sum of N values (N a power of two) as a fixed pairwise tree: x[i] + x[i + N / 2], halving until one is
/// left (N = 2: x0 + x1; N = 4: (x0 + x2) + (x1 + x3)).
template <int N> __device__ __forceinline__ float tree_sum(const float (&x)[N]) {
  static_assert(N >= 1 && (N & (N - 1)) == 0, "tree_sum sums a power of two of values");
  float partial[N];
#pragma unroll
  for (int i = 0; i < N; ++i)
    partial[i] = x[i];
#pragma unroll
  for (int width = N / 2; width >= 1; width /= 2) {
#pragma unroll
    for (int i = 0; i < width; ++i)
      partial[i] = partial[i] + partial[i + width];
  }
  return partial[0];
}

} // namespace smcgraph::device
