// A device counter for tests that need to know how many times a stream's work really ran (a graph's
// conditional bodies run or not at replay, so host-side counting at capture cannot tell).
#pragma once

#include <cuda_runtime_api.h>

namespace smcgraph::test {

/// Enqueues a one-thread kernel that adds 1 to *d_counter (device memory).
void launch_count(int* d_counter, cudaStream_t stream);

} // namespace smcgraph::test
