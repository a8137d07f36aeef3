#include "support/count_kernels.hpp"

#include "smcgraph/error.hpp"

namespace smcgraph::test {
namespace {

__global__ void CountKernel(int* counter) {
  *counter += 1; // one thread; launches on one stream are ordered
}

} // namespace

void launch_count(int* d_counter, cudaStream_t stream) {
  CountKernel<<<1, 1, 0, stream>>>(d_counter);
  SMCGRAPH_CUDA_CHECK(cudaGetLastError());
}

} // namespace smcgraph::test
