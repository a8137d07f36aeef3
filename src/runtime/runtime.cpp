#include "smcgraph/runtime.hpp"

#include <array>
#include <mutex>

#include <nvtx3/nvToolsExt.h>

namespace smcgraph {

bool Event::ready() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) {
    cudaGetLastError(); // not an error: clear it so later checks do not see it
    return false;
  }
  SMCGRAPH_CUDA_CHECK(status);
  return true;
}

void Event::spin_wait() const {
  while (!ready()) {
  }
}

float Event::elapsed_ms_since(const Event& start) const {
  float ms = 0.0f;
  SMCGRAPH_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

NvtxRange::NvtxRange(const char* name) {
  nvtxRangePushA(name);
}
NvtxRange::~NvtxRange() {
  nvtxRangePop();
}

const DeviceInfo& current_device_info() {
  constexpr int kMaxDevices = 64;
  static std::array<DeviceInfo, kMaxDevices> cache{};
  static std::array<std::once_flag, kMaxDevices> once;
  int device = 0;
  SMCGRAPH_CUDA_CHECK(cudaGetDevice(&device));
  require(device >= 0 && device < kMaxDevices, "current_device_info", "device", device, "must be < 64");
  std::call_once(once[device], [device] {
    DeviceInfo info;
    info.device = device;
    SMCGRAPH_CUDA_CHECK(
        cudaDeviceGetAttribute(&info.multiprocessors, cudaDevAttrMultiProcessorCount, device));
    SMCGRAPH_CUDA_CHECK(
        cudaDeviceGetAttribute(&info.compute_major, cudaDevAttrComputeCapabilityMajor, device));
    SMCGRAPH_CUDA_CHECK(
        cudaDeviceGetAttribute(&info.compute_minor, cudaDevAttrComputeCapabilityMinor, device));
    cache[device] = info;
  });
  return cache[device];
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

} // namespace smcgraph
