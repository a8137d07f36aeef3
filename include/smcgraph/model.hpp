// The model interface smcgraph captures into its cycle graphs (DESIGN.md §6).
#pragma once

#include <cstdint>
#include <limits>

#include <cuda_runtime_api.h>

#include "smcgraph/types.hpp"

namespace smcgraph {

/// One forward pass over `tokens_per_row` tokens of each of `rows` rows. Every pointer is device memory
/// and stays fixed across graph replays; the values behind them change between replays.
///
///   smcgraph::ForwardArgs args{rows, /*tokens_per_row=*/1, d_tokens, d_positions, d_slot_table,
///                              d_seq_lens, d_out_slots, d_live, d_logits};
///   model.forward(args, stream);   // capturable: no allocation, no synchronization
struct ForwardArgs {
  int rows = 0;                        ///< bucket rows (live and padding)
  int tokens_per_row = 0;              ///< 2 (draft head), 1 (draft step) or K + 1 (target verify)
  const int32_t* tokens = nullptr;     ///< [rows, tokens_per_row], rows token_stride() elements apart
  const int32_t* positions = nullptr;  ///< [rows, tokens_per_row]
  const int32_t* slot_table = nullptr; ///< [rows, max_seq_len()] slot id of each position of the row
  const int32_t* seq_lens = nullptr;   ///< [rows] tokens whose KV the model may read (= last position + 1)
  const int32_t* out_slots = nullptr;  ///< [rows, tokens_per_row] where this forward writes KV
  const uint8_t* live = nullptr;       ///< [rows] 0 marks a padding row
  void* logits = nullptr;              ///< [rows, tokens_per_row, vocab()] in logits_dtype()
  /// Elements between the rows of `tokens`; 0 (the default) means dense (tokens_per_row). The engine's draft
  /// steps read one column of its [rows, K + 1] draft-token block this way. Models must honour it.
  int64_t token_row_stride = 0;
  /// Tokens between the rows of `positions`, `out_slots` and `logits` (token j of row r at r * io_stride() +
  /// j, its logits at (r * io_stride() + j) * vocab()); 0 (the default) means dense (tokens_per_row). Entries
  /// past tokens_per_row in a row are not read; their logits may be written with values nothing may use (the
  /// Llama model's cuBLASLt LM head writes zeros there), and so may a padding row's. The engine's verify
  /// forward over the
  /// W <= K + 1 columns a cycle needs reads and writes its [rows, K + 1] blocks this way. Models must honour
  /// it.
  int64_t io_row_stride = 0;
  /// Logits of each row's last token only: `logits` is then [rows, vocab()] dense, row r holding token
  /// tokens_per_row - 1 of row r, and no other token gets logits. Set only for a model whose
  /// last_token_logits_supported() is true (the engine's draft head: it samples from its last column only).
  bool last_token_logits = false;
  /// The residual stream handed from a layer-prefix draft to its target (Model::resumable_layers), fp32,
  /// hidden_size() floats a token. With resume_layers = 0 (a draft's forward): after its layers, the model
  /// writes the residual of each row's last token at hidden + r * hidden_row_stride. With resume_layers = R >
  /// 0 (the target's verify; the model only reads `hidden`): hidden + r * hidden_row_stride + j *
  /// hidden_size() holds, for every token j but the last of row r, the residual after the model's first R
  /// layers (the draft's forwards wrote it, and those layers' KV of the token); the model runs its first R
  /// layers over each row's last token alone, then the others over every token, starting from these.
  /// hidden_row_stride must then be >= tokens_per_row * hidden_size(). Set only where the target's
  /// resumable_layers(draft) is R (the engine's verify, both cycle kinds).
  float* hidden = nullptr; ///< written by a draft's forward, read by a resuming one
  int64_t hidden_row_stride = 0;
  int resume_layers = 0;

  int64_t token_stride() const { return token_row_stride > 0 ? token_row_stride : tokens_per_row; }
  int64_t io_stride() const { return io_row_stride > 0 ? io_row_stride : tokens_per_row; }
};

/// A model whose forward pass can be captured into a CUDA graph: `forward` enqueues work on `stream`
/// only (no allocation, no synchronization, no host read of device values) and throws smcgraph::Error
/// for arguments it cannot serve.
class Model {
public:
  virtual ~Model() = default;
  virtual void forward(const ForwardArgs& args, cudaStream_t stream) = 0;
  virtual int vocab() const = 0;
  virtual DType logits_dtype() const = 0;
  virtual int max_seq_len() const = 0;
  /// Whether forward() honours ForwardArgs::last_token_logits (a model that does saves the LM head of the
  /// other tokens; the engine otherwise copies the column it needs).
  virtual bool last_token_logits_supported() const { return false; }
  /// The most tokens (rows x tokens_per_row) one forward serves: the engine's admission prefill takes chunks
  /// of at most this many (EngineConfig::prefill_chunk).
  virtual int max_forward_tokens() const { return std::numeric_limits<int>::max(); }
  /// Whether every KV entry this model's forward reads is written, with the same values, by `other`'s forward
  /// over the same tokens (a layer-prefix draft sharing its target's KV storage). The engine may then skip
  /// this model's forward for a cycle (AdaptiveDraftSteps::min_steps = 0) without leaving a gap in its cache.
  virtual bool kv_follows(const Model& other) const {
    (void)other;
    return false;
  }
  /// How many of this model's first layers `draft` runs as its own, with the same weights and writing the
  /// same KV into this model's storage (a layer-prefix draft whose KV follows this model's): this model's
  /// forward can then resume after them from the residual stream the draft's forwards handed over
  /// (ForwardArgs::hidden, resume_layers), instead of running them again over tokens the draft has already
  /// run. 0: it cannot.
  virtual int resumable_layers(const Model& draft) const {
    (void)draft;
    return 0;
  }
  /// Floats a token of the residual stream a forward hands over or resumes from (ForwardArgs::hidden); 0 when
  /// the model does neither.
  virtual int hidden_size() const { return 0; }
};

/// Tokens a row the engine's draft head forwards: 2 ([x_{L-2}, x_{L-1}]: the draft's KV of x_{L-2} is missing
/// when the previous cycle's last draft token was accepted), or 1 (x_{L-1} alone) where that KV is written
/// already, with the same values, by the target's verify or prefill: a draft that is the target itself or
/// whose KV follows the target's (Model::kv_follows), and that gives the head its last token's logits alone
/// (Model::last_token_logits_supported; the one-token head reads the second column of its [rows, 2] inputs,
/// and a [rows, 2, V] logits block offset the same way would let a model's writes past tokens_per_row run
/// past its end).
inline int draft_head_tokens(const Model& draft, const Model& target) {
  const bool kv_written = &draft == &target || draft.kv_follows(target);
  return kv_written && draft.last_token_logits_supported() ? 1 : 2;
}

} // namespace smcgraph
