// The engine a host inference server drives: admit requests, replay one captured cycle per step(), read
// results asynchronously (DESIGN.md §2, §5).
//
//   smcgraph::EngineConfig config;                  // SMC: N particles, K draft tokens per cycle
//   config.vocab = 128256; config.particles = 8; config.draft_steps = 4; config.max_requests = 64;
//   smcgraph::ToyModelPair models = smcgraph::ToyModel::pair(toy_config, 0.3f);
//   smcgraph::Engine engine(config, *models.draft, *models.target);   // allocates, warms up, captures
//   auto id = engine.admit(prompt_tokens, {.seed = 42});
//   engine.step();                                    // cycle t: one graph launch, returns at once
//   while (engine.live_requests() > 0) {
//     engine.step();                                  // cycle t + 1 is queued ...
//     for (const smcgraph::RequestUpdate& update : engine.poll())   // ... while cycle t is read
//       if (update.finished || update.failed) { auto result = engine.result(update.id);
//       engine.release(update.id); }
//   }
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "smcgraph/error.hpp"
#include "smcgraph/model.hpp"

namespace smcgraph {

enum class CycleKind : uint8_t {
  kSmc = 0,         ///< SMC speculative decoding: N particles, every cycle commits K + 1 tokens per particle
  kSpeculative = 1, ///< rejection-based speculative decoding (N = 1)
};

/// Largest K (EngineConfig::draft_steps); within what the verifiers accept (kMaxVerifyDraftSteps) and what
/// the Philox counter's step field numbers (kMaxStep), both checked where the config is validated.
inline constexpr int kMaxDraftSteps = 64;

/// Adaptive draft length (seed 001, ASBS), decided per request on the device at the end of every speculative
/// cycle: ema' = smoothing * accepted / K + (1 - smoothing) * ema, then the next K is draft_steps when
/// ema' >= high_threshold, mid_steps when ema' >= low_threshold, min_steps below, capped at pressure_cap
/// while the free KV slots are fewer than pressure_free_fraction of the pool. A request pinned to a K
/// (RequestParams::draft_steps) keeps it. Defaults are the seed's.
///
///   config.kind = smcgraph::CycleKind::kSpeculative; config.draft_steps = 8;   // K_max
///   config.adaptive.enabled = true;                                           // K in {1, 4, 8}
struct AdaptiveDraftSteps {
  bool enabled = false; ///< false: every request drafts its pinned K or draft_steps (fixed K)
  /// K while the EMA is below low_threshold, in [0, mid_steps]. 0 lets a request draft nothing in a cycle
  /// (the target alone decodes its next token, as with draft_steps = 0); it needs a draft whose KV cache
  /// follows the target's (Model::kv_follows: a layer-prefix LlamaModel built with
  /// LlamaModelOptions::kv_owner = the target), so a skipped draft leaves no gap in it. A cycle where no live
  /// row drafts skips the draft head too (a conditional node when captured).
  int min_steps = 1;
  int mid_steps = 4;               ///< K while the EMA is in [low_threshold, high_threshold), <= draft_steps
  float smoothing = 0.2f;          ///< EMA weight of the latest cycle, in [0, 1]
  float initial_acceptance = 0.8f; ///< EMA of a new request, in [0, 1]
  float high_threshold = 0.8f;     ///< EMA >= it: draft_steps (K_max); in [low_threshold, 1]
  float low_threshold = 0.5f;      ///< EMA >= it: mid_steps; in [0, high_threshold]
  int pressure_cap = 2;            ///< largest K under KV pressure, in [1, draft_steps]
  /// KV pressure: free slots < pressure_free_fraction x (slot_pool_size - 1) (the seed's 85% full); [0, 1].
  float pressure_free_fraction = 0.15f;
  /// 0 (default, the seed's rule): the thresholds choose K. > 0: the cost-aware rule, for drafts that are not
  /// cheap: the K of {min_steps, mid_steps, draft_steps} that maximises the expected tokens a cycle commits
  /// per unit of cycle time, (1 + a + ... + a^K) / (1 + K * draft_cost), a = the EMA read as the per-token
  /// acceptance probability and draft_cost = one draft forward's time over the rest of the cycle (the target
  /// verify and the cycle's own stages); ties take the smaller K and the thresholds are not read. In [0, 64].
  float draft_cost = 0.0f;
  /// The EMA of a request that drafted nothing this cycle (K = 0) moves this fraction of the way to 1, so a
  /// request that stopped drafting drafts again once the rule prefers it, and its acceptance is measured
  /// anew: a probe about every few dozen cycles at the default. In [0, 1]; 0 keeps the EMA (K = 0 for good).
  float idle_recovery = 0.05f;
};

/// How a captured speculative cycle runs its draft steps (Engine::draft_loop() says what it chose).
enum class DraftLoop {
  /// Conditional nodes when the engine's own rule varies K (adaptive.enabled), masked fixed-K steps
  /// otherwise: with every request at K_max the conditional nodes skip nothing and only cost their evaluation
  /// and a broken programmatic-dependent-launch chain (toy pair, K = 4, 1 request, H100: 137 us a cycle
  /// against 119).
  kAuto,
  /// IF/ELSE conditional nodes (CUDA 12.8+): a cycle runs max K_q over its live rows of draft steps and
  /// verifies max K_q + 1 columns. Worth it when K_q varies, e.g. requests pinned below draft_steps.
  kConditional,
  /// K_max - 1 draft steps every cycle, masked per row, and K_max + 1 verify columns.
  kMasked,
};

struct EngineConfig {
  CycleKind kind = CycleKind::kSmc;
  int vocab = 32000; ///< must equal both models' vocab()
  /// K (K_max when adaptive) in [1, kMaxDraftSteps]; kSpeculative also takes 0: no draft, the target alone
  /// decodes one token per row and cycle through the same captured cycle (the draft model is never run:
  /// pass the target as both)
  int draft_steps = 4;
  int particles = 4;            ///< N >= 1 (1 for kSpeculative)
  int max_requests = 16;        ///< request slots; the largest bucket
  std::vector<int> buckets;     ///< request-slot counts to capture; empty: powers of two up to max_requests
  int max_seq_len = 2048;       ///< prompt + generated tokens per row; must equal both models' max_seq_len()
  int slot_pool_size = 1 << 16; ///< KV slots shared by draft and target (slot 0 is the padding dummy)
  float draft_temperature = 0.7f;  ///< T_d > 0
  float target_temperature = 1.0f; ///< T_t >= 0 (0: greedy)
  float alpha = 1.0f;              ///< power of the target distribution, > 0
  float tau = 0.5f;                ///< resample when ESS < tau * N; in [0, 1]
  int eos_id = -1;                 ///< -1: no EOS token
  bool use_graphs = true;          ///< false (or SMCGRAPH_DISABLE_GRAPHS=1): run the same recipe eagerly
  /// How poll() (and a step() with both output buffers busy) waits for a cycle's outputs: true polls the
  /// event (one busy core, the lowest latency for the next step()); false waits in cudaEventSynchronize,
  /// which spins or yields as the device's schedule flags (cudaSetDeviceFlags) say.
  bool spin_wait = true;
  /// Per-request draft length chosen on the device (speculative cycle only; see AdaptiveDraftSteps).
  AdaptiveDraftSteps adaptive;
  /// The captured speculative cycle's draft loop (SMCGRAPH_DISABLE_CONDITIONAL=1 forces kMasked).
  DraftLoop draft_loop = DraftLoop::kAuto;
  /// Prompt tokens per forward of admit()'s prefill (each model it prefills forwards the prompt in chunks of
  /// this many tokens, one row), at most max_seq_len; the models must serve forwards of that many tokens
  /// (Model::max_forward_tokens, e.g. LlamaModelOptions::max_tokens_per_forward), else the Engine constructor
  /// throws. 0 (the default): as many as those models serve, up to max_seq_len, where they write only the
  /// last token's logits (Model::last_token_logits_supported: the prefill keeps one row of logits), else
  /// kPrefillChunkAllLogits. A token's KV and logits are the same bits in any chunk (the forward is
  /// batch-invariant); fewer, longer forwards prefill faster (Engine::prefill_chunk(); README, admission).
  int prefill_chunk = 0;
};

/// The default prefill chunk for models that write every token's logits (the prefill then holds [chunk,
/// vocab] logits).
inline constexpr int kPrefillChunkAllLogits = 128;

/// Throws smcgraph::Error naming the first bad field and its value.
void validate_engine_config(const EngineConfig& config);

/// Per-request settings; negative values take the engine's defaults.
struct RequestParams {
  uint64_t seed = 0;
  float draft_temperature = -1.0f;
  float target_temperature = -1.0f;
  float alpha = -1.0f;
  float tau = -1.0f;
  int max_new_tokens = -1; ///< -1: until max_seq_len
  /// Pins the request's K: 1 .. draft_steps (the SMC cycle: draft_steps only). -1: adaptive when
  /// EngineConfig::adaptive.enabled, else draft_steps.
  int draft_steps = -1;
};

using RequestId = int64_t;

/// What one cycle did to one request (poll()).
struct RequestUpdate {
  RequestId id = -1;
  int cycle = 0;                            ///< the request's cycle index (0 for its first cycle)
  std::vector<std::vector<int32_t>> tokens; ///< [N][tokens committed this cycle], cut after an EOS
  std::vector<int32_t> ancestors;           ///< [N] particle each particle descends from after resampling
  bool resampled = false;
  double ess = 0.0;
  bool finished = false; ///< every particle reached EOS, max_new_tokens or max_seq_len
  bool failed = false;
  std::string reason;          ///< why it failed ("nan or +inf logit", ...) or finished
  int draft_steps = 0;         ///< K the request drafted this cycle
  int accepted = 0;            ///< speculative: draft tokens accepted this cycle (0 .. draft_steps)
  float acceptance_ema = 0.0f; ///< EMA of accepted / K after this cycle (the device's value)
  int next_draft_steps = 0;    ///< K the device chose for the request's next cycle
  bool kv_pressure = false;    ///< the free slots were under the watermark when the next K was chosen
};

/// How the engine's captured cycles run the draft steps (Engine::draft_loop()).
struct DraftLoopInfo {
  /// true: each draft step after the head sits in a CUDA graph IF/ELSE node whose else-branch verifies the
  /// columns drafted so far and runs the rest of the cycle; a kernel sets the conditions from the largest K
  /// among the live rows, so a cycle runs max K steps and verifies max K + 1 columns, not K_max and
  /// K_max + 1. false: the K_max - 1 steps always run and rows past their own K are masked (eager runs, the
  /// SMC cycle, EngineConfig::draft_loop, or a toolkit / driver / model that cannot capture conditional
  /// nodes: `note` says which).
  bool conditional = false;
  std::string note;
};

/// GPU time of one stage of a cycle (Engine::profile_step()).
struct StageTime {
  std::string name; ///< the stage's NVTX name, e.g. "spec.score"
  double gpu_us = 0.0;
  /// true: the stage's launches were all queued before the GPU ran them, so gpu_us is its kernels back to
  /// back; false: it had more launches than the queue holds and gpu_us includes the host's launch gaps.
  bool gated = true;
};

/// A finished (or running) request's output (result()).
struct RequestResult {
  RequestId id = -1;
  std::vector<std::vector<int32_t>> particles; ///< [N] generated tokens of each particle (prompt excluded)
  std::vector<double> log_weights;             ///< [N]
  int chosen = 0;                              ///< particle drawn by weight with a keyed uniform
  std::vector<int32_t> tokens;                 ///< particles[chosen]
  double log_evidence = 0.0;                   ///< log Z-hat
  bool finished = false, failed = false;
  std::string reason;
};

/// Per-bucket facts (for benchmarks and tests).
struct BucketInfo {
  int requests = 0;        ///< request slots the bucket covers
  double capture_ms = 0.0; ///< capture + instantiation time
  size_t graph_nodes = 0; ///< nodes a cycle drafting K_max tokens runs (conditional nodes' branches included)
};

/// One device buffer of the engine's cycle state copied to the host (Engine::inspect).
struct StateBufferCopy {
  std::string name;
  size_t element_bytes = 0;   ///< bytes of one element (its type's size)
  std::vector<uint8_t> bytes; ///< the whole buffer
  size_t size() const { return element_bytes == 0 ? 0 : bytes.size() / element_bytes; }
  /// The elements as T; throws unless sizeof(T) is the buffer's element size.
  template <class T> std::vector<T> as() const {
    require(sizeof(T) == element_bytes, "StateBufferCopy::as", name.c_str(), sizeof(T),
            "is not the buffer's element size");
    std::vector<T> values(size());
    std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
    return values;
  }
};

/// The target layers an engine's verify of `draft_steps` >= 1 drafted tokens resumes after
/// (Engine::resumed_layers() of an engine built on these models, read before building it): the draft's,
/// where the target resumes from the draft's residual stream (Model::resumable_layers: a layer-prefix draft
/// sharing the target's KV whose head forwards x_{L-1} alone); 0 otherwise, for draft_steps = 0 and under
/// SMCGRAPH_DISABLE_PREFIX_RESUME=1.
int prefix_resume_layers(const Model& draft, const Model& target, int draft_steps);

class Engine {
public:
  /// Validates, allocates everything for the largest bucket, warms up eagerly and captures one graph per
  /// bucket (largest first). A capture that fails names the step and the CUDA error; with
  /// config.use_graphs the engine then throws, unless SMCGRAPH_GRAPH_FALLBACK=1, which runs eagerly.
  Engine(const EngineConfig& config, Model& draft, Model& target);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Eager prefill of both models over the prompt, the first token from the target's power distribution,
  /// fan-out to N particles sharing the prompt's slots. Throws for an empty / too long / out-of-vocabulary
  /// prompt or when every request slot is taken. Never synchronizes with cycles in flight.
  RequestId admit(const std::vector<int32_t>& prompt, const RequestParams& params = {});

  /// One cycle for every live request: one graph launch (or the eager recipe). Returns without waiting.
  void step();

  /// Updates of the oldest cycle not yet polled (waits for it); empty when none is outstanding.
  std::vector<RequestUpdate> poll();

  /// Tokens, weights and the chosen particle of a request (synchronizes the stream).
  RequestResult result(RequestId id);

  /// Frees the request's rows and slots (on the device, stream-ordered). Throws for unknown ids.
  void release(RequestId id);

  /// Moves live requests into the lowest request slots (device row copies) so a smaller bucket covers them.
  void compact();

  /// Runs the next step() eagerly (kernel by kernel) instead of replaying a graph (debugging, comparisons).
  void set_eager(bool eager);
  bool eager() const;

  /// One step() for profiling: waits for the engine's stream, runs the cycle's recipe eagerly with each
  /// stage alone on the GPU (its launches queued behind a gate and released together, so the time is the
  /// stage's kernels back to back, without host launch gaps and without the overlap between stages that a
  /// captured graph's programmatic dependent launches give), waits for it and returns each stage's GPU time
  /// in order. The cycle is a real one: its updates come from poll() as usual. Slow (a synchronization per
  /// stage): for profiles only. Eager, so the speculative cycle runs its masked K_max loop.
  std::vector<StageTime> profile_step();

  int live_requests() const;
  int current_bucket() const; ///< request slots the next step() covers (0 when nothing is live)
  const std::vector<BucketInfo>& buckets() const;
  const EngineConfig& config() const;
  /// Whether captured cycles skip the draft steps no live row needs (conditional nodes) or mask them.
  const DraftLoopInfo& draft_loop() const;
  /// Layers of the target the verify does not run again over the drafted tokens: the draft's, where the
  /// target resumes after them from the draft's residual stream (Model::resumable_layers; a layer-prefix
  /// LlamaModel draft with LlamaModelOptions::kv_owner = the target), in both cycle kinds. 0: the verify runs
  /// every layer (other drafts, draft_steps = 0, SMCGRAPH_DISABLE_PREFIX_RESUME=1).
  int resumed_layers() const;
  /// Prompt tokens per prefill forward in admit() (EngineConfig::prefill_chunk, resolved).
  int prefill_chunk() const;
  cudaStream_t stream() const;
  /// Device bytes the engine allocated (buffers for the largest bucket, graphs excluded).
  size_t device_bytes() const;
  /// Waits for everything enqueued so far.
  void synchronize();

  /// True when every launched cycle's updates have been returned by poll().
  bool polled_all() const;

  /// Read-only inspection for tests and debugging (not the hot path): waits for the engine's stream, then
  /// copies one buffer of the cycle state to the host. `name` is a row of the cycle-state table
  /// (state_buffer_names(): "token_table", "slot_table", "seq_len", "live", "logw", "free_stack", ...); the
  /// buffer holds the largest bucket's rows. Throws for an unknown name or one this cycle kind lacks.
  StateBufferCopy inspect(const std::string& name);
  /// The names inspect() accepts for this engine's cycle kind.
  std::vector<std::string> state_buffer_names() const;

  /// The engine's device state (internal: src/runtime/engine_state.hpp).
  struct State;

private:
  std::unique_ptr<State> state_;
};

} // namespace smcgraph
