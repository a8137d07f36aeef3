// Per-stage GPU time of one eager cycle (Engine::profile_step()).
//
// Each stage runs alone on the GPU: begin() waits until the stream is idle, launches a gate kernel that
// spins on a host-mapped flag and records the start event behind it; the stage's launches queue up behind
// the gate; end() records the end event and opens the gate. So the time between the events is the stage's
// kernels back to back, without the host's launch gaps that an eager cycle otherwise has (and without the
// overlap a captured graph's programmatic dependent launches give between stages). A gate that waits longer
// than a second opens by itself (a stage with more launches than the launch queue holds would otherwise
// block the host behind it); its stage is marked not gated, and its time includes launch gaps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "smcgraph/engine.hpp"

namespace smcgraph::detail {

class StageProfiler {
public:
  StageProfiler();
  ~StageProfiler();
  StageProfiler(const StageProfiler&) = delete;
  StageProfiler& operator=(const StageProfiler&) = delete;

  /// Starts the stage `name` on `stream` (waits for the stream to be idle first).
  void begin(const char* name, cudaStream_t stream);
  /// Ends the stage begun last. Never throws (it runs in a destructor): the first error is kept for finish().
  void end(cudaStream_t stream) noexcept;
  /// Waits for the stages and returns their GPU times in order; throws the first CUDA error seen.
  std::vector<StageTime> finish();

private:
  struct Record {
    std::string name;
    cudaEvent_t start = nullptr, stop = nullptr;
  };
  std::vector<Record> records_;
  volatile uint32_t* flag_ = nullptr; ///< host-mapped: 0 holds the gate, 1 opens it
  uint32_t* flag_device_ = nullptr;   ///< the same word, as the device sees it
  uint32_t* timed_out_ = nullptr;     ///< host-mapped [kMaxStages]: the gate of stage i opened by itself
  uint32_t* timed_out_device_ = nullptr;
  cudaError_t error_ = cudaSuccess;
  bool open_ = false;
};

} // namespace smcgraph::detail
