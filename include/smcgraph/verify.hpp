// The rejection-based speculative cycle's verification (DESIGN.md §3) and the fused verify-and-pack.
//
// draft_steps (K) is the number of draft tokens per row, the same name as EngineConfig::draft_steps (seed 000
// and the speculative-decoding papers call it gamma); the verifiers accept up to kMaxVerifyDraftSteps.
//
// verify_greedy      one warp per row, ceil(draft_steps / 32) warp ballots whatever the outcome, first
//                    mismatch by __ffs: accepted length k, mismatch flag, next token (target[k]: the
//                    correction, or the bonus target[draft_steps] when everything matched).
// verify_stochastic  exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept d_j with
//                    probability min(1, p(d_j) / q(d_j)) by a keyed Philox coin; at the first rejection
//                    sample max(0, p - q) normalised by a two-level Gumbel-max in log space, in one pass
//                    over that position's target and draft logits plus a re-read of one sub-tile (the
//                    residual is never materialised); on full acceptance sample the bonus from p at
//                    position draft_steps.
// verify_and_pack    greedy verification + exclusive offsets of the packed counts + the packed payload in ONE
//                    launch: a static grid of (row tile x split) CTAs, decoupled look-back across tiles,
//                    16-byte copies spread over the whole GPU, no host sync, any number of rows.
// pack_accepted      the same pack, taking accepted counts that an earlier verify wrote to device memory.
//
// Every launcher validates its arguments (smcgraph::Error names the parameter and the value), takes the
// stream last, never allocates or synchronizes (so it can be captured), and reads everything that changes
// between graph replays (tokens, log-probs, temperatures, seeds, draw counters, counts) from device memory.
//
//   // greedy, seed 000's interface (K = draft_steps): draft [B, K], target [B, K + 1], draft KV [B, K, D]
//   smcgraph::PackWorkspace workspace(max_rows);                        // once, before capture
//   smcgraph::TokenVerifyInputs in{d_draft, K, d_target, K + 1, rows, /*draft_steps=*/K, vocab};
//   smcgraph::PayloadView kv{d_kv, smcgraph::DType::kFloat16, kv_dim, int64_t{K} * kv_dim};
//   kv.ready_before_wait = true; // optional: the draft forward wrote d_kv before the target's kernels ran
//   kv.expected_packed_fraction = acceptance_rate; // optional: large ready payloads copy in source order
//   smcgraph::VerifyOutputs verdict{d_accepted, d_next_tokens, d_mismatch};
//   smcgraph::PackOutputs packed{d_packed_kv, int64_t{rows} * K, d_offsets, d_total};
//   smcgraph::verify_and_pack(in, kv, /*include_next=*/false, verdict, packed, workspace, stream);
//
// Row failures (DESIGN.md §7) never throw: they set RowFlag bits, OR-ed into `row_flags` (the caller clears
// them, as for sample()) and into `status`, and the row's outputs stay well defined and in bounds:
//   kFlagTokenOutOfRange  the first rejected position holds a draft id outside [0, vocab) (e.g. -1 padding):
//                         it counts as a mismatch there; or the target's token to emit is out of range (next
//                         token kInvalidToken).
//   kFlagNanLogit         stochastic: a NaN / +inf log-prob at the first rejected position, or a NaN /
//                         +inf logit in the row the next token is drawn from (next token kInvalidToken).
//   kFlagAllMasked        stochastic: nothing to draw the next token from (next token kInvalidToken).
//   kFlagBadParameter     stochastic: a temperature < 0 or not finite (accepted 0, next token kInvalidToken).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "smcgraph/runtime.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph {

/// Draft tokens `[rows, draft_steps]` and the target's tokens `[rows, draft_steps + 1]` (greedy: the target's
/// argmax at each verified position; column draft_steps is the bonus). Row strides are in elements.
struct TokenVerifyInputs {
  const int32_t* draft_tokens = nullptr;
  int64_t draft_row_stride = 0; ///< >= draft_steps
  const int32_t* target_tokens = nullptr;
  int64_t target_row_stride = 0; ///< >= draft_steps + 1
  int rows = 0;
  int draft_steps = 0; ///< draft tokens per row, 1 .. kMaxVerifyDraftSteps
  int vocab = 0;       ///< ids outside [0, vocab) are out of range

  /// Throws Error naming the first bad field (`where` prefixes the message).
  void validate(const char* where) const;
};

/// Largest draft_steps any verifier accepts: the bonus's Philox step (draft_steps) and the ballot scan's
/// rejection code (position << 8) both hold 24 bits. The engine's own limit, kMaxDraftSteps (engine.hpp), is
/// checked against it by a static_assert in engine_validation.cpp.
inline constexpr int kMaxVerifyDraftSteps = static_cast<int>(kMaxStep) - 1;

/// Per-row results of a verification.
struct VerifyOutputs {
  int32_t* accepted = nullptr;    ///< [rows] k: leading draft tokens accepted, 0 .. draft_steps
  int32_t* next_tokens = nullptr; ///< [rows] token committed after them (correction or bonus)
  uint8_t* mismatch = nullptr;    ///< optional [rows] 1 when k < draft_steps (a draft token was rejected)
  uint32_t* row_flags = nullptr;  ///< optional [rows] RowFlag bits, OR-ed in (the caller clears them)
  uint32_t* status = nullptr;     ///< optional [1] OR of every row's flags (the caller clears it)

  void validate(const char* where) const;
};

/// Greedy verification. rows / 8 CTAs of 8 warps; ceil(draft_steps / 32) ballots per row, whatever happens.
void verify_greedy(const TokenVerifyInputs& inputs, const VerifyOutputs& out, cudaStream_t stream);

/// Inputs of exact speculative sampling. Row r belongs to request r / particles_per_request (its seed and
/// draw counter), as in sample(). The coin of position j is Philox word 0 of counter
/// {0, draw counter, particle, philox_stream(kAcceptCoin, j)}; the Gumbel noise of vocab id v at the drawn
/// position j (j = draft_steps for the bonus) is word v % 4 of {v / 4, draw counter, particle,
/// philox_stream(kResidual, j)}, g = -log(-log u). Advance the draw counters between cycles.
///
/// p = softmax(target_logits / T_t), q = softmax(draft_logits / T_d). The coins need only log p(d_j) and
/// log q(d_j) (what score() and sample() already wrote); the drawn position also reads its target and draft
/// logits rows once, recovering each log-sum-exp from the given log-prob of the draft token there
/// (lse = l[d] / T - log p(d); a separate reduction over the row only when that is not finite, e.g.
/// p(d) = 0). T = 0 means greedy: p (or q) is one-hot at the target's argmax (at the draft token).
struct StochasticVerifyInputs {
  const int32_t* draft_tokens = nullptr; ///< [rows, draft_steps]
  int64_t draft_token_row_stride = 0;
  const float* draft_logprobs = nullptr; ///< [rows, draft_steps] log q(d_j) (sample()'s logprobs)
  int64_t draft_logprob_row_stride = 0;
  const float* target_logprobs = nullptr; ///< [rows, draft_steps] log p(d_j) (score()'s token_logprobs)
  int64_t target_logprob_row_stride = 0;
  LogitsView draft_logits;  ///< [rows, >= draft_steps, V] or position-major; row_stride 0 repeats one row
  LogitsView target_logits; ///< [rows, >= draft_steps + 1, V]; same dtype rules, same V
  const float* draft_temperature = nullptr;  ///< [rows] T_d >= 0
  const float* target_temperature = nullptr; ///< [rows] T_t >= 0
  RowRandom random;
  int draft_steps = 0;
  /// Optional [rows] draft length of each row, clamped to [0, draft_steps] (null: draft_steps for every row;
  /// 0: the row drafted nothing and only draws its bonus from p at position 0).
  /// Row r verifies its first row_draft_steps[r] tokens only: it accepts at most that many, draws the bonus
  /// from p at position row_draft_steps[r], and reads none of its tokens, log-probs or logits past it.
  const int32_t* row_draft_steps = nullptr;
};

/// Exact speculative sampling (a warp ballot scan of the coins, then one draw from the drawn position).
/// rows = target_logits.rows, vocab = target_logits.vocab.
///
/// The draw. At T_t = 0 the target's argmax (ties to the smallest id). Otherwise an exact two-level
/// Gumbel-max over the log-weights w_v of the law (log p_v, or log(p_v - q_v) for the residual): the row is
/// cut into tiles of verify_tile_length(vocab, dtype) logits, one CTA of verify_threads(vocab) threads each,
/// and each tile into sub-tiles, the elements one warp of the CTA reads (warp w of tile t reads the tile's
/// 16-byte vectors k * threads + 32 w + lane; sub-tile s = t * threads / 32 + w over the row). Level 1 picks
/// s by Gumbel-max over log Z_s (Z_s = the sum of e^{w_v} over s) with the Philox word of element
/// kTileDrawElement + s; level 2 picks v inside s alone by Gumbel-max over w_v with the word of element v.
/// P(s) = Z_s / Z and P(v | s) = e^{w_v} / Z_s, from independent words, so P(v) = e^{w_v} / Z: exactly the
/// law of one Gumbel-max over the row, with per-element noise for one sub-tile only. A rejection whose
/// residual has no mass left (p ~= q to float precision) draws from p the same way. A row of several tiles
/// meets in its last CTA (a ticket) through `workspace` (sized SampleWorkspace(>= rows, >= vocab); the engine
/// shares its sampler's); a row of one tile is one CTA and leaves the workspace alone. The host reference
/// (tests/reference/verify_ref.hpp) draws the same words. Never allocates or synchronizes: capturable.
void verify_stochastic(const StochasticVerifyInputs& inputs, const VerifyOutputs& out,
                       SampleWorkspace& workspace, cudaStream_t stream);

/// Threads of verify_stochastic()'s CTAs for rows of `vocab` logits: 32 up to 1024 logits, 128 above.
int verify_threads(int vocab);

/// Logits per tile (per CTA) of verify_stochastic()'s draw: 4096 bf16 / fp16 or 2048 fp32 above 1024 logits
/// (128 threads x 4 vectors of 16 bytes), the whole row (rounded up to 32 threads x 4 vectors) below.
int verify_tile_length(int vocab, DType dtype);

/// A payload `[rows, positions, width]` to pack (KV slices, hidden states): element (i, j, e) at
/// data + i * row_stride + j * width + e (positions dense within a row; row_stride in elements).
struct PayloadView {
  const void* data = nullptr;
  DType dtype = DType::kFloat16; ///< only its size matters: the copy moves bits
  int width = 0;                 ///< D
  int64_t row_stride = 0;        ///< >= packed positions per row (draft_steps, or draft_steps + 1) * width
  /// The caller vouches that these bytes were written by work that completed before the kernel just before
  /// the pack in the stream began (in a speculative cycle the draft forward wrote the draft's KV, and the
  /// target's forward and argmax ran after it). A small launch (pack_preloads) may then load its payload
  /// before its PDL wait, while that kernel finishes, instead of after the verify. Leave it false when the
  /// previous kernel writes the payload. The results are the same bits either way.
  bool ready_before_wait = false;
  /// Optional hint in [0, 1]: the fraction of the stored positions the caller expects to be packed (its
  /// running acceptance rate, say; 0 = no expectation). A large launch with a ready payload and a hint of at
  /// least kSourceOrderMinPacked copies in source order: it loads its first batch of the stored payload,
  /// accepted positions or not, before its PDL wait, and so also reads that batch's rejected positions
  /// (NVIDIA H200, b 32, gamma 128, kv 2048 fp16: 12.2 -> 11.0 us at acceptance 0.9, 7.0 -> 8.5 at 0.3). The
  /// results are the same bits whatever the hint.
  float expected_packed_fraction = 0.0f;
};

/// The least PayloadView::expected_packed_fraction at which a large launch copies in source order.
inline constexpr float kSourceOrderMinPacked = 0.7f;

/// Outputs of the pack. Row i's packed positions are j = 0 .. k_i - 1, plus j = k_i when include_next;
/// they land at packed rows offsets[i] .. offsets[i] + count_i - 1, rows in order.
struct PackOutputs {
  void* packed = nullptr;           ///< [capacity_rows, width] in the payload's dtype
  int64_t capacity_rows = 0;        ///< >= rows * (draft_steps + include_next), the worst case
  int32_t* offsets = nullptr;       ///< [rows] exclusive prefix sum of the packed counts
  int32_t* total = nullptr;         ///< [1] packed rows written
  int32_t* packed_tokens = nullptr; ///< optional [capacity_rows]: d_j for j < k_i, the next token at j = k_i

  void validate(const char* where, int64_t required_rows) const;
};

/// Scratch of the cross-tile look-back: an exit counter, a generation and one status word per row tile.
/// Allocated and zeroed once, outside any capture; every launch leaves it ready for the next one (graph
/// replays need no memset). Launches that share a workspace must be ordered (one stream or one graph).
class PackWorkspace {
public:
  PackWorkspace() = default;
  /// Zeroes its words and waits, so any stream may use it at once.
  explicit PackWorkspace(int max_rows);
  /// CUB style: zeroes on `stream` without waiting; use it on that stream or streams ordered after it.
  PackWorkspace(int max_rows, cudaStream_t stream);
  int max_rows() const noexcept { return max_rows_; }
  unsigned long long* words() noexcept { return words_.data(); }
  size_t bytes() const noexcept { return words_.bytes(); }

private:
  int max_rows_ = 0;
  DeviceBuffer<unsigned long long> words_;
};

/// Greedy verification and pack in one launch. `payload` has >= draft_steps (+1 with include_next) positions;
/// include_next = false packs seed 000's kv[i, 0:k_i]; true also packs position k_i (e.g. the target's hidden
/// state of the last committed token). `verdict.mismatch / row_flags / status` stay optional.
void verify_and_pack(const TokenVerifyInputs& inputs, const PayloadView& payload, bool include_next,
                     const VerifyOutputs& verdict, const PackOutputs& out, PackWorkspace& workspace,
                     cudaStream_t stream);

/// Accepted counts (and what packed_tokens needs) that an earlier verify wrote to device memory.
struct AcceptedRows {
  const int32_t* accepted = nullptr; ///< [rows]; values are clamped to [0, draft_steps]
  int rows = 0;
  int draft_steps = 0;
  const int32_t* draft_tokens = nullptr; ///< [rows, draft_steps]; only with out.packed_tokens
  int64_t draft_row_stride = 0;
  const int32_t* next_tokens = nullptr; ///< [rows]; only with out.packed_tokens and include_next
};

/// The pack of verify_and_pack for counts already in device memory (e.g. verify_stochastic's output): the
/// graph-friendly stage the speculative cycle runs after its verify node.
void pack_accepted(const AcceptedRows& accepted, const PayloadView& payload, bool include_next,
                   const PackOutputs& out, PackWorkspace& workspace, cudaStream_t stream);

/// How the pack launchers cut the work (exposed for tests and benches): rows per tile, tiles, and CTAs per
/// tile (splits); grid = tiles * splits. tiles > 1 means the launch chains tiles through the workspace.
struct PackLaunchShape {
  int rows_per_tile = 0;
  int tiles = 0;
  int splits = 0;
};
PackLaunchShape pack_launch_shape(int rows, int draft_steps, int width, DType dtype, bool include_next,
                                  bool counts_given);

/// Whether a launch of this shape preloads a payload marked ready_before_wait: it is one row tile (no
/// look-back across tiles), its whole payload (rows x (draft_steps + include_next) positions, accepted or
/// not) is at most multiprocessors x 16 KiB, and each CTA's share of it is one batch of its copy loop (256
/// threads x 4 copies of `vector_bytes`, the widest of 16, 8, 4 and 2 that divides a position, the row
/// stride and both pointers).
bool pack_preloads(int rows, int draft_steps, int width, DType dtype, bool include_next, bool counts_given,
                   int vector_bytes);

/// Whether a launch of this shape copies `payload` in source order (PayloadView::expected_packed_fraction):
/// its copy is wide (16-byte copies, more than 16 KiB of stored payload a CTA), the payload is marked
/// ready_before_wait and its expected_packed_fraction is at least kSourceOrderMinPacked
/// (SMCGRAPH_PACK_ORDER=packed / source overrides the hint). Only width, dtype, ready_before_wait and
/// expected_packed_fraction of `payload` matter; `vector_bytes` as for pack_preloads.
bool pack_source_order(int rows, int draft_steps, const PayloadView& payload, bool include_next,
                       bool counts_given, int vector_bytes);

} // namespace smcgraph
