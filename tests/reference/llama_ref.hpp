// Host reference of LlamaModel (src/models/llama/): the numerics contract of include/smcgraph/llama_model.hpp
// (fp32 residual; RMSNorm output, q, k, v, the attention output and the SwiGLU activation rounded to bf16;
// adjacent-pair RoPE with float inv_freq and a float angle) over the same bf16 weights, with KV storage per
// slot laid out as the device's. Sums run in double, so the device (fp32 sums in its own order) differs by
// its accumulation error plus the bf16 roundings that error flips: compare with a tolerance (compare_logits).
//
//   smcgraph::LlamaHostWeights host = smcgraph::load_llama_host_weights(file);
//   smcgraph::reference::LlamaReference ref(host, /*layers=*/{}, /*pool_size=*/4096, /*max_seq_len=*/256);
//   std::vector<double> logits(in.rows * in.tokens_per_row * host.config.vocab, poison);
//   ref.forward(in, logits);   // writes every KV of the forward, then attends; padding rows untouched
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "smcgraph/llama_model.hpp"

namespace smcgraph::reference {

/// Host copies of ForwardArgs' arrays (same shapes and layouts).
struct LlamaForwardInputs {
  int rows = 0;
  int tokens_per_row = 0;
  std::vector<int32_t> tokens;     ///< [rows, tokens_per_row]
  std::vector<int32_t> positions;  ///< [rows, tokens_per_row]
  std::vector<int32_t> slot_table; ///< [rows, max_seq_len]
  std::vector<int32_t> seq_lens;   ///< [rows]
  std::vector<int32_t> out_slots;  ///< [rows, tokens_per_row]
  std::vector<uint8_t> live;       ///< [rows]
};

enum class LlamaNumerics {
  kContract,      ///< the contract's bf16 / fp32 rounding points, sums in double: what the device should give
  kContractFloat, ///< the same rounding points, sums in fp32 in index order: a device-like summation order,
                  ///< to size the tolerances on the host (tests/test_llama_cpu.cpp)
  kExact,         ///< no rounding at all (float64 everywhere, exact RoPE angles) over the same bf16 weights:
                  ///< how far the bf16 contract itself is from the exact math
};

class LlamaReference {
public:
  /// `weights` must outlive the reference. `layers` (strictly increasing; empty: all) as
  /// LlamaModelOptions::layers. The KV storage starts at zero.
  LlamaReference(const LlamaHostWeights& weights, std::vector<int> layers, int pool_size, int max_seq_len,
                 LlamaNumerics numerics = LlamaNumerics::kContract);

  const LlamaConfig& config() const { return weights_.config; }
  const std::vector<int>& layers() const { return layers_; }
  int pool_size() const { return pool_size_; }
  int max_seq_len() const { return max_seq_len_; }
  LlamaNumerics numerics() const { return numerics_; }

  /// KV [layers().size(), pool_size, 2 (K, V), kv_heads, head_dim], the device's layout; bf16 values in the
  /// contract modes.
  const std::vector<double>& kv() const { return kv_; }
  std::vector<double>& kv() { return kv_; }
  void clear_kv() {
    kv_.assign(kv_.size(), 0.0);
    kv_flip_.assign(kv_flip_.size(), 0.0);
  }
  /// Per stored K/V element (the layout of kv()), how far it moves if two of the RMSNorm outputs it is
  /// computed from round to the neighbouring bf16 value: the sum of the two largest ulp(n_i) |w_i| (K: of
  /// both RoPE partners). The device's norm scale comes from rsqrtf (within 2 ulp of the contract's), so an
  /// input a hair from a bf16 rounding boundary may round the other way; compare_kv allows this on top of its
  /// slack.
  const std::vector<double>& kv_flip() const { return kv_flip_; }

  /// One forward: per layer, every live token's K and V is written first (slot = out_slots, dropped when
  /// outside [0, pool_size)), then every live token attends over positions 0 .. min(p, seq_len - 1) read
  /// through slot_table (an id outside [0, pool_size) reads slot 0; an empty range gives a zero output).
  /// Tokens outside [0, vocab) are clamped. Logits [rows, tokens_per_row, vocab] of live rows, before any
  /// bf16 rounding of a bf16 logits dtype; padding rows are left untouched.
  void forward(const LlamaForwardInputs& in, std::vector<double>& logits);

private:
  double to_float(double value) const; // fp32 rounding point (identity in kExact)
  double to_bf16(double value) const;  // bf16 rounding point (identity in kExact)
  double dot(const uint16_t* w, const double* x, int n) const;
  void rms_norm(const double* x, const float* weight, double* out) const;
  void rope(double* v, int position) const;

  const LlamaHostWeights& weights_;
  std::vector<int> layers_;
  int pool_size_, max_seq_len_;
  LlamaNumerics numerics_;
  std::vector<double> kv_, kv_flip_;
};

/// bf16 rounding (nearest even) of a float, as the device's __float2bfloat16_rn (NaN stays NaN).
float round_bf16(float value);

/// Rows decoding over several forwards. Row r owns sequence `tokens[r]` and a slot per position `slots[r]`
/// (distinct over the whole batch and never 0); `done[r]` positions already have KV. next() builds the
/// forward that feeds the following `tokens_per_row` tokens of each live row; padding rows get garbage
/// everywhere except valid-looking out_slots (a write through them would show in the KV).
struct LlamaSequences {
  int vocab = 0, pool_size = 0, max_seq_len = 0;
  std::vector<std::vector<int32_t>> tokens, slots;
  std::vector<int> done;
  std::vector<uint8_t> live;

  /// Garbage after seq_len in the slot tables: random ids, valid and invalid (must not be read).
  LlamaForwardInputs next(int tokens_per_row, std::mt19937_64& engine) const;
  void advance(int tokens_per_row);
};

/// `lengths.size()` rows, row r live with probability `live_fraction` (row 0 always) with a random sequence
/// of lengths[r] tokens; slots drawn without replacement from [1, pool_size).
LlamaSequences random_llama_sequences(const std::vector<int>& lengths, int vocab, int pool_size,
                                      int max_seq_len, double live_fraction, std::mt19937_64& engine);

/// Tolerances of a device forward against the kContract reference. A correct device differs from kContract
/// only by fp32-level effects (summation order, fp32 transcendentals), but every bf16 rounding point turns a
/// tiny input difference into whole-ulp flips for a fraction of the elements, and the flips cascade through
/// the layers towards the contract's own bf16 noise (|kContract - kExact|); at most a device is as far from
/// kContract as a second, independent bf16 rounding of the same math (~sqrt(2) x that noise). So the bounds
/// sit at that level, which still leaves wrong math (a RoPE pairing, a head mapping, a missed position, a
/// wrong slot: errors of the order of the values themselves) far outside them. Measured on the tiny models of
/// tests/test_llama_cpu.cpp (25 runs), with kContractFloat (fp32 sums in index order) standing in for a
/// device:
/// - per logit |got - want| <= kLlamaLogitTolerance * max(1, |want|): kContractFloat <= 0.03,
///   |kContract - kExact| <= 0.071;
/// - over all compared logits rms(got - want) <= kLlamaNoiseFraction * rms(want - exact): kContractFloat
///   0.02-0.6 (how many tokens cascaded), a device without the rounding points 1, full decorrelation ~1.4;
/// - KV per compare_kv: kContractFloat <= 0.034 x the head vector's rms in deeper layers (only +-1 ulp flips
///   in the first layer run), |kContract - kExact| <= 0.069.
/// tests/test_llama_cpu.cpp re-measures all of it on every run and checks the margins.
inline constexpr double kLlamaLogitTolerance = 0.15;
inline constexpr double kLlamaNoiseFraction = 1.0;
inline constexpr double kLlamaKvFirstLayerSlack = 1.0 / 256;
inline constexpr double kLlamaKvSlack = 0.125;

/// How close logits are to the contract reference. Errors are |got - want| / max(1, |want|).
struct LogitsAgreement {
  size_t compared = 0;    ///< logits of live tokens compared
  double max_error = 0.0; ///< the largest scaled error
  double rms_error = 0.0; ///< rms of got - want
  double rms_noise = 0.0; ///< rms of want - exact: the bf16 rounding noise of the contract (0 without exact)
  int top_mismatches = 0; ///< tokens whose argmax differs although want's top-2 gap exceeds tolerance
  int near_ties = 0;      ///< tokens whose argmax differs within that gap (allowed)
  std::string problem;    ///< the first logit out of tolerance or top mismatch; empty when none
  bool ok() const { return problem.empty(); }
  std::string summary() const;
};

/// Compares the logits of live tokens (`got`, `want`, `exact` all [rows, tokens_per_row, vocab]; `exact`
/// may be null).
LogitsAgreement compare_logits(const LlamaForwardInputs& in, int vocab, const std::vector<double>& got,
                               const std::vector<double>& want, const std::vector<double>* exact,
                               double tolerance);

/// How close bf16 KV storage ([layers, pool, 2, kv_heads, head_dim] bits) is to a contract reference's KV.
/// An element may differ from the reference by one bf16 ulp of its value plus `slack` x the rms of its
/// head vector (`first_layer_slack` in the first layer run, whose inputs are the exact embeddings);
/// an all-zero reference vector (a slot never written) must be exactly zero.
struct KvAgreement {
  size_t compared = 0, differing = 0;
  double max_excess = 0.0; ///< max |got - want| / rms of the head vector
  std::string problem;
  bool ok() const { return problem.empty(); }
};
KvAgreement compare_kv(const std::vector<uint16_t>& got, const LlamaReference& want, double first_layer_slack,
                       double slack);
/// The same comparison between two references (the host measurement of the tolerances).
KvAgreement compare_kv(const LlamaReference& got, const LlamaReference& want, double first_layer_slack,
                       double slack);

} // namespace smcgraph::reference
