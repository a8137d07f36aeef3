// Programmatic dependent launch (PDL) for the Llama forward's kernel chain: each kernel is launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, so it can start while its predecessor finishes,
// prefetch what does not depend on it (the GEMMs' weight tiles), and wait in pdl_wait()
// (cudaGridDependencySynchronize) before it reads the predecessor's outputs. A kernel calls pdl_trigger()
// only after its own pdl_wait(), so at most two kernels of the chain are resident at a time. Captured graphs
// keep the programmatic edges. SMCGRAPH_DISABLE_PDL=1 launches them plainly (pdl_wait() is then a no-op).
#pragma once

#include <cstdlib>
#include <cstring>
#include <utility>

#include <cuda_runtime.h>

#include "smcgraph/error.hpp"

namespace smcgraph::llama {

inline bool pdl_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("SMCGRAPH_DISABLE_PDL");
    return value == nullptr || std::strcmp(value, "1") != 0;
  }();
  return enabled;
}

template <class... Params, class... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  SMCGRAPH_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

} // namespace smcgraph::llama
