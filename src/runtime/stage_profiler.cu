// Per-stage GPU time of one eager cycle: the gate kernel and the event bookkeeping (stage_profiler.hpp).
#include "runtime/stage_profiler.hpp"

#include <atomic>

#include "smcgraph/error.hpp"

namespace smcgraph::detail {
namespace {

constexpr int kMaxStages = 64;
constexpr uint64_t kGateTimeoutNs = 1000000000ull; // 1 s

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// Holds the stream until the host writes 1 to `flag` (or a second passes: then timed_out = 1).
__global__ void StageGateKernel(const volatile uint32_t* flag, uint32_t* timed_out) {
  const uint64_t start = global_ns();
  while (*flag == 0u) {
    if (global_ns() - start > kGateTimeoutNs) {
      *timed_out = 1u;
      return;
    }
    __nanosleep(200);
  }
}

} // namespace

StageProfiler::StageProfiler() {
  void* flag = nullptr;
  void* timed_out = nullptr;
  SMCGRAPH_CUDA_CHECK(cudaHostAlloc(&flag, sizeof(uint32_t), cudaHostAllocMapped));
  if (cudaHostAlloc(&timed_out, kMaxStages * sizeof(uint32_t), cudaHostAllocMapped) != cudaSuccess) {
    cudaFreeHost(flag);
    throw Error("StageProfiler: cudaHostAlloc of the gate flags failed");
  }
  flag_ = static_cast<volatile uint32_t*>(flag);
  timed_out_ = static_cast<uint32_t*>(timed_out);
  *flag_ = 1u;
  for (int i = 0; i < kMaxStages; ++i)
    timed_out_[i] = 0u;
  SMCGRAPH_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_device_), flag, 0));
  SMCGRAPH_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&timed_out_device_), timed_out, 0));
}

StageProfiler::~StageProfiler() {
  *flag_ = 1u; // never leave a gate closed
  for (Record& r : records_) {
    if (r.start != nullptr)
      cudaEventSynchronize(r.start);
    if (r.stop != nullptr)
      cudaEventSynchronize(r.stop);
    cudaEventDestroy(r.start);
    cudaEventDestroy(r.stop);
  }
  cudaFreeHost(const_cast<uint32_t*>(flag_));
  cudaFreeHost(timed_out_);
}

void StageProfiler::begin(const char* name, cudaStream_t stream) {
  require(!open_, "StageProfiler::begin", "stage", name, "begins before the previous stage ended");
  require(static_cast<int>(records_.size()) < kMaxStages, "StageProfiler::begin", "stages",
          static_cast<int>(records_.size()), "exceeds 64 per profiled cycle");
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream)); // the stage runs alone
  Record r;
  r.name = name;
  SMCGRAPH_CUDA_CHECK(cudaEventCreate(&r.start));
  SMCGRAPH_CUDA_CHECK(cudaEventCreate(&r.stop));
  records_.push_back(r);
  *flag_ = 0u;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  StageGateKernel<<<1, 1, 0, stream>>>(flag_device_, timed_out_device_ + (records_.size() - 1));
  SMCGRAPH_CUDA_CHECK(cudaGetLastError());
  SMCGRAPH_CUDA_CHECK(cudaEventRecord(records_.back().start, stream));
  open_ = true;
}

void StageProfiler::end(cudaStream_t stream) noexcept {
  if (!open_)
    return;
  open_ = false;
  const cudaError_t e = cudaEventRecord(records_.back().stop, stream);
  if (e != cudaSuccess && error_ == cudaSuccess)
    error_ = e;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  *flag_ = 1u; // the stage's launches are all queued: let them run
}

std::vector<StageTime> StageProfiler::finish() {
  *flag_ = 1u;
  std::vector<StageTime> times;
  for (size_t i = 0; i < records_.size(); ++i) {
    const Record& r = records_[i];
    SMCGRAPH_CUDA_CHECK(cudaEventSynchronize(r.stop));
    float ms = 0.0f;
    SMCGRAPH_CUDA_CHECK(cudaEventElapsedTime(&ms, r.start, r.stop));
    times.push_back({r.name, 1e3 * static_cast<double>(ms), timed_out_[i] == 0u});
  }
  if (error_ != cudaSuccess)
    throw Error(std::string("StageProfiler: ") + cudaGetErrorString(error_));
  return times;
}

} // namespace smcgraph::detail
