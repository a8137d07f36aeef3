// The engine's device state and host bookkeeping (internal: the engine, the recipes in graphs/ and the
// cycle-state table use it; tests and benches read the device state through Engine::inspect()).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "kernels/cycle_io.hpp"
#include "runtime/stage_profiler.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/verify.hpp"

namespace smcgraph {

/// One captured cycle: a graph per bucket and output parity (two pinned output buffers alternate so the
/// host can read cycle t while cycle t + 1 runs).
struct CapturedCycle {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

struct HostRequest {
  RequestId id = -1;
  int slot = -1; ///< request slot: rows slot * N .. slot * N + N - 1
  int prompt_length = 0;
  int length = 0; ///< L as of the last polled cycle
  int cycles = 0; ///< cycles polled
  int max_new_tokens = -1;
  uint64_t seed = 0;
  bool finished = false, failed = false;
  std::string reason;
};

/// What one launched cycle needs for poll(): which output buffer, which bucket, who was in which slot.
struct InFlightCycle {
  int parity = 0;
  int bucket_requests = 0;
  std::vector<RequestId> slot_ids; ///< [bucket_requests], -1 for empty slots
};

/// The cycles in flight: at most two (one per output buffer), kept in a fixed ring whose entries are reused,
/// so step() allocates nothing once the slot-id vectors have grown to the largest bucket.
class InFlightRing {
public:
  size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  const InFlightCycle& front() const { return cycles_[head_]; }
  void pop_front() {
    head_ = (head_ + 1) % 2;
    --count_;
  }
  /// The entry the next push() makes visible (requires size() < 2).
  InFlightCycle& next() { return cycles_[(head_ + count_) % 2]; }
  void push() { ++count_; }

private:
  std::array<InFlightCycle, 2> cycles_;
  size_t head_ = 0, count_ = 0;
};

struct Engine::State {
  EngineConfig config;
  Model* draft = nullptr;
  Model* target = nullptr;
  Stream stream;
  Stream body_stream; ///< captures the bodies of the draft steps' conditional nodes
  DraftLoopInfo draft_loop;
  /// Nodes in the then-branches of the last captured cycle's conditional nodes (a K_max cycle runs them all).
  size_t captured_branch_nodes = 0;
  int rows = 0;        ///< max_requests * N
  int draft_steps = 0; ///< K (EngineConfig::draft_steps)
  int vocab = 0;
  int prefill_chunk = 0; ///< EngineConfig::prefill_chunk, resolved (at most what the prefilled models serve)
  /// Whether admit() prefills the draft too: unless it never runs (draft_steps = 0), is the target itself, or
  /// its KV follows the target's (Model::kv_follows: the target's prefill writes it).
  bool prefill_draft = false;
  /// Whether admit()'s prefill forwards ask every model they run for their last token's logits only
  /// (ForwardArgs::last_token_logits: prefill_logits is then one row of vocab logits, not prefill_chunk).
  bool prefill_last_token = false;
  /// The verify resumes after the draft's layers (Model::resumable_layers): this many, 0 when it runs every
  /// layer. prefix_hidden is then [rows, K + 1, hidden_size] fp32, the residual stream the draft head and
  /// steps hand over (column k from the forward that read draft-block column k).
  int resume_layers = 0;
  int hidden_size = 0;
  DeviceBuffer<float> prefix_hidden;

  // Device memory (sized for the largest bucket). Each DeviceBuffer below has one row in the cycle-state
  // table (runtime/cycle_state.cpp): its extent, zeroing, compaction and CycleBuffers view are declared
  // there.
  DeviceBuffer<int32_t> free_stack, free_count, refcount;
  DeviceBuffer<uint32_t> freed_bitmap;   ///< deferred frees, pushed in id order (slots.hpp)
  DeviceBuffer<uint32_t> freed_summary;  ///< a bit per word of freed_bitmap (slots.hpp)
  DeviceBuffer<uint32_t> collect_ticket; ///< [1] the launch that folds the collect in (slots_device.cuh)
  DeviceBuffer<int32_t> slot_table, token_table, seq_len;
  DeviceBuffer<uint8_t> live, finished, resampled, release_mask, request_mask;
  DeviceBuffer<float> draft_temperature, target_temperature, alpha, tau;
  DeviceBuffer<double> logw, ess, log_evidence;
  DeviceBuffer<uint32_t> row_flags, status, draw_counters;
  DeviceBuffer<uint64_t> seeds;
  DeviceBuffer<int32_t> head_tokens, head_positions, head_out_slots, head_seq_lens;
  DeviceBuffer<int32_t> step_positions, step_out_slots, step_seq_lens;
  DeviceBuffer<int32_t> verify_positions, verify_out_slots, verify_seq_lens;
  DeviceBuffer<int32_t> cycle_slots, draft_tokens, bonus_tokens, first_eos, ancestor, cycle_tokens;
  DeviceBuffer<float> draft_logprobs, scratch_logz, target_logprobs, bonus_logprobs, bonus_logz;
  DeviceBuffer<uint8_t> draft_logits, target_logits, prefill_logits; ///< model dtype
  DeviceBuffer<uint8_t> draft_step_logits; ///< speculative: [K, rows, V], q at every draft position
  DeviceBuffer<float> packed_logprobs;
  DeviceBuffer<int32_t> committed, accepted, next_tokens, packed_offsets, packed_total, packed_tokens;
  // Per-request draft length (AdaptiveDraftSteps): K of the next cycle, the pin, the EMA, K of the last
  // cycle.
  DeviceBuffer<int32_t> request_draft_steps, pinned_draft_steps, cycle_draft_steps, decision_free_slots;
  DeviceBuffer<float> acceptance_ema;
  DeviceBuffer<uint8_t> step_live, kv_pressure; ///< [K - 1, rows] rows drafting at step s; [1]
  PackWorkspace pack_workspace;
  DeviceBuffer<int32_t> positions_iota, admit_scalars; ///< [max_seq_len], [4]
  DeviceBuffer<float> admit_floats;                    ///< [4]
  /// The output block of the cycles of each parity (output_layout), pinned and device-mapped: the cycle's
  /// last launch writes it directly (no copy node), and the host reads it once outputs_ready[parity] fired.
  std::array<PinnedBuffer<uint8_t>, 2> outputs_host;
  std::array<uint8_t*, 2> outputs_mapped{}; ///< outputs_host[p] as the device addresses it
  /// Recorded by the captured cycle's last node (an event record node), or by step() after an eager cycle.
  std::array<std::unique_ptr<Event>, 2> outputs_ready;
  SampleWorkspace workspace;
  detail::CycleBuffers buffers;
  size_t device_bytes = 0;

  // Buckets and graphs.
  std::vector<int> bucket_requests; ///< sorted ascending
  std::vector<BucketInfo> bucket_info;
  std::vector<std::array<CapturedCycle, 2>> graphs; ///< [bucket][parity]
  bool eager = false;
  const char* stage = "";                    ///< the cycle stage being enqueued (named by a failed capture)
  detail::StageProfiler* profiler = nullptr; ///< set only while Engine::profile_step() enqueues its cycle

  // Host bookkeeping.
  std::vector<RequestId> slot_owner; ///< [max_requests], -1 when free
  std::map<RequestId, HostRequest> requests;
  RequestId next_id = 0;
  int cycles_launched = 0;
  InFlightRing in_flight;
  std::vector<RequestUpdate> pending_updates; ///< processed by step() when both buffers were busy

  SlotPoolView pool_view();
  RowTablesView tables_view(); ///< all rows
  size_t logits_bytes(int rows, int tokens) const;
};

namespace detail {

/// Whether a request of this engine may draft nothing in a cycle (adaptive K down to 0): its draft's KV
/// must then follow the target's, and the captured cycle puts the draft head in a conditional node.
inline bool may_skip_draft(const EngineConfig& config) {
  return config.adaptive.enabled && config.adaptive.min_steps == 0;
}
/// Names the stage being enqueued (a failed capture reports it) and marks it in NVTX timelines.
/// In Engine::profile_step() it also times the stage alone on the GPU (stage_profiler.hpp).
class Stage {
public:
  Stage(Engine::State& state, const char* name) : state_(state), range_(name) {
    state.stage = name;
    if (state.profiler != nullptr)
      state.profiler->begin(name, state.stream);
  }
  ~Stage() {
    if (state_.profiler != nullptr)
      state_.profiler->end(state_.stream);
  }
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;

private:
  Engine::State& state_;
  NvtxRange range_;
};

/// How a recipe's work reaches the GPU: launched now, or recorded into the graph the stream is capturing
/// (the engine knows which; the recipes do not ask the stream every cycle).
enum class Enqueue { kEager, kCapture };

/// The stages of a recipe after the target verify forward, enqueued on the stream it is given (the cycle's,
/// or the body of a conditional node being captured).
using CycleRest = std::function<void(cudaStream_t)>;

/// Alloc, forward inputs, draft head and steps with their samples, and the target verify forward: the
/// part both cycle kinds share (graphs/draft_and_verify.cpp); then `rest`. Captured with conditional nodes
/// (DraftLoopInfo), the draft steps and the verify forward of each width, each followed by `rest`, sit in
/// their branches, so `rest` is called once per width.
void enqueue_draft_and_verify(Engine::State& state, int bucket_requests, Enqueue mode, cudaStream_t stream,
                              const CycleRest& rest);

/// The SMC cycle recipe (graphs/smc_cycle.cpp): every stage of DESIGN.md §2 for `bucket_requests` request
/// slots, enqueued on `stream` (captured or eager), its last launch packing the outputs into `outputs` (a
/// device address of a pinned host block: State::outputs_mapped).
void enqueue_smc_cycle(Engine::State& state, int bucket_requests, Enqueue mode, cudaStream_t stream,
                       uint8_t* outputs);

/// The speculative cycle recipe (graphs/spec_cycle.cpp); `outputs` as for the SMC cycle.
void enqueue_spec_cycle(Engine::State& state, int bucket_requests, Enqueue mode, cudaStream_t stream,
                        uint8_t* outputs);

/// The recipe of the engine's cycle kind.
inline void enqueue_cycle(Engine::State& state, int bucket_requests, Enqueue mode, cudaStream_t stream,
                          uint8_t* outputs) {
  if (state.config.kind == CycleKind::kSpeculative)
    enqueue_spec_cycle(state, bucket_requests, mode, stream, outputs);
  else
    enqueue_smc_cycle(state, bucket_requests, mode, stream, outputs);
}

} // namespace detail

} // namespace smcgraph
