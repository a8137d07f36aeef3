// Device faults injected on purpose by the fault tests (kept in a .cu file, out of doctest's way).
#pragma once

#include <cuda_runtime_api.h>

namespace smcgraph::test {

/// Enqueues a kernel that executes a trap instruction: the context gets a sticky error
/// (cudaErrorLaunchFailure) that every later CUDA call in this process reports. Only for a test binary
/// of its own.
void launch_device_trap(cudaStream_t stream);

} // namespace smcgraph::test
