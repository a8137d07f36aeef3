// NgramDraft: a draft model without weights (n-gram, "prompt lookup" speculation). It proposes the token that
// followed the most recent earlier occurrence of the row's last n tokens, so it costs a few microseconds a
// forward instead of a neural draft's forward, and it pays where the text repeats itself (the prompt, lists,
// code, a small model's own phrases). Use it with the speculative cycle (exact for any draft); an SMC cycle
// runs with it too, but its importance weights then carry the whole correction.
//
// State: the token id of every position it has seen, per KV slot (its "KV cache": int32 [pool_size], written
// at out_slots like KV and read through the slot table like KV), so the engine's slot pool, reshuffle and
// prefill treat it like any draft. Slot 0 (the padding dummy) is never written; unwritten slots hold -1.
//
// Forward, for each token j of a live row r at position p (ForwardArgs; p clamped into [0, max_seq_len)):
//   1. store:    store[out_slots[r][j]] = clamp(tokens[r][j], 0, vocab - 1)   (every token of the forward
//   first;
//                a write to slot 0 or outside [0, pool_size) is dropped)
//   2. history:  h[i] = store[slot_table[r][i]] for i = 0 .. q, q = min(p, seq_lens[r] - 1) (a slot id
//   outside
//                [0, pool_size) reads slot 0)
//   3. proposal: for n = max_ngram down to min_ngram: the largest e in [n - 1, q - 1] with h[e - n + 1 .. e]
//   ==
//                h[q - n + 1 .. q] (every one of those n tokens >= 0); the first n whose e exists and whose
//                h[e + 1] is in [0, vocab) proposes h[e + 1]; none: no proposal
//   4. logits:   confidence at the proposed token, 0 everywhere else (all 0 without a proposal: q uniform);
//                bf16 logits are the same values rounded to nearest even
// Padding rows (live[r] == 0) write nothing, their logits included. Host reference:
// tests/reference/ngram_ref.
//
//   smcgraph::NgramDraftOptions options;
//   options.vocab = target.vocab(); options.pool_size = pool; options.max_seq_len = target.max_seq_len();
//   options.logits_dtype = target.logits_dtype();
//   smcgraph::NgramDraft draft(options);
//   smcgraph::Engine engine(config, draft, target);   // config.kind = CycleKind::kSpeculative
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "smcgraph/model.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph {

/// Longest history a forward's token may look at (shared memory of the proposal kernel): max_seq_len's bound.
inline constexpr int kNgramMaxSeqLen = 16384;
/// Longest n-gram matched.
inline constexpr int kNgramMaxN = 8;

struct NgramDraftOptions {
  int vocab = 32000;       ///< >= 1; must equal the target's
  int pool_size = 1 << 16; ///< >= 2 token slots (the engine's slot_pool_size); slot 0 is the dummy
  int max_seq_len = 2048;  ///< in [1, kNgramMaxSeqLen]; the row stride of ForwardArgs::slot_table
  DType logits_dtype = DType::kFloat32; ///< kFloat32 or kBFloat16
  int min_ngram = 1;                    ///< shortest n-gram matched, >= 1
  int max_ngram = 3;                    ///< longest n-gram tried first, in [min_ngram, kNgramMaxN]
  /// The proposed token's logit (the others are 0): finite, in (0, 1e4]. At 30 a vocabulary of 49,152 gives
  /// it probability 1 - 5e-9 at temperature 1.
  float confidence = 30.0f;
};

/// Throws smcgraph::Error naming the first bad field. Makes no CUDA call.
void validate_ngram_draft_options(const NgramDraftOptions& options);

class NgramDraft final : public Model {
public:
  /// Validates, allocates the token store and fills it with -1 (synchronously, on a private stream).
  explicit NgramDraft(const NgramDraftOptions& options);

  /// Two launches on `stream`: the store writes, then the proposals and their logits. Capturable; validates
  /// the arguments on the host (rows >= 0, tokens_per_row >= 1, row strides, non-null pointers); rows == 0 is
  /// a no-op.
  void forward(const ForwardArgs& args, cudaStream_t stream) override;

  int vocab() const override { return options_.vocab; }
  DType logits_dtype() const override { return options_.logits_dtype; }
  int max_seq_len() const override { return options_.max_seq_len; }
  bool last_token_logits_supported() const override { return true; }
  const NgramDraftOptions& options() const { return options_; }

  /// The token store, device memory [pool_size] int32 (tests read it).
  const int32_t* store_data() const { return store_.data(); }
  /// Fills the store with -1 again (enqueued on `stream`).
  void clear(cudaStream_t stream);

private:
  NgramDraftOptions options_;
  DeviceBuffer<int32_t> store_;
};

} // namespace smcgraph
