#include "support/fault_kernels.hpp"

namespace smcgraph::test {
namespace {

__global__ void DeviceTrapKernel() {
  __trap();
}

} // namespace

void launch_device_trap(cudaStream_t stream) {
  DeviceTrapKernel<<<1, 1, 0, stream>>>();
}

} // namespace smcgraph::test
