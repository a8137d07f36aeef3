// The dynamic shared-memory limit of a kernel (cudaFuncAttributeMaxDynamicSharedMemorySize) belongs to the
// kernel for the whole process, not to the model or engine that set it: a model built later with smaller
// shapes must not lower the limit that an earlier one's launches need (they would then fail to launch).
#pragma once

#include <cstddef>
#include <mutex>

#include <cuda_runtime.h>

#include "smcgraph/error.hpp"

namespace smcgraph::detail {

/// Raises `kernel`'s dynamic shared-memory limit to `bytes`; never lowers it (call outside capture).
template <class Kernel> void raise_smem_limit(Kernel kernel, size_t bytes) {
  static std::mutex mutex; // two constructors at once: the larger limit still wins
  const std::lock_guard<std::mutex> lock(mutex);
  cudaFuncAttributes attributes{};
  SMCGRAPH_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  if (static_cast<size_t>(attributes.maxDynamicSharedSizeBytes) < bytes)
    SMCGRAPH_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

/// A kernel's shared-memory setup for running with the most shared memory: its limit raised to `bytes` (0:
/// left as it is) and the carveout that gives shared memory all it can (call outside capture).
template <class Kernel> void prepare_max_shared_kernel(Kernel kernel, size_t bytes) {
  if (bytes > 0)
    raise_smem_limit(kernel, bytes);
  SMCGRAPH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared));
}

/// A Llama forward kernel's shared-memory setup: prepare_max_shared_kernel, one carveout for every kernel of
/// the forward (the most shared memory), so the SMs never reconfigure L1 / shared memory between them.
template <class Kernel> void prepare_forward_kernel(Kernel kernel, size_t bytes) {
  prepare_max_shared_kernel(kernel, bytes);
}

} // namespace smcgraph::detail
