// Graph-safe sampling and scoring from logits (DESIGN.md §2 steps 2-5, §4).
//
// One read of the logits per (row, position) from memory. The vocabulary is cut into fixed tiles
// (sample_tile_length(): a function of the dtype only), one CTA each, and each tile into
// kSampleSubTilesPerTile sub-tiles, one per warp of that CTA (sample_subtile(): the elements the warp reads,
// not contiguous). Each sub-tile keeps a log-sum-exp (its max, then the sum relative to it, base 2) and draws
// no random numbers; the last CTA of a row combines the sub-tiles' results (a ticket counter that it resets,
// so a captured graph replays without host help) and samples in two levels, an exact two-level Gumbel-max:
//   1. a sub-tile s by Gumbel-max over log Z_s, Z_s = sum over sub-tile s of exp(alpha l_v / T), one Philox
//      word per sub-tile (philox.hpp: element kTileDrawElement + s, s numbered over the row);
//   2. the token inside sub-tile s by Gumbel-max over alpha l_v / T of that sub-tile alone, one Philox word
//      per element by its rank j in the sub-tile (element kRankDrawElement + j, j by ascending vocab id),
//      after re-reading the sub-tile (from L2; 1024 bf16 / 512 fp32 logits).
// Exactness: P(s) = Z_s / Z and P(v | s) = exp(alpha l_v / T) / Z_s, because the sub-tile noises and the
// rank noises are distinct Philox words and so independent (the rank noises do not depend on which sub-tile
// won, so the device draws them before it knows); the product is exp(alpha l_v / T) / Z, exactly
// softmax(alpha l / T), the law of a single Gumbel-max over the row. Any partition of the row into sub-tiles
// gives this law; the sampler's own (fixed per dtype) only decides which token a given key draws.
// Per-element random numbers are drawn for one sub-tile only, so the pass is bound by bytes, not by Philox.
// The host reference (tests/reference/sample_ref.hpp) draws the same words and picks the same tokens.
//
//   smcgraph::SampleWorkspace workspace(max_rows, vocab);                 // once, before capture
//   smcgraph::LogitsView logits{d_logits, smcgraph::DType::kBFloat16, rows, 1, vocab, vocab, vocab};
//   smcgraph::RowParams params{d_temperature, d_alpha};                   // per row, device memory
//   smcgraph::RowRandom random{d_seeds, d_draw_counters, /*particles_per_request=*/1};
//   smcgraph::SampleOutputs out{d_tokens, d_logprobs, d_logz, d_row_flags, d_status};
//   smcgraph::sample(logits, params, random, smcgraph::philox_stream(smcgraph::Salt::kUser, 0), out,
//                    workspace, stream);
//   smcgraph::advance_draw_counters(d_draw_counters, requests, stream);  // fresh numbers next time
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "smcgraph/philox.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph {

/// Logits `[rows, positions, vocab]`: element (r, p, v) at data + r * row_stride + p * position_stride + v
/// (strides in elements).
struct LogitsView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rows = 0;
  int positions = 1;
  int vocab = 0;
  int64_t row_stride = 0;
  int64_t position_stride = 0;
};

/// Per-row sampling parameters, read from device memory at run time (so a graph replays with new values).
struct RowParams {
  const float* temperature = nullptr; ///< [rows]; 0 means greedy argmax
  const float* alpha = nullptr;       ///< [rows] power of the target distribution; nullptr means 1
};

/// Where a row's random numbers come from (philox.hpp): row r belongs to request r / particles_per_request
/// and is particle r % particles_per_request of it.
struct RowRandom {
  const uint64_t* seeds = nullptr;         ///< [requests] Philox keys
  const uint32_t* draw_counters = nullptr; ///< [requests] advanced by advance_draw_counters
  int particles_per_request = 1;
};

/// Outputs of sample(), one per row. Rows that fail (row_flags != 0) get token kInvalidToken,
/// logprob -inf and logz 0.
struct SampleOutputs {
  int32_t* tokens = nullptr; ///< [rows] sampled token (row r at r * row_stride)
  float* logprobs = nullptr; ///< [rows] log softmax(alpha * l / T)[token] (row r at r * row_stride)
  float* logz = nullptr;     ///< [rows] lse(alpha * l / T) - alpha * lse(l / T); 0 when alpha = 1 or T = 0
  uint32_t* row_flags = nullptr; ///< [rows] RowFlag bits (OR-accumulated: the caller clears them)
  uint32_t* status = nullptr;    ///< [1] OR-accumulated RowFlag bits of all rows (the caller clears it)
  /// Elements between rows of `tokens` and `logprobs` (>= 1): a column of a [rows, row_stride] block, as the
  /// engine's draft steps write d_k into its [rows, K + 1] draft-token and log-prob blocks.
  int64_t row_stride = 1;
};

/// Outputs of score(): logits `[rows, P, V]`, tokens `[rows, P - 1]`.
struct ScoreOutputs {
  float* token_logprobs = nullptr; ///< [rows, P - 1] log softmax(l / T)[token] at positions < P - 1
  int32_t* bonus_tokens = nullptr; ///< [rows] sampled from softmax(alpha * l / T) at position P - 1
  float* bonus_logprobs = nullptr; ///< [rows]
  float* logz = nullptr;           ///< [rows] lse(alpha * l / T) - alpha * lse(l / T) at position P - 1
  uint32_t* row_flags = nullptr;   ///< [rows] RowFlag bits (OR-accumulated: the caller clears them)
  uint32_t* status = nullptr;      ///< [1] OR-accumulated
};

/// Scratch for the split-vocabulary combine (a state per sub-tile of each job, a ticket per job), sized for
/// the largest launch it will serve. Allocated and zeroed once, outside any capture; launches leave it zeroed
/// again. With a stream (CUB style) the zeroing is enqueued on it and the constructor does not wait: use the
/// workspace on that stream or on streams ordered after it. Without one the constructor waits for the
/// zeroing, so any stream may use it at once.
namespace detail {
struct SampleWorkspaceAccess; // the sampler's launcher (src/kernels/sample.cu): the scratch pointers
} // namespace detail

class SampleWorkspace {
public:
  SampleWorkspace() = default;
  SampleWorkspace(int max_jobs, int max_vocab);
  SampleWorkspace(int max_jobs, int max_vocab, cudaStream_t stream);
  ~SampleWorkspace();
  SampleWorkspace(SampleWorkspace&& other) noexcept;
  SampleWorkspace& operator=(SampleWorkspace&& other) noexcept;
  SampleWorkspace(const SampleWorkspace&) = delete;
  SampleWorkspace& operator=(const SampleWorkspace&) = delete;

  int max_jobs() const noexcept { return max_jobs_; }
  int max_vocab() const noexcept { return max_vocab_; }
  size_t bytes() const noexcept { return bytes_; }

private:
  friend struct detail::SampleWorkspaceAccess;
  int max_jobs_ = 0, max_vocab_ = 0, max_partials_ = 0;
  size_t bytes_ = 0;
  void* partials_ = nullptr;
  uint32_t* tickets_ = nullptr;
};

/// Samples one token per row from softmax(alpha * logits / T) by the two-level Gumbel-max above, with keyed
/// noise (stream = the counter word w, see philox_stream): sub-tile s (sample_subtile()) draws the word of
/// element kTileDrawElement + s, and the token of rank j in the winning sub-tile (by ascending vocab id) the
/// word of element kRankDrawElement + j, both under (seed, draw counter, particle, w).
/// T = 0 is greedy (argmax, ties to the smallest id). Never allocates or synchronizes: capturable.
void sample(const LogitsView& logits, const RowParams& params, const RowRandom& random, uint32_t stream_word,
            const SampleOutputs& out, SampleWorkspace& workspace, cudaStream_t stream);

/// One pass over `[rows, P, V]`: log-probs of the given tokens at positions < P - 1 under softmax(l / T)
/// and a bonus sample (as sample()) at position P - 1. `tokens` has row stride `token_row_stride`. At T = 0
/// the law is one-hot at the argmax, ties to the smallest id (the token a greedy draw emits): a token's
/// log-prob is 0 when it is that argmax and -inf otherwise, even when its logit ties the maximum.
/// `request_steps` (optional, device memory, [requests], read at run time): row r of request
/// q = r / random.particles_per_request scores only positions < s_q and samples its bonus at position s_q,
/// s_q = request_steps[q] clamped to [0, P - 1]; its logits past s_q are never read (they may hold anything)
/// and its token log-probs at positions >= s_q are -inf. A speculative engine passes each request's own draft
/// length K_q.
void score(const LogitsView& logits, const int32_t* tokens, int64_t token_row_stride, const RowParams& params,
           const RowRandom& random, uint32_t stream_word, const ScoreOutputs& out, SampleWorkspace& workspace,
           cudaStream_t stream, const int32_t* request_steps = nullptr);

/// draw_counters[i] += 1 for i < count (one launch; put it in the graph after the draws of a cycle).
void advance_draw_counters(uint32_t* draw_counters, int count, cudaStream_t stream);

/// Fills out[i] = Philox word for (seeds[0], element = i, counter fields) — a device/host cross-check.
void philox_words(uint64_t seed, uint32_t draw_counter, uint32_t particle, uint32_t stream_word,
                  uint32_t* out, int count, cudaStream_t stream);

/// Logits per tile, i.e. per CTA of the pass: 4096 fp32, 8192 bf16 / fp16. Tile t of a row holds vocab ids
/// [t * length, min(V, (t + 1) * length)).
int sample_tile_length(DType dtype);

/// CTAs (tiles) per (row, position) the launchers use: ceil(vocab / sample_tile_length(dtype)). It depends
/// on the vocabulary and dtype only, so a row's reduction order, its tiles and its results (bit for bit)
/// do not depend on the batch it is in.
int sample_splits(int vocab, DType dtype);

/// Sub-tiles per tile, the unit of the sampler's first level: one per warp of the tile's CTA.
inline constexpr int kSampleSubTilesPerTile = 8;

/// Logits per (full) sub-tile: sample_tile_length(dtype) / kSampleSubTilesPerTile, 512 fp32, 1024 bf16 /
/// fp16. The second level of the sampler draws a random number for each logit of one sub-tile.
int sample_subtile_length(DType dtype);

/// The sub-tile holding vocab id v, numbered over the row (tile t holds sub-tiles 8 t .. 8 t + 7); sub-tile s
/// draws the word of element kTileDrawElement + s. Sub-tile w of a tile is what warp w of its CTA reads: the
/// tile's 16-byte vectors (4 fp32 / 8 bf16 logits) w * 32 + i + 256 k, i < 32, so it is not contiguous:
/// v in tile t = v / L (L = sample_tile_length) is in sub-tile 8 t + ((v % L) / (16 / bytes) % 256) / 32.
/// The last tile's sub-tiles may be partial or empty (an empty one never wins).
int sample_subtile(int vocab_id, DType dtype);

/// How the tiles of one (row, position) meet in sample() and score(): as one thread-block cluster, exchanging
/// their partial states through distributed shared memory, or through the workspace and a last-arrival
/// ticket. Clusters are the default for small launches, where they measured faster: 2 to 8 tiles a job (bf16
/// / fp16 vocabularies up to 65536, fp32 up to 32768) and at most 64 CTAs (jobs x tiles), on Hopper or later.
/// Both give the same bits. SMCGRAPH_DISABLE_SAMPLER_CLUSTER=1 turns clusters off at start;
/// set_sample_clusters() switches them for launches made (or captured) after it, for benches and tests. Not
/// synchronised with launches on other host threads.
void set_sample_clusters(bool enabled);

/// The switch set_sample_clusters() sets (true unless turned off).
bool sample_clusters_enabled();

/// Whether a launch of `jobs` (rows x positions) over `vocab` logits of `dtype` made now on the current
/// device runs in cluster mode.
bool sample_uses_clusters(int jobs, int vocab, DType dtype);

/// Walk mode, the third way (besides clusters and tickets) for a job's tiles to meet in sample() and score():
/// a job's CTAs fold its tiles one after another instead of one CTA a tile. Each tile is folded by the same
/// threads in the same order as a tile's own CTA folds it, and the states merge in the same order, so the
/// bits are those of the other modes. It serves launches that cluster mode does not take, with 2 to 64
/// tiles a job, by default only those whose CTAs fill at least 95% of the waves they take, in one of two
/// forms:
/// - the register walk: one CTA a job (two an SM, the next two tiles' loads in flight in registers), the
///   sub-tile states in shared memory; no workspace, fence or ticket. For jobs that fill waves of one CTA a
///   job (256 x 128256 bf16: 15% faster than tickets on an H200).
/// - the staged walk: `walkers` CTAs a job (four an SM; as many as one wave holds for the launch's jobs, each
///   walking at least two tiles, the next two copied into shared memory by cp.async), the last to finish
///   merging through the workspace as ticket mode does. For fewer jobs: on an H200, 64 x 128256 bf16 (eight
///   walkers) 18.1 -> 16.0 us and 128 x 128256 (four) 28.2 -> 23.2 us after a kernel that flushed L2.
/// Launches whose CTAs would fill neither (1-8 rows; 96 or 192 rows of 128256, where the walkers' tiles
/// do not divide into a full wave) stay in ticket mode.
/// set_sample_walk_min_jobs(n) walks every launch of at least n jobs instead (1: all it can take; staged
/// where a job gets more than one walker), INT_MAX none, 0 restores the default;
/// SMCGRAPH_SAMPLER_WALK_MIN_JOBS=<n> sets it at start and SMCGRAPH_DISABLE_SAMPLER_WALK=1 turns the mode
/// off. For benches and tests; not synchronised with launches on other host threads.
void set_sample_walk_min_jobs(int jobs);

/// The setting set_sample_walk_min_jobs() sets (0: the default rule).
int sample_walk_min_jobs();

/// The most CTAs a walked job takes (its walkers, each folding a consecutive run of its tiles; the last to
/// finish merges): 0 (the default) takes as many as one wave of walk CTAs holds for the launch's jobs, each
/// walking at least two tiles; n caps them at n (1: one CTA a job). SMCGRAPH_SAMPLER_WALKERS=<n> sets it at
/// start. The same bits at any count. For benches and tests; not synchronised with launches on other host
/// threads.
void set_sample_walk_max_walkers(int walkers);

/// The setting set_sample_walk_max_walkers() sets (0: the default rule).
int sample_walk_max_walkers();

/// Whether a launch of `jobs` over `vocab` logits of `dtype` made now on the current device runs in walk
/// mode.
bool sample_uses_walk(int jobs, int vocab, DType dtype);

} // namespace smcgraph
