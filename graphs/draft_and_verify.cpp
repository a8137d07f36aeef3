// The phase both cycle recipes share (graphs/smc_cycle.cpp, graphs/spec_cycle.cpp): slot allocation for
// K + 1 positions, the draft head (2 tokens a row, or 1 where the draft's KV follows the target's) and its
// sample d_1, K - 1 draft steps each with its sample, and the target verify forward over K + 1 tokens,
// followed by the recipe's own stages (its `rest`). The speculative cycle also keeps the draft's logits at
// every position (its verifier's residual needs q). With K = 0 (speculative only) there is no draft phase:
// one slot, the verify forward of the last committed token alone, the rest.
//
// Captured with conditional nodes (a speculative engine, K > 1), draft step s sits in the then-branch of an
// IF/ELSE node whose else-branch verifies s + 1 columns and runs the rest of the cycle; step s's then-branch
// ends with step s + 1's node, and step K - 1's with the verify over K + 1 columns and the rest. A cycle
// whose longest live row drafts m tokens so evaluates min(max(m, 1), K - 1) conditional nodes and no node
// follows them: nothing breaks the programmatic-dependent-launch chain of the verify and the rest of the
// cycle but the one conditional node whose else-branch (or last then-branch) holds them. The price is K
// copies of the verify forward and of the recipe's stages in the graph (one per width). Where a request may
// draft nothing (adaptive min_steps = 0, a draft whose KV follows the target's), the draft head sits in one
// more IF/ELSE node, set to m > 0: its else-branch verifies the last committed token alone and runs the rest.
// Nothing here allocates, synchronizes or reads a host value that changes between replays.
#include "runtime/engine_state.hpp"

#include <vector>

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

/// The bodies of an IF/ELSE node.
struct Branches {
  cudaGraph_t then_graph = nullptr, else_graph = nullptr;
};

/// Appends an IF/ELSE conditional node (CUDA >= 12.8) at the end of what `stream` captures; the stream's
/// later work depends on it. Returns its two empty bodies.
Branches add_if_else(cudaStream_t stream, cudaGraphConditionalHandle handle) {
  const CaptureSite site = capture_site(stream);
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 2; // then, else
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
  return {params.conditional.phGraph_out[0], params.conditional.phGraph_out[1]};
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

void enqueue_draft_and_verify(Engine::State& s, int bucket_requests, Enqueue mode, cudaStream_t stream,
                              const CycleRest& rest) {
  const bool speculative = s.config.kind == CycleKind::kSpeculative;
  const char* const alloc_name = speculative ? "spec.alloc" : "smc.alloc";
  const char* const draft_name = speculative ? "spec.draft" : "smc.draft";
  const char* const verify_name = speculative ? "spec.verify_forward" : "smc.verify";
  const int N = s.config.particles, K = s.draft_steps, V = s.vocab;
  const int rows = bucket_requests * N;
  const CycleBuffers& b = s.buffers;
  const DType dtype = s.draft->logits_dtype();
  const size_t element_bytes = dtype_bytes(dtype);
  const size_t step_logits_bytes = static_cast<size_t>(s.rows) * V * element_bytes; // one [rows, V] block

  // Captured with conditional nodes: draft step s runs only when some live row has K_q > s, and, where a
  // request may draft nothing (adaptive min_steps = 0), the draft head only when some live row drafts.
  const bool captured_conditional = s.draft_loop.conditional && K >= 1 && mode == Enqueue::kCapture;
  const bool conditional = captured_conditional && K > 1;
  const bool conditional_head = captured_conditional && may_skip_draft(s.config);
  DraftLoopConditions conditions;
  {
    Stage stage(s, alloc_name);
#if CUDART_VERSION >= 12080
    if (conditional || conditional_head) {
      const CaptureSite site = capture_site(stream);
      auto create = [&] { // reset to 1 (run the branch) at every launch
        cudaGraphConditionalHandle handle = 0;
        SMCGRAPH_CUDA_CHECK(
            cudaGraphConditionalHandleCreate(&handle, site.graph, 1u, cudaGraphCondAssignDefault));
        return static_cast<unsigned long long>(handle);
      };
      if (conditional_head)
        conditions.head = create();
      if (conditional) {
        conditions.count = K - 1;
        for (int step = 1; step < K; ++step)
          conditions.handles[step - 1] = create();
      }
    }
#endif
    // One launch: the cycle's fault bits cleared, K_q + 1 slots for each row (positions L .. L + K_q, its
    // request's draft length), the forward inputs, and the conditions from max K_q.
    alloc_and_prepare_draft_inputs(b, rows, K + 1, RequestSlotCounts{b.request_draft_steps, 1}, stream,
                                   conditions);
  }
  // The residual stream a resumed verify starts from (Engine::resumed_layers): [rows, K + 1, hidden] fp32,
  // the forward that reads draft-block column c hands over (or, the verify, reads from) column c.
  const auto hand_over = [&](ForwardArgs& args, int column) {
    args.hidden = s.prefix_hidden.data() + static_cast<size_t>(column) * s.hidden_size;
    args.hidden_row_stride = static_cast<int64_t>(K + 1) * s.hidden_size;
  };
  // Columns 0 .. width - 1 of the [rows, K + 1] blocks: the draft tokens, the verify positions and out slots,
  // and the target logits (row r's column j at r * (K + 1) + j in each); then the recipe's stages.
  auto verify_and_rest = [&](int width, cudaStream_t verify_stream) {
    {
      Stage stage(s, verify_name);
      prepare_verify_inputs(b, rows, verify_stream);
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
      // Resume after the draft's layers (Engine::resumed_layers): a row's columns before its last drafted
      // one come from the draft's forwards; that one from a draft step (K_q < width - 1) or the verify's own
      // run of the draft's layers over the last column (K_q = width - 1). A one-column verify gains nothing.
      if (s.resume_layers > 0 && width > 1) {
        hand_over(verify, 0);
        verify.resume_layers = s.resume_layers;
      }
      // Columns width .. K of the logits block hold stale values (or zeros the model wrote, which the Model
      // contract allows past tokens_per_row): they are past every live row's K_q, and
      // score() and the verifier read row r's columns 0 .. K_q only.
      s.target->forward(verify, verify_stream);
    }
    rest(verify_stream);
  };
  if (K == 0) { // no draft: the verify forward runs the last committed token alone, then the recipe's stages
    verify_and_rest(1, stream);
    return;
  }
  const RowParams draft_params{b.draft_temperature, nullptr};
  const RowRandom random{b.seeds, b.draw_counters, N};
  // Samples go straight into the [rows, K + 1] draft block: d_k in column k.
  const int64_t block_stride = K + 1;
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
    if (s.resume_layers > 0) // the residual of d_s, column s of the verify's
      hand_over(one, step);
    s.draft->forward(one, step_stream);
    const LogitsView view{logits, dtype, rows, 1, V, V, V};
    sample(view, draft_params, random, philox_stream(Salt::kDraft, static_cast<uint32_t>(step)),
           {b.draft_tokens + step + 1, b.draft_logprobs + step + 1, b.scratch_logz, b.row_flags, b.status,
            block_stride},
           s.workspace, step_stream);
  };
#if CUDART_VERSION >= 12080
  // Conditional bodies are captured one after another on one stream (each node is the last node of the body
  // it sits in); `current` is the stream the next work goes to: the cycle's, or the open body's.
  BodyCapture body(s.body_stream);
  std::vector<cudaGraph_t> then_graphs;
  cudaStream_t current = stream;
  if (conditional_head) {
    // The head's IF/ELSE node: then the head and the rest of the draft loop; else (no live row drafts) the
    // verify of the last committed token alone and the rest of the cycle.
    const Branches branch = add_if_else(stream, static_cast<cudaGraphConditionalHandle>(conditions.head));
    body.begin(branch.else_graph);
    verify_and_rest(1, body.stream());
    body.end();
    body.begin(branch.then_graph);
    then_graphs.push_back(branch.then_graph);
    current = body.stream();
  }
#else
  const cudaStream_t current = stream;
#endif
  {
    Stage stage(s, draft_name);
    // The head's logits: of its last column only, straight where the sampler (and the speculative verifier,
    // as q at position 0) reads them, when the draft supports it; else [rows, 2, V], the last column copied.
    const bool last_only = s.draft->last_token_logits_supported();
    uint8_t* const head_logits =
        speculative && last_only ? s.draft_step_logits.data() : s.draft_logits.data();
    // Its tokens: [x_{L-2}, x_{L-1}], or x_{L-1} alone (the second column of the head's inputs) where the
    // draft's KV of x_{L-2} is written already (draft_head_tokens): half the head's rows then (a 1-request
    // SMC cycle's head at N = 8: 8 rows instead of 16).
    const int skipped = 2 - draft_head_tokens(*s.draft, *s.target);
    ForwardArgs head{rows,
                     2 - skipped,
                     b.head_tokens + skipped,
                     b.head_positions + skipped,
                     b.tables.slot_table,
                     b.head_seq_lens,
                     b.head_out_slots + skipped,
                     b.tables.live,
                     head_logits}; // [rows, V] when skipped (draft_head_tokens needs last_only)
    head.token_row_stride = 2;
    head.io_row_stride = 2;
    head.last_token_logits = last_only;
    if (s.resume_layers > 0) // the residual of x_{L-1}, column 0 of the verify's
      hand_over(head, 0);
    s.draft->forward(head, current);
    // d_1 from the head's last column: rows of [V] (last_only) or of [2, V], the second position.
    const LogitsView head_last{head_logits + (last_only ? 0 : static_cast<size_t>(V) * element_bytes),
                               dtype,
                               rows,
                               1,
                               V,
                               (last_only ? 1 : 2) * static_cast<int64_t>(V),
                               V};
    sample(head_last, draft_params, random, philox_stream(Salt::kDraft, 0),
           {b.draft_tokens + 1, b.draft_logprobs + 1, b.scratch_logz, b.row_flags, b.status, block_stride},
           s.workspace, current);
    if (speculative && !last_only) // the verifier's residual needs q at every position: keep [K, rows, V]
      SMCGRAPH_CUDA_CHECK(cudaMemcpy2DAsync(s.draft_step_logits.data(), V * element_bytes,
                                            s.draft_logits.data() + V * element_bytes, 2 * V * element_bytes,
                                            V * element_bytes, rows, cudaMemcpyDeviceToDevice, current));
    if (!conditional)
      for (int step = 1; step < K; ++step)
        draft_step(step, current);
  }
#if CUDART_VERSION >= 12080
  if (conditional) {
    // Step s's IF/ELSE node: then step s (and step s + 1's node, or the full-width verify after the last
    // step), else the verify over s + 1 columns.
    cudaStream_t parent = current;
    for (int step = 1; step < K; ++step) {
      const Branches branch =
          add_if_else(parent, static_cast<cudaGraphConditionalHandle>(conditions.handles[step - 1]));
      if (parent == body.stream())
        body.end(); // the node is the parent body's last node
      body.begin(branch.else_graph);
      verify_and_rest(step + 1, body.stream());
      body.end();
      body.begin(branch.then_graph);
      then_graphs.push_back(branch.then_graph);
      {
        Stage stage(s, draft_name);
        draft_step(step, body.stream());
      }
      parent = body.stream();
    }
    current = body.stream();
  }
  verify_and_rest(K + 1, current);
  if (current == body.stream()) {
    body.end();
    for (cudaGraph_t then_graph : then_graphs) { // each holds the next node: a K_max cycle runs them all
      size_t nodes = 0;
      SMCGRAPH_CUDA_CHECK(cudaGraphGetNodes(then_graph, nullptr, &nodes));
      s.captured_branch_nodes += nodes;
    }
  }
#else
  verify_and_rest(K + 1, current);
#endif
}

} // namespace smcgraph::detail
