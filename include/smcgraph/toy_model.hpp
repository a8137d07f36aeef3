// ToyModel: the embedded draft/target pair (DESIGN.md §6). Small enough to reproduce bit for bit on the
// host, shaped like a real decoder where it matters to the cycle: a KV entry per slot read through the
// slot table, and an LM head over a realistic vocabulary that dominates the cost.
//
// Forward, for each token j of a live row r (t = tokens[r][j], p = positions[r][j], H = hidden):
//   1. KV write:  kv[out_slots[r][j]][h] = E[t][h] + P[p % 64][h]   (every token of the forward first)
//   2. hidden:    x[h] = mean of kv[slot_table[r][q]][h] over q = max(0, p - window + 1) .. min(p, L - 1),
//                 L = seq_lens[r], summed in increasing q then divided by the count (x = 0 if the range
//                 is empty), so token j sees the tokens < j of the same forward through the slot table
//   3. logits:    l[v] = b[v] + sum over increasing h of W[v][h] * g(x[h]), one fused multiply-add per h,
//                 g(x) = x / (1 + |x|); bf16 logits are the float result rounded to nearest even.
// The order of every reduction is fixed, so a row's logits do not depend on the batch, its row index, the
// tiling or graph versus eager execution, and the host reference reproduces them exactly.
//
// Defensive clamps (identical in the host reference; valid inputs never hit them): a token outside
// [0, vocab) is clamped into it, a position outside [0, max_seq_len) is clamped into it, a KV write to
// slot 0 or to an id outside [0, pool_size) is dropped, and a slot-table id outside [0, pool_size) reads
// slot 0. Slot 0 (the padding dummy) is never written, so it stays zero unless a caller fills kv_data().
// Several live tokens of one forward may write the same slot only with the same token and position (as
// particles sharing a prefix do when the draft head recomputes x_{L-2}); otherwise the slot's content is
// unspecified.
// Padding rows (live[r] == 0) read nothing but their live flag, write no KV and leave their logits
// untouched (zero the logits buffer once at allocation if a later stage reads padding rows).
//
//   smcgraph::ToyModelConfig config;
//   config.vocab = 128256; config.pool_size = 1 << 20; config.max_seq_len = 4096;
//   config.logits_dtype = smcgraph::DType::kBFloat16; config.weight_seed = 42;
//   smcgraph::ToyModelPair models = smcgraph::ToyModel::pair(config, /*draft_perturbation=*/0.2f);
//   models.draft->forward(draft_args, stream);
//   models.target->forward(verify_args, stream);
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "smcgraph/model.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph {

struct ToyModelConfig {
  int vocab = 32000;      ///< >= 1
  int hidden = 32;        ///< 1 .. kToyMaxHidden
  int window = 16;        ///< >= 1 positions averaged into the hidden state (the current one included)
  int pool_size = 4096;   ///< >= 2 KV slots; slot 0 is the padding dummy
  int max_seq_len = 2048; ///< >= 1; the row stride of ForwardArgs::slot_table
  DType logits_dtype = DType::kFloat32; ///< kFloat32 or kBFloat16
  uint64_t weight_seed = 0;             ///< every weight is a pure function of this seed
  float head_perturbation = 0.0f;       ///< >= 0: head W' = W + head_perturbation * noise (0: the target)
};

/// Largest supported ToyModelConfig::hidden (bounds the shared memory of the LM-head kernel).
inline constexpr int kToyMaxHidden = 256;
/// Rows of the position table P: position p uses row p % kToyPositionPeriod.
inline constexpr int kToyPositionPeriod = 64;

/// The host copy of every weight, generated from the config alone (counter-based splitmix64: element i of
/// a tensor depends only on the seed, the tensor and i). Row-major.
struct ToyModelWeights {
  int vocab = 0;
  int hidden = 0;
  std::vector<float> embedding; ///< E [vocab, hidden], U(-4, 4)
  std::vector<float> position;  ///< P [kToyPositionPeriod, hidden], U(-1, 1)
  std::vector<float> head;      ///< W [vocab, hidden], U(-s, s) with s = 1.5 * sqrt(32 / hidden), plus the
                                ///< perturbation: fma(head_perturbation, noise, W), noise ~ U(-s, s)
  std::vector<float> bias;      ///< b [vocab], U(-1, 1)
};

/// Throws smcgraph::Error naming the first bad field. Makes no CUDA call.
void validate_toy_model_config(const ToyModelConfig& config);

/// Generates the weights of `config` on the host (validates first; makes no CUDA call).
ToyModelWeights make_toy_model_weights(const ToyModelConfig& config);

class ToyModel;

/// A draft and a target built from one seed: same embeddings, positions and bias; the draft's head is
/// perturbed.
struct ToyModelPair {
  std::unique_ptr<ToyModel> draft;
  std::unique_ptr<ToyModel> target;
};

/// The embedded toy model. Construction validates the config before any CUDA call, uploads the weights
/// and zeroes the KV storage (synchronously, on a private stream); forward() is capturable.
class ToyModel final : public Model {
public:
  explicit ToyModel(const ToyModelConfig& config);

  /// Target = `config` with head_perturbation 0; draft = `config` with head_perturbation
  /// `draft_perturbation` (>= 0; 0 makes the draft identical to the target).
  static ToyModelPair pair(const ToyModelConfig& config, float draft_perturbation);

  /// Two launches on `stream`: the KV writes, then the hidden states and the LM head. Validates the
  /// arguments on the host (rows >= 0, tokens_per_row >= 1, non-null pointers); rows == 0 is a no-op.
  /// Call it with the device current that the model was constructed on.
  void forward(const ForwardArgs& args, cudaStream_t stream) override;

  int vocab() const override { return config_.vocab; }
  DType logits_dtype() const override { return config_.logits_dtype; }
  int max_seq_len() const override { return config_.max_seq_len; }
  bool last_token_logits_supported() const override { return true; }
  int hidden() const { return config_.hidden; }
  int window() const { return config_.window; }
  int pool_size() const { return config_.pool_size; }
  const ToyModelConfig& config() const { return config_; }

  /// The KV storage, device memory [pool_size, hidden] float. Tests may fill it directly.
  const float* kv_data() const { return kv_.data(); }
  float* kv_data() { return kv_.data(); }
  /// Zeroes the KV storage (enqueued on `stream`).
  void clear_kv(cudaStream_t stream) { kv_.fill_bytes(0, stream); }

private:
  ToyModelConfig config_;
  int vocab_padded_ = 0;                // vocab rounded up to the LM-head vocab tile
  int hidden_padded_ = 0;               // hidden rounded up to the LM-head hidden chunk
  DeviceBuffer<float> embedding_;       // [vocab, hidden]
  DeviceBuffer<float> position_;        // [kToyPositionPeriod, hidden]
  DeviceBuffer<float> head_t_;          // [hidden_padded, vocab_padded], transposed, zero padded
  DeviceBuffer<float> bias_;            // [vocab_padded], zero padded
  DeviceBuffer<float> kv_;              // [pool_size, hidden]
  int blocks_per_sm_[4] = {1, 1, 1, 1}; // LM-head occupancy per tokens-per-thread variant
  int multiprocessors_ = 1;
};

} // namespace smcgraph
