// LlamaModel: a Llama-architecture decoder read from a GGUF file (DESIGN.md §6.1), as a capturable Model.
//
// Weights are dequantised to bf16 once at load (LlamaWeights, device memory) and shared by every model built
// from them: the target runs all layers, a draft runs an increasing subset (self-speculative layer skip) and
// owns only its KV storage. Each model's KV storage is [layers run, pool_size, 2, kv_heads, head_dim] bf16,
// indexed by the engine's slot ids (page size 1), so the engine, the slot pool and the reshuffle treat it
// like the toy model.
//
// Numerics (the host reference in tests/reference/llama_ref.cpp follows the same rounding points): residual
// stream in fp32; RMSNorm output, q, k, v, the attention output and the SwiGLU activation rounded to bf16;
// every GEMM accumulates in fp32; RoPE rotates adjacent pairs (2i, 2i + 1) of the GGUF-permuted Q/K rows,
// which is llama.cpp's "normal" RoPE and equals Hugging Face's rotate-half on un-permuted rows.
//
//   smcgraph::GgufFile file = smcgraph::GgufFile::open(path);
//   auto weights = smcgraph::load_llama_weights(file);               // once; uploads bf16 weights
//   smcgraph::LlamaModelOptions options;
//   options.pool_size = 1 << 16; options.max_seq_len = 2048; options.max_tokens_per_forward = 4096;
//   smcgraph::LlamaModel target(weights, options);                   // all layers
//   options.layers = smcgraph::llama_layer_range(0, 24);               // a layer-subset draft, same weights
//   smcgraph::LlamaModel draft(weights, options);
//   smcgraph::Engine engine(config, draft, target);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "smcgraph/gguf.hpp"
#include "smcgraph/model.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph {

/// Largest head_dim the attention kernels support (SmolLM2 uses 64).
inline constexpr int kLlamaMaxHeadDim = 128;
/// Largest hidden size: the GEMMs' RMSNorm prologue holds a whole row in registers (32 lanes x 32 floats).
inline constexpr int kLlamaMaxHidden = 1024;

/// The architecture, from the GGUF metadata (llama.* keys).
struct LlamaConfig {
  int layers = 0;             ///< llama.block_count
  int hidden = 0;             ///< llama.embedding_length
  int ffn = 0;                ///< llama.feed_forward_length
  int heads = 0;              ///< llama.attention.head_count
  int kv_heads = 0;           ///< llama.attention.head_count_kv (defaults to heads)
  int head_dim = 0;           ///< hidden / heads
  int vocab = 0;              ///< rows of token_embd
  int context = 0;            ///< llama.context_length
  float rope_base = 10000.0f; ///< llama.rope.freq_base
  float rms_eps = 1e-5f;      ///< llama.attention.layer_norm_rms_epsilon
  bool tied_head = true;      ///< no output.weight: token_embd is the LM head
};

/// Reads and validates the architecture keys (general.architecture must be "llama"); throws smcgraph::Error
/// naming the key and value that is missing or out of range.
LlamaConfig llama_config_from_gguf(const GgufFile& file);

/// Host copy of every weight as bf16 bits (norm weights as float), in the GGUF's row order: a [rows, cols]
/// matrix is ggml ne = [cols, rows]. Validates every tensor's presence and shape.
struct LlamaHostWeights {
  struct Layer {
    std::vector<float> attn_norm, ffn_norm; ///< [hidden]
    std::vector<uint16_t> q, k, v, o;       ///< [heads*hd, H], [kvh*hd, H] x2, [H, heads*hd]
    std::vector<uint16_t> gate, up, down;   ///< [ffn, H], [ffn, H], [H, ffn]
  };
  LlamaConfig config;
  std::vector<uint16_t> token_embd; ///< [vocab, hidden]
  std::vector<uint16_t> output;     ///< [vocab, hidden]; empty when tied
  std::vector<float> output_norm;   ///< [hidden]
  std::vector<Layer> layers;
  /// The LM head's Q8_0 blocks as the file stores them, where it stores them so (token_embd, or output when
  /// untied) and every scale is finite: the int8 values [vocab, hidden] and each 32-value block's scale as
  /// float [vocab, hidden / 32]; empty otherwise. bf16(value * scale) is the head's bf16 weight (the loader's
  /// dequantisation), so the int8 head (llama_head.cu) reads 1.125 bytes a weight for the same bits.
  std::vector<int8_t> head_q8;
  std::vector<float> head_q8_scales;
};
LlamaHostWeights load_llama_host_weights(const GgufFile& file);

/// Device weights (bf16), shared by the models built from them. Immutable after construction.
class LlamaWeights {
public:
  explicit LlamaWeights(const LlamaHostWeights& host);
  const LlamaConfig& config() const { return config_; }
  size_t device_bytes() const;

  struct Layer {
    const float* attn_norm;
    const float* ffn_norm;
    const uint16_t* qkv;     ///< [(heads + 2 kv_heads) * hd, H]: q rows, then k, then v
    const uint16_t* o;       ///< [H, heads * hd]
    const uint16_t* gate_up; ///< [2 ffn, H], gate and up rows interleaved in groups of kGateUpGroup
    const uint16_t* down;    ///< [H, ffn]
  };
  const Layer& layer(int index) const { return layer_views_[index]; }
  const uint16_t* token_embd() const { return token_embd_.data(); }
  const uint16_t* head() const { return head_ ? head_ : token_embd_.data(); }
  const float* output_norm() const { return output_norm_.data(); }
  const float* rope_inv_freq() const { return rope_inv_freq_.data(); }
  /// Rows of token_embd() and head(): vocab rounded up to a multiple of 64 with zero rows.
  int vocab_padded() const { return vocab_padded_; }
  /// The head's Q8_0 values (LlamaHostWeights::head_q8) in the int8 head's fragment order, or null where the
  /// file's head is not Q8_0: for each 16-row group g of vocab_padded() rows and each 16-wide K step s, 256
  /// bytes, lane l's 8 at 8 l: rows 16 g + l / 4 (r) and r + 8, columns c = 16 s + 2 (l % 4): (r, c), (r, c +
  /// 1), (r + 8, c), (r + 8, c + 1), (r, c + 8), (r, c + 9), (r + 8, c + 8), (r + 8, c + 9): the m16n8k16 A
  /// fragment's registers in order. Padding rows hold zeros.
  const int8_t* head_q8() const { return head_q8_.size() > 0 ? head_q8_.data() : nullptr; }
  /// The scales of head_q8(): for each 16-row group and each 32-wide block of K, the 16 rows' scales
  /// (floats).
  const float* head_q8_scales() const {
    return head_q8_scales_.size() > 0 ? head_q8_scales_.data() : nullptr;
  }

  /// Rows of gate and of up that alternate in gate_up (so one GEMM tile holds matching gate and up rows).
  static constexpr int kGateUpGroup = 16;

private:
  LlamaConfig config_;
  DeviceBuffer<uint16_t> token_embd_, output_;
  DeviceBuffer<int8_t> head_q8_;
  DeviceBuffer<float> head_q8_scales_;
  DeviceBuffer<float> output_norm_, rope_inv_freq_;
  std::vector<DeviceBuffer<float>> norms_;
  std::vector<DeviceBuffer<uint16_t>> matrices_;
  std::vector<Layer> layer_views_;
  const uint16_t* head_ = nullptr;
  int vocab_padded_ = 0;
};

/// Loads and uploads the weights of a GGUF file (config + host weights + LlamaWeights).
std::shared_ptr<const LlamaWeights> load_llama_weights(const GgufFile& file);

/// [first, last) as a layer list.
std::vector<int> llama_layer_range(int first, int last);

/// Whether `layers` are the first layers of `of` (in order; a draft with such layers may share the KV of a
/// model that runs `of`: LlamaModelOptions::kv_owner).
bool llama_layers_prefix(const std::vector<int>& layers, const std::vector<int>& of);

/// A layer list from text: inclusive ranges and single layers, "0-27" or "0-11,18-29". Throws smcgraph::Error
/// naming the text for anything else (the model checks the indices against its config).
std::vector<int> parse_llama_layers(const std::string& text);

/// File name of the real model the project fetches (./run fetch-model).
inline constexpr const char* kSmolLM2FileName = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Where the tools and tests look for it: $SMCGRAPH_MODEL_PATH; else .cache/models/<kSmolLM2FileName> under
/// $SMCGRAPH_SOURCE_ROOT (the repository, which meson's test setup passes); else in the current directory or
/// the nearest parent that has it; else that relative path. The file may not exist: callers check.
std::string default_llama_model_path();

class LlamaModel;

/// LlamaModelOptions::tensor_core_attention_tokens' default.
inline constexpr int kTensorCoreAttentionTokens = 64;
/// LlamaModelOptions::prefill_gemm_tokens' default.
inline constexpr int kPrefillGemmTokens = 2048;

struct LlamaModelOptions {
  int pool_size = 1 << 16;           ///< KV slots (>= 2; slot 0 is the padding dummy)
  int max_seq_len = 2048;            ///< row stride of ForwardArgs::slot_table; <= config.context
  int max_tokens_per_forward = 4096; ///< rows x tokens_per_row of the largest forward (sizes the activations)
  DType logits_dtype = DType::kFloat32; ///< kFloat32 or kBFloat16
  std::vector<int> layers;              ///< layers to run, strictly increasing; empty: all (the target)
  /// Share this model's KV storage: a draft whose layers are the first layers of `kv_owner` (built from the
  /// same weights, same pool_size) reads and writes kv_owner's KV of those layers instead of owning a copy.
  /// The same weights on the same tokens give the same K and V bits (the forward is batch-invariant), so
  /// every position the owner's forward processed is already in the draft's cache: kv_follows(owner) is
  /// true and the engine may skip the draft for a cycle (AdaptiveDraftSteps::min_steps = 0). The owner must
  /// outlive this model. nullptr (default): own KV storage.
  const LlamaModel* kv_owner = nullptr;
  /// Forwards of at least this many tokens a row (a prompt's prefill) run attention on tensor cores
  /// (FlashAttention-2 style, bf16 MMAs with fp32 accumulation) where the heads have 64 or 128 dimensions;
  /// smaller ones (decode, verify blocks) on the CUDA-core kernel. A token's output is the same in any batch
  /// or chunk either kernel takes, but the two kernels' outputs differ in the last bits (the tensor-core one
  /// rounds the softmax weights to bf16), so a prompt prefilled in chunks of fewer tokens than this gives
  /// other KV bits than one prefilled in larger chunks. 0: every forward on the CUDA-core kernel (the
  /// chunking then changes no bit). SmolLM2 on an H200: README, "Admission".
  int tensor_core_attention_tokens = kTensorCoreAttentionTokens;
  /// Forwards of at least this many tokens a row (a long prompt's prefill) run their layer GEMMs through
  /// cuBLASLt, one algorithm pinned per shape at construction with split-K off (so a token's outputs do not
  /// depend on the batch), and RoPE / KV write and SwiGLU in a separate kernel over the fp32 products;
  /// smaller forwards on the library's own GEMM kernels. The two differ in the last bits, as the attention
  /// kernels do (above). cuBLASLt's faster GEMMs pay only for long prompts: its host time per call and the
  /// separate norm and epilogue kernels cost as much or more below about 2,100 tokens (SmolLM2 on an H200:
  /// README, "Admission"). A model whose max_tokens_per_forward reaches it keeps fp32 scratch of
  /// min(max_tokens_per_forward, 4096) x max(q_dim + 2 kv_dim, 2 ffn) floats (SmolLM2 at 2,048 tokens: 24
  /// MiB) and a cuBLASLt handle. 0: never.
  int prefill_gemm_tokens = kPrefillGemmTokens;
};

/// Throws smcgraph::Error naming the first bad option (checked against the weights' config).
void validate_llama_options(const LlamaConfig& config, const LlamaModelOptions& options);

class LlamaModel final : public Model {
public:
  LlamaModel(std::shared_ptr<const LlamaWeights> weights, const LlamaModelOptions& options);
  ~LlamaModel() override;

  /// Capturable: enqueues the embedding, per layer the fused kernels, and the LM head on `stream`; reads
  /// every value that changes between replays from device memory. Throws for rows * tokens_per_row above
  /// max_tokens_per_forward or null pointers. rows == 0 is a no-op.
  void forward(const ForwardArgs& args, cudaStream_t stream) override;

  int vocab() const override;
  DType logits_dtype() const override { return options_.logits_dtype; }
  int max_seq_len() const override { return options_.max_seq_len; }
  /// The LM head then reads the last token of each row only (rows, not rows x tokens_per_row, GEMM rows).
  bool last_token_logits_supported() const override { return true; }
  int max_forward_tokens() const override { return options_.max_tokens_per_forward; }
  const LlamaConfig& config() const;
  const LlamaModelOptions& options() const { return options_; }
  const std::vector<int>& layers() const { return layers_; }
  /// True when `other` is this model's LlamaModelOptions::kv_owner.
  bool kv_follows(const Model& other) const override;
  /// The layers of `draft` when it is a LlamaModel whose kv_owner is this model (its layers are then this
  /// model's first ones, on the same weights): forward() resumes after them from the residual the draft's
  /// forwards handed over (ForwardArgs::hidden, resume_layers). A draft of every layer resumes too: the
  /// verify then runs the layers for each row's last token only and the LM head over every token. 0
  /// otherwise.
  int resumable_layers(const Model& draft) const override;
  /// LlamaConfig::hidden: a forward with ForwardArgs::hidden writes (or resumes from) that many floats a
  /// token.
  int hidden_size() const override;
  /// Kernel launches per forward of a decode's size (for the floor: launches x node latency). Forwards of
  /// many tokens add an RMSNorm kernel before each QKV / gate/up GEMM that takes the pipelined tiles.
  int launches_per_forward() const;
  /// The LM head's kernels for `tokens` head rows (rows x tokens_per_row, or rows with last_token_logits):
  /// "small_q8" (one own kernel over the file's Q8_0 head values, where the file stores the head so, up to 16
  /// rows), "small" (one own kernel over the bf16 head, up to 16 rows), both with cuBLASLt's bits,
  /// "cublaslt" (a norm kernel and cuBLASLt's matmul) or "own_gemm" (the own GEMM, where cuBLASLt is off or
  /// offers no algorithm). SMCGRAPH_LM_HEAD (read at construction): small_bf16 turns the int8 head off,
  /// cublaslt both small heads, own_gemm all three.
  const char* lm_head_kernel(int tokens) const;
  /// Bytes one forward must read at least: the weights of the layers run plus the LM head's, as the head
  /// kernel for `head_tokens` rows reads them (1.125 bytes a weight for the int8 head, 2 otherwise).
  size_t weight_bytes_per_forward(int head_tokens = 1) const;

  /// KV storage [layers().size(), pool_size, 2, kv_heads, head_dim] bf16 (tests read it): its own, or the
  /// first layers of kv_owner's.
  const uint16_t* kv_data() const { return kv_; }
  /// Zeros kv_data() (with a kv_owner: the owner's KV of this model's layers).
  void clear_kv(cudaStream_t stream);

private:
  struct Workspace;
  std::shared_ptr<const LlamaWeights> weights_;
  LlamaModelOptions options_;
  std::vector<int> layers_;
  DeviceBuffer<uint16_t> own_kv_; ///< empty with a kv_owner
  uint16_t* kv_ = nullptr;        ///< own_kv_, or kv_owner's
  size_t kv_elements_ = 0;        ///< elements of kv_data()
  std::unique_ptr<Workspace> workspace_;
};

} // namespace smcgraph
