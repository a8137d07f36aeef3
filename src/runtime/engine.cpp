// Engine: buffers for the largest bucket, capture per bucket, admission, replay, asynchronous outputs.
#include "runtime/engine_state.hpp"
#include "runtime/cycle_state.hpp"
#include "runtime/engine_validation.hpp"
#include "runtime/request_outcome.hpp"
#include "runtime/env.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "smcgraph/error.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/smc_kernels.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph {
namespace {

using detail::env_flag;

/// Whether the captured draft steps sit in conditional nodes: a speculative engine with graphs, K > 1 (or a
/// draft head that may be skipped), EngineConfig::draft_loop kConditional, or kAuto with adaptive K, a
/// toolkit and driver of CUDA 12.8 or later (IF nodes with an else branch), and no
/// SMCGRAPH_DISABLE_CONDITIONAL=1. A failed capture turns it off later (Engine::Engine).
DraftLoopInfo initial_draft_loop(const EngineConfig& config) {
  const char* masked =
      "every cycle runs K_max - 1 draft steps, masked per row, and verifies K_max + 1 columns";
  if (config.kind != CycleKind::kSpeculative)
    return {false, std::string("SMC cycle: every request drafts draft_steps; ") + masked};
  if (config.draft_steps == 0)
    return {false, "draft_steps = 0: no draft, the target alone decodes one token per row and cycle"};
  const bool skip_head = detail::may_skip_draft(config);
  if (config.draft_steps == 1 && !skip_head)
    return {false, "draft_steps = 1: no draft step after the head"};
  if (!config.use_graphs)
    return {false, std::string("eager: ") + masked};
  if (env_flag("SMCGRAPH_DISABLE_CONDITIONAL"))
    return {false, std::string("SMCGRAPH_DISABLE_CONDITIONAL=1: ") + masked};
  if (config.draft_loop == DraftLoop::kMasked)
    return {false, std::string("draft_loop = kMasked: ") + masked};
  if (config.draft_loop == DraftLoop::kAuto && !config.adaptive.enabled)
    return {false, std::string("draft_loop = kAuto with fixed K (conditional nodes would skip steps only "
                               "for requests pinned below draft_steps): ") +
                       masked};
#if CUDART_VERSION >= 12080
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver < 12080) {
    cudaGetLastError();
    return {false, "the driver (CUDA " + std::to_string(driver / 1000) + "." +
                       std::to_string(driver % 1000 / 10) +
                       ") has no IF/ELSE conditional nodes (needs 12.8); " + masked};
  }
  return {true,
          std::string("conditional nodes: ") +
              (skip_head ? "an IF/ELSE node around the draft head (else: the verify of one column and the "
                           "rest of the cycle), then "
                         : "") +
              "an IF/ELSE node per draft step (else: the verify over the columns drafted so far and the rest "
              "of the cycle); a cycle runs max K over its live rows and verifies max K + 1 columns"};
#else
  return {false, std::string("built with CUDA < 12.8 (no IF/ELSE conditional nodes); ") + masked};
#endif
}

/// EngineConfig::prefill_chunk resolved: at most max_seq_len and what the prefilled models serve.
int prefill_chunk_of(const EngineConfig& config, const Engine::State& s) {
  int serves = s.target->max_forward_tokens();
  if (s.prefill_draft)
    serves = std::min(serves, s.draft->max_forward_tokens());
  if (config.prefill_chunk > 0) {
    const int chunk = std::min(config.prefill_chunk, config.max_seq_len);
    const std::string serves_text = "exceeds the tokens one forward of the prefilled models serves "
                                    "(Model::max_forward_tokens = " +
                                    std::to_string(serves) + ")";
    require(chunk <= serves, "Engine", "config.prefill_chunk", config.prefill_chunk, serves_text.c_str());
    return chunk;
  }
  return std::max(1, std::min({s.prefill_last_token ? config.max_seq_len : kPrefillChunkAllLogits,
                               config.max_seq_len, serves}));
}

} // namespace

SlotPoolView Engine::State::pool_view() {
  return {free_stack.data(),     free_count.data(),   refcount.data(),
          config.slot_pool_size, freed_bitmap.data(), freed_summary.data()};
}

RowTablesView Engine::State::tables_view() {
  return {slot_table.data(), token_table.data(), seq_len.data(), live.data(), rows, config.max_seq_len};
}

size_t Engine::State::logits_bytes(int row_count, int tokens) const {
  return static_cast<size_t>(row_count) * tokens * vocab * dtype_bytes(draft->logits_dtype());
}

Engine::Engine(const EngineConfig& config, Model& draft, Model& target) : state_(std::make_unique<State>()) {
  validate_engine_config(config);
  State& s = *state_;
  s.config = config;
  if (env_flag("SMCGRAPH_DISABLE_GRAPHS"))
    s.config.use_graphs = false;
  require(draft.vocab() == config.vocab, "Engine", "draft.vocab()", draft.vocab(), "must equal config.vocab");
  require(target.vocab() == config.vocab, "Engine", "target.vocab()", target.vocab(),
          "must equal config.vocab");
  require(draft.max_seq_len() == config.max_seq_len, "Engine", "draft.max_seq_len()", draft.max_seq_len(),
          "must equal config.max_seq_len");
  require(target.max_seq_len() == config.max_seq_len, "Engine", "target.max_seq_len()", target.max_seq_len(),
          "must equal config.max_seq_len");
  require(draft.logits_dtype() == target.logits_dtype(), "Engine", "draft.logits_dtype()",
          dtype_name(draft.logits_dtype()), "must equal target.logits_dtype()");
  require(!detail::may_skip_draft(config) || draft.kv_follows(target), "Engine", "adaptive.min_steps",
          config.adaptive.min_steps,
          "0 needs a draft whose KV cache follows the target's (Model::kv_follows; a layer-prefix LlamaModel "
          "with LlamaModelOptions::kv_owner = the target): a skipped draft would leave a gap in its own");
  s.draft = &draft;
  s.target = &target;
  s.rows = config.max_requests * config.particles;
  s.draft_steps = config.draft_steps;
  s.vocab = config.vocab;
  s.prefill_draft = s.draft_steps > 0 && s.draft != s.target && !draft.kv_follows(target);
  // The prefill needs the target's logits of the prompt's last token only (the draft's are overwritten).
  s.prefill_last_token =
      target.last_token_logits_supported() && (!s.prefill_draft || draft.last_token_logits_supported());
  s.prefill_chunk = prefill_chunk_of(config, s);
  s.eager = !s.config.use_graphs;
  s.draft_loop = initial_draft_loop(s.config);

  const int R = s.rows, K = s.draft_steps, Q = config.max_requests, S = config.max_seq_len;
  // Every buffer of the cycle state (runtime/cycle_state.cpp), then the objects that own their memory.
  size_t& total = s.device_bytes;
  total += detail::allocate_cycle_state(s);
  if (config.kind == CycleKind::kSpeculative) {
    s.pack_workspace = PackWorkspace(R, s.stream);
    total += s.pack_workspace.bytes();
  }
  // The verify resumes after the draft's layers where the target can (a layer-prefix draft sharing its KV,
  // whose head forwards x_{L-1} alone: Model::resumable_layers, draft_head_tokens), so those layers run once
  // a token instead of twice; SMCGRAPH_DISABLE_PREFIX_RESUME=1 turns it off (A/B runs, tests).
  if (const int resume = prefix_resume_layers(draft, target, K); resume > 0) {
    s.resume_layers = resume;
    s.hidden_size = target.hidden_size();
    s.prefix_hidden = DeviceBuffer<float>(static_cast<size_t>(R) * (K + 1) * s.hidden_size);
    s.prefix_hidden.fill_bytes(0, s.stream); // padding rows' columns are read (and ignored) before written
    total += s.prefix_hidden.bytes();
    s.buffers.hand_over_last_draft = true; // each row's last drafted token reaches the buffer too
  }
  const size_t output_bytes = detail::output_layout(R, Q, K).bytes;
  for (int p = 0; p < 2; ++p) {
    s.outputs_host[p] = PinnedBuffer<uint8_t>(output_bytes);
    std::memset(s.outputs_host[p].data(), 0, output_bytes); // as the device buffers, zero before any cycle
    s.outputs_ready[p] = std::make_unique<Event>();
    // Pinned memory is device-mapped wherever addressing is unified (every 64-bit platform CUDA supports).
    void* mapped = nullptr;
    const cudaError_t mapping = cudaHostGetDevicePointer(&mapped, s.outputs_host[p].data(), 0);
    if (mapping != cudaSuccess) {
      cudaGetLastError();
      throw Error(
          std::string("Engine: the pinned output buffer is not device-mapped (cudaHostGetDevicePointer: ") +
              detail::describe_cuda_error(mapping) + ")",
          mapping);
    }
    s.outputs_mapped[p] = static_cast<uint8_t*>(mapped);
  }
  // The sampler serves K + 1 positions of every row (score) at most.
  s.workspace = SampleWorkspace(R * (K + 1), config.vocab, s.stream);
  total += s.workspace.bytes();

  detail::wire_cycle_views(s);
  detail::zero_cycle_state(s);
  {
    // Padding rows run through the samplers too: give them legal parameters so they raise no flags.
    const std::vector<float> ones(R, 1.0f);
    for (auto* buffer : {&s.draft_temperature, &s.target_temperature, &s.alpha})
      buffer->copy_from_host(ones.data(), ones.size(), s.stream);
    s.stream.synchronize();
  }
  {
    std::vector<int32_t> iota(S);
    for (int i = 0; i < S; ++i)
      iota[i] = i;
    s.positions_iota.copy_from_host(iota.data(), iota.size(), s.stream);
  }
  init_slot_pool(s.pool_view(), s.stream);
  s.slot_owner.assign(Q, -1);

  s.bucket_requests = config.buckets;
  if (s.bucket_requests.empty()) {
    for (int b_requests = 1; b_requests < Q; b_requests *= 2)
      s.bucket_requests.push_back(b_requests);
    s.bucket_requests.push_back(Q);
  }
  s.graphs.resize(s.bucket_requests.size());
  s.bucket_info.resize(s.bucket_requests.size());
  for (size_t i = 0; i < s.bucket_requests.size(); ++i)
    s.bucket_info[i].requests = s.bucket_requests[i];

  // Eager warm-up at the largest bucket (nothing is live: every row is padding), then capture largest first.
  try {
    detail::enqueue_cycle(s, Q, detail::Enqueue::kEager, s.stream, s.outputs_mapped[0]);
    s.stream.synchronize();
  } catch (const Error& e) {
    throw Error(std::string("Engine: eager warm-up failed at step ") + s.stage + ": " + e.what(),
                e.cuda_error());
  } catch (const std::exception& e) {
    throw Error(std::string("Engine: eager warm-up failed at step ") + s.stage + ": " + e.what());
  }
  if (!s.config.use_graphs)
    return;
  // Captures every bucket; on failure destroys what it captured and returns the message and error.
  auto capture_buckets = [&]() -> std::pair<std::string, cudaError_t> {
    for (int i = static_cast<int>(s.bucket_requests.size()) - 1; i >= 0; --i) {
      const int requests = s.bucket_requests[i];
      const auto start = std::chrono::steady_clock::now();
      for (int parity = 0; parity < 2; ++parity) {
        CapturedCycle& captured = s.graphs[i][parity];
        SMCGRAPH_CUDA_CHECK(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal));
        std::string failure;
        cudaError_t failure_code = cudaSuccess;
        try {
          s.captured_branch_nodes = 0;
          // The cycle's last launch writes the parity's pinned host block.
          detail::enqueue_cycle(s, requests, detail::Enqueue::kCapture, s.stream, s.outputs_mapped[parity]);
          // The event the host waits on before it reads that block, recorded by the graph itself (an event
          // record node), so that step() makes one driver call, cudaGraphLaunch, instead of two. H100, toy
          // pair, host us per step() (step-time stamps, two rounds; the launch's own time varies most):
          // the separate cudaEventRecord took 0.24-1.65 us of it, the node adds no GPU time per cycle.
          SMCGRAPH_CUDA_CHECK(
              cudaEventRecordWithFlags(s.outputs_ready[parity]->get(), s.stream, cudaEventRecordExternal));
        } catch (const Error& e) {
          failure = e.what();
          failure_code = e.cuda_error();
        } catch (const std::exception& e) { // a model's own exception: still end the capture cleanly
          failure = std::string("exception: ") + e.what();
        } catch (...) {
          failure = "unknown exception";
        }
        cudaGraph_t graph = nullptr;
        const cudaError_t end = cudaStreamEndCapture(s.stream, &graph);
        if (failure.empty() && end != cudaSuccess) {
          failure = std::string("cudaStreamEndCapture: ") + detail::describe_cuda_error(end);
          failure_code = end;
        }
        cudaGraphExec_t exec = nullptr;
        if (failure.empty()) {
          s.stage = "instantiate";
          const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
          if (instantiated != cudaSuccess) {
            failure = std::string("cudaGraphInstantiate: ") + detail::describe_cuda_error(instantiated);
            failure_code = instantiated;
          }
        }
        if (!failure.empty()) {
          if (graph)
            cudaGraphDestroy(graph);
          cudaGetLastError();
          for (auto& pair : s.graphs)
            for (auto& other : pair) {
              if (other.exec)
                cudaGraphExecDestroy(other.exec);
              if (other.graph)
                cudaGraphDestroy(other.graph);
              other = CapturedCycle{};
            }
          return {"Engine: capture of bucket " + std::to_string(requests) + " failed at step " + s.stage +
                      ": " + failure,
                  failure_code};
        }
        captured.graph = graph;
        captured.exec = exec;
        size_t top_nodes = 0;
        SMCGRAPH_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &top_nodes));
        // The cycle's nodes: its launches, not the event record node that ends it.
        s.bucket_info[i].graph_nodes = top_nodes - 1 + s.captured_branch_nodes;
      }
      s.bucket_info[i].capture_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    }
    return {};
  };
  std::pair<std::string, cudaError_t> failure = capture_buckets();
  if (!failure.first.empty() && s.draft_loop.conditional) {
    // The conditional draft loop is what failed, or may be: capture again with masked fixed-K steps.
    s.draft_loop = {false, "conditional draft steps could not be captured (" + failure.first +
                               "); every cycle runs K_max - 1 draft steps, masked per row"};
    failure = capture_buckets();
  }
  if (!failure.first.empty()) {
    if (env_flag("SMCGRAPH_GRAPH_FALLBACK")) {
      s.config.use_graphs = false;
      s.eager = true;
      s.draft_loop = {false, "eager (graph capture failed): K_max - 1 draft steps, masked per row"};
      s.stream.synchronize();
      return;
    }
    throw Error(failure.first, failure.second);
  }
  // Upload so the first replay pays no lazy setup.
  for (auto& pair : s.graphs)
    for (auto& captured : pair)
      SMCGRAPH_CUDA_CHECK(cudaGraphUpload(captured.exec, s.stream));
  s.stream.synchronize();
}

Engine::~Engine() {
  if (!state_)
    return;
  cudaStreamSynchronize(state_->stream); // no throw from a destructor; buffers free after the work drains
  for (auto& pair : state_->graphs) {
    for (auto& captured : pair) {
      if (captured.exec)
        cudaGraphExecDestroy(captured.exec);
      if (captured.graph)
        cudaGraphDestroy(captured.graph);
    }
  }
}

RequestId Engine::admit(const std::vector<int32_t>& prompt, const RequestParams& params) {
  State& s = *state_;
  const EngineConfig& c = s.config;
  constexpr const char* kWhere = "Engine::admit";
  const detail::ResolvedRequestParams resolved = detail::validate_request(c, prompt, params);
  const int P = static_cast<int>(prompt.size());
  const auto free_slot = std::find(s.slot_owner.begin(), s.slot_owner.end(), RequestId{-1});
  require(free_slot != s.slot_owner.end(), kWhere, "live requests", c.max_requests,
          "every request slot is taken (max_requests); release or wait");
  const int q = static_cast<int>(free_slot - s.slot_owner.begin());
  const int row = q * c.particles;
  const detail::CycleBuffers& b = s.buffers;
  cudaStream_t stream = s.stream;

  NvtxRange range("smc.admit");
  detail::init_request_rows(b, q, params.seed, resolved.draft_temperature, resolved.target_temperature,
                            resolved.alpha, resolved.tau, resolved.pinned_draft_steps, stream);
  int32_t* token_row = s.token_table.data() + static_cast<size_t>(row) * c.max_seq_len;
  SMCGRAPH_CUDA_CHECK(
      cudaMemcpyAsync(token_row, prompt.data(), sizeof(int32_t) * P, cudaMemcpyHostToDevice, stream));
  detail::admit_alloc(b, row, P, stream);
  // Prefill in chunks of prefill_chunk tokens (KV for positions < P) each model the cycle runs, once: the
  // draft where prefill_draft, then the target, whose logits of the last position stay in prefill_logits
  // (the only row there with prefill_last_token).
  const int32_t* slot_row = s.slot_table.data() + static_cast<size_t>(row) * c.max_seq_len;
  int last_chunk_length = 0;
  for (int begin = 0; begin < P; begin += s.prefill_chunk) {
    const int length = std::min(s.prefill_chunk, P - begin);
    detail::set_int(s.admit_scalars.data(), begin + length, stream);
    for (Model* model : {s.prefill_draft ? s.draft : nullptr, s.target}) {
      if (model == nullptr)
        continue;
      ForwardArgs args{1,
                       length,
                       token_row + begin,
                       s.positions_iota.data() + begin,
                       slot_row,
                       s.admit_scalars.data(),
                       slot_row + begin,
                       s.live.data() + row,
                       s.prefill_logits.data()};
      args.last_token_logits = s.prefill_last_token; // [1, vocab]: the prompt's last token is all it samples
      model->forward(args, stream);
    }
    last_chunk_length = length;
  }
  // x_P from the target's power distribution softmax(alpha l / T_t) (salt kAdmission, particle 0).
  const size_t element_bytes = dtype_bytes(s.target->logits_dtype());
  const size_t last_row = s.prefill_last_token ? 0 : static_cast<size_t>(last_chunk_length - 1);
  const LogitsView last{s.prefill_logits.data() + last_row * s.vocab * element_bytes,
                        s.target->logits_dtype(),
                        1,
                        1,
                        s.vocab,
                        s.vocab,
                        s.vocab};
  sample(last, {s.target_temperature.data() + row, s.alpha.data() + row},
         {s.seeds.data() + q, s.draw_counters.data() + q, 1}, philox_stream(Salt::kAdmission, 0),
         {s.admit_scalars.data() + 1, s.admit_floats.data(), s.admit_floats.data() + 1,
          s.row_flags.data() + row, s.status.data()},
         s.workspace, stream);
  detail::admit_finish(b, row, P, s.admit_scalars.data() + 1, stream);
  if (c.particles > 1) {
    SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(s.request_mask.data() + q, 1, 1, stream));
    fan_out_rows(s.pool_view(), s.tables_view(), c.particles, s.request_mask.data(), stream);
    collect_freed_slots(s.pool_view(), stream);
    SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(s.request_mask.data() + q, 0, 1, stream));
  }

  HostRequest request;
  request.id = s.next_id++;
  request.slot = q;
  request.prompt_length = P;
  request.length = P + 1;
  request.max_new_tokens = params.max_new_tokens;
  request.seed = params.seed;
  s.slot_owner[q] = request.id;
  s.requests[request.id] = request;
  return request.id;
}

namespace {

int bucket_index_for(const Engine::State& s) {
  int highest = -1;
  for (int q = 0; q < static_cast<int>(s.slot_owner.size()); ++q)
    if (s.slot_owner[q] >= 0)
      highest = q;
  if (highest < 0)
    return -1;
  for (size_t i = 0; i < s.bucket_requests.size(); ++i)
    if (s.bucket_requests[i] > highest)
      return static_cast<int>(i);
  return static_cast<int>(s.bucket_requests.size()) - 1;
}

/// Turns one finished cycle's output block into per-request updates and updates the host bookkeeping.
std::vector<RequestUpdate> process_cycle(Engine::State& s, const InFlightCycle& cycle) {
  if (s.config.spin_wait)
    s.outputs_ready[cycle.parity]->spin_wait();
  else
    s.outputs_ready[cycle.parity]->synchronize();
  const EngineConfig& c = s.config;
  const int N = c.particles, K = s.draft_steps;
  const int rows = cycle.bucket_requests * N;
  const detail::OutputLayout layout = detail::output_layout(rows, cycle.bucket_requests, K);
  const uint8_t* out = s.outputs_host[cycle.parity].data();
  auto ints = [&](size_t offset) { return reinterpret_cast<const int32_t*>(out + offset); };
  const int32_t* tokens = ints(layout.tokens);
  const int32_t* committed = ints(layout.committed);
  const int32_t* ancestor = ints(layout.ancestor);
  const uint32_t* flags = reinterpret_cast<const uint32_t*>(out + layout.row_flags);
  const int32_t* seq_len = ints(layout.seq_len);
  const double* ess = reinterpret_cast<const double*>(out + layout.ess);
  const int32_t* cycle_draft_steps = ints(layout.cycle_draft_steps);
  const int32_t* next_draft_steps = ints(layout.next_draft_steps);
  const int32_t* accepted = ints(layout.accepted);
  const float* acceptance_ema = reinterpret_cast<const float*>(out + layout.acceptance_ema);
  const bool kv_pressure = out[layout.kv_pressure] != 0;

  std::vector<RequestUpdate> updates;
  for (int q = 0; q < cycle.bucket_requests; ++q) {
    const RequestId id = cycle.slot_ids[q];
    if (id < 0)
      continue;
    auto it = s.requests.find(id);
    if (it == s.requests.end())
      continue; // released since
    HostRequest& request = it->second;
    if (request.finished || request.failed)
      continue;
    RequestUpdate update;
    update.id = id;
    update.cycle = request.cycles++;
    uint32_t request_flags = 0;
    bool all_finished = true, any_live = false;
    update.tokens.resize(N);
    update.ancestors.resize(N);
    for (int i = 0; i < N; ++i) {
      const int r = q * N + i;
      request_flags |= flags[r];
      all_finished = all_finished && out[layout.finished + r] != 0;
      any_live = any_live || out[layout.live + r] != 0;
      update.ancestors[i] = ancestor[r] - q * N;
      const int counted = std::clamp(committed[r], 0, K + 1); // EOS-cut count (accepted + 1 for spec)
      update.tokens[i].assign(tokens + r * (K + 1), tokens + r * (K + 1) + counted);
    }
    update.resampled = out[layout.resampled + q] != 0;
    update.ess = ess[q];
    update.draft_steps = cycle_draft_steps[q];
    // A request that did not draft this cycle (its rows were not live) accepted nothing; SMC keeps every
    // token.
    const bool drafted = committed[q * N] > 0;
    update.accepted = !drafted ? 0 : (c.kind == CycleKind::kSpeculative ? accepted[q] : update.draft_steps);
    update.acceptance_ema = acceptance_ema[q];
    update.next_draft_steps = next_draft_steps[q];
    update.kv_pressure = kv_pressure;
    request.length = seq_len[q * N];
    const detail::RequestVerdict verdict =
        detail::classify_request({request_flags, all_finished, any_live, request.length,
                                  request.prompt_length, request.max_new_tokens});
    if (verdict.outcome != detail::RequestOutcome::kRunning) {
      update.finished = request.finished = verdict.finished();
      update.failed = request.failed = verdict.failed();
      update.reason = request.reason = verdict.reason;
      if (verdict.outcome == detail::RequestOutcome::kFailed)
        update.tokens.assign(N, {}); // a failed cycle's tokens are not results
    }
    updates.push_back(std::move(update));
  }
  return updates;
}

} // namespace

void Engine::step() {
  State& s = *state_;
  const int bucket = bucket_index_for(s);
  if (bucket < 0)
    return; // nothing is live
  const int parity = s.cycles_launched % 2;
  // Both output buffers busy: the older cycle is read now and its updates wait for the next poll().
  if (s.in_flight.size() >= 2) {
    std::vector<RequestUpdate> updates = process_cycle(s, s.in_flight.front());
    s.in_flight.pop_front();
    if (s.pending_updates.empty())
      s.pending_updates = std::move(updates);
    else
      for (auto& update : updates)
        s.pending_updates.push_back(std::move(update));
  }
  InFlightCycle& cycle = s.in_flight.next(); // becomes visible only once the launch succeeded
  cycle.parity = parity;
  cycle.bucket_requests = s.bucket_requests[bucket];
  cycle.slot_ids.assign(s.slot_owner.begin(), s.slot_owner.begin() + cycle.bucket_requests);
  if (s.eager) {
    NvtxRange range("cycle.eager");
    detail::enqueue_cycle(s, cycle.bucket_requests, detail::Enqueue::kEager, s.stream,
                          s.outputs_mapped[parity]);
    s.outputs_ready[parity]->record(s.stream);
  } else {
    // The graph records outputs_ready[parity] itself (its last node).
    SMCGRAPH_CUDA_CHECK(cudaGraphLaunch(s.graphs[bucket][parity].exec, s.stream));
  }
  s.in_flight.push();
  ++s.cycles_launched;
}

std::vector<StageTime> Engine::profile_step() {
  State& s = *state_;
  s.stream.synchronize();
  detail::StageProfiler profiler;
  { // one eager step with the profiler attached; the engine is as it was afterwards, even after a throw
    struct Restore {
      State& s;
      bool eager;
      ~Restore() {
        s.eager = eager;
        s.profiler = nullptr;
      }
    } restore{s, s.eager};
    s.eager = true;
    s.profiler = &profiler;
    step();
  }
  return profiler.finish();
}

std::vector<RequestUpdate> Engine::poll() {
  State& s = *state_;
  if (!s.pending_updates.empty()) {
    std::vector<RequestUpdate> updates = std::move(s.pending_updates);
    s.pending_updates.clear();
    return updates;
  }
  if (s.in_flight.empty())
    return {};
  std::vector<RequestUpdate> updates = process_cycle(s, s.in_flight.front());
  s.in_flight.pop_front();
  return updates;
}

RequestResult Engine::result(RequestId id) {
  State& s = *state_;
  auto it = s.requests.find(id);
  require(it != s.requests.end(), "Engine::result", "id", id, "unknown or released request");
  const HostRequest& request = it->second;
  const int N = s.config.particles, S = s.config.max_seq_len, q = request.slot;
  s.stream.synchronize();
  RequestResult result;
  result.id = id;
  result.finished = request.finished;
  result.failed = request.failed;
  result.reason = request.reason;
  std::vector<int32_t> tokens(static_cast<size_t>(N) * S), lengths(N);
  std::vector<double> logw(N);
  double log_evidence = 0.0;
  SMCGRAPH_CUDA_CHECK(cudaMemcpy(tokens.data(), s.token_table.data() + static_cast<size_t>(q) * N * S,
                                 tokens.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  SMCGRAPH_CUDA_CHECK(
      cudaMemcpy(lengths.data(), s.seq_len.data() + q * N, N * sizeof(int32_t), cudaMemcpyDeviceToHost));
  SMCGRAPH_CUDA_CHECK(
      cudaMemcpy(logw.data(), s.logw.data() + q * N, N * sizeof(double), cudaMemcpyDeviceToHost));
  SMCGRAPH_CUDA_CHECK(
      cudaMemcpy(&log_evidence, s.log_evidence.data() + q, sizeof(double), cudaMemcpyDeviceToHost));
  result.particles.resize(N);
  for (int i = 0; i < N; ++i) {
    const int32_t* row = tokens.data() + static_cast<size_t>(i) * S;
    for (int position = request.prompt_length; position < lengths[i]; ++position) {
      result.particles[i].push_back(row[position]);
      if (row[position] == s.config.eos_id)
        break; // EOS is absorbing: nothing after it counts
    }
    if (request.max_new_tokens > 0 && static_cast<int>(result.particles[i].size()) > request.max_new_tokens)
      result.particles[i].resize(request.max_new_tokens);
  }
  result.log_weights = logw;
  // The returned particle: drawn by normalised weight with a keyed uniform (salt kResult).
  const double max_logw = *std::max_element(logw.begin(), logw.end());
  std::vector<double> weights(N);
  double total = 0.0;
  for (int i = 0; i < N; ++i)
    total += weights[i] = std::isfinite(max_logw) ? std::exp(logw[i] - max_logw) : 1.0;
  const double u = uniform_open01(philox_word(request.seed, 0, static_cast<uint32_t>(request.cycles), 0,
                                              philox_stream(Salt::kResult, 0)));
  double cumulative = 0.0;
  result.chosen = N - 1;
  for (int i = 0; i < N; ++i) {
    cumulative += weights[i] / total;
    if (u < cumulative) {
      result.chosen = i;
      break;
    }
  }
  result.tokens = result.particles[result.chosen];
  result.log_evidence = log_evidence + (std::isfinite(max_logw) ? max_logw + std::log(total / N) : max_logw);
  return result;
}

void Engine::release(RequestId id) {
  State& s = *state_;
  auto it = s.requests.find(id);
  require(it != s.requests.end(), "Engine::release", "id", id, "unknown or already released request");
  const int q = it->second.slot, N = s.config.particles;
  SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(s.release_mask.data() + q * N, 1, N, s.stream));
  release_rows(s.pool_view(), s.tables_view(), s.release_mask.data(), s.stream);
  collect_freed_slots(s.pool_view(), s.stream);
  SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(s.release_mask.data() + q * N, 0, N, s.stream));
  s.slot_owner[q] = -1;
  s.requests.erase(it);
}

void Engine::compact() {
  State& s = *state_;
  const int N = s.config.particles;
  cudaStream_t stream = s.stream;
  int low = 0;
  for (int high = static_cast<int>(s.slot_owner.size()) - 1; high > low; --high) {
    if (s.slot_owner[high] < 0)
      continue;
    while (low < high && s.slot_owner[low] >= 0)
      ++low;
    if (low >= high)
      break;
    // Rows move by copy: no refcount changes; the old rows are emptied.
    detail::move_request_state(s, high, low);
    SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(s.live.data() + high * N, 0, N, stream));
    SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(s.seq_len.data() + high * N, 0, sizeof(int32_t) * N, stream));
    const RequestId id = s.slot_owner[high];
    s.slot_owner[low] = id;
    s.slot_owner[high] = -1;
    s.requests[id].slot = low;
  }
}

void Engine::set_eager(bool eager) {
  require(!eager ? state_->config.use_graphs : true, "Engine::set_eager", "eager", eager,
          "graphs are disabled for this engine");
  state_->eager = eager;
}
bool Engine::eager() const {
  return state_->eager;
}

int Engine::live_requests() const {
  int count = 0;
  for (const auto& [id, request] : state_->requests)
    count += !request.finished && !request.failed;
  return count;
}

int Engine::current_bucket() const {
  const int index = bucket_index_for(*state_);
  return index < 0 ? 0 : state_->bucket_requests[index];
}

const std::vector<BucketInfo>& Engine::buckets() const {
  return state_->bucket_info;
}
const EngineConfig& Engine::config() const {
  return state_->config;
}
const DraftLoopInfo& Engine::draft_loop() const {
  return state_->draft_loop;
}
int prefix_resume_layers(const Model& draft, const Model& target, int draft_steps) {
  if (draft_steps < 1 || env_flag("SMCGRAPH_DISABLE_PREFIX_RESUME") ||
      draft_head_tokens(draft, target) != 1 || target.hidden_size() <= 0 ||
      draft.hidden_size() != target.hidden_size())
    return 0;
  return std::max(0, target.resumable_layers(draft));
}

int Engine::resumed_layers() const {
  return state_->resume_layers;
}
int Engine::prefill_chunk() const {
  return state_->prefill_chunk;
}
cudaStream_t Engine::stream() const {
  return state_->stream;
}
size_t Engine::device_bytes() const {
  return state_->device_bytes;
}
void Engine::synchronize() {
  state_->stream.synchronize();
}
bool Engine::polled_all() const {
  return state_->in_flight.empty() && state_->pending_updates.empty();
}
StateBufferCopy Engine::inspect(const std::string& name) {
  return detail::copy_state_buffer(*state_, name);
}
std::vector<std::string> Engine::state_buffer_names() const {
  return detail::state_buffer_names(*state_);
}

} // namespace smcgraph
