// verify_greedy() and verify_stochastic(): the verify stage of the speculative cycle (DESIGN.md §3).
//
// Both scan a row's draft positions with warp ballots (ceil(draft_steps / 32) of them whatever the outcome,
// so lanes never diverge on where the first rejection is). The stochastic verifier then draws the next token
// from one position of the row (the residual max(0, p - q) at the first rejection, or p at position
// draft_steps) by Gumbel-max in log space, as follows.
//
// The stochastic verifier splits the vocabulary: a row is `splits` CTAs (a tile of verify_tile_length()
// logits each), and every CTA runs the row's coins itself (a few loads and Philox words) and then folds its
// tile. At T_t = 0 the draw is the argmax: each tile's best (larger logit, ties to the smaller id: a total
// order, so the winner does not depend on the cut) goes to the workspace and the row's last CTA (a ticket it
// resets: kernels/ticket.cuh) takes the best of them. Otherwise it is the two-level Gumbel-max of verify.hpp:
// each warp's sub-tile log-sum-exp of the law's weights goes to the workspace (shared memory for a one-tile
// row), and the last CTA picks the sub-tile (one Philox word each), re-reads it from L2 and races its
// elements with their own Gumbel noise. Per-element noise is drawn for one sub-tile only, so the first pass
// is bound by bytes (and, for the residual, by its exponentials), not by Philox.
#include "kernels/pdl.cuh"
#include "kernels/launch_checks.hpp"
#include "kernels/logits_pass.cuh"
#include "kernels/draft_steps_device.cuh"
#include "kernels/verify_device.cuh"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include <cub/block/block_reduce.cuh>

#include "kernels/random.cuh"
#include "smcgraph/error.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/verify.hpp"

namespace smcgraph {
namespace {

// ---------------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------------

constexpr int kGreedyThreads = 256;
constexpr int kGreedyWarps = kGreedyThreads / 32;
constexpr int kWindowsPerBatch = 4; // ballot windows whose loads are issued together

using device::out_of_range;

struct GreedyArgs {
  TokenVerifyInputs in;
  VerifyOutputs out;
};

/// One warp per row. The loads of kWindowsPerBatch windows are issued before their ballots, so a long row
/// (draft_steps = 256: 8 windows) waits for memory twice, not eight times.
__global__ void __launch_bounds__(kGreedyThreads) GreedyVerifyKernel(const GreedyArgs args) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const TokenVerifyInputs& in = args.in;
  const int row = blockIdx.x * kGreedyWarps + static_cast<int>(threadIdx.x) / 32;
  if (row >= in.rows)
    return; // warp-uniform
  const int lane = threadIdx.x % 32;
  const int32_t* draft = in.draft_tokens + row * in.draft_row_stride;
  const int32_t* target = in.target_tokens + row * in.target_row_stride;

  uint32_t first = device::kNoRejection;
  for (int batch = 0; batch < in.draft_steps; batch += 32 * kWindowsPerBatch) {
    int32_t draft_token[kWindowsPerBatch], target_token[kWindowsPerBatch];
#pragma unroll
    for (int w = 0; w < kWindowsPerBatch; ++w) {
      const int j = batch + 32 * w + lane;
      draft_token[w] = j < in.draft_steps ? draft[j] : 0;
      target_token[w] = j < in.draft_steps ? target[j] : 0;
    }
#pragma unroll
    for (int w = 0; w < kWindowsPerBatch; ++w) {
      const int base = batch + 32 * w;
      if (base >= in.draft_steps)
        break; // warp-uniform: exactly ceil(draft_steps / 32) ballots per row
      const bool inside = base + lane < in.draft_steps;
      const bool bad = inside && out_of_range(draft_token[w], in.vocab);
      const bool reject = inside && (bad || draft_token[w] != target_token[w]);
      first = min(first, device::first_rejection(reject, bad ? kFlagTokenOutOfRange : 0u, base));
    }
  }
  if (lane != 0)
    return;
  const int accepted = first == device::kNoRejection ? in.draft_steps : static_cast<int>(first >> 8);
  uint32_t flags = first == device::kNoRejection ? 0u : (first & 0xffu);
  int32_t next_token = target[accepted];
  if (out_of_range(next_token, in.vocab)) {
    flags |= kFlagTokenOutOfRange;
    next_token = kInvalidToken;
  }
  device::write_verdict(args.out, row, accepted, in.draft_steps, next_token, flags);
}

// --- stochastic ------------------------------------------------------------------------------------------

/// Largest Gumbel noise a Philox uniform can give: u <= 1 - 2^-24, so -log(-log u) <= 16.6355. An element
/// whose log-weight is this far below the best score so far cannot win, and skips its noise.
constexpr float kMaxGumbel = 16.64f;

/// How the next token is drawn from one position.
enum class Draw : int {
  kResidual,     ///< max(0, p - q): score log(p_v - q_v) + Gumbel_v
  kTarget,       ///< p (the bonus, and the residual's fallback): score l_v / T_t + Gumbel_v
  kTargetExcept, ///< p without `excluded` (the residual when q is one-hot at the draft token, T_d = 0)
  kArgmax,       ///< T_t = 0: p is one-hot at the target's argmax, whatever q is
};

/// What a draw needs besides the logits (read from device memory by the kernel).
struct DrawContext {
  uint64_t seed;
  uint32_t draw_counter, particle, stream_word;
  float inverse_target_t, target_lse; // log p_v = l_t[v] * inverse_target_t - target_lse
  float inverse_draft_t, draft_lse;   // log q_v likewise
  int excluded;
  int vocab;
};

struct Candidate {
  float score;
  int index; ///< INT_MAX when none
};

struct BetterCandidate { // larger score; ties to the smaller vocab id
  __device__ __forceinline__ Candidate operator()(const Candidate& a, const Candidate& b) const {
    if (a.score != b.score)
      return a.score > b.score ? a : b;
    return a.index <= b.index ? a : b;
  }
};

struct LogSumExp {
  float max, sum; ///< sum of exp(x - max)
};

struct MergeLogSumExp {
  __device__ __forceinline__ LogSumExp operator()(const LogSumExp& a, const LogSumExp& b) const {
    const float m = detail::max_nan(a.max, b.max);
    if (m == -INFINITY || m != m)
      return {m, m == -INFINITY ? 0.0f : NAN};
    const float sum_a = a.max == -INFINITY ? 0.0f : a.sum * expf(a.max - m);
    const float sum_b = b.max == -INFINITY ? 0.0f : b.sum * expf(b.max - m);
    return {m, sum_a + sum_b};
  }
};

/// log(1 - e^x) for x <= 0, accurate at both ends (Maechler 2012).
__device__ __forceinline__ float log1mexp(float x) {
  return x > -0.693147182f ? logf(-expm1f(x)) : log1pf(-expf(x));
}

__device__ __forceinline__ bool bad_value(float x) {
  return x != x || x == INFINITY;
}

template <DType DTYPE, int THREADS> struct RowPass {
  using Traits = detail::DTypeTraits<DTYPE>;
  using Scalar = typename Traits::Scalar;
  static constexpr int kPerVector = Traits::kPerVector;
  static constexpr int kUnroll = detail::kUnrollVectors;
  using CandidateReduce = cub::BlockReduce<Candidate, THREADS>;
  using LseReduce = cub::BlockReduce<LogSumExp, THREADS>;
  union TempStorage {
    typename CandidateReduce::TempStorage candidate;
    typename LseReduce::TempStorage lse;
  };

  static __device__ bool aligned(const Scalar* row) {
    return reinterpret_cast<uintptr_t>(row) % detail::kVectorBytes == 0;
  }

  /// log-sum-exp of row * inverse_temperature; every thread gets it. A second read of the row, taken only
  /// when the log-sum-exp cannot be recovered from the given log-prob (p(d) = 0, an out-of-range draft id).
  static __device__ float log_sum_exp(const Scalar* row, float inverse_temperature, int vocab,
                                      TempStorage& temp, float* broadcast) {
    const bool row_aligned = aligned(row);
    const MergeLogSumExp merge;
    LogSumExp state{-INFINITY, 0.0f};
    for (int first = threadIdx.x * kPerVector; first < vocab; first += THREADS * kPerVector) {
      float values[kPerVector];
      detail::unpack<DTYPE>(
          detail::load_vector<DTYPE>(row, first, min(kPerVector, vocab - first), row_aligned), values);
#pragma unroll
      for (int i = 0; i < kPerVector; ++i)
        state = merge(state, LogSumExp{values[i] * inverse_temperature, 1.0f});
    }
    state = LseReduce(temp.lse).Reduce(state, merge);
    if (threadIdx.x == 0)
      *broadcast = state.max == -INFINITY ? -INFINITY : state.max + logf(state.sum);
    __syncthreads();
    const float result = *broadcast;
    __syncthreads(); // temp and broadcast are reused
    return result;
  }

  /// The log-weight of element v under DRAW, before noise: -inf where it can never be drawn (masked, no
  /// residual mass, the excluded id). x is the target logit, y the draft logit (kResidual only).
  template <Draw DRAW>
  static __device__ __forceinline__ float log_weight(float x, float y, int v, const DrawContext& context) {
    if constexpr (DRAW == Draw::kArgmax) {
      return x;
    } else if constexpr (DRAW == Draw::kTarget) {
      return x * context.inverse_target_t;
    } else if constexpr (DRAW == Draw::kTargetExcept) {
      return v == context.excluded ? -INFINITY : x * context.inverse_target_t;
    } else {
      const float log_p = x * context.inverse_target_t - context.target_lse;
      const float log_q = y * context.inverse_draft_t - context.draft_lse;
      // log(p - q) = log p + log(1 - q / p) where p > q; no residual mass (or NaN) otherwise. q = 0
      // (log_q = -inf) gives log p exactly; p = 0 never passes.
      return log_p > log_q ? log_p + log1mexp(log_q - log_p) : -INFINITY;
    }
  }

  /// Loads vector `vector` of a row (count logits, -inf past the vocabulary) as floats.
  static __device__ __forceinline__ int load(const Scalar* row, bool row_aligned, int vector, int vocab,
                                             float (&out)[kPerVector]) {
    const int first = vector * kPerVector;
    const int count = max(0, min(kPerVector, vocab - first));
    if (count > 0)
      detail::unpack<DTYPE>(detail::load_vector<DTYPE>(row, first, count, row_aligned), out);
    return count;
  }

  /// Issues one batch of a thread's loads, all before any is used (several in flight per thread): vectors
  /// base + u * THREADS + threadIdx.x (u < kUnroll, below `end`) of the target row and, for READS_DRAFT, of
  /// the draft row; firsts[u] is the vector's first vocab id, counts[u] its logits (0: nothing loaded).
  template <bool READS_DRAFT>
  static __device__ __forceinline__ void
  load_batch(const Scalar* target_row, bool target_aligned, const Scalar* draft_row, bool draft_aligned,
             int base, int end, int vocab, uint4 (&raw_target)[kUnroll], uint4 (&raw_draft)[kUnroll],
             int (&firsts)[kUnroll], int (&counts)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int vector = base + u * THREADS + static_cast<int>(threadIdx.x);
      firsts[u] = vector * kPerVector;
      counts[u] = vector < end ? max(0, min(kPerVector, vocab - firsts[u])) : 0;
      if (counts[u] > 0) {
        raw_target[u] = detail::load_vector<DTYPE>(target_row, firsts[u], counts[u], target_aligned);
        if constexpr (READS_DRAFT)
          raw_draft[u] = detail::load_vector<DTYPE>(draft_row, firsts[u], counts[u], draft_aligned);
      }
    }
  }

  /// Every 16-byte vector [begin, end) of the target row (and, for READS_DRAFT, of the draft row), a batch of
  /// kUnroll vectors a thread at a time with all of the batch's loads issued first (load_batch):
  /// visit(target_logit, draft_logit, first, count) for each vector that holds logits (elements past the
  /// vocabulary read as -inf; draft_logit is unset without READS_DRAFT).
  template <bool READS_DRAFT, typename Visit>
  static __device__ __forceinline__ void for_each_vector(const Scalar* target_row, const Scalar* draft_row,
                                                         int begin, int end, int vocab, Visit&& visit) {
    const bool target_aligned = aligned(target_row);
    const bool draft_aligned = READS_DRAFT && aligned(draft_row);
    for (int base = begin; base < end; base += kUnroll * THREADS) {
      uint4 raw_target[kUnroll], raw_draft[kUnroll];
      int firsts[kUnroll], counts[kUnroll];
      load_batch<READS_DRAFT>(target_row, target_aligned, draft_row, draft_aligned, base, end, vocab,
                              raw_target, raw_draft, firsts, counts);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (counts[u] <= 0)
          continue;
        float target_logit[kPerVector], draft_logit[kPerVector];
        detail::unpack<DTYPE>(raw_target[u], target_logit);
        if constexpr (READS_DRAFT)
          detail::unpack<DTYPE>(raw_draft[u], draft_logit);
        visit(target_logit, draft_logit, firsts[u], counts[u]);
      }
    }
  }

  /// Offers the `count` elements of one vector (ids first ..) to a race: log-weight + the Gumbel noise of
  /// their vocab ids (none for kArgmax), skipping the noise of elements that cannot win.
  template <Draw DRAW>
  static __device__ __forceinline__ void
  race_vector(const float (&target_logit)[kPerVector], const float (&draft_logit)[kPerVector], int first,
              int count, const DrawContext& context, Candidate& best, bool& bad) {
    uint4 words = make_uint4(0, 0, 0, 0);
    int words_group = -1;
#pragma unroll
    for (int i = 0; i < kPerVector; ++i) {
      if (i >= count)
        break;
      const int v = first + i;
      bad |= bad_value(target_logit[i]);
      if constexpr (DRAW == Draw::kResidual)
        bad |= bad_value(draft_logit[i]);
      float score = log_weight<DRAW>(target_logit[i], draft_logit[i], v, context);
      if (!(score > -INFINITY))
        continue; // masked, NaN, or no residual mass: never drawn
      if constexpr (DRAW != Draw::kArgmax) {
        if (score + kMaxGumbel <= best.score)
          continue; // cannot win: skip the noise
        const int group = v >> 2;
        if (group != words_group) {
          words = device::philox_group(context.seed, static_cast<uint32_t>(group), context.draw_counter,
                                       context.particle, context.stream_word);
          words_group = group;
        }
        const uint32_t word = (i & 3) == 0   ? words.x
                              : (i & 3) == 1 ? words.y
                              : (i & 3) == 2 ? words.z
                                             : words.w;
        score += -logf(-logf(device::uniform_open01(word)));
      }
      if (score > best.score)
        best = Candidate{score, v}; // ids grow within a thread: ties keep the first
    }
  }

  /// One race over the drawn position's 16-byte vectors [vector_begin, vector_end) (the greedy draw's tile,
  /// or the whole row): the best score among them, reduced over the CTA (valid in thread 0). `saw_bad_logit`
  /// (every thread) reports a NaN or +inf logit among those read.
  template <Draw DRAW>
  static __device__ Candidate draw(const Scalar* target_row, const Scalar* draft_row,
                                   const DrawContext& context, int vector_begin, int vector_end,
                                   TempStorage& temp, bool& saw_bad_logit) {
    Candidate best{-INFINITY, INT_MAX};
    bool bad = false;
    for_each_vector<DRAW == Draw::kResidual>(
        target_row, draft_row, vector_begin, vector_end, context.vocab,
        [&](const float(&target_logit)[kPerVector], const float(&draft_logit)[kPerVector], int first,
            int count) { race_vector<DRAW>(target_logit, draft_logit, first, count, context, best, bad); });
    saw_bad_logit = __syncthreads_or(bad) != 0;
    best = CandidateReduce(temp.candidate).Reduce(best, BetterCandidate{});
    __syncthreads(); // temp is reused
    return best;
  }

  /// The first level's fold of one tile: this thread's log-sum-exp of the DRAW weights over its vectors
  /// (vector = tile_begin + k * THREADS + threadIdx.x, all loads of a batch issued first), and for kResidual
  /// also of p's (the fallback when no residual mass is left). The residual's weights p - q and p's are
  /// probabilities (<= 1), summed as they are (max 0). `bad`: a NaN or +inf logit was read.
  template <Draw DRAW>
  static __device__ void fold(const Scalar* target_row, const Scalar* draft_row, const DrawContext& context,
                              int tile_begin, int tile_end, LogSumExp& law, LogSumExp& p, bool& bad) {
    for_each_vector<DRAW == Draw::kResidual>(
        target_row, draft_row, tile_begin, tile_end, context.vocab,
        [&](const float(&target_logit)[kPerVector], const float(&draft_logit)[kPerVector], int first, int) {
#pragma unroll
          for (int i = 0; i < kPerVector; ++i) {
            const float x = target_logit[i];
            bad |= bad_value(x);
            if constexpr (DRAW == Draw::kResidual) {
              bad |= bad_value(draft_logit[i]);
              const float log_p = x * context.inverse_target_t - context.target_lse;
              const float log_q = draft_logit[i] * context.inverse_draft_t - context.draft_lse;
              const float p_v = __expf(log_p);
              if (log_p > log_q) { // p - q = p (1 - q / p), without the cancellation of p - q
                law.max = 0.0f;
                law.sum += p_v * -expm1f(log_q - log_p);
              }
              if (p_v > 0.0f) {
                p.max = 0.0f;
                p.sum += p_v;
              }
            } else {
              const float w = log_weight<DRAW>(x, 0.0f, first + i, context);
              if (w > law.max) {
                law.sum = law.max == -INFINITY ? 1.0f : law.sum * __expf(law.max - w) + 1.0f;
                law.max = w;
              } else if (w > -INFINITY) {
                law.sum += __expf(w - law.max);
              }
            }
          }
        });
  }
};

/// A greedy draw's tile result in the workspace (the row's last CTA reads them back with __ldcg).
struct TilePartial {
  float score;
  int index;    ///< INT_MAX when the tile has no candidate
  uint32_t bad; ///< a NaN or +inf logit among those the tile read
};

/// A sampled draw's sub-tile (the elements one warp folds) after the first level: the log-sum-exp of the
/// law's weights and, for the residual, of p's.
struct SubTileState {
  LogSumExp law, p;
  uint32_t bad;
};

struct StochasticArgs {
  StochasticVerifyInputs in;
  VerifyOutputs out;
  int vocab;
  int splits;       ///< CTAs per row (tiles of the drawn position)
  int tile_vectors; ///< 16-byte vectors per tile (the whole row when splits = 1)
  /// When splits > 1: splits * warps SubTileStates per row, the row's sub-tile states (sampled) or, from the
  /// region's start, one TilePartial per tile (greedy: T_t = 0); one stride, as a launch mixes both laws.
  void* partials;
  uint32_t* tickets; ///< [rows] when splits > 1
};

/// grid.x = rows * splits: CTA b verifies row b / splits and folds (sampled) or races (greedy) tile
/// b % splits of its drawn position.
/// Every CTA of a row runs the coins (warp ballots, windows spread over the warps) and takes the same
/// decisions; the verdicts that need no draw are written by the row's first CTA, and the drawn token by the
/// last to finish its tile.
template <DType DTYPE, int THREADS>
__global__ void __launch_bounds__(THREADS) StochasticVerifyKernel(const StochasticArgs args) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  using Pass = RowPass<DTYPE, THREADS>;
  using Scalar = typename Pass::Scalar;
  __shared__ typename Pass::TempStorage temp;
  __shared__ uint32_t row_first_rejection;
  __shared__ int drawn_index;
  __shared__ float broadcast;

  const StochasticVerifyInputs& in = args.in;
  const int row = static_cast<int>(blockIdx.x) / args.splits;
  const int split = static_cast<int>(blockIdx.x) % args.splits;
  const bool row_writer = split == 0 && threadIdx.x == 0; // verdicts decided before the draw
  const int draft_steps = in.row_draft_steps == nullptr
                              ? in.draft_steps
                              : detail::request_draft_steps_of(in.row_draft_steps, row, in.draft_steps);
  const int vocab = args.vocab;
  const int particles = in.random.particles_per_request;
  const int request = row / particles;
  DrawContext context{};
  context.seed = in.random.seeds[request];
  context.draw_counter = in.random.draw_counters[request];
  context.particle = static_cast<uint32_t>(row % particles);
  context.vocab = vocab;
  const float target_t = in.target_temperature[row];
  const float draft_t = in.draft_temperature[row];
  if (!(target_t >= 0.0f) || isinf(target_t) || !(draft_t >= 0.0f) || isinf(draft_t)) { // row-uniform
    if (row_writer)
      device::write_verdict(args.out, row, 0, draft_steps, kInvalidToken, kFlagBadParameter);
    return;
  }

  const int32_t* tokens = in.draft_tokens + row * in.draft_token_row_stride;
  const float* target_logprobs = in.target_logprobs + row * in.target_logprob_row_stride;
  const float* draft_logprobs = in.draft_logprobs + row * in.draft_logprob_row_stride;
  if (threadIdx.x == 0)
    row_first_rejection = device::kNoRejection;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int base = static_cast<int>(threadIdx.x) - lane; base < draft_steps; base += THREADS) { // warp-uniform
    const int j = base + lane;
    bool reject = false;
    uint32_t reason = 0;
    if (j < draft_steps) {
      const int32_t token = tokens[j];
      const float log_p = target_logprobs[j], log_q = draft_logprobs[j];
      // The checks without short-circuits (selects, not branches), so all three loads issue together: with
      // the branches, ptxas sank each log-probability's load past the check before it (the token's range,
      // log p's value), up to three L2 round trips in a row. NVIDIA H200, verify_stochastic_bench, A/B in
      // one call, two rounds, us a launch: sampled 1 / 8 x 128256 bf16 19.59-19.62 / 20.58-20.69 ->
      // 19.09-19.10 / 20.23-20.41, greedy 5.29-5.30 / 5.96 -> 4.98 / 5.68-5.69, 256 x 128256 greedy
      // 43.41-43.52 -> 41.81-41.83; the toy speculative cycle K 4 at 1 / 64 requests 108.7-108.8 /
      // 353.3-353.8 -> 108.5 / 352.4-352.7.
      const bool token_bad = out_of_range(token, vocab);
      const bool value_bad = bad_value(log_p) | bad_value(log_q);
      if (token_bad | value_bad) {
        reject = true;
        reason = token_bad ? kFlagTokenOutOfRange : kFlagNanLogit;
      } else if (log_p == -INFINITY) { // p(d) = 0: d is never emitted
        reject = true;
      } else if (log_p < log_q) { // accept with probability p / q < 1
        const uint32_t word = device::philox_group(context.seed, 0u, context.draw_counter, context.particle,
                                                   philox_stream(Salt::kAcceptCoin, static_cast<uint32_t>(j)))
                                  .x;
        reject = !(device::uniform_open01(word) < expf(log_p - log_q));
      }
    }
    const uint32_t found = device::first_rejection(reject, reason, base);
    if (lane == 0 && found != device::kNoRejection)
      atomicMin(&row_first_rejection, found);
  }
  __syncthreads();
  const uint32_t first = row_first_rejection;
  const int accepted = first == device::kNoRejection ? draft_steps : static_cast<int>(first >> 8);
  uint32_t flags = first == device::kNoRejection ? 0u : (first & 0xffu);
  if (flags & kFlagNanLogit) { // row-uniform: no draw
    if (row_writer)
      device::write_verdict(args.out, row, accepted, draft_steps, kInvalidToken, flags);
    return;
  }

  // Which law the next token follows, and its context (row-uniform from here on).
  const LogitsView& target = in.target_logits;
  const LogitsView& draft = in.draft_logits;
  const Scalar* target_row =
      static_cast<const Scalar*>(target.data) + row * target.row_stride + accepted * target.position_stride;
  const Scalar* draft_row = nullptr;
  context.stream_word = philox_stream(Salt::kResidual, static_cast<uint32_t>(accepted));
  context.inverse_target_t = target_t > 0.0f ? 1.0f / target_t : 0.0f;
  Draw law;
  if (target_t == 0.0f) {
    law = Draw::kArgmax;
  } else if (accepted == draft_steps) {
    law = Draw::kTarget;
  } else if (draft_t == 0.0f) {
    law = Draw::kTargetExcept;
    context.excluded = tokens[accepted]; // an out-of-range id excludes nothing
  } else {
    law = Draw::kResidual;
    draft_row =
        static_cast<const Scalar*>(draft.data) + row * draft.row_stride + accepted * draft.position_stride;
    context.inverse_draft_t = 1.0f / draft_t;
    const int32_t token = tokens[accepted];
    float target_lse = NAN, draft_lse = NAN;
    if (!out_of_range(token, vocab)) { // lse = l[d] / T - log p(d), from what the score pass computed
      target_lse =
          Pass::Traits::to_float(target_row[token]) * context.inverse_target_t - target_logprobs[accepted];
      draft_lse =
          Pass::Traits::to_float(draft_row[token]) * context.inverse_draft_t - draft_logprobs[accepted];
    }
    // Not recoverable (p(d) = 0, an id out of range): every CTA of the row reads the whole row once more and
    // computes the same bits (same code, same order).
    if (!isfinite(target_lse))
      target_lse = Pass::log_sum_exp(target_row, context.inverse_target_t, vocab, temp, &broadcast);
    if (!isfinite(draft_lse))
      draft_lse = Pass::log_sum_exp(draft_row, context.inverse_draft_t, vocab, temp, &broadcast);
    context.target_lse = target_lse;
    context.draft_lse = draft_lse;
  }
  constexpr int kPerVector = Pass::kPerVector;
  constexpr int kWarps = THREADS / 32;
  const int vectors = (vocab + kPerVector - 1) / kPerVector;
  const int tile_begin = split * args.tile_vectors;
  const int tile_end = min(vectors, tile_begin + args.tile_vectors);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const BetterCandidate better;
  bool saw_bad_logit = false;
  Candidate best{-INFINITY, INT_MAX};

  if (law == Draw::kArgmax) { // no noise: one level, each tile's best meets in the last CTA
    best = Pass::template draw<Draw::kArgmax>(target_row, nullptr, context, tile_begin, tile_end, temp,
                                              saw_bad_logit);
    if (args.splits > 1) {
      // A row's workspace region is the same size whatever its law (a launch mixes greedy and sampled rows).
      TilePartial* tiles = reinterpret_cast<TilePartial*>(static_cast<SubTileState*>(args.partials) +
                                                          static_cast<int64_t>(row) * args.splits * kWarps);
      if (threadIdx.x == 0)
        tiles[split] = TilePartial{best.score, best.index, saw_bad_logit ? 1u : 0u};
      if (!device::last_to_arrive(&args.tickets[row], static_cast<uint32_t>(args.splits)))
        return;
      Candidate mine{-INFINITY, INT_MAX};
      bool bad = false;
      for (int t = threadIdx.x; t < args.splits; t += THREADS) {
        mine = better(mine, Candidate{__ldcg(&tiles[t].score), __ldcg(&tiles[t].index)});
        bad |= __ldcg(&tiles[t].bad) != 0u;
      }
      saw_bad_logit = __syncthreads_or(bad) != 0;
      best = Pass::CandidateReduce(temp.candidate).Reduce(mine, better);
    }
  } else { // two levels (header comment)
    // Level 1: every warp's sub-tile state, to the workspace (several tiles) or shared memory (one).
    __shared__ SubTileState local_states[kWarps];
    LogSumExp law_state{-INFINITY, 0.0f}, p_state{-INFINITY, 0.0f};
    bool bad = false;
    if (law == Draw::kTarget)
      Pass::template fold<Draw::kTarget>(target_row, nullptr, context, tile_begin, tile_end, law_state,
                                         p_state, bad);
    else if (law == Draw::kTargetExcept)
      Pass::template fold<Draw::kTargetExcept>(target_row, nullptr, context, tile_begin, tile_end, law_state,
                                               p_state, bad);
    else
      Pass::template fold<Draw::kResidual>(target_row, draft_row, context, tile_begin, tile_end, law_state,
                                           p_state, bad);
    const MergeLogSumExp merge;
#pragma unroll
    for (int offset = 16; offset >= 1; offset /= 2) { // a fixed butterfly: the sub-tile's state
      law_state = merge(law_state, LogSumExp{__shfl_xor_sync(0xffffffffu, law_state.max, offset),
                                             __shfl_xor_sync(0xffffffffu, law_state.sum, offset)});
      p_state = merge(p_state, LogSumExp{__shfl_xor_sync(0xffffffffu, p_state.max, offset),
                                         __shfl_xor_sync(0xffffffffu, p_state.sum, offset)});
    }
    bad = __any_sync(0xffffffffu, bad);
    SubTileState* states = args.splits > 1 ? static_cast<SubTileState*>(args.partials) +
                                                 static_cast<int64_t>(row) * args.splits * kWarps
                                           : local_states;
    if (threadIdx.x % 32 == 0)
      states[split * kWarps + warp] = SubTileState{law_state, p_state, bad ? 1u : 0u};
    if (args.splits > 1) {
      if (!device::last_to_arrive(&args.tickets[row], static_cast<uint32_t>(args.splits)))
        return;
    } else {
      __syncthreads();
    }
    // The row's last CTA: the sub-tile by Gumbel-max over log Z_s (the tile draw of s, kTileDrawElement +
    // s); p's states when the residual has no mass left anywhere (p ~= q to float precision).
    const int sub_tiles = args.splits * kWarps;
    auto state_of = [&](int t) {
      if (args.splits == 1)
        return states[t];
      SubTileState state;
      state.law = LogSumExp{__ldcg(&states[t].law.max), __ldcg(&states[t].law.sum)};
      state.p = LogSumExp{__ldcg(&states[t].p.max), __ldcg(&states[t].p.sum)};
      state.bad = __ldcg(&states[t].bad);
      return state;
    };
    bool any_bad = false, any_mass = false;
    for (int t = threadIdx.x; t < sub_tiles; t += THREADS) {
      const SubTileState state = state_of(t);
      any_bad |= state.bad != 0u;
      any_mass |= state.law.max > -INFINITY && state.law.sum > 0.0f;
    }
    saw_bad_logit = __syncthreads_or(any_bad) != 0;
    const bool use_p = law == Draw::kResidual && __syncthreads_or(any_mass) == 0;
    Candidate sub{-INFINITY, INT_MAX};
    if (!saw_bad_logit) {
      for (int t = threadIdx.x; t < sub_tiles; t += THREADS) { // ascending: ties keep the first
        const SubTileState state = state_of(t);
        const LogSumExp z = use_p ? state.p : state.law;
        if (!(z.max > -INFINITY && z.sum > 0.0f))
          continue; // no mass: never chosen
        const uint32_t word =
            device::philox_tile_word(context.seed, static_cast<uint32_t>(t), context.draw_counter,
                                     context.particle, context.stream_word);
        sub = better(sub, Candidate{z.max + logf(z.sum) - logf(-logf(device::uniform_open01(word))), t});
      }
    }
    sub = Pass::CandidateReduce(temp.candidate).Reduce(sub, better);
    if (threadIdx.x == 0)
      drawn_index = sub.index;
    __syncthreads();
    const int chosen = drawn_index;
    if (chosen != INT_MAX) {
      // Level 2: Gumbel-max over the chosen sub-tile's elements alone (the word of each vocab id), re-read
      // from L2: vectors tile_begin' + k * THREADS + w * 32 + lane of tile chosen / kWarps, w = chosen %
      // kWarps.
      const int sub_tile_begin = (chosen / kWarps) * args.tile_vectors;
      const int sub_tile_end = min(vectors, sub_tile_begin + args.tile_vectors);
      const int sub_warp = chosen % kWarps;
      const int slots = 32 * ((args.tile_vectors + THREADS - 1) / THREADS);
      const bool target_aligned = Pass::aligned(target_row);
      const bool draft_aligned = law == Draw::kResidual && !use_p && Pass::aligned(draft_row);
      bool race_bad = false;
      for (int j = threadIdx.x; j < slots; j += THREADS) { // ascending vectors within a thread
        const int vector = sub_tile_begin + (j / 32) * THREADS + sub_warp * 32 + j % 32;
        if (vector >= sub_tile_end)
          break;
        float target_logit[kPerVector], draft_logit[kPerVector];
        const int count = Pass::load(target_row, target_aligned, vector, vocab, target_logit);
        if (use_p || law == Draw::kTarget) {
          Pass::template race_vector<Draw::kTarget>(target_logit, draft_logit, vector * kPerVector, count,
                                                    context, best, race_bad);
        } else if (law == Draw::kTargetExcept) {
          Pass::template race_vector<Draw::kTargetExcept>(target_logit, draft_logit, vector * kPerVector,
                                                          count, context, best, race_bad);
        } else {
          Pass::load(draft_row, draft_aligned, vector, vocab, draft_logit);
          Pass::template race_vector<Draw::kResidual>(target_logit, draft_logit, vector * kPerVector, count,
                                                      context, best, race_bad);
        }
      }
      __syncthreads(); // temp.candidate is reused
      best = Pass::CandidateReduce(temp.candidate).Reduce(best, better);
    }
  }
  int32_t next_token = kInvalidToken;
  if (saw_bad_logit) {
    flags |= kFlagNanLogit;
  } else if (best.index == INT_MAX) {
    flags |= kFlagAllMasked; // (thread 0's view; only thread 0 writes)
  } else {
    next_token = best.index;
  }
  if (threadIdx.x == 0)
    device::write_verdict(args.out, row, accepted, draft_steps, next_token, flags);
}

// ---------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------

/// Threads of a split-vocabulary CTA; its tile is kSplitThreads * kUnrollVectors 16-byte vectors (4096 bf16 /
/// fp16, 2048 fp32 logits), so a 128256-logit bf16 row spreads over 32 CTAs.
constexpr int kSplitThreads = 128;
constexpr int kSplitTileVectors = kSplitThreads * detail::kUnrollVectors;
/// Rows of at most this many logits are one CTA of 32 threads (the statistics tests' ~10^6 tiny rows).
constexpr int kSmallVocab = 1024;

template <int THREADS> void launch_stochastic(DType dtype, const StochasticArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.in.target_logits.rows * args.splits));
  switch (dtype) {
  case DType::kFloat32:
    detail::launch_pdl(StochasticVerifyKernel<DType::kFloat32, THREADS>, grid, dim3(THREADS), 0, stream,
                       args);
    break;
  case DType::kBFloat16:
    detail::launch_pdl(StochasticVerifyKernel<DType::kBFloat16, THREADS>, grid, dim3(THREADS), 0, stream,
                       args);
    break;
  case DType::kFloat16:
    detail::launch_pdl(StochasticVerifyKernel<DType::kFloat16, THREADS>, grid, dim3(THREADS), 0, stream,
                       args);
    break;
  }
}

void validate_logits(const char* where, const char* name, const LogitsView& view, int min_positions,
                     const char* positions_requirement) {
  const std::string field = name;
  require(view.data != nullptr, where, (field + ".data").c_str(), "null", "must be a device pointer");
  require(view.dtype == DType::kFloat32 || view.dtype == DType::kBFloat16 || view.dtype == DType::kFloat16,
          where, (field + ".dtype").c_str(), static_cast<int>(view.dtype), "must be fp32, bf16 or fp16");
  require(view.rows >= 1, where, (field + ".rows").c_str(), view.rows, "must be >= 1");
  require(view.vocab >= 1, where, (field + ".vocab").c_str(), view.vocab, "must be >= 1");
  require(view.positions >= min_positions, where, (field + ".positions").c_str(), view.positions,
          positions_requirement);
  require(view.position_stride >= view.vocab, where, (field + ".position_stride").c_str(),
          view.position_stride, "must be >= vocab");
  // Rows may nest positions ([rows, positions, V]) or positions may nest rows ([positions, rows, V], how a
  // cycle keeps its K draft steps' logits); either way no two (row, position) pairs overlap.
  const bool row_major = view.row_stride >= (view.positions - 1) * view.position_stride + view.vocab;
  const bool position_major =
      view.row_stride >= view.vocab && view.position_stride >= (view.rows - 1) * view.row_stride + view.vocab;
  require(view.row_stride == 0 || row_major || position_major, where, (field + ".row_stride").c_str(),
          view.row_stride, "must be 0 (one shared row) or lay rows and positions out without overlap");
}

} // namespace

void TokenVerifyInputs::validate(const char* where) const {
  require(rows >= 1, where, "rows", rows, "must be >= 1");
  require(draft_steps >= 1 && draft_steps <= kMaxVerifyDraftSteps, where, "draft_steps", draft_steps,
          "must be in [1, kMaxVerifyDraftSteps]");
  require(vocab >= 1, where, "vocab", vocab, "must be >= 1");
  require(draft_tokens != nullptr, where, "draft_tokens", "null", "must be a device pointer");
  require(target_tokens != nullptr, where, "target_tokens", "null", "must be a device pointer");
  require(draft_row_stride >= draft_steps, where, "draft_row_stride", draft_row_stride,
          "must be >= draft_steps");
  require(target_row_stride > draft_steps, where, "target_row_stride", target_row_stride,
          "must be >= draft_steps + 1");
}

void VerifyOutputs::validate(const char* where) const {
  require(accepted != nullptr, where, "out.accepted", "null", "must be a device pointer");
  require(next_tokens != nullptr, where, "out.next_tokens", "null", "must be a device pointer");
}

int verify_threads(int vocab) {
  return vocab > kSmallVocab ? kSplitThreads : 32;
}

int verify_tile_length(int vocab, DType dtype) {
  const int per_vector = detail::kVectorBytes / dtype_bytes(dtype);
  const int pass = verify_threads(vocab) * detail::kUnrollVectors * per_vector; // one load batch of a CTA
  if (vocab > kSmallVocab)
    return pass;
  return (vocab + pass - 1) / pass * pass; // the whole row, one CTA
}

void verify_greedy(const TokenVerifyInputs& inputs, const VerifyOutputs& out, cudaStream_t stream) {
  constexpr const char* kWhere = "smcgraph::verify_greedy";
  inputs.validate(kWhere);
  out.validate(kWhere);
  const NvtxRange range("verify_greedy");
  const dim3 grid(static_cast<unsigned>((inputs.rows + kGreedyWarps - 1) / kGreedyWarps));
  detail::launch_pdl(GreedyVerifyKernel, dim3(grid), dim3(kGreedyThreads), 0, stream,
                     GreedyArgs{inputs, out});
}

void verify_stochastic(const StochasticVerifyInputs& inputs, const VerifyOutputs& out,
                       SampleWorkspace& workspace, cudaStream_t stream) {
  constexpr const char* kWhere = "smcgraph::verify_stochastic";
  const int draft_steps = inputs.draft_steps;
  require(draft_steps >= 1 && draft_steps <= kMaxVerifyDraftSteps, kWhere, "draft_steps", draft_steps,
          "must be in [1, kMaxVerifyDraftSteps]");
  validate_logits(kWhere, "target_logits", inputs.target_logits, draft_steps + 1,
                  "must be >= draft_steps + 1");
  validate_logits(kWhere, "draft_logits", inputs.draft_logits, draft_steps, "must be >= draft_steps");
  const int rows = inputs.target_logits.rows;
  const int vocab = inputs.target_logits.vocab;
  require(inputs.draft_logits.rows == rows, kWhere, "draft_logits.rows", inputs.draft_logits.rows,
          "must equal target_logits.rows");
  require(inputs.draft_logits.vocab == vocab, kWhere, "draft_logits.vocab", inputs.draft_logits.vocab,
          "must equal target_logits.vocab");
  require(inputs.draft_logits.dtype == inputs.target_logits.dtype, kWhere, "draft_logits.dtype",
          dtype_name(inputs.draft_logits.dtype), "must equal target_logits.dtype");
  require(inputs.draft_tokens != nullptr, kWhere, "draft_tokens", "null", "must be a device pointer");
  require(inputs.draft_token_row_stride >= draft_steps, kWhere, "draft_token_row_stride",
          inputs.draft_token_row_stride, "must be >= draft_steps");
  require(inputs.draft_logprobs != nullptr, kWhere, "draft_logprobs", "null", "must be a device pointer");
  require(inputs.draft_logprob_row_stride >= draft_steps, kWhere, "draft_logprob_row_stride",
          inputs.draft_logprob_row_stride, "must be >= draft_steps");
  require(inputs.target_logprobs != nullptr, kWhere, "target_logprobs", "null", "must be a device pointer");
  require(inputs.target_logprob_row_stride >= draft_steps, kWhere, "target_logprob_row_stride",
          inputs.target_logprob_row_stride, "must be >= draft_steps");
  detail::require_device_pointers(kWhere, {{"draft_temperature", inputs.draft_temperature},
                                           {"target_temperature", inputs.target_temperature}});
  detail::require_random(inputs.random, kWhere);
  out.validate(kWhere);

  StochasticArgs args{inputs, out, vocab, 1, 0, nullptr, nullptr};
  const DType dtype = inputs.target_logits.dtype;
  const int per_vector = detail::kVectorBytes / dtype_bytes(dtype);
  const int vectors = (vocab + per_vector - 1) / per_vector;
  args.tile_vectors = std::min(vectors, verify_tile_length(vocab, dtype) / per_vector);
  args.splits = (vectors + args.tile_vectors - 1) / args.tile_vectors;
  if (args.splits > 1) {
    using Access = detail::SampleWorkspaceAccess;
    require(workspace.max_jobs() >= rows, kWhere, "workspace.max_jobs", workspace.max_jobs(),
            "must be >= rows (a row of this vocabulary is split over several CTAs)");
    const int64_t per_tile =
        std::max<int64_t>(sizeof(TilePartial), (kSplitThreads / 32) * sizeof(SubTileState));
    const int64_t partial_bytes = static_cast<int64_t>(rows) * args.splits * per_tile;
    require(partial_bytes <= static_cast<int64_t>(Access::max_partials(workspace)) *
                                 static_cast<int64_t>(sizeof(detail::PassState)),
            kWhere, "workspace.max_vocab", workspace.max_vocab(),
            "too small for rows x tiles of this vocabulary");
    args.partials = Access::partials(workspace);
    args.tickets = Access::tickets(workspace);
  }

  const NvtxRange range("verify_stochastic");
  if (verify_threads(vocab) == kSplitThreads)
    launch_stochastic<kSplitThreads>(dtype, args, stream);
  else
    launch_stochastic<32>(dtype, args, stream);
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace smcgraph
