// bucket_sweep: the whole decode cycle (SMC and speculative) per batch-size bucket over the engine grid
// (DESIGN.md §9), with the embedded toy models: GPU time per cycle replayed as a graph and run eagerly, host
// time per step(), the model forwards timed on their own, the non-model rest of the cycle against its floor,
// request tokens/s, capture time, graph nodes and engine memory; optionally the PyTorch peers of the same
// cycles and plots.
//
//   build-sweep/bench/bucket_sweep [--quick] [--csv results/bucket_sweep.csv] [--peers] [--plots]
//
// Grid (default): requests per bucket {1, 2, 4, 8, 16, 32, 64} x K {4, 8} x V {32000, 128256} x logits
// {fp32, bf16} x cycle kind: smc with N {4, 8} (T_d 0.7, T_t 1, the EngineConfig defaults), and spec when the
// engine accepts kSpeculative (the output says which): N = 1, greedy (T_d = T_t = 0: exact greedy speculative
// decoding, the setting of its PyTorch peer; tokens per cycle = accepted + 1). Each kind has its PyTorch
// peer: bench/peers/smc_peer.py and bench/peers/spec_peer.py.
//
// Per bucket, in this order (every phase starts from freshly admitted 32-token prompts, or --context N
// tokens, so every phase times rows of the same lengths, and the PyTorch peer starts from the same point):
//   1. model forwards alone, their rows as long as the graph phase's rows halfway through its timed cycles
//      (prompt + 1 + (3 + cycles / 2) x the tokens a row commits per cycle; timed again after step 2 where
//      a speculative bucket's tokens per cycle differ from the prediction): draft head (rows x 2 tokens,
//      or 1: draft_head_tokens), draft step (rows x 1), target verify (rows x K+1), each captured in a graph
//      and replayed; model time per cycle = head + (K - 1) steps + verify;
//   2. graph: 3 warm-up cycles, validated (no failed request, N particles x K + 1 in-vocabulary tokens, or
//      1 .. K + 1 for spec, slot invariants), then `cycles` replays with an event after each step(): median
//      GPU time per cycle;
//   3. host time per step() with one cycle in flight (graph replay);
//   4. the same recipe eagerly (Engine::set_eager(true)): GPU time per cycle, then (fresh prompts again) host
//      time per step.
// Non-model time = graph cycle time - model time. Its floor = bytes it must move / copy bandwidth (the
// samplers read K draft columns and K + 1 target columns of logits per row, plus a small per-token state)
// + non-model graph nodes x the measured node floor (an empty kernel's graph node), both measured in this
// run. With the real model (--model smollm2) the model forwards have a floor too (issue 12's definition):
// each forward's weight bytes and the KV its rows read at the timed length, over the copy bandwidth, plus its
// graph nodes x the node floor (model_floor_us, model_over_floor; printed with the HBM roofline line).
//
// Files for the peers (bench/peers/smc_peer.py and spec_peer.py, format in bench/peers/toy_weights_io.md),
// next to the CSV, written when either kind is in the grid:
//   toy_weights_v<V>.safetensors  the draft and target ToyModelWeights + the engine config (metadata)
//   bucket_sweep_peer.json        the grid, the run's constants and the validation tokens the peers must
//                                 reproduce before they time anything: per (V, dtype), for smc the engine's
//                                 particle-0 tokens for 4 prompts over 6 cycles with a greedy target and a
//                                 near-zero draft temperature (`validation`); for spec the engine's tokens
//                                 for the same prompts over 6 cycles with T_d = T_t = 0 (`spec.validation`)
// --peers runs each kind's peer after the sweep (smc_peer.csv / spec_peer.csv beside the CSV), prints
// smcgraph's ratios to every peer method of the same run and rewrites the CSV with per-method peer columns.
//
// Files: this one drives the engines (engine driving, the model forwards timed alone, the peer validation
// tokens, the table and CSV rows, the sweep of one engine config, run() and main()); in bench/sweep/:
//   sweep_common.hpp  the constants, options, model pair and result types the pieces share
//   options.cpp       the command line (--help, parse_options)
//   manifest.cpp      the peer files: toy weights (safetensors), the manifest, the JSON helpers
//   peers.cpp         the PyTorch peers (smc, spec and the real model's), their ratios, the plots
//
// Exit status: 0; 1 when a validation failed; 2 when it could not run; 3 when a peer failed or reported an
// invalid result (smcgraph's own numbers are still written).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "bench_util.hpp"
#include "chat_prompts.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/tokenizer.hpp"
#include "smcgraph/toy_model.hpp"
#include "sweep/sweep_common.hpp"

namespace smcgraph::sweep {

using smcgraph::bench::format;

// Declared in sweep/sweep_common.hpp; run() fills it when the real model pair is swept.
std::vector<std::vector<int32_t>> g_real_prompts;

namespace {

/// Tokens of every timed prompt (Options::context; run() sets it).
int g_prompt_length = kPromptLength;

// ---------------------------------------------------------------------------------------------------------
// Small helpers

int round_up(int value, int multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

Summary summarize(std::vector<double> us) {
  Summary summary;
  if (us.empty())
    return summary;
  std::sort(us.begin(), us.end());
  const size_t n = us.size();
  summary.median_us = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
  summary.p90_us = us[std::min(n - 1, static_cast<size_t>(std::ceil(0.9 * static_cast<double>(n))) - 1)];
  return summary;
}

/// Prompt of request slot `q` (timing phases; the peer uses the same rule, see toy_weights_io.md).
std::vector<int32_t> timing_prompt(int q, int vocab) {
  if (!g_real_prompts.empty()) // the real model: chat prompts, so acceptance is that of real text
    return g_real_prompts[static_cast<size_t>(q) % g_real_prompts.size()];
  std::vector<int32_t> prompt(g_prompt_length);
  for (int i = 0; i < g_prompt_length; ++i)
    prompt[i] =
        static_cast<int32_t>((static_cast<int64_t>(q + 1) * 7919 + static_cast<int64_t>(i) * 104729) % vocab);
  return prompt;
}

/// Prompt `q` of the peer validation (written to the manifest).
std::vector<int32_t> validation_prompt(int q, int vocab) {
  std::vector<int32_t> prompt(kPromptLength);
  for (int i = 0; i < kPromptLength; ++i)
    prompt[i] = static_cast<int32_t>(
        (static_cast<int64_t>(q) * 1000003 + static_cast<int64_t>(i) * 7927 + 11) % vocab);
  return prompt;
}

/// One progress line on stderr, rewritten in place on a terminal, one line per update otherwise.
class Progress {
public:
  Progress(bool enabled, int total) : enabled_(enabled), total_(total), tty_(isatty(STDERR_FILENO) != 0) {}
  void update(int done, const std::string& what) {
    if (!enabled_)
      return;
    char head[32];
    std::snprintf(head, sizeof(head), "[%3d/%3d] ", done, total_);
    if (tty_) {
      std::fprintf(stderr, "\r\033[K%s%s", head, what.c_str());
    } else {
      std::fprintf(stderr, "%s%s\n", head, what.c_str());
    }
    std::fflush(stderr);
  }
  void finish() {
    if (enabled_ && tty_)
      std::fprintf(stderr, "\r\033[K");
  }

private:
  bool enabled_;
  int total_;
  bool tty_;
};

} // namespace

// ---------------------------------------------------------------------------------------------------------
// Engine driving

/// Everything the engine still holds for the host: pending updates and cycles in flight.
void drain(Engine& engine, std::vector<RequestUpdate>& updates) {
  while (!engine.polled_all()) {
    for (RequestUpdate& update : engine.poll())
      updates.push_back(std::move(update));
  }
  engine.synchronize();
}

namespace {

/// Validation of what cycles reported: every update of a live request carries N particles x (K + 1)
/// in-vocabulary tokens and no failure; `expected` updates in total.
struct UpdateCheck {
  bool ok = true;
  std::string problem;
  void fail(const std::string& text) {
    if (ok)
      problem = text;
    ok = false;
  }
};

/// Returns the tokens committed per particle, summed over the updates.
int64_t check_updates(const std::vector<RequestUpdate>& updates, size_t expected, const EngineConfig& config,
                      UpdateCheck& check) {
  const bool speculative = config.kind == CycleKind::kSpeculative;
  const int K = config.draft_steps;
  int64_t committed = 0;
  if (updates.size() != expected)
    check.fail("got " + std::to_string(updates.size()) + " request updates, expected " +
               std::to_string(expected));
  for (const RequestUpdate& update : updates) {
    const std::string who = "request " + std::to_string(update.id);
    if (update.failed)
      check.fail(who + " failed: " + update.reason);
    if (update.finished)
      check.fail(who + " finished early: " + update.reason);
    if (update.tokens.size() != static_cast<size_t>(config.particles))
      check.fail(who + ": " + std::to_string(update.tokens.size()) + " particles");
    for (const auto& tokens : update.tokens) {
      // SMC commits K + 1 tokens per particle and cycle; speculative decoding accepted + 1, 1 .. K + 1.
      const bool count_ok = speculative ? tokens.size() >= 1 && tokens.size() <= static_cast<size_t>(K + 1)
                                        : tokens.size() == static_cast<size_t>(K + 1);
      if (!count_ok)
        check.fail(who + ": " + std::to_string(tokens.size()) + " tokens in a cycle, expected " +
                   (speculative ? "1 .. K + 1 = " : "K + 1 = ") + std::to_string(K + 1));
      for (const int32_t token : tokens)
        if (token < 0 || token >= config.vocab)
          check.fail(who + ": token " + std::to_string(token) + " out of range");
      committed += static_cast<int64_t>(tokens.size());
    }
  }
  return committed;
}

void check_slots(Engine& engine, UpdateCheck& check) {
  const SlotCheck slots = check_engine_slots(engine);
  if (!slots.ok)
    check.fail("slot invariants: " + slots.problem);
}

/// Releases every request, admits `requests` fresh ones (request slots 0 .. requests - 1) and runs
/// kWarmupCycles validated cycles.
void refill_and_warm_up(Engine& engine, std::vector<RequestId>& ids, int requests, uint64_t& seed,
                        UpdateCheck& check) {
  std::vector<RequestUpdate> updates;
  drain(engine, updates);
  for (const RequestId id : ids)
    engine.release(id);
  ids.clear();
  const EngineConfig& config = engine.config();
  for (int q = 0; q < requests; ++q)
    ids.push_back(engine.admit(timing_prompt(q, config.vocab), {.seed = seed++}));
  if (engine.current_bucket() != requests)
    check.fail("bucket " + std::to_string(engine.current_bucket()) + " covers " + std::to_string(requests) +
               " requests (expected exactly " + std::to_string(requests) + ")");
  updates.clear();
  for (int c = 0; c < kWarmupCycles; ++c)
    engine.step();
  drain(engine, updates);
  check_updates(updates, static_cast<size_t>(kWarmupCycles) * requests, config, check);
}

/// GPU time per cycle: `cycles` step()s with an event after each on the engine's stream (step() keeps at most
/// two cycles queued, so the GPU never waits for the host as long as one step() is shorter than one cycle).
Summary time_cycles(Engine& engine, int cycles, std::vector<RequestUpdate>& updates) {
  drain(engine, updates);
  std::deque<Event> events; // Event is neither copyable nor movable; a deque never relocates its elements
  for (int i = 0; i <= cycles; ++i)
    events.emplace_back(true);
  events[0].record(engine.stream());
  for (int i = 0; i < cycles; ++i) {
    engine.step();
    events[i + 1].record(engine.stream());
  }
  events.back().synchronize();
  std::vector<double> us(cycles);
  for (int i = 0; i < cycles; ++i)
    us[i] = 1000.0 * events[i + 1].elapsed_ms_since(events[i]);
  drain(engine, updates);
  return summarize(std::move(us));
}

/// Median host times of step() and of a bare graph launch beside it (host_us_per_step).
struct HostTimes {
  double step_us = NAN, launch_us = NAN;
};

/// Host time of step() alone: one cycle is in flight when step() is called, so it only launches. With
/// `bare`, also the driver's own cost of a graph launch in the same place (BareGraphLaunch: a graph of the
/// cycle's node count, empty kernels), right after the wait for the older cycle as step() is, the two in
/// turns (so neither always goes first): step()'s floor, measured in the same driver and GPU state. The
/// cudaGraphLaunch time moves between 3 and 20 us in phases on the same machine and cycle, whatever the graph
/// holds (docs/toy_and_kernel_results.md, fiftieth session), so a step() time is read against this column.
HostTimes host_us_per_step(Engine& engine, int cycles, std::vector<RequestUpdate>& updates,
                           bench::BareGraphLaunch* bare) {
  drain(engine, updates);
  engine.step();
  std::vector<double> samples, launches;
  for (int i = 0; i < cycles; ++i) {
    if (bare && i % 2 == 0)
      launches.push_back(bare->launch());
    const auto t0 = std::chrono::steady_clock::now();
    engine.step();
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    if (bare && i % 2 == 1)
      launches.push_back(bare->launch());
    for (RequestUpdate& update : engine.poll())
      updates.push_back(std::move(update));
  }
  drain(engine, updates);
  HostTimes times;
  times.step_us = summarize(std::move(samples)).median_us;
  if (bare) {
    bare->synchronize();
    times.launch_us = summarize(std::move(launches)).median_us;
  }
  return times;
}

// ---------------------------------------------------------------------------------------------------------
// Model forwards on their own

/// The weight bytes one forward of `model` reads for `head_tokens` logits rows: a LlamaModel's LM head as
/// its kernel for that many rows reads it (LlamaModel::weight_bytes_per_forward: the int8 head, 1.125 bytes a
/// weight, up to 16 rows; the bf16 copy beyond); `one_row_bytes` for any other model.
size_t forward_weight_bytes(const Model& model, size_t one_row_bytes, int head_tokens) {
  if (const auto* llama = dynamic_cast<const LlamaModel*>(&model))
    return llama->weight_bytes_per_forward(head_tokens);
  return one_row_bytes;
}

/// A row's length halfway through a graph phase's `cycles` timed cycles: its prompt, the token admission
/// samples, the warm-up cycles and half the timed ones at `tokens_per_cycle` tokens a cycle. The forwards
/// are timed there, and the KV of their floor and of the HBM roofline is counted there.
double mid_phase_length(int cycles, double tokens_per_cycle) {
  return g_prompt_length + 1 + (kWarmupCycles + 0.5 * cycles) * tokens_per_cycle;
}

/// Inputs of the draft head / draft step / target verify forwards at a bucket's shape: random in-vocabulary
/// tokens at mid-sequence positions (full window), valid distinct slots, every row live. The models' KV
/// storage is written at free slots only (the bench calls this while the engine holds no request), and the
/// engine writes every slot's KV before it reads it, so this leaves no trace in the engine's results.
class ForwardBench {
public:
  ForwardBench(int max_rows, int max_tokens_per_row, int vocab, DType dtype, int max_seq_len, int pool_size)
      : max_rows_(max_rows), max_tokens_(max_tokens_per_row), vocab_(vocab), max_seq_len_(max_seq_len),
        pool_size_(pool_size), tokens_(static_cast<size_t>(max_rows) * max_tokens_per_row),
        positions_(tokens_.size()), out_slots_(tokens_.size()),
        slot_table_(static_cast<size_t>(max_rows) * max_seq_len), seq_lens_(max_rows), live_(max_rows),
        logits_(static_cast<size_t>(max_rows) * max_tokens_per_row * vocab * dtype_bytes(dtype)) {}

  /// What a timed forward does with the residual stream when the engine's SMC verify resumes after the
  /// draft's layers (resume_after): a draft forward hands its last token's residual over, the verify resumes
  /// from the handed-over residuals, as in the cycle (graphs/draft_and_verify.cpp).
  enum class Role { kDraft, kVerify };

  /// prefix_resume_layers() (the engine's Engine::resumed_layers()) and the target's hidden size: 0 layers,
  /// forwards as plain ones.
  void resume_after(int layers, int hidden_size) {
    resume_layers_ = layers;
    hidden_size_ = hidden_size;
    if (layers > 0) {
      hidden_ = DeviceBuffer<float>(static_cast<size_t>(max_rows_) * max_tokens_ * hidden_size);
      hidden_.fill_bytes(0, nullptr);
      SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    }
  }

  ForwardArgs prepare(int rows, int tokens_per_row, cudaStream_t stream, Role role) {
    ForwardArgs args = prepare(rows, tokens_per_row, stream);
    if (resume_layers_ > 0) {
      args.hidden = hidden_.data();
      if (role == Role::kVerify) {
        args.hidden_row_stride = static_cast<int64_t>(tokens_per_row) * hidden_size_;
        args.resume_layers = resume_layers_;
      } else {
        args.hidden_row_stride = static_cast<int64_t>(max_tokens_) * hidden_size_;
      }
    }
    return args;
  }

  ForwardArgs prepare(int rows, int tokens_per_row, cudaStream_t stream) {
    require(rows <= max_rows_ && tokens_per_row <= max_tokens_, "ForwardBench::prepare", "rows", rows,
            "too large");
    const int base = timed_length(tokens_per_row) - tokens_per_row;
    std::vector<int32_t> tokens(static_cast<size_t>(rows) * tokens_per_row), positions(tokens.size()),
        out_slots(tokens.size()), slot_table(static_cast<size_t>(rows) * max_seq_len_), seq_lens(rows);
    for (int r = 0; r < rows; ++r) {
      for (int q = 0; q < max_seq_len_; ++q)
        slot_table[static_cast<size_t>(r) * max_seq_len_ + q] =
            1 + static_cast<int32_t>((static_cast<int64_t>(r) * max_seq_len_ + q) % (pool_size_ - 1));
      for (int j = 0; j < tokens_per_row; ++j) {
        const size_t t = static_cast<size_t>(r) * tokens_per_row + j;
        tokens[t] = static_cast<int32_t>(
            (static_cast<int64_t>(r) * 131 + static_cast<int64_t>(j) * 7919 + 5) % vocab_);
        positions[t] = base + j;
        out_slots[t] = slot_table[static_cast<size_t>(r) * max_seq_len_ + base + j];
      }
      seq_lens[r] = base + tokens_per_row;
    }
    const std::vector<uint8_t> live(rows, 1);
    tokens_.copy_from_host(tokens.data(), tokens.size(), stream);
    positions_.copy_from_host(positions.data(), positions.size(), stream);
    out_slots_.copy_from_host(out_slots.data(), out_slots.size(), stream);
    slot_table_.copy_from_host(slot_table.data(), slot_table.size(), stream);
    seq_lens_.copy_from_host(seq_lens.data(), seq_lens.size(), stream);
    live_.copy_from_host(live.data(), live.size(), stream);
    SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream)); // the host vectors die here
    return ForwardArgs{rows,
                       tokens_per_row,
                       tokens_.data(),
                       positions_.data(),
                       slot_table_.data(),
                       seq_lens_.data(),
                       out_slots_.data(),
                       live_.data(),
                       logits_.data()};
  }

  double time_forward(Model& model, int rows, int tokens_per_row, cudaStream_t stream, Role role,
                      bool last_token_logits = false) {
    ForwardArgs args = prepare(rows, tokens_per_row, stream, role);
    args.last_token_logits = last_token_logits;
    return bench::time_graph([&](cudaStream_t s) { model.forward(args, s); }, stream, kModelLaunchesPerGraph,
                             kModelRepetitions, kModelWarmup)
        .median_us;
  }

  ModelTiming time_cycle_forwards(Model& draft, Model& target, int rows, int steps, cudaStream_t stream) {
    ModelTiming timing;
    // As the cycle runs it: the head's logits of its last column only where the draft supports that.
    // K = 0 (no draft): the verify forward of one token alone.
    // The verify as the engine runs it: resuming after the draft's layers where the engine does.
    timing.head_us = steps > 0 ? time_forward(draft, rows, draft_head_tokens(draft, target), stream,
                                              Role::kDraft, draft.last_token_logits_supported())
                               : 0.0;
    timing.step_us = steps > 1 ? time_forward(draft, rows, 1, stream, Role::kDraft) : 0.0;
    timing.verify_us = time_forward(target, rows, steps + 1, stream, Role::kVerify);
    timing.cycle_us = timing.head_us + std::max(steps - 1, 0) * timing.step_us + timing.verify_us;
    return timing;
  }

  /// The positions each row holds before a timed forward's tokens: set_context(mid_phase_length(...)) puts
  /// the forwards where the timed cycles are halfway through (so model time and non-model time = graph
  /// time - model time compare rows of the same lengths however many cycles a phase runs); the default,
  /// 68 past the prompt, is that point for 20 SMC cycles of K 4 (the cost-aware K's draft_cost is measured
  /// there).
  void set_context(double positions) { context_ = static_cast<int>(std::lround(positions)); }

  /// Positions each row of a timed forward of `tokens_per_row` tokens reads (its KV up to its last token).
  int timed_length(int tokens_per_row) const {
    return std::min(context_, max_seq_len_ - tokens_per_row - 1) + tokens_per_row;
  }

  /// The floor of the forwards time_cycle_forwards times (issue 12's definition of a forward's floor): each
  /// forward's weight bytes plus the KV bytes its rows read at the timed length, over the copy bandwidth,
  /// plus its graph nodes x the node floor, summed as the cycle runs them. Real models only (NaN otherwise).
  double model_floor_us(const ModelPair& m, int rows, int steps, double copy_gbs, double node_us,
                        cudaStream_t stream) {
    if (!m.real)
      return NAN;
    // A resumed verify reads the same weights (each layer once) and the same KV (each row's, per layer).
    const auto forward_floor = [&](Model& model, size_t weight_bytes, size_t kv_bytes_per_token,
                                   int tokens_per_row, Role role) {
      // The LM head's bytes as its kernel for this forward's logits rows reads them: a draft forward's logits
      // are its rows' last tokens, a verify's all of its tokens.
      weight_bytes =
          forward_weight_bytes(model, weight_bytes, role == Role::kVerify ? rows * tokens_per_row : rows);
      const double bytes = static_cast<double>(weight_bytes) +
                           static_cast<double>(rows) * timed_length(tokens_per_row) * kv_bytes_per_token;
      return bytes / (copy_gbs * 1e3) +
             static_cast<double>(nodes_per_forward(model, rows, tokens_per_row, stream, role)) * node_us;
    };
    double us = forward_floor(*m.target, m.target_weight_bytes, m.target_kv_bytes_per_token, steps + 1,
                              Role::kVerify);
    if (steps > 0)
      us += forward_floor(*m.draft, m.draft_weight_bytes, m.draft_kv_bytes_per_token,
                          draft_head_tokens(*m.draft, *m.target), Role::kDraft);
    if (steps > 1)
      us += (steps - 1) *
            forward_floor(*m.draft, m.draft_weight_bytes, m.draft_kv_bytes_per_token, 1, Role::kDraft);
    return us;
  }

  /// Graph nodes one forward adds to a captured cycle.
  size_t nodes_per_forward(Model& model, int rows, int tokens_per_row, cudaStream_t stream, Role role) {
    const ForwardArgs args = prepare(rows, tokens_per_row, stream, role);
    SMCGRAPH_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      model.forward(args, stream);
    } catch (...) {
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream, &partial);
      if (partial)
        cudaGraphDestroy(partial);
      cudaGetLastError();
      throw;
    }
    cudaGraph_t graph = nullptr;
    SMCGRAPH_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    size_t nodes = 0;
    const cudaError_t status = cudaGraphGetNodes(graph, nullptr, &nodes);
    cudaGraphDestroy(graph);
    SMCGRAPH_CUDA_CHECK(status);
    return nodes;
  }

private:
  int max_rows_, max_tokens_, vocab_, max_seq_len_, pool_size_;
  int context_ = g_prompt_length + 68;
  DeviceBuffer<int32_t> tokens_, positions_, out_slots_, slot_table_, seq_lens_;
  DeviceBuffer<uint8_t> live_;
  DeviceBuffer<uint8_t> logits_;
  int resume_layers_ = 0, hidden_size_ = 0;
  DeviceBuffer<float> hidden_; ///< [max_rows, max_tokens, hidden_size]: handed over and resumed from
};

} // namespace

// ---------------------------------------------------------------------------------------------------------
// Results: the CSV columns and cells (Row and Environment are in sweep/sweep_common.hpp)

const std::vector<std::string> kCsvColumns = {"device",
                                              "kind",
                                              "vocab",
                                              "dtype",
                                              "particles",
                                              "steps",
                                              "requests",
                                              "rows",
                                              "graph_us",
                                              "graph_p90_us",
                                              "eager_us",
                                              "eager_p90_us",
                                              "eager_over_graph",
                                              "host_step_us",
                                              "bare_launch_us",
                                              "eager_host_step_us",
                                              "model_us",
                                              "head_us",
                                              "draft_step_us",
                                              "verify_us",
                                              "nonmodel_us",
                                              "logits_bytes",
                                              "state_bytes",
                                              "copy_gbs",
                                              "bytes_floor_us",
                                              "node_floor_us",
                                              "graph_nodes",
                                              "nonmodel_nodes",
                                              "node_floor_total_us",
                                              "floor_us",
                                              "nonmodel_over_floor",
                                              "tokens_per_cycle",
                                              "request_tokens_per_s",
                                              "capture_ms",
                                              "engine_construct_ms",
                                              "engine_mb",
                                              "valid",
                                              "model",
                                              "cycle_bytes",
                                              "roofline_us",
                                              "roofline_fraction",
                                              "model_floor_us",
                                              "model_over_floor",
                                              "ess_over_n",
                                              "resample_rate",
                                              "mean_draft_steps",
                                              "accepted_per_draft",
                                              "log_z_per_token"};

std::vector<std::string> csv_cells(const Environment& env, const Row& row) {
  return {env.device,
          row.kind,
          std::to_string(row.vocab),
          dtype_name(row.dtype),
          std::to_string(row.particles),
          std::to_string(row.steps),
          std::to_string(row.requests),
          std::to_string(row.rows),
          format(row.graph.median_us, 2),
          format(row.graph.p90_us, 2),
          format(row.eager.median_us, 2),
          format(row.eager.p90_us, 2),
          format(row.eager.median_us / row.graph.median_us, 3),
          format(row.host_step_us, 2),
          format(row.bare_launch_us, 2),
          format(row.eager_host_step_us, 2),
          format(row.model.cycle_us, 2),
          format(row.model.head_us, 2),
          format(row.model.step_us, 2),
          format(row.model.verify_us, 2),
          format(row.nonmodel_us, 2),
          std::to_string(row.logits_bytes),
          std::to_string(row.state_bytes),
          format(env.copy_gbs, 1),
          format(row.bytes_floor_us, 2),
          format(env.node_floor_us, 3),
          std::to_string(row.graph_nodes),
          std::to_string(row.nonmodel_nodes),
          format(row.node_floor_total_us, 2),
          format(row.floor_us, 2),
          format(row.nonmodel_us / row.floor_us, 3),
          format(row.tokens_per_cycle, 3),
          format(row.tokens_per_s, 0),
          format(row.capture_ms, 2),
          format(row.construct_ms, 1),
          format(row.engine_mb, 1),
          row.valid ? "1" : "0",
          row.model_name,
          std::to_string(row.cycle_bytes),
          format(row.roofline_us, 2),
          format(row.roofline_us / row.graph.median_us, 4),
          format(row.model.floor_us, 2),
          format(row.model.cycle_us / row.model.floor_us, 3),
          format(row.ess_over_n, 3),
          format(row.resample_rate, 3),
          format(row.mean_draft_steps, 3),
          format(row.accepted_per_draft, 3),
          format(row.log_z_per_token, 3)};
}

namespace {

// ---------------------------------------------------------------------------------------------------------
// Peer validation tokens (the peer files are written by sweep/manifest.cpp)

/// Runs the engine with a greedy target on the validation prompts and keeps particle 0's tokens, for the peer
/// to reproduce: smc with a near-zero draft temperature, spec (N = 1) with the greedy draft it is timed with.
ValidationRecord run_validation_engine(const ModelPair& models, CycleKind kind, int vocab, DType dtype,
                                       int particles, int steps, const SweepConstants& k) {
  const bool speculative = kind == CycleKind::kSpeculative;
  ValidationRecord record;
  record.kind = kind;
  record.vocab = vocab;
  record.dtype = dtype;
  record.particles = speculative ? 1 : particles;
  record.steps = steps;
  record.cycles = kValidationCycles;
  record.draft_temperature = speculative ? kSpecDraftTemperature : kValidationDraftTemperature;
  EngineConfig config;
  config.kind = kind;
  config.vocab = vocab;
  config.particles = record.particles;
  config.draft_steps = steps;
  config.max_requests = kValidationPrompts;
  config.max_seq_len = k.max_seq_len;
  config.slot_pool_size = k.pool_size;
  config.draft_temperature = record.draft_temperature;
  config.target_temperature = 0.0f;
  config.alpha = 1.0f;
  config.tau = k.engine_defaults.tau;
  config.eos_id = -1;
  Engine engine(config, *models.draft, *models.target);
  std::vector<RequestId> ids;
  for (int q = 0; q < kValidationPrompts; ++q) {
    record.prompts.push_back(validation_prompt(q, vocab));
    ids.push_back(engine.admit(record.prompts.back(), {.seed = 1000u + static_cast<uint64_t>(q)}));
  }
  std::vector<RequestUpdate> updates;
  for (int c = 0; c < kValidationCycles; ++c)
    engine.step();
  drain(engine, updates);
  UpdateCheck check;
  check_updates(updates, static_cast<size_t>(kValidationCycles) * kValidationPrompts, engine.config(), check);
  check_slots(engine, check);
  std::map<RequestId, size_t> committed; // spec: accepted + 1 per cycle, summed over the updates
  for (const RequestUpdate& update : updates)
    if (!update.tokens.empty())
      committed[update.id] += update.tokens[0].size();
  for (const RequestId id : ids) {
    const RequestResult result = engine.result(id);
    if (result.failed)
      check.fail("validation request failed: " + result.reason);
    const size_t expected =
        1 + (speculative ? committed[id] : static_cast<size_t>(kValidationCycles) * (steps + 1));
    if (result.particles.empty() || result.particles[0].size() != expected)
      check.fail("validation request has " +
                 std::to_string(result.particles.empty() ? 0 : result.particles[0].size()) +
                 " tokens, expected " + std::to_string(expected));
    record.tokens.push_back(result.particles.empty() ? std::vector<int32_t>{} : result.particles[0]);
  }
  record.ok = check.ok;
  record.problem = check.problem;
  return record;
}

// ---------------------------------------------------------------------------------------------------------
// The sweep of one engine config

struct SweepContext {
  const Options* options;
  const Environment* env;
  const SweepConstants* constants;
  bench::Csv* csv;
  Progress* progress;
  int* done;
  uint64_t* seed;
  Stream* stream;
};

void print_table_header() {
  std::printf("%8s %5s %10s %10s %7s %9s %9s %10s %9s %10s %9s %8s %6s %11s %9s %6s %8s\n", "requests",
              "rows", "graph_us", "eager_us", "eag/gr", "host_us", "launch", "eag_host", "model_us",
              "nonmodel", "floor_us", "nm/flr", "tok/c", "tokens/s", "capt_ms", "nodes", "nm_nodes");
}

const char* kind_name(CycleKind kind) {
  return kind == CycleKind::kSpeculative ? "spec" : "smc";
}

void sweep_engine(const SweepContext& ctx, const ModelPair& models, CycleKind kind, int vocab, DType dtype,
                  int particles, int steps, std::vector<Row>& results) {
  const Options& o = *ctx.options;
  const Environment& env = *ctx.env;
  EngineConfig config = ctx.constants->engine_defaults;
  config.kind = kind;
  if (kind == CycleKind::kSpeculative) { // greedy speculative decoding (see kSpecDraftTemperature)
    config.draft_temperature = kSpecDraftTemperature;
    config.target_temperature = kSpecTargetTemperature;
  }
  config.vocab = vocab;
  config.particles = particles;
  config.draft_steps = steps;
  config.max_requests = o.requests.back();
  config.buckets = o.requests;
  config.max_seq_len = ctx.constants->max_seq_len;
  config.slot_pool_size = ctx.constants->pool_size;
  const int max_rows = config.max_requests * particles;
  ForwardBench forwards(max_rows, steps + 1, vocab, dtype, config.max_seq_len, config.slot_pool_size);
  // The forwards timed alone as the engine runs them: the verify resumed after a prefix draft's layers.
  forwards.resume_after(prefix_resume_layers(*models.draft, *models.target, steps),
                        models.target->hidden_size());
  Stream& stream = *ctx.stream;
  if (kind == CycleKind::kSpeculative && o.adaptive) {
    config.adaptive.enabled = true;
    config.adaptive.mid_steps = std::max(1, (steps + 1) / 2);
    config.adaptive.min_steps = std::min(o.min_steps, config.adaptive.mid_steps);
    config.adaptive.draft_cost = o.draft_cost;
    if (o.draft_cost < 0.0f) { // the cost-aware rule with this pair's measured cost ratio
      const ModelTiming alone =
          forwards.time_cycle_forwards(*models.draft, *models.target, o.requests.front(), steps, stream);
      const double draft_us = steps > 1 ? alone.step_us : alone.head_us;
      config.adaptive.draft_cost = static_cast<float>(std::clamp(draft_us / alone.verify_us, 0.001, 64.0));
    }
    std::printf(
        "\nadaptive K: %s (draft_cost %.3f); model, nonmodel, floor, nodes and the HBM roofline below "
        "assume K_max draft steps, and the eager run (no conditional nodes) drafts K_max steps, "
        "masked: compare tokens/s and graph time\n",
        config.adaptive.draft_cost > 0.0f ? "cost-aware rule" : "the seed's thresholds",
        config.adaptive.draft_cost);
    std::printf("adaptive K in {%d, %d, %d}%s\n", config.adaptive.min_steps, config.adaptive.mid_steps, steps,
                config.adaptive.min_steps == 0 ? " (0: no draft; the draft shares the target's KV)" : "");
  }

  const auto construct_start = std::chrono::steady_clock::now();
  Engine engine(config, *models.draft, *models.target);
  const double construct_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - construct_start).count();
  if (engine.resumed_layers() > 0)
    std::printf("\nthe verify resumes after the draft's %d layers (Engine::resumed_layers; "
                "SMCGRAPH_DISABLE_PREFIX_RESUME=1 runs every layer); the verify below is timed so\n",
                engine.resumed_layers());
  // The forwards' graph nodes for a bucket of `rows` rows (the draft steps and the verify; a forward's node
  // count may grow with its token count: the Llama GEMMs of many tokens add an RMSNorm kernel each).
  const auto model_nodes_of = [&](int rows) {
    const size_t draft_nodes =
        forwards.nodes_per_forward(*models.draft, rows, 1, stream, ForwardBench::Role::kDraft);
    const size_t target_nodes =
        forwards.nodes_per_forward(*models.target, rows, steps + 1, stream, ForwardBench::Role::kVerify);
    return static_cast<int64_t>(draft_nodes) * steps + static_cast<int64_t>(target_nodes);
  };
  const int64_t model_nodes = model_nodes_of(particles);

  std::printf(
      "\n%s  V = %d  %s  N = %d  K = %d: engine %.1f MB, constructed (warm-up + capture of %zu buckets x 2 "
      "output parities) in %.1f ms; %lld model nodes per cycle at 1 request\n",
      kind_name(kind), vocab, dtype_name(dtype), particles, steps, engine.device_bytes() / 1e6,
      engine.buckets().size(), construct_ms, static_cast<long long>(model_nodes));
  print_table_header();

  std::vector<RequestId> ids;
  double spec_tokens_per_cycle = (steps + 2) / 2.0; // the last bucket's, for the next prediction
  for (const BucketInfo& info : engine.buckets()) {
    const int requests = info.requests;
    const int rows = requests * particles;
    char label[160];
    std::snprintf(label, sizeof(label), "%s V=%d %s N=%d K=%d requests=%d", kind_name(kind), vocab,
                  dtype_name(dtype), particles, steps, requests);
    Row row;
    row.kind = kind_name(kind);
    row.vocab = vocab;
    row.dtype = dtype;
    row.particles = particles;
    row.steps = steps;
    row.requests = requests;
    row.rows = rows;
    row.graph_nodes = static_cast<int64_t>(info.graph_nodes);
    row.capture_ms = info.capture_ms;
    row.engine_mb = engine.device_bytes() / 1e6;
    row.construct_ms = construct_ms;
    UpdateCheck check;
    std::vector<RequestUpdate> updates;

    // 1. The model forwards on their own, while the engine holds no request, at the length a row has halfway
    //    through the graph phase's timed cycles as predicted (an SMC row commits K + 1 tokens a cycle, a
    //    no-draft row 1, a speculative row what the last bucket's rows did); timed again after the graph
    //    phase where the prediction missed (step 2). They run first as before: they also bring the GPU to
    //    its working state for the graph phase (timed after them, the real SMC cycle at 1 request measured
    //    1,975 us; timed first, 2,017-2,019: H100, same call).
    const auto time_forwards_at = [&](double tokens_per_cycle) {
      ctx.progress->update(*ctx.done, std::string(label) + ": model forwards");
      drain(engine, updates);
      for (const RequestId id : ids)
        engine.release(id);
      ids.clear();
      engine.synchronize();
      forwards.set_context(mid_phase_length(o.cycles, tokens_per_cycle));
      row.model = forwards.time_cycle_forwards(*models.draft, *models.target, rows, steps, stream);
      row.model.floor_us =
          forwards.model_floor_us(models, rows, steps, env.copy_gbs, env.node_floor_us, stream);
    };
    const double predicted_tokens_per_cycle =
        kind == CycleKind::kSmc ? steps + 1.0 : (steps == 0 ? 1.0 : spec_tokens_per_cycle);
    time_forwards_at(predicted_tokens_per_cycle);
    const int64_t bucket_model_nodes = model_nodes_of(rows);

    // 2. Graph replay: validated warm-up, then timed cycles (validated too), then the slot invariants.
    ctx.progress->update(*ctx.done, std::string(label) + ": graph replay");
    engine.set_eager(false);
    refill_and_warm_up(engine, ids, requests, *ctx.seed, check);
    check_slots(engine, check);
    updates.clear();
    row.graph = time_cycles(engine, o.cycles, updates);
    const int64_t committed = check_updates(updates, static_cast<size_t>(o.cycles) * requests, config, check);
    row.tokens_per_cycle = static_cast<double>(committed) / (static_cast<double>(o.cycles) * rows);
    double mean_draft_steps = 0.0, mean_acceptance_ema = 0.0; // the draft length of the timed cycles
    int64_t accepted = 0;
    for (const RequestUpdate& update : updates) {
      mean_draft_steps += update.draft_steps;
      mean_acceptance_ema += update.acceptance_ema;
      accepted += update.accepted;
    }
    if (!updates.empty() && kind == CycleKind::kSpeculative) {
      row.accepted_per_draft = static_cast<double>(accepted) / mean_draft_steps;
      mean_draft_steps /= static_cast<double>(updates.size());
      mean_acceptance_ema /= static_cast<double>(updates.size());
      row.mean_draft_steps = mean_draft_steps;
    }
    if (kind == CycleKind::kSmc && !updates.empty()) { // particle health of the timed cycles
      double ess = 0.0;
      int64_t resampled = 0;
      for (const RequestUpdate& update : updates) {
        ess += update.ess;
        resampled += update.resampled ? 1 : 0;
      }
      row.ess_over_n = ess / (static_cast<double>(updates.size()) * particles);
      row.resample_rate = static_cast<double>(resampled) / static_cast<double>(updates.size());
      // log Z-hat per generated token of the requests so far (warm-up and timed cycles): how many nats a
      // token the particles fall short of the target (0 for an exact sampler; a draft far from the target
      // loses the target's text while ESS / N stays high: examples/smollm2_drafts.hpp).
      double log_z = 0.0;
      size_t generated = 0;
      for (const RequestId id : ids) {
        const RequestResult result = engine.result(id);
        log_z += result.log_evidence;
        generated += result.tokens.size();
      }
      row.log_z_per_token = generated ? log_z / static_cast<double>(generated) : NAN;
    }
    if (kind == CycleKind::kSpeculative && steps > 0)
      spec_tokens_per_cycle = row.tokens_per_cycle;
    const double mid_length = mid_phase_length(o.cycles, row.tokens_per_cycle);
    if (std::lround(mid_length) != std::lround(mid_phase_length(o.cycles, predicted_tokens_per_cycle)))
      time_forwards_at(row.tokens_per_cycle);

    // 3. Host time per step() (graph replay).
    ctx.progress->update(*ctx.done, std::string(label) + ": host step");
    refill_and_warm_up(engine, ids, requests, *ctx.seed, check);
    updates.clear();
    {
      bench::BareGraphLaunch bare(static_cast<int>(std::max<int64_t>(1, row.graph_nodes)));
      const HostTimes times = host_us_per_step(engine, o.cycles, updates, &bare);
      row.host_step_us = times.step_us;
      row.bare_launch_us = times.launch_us;
    }
    check_updates(updates, static_cast<size_t>(o.cycles + 1) * requests, config, check);

    // 4. The same recipe eagerly.
    ctx.progress->update(*ctx.done, std::string(label) + ": eager");
    engine.set_eager(true);
    refill_and_warm_up(engine, ids, requests, *ctx.seed, check);
    updates.clear();
    row.eager = time_cycles(engine, o.cycles, updates);
    check_updates(updates, static_cast<size_t>(o.cycles) * requests, config, check);
    refill_and_warm_up(engine, ids, requests, *ctx.seed, check);
    updates.clear();
    row.eager_host_step_us = host_us_per_step(engine, o.cycles, updates, nullptr).step_us;
    check_updates(updates, static_cast<size_t>(o.cycles + 1) * requests, config, check);
    engine.set_eager(false);
    check_slots(engine, check);

    // 5. (--stages) Each stage's GPU time, alone on the GPU: median over 5 profiled cycles.
    std::vector<std::pair<std::string, double>> stage_us;
    if (o.stages) {
      ctx.progress->update(*ctx.done, std::string(label) + ": stages");
      refill_and_warm_up(engine, ids, requests, *ctx.seed, check);
      std::vector<std::vector<StageTime>> profiles;
      for (int c = 0; c < 5; ++c)
        profiles.push_back(engine.profile_step());
      drain(engine, updates);
      for (size_t i = 0; i < profiles[0].size(); ++i) {
        std::vector<double> us;
        bool gated = true;
        for (const auto& profile : profiles) {
          us.push_back(profile[i].gpu_us);
          gated = gated && profile[i].gated;
        }
        stage_us.emplace_back(profiles[0][i].name + (gated ? "" : " (ungated)"), summarize(us).median_us);
      }
      check_slots(engine, check);
    }

    // Derived numbers.
    row.nonmodel_us = row.graph.median_us - row.model.cycle_us;
    const int element_bytes = dtype_bytes(dtype);
    row.logits_bytes = static_cast<int64_t>(rows) * (2 * steps + 1) * vocab * element_bytes;
    row.state_bytes = static_cast<int64_t>(rows) * ((steps + 1) * kStateBytesPerToken + kStateBytesPerRow);
    row.bytes_floor_us = static_cast<double>(row.logits_bytes + row.state_bytes) / (env.copy_gbs * 1e3);
    row.nonmodel_nodes = std::max<int64_t>(0, row.graph_nodes - bucket_model_nodes);
    row.node_floor_total_us = static_cast<double>(row.nonmodel_nodes) * env.node_floor_us;
    row.floor_us = row.bytes_floor_us + row.node_floor_total_us;
    row.tokens_per_s = requests * row.tokens_per_cycle / (row.graph.median_us * 1e-6);
    if (models.real) {
      // HBM roofline of the whole cycle: every forward reads its weights once (draft head + K - 1 steps,
      // target verify; the LM head as its kernel for the forward's logits rows reads it: `rows` for a draft
      // forward, rows x (K + 1) for the verify), each row's KV up to its length (mid-phase length), and the
      // logits are written once and read once by the samplers.
      row.model_name = "smollm2";
      const double kv = rows * mid_length *
                        (static_cast<double>(steps) * models.draft_kv_bytes_per_token +
                         static_cast<double>(models.target_kv_bytes_per_token));
      const double draft_weights =
          static_cast<double>(forward_weight_bytes(*models.draft, models.draft_weight_bytes, rows));
      const double target_weights = static_cast<double>(
          forward_weight_bytes(*models.target, models.target_weight_bytes, rows * (steps + 1)));
      row.cycle_bytes = static_cast<int64_t>(static_cast<double>(steps) * draft_weights + target_weights +
                                             kv + 2.0 * static_cast<double>(row.logits_bytes));
      row.roofline_us = static_cast<double>(row.cycle_bytes) / (env.copy_gbs * 1e3);
    }
    row.valid = check.ok;
    row.problem = check.problem;
    ctx.csv->row(csv_cells(env, row));

    std::printf("%8d %5d %10s %10s %7s %9s %9s %10s %9s %10s %9s %8s %6s %11s %9s %6lld %8lld%s\n", requests,
                rows, format(row.graph.median_us, 1).c_str(), format(row.eager.median_us, 1).c_str(),
                format(row.eager.median_us / row.graph.median_us, 2).c_str(),
                format(row.host_step_us, 1).c_str(), format(row.bare_launch_us, 1).c_str(),
                format(row.eager_host_step_us, 1).c_str(), format(row.model.cycle_us, 1).c_str(),
                format(row.nonmodel_us, 1).c_str(), format(row.floor_us, 1).c_str(),
                format(row.nonmodel_us / row.floor_us, 2).c_str(), format(row.tokens_per_cycle, 2).c_str(),
                format(row.tokens_per_s, 0).c_str(), format(row.capture_ms, 2).c_str(),
                static_cast<long long>(row.graph_nodes), static_cast<long long>(row.nonmodel_nodes),
                row.valid ? "" : "  INVALID");
    if (models.real)
      std::printf(
          "%8s  HBM roofline: %.1f MB a cycle (weights per forward, KV, logits) = %s us at copy bandwidth, "
          "%s%% of the graph time; model forwards %s us against their floor %s us (weights + KV at the "
          "timed lengths over copy bandwidth + graph nodes x node floor): %sx\n",
          "", row.cycle_bytes / 1e6, format(row.roofline_us, 1).c_str(),
          format(100.0 * row.roofline_us / row.graph.median_us, 1).c_str(),
          format(row.model.cycle_us, 1).c_str(), format(row.model.floor_us, 1).c_str(),
          format(row.model.cycle_us / row.model.floor_us, 3).c_str());
    if (kind == CycleKind::kSpeculative && steps == 0) // nothing drafted: no draft length or acceptance
      std::printf("%8s  draft length: none (%s)\n", "", engine.draft_loop().note.c_str());
    else if (kind == CycleKind::kSpeculative)
      std::printf("%8s  draft length: mean K %s of %d, %s accepted tokens per drafted token (per draft "
                  "forward of a request), mean acceptance EMA %s (%s)\n",
                  "", format(mean_draft_steps, 2).c_str(), steps, format(row.accepted_per_draft, 3).c_str(),
                  format(mean_acceptance_ema, 3).c_str(), engine.draft_loop().note.c_str());
    if (kind == CycleKind::kSmc)
      std::printf("%8s  particles: mean ESS / N %s, resampled in %s%% of request cycles, log Z-hat %s a "
                  "token\n",
                  "", format(row.ess_over_n, 3).c_str(), format(100.0 * row.resample_rate, 1).c_str(),
                  format(row.log_z_per_token, 3).c_str());
    if (!stage_us.empty()) {
      // Stages that hold a model forward are named *draft* and *verify*; the rest is the library's own part.
      double own = 0.0;
      std::string line;
      auto holds_forward = [](const std::string& name) {
        const std::string stage = name.substr(0, name.find(' '));
        return stage == "smc.draft" || stage == "spec.draft" || stage == "smc.verify" ||
               stage == "spec.verify_forward";
      };
      for (const auto& [name, us] : stage_us) {
        line += " " + name + " " + format(us, 1);
        if (!holds_forward(name))
          own += us;
      }
      std::printf("%8s  stages (us, each alone on the GPU, eager):%s; stages without a forward %s us\n", "",
                  line.c_str(), format(own, 1).c_str());
    }
    if (!row.valid)
      std::printf("  validation failed: %s\n", row.problem.c_str());
    std::fflush(stdout);
    results.push_back(std::move(row));
    ++*ctx.done;
  }
  std::vector<RequestUpdate> updates;
  drain(engine, updates);
  for (const RequestId id : ids)
    engine.release(id);
  engine.synchronize();
}

// ---------------------------------------------------------------------------------------------------------

int run(const Options& o, const char* argv0) {
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "bucket_sweep: no CUDA device\n");
    return 2;
  }
  const bool real = o.model == "smollm2";
  const std::string model_path =
      real ? (o.model_path.empty() ? default_llama_model_path() : o.model_path) : "";
  if (real && !std::filesystem::exists(model_path)) {
    std::fprintf(stderr, "bucket_sweep: the model file %s is missing (run ./run fetch-model)\n",
                 model_path.c_str());
    return 2;
  }
  // The real model has one vocabulary; the toy pair sweeps the listed ones.
  const std::vector<int> vocabs = real ? std::vector<int>{kRealVocab} : o.vocabs;
  Environment env;
  env.device = bench::device_name();
  Stream stream;
  env.copy_gbs = bench::measure_copy_bandwidth_gbs(stream);
  env.node_floor_us = bench::node_floor_us(stream);

  // The speculative cycle: probe the engine rather than assume, so the sweep follows the engine.
  bool spec_available = false;
  std::string spec_note;
  {
    EngineConfig probe;
    probe.kind = CycleKind::kSpeculative;
    probe.particles = 1;
    try {
      validate_engine_config(probe);
      spec_available = true;
      spec_note = "N = 1 (the particle list applies to smc only), greedy: T_d = T_t = 0 (exact greedy "
                  "speculative decoding)";
    } catch (const Error& error) {
      spec_note = std::string("pending: the engine has no speculative cycle yet (") + error.what() + ")";
    }
  }
  const bool run_smc = std::find(o.kinds.begin(), o.kinds.end(), "smc") != o.kinds.end();
  const bool run_spec = spec_available && std::find(o.kinds.begin(), o.kinds.end(), "spec") != o.kinds.end();
  // (kind, particles) pairs of the engine grid, smc first.
  std::vector<std::pair<CycleKind, int>> engine_kinds;
  if (run_smc)
    for (const int particles : o.particles)
      engine_kinds.emplace_back(CycleKind::kSmc, particles);
  if (run_spec)
    engine_kinds.emplace_back(CycleKind::kSpeculative, 1);

  const int max_particles = *std::max_element(o.particles.begin(), o.particles.end());
  const int max_steps = *std::max_element(o.steps.begin(), o.steps.end());
  SweepConstants constants;
  // Every phase admits fresh prompts and runs warm-up + `cycles` (+ 1 for the host timing) cycles.
  g_prompt_length = o.context;
  const int longest = g_prompt_length + 1 + (kWarmupCycles + o.cycles + 2) * (max_steps + 1);
  const int validation_longest = kPromptLength + 1 + (kValidationCycles + 1) * (max_steps + 1);
  constants.max_seq_len = round_up(std::max({longest, validation_longest, 256}), 128);
  // Enough slots for the largest bucket and for the peers' validation engines (kValidationPrompts requests).
  const int pool_requests = std::max(o.requests.back(), kValidationPrompts);
  const int64_t pool = static_cast<int64_t>(pool_requests) * max_particles * constants.max_seq_len + 1;
  require(pool < (int64_t{1} << 30), "bucket_sweep", "slot pool", pool,
          "too large (fewer cycles or requests)");
  constants.pool_size = static_cast<int>(pool);
  const int total = static_cast<int>(vocabs.size() * o.dtypes.size() * engine_kinds.size() * o.steps.size() *
                                     o.requests.size());

  std::printf("smcgraph bucket_sweep on %s: copy %s GB/s (read + write), node floor %s us\n",
              env.device.c_str(), format(env.copy_gbs, 0).c_str(), format(env.node_floor_us, 3).c_str());
  std::printf("cycle kinds: smc %s; spec %s: %s\n", run_smc ? "measured" : "not requested",
              run_spec ? "measured" : (spec_available ? "not requested" : "not measured"), spec_note.c_str());
  std::printf("grid: requests {%s} x N {%s} x K {%s} x V {%s} x logits {",
              join_ints(o.requests, ", ").c_str(), join_ints(o.particles, ", ").c_str(),
              join_ints(o.steps, ", ").c_str(), join_ints(vocabs, ", ").c_str());
  for (size_t i = 0; i < o.dtypes.size(); ++i)
    std::printf("%s%s", i ? ", " : "", dtype_name(o.dtypes[i]));
  std::printf(
      "}; %d cycles per phase after %d warm-up cycles from %d-token prompts; T_d %.2f, T_t %.2f, alpha "
      "%.2f, tau %.2f; ",
      o.cycles, kWarmupCycles, g_prompt_length, constants.engine_defaults.draft_temperature,
      constants.engine_defaults.target_temperature, constants.engine_defaults.alpha,
      constants.engine_defaults.tau);
  if (real)
    std::printf("real model pair (below)");
  else
    std::printf("toy models hidden %d, window %d, draft perturbation %.2f", kToyHidden, kToyWindow,
                o.draft_perturbation);
  std::printf("; max_seq_len %d, slot pool %d\n", constants.max_seq_len, constants.pool_size);
  std::printf(
      "graph/eager = median GPU time per cycle; host = host time per step(); launch = the driver's "
      "cudaGraphLaunch of a graph of the cycle's nodes, timed in turns with step() (step()'s floor); "
      "eag_host = host time per eager step(); model = draft head + "
      "(K-1) draft steps + verify timed alone at the rows' mid-phase length; nonmodel = graph - model (it "
      "can be slightly negative "
      "with the real model: inside the cycle's graph a forward's first launch overlaps the end of the "
      "stage before it (programmatic dependent launch), timed alone it does not); floor = (logits the "
      "samplers read: K draft + K+1 target columns per row, + state) / copy bandwidth + non-model "
      "nodes x node floor; tok/c = tokens committed per row and cycle; tokens/s = requests x tok/c / "
      "graph time\n");
  std::fflush(stdout);

  bench::Csv csv(o.csv);
  csv.row(kCsvColumns);
  const std::filesystem::path out_dir = std::filesystem::path(o.csv).parent_path();
  const std::string manifest = (out_dir / kPeerManifestName).string();
  std::map<int, std::string> weight_files;
  std::vector<ValidationRecord> validation, spec_validation;
  std::vector<Row> results;
  Progress progress(o.progress, total);
  int done = 0;
  uint64_t seed = 1;
  bool all_valid = true;
  const SweepContext ctx{&o, &env, &constants, &csv, &progress, &done, &seed, &stream};

  // The real pair: the weights once (shared by draft and target), chat prompts from its own tokenizer.
  std::unique_ptr<GgufFile> gguf;
  std::shared_ptr<const LlamaWeights> llama_weights;
  std::vector<std::vector<int32_t>> real_greedy; // smcgraph's greedy continuations (peer validation)
  if (real) {
    gguf = std::make_unique<GgufFile>(GgufFile::open(model_path));
    llama_weights = load_llama_weights(*gguf);
    const Tokenizer tokenizer = Tokenizer::from_gguf(*gguf);
    // Prompt i: the chat of question i (with --context, of the built-in questions from i on as user turns
    // until it is long enough), its last g_prompt_length tokens.
    constexpr size_t kQuestions = std::size(examples::kChatQuestions);
    for (int i = 0; i < examples::kSweepChatQuestions; ++i) {
      std::vector<std::pair<std::string, std::string>> messages;
      std::vector<int32_t> ids;
      do {
        messages.emplace_back("user", examples::kChatQuestions[(i + messages.size()) % kQuestions]);
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, true));
      } while (ids.size() < static_cast<size_t>(g_prompt_length) && g_prompt_length > kPromptLength);
      if (ids.size() > static_cast<size_t>(g_prompt_length))
        ids.erase(ids.begin(), ids.end() - g_prompt_length);
      while (ids.size() <
             static_cast<size_t>(g_prompt_length)) // pad at the front with the system prompt's start
        ids.insert(ids.begin(), tokenizer.bos_id());
      g_real_prompts.push_back(std::move(ids));
    }
    const auto describe = [&](CycleKind kind) {
      const std::string layers = draft_layers_for(o, kind);
      return layers == "ngram"
                 ? std::string("the n-gram draft")
                 : "layers " + layers + " (" + std::to_string(parse_llama_layers(layers).size()) + ")";
    };
    std::printf(
        "model: SmolLM2-135M-Instruct (%s), %d layers; draft: spec %s, smc %s; timing prompts: the last %d "
        "tokens of %zu chat prompts\n",
        model_path.c_str(), llama_weights->config().layers, describe(CycleKind::kSpeculative).c_str(),
        describe(CycleKind::kSmc).c_str(), g_prompt_length, g_real_prompts.size());
  }

  for (const int vocab : vocabs) {
    for (const DType dtype : o.dtypes) {
      if (engine_kinds.empty())
        break;
      // The pairs of this (V, dtype): the real models (weights shared, loaded once; a draft per distinct
      // layer list of the two kinds) or the toy pair. models_of(kind) is the pair a kind runs.
      std::unique_ptr<LlamaModel> llama_target;
      std::map<std::string, std::unique_ptr<Model>> real_drafts; // by layer list ("ngram": the n-gram draft)
      std::map<std::string, ModelPair> real_pairs;
      ToyModelPair toy_models;
      ModelPair toy_pair;
      const auto models_of = [&](CycleKind kind) -> const ModelPair& {
        return real ? real_pairs.at(draft_layers_for(o, kind)) : toy_pair;
      };
      if (real) {
        LlamaModelOptions options;
        options.pool_size = constants.pool_size;
        options.max_seq_len = constants.max_seq_len;
        options.max_tokens_per_forward =
            std::max(128, o.requests.back() * std::max(max_particles, kValidationPrompts) * (max_steps + 1));
        options.logits_dtype = dtype;
        llama_target = std::make_unique<LlamaModel>(llama_weights, options);
        const LlamaConfig& c = llama_target->config();
        const size_t kv_token_layer = size_t{2} * c.kv_heads * c.head_dim * sizeof(uint16_t);
        for (const CycleKind kind : {CycleKind::kSpeculative, CycleKind::kSmc}) {
          const std::string layers = draft_layers_for(o, kind);
          if (real_pairs.count(layers))
            continue;
          ModelPair pair{nullptr, llama_target.get(), true};
          real_drafts[layers] = examples::make_draft(layers, llama_weights, options, *llama_target);
          if (const auto* draft = dynamic_cast<const LlamaModel*>(real_drafts[layers].get())) {
            pair.draft_weight_bytes = draft->weight_bytes_per_forward();
            pair.draft_kv_bytes_per_token = kv_token_layer * draft->layers().size();
          } else { // the n-gram draft: no weights, a token id per position
            pair.draft_kv_bytes_per_token = sizeof(int32_t);
          }
          pair.draft = real_drafts[layers].get();
          pair.target_weight_bytes = llama_target->weight_bytes_per_forward();
          pair.target_kv_bytes_per_token = kv_token_layer * llama_target->layers().size();
          real_pairs[layers] = pair;
        }
        if (o.peers && real_greedy.empty()) { // greedy: the target's tokens, whichever draft
          progress.update(done, "greedy validation tokens for the peers");
          real_greedy = real_greedy_tokens(models_of(CycleKind::kSpeculative), constants, kRealGreedyTokens,
                                           o.steps.front());
        }
      }
      ToyModelConfig toy;
      toy.vocab = vocab;
      toy.hidden = kToyHidden;
      toy.window = kToyWindow;
      toy.pool_size = constants.pool_size;
      toy.max_seq_len = constants.max_seq_len;
      toy.logits_dtype = dtype;
      toy.weight_seed = kWeightSeed;
      if (!real) {
        toy_models = ToyModel::pair(toy, o.draft_perturbation);
        toy_pair = ModelPair{toy_models.draft.get(), toy_models.target.get()};
      }

      if (!real && (run_smc || run_spec)) { // the toy peers' inputs: weights once per vocabulary, validation
                                            // tokens per (kind, V, dtype)
        if (!weight_files.count(vocab)) {
          const std::string name = "toy_weights_v" + std::to_string(vocab) + ".safetensors";
          progress.update(done, "writing " + name);
          EngineConfig described = constants.engine_defaults;
          described.vocab = vocab;
          described.max_seq_len = constants.max_seq_len;
          described.slot_pool_size = constants.pool_size;
          described.max_requests = o.requests.back();
          write_toy_weights((out_dir / name).string(), toy, o.draft_perturbation, described);
          weight_files[vocab] = name;
        }
        for (const CycleKind kind : {CycleKind::kSmc, CycleKind::kSpeculative}) {
          if (!(kind == CycleKind::kSmc ? run_smc : run_spec))
            continue;
          std::vector<ValidationRecord>& records = kind == CycleKind::kSmc ? validation : spec_validation;
          progress.update(done, std::string("validation engine ") + kind_name(kind) +
                                    " V=" + std::to_string(vocab) + " " + dtype_name(dtype));
          try {
            // The SMC cycle drafts at least one token: its validation takes K >= 1 (K = 0 is spec only).
            const int validation_steps =
                kind == CycleKind::kSmc ? std::max(1, o.steps.front()) : o.steps.front();
            records.push_back(run_validation_engine(models_of(kind), kind, vocab, dtype, o.particles.front(),
                                                    validation_steps, constants));
          } catch (const Error& error) {
            records.push_back({});
            records.back().kind = kind;
            records.back().draft_temperature =
                kind == CycleKind::kSmc ? kValidationDraftTemperature : kSpecDraftTemperature;
            records.back().vocab = vocab;
            records.back().dtype = dtype;
            records.back().ok = false;
            records.back().problem = error.what();
          }
          if (!records.back().ok) {
            all_valid = false;
            std::printf("validation engine %sV = %d %s: FAILED: %s\n", kind == CycleKind::kSmc ? "" : "spec ",
                        vocab, dtype_name(dtype), records.back().problem.c_str());
          }
        }
        write_manifest(manifest, o, env, constants, weight_files, validation, run_smc, run_spec,
                       spec_validation);
      }

      for (const auto& [kind, particles] : engine_kinds) {
        for (const int steps : o.steps) {
          const int done_before = done;
          if (kind == CycleKind::kSmc && steps == 0) { // no SMC without a draft
            std::printf("\nsmc N = %d K = 0: skipped (K = 0, no draft, is the speculative cycle's only)\n",
                        particles);
            done += static_cast<int>(o.requests.size());
            continue;
          }
          try {
            sweep_engine(ctx, models_of(kind), kind, vocab, dtype, particles, steps, results);
          } catch (
              const Error& error) { // report, go on with the next engine (a sticky CUDA error stops them all)
            all_valid = false;
            std::printf("\n%s V = %d %s N = %d K = %d: FAILED: %s\n", kind_name(kind), vocab,
                        dtype_name(dtype), particles, steps, error.what());
            std::fflush(stdout);
            done = done_before + static_cast<int>(o.requests.size());
          }
        }
      }
    }
  }
  progress.finish();
  for (const Row& row : results)
    all_valid = all_valid && row.valid;
  std::printf("\nvalidation: %s; CSV: %s; peer inputs: %s\n", all_valid ? "ok" : "FAILED", o.csv.c_str(),
              run_smc || run_spec ? manifest.c_str() : "(none)");
  std::fflush(stdout);

  bool peers_ok = true;
  if (real && o.peers)
    peers_ok = run_real_peers(o, argv0, env, model_path, results, real_greedy);
  else if (o.peers && (run_smc || run_spec))
    peers_ok = run_peers(o, argv0, env, manifest, results, run_smc, run_spec);
  if (o.plots && !results.empty() && !real)
    run_plots(o, argv0, run_smc, run_spec);
  if (!all_valid)
    return 1;
  return peers_ok ? 0 : 3;
}

} // namespace

} // namespace smcgraph::sweep

int main(int argc, char** argv) {
  smcgraph::sweep::Options options;
  const int status = smcgraph::sweep::parse_options(argc, argv, options);
  if (status >= 0)
    return status;
  try {
    return smcgraph::sweep::run(options, argv[0]);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "\nbucket_sweep: %s\n", error.what());
    return 2;
  }
}
