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
// Per bucket, in this order (every phase starts from freshly admitted 32-token prompts, so every phase times
// rows of the same lengths, and the PyTorch peer starts from the same point):
//   1. model forwards alone: draft head (rows x 2 tokens), draft step (rows x 1), target verify (rows x K+1),
//      each captured in a graph and replayed; model time per cycle = head + (K - 1) steps + verify;
//   2. graph: 3 warm-up cycles, validated (no failed request, N particles x K + 1 in-vocabulary tokens, or
//      1 .. K + 1 for spec, slot invariants), then `cycles` replays with an event after each step(): median
//      GPU time per cycle;
//   3. host time per step() with one cycle in flight (graph replay);
//   4. the same recipe eagerly (Engine::set_eager(true)): GPU time per cycle, then (fresh prompts again) host
//      time per step.
// Non-model time = graph cycle time - model time. Its floor = bytes it must move / copy bandwidth (the
// samplers read K draft columns and K + 1 target columns of logits per row, plus a small per-token state)
// + non-model graph nodes x the measured node floor (an empty kernel's graph node), both measured in this
// run.
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
// Exit status: 0; 1 when a validation failed; 2 when it could not run; 3 when a peer failed or reported an
// invalid result (smcgraph's own numbers are still written).
#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include "bench_util.hpp"
#include "runtime/engine_state.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/tokenizer.hpp"
#include "smcgraph/toy_model.hpp"

namespace {

using namespace smcgraph;
using smcgraph::bench::find_peer_script;
using smcgraph::bench::format;
using smcgraph::bench::run_command;
using smcgraph::bench::shell_quote;

constexpr int kPromptLength = 32;
constexpr int kWarmupCycles = 3;
constexpr int kToyHidden = 32;
constexpr int kToyWindow = 16;
constexpr uint64_t kWeightSeed = 2026;
constexpr int kValidationPrompts = 4;
constexpr int kValidationCycles = 6;
// Near-greedy drafting for the peer validation: logits closer than ~50 x T_d to the maximum are the only ones
// Gumbel noise can reorder, so both sides draw the argmax except at (near-)ties, which the peer recognises.
constexpr float kValidationDraftTemperature = 1e-6f;
// The spec kind runs greedy speculative decoding, timed and validated alike: the draft by argmax (T_d = 0,
// which the engine accepts for kSpeculative) and a greedy target (T_t = 0), so its tokens are those of greedy
// target-only decoding and its PyTorch peer (greedy too) commits the same tokens per cycle.
constexpr float kSpecDraftTemperature = 0.0f;
constexpr float kSpecTargetTemperature = 0.0f;
constexpr int kModelLaunchesPerGraph = 10, kModelRepetitions = 20, kModelWarmup = 3;
// Small state the non-model kernels of a cycle must touch, per row: per token position (K + 1 of them) the
// slot id, token, position, out slot and sequence length of the forward inputs, the log-probs, the slot
// table / token table / refcount writes of alloc and commit and the packed outputs (16 4-byte values), plus
// per-row scalars (logw, flags, live, finished, ancestor, ESS, draw counter, ...). Three orders of magnitude
// below the logits the samplers read, so the estimate's precision does not matter.
constexpr int64_t kStateBytesPerToken = 64;
constexpr int64_t kStateBytesPerRow = 128;

const char* const kPeerManifestName = "bucket_sweep_peer.json";
const char* const kPeerCsvName = "smc_peer.csv";
const char* const kSpecPeerCsvName = "spec_peer.csv";

struct Options {
  std::vector<std::string> kinds{"smc", "spec"};
  std::vector<int> requests{1, 2, 4, 8, 16, 32, 64};
  std::vector<int> particles{4, 8};
  std::vector<int> steps{4, 8};
  std::vector<int> vocabs{32000, 128256};
  std::vector<DType> dtypes{DType::kFloat32, DType::kBFloat16};
  int cycles = 30;
  float draft_perturbation = 0.3f;
  std::string csv = "results/bucket_sweep.csv";
  bool quick = false, peers = false, plots = false, progress = true;
  std::string python = "python3";
  std::string peer_script, spec_peer_script, plot_script; // empty: found from the cwd or the executable
  std::string peer_methods;  // empty: each peer's default methods; spec_* names go to spec_peer.py
  std::string model = "toy"; ///< toy: the embedded pair; smollm2: the real pair from its GGUF file
  std::string model_path;    ///< empty: $SMCGRAPH_MODEL_PATH or .cache/models/ found from the cwd
  std::string draft_layers = "0-27";
};

/// A draft and a target (the toy pair or the real one) plus what the roofline needs of the real one.
struct ModelPair {
  Model* draft = nullptr;
  Model* target = nullptr;
  bool real = false;
  size_t draft_weight_bytes = 0, target_weight_bytes = 0; ///< bytes one forward must read at least
  size_t draft_kv_bytes_per_token = 0, target_kv_bytes_per_token = 0;
};

/// Chat prompts of the real model (their last kPromptLength tokens); empty for the toy pair.
std::vector<std::vector<int32_t>> g_real_prompts;

// ---------------------------------------------------------------------------------------------------------
// Small helpers

int round_up(int value, int multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

struct Summary {
  double median_us = NAN, p90_us = NAN;
};

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

std::string join_ints(const std::vector<int>& values, const char* separator = ",") {
  std::string text;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i)
      text += separator;
    text += std::to_string(values[i]);
  }
  return text;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ','))
    if (!item.empty())
      items.push_back(item);
  return items;
}

/// Shortest text that reads back as the same float (JSON and safetensors metadata).
std::string float_text(float value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", static_cast<double>(value));
  return text;
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof(escape), "\\u%04x", c);
      out += escape;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string json_int_array(const std::vector<int32_t>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i)
      text += ',';
    text += std::to_string(values[i]);
  }
  return text + "]";
}

/// Prompt of request slot `q` (timing phases; the peer uses the same rule, see toy_weights_io.md).
std::vector<int32_t> timing_prompt(int q, int vocab) {
  if (!g_real_prompts.empty()) // the real model: chat prompts, so acceptance is that of real text
    return g_real_prompts[static_cast<size_t>(q) % g_real_prompts.size()];
  std::vector<int32_t> prompt(kPromptLength);
  for (int i = 0; i < kPromptLength; ++i)
    prompt[i] =
        static_cast<int32_t>((static_cast<int64_t>(q + 1) * 7919 + static_cast<int64_t>(i) * 104729) % vocab);
  return prompt;
}

// The real model pair (--model smollm2): its vocabulary and the chat prompts the timing phases use.
constexpr int kRealVocab = 49152;
constexpr int kRealGreedyTokens = 64; // greedy tokens per prompt the peers must reproduce
constexpr const char* kRealPrompts[] = {
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the ocean at night.",
    "Explain what a GPU is to a ten-year-old.",
    "List three tips for staying focused while studying.",
    "How do I make a cup of green tea?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into Spanish and French.",
};

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

// ---------------------------------------------------------------------------------------------------------
// Engine driving

/// Everything the engine still holds for the host: pending updates and cycles in flight.
void drain(Engine& engine, std::vector<RequestUpdate>& updates) {
  Engine::State& state = engine.state();
  while (!state.in_flight.empty() || !state.pending_updates.empty()) {
    for (RequestUpdate& update : engine.poll())
      updates.push_back(std::move(update));
  }
  engine.synchronize();
}

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
  engine.synchronize();
  Engine::State& state = engine.state();
  const SlotCheck slots =
      check_slot_invariants_device(state.pool_view(), state.tables_view(), engine.stream());
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

/// Host time of step() alone: one cycle is in flight when step() is called, so it only launches.
double host_us_per_step(Engine& engine, int cycles, std::vector<RequestUpdate>& updates) {
  drain(engine, updates);
  engine.step();
  std::vector<double> samples;
  for (int i = 0; i < cycles; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    engine.step();
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    for (RequestUpdate& update : engine.poll())
      updates.push_back(std::move(update));
  }
  drain(engine, updates);
  return summarize(std::move(samples)).median_us;
}

// ---------------------------------------------------------------------------------------------------------
// Model forwards on their own

struct ModelTiming {
  double head_us = NAN, step_us = NAN, verify_us = NAN, cycle_us = NAN;
};

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

  ForwardArgs prepare(int rows, int tokens_per_row, cudaStream_t stream) {
    require(rows <= max_rows_ && tokens_per_row <= max_tokens_, "ForwardBench::prepare", "rows", rows,
            "too large");
    const int base = std::min(100, max_seq_len_ - tokens_per_row - 1);
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

  double time_forward(Model& model, int rows, int tokens_per_row, cudaStream_t stream) {
    const ForwardArgs args = prepare(rows, tokens_per_row, stream);
    return bench::time_graph([&](cudaStream_t s) { model.forward(args, s); }, stream, kModelLaunchesPerGraph,
                             kModelRepetitions, kModelWarmup)
        .median_us;
  }

  ModelTiming time_cycle_forwards(Model& draft, Model& target, int rows, int steps, cudaStream_t stream) {
    ModelTiming timing;
    timing.head_us = time_forward(draft, rows, 2, stream);
    timing.step_us = steps > 1 ? time_forward(draft, rows, 1, stream) : 0.0;
    timing.verify_us = time_forward(target, rows, steps + 1, stream);
    timing.cycle_us = timing.head_us + (steps - 1) * timing.step_us + timing.verify_us;
    return timing;
  }

  /// Graph nodes one forward adds to a captured cycle.
  size_t nodes_per_forward(Model& model, int rows, int tokens_per_row, cudaStream_t stream) {
    const ForwardArgs args = prepare(rows, tokens_per_row, stream);
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
  DeviceBuffer<int32_t> tokens_, positions_, out_slots_, slot_table_, seq_lens_;
  DeviceBuffer<uint8_t> live_;
  DeviceBuffer<uint8_t> logits_;
};

// ---------------------------------------------------------------------------------------------------------
// Results

struct Row {
  std::string kind;
  int vocab = 0;
  DType dtype = DType::kFloat32;
  int particles = 0, steps = 0, requests = 0, rows = 0;
  Summary graph, eager;
  double host_step_us = NAN, eager_host_step_us = NAN;
  ModelTiming model;
  double nonmodel_us = NAN;
  int64_t logits_bytes = 0, state_bytes = 0;
  double bytes_floor_us = NAN, node_floor_total_us = NAN, floor_us = NAN;
  int64_t graph_nodes = 0, nonmodel_nodes = 0;
  double tokens_per_cycle =
      NAN; ///< tokens committed per row and cycle (K + 1 for smc; accepted + 1 for spec)
  double tokens_per_s = NAN, capture_ms = NAN, engine_mb = NAN, construct_ms = NAN;
  std::string model_name = "toy";
  int64_t cycle_bytes = 0;    ///< real model: weights per forward, KV read, logits (the HBM roofline's bytes)
  double roofline_us = NAN;   ///< cycle_bytes / copy bandwidth
  double ess_over_n = NAN;    ///< smc: mean ESS / N over the timed cycles' request updates
  double resample_rate = NAN; ///< smc: fraction of request cycles that resampled
  bool valid = true;
  std::string problem;
};

struct Environment {
  std::string device;
  double copy_gbs = NAN;
  double node_floor_us = NAN;
};

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
                                              "ess_over_n",
                                              "resample_rate"};

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
          format(row.ess_over_n, 3),
          format(row.resample_rate, 3)};
}

// ---------------------------------------------------------------------------------------------------------
// Peer files: the toy weights (safetensors layout) and the manifest

/// Writes the draft and target weights of `toy` (draft head perturbed by `draft_perturbation`, as
/// ToyModel::pair) and the engine config as a safetensors file (bench/peers/toy_weights_io.md).
void write_toy_weights(const std::string& path, const ToyModelConfig& toy, float draft_perturbation,
                       const EngineConfig& engine_config) {
  static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");
  ToyModelConfig target_config = toy;
  target_config.head_perturbation = 0.0f;
  ToyModelConfig draft_config = toy;
  draft_config.head_perturbation = draft_perturbation;
  const ToyModelWeights target = make_toy_model_weights(target_config);
  const ToyModelWeights draft = make_toy_model_weights(draft_config);

  struct Tensor {
    std::string name;
    const std::vector<float>* data;
    std::vector<int64_t> shape;
  };
  const int64_t V = toy.vocab, H = toy.hidden;
  std::vector<Tensor> tensors;
  for (const auto& [prefix, weights] : {std::pair<std::string, const ToyModelWeights*>{"target", &target},
                                        std::pair<std::string, const ToyModelWeights*>{"draft", &draft}}) {
    tensors.push_back({prefix + ".embedding", &weights->embedding, {V, H}});
    tensors.push_back({prefix + ".position", &weights->position, {kToyPositionPeriod, H}});
    tensors.push_back({prefix + ".head", &weights->head, {V, H}});
    tensors.push_back({prefix + ".bias", &weights->bias, {V}});
  }

  const std::vector<std::pair<std::string, std::string>> metadata = {
      {"format", "smcgraph-toy-weights-1"},
      {"vocab", std::to_string(toy.vocab)},
      {"hidden", std::to_string(toy.hidden)},
      {"window", std::to_string(toy.window)},
      {"position_period", std::to_string(kToyPositionPeriod)},
      {"pool_size", std::to_string(toy.pool_size)},
      {"max_seq_len", std::to_string(toy.max_seq_len)},
      {"weight_seed", std::to_string(toy.weight_seed)},
      {"draft_perturbation", float_text(draft_perturbation)},
      {"engine.vocab", std::to_string(engine_config.vocab)},
      {"engine.max_seq_len", std::to_string(engine_config.max_seq_len)},
      {"engine.slot_pool_size", std::to_string(engine_config.slot_pool_size)},
      {"engine.max_requests", std::to_string(engine_config.max_requests)},
      {"engine.draft_temperature", float_text(engine_config.draft_temperature)},
      {"engine.target_temperature", float_text(engine_config.target_temperature)},
      {"engine.alpha", float_text(engine_config.alpha)},
      {"engine.tau", float_text(engine_config.tau)},
      {"engine.eos_id", std::to_string(engine_config.eos_id)},
  };
  std::string header = "{\"__metadata__\":{";
  for (size_t i = 0; i < metadata.size(); ++i) {
    if (i)
      header += ',';
    header += json_string(metadata[i].first);
    header += ':';
    header += json_string(metadata[i].second);
  }
  header += "}";
  size_t offset = 0;
  for (const Tensor& tensor : tensors) {
    const size_t bytes = tensor.data->size() * sizeof(float);
    int64_t elements = 1;
    for (const int64_t extent : tensor.shape)
      elements *= extent;
    require(static_cast<size_t>(elements) == tensor.data->size(), "write_toy_weights", "tensor elements",
            tensor.data->size(), "do not match the shape");
    header += ',';
    header += json_string(tensor.name);
    header += ":{\"dtype\":\"F32\",\"shape\":[";
    for (size_t i = 0; i < tensor.shape.size(); ++i) {
      if (i)
        header += ',';
      header += std::to_string(tensor.shape[i]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  while (header.size() % 8 != 0)
    header += ' '; // the data section starts 8-byte aligned

  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty())
    std::filesystem::create_directories(parent);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    throw Error("bucket_sweep: cannot open " + path + " for writing");
  const uint64_t header_bytes = header.size();
  out.write(reinterpret_cast<const char*>(&header_bytes), sizeof(header_bytes));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const Tensor& tensor : tensors)
    out.write(reinterpret_cast<const char*>(tensor.data->data()),
              static_cast<std::streamsize>(tensor.data->size() * sizeof(float)));
  if (!out)
    throw Error("bucket_sweep: writing " + path + " failed");
}

/// The engine's tokens for the validation prompts (greedy target; smc: near-zero draft temperature, spec:
/// greedy draft).
struct ValidationRecord {
  CycleKind kind = CycleKind::kSmc;
  int vocab = 0;
  DType dtype = DType::kFloat32;
  int particles = 0, steps = 0, cycles = 0;
  float draft_temperature = kValidationDraftTemperature;
  std::vector<std::vector<int32_t>> prompts, tokens; ///< tokens: particle 0's generated tokens (x_P first)
  bool ok = true;
  std::string problem;
};

struct SweepConstants {
  int max_seq_len = 0, pool_size = 0;
  EngineConfig engine_defaults; ///< temperatures, alpha, tau, eos of the timed engines
};

/// The validation entries of one kind as a JSON array (`indent` before each entry).
std::string json_validation(const std::vector<ValidationRecord>& validation, const SweepConstants& k,
                            const char* indent) {
  std::ostringstream j;
  j << "[";
  for (size_t v = 0; v < validation.size(); ++v) {
    const ValidationRecord& r = validation[v];
    j << (v ? ",\n" : "\n") << indent << "{\"vocab\": " << r.vocab
      << ", \"dtype\": " << json_string(dtype_name(r.dtype)) << ", \"particles\": " << r.particles
      << ", \"steps\": " << r.steps << ", \"cycles\": " << r.cycles
      << ", \"draft_temperature\": " << float_text(r.draft_temperature)
      << ", \"target_temperature\": 0, \"alpha\": 1, \"tau\": " << float_text(k.engine_defaults.tau)
      << ", \"engine_ok\": " << (r.ok ? "true" : "false") << ",\n"
      << indent << " \"prompts\": [";
    for (size_t p = 0; p < r.prompts.size(); ++p)
      j << (p ? ", " : "") << json_int_array(r.prompts[p]);
    j << "],\n" << indent << " \"tokens\": [";
    for (size_t p = 0; p < r.tokens.size(); ++p)
      j << (p ? ", " : "") << json_int_array(r.tokens[p]);
    j << "]}";
  }
  return j.str();
}

/// `validation`: the smc entries; `spec_validation`: the spec entries (the `spec` section is written when
/// `with_spec`).
void write_manifest(const std::string& path, const Options& o, const Environment& env,
                    const SweepConstants& k, const std::map<int, std::string>& weight_files,
                    const std::vector<ValidationRecord>& validation, bool with_smc, bool with_spec,
                    const std::vector<ValidationRecord>& spec_validation) {
  std::ostringstream j;
  j << "{\n  \"format\": \"smcgraph-bucket-sweep-peer-1\",\n";
  j << "  \"device\": " << json_string(env.device) << ",\n";
  j << "  \"kinds\": [" << (with_smc ? "\"smc\"" : "") << (with_smc && with_spec ? ", " : "")
    << (with_spec ? "\"spec\"" : "") << "],\n";
  j << "  \"vocabs\": [" << join_ints(o.vocabs, ", ") << "],\n";
  j << "  \"dtypes\": [";
  for (size_t i = 0; i < o.dtypes.size(); ++i)
    j << (i ? ", " : "") << json_string(dtype_name(o.dtypes[i]));
  j << "],\n";
  j << "  \"particles\": [" << join_ints(o.particles, ", ") << "],\n";
  j << "  \"steps\": [" << join_ints(o.steps, ", ") << "],\n";
  j << "  \"requests\": [" << join_ints(o.requests, ", ") << "],\n";
  j << "  \"cycles\": " << o.cycles << ",\n";
  j << "  \"warmup_cycles\": " << kWarmupCycles << ",\n";
  j << "  \"prompt_length\": " << kPromptLength << ",\n";
  j << "  \"timing_prompt\": \"token i of request slot q: ((q + 1) * 7919 + i * 104729) % vocab\",\n";
  j << "  \"max_seq_len\": " << k.max_seq_len << ",\n";
  j << "  \"slot_pool_size\": " << k.pool_size << ",\n";
  j << "  \"draft_temperature\": " << float_text(k.engine_defaults.draft_temperature) << ",\n";
  j << "  \"target_temperature\": " << float_text(k.engine_defaults.target_temperature) << ",\n";
  j << "  \"alpha\": " << float_text(k.engine_defaults.alpha) << ",\n";
  j << "  \"tau\": " << float_text(k.engine_defaults.tau) << ",\n";
  j << "  \"eos_id\": " << k.engine_defaults.eos_id << ",\n";
  j << "  \"toy\": {\"hidden\": " << kToyHidden << ", \"window\": " << kToyWindow
    << ", \"position_period\": " << kToyPositionPeriod << ", \"weight_seed\": " << kWeightSeed
    << ", \"draft_perturbation\": " << float_text(o.draft_perturbation) << "},\n";
  j << "  \"weights\": {";
  bool first = true;
  for (const auto& [vocab, file] : weight_files) {
    j << (first ? "" : ", ") << json_string(std::to_string(vocab)) << ": " << json_string(file);
    first = false;
  }
  j << "},\n";
  j << "  \"validation\": " << json_validation(validation, k, "    ") << "\n  ]";
  if (with_spec) {
    j << ",\n  \"spec\": {\"particles\": 1, \"steps\": [" << join_ints(o.steps, ", ") << "], \"requests\": ["
      << join_ints(o.requests, ", ") << "], \"draft_temperature\": " << float_text(kSpecDraftTemperature)
      << ", \"target_temperature\": " << float_text(kSpecTargetTemperature)
      << ",\n    \"validation\": " << json_validation(spec_validation, k, "      ") << "\n    ]}";
  }
  j << "\n}\n";
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty())
    std::filesystem::create_directories(parent);
  std::ofstream out(path, std::ios::trunc);
  out << j.str();
  if (!out)
    throw Error("bucket_sweep: writing " + path + " failed");
}

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
  std::printf("%8s %5s %10s %10s %7s %9s %10s %9s %10s %9s %8s %6s %11s %9s %6s\n", "requests", "rows",
              "graph_us", "eager_us", "eag/gr", "host_us", "eag_host", "model_us", "nonmodel", "floor_us",
              "nm/flr", "tok/c", "tokens/s", "capt_ms", "nodes");
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

  const auto construct_start = std::chrono::steady_clock::now();
  Engine engine(config, *models.draft, *models.target);
  const double construct_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - construct_start).count();
  const int max_rows = config.max_requests * particles;
  ForwardBench forwards(max_rows, steps + 1, vocab, dtype, config.max_seq_len, config.slot_pool_size);
  Stream& stream = *ctx.stream;
  const size_t draft_nodes = forwards.nodes_per_forward(*models.draft, particles, 1, stream);
  const size_t target_nodes = forwards.nodes_per_forward(*models.target, particles, steps + 1, stream);
  const int64_t model_nodes = static_cast<int64_t>(draft_nodes) * steps + static_cast<int64_t>(target_nodes);

  std::printf(
      "\n%s  V = %d  %s  N = %d  K = %d: engine %.1f MB, constructed (warm-up + capture of %zu buckets x 2 "
      "output parities) in %.1f ms; %lld model nodes per cycle\n",
      kind_name(kind), vocab, dtype_name(dtype), particles, steps, engine.device_bytes() / 1e6,
      engine.buckets().size(), construct_ms, static_cast<long long>(model_nodes));
  print_table_header();

  std::vector<RequestId> ids;
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

    // 1. The model forwards on their own, while the engine holds no request.
    ctx.progress->update(*ctx.done, std::string(label) + ": model forwards");
    drain(engine, updates);
    for (const RequestId id : ids)
      engine.release(id);
    ids.clear();
    engine.synchronize();
    row.model = forwards.time_cycle_forwards(*models.draft, *models.target, rows, steps, stream);

    // 2. Graph replay: validated warm-up, then timed cycles (validated too), then the slot invariants.
    ctx.progress->update(*ctx.done, std::string(label) + ": graph replay");
    engine.set_eager(false);
    refill_and_warm_up(engine, ids, requests, *ctx.seed, check);
    check_slots(engine, check);
    updates.clear();
    row.graph = time_cycles(engine, o.cycles, updates);
    const int64_t committed = check_updates(updates, static_cast<size_t>(o.cycles) * requests, config, check);
    row.tokens_per_cycle = static_cast<double>(committed) / (static_cast<double>(o.cycles) * rows);
    if (kind == CycleKind::kSmc && !updates.empty()) { // particle health of the timed cycles
      double ess = 0.0;
      int64_t resampled = 0;
      for (const RequestUpdate& update : updates) {
        ess += update.ess;
        resampled += update.resampled ? 1 : 0;
      }
      row.ess_over_n = ess / (static_cast<double>(updates.size()) * particles);
      row.resample_rate = static_cast<double>(resampled) / static_cast<double>(updates.size());
    }

    // 3. Host time per step() (graph replay).
    ctx.progress->update(*ctx.done, std::string(label) + ": host step");
    refill_and_warm_up(engine, ids, requests, *ctx.seed, check);
    updates.clear();
    row.host_step_us = host_us_per_step(engine, o.cycles, updates);
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
    row.eager_host_step_us = host_us_per_step(engine, o.cycles, updates);
    check_updates(updates, static_cast<size_t>(o.cycles + 1) * requests, config, check);
    engine.set_eager(false);
    check_slots(engine, check);

    // Derived numbers.
    row.nonmodel_us = row.graph.median_us - row.model.cycle_us;
    const int element_bytes = dtype_bytes(dtype);
    row.logits_bytes = static_cast<int64_t>(rows) * (2 * steps + 1) * vocab * element_bytes;
    row.state_bytes = static_cast<int64_t>(rows) * ((steps + 1) * kStateBytesPerToken + kStateBytesPerRow);
    row.bytes_floor_us = static_cast<double>(row.logits_bytes + row.state_bytes) / (env.copy_gbs * 1e3);
    row.nonmodel_nodes = std::max<int64_t>(0, row.graph_nodes - model_nodes);
    row.node_floor_total_us = static_cast<double>(row.nonmodel_nodes) * env.node_floor_us;
    row.floor_us = row.bytes_floor_us + row.node_floor_total_us;
    row.tokens_per_s = requests * row.tokens_per_cycle / (row.graph.median_us * 1e-6);
    if (models.real) {
      // HBM roofline of the whole cycle: every forward reads its weights once (draft head + K - 1 steps,
      // target verify), each row's KV up to its length (mid-phase length), and the logits are written once
      // and read once by the samplers.
      row.model_name = "smollm2";
      const double length = kPromptLength + 1 + (kWarmupCycles + 0.5 * o.cycles) * row.tokens_per_cycle;
      const double kv = rows * length *
                        (static_cast<double>(steps) * models.draft_kv_bytes_per_token +
                         static_cast<double>(models.target_kv_bytes_per_token));
      row.cycle_bytes = static_cast<int64_t>(static_cast<double>(steps) * models.draft_weight_bytes +
                                             static_cast<double>(models.target_weight_bytes) + kv +
                                             2.0 * static_cast<double>(row.logits_bytes));
      row.roofline_us = static_cast<double>(row.cycle_bytes) / (env.copy_gbs * 1e3);
    }
    row.valid = check.ok;
    row.problem = check.problem;
    ctx.csv->row(csv_cells(env, row));

    std::printf("%8d %5d %10s %10s %7s %9s %10s %9s %10s %9s %8s %6s %11s %9s %6lld%s\n", requests, rows,
                format(row.graph.median_us, 1).c_str(), format(row.eager.median_us, 1).c_str(),
                format(row.eager.median_us / row.graph.median_us, 2).c_str(),
                format(row.host_step_us, 1).c_str(), format(row.eager_host_step_us, 1).c_str(),
                format(row.model.cycle_us, 1).c_str(), format(row.nonmodel_us, 1).c_str(),
                format(row.floor_us, 1).c_str(), format(row.nonmodel_us / row.floor_us, 2).c_str(),
                format(row.tokens_per_cycle, 2).c_str(), format(row.tokens_per_s, 0).c_str(),
                format(row.capture_ms, 2).c_str(), static_cast<long long>(row.graph_nodes),
                row.valid ? "" : "  INVALID");
    if (models.real)
      std::printf(
          "%8s  HBM roofline: %.1f MB a cycle (weights per forward, KV, logits) = %s us at copy bandwidth, "
          "%s%% of the graph time\n",
          "", row.cycle_bytes / 1e6, format(row.roofline_us, 1).c_str(),
          format(100.0 * row.roofline_us / row.graph.median_us, 1).c_str());
    if (kind == CycleKind::kSmc)
      std::printf("%8s  particles: mean ESS / N %s, resampled in %s%% of request cycles\n", "",
                  format(row.ess_over_n, 3).c_str(), format(100.0 * row.resample_rate, 1).c_str());
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
// Peers

struct PeerResult {
  double cycle_us = NAN, model_us = NAN, tokens_per_s = NAN, tokens_per_cycle = NAN;
  bool valid = true;
};
/// (requests, particles, steps, vocab, dtype) -> method -> result.
using PeerKey = std::tuple<int, int, int, int, std::string>;
using PeerTable = std::map<PeerKey, std::map<std::string, PeerResult>>;

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> cells;
  std::stringstream stream(line);
  std::string cell;
  while (std::getline(stream, cell, ','))
    cells.push_back(cell);
  return cells;
}

PeerTable read_peer_csv(const std::string& path, std::vector<std::string>& methods) {
  PeerTable table;
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line))
    return table;
  if (!line.empty() && line.back() == '\r') // Python's csv module ends lines with \r\n
    line.pop_back();
  const std::vector<std::string> header = split_csv_line(line);
  const auto column = [&](const char* name) {
    const auto it = std::find(header.begin(), header.end(), name);
    return it == header.end() ? -1 : static_cast<int>(it - header.begin());
  };
  const int method = column("method"), requests = column("requests"), particles = column("particles"),
            steps = column("steps"), vocab = column("vocab"), dtype = column("dtype"),
            cycle = column("cycle_us"), model = column("model_us"), valid = column("valid"),
            tokens_per_s = column("tokens_per_s"), tokens_per_cycle = column("tokens_per_cycle");
  if (std::min({method, requests, particles, steps, vocab, dtype, cycle}) < 0)
    return table;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    const std::vector<std::string> cells = split_csv_line(line);
    if (static_cast<int>(cells.size()) < static_cast<int>(header.size()))
      continue;
    try {
      PeerResult result;
      result.cycle_us = std::stod(cells[cycle]);
      result.model_us = model >= 0 ? std::stod(cells[model]) : NAN;
      result.tokens_per_s = tokens_per_s >= 0 ? std::stod(cells[tokens_per_s]) : NAN;
      result.tokens_per_cycle = tokens_per_cycle >= 0 ? std::stod(cells[tokens_per_cycle]) : NAN;
      result.valid = valid < 0 || cells[valid] == "1";
      table[{std::stoi(cells[requests]), std::stoi(cells[particles]), std::stoi(cells[steps]),
             std::stoi(cells[vocab]), cells[dtype]}][cells[method]] = result;
      if (std::find(methods.begin(), methods.end(), cells[method]) == methods.end())
        methods.push_back(cells[method]);
    } catch (const std::exception&) {
      continue; // "nan" or a malformed line: skip it
    }
  }
  return table;
}

/// One cycle kind's PyTorch peer: its script, its CSV and what it reported.
struct PeerRun {
  std::string kind;   ///< "smc" or "spec": the sweep rows it compares with
  std::string script; ///< file name in bench/peers/
  std::string given;  ///< --peer-script / --spec-peer-script
  std::string csv_name;
  std::string csv;                  ///< path beside the sweep's CSV
  std::vector<std::string> methods; ///< in the peer CSV's order
  PeerTable table;
};

/// The --peer-methods names meant for `kind`'s peer (spec_* for spec, the others for smc); "" when none was
/// given (the peer's defaults).
std::string peer_methods_for(const Options& o, const std::string& kind, bool& none_left) {
  none_left = false;
  if (o.peer_methods.empty())
    return "";
  std::string methods;
  for (const std::string& method : split_list(o.peer_methods)) {
    if ((method.rfind("spec_", 0) == 0) != (kind == "spec"))
      continue;
    methods += (methods.empty() ? "" : ",") + method;
  }
  none_left = methods.empty();
  return methods;
}

/// Runs the peer of every measured kind, prints smcgraph's ratios to them and rewrites the CSV with the peer
/// columns added. Returns false when a peer could not run or reported a failure or an invalid result.
bool run_peers(const Options& o, const char* argv0, const Environment& env, const std::string& manifest,
               const std::vector<Row>& results, bool run_smc, bool run_spec) {
  const std::filesystem::path csv_dir = std::filesystem::path(o.csv).parent_path();
  std::vector<PeerRun> peers;
  if (run_smc)
    peers.push_back({"smc", "smc_peer.py", o.peer_script, kPeerCsvName, "", {}, {}});
  if (run_spec)
    peers.push_back({"spec", "spec_peer.py", o.spec_peer_script, kSpecPeerCsvName, "", {}, {}});
  const std::string probe =
      o.python + " -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'";
  if (run_command(probe + " >/dev/null 2>&1") != 0) {
    std::printf("\npeers: skipped (%s with a CUDA-enabled torch is not available)\n", o.python.c_str());
    return false;
  }
  bool all_ok = true, any_rows = false;
  for (PeerRun& peer : peers) {
    const std::string script = find_peer_script(peer.given, peer.script.c_str(), argv0);
    if (script.empty()) {
      std::printf("\npeers: %s skipped (bench/peers/%s not found; run from the repository root or pass "
                  "--%speer-script)\n",
                  peer.kind.c_str(), peer.script.c_str(), peer.kind == "spec" ? "spec-" : "");
      all_ok = false;
      continue;
    }
    bool none_left = false;
    const std::string methods = peer_methods_for(o, peer.kind, none_left);
    if (none_left) {
      std::printf("\npeers: %s skipped (--peer-methods names none of its methods)\n", peer.kind.c_str());
      continue;
    }
    peer.csv = (csv_dir / peer.csv_name).string();
    std::error_code ignored;
    std::filesystem::remove(peer.csv, ignored); // never compare with an earlier run's rows
    std::string command = o.python + " " + shell_quote(script) + " --manifest " + shell_quote(manifest) +
                          " --csv " + shell_quote(peer.csv);
    if (!methods.empty())
      command += " --methods " + shell_quote(methods);
    std::printf("\npeers: %s\n", command.c_str());
    const int status = run_command(command);
    if (status != 0) {
      std::printf("peers: the peer exited with status %d; comparing what it wrote\n", status);
      all_ok = false;
    }
    peer.table = read_peer_csv(peer.csv, peer.methods);
    if (peer.table.empty()) {
      std::printf("peers: no rows in %s\n", peer.csv.c_str());
      all_ok = false;
    }
    any_rows = any_rows || !peer.table.empty();
  }
  if (!any_rows)
    return false;

  const auto peer_of = [&](const std::string& kind) -> const PeerRun* {
    for (const PeerRun& peer : peers)
      if (peer.kind == kind && !peer.table.empty())
        return &peer;
    return nullptr;
  };
  const auto find_result = [&](const Row& row) -> const std::map<std::string, PeerResult>* {
    const PeerRun* peer = peer_of(row.kind);
    if (peer == nullptr)
      return nullptr;
    const auto it =
        peer->table.find({row.requests, row.particles, row.steps, row.vocab, dtype_name(row.dtype)});
    return it == peer->table.end() ? nullptr : &it->second;
  };

  if (peer_of("smc") != nullptr) {
    std::printf(
        "\nsmcgraph (graph replay, GPU time per cycle) vs the PyTorch peer in this run; ratio = peer time / "
        "smcgraph time (> 1: smcgraph faster); nonmodel = cycle - the implementation's own model forwards\n");
    std::printf("%7s %5s %2s %2s %8s %10s %10s  %-20s %10s %7s %10s %7s\n", "vocab", "dtype", "N", "K",
                "requests", "smcg_us", "smcg_nm", "peer", "peer_us", "ratio", "peer_nm", "nm_rat");
    for (const Row& row : results) {
      if (row.kind != "smc")
        continue;
      const auto* found = find_result(row);
      if (found == nullptr)
        continue;
      for (const auto& [method, peer] : *found) {
        const double peer_nonmodel = peer.cycle_us - peer.model_us;
        std::printf("%7d %5s %2d %2d %8d %10s %10s  %-20s %10s %6sx %10s %6sx%s\n", row.vocab,
                    dtype_name(row.dtype), row.particles, row.steps, row.requests,
                    format(row.graph.median_us, 1).c_str(), format(row.nonmodel_us, 1).c_str(),
                    method.c_str(), format(peer.cycle_us, 1).c_str(),
                    format(peer.cycle_us / row.graph.median_us, 2).c_str(), format(peer_nonmodel, 1).c_str(),
                    format(peer_nonmodel / row.nonmodel_us, 2).c_str(), peer.valid ? "" : "  (peer INVALID)");
      }
    }
  }
  if (peer_of("spec") != nullptr) {
    std::printf("\nsmcgraph spec (greedy speculative decoding, graph replay) vs its PyTorch peer in this "
                "run; tps_rat = smcgraph tokens/s / peer tokens/s (> 1: smcgraph faster; tok/c = tokens "
                "per row and cycle, accepted + 1, each side's own); cyc_rat = peer time / smcgraph time "
                "per cycle; nonmodel as above\n");
    std::printf("%7s %5s %2s %8s %10s %6s %10s  %-24s %10s %6s %10s %7s %7s %10s %7s\n", "vocab", "dtype",
                "K", "requests", "smcg_us", "tok/c", "smcg_tok/s", "peer", "peer_us", "tok/c", "peer_tok/s",
                "tps_rat", "cyc_rat", "peer_nm", "nm_rat");
    for (const Row& row : results) {
      if (row.kind != "spec")
        continue;
      const auto* found = find_result(row);
      if (found == nullptr)
        continue;
      for (const auto& [method, peer] : *found) {
        const double peer_nonmodel = peer.cycle_us - peer.model_us;
        std::printf("%7d %5s %2d %8d %10s %6s %10s  %-24s %10s %6s %10s %6sx %6sx %10s %6sx%s\n", row.vocab,
                    dtype_name(row.dtype), row.steps, row.requests, format(row.graph.median_us, 1).c_str(),
                    format(row.tokens_per_cycle, 2).c_str(), format(row.tokens_per_s, 0).c_str(),
                    method.c_str(), format(peer.cycle_us, 1).c_str(),
                    format(peer.tokens_per_cycle, 2).c_str(), format(peer.tokens_per_s, 0).c_str(),
                    format(row.tokens_per_s / peer.tokens_per_s, 2).c_str(),
                    format(peer.cycle_us / row.graph.median_us, 2).c_str(), format(peer_nonmodel, 1).c_str(),
                    format(peer_nonmodel / row.nonmodel_us, 2).c_str(), peer.valid ? "" : "  (peer INVALID)");
      }
    }
  }

  // The CSV again, with per-method peer columns (smc methods first); a row has values only for its kind's
  // peer. Spec methods add their tokens/s and smcgraph's tokens/s over it (their tokens per cycle may
  // differ).
  std::vector<std::string> header = kCsvColumns;
  std::vector<std::pair<std::string, std::string>> columns; // (kind, method)
  for (const PeerRun& peer : peers) {
    for (const std::string& method : peer.methods) {
      columns.emplace_back(peer.kind, method);
      header.push_back(method + "_us");
      header.push_back(method + "_over_graph");
      header.push_back(method + "_nonmodel_us");
      header.push_back(method + "_nonmodel_over_smcgraph");
      if (peer.kind == "spec") {
        header.push_back(method + "_tokens_per_s");
        header.push_back(method + "_tokens_per_s_smcgraph_over_peer");
      }
    }
  }
  bench::Csv csv(o.csv);
  csv.row(header);
  bool peer_valid = true;
  for (const Row& row : results) {
    std::vector<std::string> cells = csv_cells(env, row);
    const auto* found = find_result(row);
    for (const auto& [kind, method] : columns) {
      PeerResult peer;
      if (kind == row.kind && found != nullptr && found->count(method))
        peer = found->at(method);
      peer_valid = peer_valid && peer.valid;
      const double peer_nonmodel = peer.cycle_us - peer.model_us;
      cells.push_back(format(peer.cycle_us, 2));
      cells.push_back(format(peer.cycle_us / row.graph.median_us, 3));
      cells.push_back(format(peer_nonmodel, 2));
      cells.push_back(format(peer_nonmodel / row.nonmodel_us, 3));
      if (kind == "spec") {
        cells.push_back(format(peer.tokens_per_s, 0));
        cells.push_back(format(row.tokens_per_s / peer.tokens_per_s, 3));
      }
    }
    csv.row(cells);
  }
  std::string peer_csvs;
  for (const PeerRun& peer : peers)
    if (!peer.csv.empty())
      peer_csvs += (peer_csvs.empty() ? "" : ", ") + peer.csv;
  std::printf("peers: columns added to %s (peer CSV%s: %s)\n", o.csv.c_str(), peers.size() > 1 ? "s" : "",
              peer_csvs.c_str());
  return all_ok && peer_valid;
}

void run_plots(const Options& o, const char* argv0, bool run_smc, bool run_spec) {
  const std::string script = find_peer_script(o.plot_script, "plot_sweep.py", argv0);
  if (script.empty()) {
    std::printf("\nplots: skipped (bench/peers/plot_sweep.py not found; pass --plot-script)\n");
    return;
  }
  const std::filesystem::path csv_dir = std::filesystem::path(o.csv).parent_path();
  const std::string out_dir = (csv_dir / "plots").string();
  std::string command = o.python + " " + shell_quote(script) + " --sweep " + shell_quote(o.csv) + " --out " +
                        shell_quote(out_dir);
  for (const auto& [measured, name] : {std::pair<bool, const char*>{run_smc, kPeerCsvName},
                                       std::pair<bool, const char*>{run_spec, kSpecPeerCsvName}}) {
    const std::string peer_csv = (csv_dir / name).string();
    if (o.peers && measured && std::filesystem::exists(peer_csv))
      command += " --peer " + shell_quote(peer_csv);
  }
  std::printf("\nplots: %s\n", command.c_str());
  const int status = run_command(command);
  if (status != 0)
    std::printf("plots: the plot script exited with status %d\n", status);
}

// ---------------------------------------------------------------------------------------------------------
// Peers of the real model (bench/peers/llama_peer.py)

/// smcgraph's greedy continuation of each prompt: the speculative cycle with T_d = T_t = 0, which equals
/// greedy target-only decoding; the peers reproduce it before they time anything.
std::vector<std::vector<int32_t>> real_greedy_tokens(const ModelPair& models, const SweepConstants& k,
                                                     int max_new_tokens, int steps) {
  EngineConfig config;
  config.kind = CycleKind::kSpeculative;
  config.vocab = kRealVocab;
  config.particles = 1;
  config.draft_steps = steps;
  config.max_requests = static_cast<int>(g_real_prompts.size());
  config.max_seq_len = k.max_seq_len;
  config.slot_pool_size = k.pool_size;
  config.draft_temperature = 0.0f;
  config.target_temperature = 0.0f;
  Engine engine(config, *models.draft, *models.target);
  std::vector<RequestId> ids;
  for (size_t q = 0; q < g_real_prompts.size(); ++q)
    ids.push_back(engine.admit(g_real_prompts[q], {.seed = q, .max_new_tokens = max_new_tokens}));
  std::set<RequestId> finished;
  for (int cycle = 0; finished.size() < ids.size(); ++cycle) {
    require(cycle < 100000, "bucket_sweep", "greedy validation cycles", cycle, "did not finish");
    engine.step();
    std::vector<RequestUpdate> updates;
    drain(engine, updates);
    for (const RequestUpdate& update : updates) {
      if (update.failed)
        throw Error("bucket_sweep: greedy validation request failed: " + update.reason);
      if (update.finished)
        finished.insert(update.id);
    }
  }
  std::vector<std::vector<int32_t>> tokens;
  for (const RequestId id : ids) {
    tokens.push_back(engine.result(id).tokens);
    engine.release(id);
  }
  return tokens;
}

/// Writes the peer manifest, runs bench/peers/llama_peer.py and prints smcgraph's tokens/s over each peer
/// method's at the same (kind, requests, N, K). Returns false when the peer could not run or was invalid.
bool run_real_peers(const Options& o, const char* argv0, const Environment& env,
                    const std::string& model_path, const std::vector<Row>& results,
                    const std::vector<std::vector<int32_t>>& greedy) {
  const std::filesystem::path csv_dir = std::filesystem::path(o.csv).parent_path();
  const std::string manifest = (csv_dir / "llama_peer.json").string();
  const std::string peer_csv = (csv_dir / "llama_peer.csv").string();
  {
    // The format bench/peers/llama_peer.py reads (its header documents it).
    std::ostringstream j;
    const EngineConfig defaults;
    j << "{\n  \"format\": \"smcgraph-llama-peer-1\",\n  \"device\": " << json_string(env.device) << ",\n";
    j << "  \"model\": " << json_string(std::filesystem::absolute(model_path).string()) << ",\n";
    j << "  \"draft_layers\": [" << join_ints(parse_llama_layers(o.draft_layers), ", ") << "],\n";
    j << "  \"logits_dtype\": \"bf16\",\n  \"eos_id\": -1,\n";
    j << "  \"prompts\": [";
    for (size_t p = 0; p < g_real_prompts.size(); ++p)
      j << (p ? ", " : "") << json_int_array(g_real_prompts[p]);
    j << "],\n  \"greedy\": {\"new_tokens\": " << kRealGreedyTokens << ", \"tokens\": [";
    for (size_t p = 0; p < greedy.size(); ++p)
      j << (p ? ", " : "") << json_int_array(greedy[p]);
    j << "]},\n";
    j << "  \"generate\": {\"requests\": [" << join_ints(o.requests, ", ") << "], \"new_tokens\": 128},\n";
    const bool with_spec = std::find(o.kinds.begin(), o.kinds.end(), "spec") != o.kinds.end();
    const bool with_smc = std::find(o.kinds.begin(), o.kinds.end(), "smc") != o.kinds.end();
    if (with_spec)
      j << "  \"spec\": {\"steps\": [" << join_ints(o.steps, ", ") << "], \"requests\": ["
        << join_ints(o.requests, ", ") << "], \"cycles\": " << o.cycles
        << ", \"warmup_cycles\": " << kWarmupCycles << ", \"new_tokens\": 128},\n";
    if (with_smc)
      j << "  \"smc\": {\"particles\": [" << join_ints(o.particles, ", ") << "], \"steps\": ["
        << join_ints(o.steps, ", ") << "], \"requests\": [" << join_ints(o.requests, ", ")
        << "], \"cycles\": " << o.cycles << ", \"warmup_cycles\": " << kWarmupCycles
        << ", \"draft_temperature\": " << float_text(defaults.draft_temperature)
        << ", \"target_temperature\": " << float_text(defaults.target_temperature)
        << ", \"alpha\": " << float_text(defaults.alpha) << ", \"tau\": " << float_text(defaults.tau)
        << "},\n";
    j << "  \"requests\": [" << join_ints(o.requests, ", ") << "]\n}\n";
    std::ofstream out(manifest, std::ios::trunc);
    out << j.str();
    if (!out)
      throw Error("bucket_sweep: writing " + manifest + " failed");
  }
  const std::string script = find_peer_script("", "llama_peer.py", argv0);
  if (script.empty()) {
    std::printf("\npeers: skipped (bench/peers/llama_peer.py not found; run from the repository root)\n");
    return false;
  }
  std::error_code ignored;
  std::filesystem::remove(peer_csv, ignored);
  std::string command = o.python + " " + shell_quote(script) + " --manifest " + shell_quote(manifest) +
                        " --csv " + shell_quote(peer_csv);
  if (!o.peer_methods.empty())
    command += " --methods " + shell_quote(o.peer_methods);
  std::printf("\npeers: %s\n", command.c_str());
  std::fflush(stdout);
  bool ok = run_command(command) == 0;
  // The peer CSV: method,kind,requests,particles,steps,tokens_per_s,cycle_us,valid (one row per point).
  std::ifstream in(peer_csv);
  std::string line;
  std::vector<std::string> header;
  if (!std::getline(in, line)) {
    std::printf("peers: no rows in %s\n", peer_csv.c_str());
    return false;
  }
  header = split_csv_line(line);
  const auto column = [&](const char* name) {
    return static_cast<int>(std::find(header.begin(), header.end(), name) - header.begin());
  };
  const int c_method = column("method"), c_requests = column("requests"), c_particles = column("particles"),
            c_steps = column("steps"), c_tps = column("tokens_per_s"), c_valid = column("valid");
  std::printf(
      "\nsmcgraph (graph replay) vs the real-model peers in this run: ratio = smcgraph request tokens/s "
      "/ peer tokens/s at the same kind, requests, N, K (> 1: smcgraph faster)\n");
  std::printf("%-26s %5s %8s %2s %2s %12s %12s %8s\n", "peer", "kind", "requests", "N", "K", "peer_tok/s",
              "smcg_tok/s", "ratio");
  while (std::getline(in, line)) {
    const std::vector<std::string> cells = split_csv_line(line);
    if (cells.size() < header.size())
      continue;
    // The method names say the kind: hf_generate_greedy is plain greedy decoding, *smc* the SMC cycle, the
    // rest (hf_assisted, torch_spec_*) greedy speculative decoding.
    const std::string& method = cells[c_method];
    const std::string kind = method.find("smc") != std::string::npos ? "smc"
                             : method.rfind("hf_generate", 0) == 0   ? "greedy"
                                                                     : "spec";
    const int requests = std::atoi(cells[c_requests].c_str());
    const int particles = std::atoi(cells[c_particles].c_str()), steps = std::atoi(cells[c_steps].c_str());
    const double peer_tps = std::atof(cells[c_tps].c_str());
    const bool valid = cells[c_valid] == "1" || cells[c_valid] == "True" || cells[c_valid] == "true";
    ok = ok && valid;
    // A greedy (non-speculative) peer compares with smcgraph's spec row (greedy) of the same requests.
    double smcgraph_tps = NAN;
    for (const Row& row : results) {
      const bool same_kind = row.kind == kind || (kind == "greedy" && row.kind == "spec");
      if (same_kind && row.requests == requests && (kind != "smc" || row.particles == particles) &&
          (steps == 0 || row.steps == steps) && row.dtype == DType::kBFloat16)
        smcgraph_tps = std::isnan(smcgraph_tps) ? row.tokens_per_s : std::max(smcgraph_tps, row.tokens_per_s);
    }
    std::printf("%-26s %5s %8d %2d %2d %12s %12s %7sx%s\n", cells[c_method].c_str(), kind.c_str(), requests,
                particles, steps, format(peer_tps, 1).c_str(), format(smcgraph_tps, 0).c_str(),
                format(smcgraph_tps / peer_tps, 1).c_str(), valid ? "" : "  (peer INVALID)");
  }
  std::fflush(stdout);
  return ok;
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
  const int longest = kPromptLength + 1 + (kWarmupCycles + o.cycles + 2) * (max_steps + 1);
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
      o.cycles, kWarmupCycles, kPromptLength, constants.engine_defaults.draft_temperature,
      constants.engine_defaults.target_temperature, constants.engine_defaults.alpha,
      constants.engine_defaults.tau);
  if (real)
    std::printf("real model pair (below)");
  else
    std::printf("toy models hidden %d, window %d, draft perturbation %.2f", kToyHidden, kToyWindow,
                o.draft_perturbation);
  std::printf("; max_seq_len %d, slot pool %d\n", constants.max_seq_len, constants.pool_size);
  std::printf(
      "graph/eager = median GPU time per cycle; host = host time per step(); model = draft head + "
      "(K-1) draft steps + verify timed alone; nonmodel = graph - model (it can be slightly negative "
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
  std::vector<int> draft_layers;
  std::vector<std::vector<int32_t>> real_greedy; // smcgraph's greedy continuations (peer validation)
  if (real) {
    gguf = std::make_unique<GgufFile>(GgufFile::open(model_path));
    llama_weights = load_llama_weights(*gguf);
    const Tokenizer tokenizer = Tokenizer::from_gguf(*gguf);
    for (const char* question : kRealPrompts) {
      std::vector<int32_t> ids = tokenizer.encode(tokenizer.apply_chat_template({{"user", question}}, true));
      if (ids.size() > static_cast<size_t>(kPromptLength))
        ids.erase(ids.begin(), ids.end() - kPromptLength);
      while (ids.size() <
             static_cast<size_t>(kPromptLength)) // pad at the front with the system prompt's start
        ids.insert(ids.begin(), tokenizer.bos_id());
      g_real_prompts.push_back(std::move(ids));
    }
    draft_layers = parse_llama_layers(o.draft_layers);
    std::printf(
        "model: SmolLM2-135M-Instruct (%s), %d layers; draft: layers %s (%zu); timing prompts: the last %d "
        "tokens of %zu chat prompts\n",
        model_path.c_str(), llama_weights->config().layers, o.draft_layers.c_str(), draft_layers.size(),
        kPromptLength, g_real_prompts.size());
  }

  for (const int vocab : vocabs) {
    for (const DType dtype : o.dtypes) {
      if (engine_kinds.empty())
        break;
      // The pair of this (V, dtype): the real models (weights shared, loaded once) or the toy pair.
      std::unique_ptr<LlamaModel> llama_target, llama_draft;
      ToyModelPair toy_models;
      ModelPair models;
      if (real) {
        LlamaModelOptions options;
        options.pool_size = constants.pool_size;
        options.max_seq_len = constants.max_seq_len;
        options.max_tokens_per_forward =
            std::max(128, o.requests.back() * std::max(max_particles, kValidationPrompts) * (max_steps + 1));
        options.logits_dtype = dtype;
        llama_target = std::make_unique<LlamaModel>(llama_weights, options);
        options.layers = draft_layers;
        llama_draft = std::make_unique<LlamaModel>(llama_weights, options);
        models = ModelPair{llama_draft.get(), llama_target.get(), true};
        models.draft_weight_bytes = llama_draft->weight_bytes_per_forward();
        models.target_weight_bytes = llama_target->weight_bytes_per_forward();
        const LlamaConfig& c = llama_target->config();
        const size_t kv_token_layer = size_t{2} * c.kv_heads * c.head_dim * sizeof(uint16_t);
        models.draft_kv_bytes_per_token = kv_token_layer * llama_draft->layers().size();
        models.target_kv_bytes_per_token = kv_token_layer * llama_target->layers().size();
        if (o.peers && real_greedy.empty()) {
          progress.update(done, "greedy validation tokens for the peers");
          real_greedy = real_greedy_tokens(models, constants, kRealGreedyTokens, o.steps.front());
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
        models = ModelPair{toy_models.draft.get(), toy_models.target.get()};
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
            records.push_back(run_validation_engine(models, kind, vocab, dtype, o.particles.front(),
                                                    o.steps.front(), constants));
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
          try {
            sweep_engine(ctx, models, kind, vocab, dtype, particles, steps, results);
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

// ---------------------------------------------------------------------------------------------------------
// Command line

void print_usage() {
  std::printf(
      "usage: bucket_sweep [options]\n"
      "  --quick               a small subset: requests {1, 8, 64} x N {4} x K {4} x V {32000} x {fp32, "
      "bf16},\n"
      "                        20 cycles per phase\n"
      "  --requests LIST       request-slot buckets, e.g. 1,2,4,8,16,32,64 (the largest is max_requests)\n"
      "  --particles LIST      N values (default 4,8)\n"
      "  --steps LIST          K values (default 4,8)\n"
      "  --vocabs LIST         V values (default 32000,128256)\n"
      "  --dtypes LIST         logits dtypes, fp32 and/or bf16 (default fp32,bf16)\n"
      "  --kinds LIST          cycle kinds, smc and/or spec (default both; spec runs with N = 1 and is "
      "reported as\n"
      "                        pending when the engine rejects kSpeculative)\n"
      "  --cycles C            timed cycles per phase (default 30)\n"
      "  --perturbation P      draft head perturbation of the toy pair (default 0.3)\n"
      "  --csv PATH            CSV output (default results/bucket_sweep.csv); the peer files go beside it\n"
      "  --peers               run the PyTorch peers afterwards (same grid, same weights): "
      "bench/peers/smc_peer.py\n"
      "                        for smc, bench/peers/spec_peer.py for spec; print the ratios and add "
      "per-method peer\n"
      "                        columns to the CSV\n"
      "  --peer-methods LIST   methods for the peers (default: all of "
      "torch_eager,torch_graph_draft,torch_graph_cycle\n"
      "                        for smc and spec_torch_eager,spec_torch_graph_draft for spec; spec_* names go "
      "to the\n"
      "                        spec peer, the others to the smc peer)\n"
      "  --plots               run bench/peers/plot_sweep.py afterwards (PNGs in <csv dir>/plots)\n"
      "  --python PYTHON       interpreter for --peers / --plots (default python3)\n"
      "  --peer-script PATH    default: bench/peers/smc_peer.py found from the cwd or the executable\n"
      "  --spec-peer-script PATH  default: bench/peers/spec_peer.py found likewise\n"
      "  --plot-script PATH    default: bench/peers/plot_sweep.py found likewise\n"
      "  --no-progress         no progress line on stderr\n"
      "  --model toy|smollm2   the embedded toy pair (default) or the real pair SmolLM2-135M-Instruct from "
      "its\n"
      "                        GGUF file (./run fetch-model); smollm2 has one vocabulary (49152), adds the "
      "HBM\n"
      "                        roofline columns and runs bench/peers/llama_peer.py with --peers\n"
      "  --model-path PATH     the GGUF file (default $SMCGRAPH_MODEL_PATH or .cache/models/ found from the "
      "cwd)\n"
      "  --draft-layers LIST   layers of the real model's draft, e.g. 0-27 (default) or 0-11,18-29\n"
      "exit status: 0; 1 a validation failed; 2 could not run; 3 a peer failed or reported invalid "
      "results\n");
}

bool parse_int_list(const std::string& text, std::vector<int>& out) {
  out.clear();
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (item.empty())
      continue;
    char* end = nullptr;
    const long value = std::strtol(item.c_str(), &end, 10);
    if (*end != '\0' || value < 1 || value > 1 << 20)
      return false;
    out.push_back(static_cast<int>(value));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return !out.empty();
}

/// Returns -1 to go on, else the exit status.
int parse_options(int argc, char** argv, Options& o) {
  bool explicit_lists[6] = {false, false, false, false, false, false};
  bool explicit_cycles = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bucket_sweep: %s needs a value\n", arg.c_str());
        return nullptr;
      }
      return argv[++i];
    };
    const auto bad = [&](const char* text) {
      std::fprintf(stderr, "bucket_sweep: bad value for %s: '%s'\n", arg.c_str(), text);
      return 2;
    };
    if (arg == "--help" || arg == "-h") {
      print_usage();
      return 0;
    } else if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--peers") {
      o.peers = true;
    } else if (arg == "--plots") {
      o.plots = true;
    } else if (arg == "--no-progress") {
      o.progress = false;
    } else if (arg == "--requests" || arg == "--particles" || arg == "--steps" || arg == "--vocabs") {
      const char* text = value();
      if (!text)
        return 2;
      const int which = arg == "--requests" ? 0 : arg == "--particles" ? 1 : arg == "--steps" ? 2 : 3;
      std::vector<int>& list = which == 0   ? o.requests
                               : which == 1 ? o.particles
                               : which == 2 ? o.steps
                                            : o.vocabs;
      if (!parse_int_list(text, list))
        return bad(text);
      explicit_lists[which] = true;
    } else if (arg == "--dtypes") {
      const char* text = value();
      if (!text)
        return 2;
      o.dtypes.clear();
      for (const std::string& name : split_list(text)) {
        if (name == "fp32")
          o.dtypes.push_back(DType::kFloat32);
        else if (name == "bf16")
          o.dtypes.push_back(DType::kBFloat16);
        else
          return bad(text);
      }
      if (o.dtypes.empty())
        return bad(text);
      explicit_lists[4] = true;
    } else if (arg == "--kinds") {
      const char* text = value();
      if (!text)
        return 2;
      o.kinds = split_list(text);
      for (const std::string& kind : o.kinds)
        if (kind != "smc" && kind != "spec")
          return bad(text);
      if (o.kinds.empty())
        return bad(text);
      explicit_lists[5] = true;
    } else if (arg == "--cycles") {
      const char* text = value();
      if (!text)
        return 2;
      o.cycles = std::atoi(text);
      if (o.cycles < 1 || o.cycles > 10000)
        return bad(text);
      explicit_cycles = true;
    } else if (arg == "--perturbation") {
      const char* text = value();
      if (!text)
        return 2;
      char* end = nullptr;
      o.draft_perturbation = std::strtof(text, &end);
      if (*end != '\0' || !(o.draft_perturbation >= 0.0f) || !std::isfinite(o.draft_perturbation))
        return bad(text);
    } else if (arg == "--model") {
      const char* text = value();
      if (!text)
        return 2;
      o.model = text;
      if (o.model != "toy" && o.model != "smollm2")
        return bad(text);
    } else if (arg == "--model-path" || arg == "--draft-layers") {
      const char* text = value();
      if (!text)
        return 2;
      (arg == "--model-path" ? o.model_path : o.draft_layers) = text;
    } else if (arg == "--csv" || arg == "--python" || arg == "--peer-script" || arg == "--spec-peer-script" ||
               arg == "--plot-script" || arg == "--peer-methods") {
      const char* text = value();
      if (!text)
        return 2;
      (arg == "--csv"                ? o.csv
       : arg == "--python"           ? o.python
       : arg == "--peer-script"      ? o.peer_script
       : arg == "--spec-peer-script" ? o.spec_peer_script
       : arg == "--plot-script"      ? o.plot_script
                                     : o.peer_methods) = text;
    } else {
      std::fprintf(stderr, "bucket_sweep: unknown argument '%s' (see --help)\n", arg.c_str());
      return 2;
    }
  }
  if (o.quick) { // explicit lists win over --quick
    if (!explicit_lists[0])
      o.requests = {1, 8, 64};
    if (!explicit_lists[1])
      o.particles = {4};
    if (!explicit_lists[2])
      o.steps = {4};
    if (!explicit_lists[3])
      o.vocabs = {32000};
    if (!explicit_cycles)
      o.cycles = 20;
  }
  return -1;
}

} // namespace

int main(int argc, char** argv) {
  Options options;
  const int status = parse_options(argc, argv, options);
  if (status >= 0)
    return status;
  try {
    return run(options, argv[0]);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "\nbucket_sweep: %s\n", error.what());
    return 2;
  }
}
