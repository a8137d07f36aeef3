// Hopper's thread-block cluster barrier in two halves, as the .aligned instructions (internal: compiled by
// nvcc only). Used by the sampler pass's cluster mode (logits_pass.cuh) and the cluster benches
// (bench/cluster_stream_bench.cu, bench/stage_chain_bench.cu). cuda::ptx::barrier_cluster_arrive / _wait
// and cooperative_groups' cluster_group::barrier_arrive / barrier_wait emit the non-.aligned forms (CUDA
// 13.0), and cuda::ptx's relaxed arrival does not clobber memory.
#pragma once

namespace smcgraph::detail {

/// The cluster barrier in two halves (all threads of every CTA of the cluster, converged: the .aligned form;
/// release / acquire order the shared-memory writes before the arrival with the peers' reads after their
/// wait).
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
/// The second barrier's arrival ("done reading the peers' shared memory"): every value this CTA loaded from
/// its peers was consumed before it, so those loads are complete and no release is needed. The release form
/// puts a MEMBAR.ALL.GPU (a GPU-scope fence) before the arrival; this one does not. NVIDIA H200, sample_bench
/// graph us a launch, release -> relaxed, two rounds in one call: 1 x 16384 / 32000 / 49152 bf16 6.33 / 6.41-
/// 6.42 / 6.58 -> 6.15-6.21 / 6.26-6.29 / 6.40-6.46, 8 x 49152 6.68 -> 6.55, 8 x 32000 fp32 6.35 -> 6.23;
/// after a kernel that flushed L2, 8 x 49152 9.27-9.28 -> 9.08-9.14, the other shapes within noise.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

/// Both halves: arrive (release) and wait (acquire).
__device__ __forceinline__ void cluster_barrier() {
  cluster_arrive();
  cluster_wait();
}

} // namespace smcgraph::detail
