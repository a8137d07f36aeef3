// Programmatic dependent launch (PDL) for kernel chains: the cycle's stage kernels, the sampler's pass and
// the Llama forward. A kernel launched through launch_pdl() carries
// cudaLaunchAttributeProgrammaticStreamSerialization, so it can be launched (its CTAs made resident) while
// its predecessor in the stream finishes; it must wait in pdl_wait() (cudaGridDependencySynchronize: the
// predecessor grid has completed and its writes are visible) before it touches memory the predecessor reads
// or writes. A kernel calls pdl_trigger() only after its own pdl_wait(), so at most two kernels of a chain
// are resident at a time. Captured graphs keep the programmatic edges (the launch latency between two
// dependent nodes is hidden). SMCGRAPH_DISABLE_PDL=1 launches plainly (pdl_wait() is then a no-op). A kernel
// that may be launched through launch_pdl() must call pdl_wait() before its first global-memory access;
// pdl_enter() does both at the top of a small stage kernel.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>

#include <cuda_runtime.h>

#include "runtime/env.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"

namespace smcgraph::detail {

inline bool pdl_enabled() {
  static const bool enabled = !env_flag("SMCGRAPH_DISABLE_PDL");
  return enabled;
}

/// The launch attribute that runs a grid as thread-block clusters of `cluster_x` CTAs along x.
inline cudaLaunchAttribute cluster_attribute(unsigned cluster_x) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster_x;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return attribute;
}

/// A range of device memory one launch reads once, marked streaming in L2 (launch_pdl_streaming): bytes 0 is
/// no range.
struct L2StreamingRange {
  const void* base = nullptr;
  size_t bytes = 0;
};

/// The launch attribute that marks `range` streaming (cudaAccessPropertyStreaming for hits and misses): L2
/// evicts the lines the launch brings in for it first, so they do not push out what later launches reuse.
/// The range is cut at the device's largest window (DeviceInfo). False, and `attribute` untouched, where
/// there is nothing to mark: no bytes, or a device without windows.
inline bool streaming_window_attribute(L2StreamingRange range, cudaLaunchAttribute& attribute) {
  if (range.bytes == 0) // before the device query: most launches mark nothing
    return false;
  const auto max_window = static_cast<size_t>(current_device_info().access_policy_max_window_bytes);
  if (max_window == 0)
    return false;
  attribute = cudaLaunchAttribute{};
  attribute.id = cudaLaunchAttributeAccessPolicyWindow;
  attribute.val.accessPolicyWindow.base_ptr = const_cast<void*>(range.base);
  attribute.val.accessPolicyWindow.num_bytes = std::min(range.bytes, max_window);
  attribute.val.accessPolicyWindow.hitRatio = 1.0f;
  attribute.val.accessPolicyWindow.hitProp = cudaAccessPropertyStreaming;
  attribute.val.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
  return true;
}

/// Runs `launch` (a library's launches on `stream`, which take no launch attribute from us: cuBLASLt) with
/// `range` marked streaming in L2 through the stream's access-policy window
/// (cudaStreamAttributeAccessPolicyWindow), and puts the stream's previous window back after it, also when
/// `launch` throws. Kernels captured from the stream keep the window in their graph nodes (test_llama_gpu
/// checks a captured forward's nodes). Without a range, on a device without windows or on the legacy default
/// stream (whose attributes cannot be set), `launch` runs unmarked.
template <class Launch>
void with_streaming_window(cudaStream_t stream, L2StreamingRange range, Launch&& launch) {
  cudaLaunchAttribute marked;
  if (stream == nullptr || stream == cudaStreamLegacy || !streaming_window_attribute(range, marked)) {
    launch();
    return;
  }
  cudaStreamAttrValue previous{};
  SMCGRAPH_CUDA_CHECK(cudaStreamGetAttribute(stream, cudaStreamAttributeAccessPolicyWindow, &previous));
  SMCGRAPH_CUDA_CHECK(cudaStreamSetAttribute(stream, cudaStreamAttributeAccessPolicyWindow, &marked.val));
  try {
    launch();
  } catch (...) { // the first error wins: the window is put back without a check of its own
    (void)cudaStreamSetAttribute(stream, cudaStreamAttributeAccessPolicyWindow, &previous);
    throw;
  }
  SMCGRAPH_CUDA_CHECK(cudaStreamSetAttribute(stream, cudaStreamAttributeAccessPolicyWindow, &previous));
}

/// Launches `kernel` with the PDL attribute unless SMCGRAPH_DISABLE_PDL=1, as clusters of `cluster_x` CTAs
/// along x where > 1 (grid.x a multiple of it) and with a streaming L2 window over `streaming` where it has
/// bytes and the device has windows, and checks the launch: a launch error throws smcgraph::Error here, so
/// callers need no SMCGRAPH_CHECK_LAUNCH() after it.
template <class... Params, class... Args>
void launch_pdl_with(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, unsigned cluster_x,
                     L2StreamingRange streaming, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[3];
  unsigned count = 0;
  if (cluster_x > 1)
    attributes[count++] = cluster_attribute(cluster_x);
  if (streaming_window_attribute(streaming, attributes[count]))
    ++count;
  if (pdl_enabled()) {
    attributes[count] = cudaLaunchAttribute{};
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  SMCGRAPH_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

/// launch_pdl_with() without a streaming range.
template <class... Params, class... Args>
void launch_pdl_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                          unsigned cluster_x, cudaStream_t stream, Args&&... args) {
  launch_pdl_with(kernel, grid, block, smem_bytes, cluster_x, L2StreamingRange{}, stream,
                  std::forward<Args>(args)...);
}

/// launch_pdl_clustered() without clusters: the launcher of every PDL kernel.
template <class... Params, class... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                Args&&... args) {
  launch_pdl_with(kernel, grid, block, smem_bytes, 1u, L2StreamingRange{}, stream,
                  std::forward<Args>(args)...);
}

/// launch_pdl with `streaming` marked streaming in L2 (a range the launch reads once: weights).
template <class... Params, class... Args>
void launch_pdl_streaming(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                          L2StreamingRange streaming, cudaStream_t stream, Args&&... args) {
  launch_pdl_with(kernel, grid, block, smem_bytes, 1u, streaming, stream, std::forward<Args>(args)...);
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

/// The top of a stage kernel: wait for the predecessor, then let the successor launch.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_trigger();
}

} // namespace smcgraph::detail
