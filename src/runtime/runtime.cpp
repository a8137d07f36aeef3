#include "smcgraph/runtime.hpp"

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include <nvtx3/nvToolsExt.h>

#include "runtime/env.hpp"

namespace smcgraph {

namespace {

// Process-wide counters of smcgraph's own allocations (relaxed: each is a statistic read on its own; the
// checks that compare them run after the allocating objects are gone, on the same thread).
std::atomic<int64_t> g_device_allocations{0};
std::atomic<int64_t> g_device_bytes{0};
std::atomic<int64_t> g_peak_device_bytes{0};
std::atomic<int64_t> g_pinned_allocations{0};
std::atomic<int64_t> g_pinned_bytes{0};

} // namespace

DeviceMemoryStats device_memory_stats() {
  DeviceMemoryStats stats;
  stats.device_allocations = g_device_allocations.load(std::memory_order_relaxed);
  stats.device_bytes = g_device_bytes.load(std::memory_order_relaxed);
  stats.peak_device_bytes = g_peak_device_bytes.load(std::memory_order_relaxed);
  stats.pinned_allocations = g_pinned_allocations.load(std::memory_order_relaxed);
  stats.pinned_bytes = g_pinned_bytes.load(std::memory_order_relaxed);
  return stats;
}

namespace detail {

namespace {

/// SMCGRAPH_POISON_ALLOCATIONS=<byte> (decimal or 0x hex, 0-255): every device allocation is filled with that
/// byte before it is returned, so a read of memory the library never wrote sees the same garbage whatever the
/// process ran before (cudaMalloc hands back freed memory with its old contents). -1 when unset.
int poison_byte() {
  static const int byte = static_cast<int>(
      env_integer("SMCGRAPH_POISON_ALLOCATIONS", 0, 255, "must be a byte value, 0-255 (decimal or 0x hex)", 0)
          .value_or(-1));
  return byte;
}

} // namespace

void* device_allocate(size_t bytes) {
  const int poison = poison_byte();
  void* d_pointer = nullptr;
  SMCGRAPH_CUDA_CHECK(cudaMalloc(&d_pointer, bytes));
  if (poison >= 0) {
    // On the legacy stream, then waited for: the caller's non-blocking streams do not order after it.
    const cudaError_t filled = cudaMemset(d_pointer, poison, bytes);
    const cudaError_t done = filled == cudaSuccess ? cudaStreamSynchronize(nullptr) : filled;
    if (done != cudaSuccess) {
      cudaFree(d_pointer);
      SMCGRAPH_CUDA_CHECK(done);
    }
  }
  g_device_allocations.fetch_add(1, std::memory_order_relaxed);
  const int64_t now = g_device_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed) +
                      static_cast<int64_t>(bytes);
  int64_t peak = g_peak_device_bytes.load(std::memory_order_relaxed);
  while (now > peak && !g_peak_device_bytes.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return d_pointer;
}

void device_free(void* d_pointer, size_t bytes) noexcept {
  if (d_pointer == nullptr)
    return;
  cudaFree(d_pointer); // a failed free (a poisoned context) leaves nothing to recover; the buffer is gone
  g_device_allocations.fetch_sub(1, std::memory_order_relaxed);
  g_device_bytes.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
}

void* pinned_allocate(size_t bytes) {
  void* h_pointer = nullptr;
  SMCGRAPH_CUDA_CHECK(cudaMallocHost(&h_pointer, bytes));
  g_pinned_allocations.fetch_add(1, std::memory_order_relaxed);
  g_pinned_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  return h_pointer;
}

void pinned_free(void* h_pointer, size_t bytes) noexcept {
  if (h_pointer == nullptr)
    return;
  cudaFreeHost(h_pointer);
  g_pinned_allocations.fetch_sub(1, std::memory_order_relaxed);
  g_pinned_bytes.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
}

} // namespace detail

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
    SMCGRAPH_CUDA_CHECK(cudaDeviceGetAttribute(&info.shared_memory_optin_bytes,
                                               cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    SMCGRAPH_CUDA_CHECK(cudaDeviceGetAttribute(&info.access_policy_max_window_bytes,
                                               cudaDevAttrMaxAccessPolicyWindowSize, device));
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
