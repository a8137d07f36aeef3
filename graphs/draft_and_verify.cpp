// The phase both cycle recipes share (graphs/smc_cycle.cpp, graphs/spec_cycle.cpp): slot allocation for
// K + 1 positions, the draft head (2 tokens) and its sample d_1, K - 1 draft steps each with its sample, and
// the target verify forward over K + 1 tokens (captured with conditional nodes: nested IF nodes for the draft
// steps a live row still needs, and one SWITCH node over the verify width max K_q + 1). The speculative cycle
// also keeps the draft's logits at every position (its verifier's residual needs q). Nothing here allocates,
// synchronizes or reads a host value that changes between replays.
#include "runtime/engine_state.hpp"

#include "smcgraph/error.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/slots.hpp"

namespace smcgraph::detail {
namespace {

#if CUDART_VERSION >= 12080
/// The graph `stream` is capturing into and the nodes the next captured work depends on.
struct CaptureSite {
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* dependencies = nullptr;
  size_t count = 0;
};

CaptureSite capture_site(cudaStream_t stream) {
  CaptureSite site;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  // The edge data is queried so that programmatic (PDL) edges do not make the query lossy; the conditional
  // node then takes plain full dependencies on those nodes, which orders at least as strongly.
  const cudaGraphEdgeData* edges = nullptr;
#if CUDART_VERSION >= 13000
  SMCGRAPH_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &site.graph, &site.dependencies,
                                               &edges, &site.count));
#else
  SMCGRAPH_CUDA_CHECK(cudaStreamGetCaptureInfo_v3(stream, &status, nullptr, &site.graph, &site.dependencies,
                                                  &edges, &site.count));
#endif
  require(status == cudaStreamCaptureStatusActive, "draft loop", "capture status", static_cast<int>(status),
          "the stream must be capturing");
  return site;
}

inline constexpr int kMaxBranches = kMaxDraftSteps;

/// The body graphs of a conditional node.
struct Branches {
  cudaGraph_t graphs[kMaxBranches] = {};
};

/// Appends a conditional node (IF with one body, or SWITCH with `size` bodies) at the end of what `stream`
/// captures; the stream's later work depends on it. Returns its empty body graphs.
Branches add_conditional(cudaStream_t stream, cudaGraphConditionalNodeType type,
                         cudaGraphConditionalHandle handle, int size) {
  require(size >= 1 && size <= kMaxBranches, "draft loop", "conditional size", size,
          "must be in [1, kMaxDraftSteps]");
  const CaptureSite site = capture_site(stream);
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = type;
  params.conditional.size = static_cast<unsigned>(size);
  cudaGraphNode_t node = nullptr;
#if CUDART_VERSION >= 13000
  SMCGRAPH_CUDA_CHECK(cudaGraphAddNode(&node, site.graph, site.dependencies, nullptr, site.count, &params));
  SMCGRAPH_CUDA_CHECK(
      cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
#else
  SMCGRAPH_CUDA_CHECK(cudaGraphAddNode(&node, site.graph, site.dependencies, site.count, &params));
  SMCGRAPH_CUDA_CHECK(
      cudaStreamUpdateCaptureDependencies(stream, &node, 1, cudaStreamSetCaptureDependencies));
#endif
  Branches branches;
  for (int i = 0; i < size; ++i)
    branches.graphs[i] = params.conditional.phGraph_out[i];
  return branches;
}

/// Captures conditional bodies on one stream, one at a time: begin(graph) ... end(). A body may end with a
/// nested conditional node whose own bodies are captured next on the same stream (end the parent first: the
/// nested node is its last node). An exception leaves no capture open.
class BodyCapture {
public:
  explicit BodyCapture(cudaStream_t stream) : stream_(stream) {}
  BodyCapture(const BodyCapture&) = delete;
  BodyCapture& operator=(const BodyCapture&) = delete;
  cudaStream_t stream() const { return stream_; }
  void begin(cudaGraph_t body) {
    SMCGRAPH_CUDA_CHECK(
        cudaStreamBeginCaptureToGraph(stream_, body, nullptr, nullptr, 0, cudaStreamCaptureModeThreadLocal));
    open_ = true;
  }
  void end() {
    open_ = false;
    cudaGraph_t body = nullptr;
    SMCGRAPH_CUDA_CHECK(cudaStreamEndCapture(stream_, &body));
  }
  ~BodyCapture() {
    if (open_) { // an exception left a body open: end it so the stream can be used again
      cudaGraph_t body = nullptr;
      cudaStreamEndCapture(stream_, &body);
      cudaGetLastError();
    }
  }

private:
  cudaStream_t stream_;
  bool open_ = false;
};
#endif

} // namespace

void enqueue_draft_and_verify(Engine::State& s, int bucket_requests, Enqueue mode, cudaStream_t stream) {
  const bool speculative = s.config.kind == CycleKind::kSpeculative;
  const char* const alloc_name = speculative ? "spec.alloc" : "smc.alloc";
  const char* const draft_name = speculative ? "spec.draft" : "smc.draft";
  const char* const verify_name = speculative ? "spec.verify_forward" : "smc.verify";
  const int N = s.config.particles, K = s.draft_steps, V = s.vocab;
  const int rows = bucket_requests * N;
  const CycleBuffers& b = s.buffers;
  RowTablesView tables = b.tables;
  tables.rows = rows; // the bucket's rows only
  const DType dtype = s.draft->logits_dtype();
  const size_t element_bytes = dtype_bytes(dtype);
  const size_t step_logits_bytes = static_cast<size_t>(s.rows) * V * element_bytes; // one [rows, V] block

  // Captured with conditional nodes: draft step s runs only when some live row has K_q > s.
  const bool conditional = s.draft_loop.conditional && K > 1 && mode == Enqueue::kCapture;
  DraftLoopConditions conditions;
  {
    Stage stage(s, alloc_name);
    SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(b.status, 0, sizeof(uint32_t), stream)); // the cycle's fault bits
    // Each row takes K_q + 1 slots (positions L .. L + K_q), its request's draft length.
    alloc_cycle_slots(b.pool, tables, N, K + 1, RequestSlotCounts{b.request_draft_steps, 1}, b.cycle_slots,
                      b.row_flags, b.status, stream);
    prepare_draft_inputs(b, rows, stream);
#if CUDART_VERSION >= 12080
    if (conditional) {
      const CaptureSite site = capture_site(stream);
      // Reset to `value` at every launch, so a node whose condition is never set behaves as in a fixed-K
      // cycle.
      auto new_handle = [&](unsigned value) {
        cudaGraphConditionalHandle handle = 0;
        SMCGRAPH_CUDA_CHECK(
            cudaGraphConditionalHandleCreate(&handle, site.graph, value, cudaGraphCondAssignDefault));
        return static_cast<unsigned long long>(handle);
      };
      conditions.count = K - 1;
      for (int step = 1; step < K; ++step) // every draft step runs by default
        conditions.handles[step - 1] = new_handle(1);
      // One SWITCH node over the verify width: branch w - 2 verifies w columns; by default all K + 1.
      conditions.verify_handle = new_handle(static_cast<unsigned>(K - 1));
      conditions.verify_widths = K;
      set_draft_loop(b, rows, conditions, stream);
    }
#endif
  }
  const RowParams draft_params{b.draft_temperature, nullptr};
  const RowRandom random{b.seeds, b.draw_counters, N};
  {
    Stage stage(s, draft_name);
    ForwardArgs head{rows,
                     2,
                     b.head_tokens,
                     b.head_positions,
                     b.tables.slot_table,
                     b.head_seq_lens,
                     b.head_out_slots,
                     b.tables.live,
                     s.draft_logits.data()};
    s.draft->forward(head, stream);
    // d_1 from the head's last column: rows of [2, V], the second position.
    const LogitsView head_last{s.draft_logits.data() + static_cast<size_t>(V) * element_bytes,
                               dtype,
                               rows,
                               1,
                               V,
                               2 * static_cast<int64_t>(V),
                               V};
    // Samples go straight into the [rows, K + 1] draft block: d_k in column k.
    const int64_t block_stride = K + 1;
    sample(head_last, draft_params, random, philox_stream(Salt::kDraft, 0),
           {b.draft_tokens + 1, b.draft_logprobs + 1, b.scratch_logz, b.row_flags, b.status, block_stride},
           s.workspace, stream);
    if (speculative) // the verifier's residual needs q at every position: keep [K, rows, V]
      SMCGRAPH_CUDA_CHECK(cudaMemcpy2DAsync(s.draft_step_logits.data(), V * element_bytes,
                                            s.draft_logits.data() + V * element_bytes, 2 * V * element_bytes,
                                            V * element_bytes, rows, cudaMemcpyDeviceToDevice, stream));
    // Step s reads d_s (column s of the draft block) and drafts d_{s+1} for the rows with K_q > s
    // (step_live); the others write the dummy slot and their samples are never read.
    auto draft_step = [&](int step, cudaStream_t step_stream) {
      const size_t offset = static_cast<size_t>(step - 1) * s.rows;
      uint8_t* logits =
          speculative ? s.draft_step_logits.data() + step * step_logits_bytes : s.draft_logits.data();
      ForwardArgs one{rows,
                      1,
                      b.draft_tokens + step,
                      b.step_positions + offset,
                      b.tables.slot_table,
                      b.step_seq_lens + offset,
                      b.step_out_slots + offset,
                      b.step_live + offset,
                      logits,
                      block_stride};
      s.draft->forward(one, step_stream);
      const LogitsView view{logits, dtype, rows, 1, V, V, V};
      sample(view, draft_params, random, philox_stream(Salt::kDraft, static_cast<uint32_t>(step)),
             {b.draft_tokens + step + 1, b.draft_logprobs + step + 1, b.scratch_logz, b.row_flags, b.status,
              block_stride},
             s.workspace, step_stream);
    };
#if CUDART_VERSION >= 12080
    if (conditional) {
      // Nested IF nodes: step s's body ends with step s + 1's IF node, so once a step is not needed the
      // later ones are not even evaluated (a K_q = 1 cycle pays for one conditional node here).
      BodyCapture body(s.body_stream);
      cudaStream_t parent = stream;
      for (int step = 1; step < K; ++step) {
        const Branches branch =
            add_conditional(parent, cudaGraphCondTypeIf,
                            static_cast<cudaGraphConditionalHandle>(conditions.handles[step - 1]), 1);
        if (parent == body.stream())
          body.end(); // the nested IF node is the parent body's last node
        body.begin(branch.graphs[0]);
        draft_step(step, body.stream());
        parent = body.stream();
      }
      body.end();
    }
#endif
    if (!conditional) {
      for (int step = 1; step < K; ++step)
        draft_step(step, stream);
    }
  }
  {
    Stage stage(s, verify_name);
    prepare_verify_inputs(b, rows, stream);
    // Columns 0 .. width - 1 of the [rows, K + 1] blocks: the draft tokens, the verify positions and out
    // slots, and the target logits (row r's column j at r * (K + 1) + j in each).
    auto verify_forward = [&](int width, cudaStream_t verify_stream) {
      ForwardArgs verify{rows,
                         width,
                         b.draft_tokens,
                         b.verify_positions,
                         b.tables.slot_table,
                         b.verify_seq_lens,
                         b.verify_out_slots,
                         b.tables.live,
                         s.target_logits.data(),
                         K + 1,
                         K + 1};
      // Columns width .. K of the logits block keep what they held: they are past every live row's K_q, and
      // score() and the verifier read row r's columns 0 .. K_q only.
      s.target->forward(verify, verify_stream);
    };
#if CUDART_VERSION >= 12080
    if (conditional) { // the width of the longest live row's block: max K_q + 1 (set_draft_loop)
      const Branches widths =
          add_conditional(stream, cudaGraphCondTypeSwitch,
                          static_cast<cudaGraphConditionalHandle>(conditions.verify_handle), K);
      BodyCapture body(s.body_stream);
      for (int width = 2; width <= K + 1; ++width) {
        body.begin(widths.graphs[width - 2]);
        verify_forward(width, body.stream());
        body.end();
      }
      return;
    }
#endif
    verify_forward(K + 1, stream);
  }
}

} // namespace smcgraph::detail
