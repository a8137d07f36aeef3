// LlamaWeights (the bf16 device copy) and LlamaModel::forward: the order of the fused kernels of
// llama_kernels.hpp, the activation workspace sized once at construction, nothing allocated per forward.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

#include "models/forward_layout.cuh"
#include "models/llama/llama_kernels.hpp"
#include "runtime/env.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/llama_model.hpp"

namespace smcgraph {
namespace {

template <class T> DeviceBuffer<T> upload(const std::vector<T>& host, cudaStream_t stream) {
  DeviceBuffer<T> buffer(host.size());
  buffer.copy_from_host(host.data(), host.size(), stream);
  return buffer;
}

} // namespace

LlamaWeights::LlamaWeights(const LlamaHostWeights& host) : config_(host.config) {
  const LlamaConfig& c = config_;
  require(static_cast<int>(host.layers.size()) == c.layers, "LlamaWeights", "layers.size()",
          host.layers.size(), "must equal config.layers");
  Stream stream;
  const size_t H = c.hidden, F = c.ffn, qd = size_t(c.heads) * c.head_dim,
               kvd = size_t(c.kv_heads) * c.head_dim;
  // The head's rows padded with zeros to a multiple of 64 (whole GEMM tiles); logits stop at vocab.
  vocab_padded_ = static_cast<int>((c.vocab + 63) / 64 * 64);
  std::vector<uint16_t> padded(static_cast<size_t>(vocab_padded_) * H, 0);
  std::copy(host.token_embd.begin(), host.token_embd.end(), padded.begin());
  token_embd_ = upload(padded, stream);
  stream.synchronize();
  if (!host.output.empty()) {
    std::copy(host.output.begin(), host.output.end(), padded.begin());
    output_ = upload(padded, stream);
    head_ = output_.data();
    stream.synchronize();
  }
  if (!host.head_q8.empty()) { // the int8 head's fragment order (LlamaWeights::head_q8)
    require(host.head_q8.size() == static_cast<size_t>(c.vocab) * H && H % 32 == 0 &&
                host.head_q8_scales.size() == host.head_q8.size() / 32,
            "LlamaWeights", "head_q8.size()", host.head_q8.size(),
            "must be vocab x hidden (hidden % 32 == 0)");
    std::vector<int8_t> q8;
    std::vector<float> scales;
    llama::q8_head_layout(host.head_q8.data(), host.head_q8_scales.data(), c.vocab, vocab_padded_, c.hidden,
                          q8, scales);
    head_q8_ = upload(q8, stream);
    head_q8_scales_ = upload(scales, stream);
    stream.synchronize();
  }
  output_norm_ = upload(host.output_norm, stream);
  std::vector<float> inv_freq(c.head_dim / 2);
  for (int i = 0; i < c.head_dim / 2; ++i)
    inv_freq[i] = static_cast<float>(std::pow(static_cast<double>(c.rope_base), -2.0 * i / c.head_dim));
  rope_inv_freq_ = upload(inv_freq, stream);

  // Every matrix of a layer in one buffer: qkv, o, gate/up (interleaved in groups of kGateUpGroup / 2), down.
  const size_t qkv_elems = (qd + 2 * kvd) * H, o_elems = H * qd, gate_up_elems = 2 * F * H,
               down_elems = H * F;
  std::vector<uint16_t> packed(qkv_elems + o_elems + gate_up_elems + down_elems);
  std::vector<float> norms(2 * H);
  layer_views_.resize(c.layers);
  constexpr int group = kGateUpGroup / 2;
  static_assert(group == llama::kSwiGluGroup, "the gate/up interleave and the SwiGLU epilogue must agree");
  for (int l = 0; l < c.layers; ++l) {
    const LlamaHostWeights::Layer& w = host.layers[l];
    uint16_t* out = packed.data();
    out = std::copy(w.q.begin(), w.q.end(), out);
    out = std::copy(w.k.begin(), w.k.end(), out);
    out = std::copy(w.v.begin(), w.v.end(), out);
    out = std::copy(w.o.begin(), w.o.end(), out);
    for (size_t g = 0; g < F / group; ++g) {
      out = std::copy(w.gate.begin() + g * group * H, w.gate.begin() + (g + 1) * group * H, out);
      out = std::copy(w.up.begin() + g * group * H, w.up.begin() + (g + 1) * group * H, out);
    }
    std::copy(w.down.begin(), w.down.end(), out);
    std::copy(w.attn_norm.begin(), w.attn_norm.end(), norms.begin());
    std::copy(w.ffn_norm.begin(), w.ffn_norm.end(), norms.begin() + H);
    matrices_.push_back(upload(packed, stream));
    norms_.push_back(upload(norms, stream));
    // The host vectors are reused: wait before the next layer overwrites them.
    stream.synchronize();
    const uint16_t* base = matrices_.back().data();
    layer_views_[l] =
        Layer{norms_.back().data(), norms_.back().data() + H,   base,
              base + qkv_elems,     base + qkv_elems + o_elems, base + qkv_elems + o_elems + gate_up_elems};
  }
  stream.synchronize();
}

size_t LlamaWeights::device_bytes() const {
  size_t bytes = token_embd_.bytes() + output_.bytes() + head_q8_.bytes() + head_q8_scales_.bytes() +
                 output_norm_.bytes() + rope_inv_freq_.bytes();
  for (const auto& m : matrices_)
    bytes += m.bytes();
  for (const auto& n : norms_)
    bytes += n.bytes();
  return bytes;
}

std::shared_ptr<const LlamaWeights> load_llama_weights(const GgufFile& file) {
  return std::make_shared<const LlamaWeights>(load_llama_host_weights(file));
}

struct LlamaModel::Workspace {
  DeviceBuffer<float> x;         // [T, hidden] residual stream
  DeviceBuffer<float> resumed_x; // [T, hidden]: a resumed verify's after the draft's layers (targets)
  DeviceBuffer<uint16_t> q, o, act, normed; // [T, q_dim], [T, q_dim], [T, ffn], [T, hidden] (the LM head's A)
  std::unique_ptr<llama::LtHead> head;      // the LM head (small head or cuBLASLt) where it serves the call
  // A prefill's layer GEMMs through cuBLASLt (forwards of at least prefill_gemm_tokens tokens a row) and
  // their fp32 scratch [min(T, kPrefillChunkTokens), max(q_dim + 2 kv_dim, 2 ffn)]; null / empty when off.
  std::unique_ptr<llama::PrefillGemms> prefill;
  DeviceBuffer<float> prefill_y;
  llama::AttentionGrouping attention_grouping = llama::AttentionGrouping::kBySize;
  llama::GemmTiles gemm_tiles = llama::GemmTiles::kBySize;
  uint8_t gemm_narrow_warps = 0;
  llama::GemmAStaging gemm_a_staging = llama::GemmAStaging::kRegisters;
  llama::GemmFragments gemm_fragments = llama::GemmFragments::kLdmatrix;
  // Split-KV attention (llama_attention.cu): the split states of up to kAttentionSplitMaxTokens tokens and
  // their tickets; empty where rows have one split (max_seq_len <= 512) or SMCGRAPH_ATTENTION_SPLIT=off.
  DeviceBuffer<float> attention_states;
  DeviceBuffer<uint32_t> attention_tickets;
  int attention_max_splits = 1;
  /// SMCGRAPH_LLAMA_TRIGGER, bits of the launches that trigger at their top: 1 attention, 2 O, 4 down (any
  /// subset of these three: early_attention, early_o, early_down, their pairs, early = all three); 8 QKV
  /// (early_all = 15: O then reads its residual after its wait); 16 gate/up (early_max = 31: down reads its
  /// residual after its wait as well). 0: after_wait. Default early_o_down (6).
  uint8_t early_trigger = 6;
  /// SMCGRAPH_LLAMA_WEIGHT_CACHE: the GEMMs and LM heads launch with their weights marked streaming in L2
  /// (streaming, the default; the cuBLASLt head through its stream's window) or not (normal);
  /// GemmArgs::stream_weights. A forward reads its weights once (SmolLM2: about 245 MB, five times an H200's
  /// L2), so unmarked they push out of L2 what the next kernels and the next forward reuse: the KV, the
  /// sampler's code and inputs, the cycle's small buffers. H200, graph us a cycle, normal -> streaming (two
  /// rounds each, alternating in one call): SMC N 8 K 4 at 1 request 2,069.4, 2,072.9 -> 2,018.8, 2,024.1
  /// (non-model 66.5, 68.8 -> 43.5, 48.6); no draft at 1 request 375.1, 375.1 -> 367.2, 367.8; speculative K
  /// 4 at 1 / 8 requests 1,763.5, 1,772.8 -> 1,719.8, 1,719.4 / 1,931.2, 1,928.1 -> 1,884.0, 1,878.6; SMC at
  /// 8 requests 4,384.1, 4,354.4 -> 4,353.2, 4,356.1.
  bool stream_weights = true;
};

namespace {

/// A kernel choice from an environment variable, for tests and A/B runs (the same bits either way): unset or
/// empty gives the first of `choices` (by_size); an unknown word throws, naming the variable and the word.
template <class Choice>
Choice choice_from_env(const char* name, std::initializer_list<std::pair<const char*, Choice>> choices) {
  return detail::env_choice("LlamaModel", name, choices);
}

/// An RMSNorm epilogue on pipelined tiles or through cuBLASLt (`cublaslt`: a long prefill) reads its A rows
/// normalised: rms_norm_rows(x) into `normed` ([T, hidden]; the LM head's A rows at the end of the forward),
/// which becomes the GEMM's a_bf16. The residual adds read their A rows as they are.
void normalize_rows_first(llama::GemmEpilogue epilogue, llama::GemmArgs& g, bool cublaslt, uint16_t* normed,
                          cudaStream_t stream) {
  if (epilogue == llama::GemmEpilogue::kResidualAdd || !(cublaslt || llama::pipelined_tiles(epilogue, g)))
    return;
  llama::rms_norm_rows(g.tokens, g.k, g.x, g.x_row_stride, g.norm_weight, g.eps, normed, stream);
  g.a_bf16 = normed;
}

} // namespace

LlamaModel::LlamaModel(std::shared_ptr<const LlamaWeights> weights, const LlamaModelOptions& options)
    : weights_(std::move(weights)), options_(options) {
  require(weights_ != nullptr, "LlamaModel", "weights", "null", "must be loaded weights");
  const LlamaConfig& c = weights_->config();
  validate_llama_options(c, options_);
  layers_ = options_.layers.empty() ? llama_layer_range(0, c.layers) : options_.layers;
  const size_t T = options_.max_tokens_per_forward;
  const size_t qd = size_t(c.heads) * c.head_dim, kvd = size_t(c.kv_heads) * c.head_dim;
  kv_elements_ = layers_.size() * options_.pool_size * 2 * kvd;
  if (const LlamaModel* owner = options_.kv_owner) {
    constexpr const char* kWhere = "LlamaModel";
    require(owner->weights_ == weights_, kWhere, "options.kv_owner", "other weights",
            "must be built from the same LlamaWeights");
    require(owner->options_.pool_size == options_.pool_size, kWhere, "options.kv_owner",
            owner->options_.pool_size, "must have the same pool_size");
    require(llama_layers_prefix(layers_, owner->layers_), kWhere, "options.layers", layers_.size(),
            "must be the first layers of options.kv_owner's (its KV is shared layer by layer)");
    kv_ = owner->kv_;
  } else {
    own_kv_ = DeviceBuffer<uint16_t>(kv_elements_);
    kv_ = own_kv_.data();
  }
  workspace_ = std::make_unique<Workspace>();
  Workspace& w = *workspace_;
  w.x = DeviceBuffer<float>(T * c.hidden);
  if (!options_.kv_owner) // a model owning its KV may be a target that resumes (ForwardArgs::resume_layers)
    w.resumed_x = DeviceBuffer<float>(T * c.hidden);
  w.q = DeviceBuffer<uint16_t>(T * qd);
  w.o = DeviceBuffer<uint16_t>(T * qd);
  w.act = DeviceBuffer<uint16_t>(T * c.ffn);
  w.normed = DeviceBuffer<uint16_t>(T * c.hidden);
  if (options_.prefill_gemm_tokens > 0 && T >= static_cast<size_t>(options_.prefill_gemm_tokens)) {
    w.prefill = std::make_unique<llama::PrefillGemms>(c.hidden, static_cast<int>(qd), static_cast<int>(kvd),
                                                      c.ffn, static_cast<int>(T));
    w.prefill_y = DeviceBuffer<float>(std::min<size_t>(T, llama::kPrefillChunkTokens) *
                                      std::max(qd + 2 * kvd, 2 * static_cast<size_t>(c.ffn)));
  }
  using llama::AttentionGrouping, llama::GemmTiles;
  w.attention_grouping = choice_from_env<AttentionGrouping>("SMCGRAPH_ATTENTION_GROUPING",
                                                            {{"by_size", AttentionGrouping::kBySize},
                                                             {"per_query", AttentionGrouping::kPerQuery},
                                                             {"grouped", AttentionGrouping::kGrouped}});
  w.gemm_tiles = choice_from_env<GemmTiles>("SMCGRAPH_GEMM_TILES", {{"by_size", GemmTiles::kBySize},
                                                                    {"narrow_wide", GemmTiles::kNarrowWide},
                                                                    {"pipelined", GemmTiles::kPipelined}});
  w.gemm_narrow_warps =
      choice_from_env<uint8_t>("SMCGRAPH_GEMM_NARROW_WARPS", {{"by_size", 0}, {"8", 8}, {"4", 4}});
  w.gemm_a_staging = choice_from_env<llama::GemmAStaging>(
      "SMCGRAPH_GEMM_A_STAGING",
      {{"registers", llama::GemmAStaging::kRegisters}, {"cp_async", llama::GemmAStaging::kCpAsync}});
  w.gemm_fragments = choice_from_env<llama::GemmFragments>(
      "SMCGRAPH_GEMM_FRAGMENTS",
      {{"ldmatrix", llama::GemmFragments::kLdmatrix}, {"wmma", llama::GemmFragments::kWmma}});
  const bool split_kv =
      choice_from_env<bool>("SMCGRAPH_ATTENTION_SPLIT", {{"by_size", true}, {"off", false}});
  w.attention_max_splits = llama::attention_max_splits(options_.max_seq_len);
  if (split_kv && w.attention_max_splits > 1) {
    const size_t split_tokens = std::min<size_t>(T, llama::kAttentionSplitMaxTokens);
    w.attention_states =
        DeviceBuffer<float>(split_tokens * c.heads * w.attention_max_splits * (size_t(c.head_dim) + 2));
    w.attention_tickets = DeviceBuffer<uint32_t>(split_tokens * c.heads); // zeroed below; launches keep it
  }
  // When the next launch of the chain may start (PDL): at the top of each layer's O and down launches and
  // after the wait of the others (early_o_down, the default), or after every kernel's wait (after_wait), or
  // another subset (forward() says why the successors' early reads stay safe). Bits: 1 attention, 2 O, 4
  // down, 8 QKV, 16 gate/up trigger at their top. H100, SmolLM2, graph us a cycle, after_wait -> early_o_down
  // (two rounds each, the modes alternating in one call): no draft at 1 / 8 requests 428.1-431.5 /
  // 445.7-446.1 -> 407.5-407.7 / 439.7-440.2; greedy speculative K 4 2,016.5-2,018.5 / 2,120.7-2,121.2 ->
  // 1,910.8-1,912.9 / 2,116.9-2,117.1; SMC N 8 K 4 1,925.4-1,926.8 / 4,238.3-4,257.5 -> 1,954.4-1,955.2 /
  // 4,160.4-4,166.2 (the one loss). Triggering the attention early as well lost at 8 rows (early: 458.7-459.1
  // at 8 requests).
  w.early_trigger = choice_from_env<uint8_t>("SMCGRAPH_LLAMA_TRIGGER", {{"early_o_down", 6},
                                                                        {"after_wait", 0},
                                                                        {"early_attention", 1},
                                                                        {"early_o", 2},
                                                                        {"early_down", 4},
                                                                        {"early_attention_o", 3},
                                                                        {"early_attention_down", 5},
                                                                        {"early", 7},
                                                                        {"early_all", 15},
                                                                        {"early_max", 31}});
  w.stream_weights =
      choice_from_env<bool>("SMCGRAPH_LLAMA_WEIGHT_CACHE", {{"streaming", true}, {"normal", false}});
  const llama::HeadKernels head_kernels =
      choice_from_env<llama::HeadKernels>("SMCGRAPH_LM_HEAD", {{"by_size", llama::HeadKernels::kBySize},
                                                               {"small_bf16", llama::HeadKernels::kSmallBf16},
                                                               {"cublaslt", llama::HeadKernels::kCublasLt},
                                                               {"own_gemm", llama::HeadKernels::kOwnGemm}});
  w.head = std::make_unique<llama::LtHead>(c.vocab, c.hidden, static_cast<int>(T), options_.logits_dtype,
                                           head_kernels);
  w.head->use_q8_weights(weights_->head_q8(), weights_->head_q8_scales());
  llama::prepare_gemm(std::max({c.hidden, static_cast<int>(qd), c.ffn}));
  llama::prepare_attention(c.head_dim);
  // Zero everything once: padding rows of the activations are read (and ignored) by the GEMMs.
  Stream stream;
  if (!options_.kv_owner) // a shared KV is the owner's, zeroed by it
    own_kv_.fill_bytes(0, stream);
  w.x.fill_bytes(0, stream);
  if (w.resumed_x.size() > 0)
    w.resumed_x.fill_bytes(0, stream);
  w.q.fill_bytes(0, stream);
  w.o.fill_bytes(0, stream);
  w.act.fill_bytes(0, stream);
  // Every prefill GEMM writes the rows its epilogue reads; zeroed anyway because compute-sanitizer's
  // initcheck does not see cuBLASLt's stores into it (it reported the epilogue's reads of rows the GEMM had
  // written, whose results matched the references).
  w.prefill_y.fill_bytes(0, stream);
  w.attention_tickets.fill_bytes(0, stream); // the split-KV tickets start at 0 (none without the workspace)
  stream.synchronize();
}

LlamaModel::~LlamaModel() = default;

bool llama_layers_prefix(const std::vector<int>& layers, const std::vector<int>& of) {
  return layers.size() <= of.size() && std::equal(layers.begin(), layers.end(), of.begin());
}

void LlamaModel::clear_kv(cudaStream_t stream) {
  SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(kv_, 0, kv_elements_ * sizeof(uint16_t), stream));
}

bool LlamaModel::kv_follows(const Model& other) const {
  return options_.kv_owner != nullptr && static_cast<const Model*>(options_.kv_owner) == &other;
}

int LlamaModel::vocab() const {
  return weights_->config().vocab;
}
const LlamaConfig& LlamaModel::config() const {
  return weights_->config();
}

int LlamaModel::launches_per_forward() const {
  // embed + per layer (qkv, attention, o, gate/up, down) + head: the small head or one own GEMM, or the norm
  // and cuBLASLt's matmul (usually one kernel).
  const llama::LtHead& head = *workspace_->head;
  return 2 + static_cast<int>(layers_.size()) * 5 + (head.usable() && !head.small_head_serves(1) ? 1 : 0);
}

const char* LlamaModel::lm_head_kernel(int tokens) const {
  return workspace_->head->kernel(tokens);
}

size_t LlamaModel::weight_bytes_per_forward(int head_tokens) const {
  const LlamaConfig& c = config();
  const size_t H = c.hidden, qd = size_t(c.heads) * c.head_dim, kvd = size_t(c.kv_heads) * c.head_dim;
  const size_t per_layer = ((qd + 2 * kvd) * H + H * qd + 3 * size_t(c.ffn) * H) * 2 + 2 * H * 4;
  // The int8 head reads a byte a weight and a float scale a 32 of them; the others the bf16 weights.
  const bool q8 = std::max(head_tokens, 1) <= workspace_->head->q8_max_tokens();
  const size_t head = q8 ? size_t(c.vocab) * H + size_t(c.vocab) * (H / 32) * 4 : size_t(c.vocab) * H * 2;
  return layers_.size() * per_layer + head + H * 4;
}

void LlamaModel::forward(const ForwardArgs& args, cudaStream_t stream) {
  constexpr const char* kWhere = "LlamaModel::forward";
  if (!detail::require_forward_args(args, kWhere))
    return;
  const int64_t tokens = static_cast<int64_t>(args.rows) * args.tokens_per_row;
  require(tokens <= options_.max_tokens_per_forward, kWhere, "rows * tokens_per_row", tokens,
          "exceeds LlamaModelOptions::max_tokens_per_forward");
  const LlamaConfig& c = config();
  Workspace& w = *workspace_;
  const int T = static_cast<int>(tokens);
  const int qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  const int W = args.tokens_per_row;
  // Resuming (ForwardArgs::hidden): every token but each row's last enters layer R from `hidden`, where the
  // draft's forwards left it; the last token runs layers 0 .. R - 1 alone first, and joins them there.
  const int R = args.resume_layers;
  require(R >= 0 && R <= static_cast<int>(layers_.size()), kWhere, "args.resume_layers", R,
          "must be in [0, layers] (0: run every layer; layers: the LM head over the handed-over tokens)");
  if (R > 0 || args.hidden != nullptr) {
    require(args.hidden != nullptr && reinterpret_cast<uintptr_t>(args.hidden) % 16 == 0, kWhere,
            "args.hidden", args.hidden == nullptr ? "null" : "misaligned",
            "must be a 16-byte aligned device pointer where resume_layers > 0");
    require(args.hidden_row_stride >= (R > 0 ? static_cast<int64_t>(W) : 1) * c.hidden &&
                args.hidden_row_stride % 4 == 0,
            kWhere, "args.hidden_row_stride", args.hidden_row_stride,
            R > 0 ? "must be a multiple of 4 and >= tokens_per_row * hidden_size() when resuming"
                  : "must be a multiple of 4 and >= hidden_size()");
  }
  if (R > 0)
    require(w.resumed_x.size() > 0, kWhere, "args.resume_layers", R,
            "needs a model that owns its KV (a target; a kv_owner draft never resumes)");

  // clang-format off
  llama::AttentionArgs attention{
      .rows = args.rows, .tokens_per_row = W, .heads = c.heads, .kv_heads = c.kv_heads,
      .head_dim = c.head_dim, .max_seq_len = options_.max_seq_len, .pool_size = options_.pool_size,
      .io_row_stride = args.io_stride(), .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
      .q = w.q.data(), .kv = nullptr,
      .slot_table = args.slot_table, .seq_lens = args.seq_lens, .positions = args.positions, .live = args.live,
      .out = w.o.data(), .grouping = w.attention_grouping,
      .split_states = w.attention_states.data(), .split_tickets = w.attention_tickets.data(), // null: none
      .max_splits = w.attention_max_splits,
      .tensor_core_min_tokens = options_.tensor_core_attention_tokens}; // .kv: each layer's
  // clang-format on

  llama::GemmArgs g;
  g.tokens = T;
  g.tokens_per_row = W;
  g.io_row_stride = args.io_stride();
  g.live = args.live;
  g.eps = c.rms_eps;
  g.tiles = w.gemm_tiles;
  g.narrow_warps = w.gemm_narrow_warps;
  g.a_staging = w.gemm_a_staging;
  g.fragments = w.gemm_fragments;
  g.stream_weights = w.stream_weights;

  // Layers [first, last) of this model on residual stream x, with the shapes of `shape` and `att` (whose
  // positions the QKV projection's RoPE and KV write also take, with att's out_slots).
  const auto run_layers = [&](size_t first, size_t last, float* x, const llama::GemmArgs& shape,
                              llama::AttentionArgs att, const int32_t* out_slots) {
    // A long prefill (at least prefill_gemm_tokens tokens a row) runs its layer GEMMs through cuBLASLt where
    // a pinned algorithm serves the shape (llama_prefill_gemm.cu); the RMSNorm epilogues then read
    // rms_norm_rows(x).
    const bool prefill = w.prefill != nullptr && shape.tokens_per_row >= options_.prefill_gemm_tokens;
    const auto project = [&](llama::GemmEpilogue epilogue, llama::GemmArgs& args) {
      const bool cublaslt = prefill && w.prefill->serves(args.n, args.k);
      normalize_rows_first(epilogue, args, cublaslt, w.normed.data(), stream);
      if (!(cublaslt && w.prefill->run(epilogue, args, w.prefill_y.data(), stream)))
        llama::gemm(epilogue, args, stream);
    };
    for (size_t local = first; local < last; ++local) {
      const LlamaWeights::Layer& layer = weights_->layer(layers_[local]);
      uint16_t* kv = kv_ + local * size_t(options_.pool_size) * 2 * kvd;

      llama::GemmArgs qkv = shape;
      qkv.n = qd + 2 * kvd;
      qkv.k = c.hidden;
      qkv.weight = layer.qkv;
      qkv.x = x;
      qkv.norm_weight = layer.attn_norm;
      qkv.out_bf16 = w.q.data();
      qkv.q_dim = qd;
      qkv.kv_dim = kvd;
      qkv.head_dim = c.head_dim;
      qkv.pool_size = options_.pool_size;
      qkv.inv_freq = weights_->rope_inv_freq();
      qkv.positions = att.positions;
      qkv.out_slots = out_slots;
      qkv.kv = kv;
      // Early triggers (Workspace::early_trigger). A kernel may read before its wait only what completed
      // before the last kernel of the chain that triggered after its own wait passed that wait.
      // early (attention, O and down) and any subset of it, early_o_down the default among them: QKV and
      // gate/up trigger after their wait, so attention's successor, O, reads the residual stream before its
      // wait, whose last writer (down, embed or gather_rows) completed before QKV's wait; O's successor,
      // gate/up (or the norm of pipelined tiles), reads only weights before its wait; down's successor, the
      // next layer's QKV (or its norm), reads weights and the forward's inputs. At most four kernels of the
      // chain are resident: QKV running, attention, O and gate/up waiting (early_o_down: gate/up running or
      // waiting beside O, the next QKV beside down).
      // early_all: QKV triggers early too, so only gate/up stops the cascade: after its wait, down, the next
      // QKV, attention, O and gate/up may all start. Attention reads only the forward's inputs and older
      // positions' KV (earlier forwards') before its wait, but the residual stream's last writer (down) may
      // still run when O starts: O reads its residual after its wait.
      // early_max: gate/up triggers early too, so nothing inside the layers stops the cascade: once embed (or
      // gather_rows) passed its wait, every layer kernel may start as resources allow, staging its weights.
      // Every read before a wait is then of weights, the forward's inputs or earlier forwards' KV; O and down
      // read their residual after their wait.
      // In all of them, a layer's last launch before the LM head or a hand-over keeps the late trigger.
      qkv.trigger_early = (w.early_trigger & 8) != 0;
      project(llama::GemmEpilogue::kQkvRope, qkv);

      att.kv = kv;
      att.trigger_early = (w.early_trigger & 1) != 0;
      llama::attention(att, stream);

      llama::GemmArgs o = shape;
      o.n = c.hidden;
      o.k = qd;
      o.weight = layer.o;
      o.a_bf16 = w.o.data();
      o.residual = x;
      // last written by the down projection (or embed) before QKV's wait (not with early_all: above)
      o.residual_ready_before_wait = (w.early_trigger & 8) == 0;
      o.trigger_early = (w.early_trigger & 2) != 0;
      project(llama::GemmEpilogue::kResidualAdd, o);

      llama::GemmArgs gate_up = shape;
      gate_up.n = 2 * c.ffn;
      gate_up.k = c.hidden;
      gate_up.weight = layer.gate_up;
      gate_up.x = x;
      gate_up.norm_weight = layer.ffn_norm;
      gate_up.out_bf16 = w.act.data();
      gate_up.trigger_early = (w.early_trigger & 16) != 0;
      project(llama::GemmEpilogue::kSwiGlu, gate_up);

      llama::GemmArgs down = shape;
      down.n = c.hidden;
      down.k = c.ffn;
      down.weight = layer.down;
      down.a_bf16 = w.act.data();
      down.residual = x;
      // last written by the O projection before gate/up's wait (not with early_max: above)
      down.residual_ready_before_wait = (w.early_trigger & 16) == 0;
      down.trigger_early = (w.early_trigger & 4) != 0 && local + 1 < last;
      project(llama::GemmEpilogue::kResidualAdd, down);
    }
  };

  float* x = w.x.data();
  if (R == 0) {
    llama::embed(T, W, args.token_stride(), c.hidden, c.vocab, args.tokens, args.live, weights_->token_embd(),
                 x, stream);
    run_layers(0, layers_.size(), x, g, attention, args.out_slots);
  } else {
    // Each row's last token alone through layers 0 .. R - 1 (its column of the inputs, a one-token forward
    // of `rows` tokens); then the rows' tokens, the others' residuals from `hidden` and the last one's from
    // there, through layers R .. on the workspace's second residual stream.
    const int64_t last = W - 1;
    llama::GemmArgs one = g;
    one.tokens = args.rows;
    one.tokens_per_row = 1;
    llama::AttentionArgs one_attention = attention;
    one_attention.tokens_per_row = 1;
    one_attention.positions = args.positions + last;
    llama::embed(args.rows, 1, args.token_stride(), c.hidden, c.vocab, args.tokens + last, args.live,
                 weights_->token_embd(), x, stream);
    run_layers(0, static_cast<size_t>(R), x, one, one_attention, args.out_slots + last);
    llama::gather_rows(args.rows, W, c.hidden, args.hidden, args.hidden_row_stride, x, c.hidden,
                       w.resumed_x.data(), static_cast<int64_t>(W) * c.hidden, stream);
    x = w.resumed_x.data();
    run_layers(static_cast<size_t>(R), layers_.size(), x, g, attention, args.out_slots);
  }

  llama::GemmArgs head = g;
  head.tiles = llama::GemmTiles::kBySize; // SMCGRAPH_GEMM_TILES picks the layer GEMMs' tiles, not the head's
  if (args.last_token_logits) {           // row r's last token only, its logits at row r of a dense [rows, V]
    head.tokens = args.rows;
    head.tokens_per_row = 1;
    head.io_row_stride = 1;
    head.x_row_stride = static_cast<int64_t>(W) * c.hidden;
  }
  head.n = weights_->vocab_padded();
  head.logits_cols = c.vocab;
  head.k = c.hidden;
  head.weight = weights_->head();
  head.x = x + (args.last_token_logits ? static_cast<size_t>(W - 1) * c.hidden : 0);
  head.norm_weight = weights_->output_norm();
  head.logits = args.logits;
  head.logits_dtype = options_.logits_dtype;
  if (!w.head->run(head, w.normed.data(), stream))
    llama::gemm(llama::GemmEpilogue::kLogits, head, stream);
  // The residual of each row's last token, for the target to resume from: after the head, so that the head
  // follows the last down projection directly and stages its weights while that runs (PDL). H100, graph us a
  // cycle, two rounds in one call: SMC N 8 K 4 at 1 request 1,939.1, 1,946.3 -> 1,940.1, 1,929.5; speculative
  // K 4 at 1 / 8 requests 1,876.0, 1,877.4 / 2,078.0, 2,075.2 -> 1,873.6, 1,870.6 / 2,072.0, 2,072.9.
  if (R == 0 && args.hidden != nullptr)
    llama::gather_rows(args.rows, 1, c.hidden, nullptr, 0, x + static_cast<size_t>(W - 1) * c.hidden,
                       static_cast<int64_t>(W) * c.hidden, args.hidden, args.hidden_row_stride, stream);
}

int LlamaModel::resumable_layers(const Model& draft) const {
  const auto* prefix = dynamic_cast<const LlamaModel*>(&draft);
  if (prefix == nullptr || prefix->options_.kv_owner != this || prefix->layers_.size() > layers_.size() ||
      workspace_->resumed_x.size() == 0)
    return 0;
  return static_cast<int>(prefix->layers_.size()); // kv_owner: the same weights, the first layers of ours
}

int LlamaModel::hidden_size() const {
  return config().hidden;
}

} // namespace smcgraph
