// The pieces of bucket_sweep (bench/bucket_sweep.cpp, whose header describes the sweep) share these: the
// run's constants, the options, the model pair, the result rows and the functions one piece calls in another.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cli.hpp"
#include "smollm2_drafts.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/toy_model.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::sweep {

// ---------------------------------------------------------------------------------------------------------
// The run's constants, the options and the model pair

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

// The real model pair (--model smollm2): its vocabulary (its timing prompts: examples/chat_prompts.hpp).
constexpr int kRealVocab = 49152;
constexpr int kRealGreedyTokens = 64; // greedy tokens per prompt the peers must reproduce

struct Options {
  std::vector<std::string> kinds{"smc", "spec"};
  std::vector<int> requests{1, 2, 4, 8, 16, 32, 64};
  std::vector<int> particles{4, 8};
  std::vector<int> steps{4, 8};
  std::vector<int> vocabs{32000, 128256};
  std::vector<DType> dtypes{DType::kFloat32, DType::kBFloat16};
  int cycles = 30;
  /// --context N: tokens of every timed prompt (default kPromptLength); the real model's are multi-turn chats
  /// of the built-in questions cut to their last N tokens. Not with --peers (their prompts are
  /// kPromptLength).
  int context = kPromptLength;
  float draft_perturbation = 0.3f;
  std::string csv = "results/bucket_sweep.csv";
  bool quick = false, peers = false, plots = false, progress = true;
  bool stages = false;   ///< --stages: per-stage GPU time of a cycle (Engine::profile_step())
  bool adaptive = false; ///< --adaptive: speculative engines choose each request's K on the device
  /// --draft-cost C: AdaptiveDraftSteps::draft_cost of the adaptive engines; < 0 (default): measured (one
  /// draft forward over the target verify forward, timed alone at the smallest bucket); 0: the seed's rule
  float draft_cost = -1.0f;
  /// --min-steps M: AdaptiveDraftSteps::min_steps of the adaptive engines (default 1); 0 lets a request draft
  /// nothing in a cycle and needs the real pair (its draft then shares the target's KV)
  int min_steps = 1;
  std::string python = "python3";
  std::string peer_script, spec_peer_script, plot_script; // empty: found from the cwd or the executable
  std::string peer_methods;  // empty: each peer's default methods; spec_* names go to spec_peer.py
  std::string model = "toy"; ///< toy: the embedded pair; smollm2: the real pair from its GGUF file
  std::string model_path;    ///< empty: $SMCGRAPH_MODEL_PATH or .cache/models/ found from the cwd
  /// The real model's draft for both kinds (--draft-layers); empty: each kind's default (draft_layers_for()).
  std::string draft_layers;
};

using examples::kSmcDraftLayers; // the real model's default drafts (examples/smollm2_drafts.hpp)
using examples::kSpecDraftLayers;

/// The draft layer list (or "ngram") a kind runs: --draft-layers, else the kind's default.
inline std::string draft_layers_for(const Options& o, CycleKind kind) {
  if (!o.draft_layers.empty())
    return o.draft_layers;
  return kind == CycleKind::kSmc ? kSmcDraftLayers : kSpecDraftLayers;
}

/// A draft and a target (the toy pair or the real one) plus what the roofline needs of the real one.
struct ModelPair {
  Model* draft = nullptr;
  Model* target = nullptr;
  bool real = false;
  size_t draft_weight_bytes = 0, target_weight_bytes = 0; ///< bytes one forward must read at least
  size_t draft_kv_bytes_per_token = 0, target_kv_bytes_per_token = 0;
};

/// Chat prompts of the real model (their last kPromptLength tokens); empty for the toy pair.
extern std::vector<std::vector<int32_t>> g_real_prompts; // defined in bucket_sweep.cpp

// ---------------------------------------------------------------------------------------------------------
// Results

struct Summary {
  double median_us = NAN, p90_us = NAN;
};

struct ModelTiming {
  double head_us = NAN, step_us = NAN, verify_us = NAN, cycle_us = NAN;
  /// Real model: the floor of those forwards (ForwardBench::model_floor_us: weights and KV bytes over copy
  /// bandwidth plus graph nodes x node floor).
  double floor_us = NAN;
};

struct Row {
  std::string kind;
  int vocab = 0;
  DType dtype = DType::kFloat32;
  int particles = 0, steps = 0, requests = 0, rows = 0;
  Summary graph, eager;
  double host_step_us = NAN, eager_host_step_us = NAN;
  double bare_launch_us =
      NAN; ///< the driver's cudaGraphLaunch of a graph of the cycle's nodes, beside step()
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
  /// smc: log Z-hat per generated token of the requests timed (their warm-up and timed cycles): 0 for an
  /// exact sampler, more negative the further the particles fall short of the target
  double log_z_per_token = NAN;
  double mean_draft_steps = NAN; ///< spec: mean K of the timed cycles' request updates
  /// spec: accepted draft tokens per drafted token (sum accepted / sum K over the timed request updates): a
  /// request's draft forwards per cycle are its K (the head and K - 1 steps)
  double accepted_per_draft = NAN;
  bool valid = true;
  std::string problem;
};

struct Environment {
  std::string device;
  double copy_gbs = NAN;
  double node_floor_us = NAN;
};

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

// ---------------------------------------------------------------------------------------------------------
// Defined in bench/bucket_sweep.cpp: engine driving and the CSV rows

void drain(Engine& engine, std::vector<RequestUpdate>& updates);
extern const std::vector<std::string> kCsvColumns;
std::vector<std::string> csv_cells(const Environment& env, const Row& row);

// ---------------------------------------------------------------------------------------------------------
// Defined in bench/sweep/options.cpp: the command line

/// Returns -1 to go on, else the exit status.
int parse_options(int argc, char** argv, Options& o);
using cli::split_list; // examples/cli.hpp

// ---------------------------------------------------------------------------------------------------------
// Defined in bench/sweep/manifest.cpp: the peer files and the JSON text they are made of

std::string join_ints(const std::vector<int>& values, const char* separator = ",");
/// The draft lengths the SMC cycle runs: `steps` without K = 0 (no draft is the speculative cycle's only; the
/// sweep skips it for SMC), as the peer manifests list them.
std::vector<int> smc_steps(const std::vector<int>& steps);
std::string float_text(float value);
std::string json_string(const std::string& text);
std::string json_int_array(const std::vector<int32_t>& values);
void write_toy_weights(const std::string& path, const ToyModelConfig& toy, float draft_perturbation,
                       const EngineConfig& engine_config);
void write_manifest(const std::string& path, const Options& o, const Environment& env,
                    const SweepConstants& k, const std::map<int, std::string>& weight_files,
                    const std::vector<ValidationRecord>& validation, bool with_smc, bool with_spec,
                    const std::vector<ValidationRecord>& spec_validation);

// ---------------------------------------------------------------------------------------------------------
// Defined in bench/sweep/peers.cpp: the PyTorch peers and the plots

bool run_peers(const Options& o, const char* argv0, const Environment& env, const std::string& manifest,
               const std::vector<Row>& results, bool run_smc, bool run_spec);
void run_plots(const Options& o, const char* argv0, bool run_smc, bool run_spec);
std::vector<std::vector<int32_t>> real_greedy_tokens(const ModelPair& models, const SweepConstants& k,
                                                     int max_new_tokens, int steps);
bool run_real_peers(const Options& o, const char* argv0, const Environment& env,
                    const std::string& model_path, const std::vector<Row>& results,
                    const std::vector<std::vector<int32_t>>& greedy);

} // namespace smcgraph::sweep
