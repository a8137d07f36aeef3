// The single pass over logits that both sample() and score() are made of.
//
// A job is one (row, position) of `[rows, P, V]` logits. Its V logits are cut into fixed tiles of
// kSplitLength<DTYPE> logits (4096 fp32, 8192 bf16/fp16: a function of the dtype only), one CTA per tile.
// Each CTA reads its tile once and keeps an online log-sum-exp in base 2: max m_c and sums relative to it,
// sum 2^((l - m_c) c) and, for alpha != 1, sum 2^(alpha (l - m_c) c), with c = log2(e) / T. That costs one
// exponential per element (two at alpha != 1) and no random number. The last CTA of the job (a ticket
// counter it resets to 0, so graph replays need no memset) merges the tiles' states into lse(l / T) and
// lse(alpha l / T) for the log-prob and log Z outputs, and, when the job samples, draws the token in two
// levels (an exact two-level Gumbel-max):
//
//   1. tile:  c* = argmax_c log Z_c + G_c, where Z_c = sum over tile c of exp(alpha l_v / T) and G_c is
//             Gumbel noise from the tile draw of c (philox.hpp: element kTileDrawElement + c). In base 2 and
//             ratio-free form: argmax_c alpha (m_c - M) c + log2(sum_c) - log2(-log2 u_c), M the row max.
//             One Philox word per tile; tiles that are entirely -inf (Z_c = 0) never win.
//   2. token: the last CTA re-reads tile c* (an L2 hit: its CTA read it moments ago with L2's normal
//             eviction policy) and runs the per-element race over it alone: argmax_v e_v / E_v with
//             e_v = 2^(alpha (l_v - m_c*) c) and E_v = -log2 u_v, u_v from the vocab draw of v (element v),
//             which is Gumbel-max over alpha l_v / T in ratio form (no division: fractions are compared by
//             cross-multiplication).
//
// Exactness: the tile draws and the vocab draws are distinct Philox words (c.x < 2^31 for vocab ids, 2^31 |
// c / 4 for tiles), so the noises are independent. Gumbel-max over the tiles picks c with probability
// Z_c / Z, and Gumbel-max inside c picks v with probability exp(alpha l_v / T) / Z_c, independently of
// which noises decided the tile; the product is exp(alpha l_v / T) / Z = softmax(alpha l / T)_v, the same law
// as one Gumbel-max over the whole row. Only the winning tile draws per-element numbers, so the first read
// of the logits is bound by bytes, not by Philox and log2 per element. With a single tile (V <= one tile)
// the tile level is skipped and the race runs over the whole row, as before.
//
// The host reference (tests/reference/sample_ref.cpp) runs the same two levels with the same Philox words.
#pragma once

#include <cstdint>

#include <cub/block/block_reduce.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/random.cuh"
#include "smcgraph/sample.hpp"

namespace smcgraph::detail {

inline constexpr int kPassThreads = 256;
inline constexpr int kVectorBytes = 16;
inline constexpr float kLn2 = 0.69314718055994530942f;
inline constexpr float kLog2e = 1.44269504088896340736f;

enum class PassMode : int {
  kGreedy = 0,    ///< T = 0: argmax, ties to the smallest id
  kScore = 1,     ///< log-sum-exp of l / T only (token log-probs)
  kRace = 2,      ///< sample, alpha = 1: lse of l / T per tile, then the two-level race on it
  kRacePower = 3, ///< sample, alpha != 1: lse of l / T and of alpha l / T per tile, race on the latter
};

/// Per-thread and per-tile state of the first read; merged across threads and tiles.
struct PassState {
  float max;       ///< max raw logit seen (NaN once a NaN was seen)
  float sum;       ///< sum 2^((l - max) c)
  float sum_power; ///< sum 2^(alpha (l - max) c) (kRacePower; the merge copies sum into it otherwise)
  int max_index;   ///< greedy: smallest vocab id holding max; -1 when none
  uint32_t flags;  ///< RowFlag bits
};

__device__ __forceinline__ PassState empty_state() {
  return PassState{-INFINITY, 0.0f, 0.0f, -1, 0u};
}

/// A race's standing across threads: key = log2 of the best ratio e / E (element race) or the tile key
/// (tile race), the winner's raw logit and its index (vocab id or tile); index -1 and key -inf when none.
struct RaceBest {
  float key;
  float logit;
  int index;
};

/// The better of two race standings: the larger key, ties to the smaller index.
struct RaceBestOp {
  __device__ __forceinline__ RaceBest operator()(const RaceBest& a, const RaceBest& b) const {
    const bool take_b =
        b.index >= 0 && (a.index < 0 || b.key > a.key || (b.key == a.key && b.index < a.index));
    return take_b ? b : a;
  }
};

template <DType DTYPE> struct DTypeTraits;
template <> struct DTypeTraits<DType::kFloat32> {
  using Scalar = float;
  static constexpr int kPerVector = 4;
  __device__ static float to_float(Scalar x) { return x; }
};
template <> struct DTypeTraits<DType::kBFloat16> {
  using Scalar = __nv_bfloat16;
  static constexpr int kPerVector = 8;
  __device__ static float to_float(Scalar x) { return __bfloat162float(x); }
};
template <> struct DTypeTraits<DType::kFloat16> {
  using Scalar = __half;
  static constexpr int kPerVector = 8;
  __device__ static float to_float(Scalar x) { return __half2float(x); }
};

template <DType DTYPE> __device__ __forceinline__ void unpack(const uint4& raw, float* out) {
  if constexpr (DTYPE == DType::kFloat32) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (DTYPE == DType::kBFloat16) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
      } else {
        const __half2 pair = *reinterpret_cast<const __half2*>(&words[i]);
        const float2 f = __half22float2(pair);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
      }
    }
  }
}

/// max that propagates NaN (fmaxf drops it, and a NaN must not hide).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

/// What a job needs to know about its row, read from device memory at run time.
struct JobContext {
  float c; ///< log2(e) / T
  float alpha;
  uint64_t seed;
  uint32_t draw_counter;
  uint32_t particle;
  uint32_t stream_word;
};

/// Sum of N values as a fixed pairwise tree (short dependency chains, same order everywhere).
template <int N> __device__ __forceinline__ float tree_sum(const float (&x)[N]) {
  float partial[N];
#pragma unroll
  for (int i = 0; i < N; ++i)
    partial[i] = x[i];
#pragma unroll
  for (int width = N / 2; width >= 1; width /= 2) {
#pragma unroll
    for (int i = 0; i < width; ++i)
      partial[i] = partial[i] + partial[i + width];
  }
  return partial[0];
}

/// Folds up to N consecutive logits starting at vocab id `first` into `state` (the first read: max and
/// sums only, one exponential per element, two in kRacePower). `count` < N only at the end of a row;
/// missing elements count as -inf.
template <PassMode MODE, int N>
__device__ __forceinline__ void fold_chunk(PassState& state, const float (&logits)[N], int first, int count,
                                           const JobContext& job) {
  float l[N];
#pragma unroll
  for (int i = 0; i < N; ++i)
    l[i] = i < count ? logits[i] : -INFINITY;
  if constexpr (MODE == PassMode::kGreedy) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (l[i] != l[i])
        state.flags |= kFlagNanLogit;
      if (l[i] > state.max) {
        state.max = l[i];
        state.max_index = first + i;
      }
    }
    return;
  } else {
    float chunk_max = l[0];
#pragma unroll
    for (int i = 1; i < N; ++i)
      chunk_max = max_nan(chunk_max, l[i]);
    if (!(chunk_max <= state.max)) { // a new maximum, or NaN: rescale what was summed so far
      const float shift = state.max == -INFINITY ? -INFINITY : (state.max - chunk_max) * job.c;
      state.sum *= fast_exp2(shift);
      if constexpr (MODE == PassMode::kRacePower)
        state.sum_power *= fast_exp2(job.alpha * shift);
      state.max = chunk_max;
    }
    if (state.max == -INFINITY)
      return; // everything so far is masked
    float e[N], e_power[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float scaled = (l[i] - state.max) * job.c; // <= 0; -inf for masked; NaN poisons the sums
      e[i] = fast_exp2(scaled);
      if constexpr (MODE == PassMode::kRacePower)
        e_power[i] = fast_exp2(job.alpha * scaled);
    }
    state.sum += tree_sum<N>(e);
    if constexpr (MODE == PassMode::kRacePower)
      state.sum_power += tree_sum<N>(e_power);
  }
}

/// The element race of one thread over its share of the winning tile: the best ratio e / E so far, kept
/// as a fraction (no division) until the end.
struct RaceState {
  float numerator;   ///< e = 2^(alpha (l - m) c) of the best (m the tile max); 0 while none
  float denominator; ///< E = -log2 u of the best
  float logit;       ///< raw logit of the best
  int index;         ///< -1 when none
};

/// Races up to N consecutive logits starting at vocab id `first` (a multiple of 4) into `state`. The
/// Philox words, the exponentials and the logs are independent across the N elements; a fixed pairwise
/// tree picks the chunk's best, which then meets the running best.
template <int N>
__device__ __forceinline__ void race_chunk(RaceState& state, const float (&logits)[N], int first, int count,
                                           const JobContext& job, float tile_max, float power_c) {
  uint32_t words[N];
#pragma unroll
  for (int g = 0; g < N / 4; ++g) { // issued first: independent of everything below
    const uint4 w = device::philox_group(job.seed, static_cast<uint32_t>((first >> 2) + g), job.draw_counter,
                                         job.particle, job.stream_word);
    words[4 * g] = w.x;
    words[4 * g + 1] = w.y;
    words[4 * g + 2] = w.z;
    words[4 * g + 3] = w.w;
  }
  // Ratios e / E, E = -log2 u. log2f, not lg2.approx: winners have u near 1 where the approximation's
  // 2^-22 absolute error is a large relative error of E. Masked (and missing) elements have e = 0: they
  // never beat anything, and the tile max (e = 1) is always a candidate.
  float numerator[N], denominator[N], logit[N];
  int index[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    logit[i] = i < count ? logits[i] : -INFINITY;
    numerator[i] = fast_exp2((logit[i] - tile_max) * power_c);
    denominator[i] = -log2f(device::uniform_open01(words[i]));
    index[i] = first + i;
  }
#pragma unroll
  for (int width = N / 2; width >= 1; width /= 2) {
#pragma unroll
    for (int i = 0; i < width; ++i) { // strictly better only: ties keep the smaller vocab id
      const bool right = numerator[i + width] * denominator[i] > numerator[i] * denominator[i + width];
      numerator[i] = right ? numerator[i + width] : numerator[i];
      denominator[i] = right ? denominator[i + width] : denominator[i];
      logit[i] = right ? logit[i + width] : logit[i];
      index[i] = right ? index[i + width] : index[i];
    }
  }
  if (numerator[0] * state.denominator > state.numerator * denominator[0]) {
    state.numerator = numerator[0];
    state.denominator = denominator[0];
    state.logit = logit[0];
    state.index = index[0];
  }
}

/// Merges b into a (order-independent up to rounding; greedy ties go to the smaller vocab id).
template <PassMode MODE>
__device__ __forceinline__ PassState merge_states(const PassState& a, const PassState& b, float c,
                                                  float alpha) {
  PassState out;
  if constexpr (MODE == PassMode::kGreedy) {
    const bool take_b = b.max > a.max || (b.max == a.max && b.max_index >= 0 &&
                                          (a.max_index < 0 || b.max_index < a.max_index));
    out = take_b ? b : a;
    out.flags = a.flags | b.flags;
    return out;
  } else {
    out.flags = a.flags | b.flags;
    out.max_index = -1;
    const float m = max_nan(a.max, b.max);
    out.max = m;
    if (m == -INFINITY || m != m) {
      out.sum = (m != m) ? NAN : 0.0f;
      out.sum_power = out.sum;
      return out;
    }
    const float shift_a = a.max == -INFINITY ? -INFINITY : (a.max - m) * c;
    const float shift_b = b.max == -INFINITY ? -INFINITY : (b.max - m) * c;
    out.sum = a.sum * fast_exp2(shift_a) + b.sum * fast_exp2(shift_b);
    if constexpr (MODE == PassMode::kRacePower) {
      out.sum_power = a.sum_power * fast_exp2(alpha * shift_a) + b.sum_power * fast_exp2(alpha * shift_b);
    } else {
      out.sum_power = out.sum;
    }
    return out;
  }
}

template <PassMode MODE> struct MergeOp {
  float c, alpha;
  __device__ __forceinline__ PassState operator()(const PassState& a, const PassState& b) const {
    return merge_states<MODE>(a, b, c, alpha);
  }
};

template <DType DTYPE> __device__ __forceinline__ uint32_t negative_infinity_bits() {
  if constexpr (DTYPE == DType::kFloat32)
    return 0xff800000u;
  else if constexpr (DTYPE == DType::kBFloat16)
    return 0xff80ff80u;
  else
    return 0xfc00fc00u;
}

/// Loads vector `first .. first + count` of a row: one 16-byte load when the row is aligned and the vector
/// full, element loads otherwise (missing elements read as -inf). Either way the same bits come out, so
/// the fold below does not depend on a row's alignment. STREAMING (score positions, greedy, and the
/// verifier in verify.cu): evict-first, the logits are read once. Sampling jobs load with L2's normal
/// policy, so the winning tile is still in L2 when the last CTA reads it again.
template <DType DTYPE, bool STREAMING = true>
__device__ __forceinline__ uint4 load_vector(const typename DTypeTraits<DTYPE>::Scalar* row, int first,
                                             int count, bool aligned) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  if (aligned && count == kPerVector) {
    const uint4* address = reinterpret_cast<const uint4*>(row + first);
    return STREAMING ? __ldcs(address) : __ldcg(address);
  }
  const uint32_t fill = negative_infinity_bits<DTYPE>();
  uint32_t words[4] = {fill, fill, fill, fill};
  if constexpr (DTYPE == DType::kFloat32) {
    const uint32_t* elements = reinterpret_cast<const uint32_t*>(row + first);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (i < count)
        words[i] = elements[i];
  } else {
    const uint16_t* elements = reinterpret_cast<const uint16_t*>(row + first);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (i < count) {
        const uint32_t shift = 16 * (i & 1);
        words[i / 2] = (words[i / 2] & ~(0xffffu << shift)) | (static_cast<uint32_t>(elements[i]) << shift);
      }
    }
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

/// Logits a tile (one CTA) folds: kUnrollVectors 16-byte vectors per thread. A function of the dtype
/// only, so the reduction tree of a row and its tiles do not depend on how many rows share the launch: a
/// row's results are bit-identical alone or in a batch, at any row index, eager or graphed.
#ifndef SMCGRAPH_PASS_VECTORS_PER_THREAD
#define SMCGRAPH_PASS_VECTORS_PER_THREAD 4
#endif
inline constexpr int kUnrollVectors = SMCGRAPH_PASS_VECTORS_PER_THREAD;
template <DType DTYPE>
inline constexpr int kSplitLength = kPassThreads* kUnrollVectors* DTypeTraits<DTYPE>::kPerVector;

/// Calls visit(values, first, count) for the vectors of logits [begin, end) a thread owns: thread t takes
/// vectors t, t + 256, t + 512, ... in order, issuing UNROLL loads before visiting them (the order of the
/// visits does not depend on UNROLL).
template <DType DTYPE, bool STREAMING, int UNROLL, class Visit>
__device__ __forceinline__ void for_each_vector(const typename DTypeTraits<DTYPE>::Scalar* row, int begin,
                                                int end, bool aligned, Visit&& visit) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  const int vectors = (end - begin + kPerVector - 1) / kPerVector;
  for (int base = 0; base < vectors; base += UNROLL * kPassThreads) {
    uint4 raw[UNROLL];
    int firsts[UNROLL], counts[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) { // all loads first: several in flight per thread
      firsts[u] = begin + (base + u * kPassThreads + static_cast<int>(threadIdx.x)) * kPerVector;
      counts[u] = max(0, min(kPerVector, end - firsts[u]));
      if (counts[u] > 0)
        raw[u] = load_vector<DTYPE, STREAMING>(row, firsts[u], counts[u], aligned);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (counts[u] > 0) {
        float values[kPerVector];
        unpack<DTYPE>(raw[u], values);
        visit(values, firsts[u], counts[u]);
      }
    }
  }
}

/// The first read of logits [begin, end) of one job: this thread's max and sums.
template <DType DTYPE, PassMode MODE>
__device__ __forceinline__ PassState fold_range(const typename DTypeTraits<DTYPE>::Scalar* row, int begin,
                                                int end, bool aligned, const JobContext& job) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  constexpr bool kStreaming = MODE == PassMode::kGreedy || MODE == PassMode::kScore;
  PassState state = empty_state();
  for_each_vector<DTYPE, kStreaming, kUnrollVectors>(
      row, begin, end, aligned, [&](const float(&values)[kPerVector], int first, int count) {
        fold_chunk<MODE, kPerVector>(state, values, first, count, job);
      });
  // Per-thread NaN check: a NaN (or +inf) logit leaves max or the sums NaN.
  if constexpr (MODE != PassMode::kGreedy) {
    if (state.max != state.max || state.sum != state.sum || state.sum_power != state.sum_power)
      state.flags |= kFlagNanLogit;
  }
  if (state.max == INFINITY)
    state.flags |= kFlagNanLogit;
  return state;
}

/// Vectors in flight per thread in the element race: it re-reads one tile from L2 and is bound by Philox
/// and log2, so fewer loads in flight leave the registers to the race (no spills at 80 registers).
#ifndef SMCGRAPH_RACE_VECTORS_PER_THREAD
#define SMCGRAPH_RACE_VECTORS_PER_THREAD 2
#endif
inline constexpr int kRaceUnrollVectors = SMCGRAPH_RACE_VECTORS_PER_THREAD;

/// The element race over logits [begin, end) of the winning tile (max tile_max): this thread's best, as a
/// key log2(e / E). power_c = alpha c (c when alpha = 1).
template <DType DTYPE>
__device__ __forceinline__ RaceBest race_range(const typename DTypeTraits<DTYPE>::Scalar* row, int begin,
                                               int end, bool aligned, const JobContext& job, float tile_max,
                                               float power_c) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  RaceState state{0.0f, 1.0f, -INFINITY, -1};
  for_each_vector<DTYPE, false, kRaceUnrollVectors>(
      row, begin, end, aligned, [&](const float(&values)[kPerVector], int first, int count) {
        race_chunk<kPerVector>(state, values, first, count, job, tile_max, power_c);
      });
  if (state.index < 0)
    return RaceBest{-INFINITY, -INFINITY, -1};
  return RaceBest{log2f(state.numerator) - log2f(state.denominator), state.logit, state.index};
}

/// This thread's best tile of a job from the tiles' partial states: key = log2 Z_c relative to the row
/// max M (alpha (m_c - M) c + log2 sum_c) minus log2 E_c, E_c = -log2 u_c from the tile draw of c. Tiles
/// that are entirely -inf (Z_c = 0) never win.
template <PassMode MODE>
__device__ __forceinline__ RaceBest choose_tile(const PassState* tiles, int tile_count, float row_max,
                                                const JobContext& job, float power_c) {
  RaceBest best{-INFINITY, -INFINITY, -1};
  for (int tile = threadIdx.x; tile < tile_count; tile += kPassThreads) { // ascending: ties keep the first
    const float tile_max = __ldcg(&tiles[tile].max);
    if (tile_max == -INFINITY)
      continue;
    const float sum = __ldcg(MODE == PassMode::kRacePower ? &tiles[tile].sum_power : &tiles[tile].sum);
    const uint32_t word = device::philox_tile_word(job.seed, static_cast<uint32_t>(tile), job.draw_counter,
                                                   job.particle, job.stream_word);
    const float key =
        (tile_max - row_max) * power_c + log2f(sum) - log2f(-log2f(device::uniform_open01(word)));
    if (best.index < 0 || key > best.key)
      best = RaceBest{key, tile_max, tile};
  }
  return best;
}

/// Arguments of the pass kernel (launch arguments: fixed for the life of a captured graph).
struct PassArgs {
  LogitsView logits{};
  RowParams params{};
  RowRandom random{};
  uint32_t stream_word{};
  // score(): token log-probs at positions < P - 1
  const int32_t* tokens{};
  int64_t token_row_stride{};
  float* token_logprobs{};
  // the sample at position P - 1 (token and log-prob of row r at r * sample_row_stride)
  int32_t* sample_tokens{};
  float* sample_logprobs{};
  int64_t sample_row_stride = 1;
  float* sample_logz{};
  uint32_t* row_flags{};
  uint32_t* status{};
  /// score(): [requests] per-request sample position s_q (clamped to [0, P - 1]); null: P - 1 for all rows
  const int32_t* request_steps{};
  // set by launch_logits_pass
  int splits{}; ///< tiles per job: ceil(vocab / kSplitLength<DTYPE>)
  PassState* partials{};
  uint32_t* tickets{};
};

template <DType DTYPE, PassMode MODE>
__device__ void run_job(const PassArgs& args, const JobContext& job, int row, int position, int split,
                        bool sample_position, uint32_t param_flags) {
  using Scalar = typename DTypeTraits<DTYPE>::Scalar;
  using BlockReduce = cub::BlockReduce<PassState, kPassThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  __shared__ bool is_last;

  const int job_index = row * args.logits.positions + position;
  const Scalar* row_logits = static_cast<const Scalar*>(args.logits.data) + row * args.logits.row_stride +
                             position * args.logits.position_stride;
  const int begin = split * kSplitLength<DTYPE>;
  const int end = min(args.logits.vocab, begin + kSplitLength<DTYPE>);
  const bool aligned = (reinterpret_cast<uintptr_t>(row_logits) % kVectorBytes) == 0;

  PassState state =
      param_flags ? empty_state() : fold_range<DTYPE, MODE>(row_logits, begin, end, aligned, job);
  const MergeOp<MODE> merge{job.c, job.alpha};
  state = BlockReduce(reduce_storage).Reduce(state, merge);

  PassState* tiles = args.partials + static_cast<int64_t>(job_index) * args.splits;
  if (args.splits > 1) {
    if (threadIdx.x == 0) {
      tiles[split] = state;
      __threadfence(); // publish the partial before taking a ticket
      const uint32_t ticket = atomicAdd(&args.tickets[job_index], 1u);
      is_last = ticket == static_cast<uint32_t>(args.splits - 1);
      if (is_last)
        args.tickets[job_index] = 0; // ready for the next launch / graph replay
    }
    __syncthreads();
    if (!is_last)
      return;
    __threadfence(); // acquire the other CTAs' partials
    state = empty_state();
    for (int s = threadIdx.x; s < args.splits; s += kPassThreads) {
      PassState other;
      other.max = __ldcg(&tiles[s].max);
      other.sum = __ldcg(&tiles[s].sum);
      other.sum_power = __ldcg(&tiles[s].sum_power);
      other.max_index = __ldcg(&tiles[s].max_index);
      other.flags = __ldcg(&tiles[s].flags);
      state = merge_states<MODE>(state, other, job.c, job.alpha);
    }
    __syncthreads(); // reduce_storage is reused
    state = BlockReduce(reduce_storage).Reduce(state, merge);
  }

  // Sampling: the two-level race (header comment). Every thread takes part, so the row's merged state
  // goes through shared memory first.
  RaceBest winner{-INFINITY, -INFINITY, -1};
  if constexpr (MODE == PassMode::kRace || MODE == PassMode::kRacePower) {
    using RaceReduce = cub::BlockReduce<RaceBest, kPassThreads>;
    __shared__ typename RaceReduce::TempStorage race_storage;
    __shared__ PassState row_state;
    __shared__ RaceBest tile_winner;
    if (threadIdx.x == 0)
      row_state = state;
    __syncthreads();
    const PassState total = row_state; // uniform across the CTA, so are the branches below
    if (!total.flags && total.max != -INFINITY) {
      const float power_c = MODE == PassMode::kRacePower ? job.alpha * job.c : job.c;
      RaceBest tile{0.0f, total.max, 0}; // one tile: it holds the whole row
      if (args.splits > 1) {
        tile = choose_tile<MODE>(tiles, args.splits, total.max, job, power_c);
        tile = RaceReduce(race_storage).Reduce(tile, RaceBestOp{});
        if (threadIdx.x == 0)
          tile_winner = tile;
        __syncthreads();
        tile = tile_winner;
      }
      const int tile_begin = tile.index * kSplitLength<DTYPE>;
      const int tile_end = min(args.logits.vocab, tile_begin + kSplitLength<DTYPE>);
      winner = race_range<DTYPE>(row_logits, tile_begin, tile_end, aligned, job, tile.logit, power_c);
      __syncthreads(); // race_storage is reused
      winner = RaceReduce(race_storage).Reduce(winner, RaceBestOp{});
    }
  }
  if (threadIdx.x != 0)
    return;

  uint32_t flags = state.flags | param_flags;
  if (!flags && state.max == -INFINITY)
    flags |= kFlagAllMasked;
  if (sample_position) {
    int32_t token = kInvalidToken;
    float logprob = -INFINITY, logz = 0.0f;
    if (!flags) {
      if constexpr (MODE == PassMode::kGreedy) {
        token = state.max_index;
        logprob = 0.0f;
      } else if constexpr (MODE == PassMode::kRace || MODE == PassMode::kRacePower) {
        token = winner.index;
        const float log2_sum = __log2f(state.sum);
        const float log2_sum_power = MODE == PassMode::kRacePower ? __log2f(state.sum_power) : log2_sum;
        const float alpha = MODE == PassMode::kRacePower ? job.alpha : 1.0f;
        logprob = kLn2 * (alpha * (winner.logit - state.max) * job.c - log2_sum_power);
        logz = MODE == PassMode::kRacePower ? kLn2 * (log2_sum_power - job.alpha * log2_sum) : 0.0f;
      }
    }
    args.sample_tokens[row * args.sample_row_stride] = token;
    args.sample_logprobs[row * args.sample_row_stride] = logprob;
    args.sample_logz[row] = logz;
  } else {
    float logprob = -INFINITY;
    const int32_t token = args.tokens[row * args.token_row_stride + position];
    if (token < 0 || token >= args.logits.vocab) {
      flags |= kFlagTokenOutOfRange;
    } else if (!flags) {
      const float l = DTypeTraits<DTYPE>::to_float(row_logits[token]);
      if constexpr (MODE == PassMode::kGreedy) {
        logprob = l == state.max ? 0.0f : -INFINITY;
      } else {
        logprob = kLn2 * ((l - state.max) * job.c - __log2f(state.sum));
      }
    }
    args.token_logprobs[row * (args.logits.positions - 1) + position] = logprob;
  }
  if (flags) {
    atomicOr(&args.row_flags[row], flags);
    atomicOr(args.status, flags);
  }
}

/// grid.x = jobs * splits; block = kPassThreads.
#ifndef SMCGRAPH_PASS_MIN_BLOCKS
#define SMCGRAPH_PASS_MIN_BLOCKS 3
#endif
template <DType DTYPE>
__global__ void __launch_bounds__(kPassThreads, SMCGRAPH_PASS_MIN_BLOCKS)
    LogitsPassKernel(const PassArgs args) {
  const int split = blockIdx.x % args.splits;
  const int job_index = blockIdx.x / args.splits;
  const int row = job_index / args.logits.positions;
  const int position = job_index % args.logits.positions;
  const int particles = args.random.particles_per_request;
  const int request = row / particles;
  // The row's sample position: P - 1, or its request's own s_q (score() with request_steps).
  int last = args.logits.positions - 1;
  if (args.request_steps != nullptr)
    last = min(max(args.request_steps[request], 0), last);
  // A token position at or past the row's sample position is not scored: its log-prob is -inf. Past it the
  // logits are not read at all.
  if (position >= last && position < args.logits.positions - 1 && split == 0 && threadIdx.x == 0)
    args.token_logprobs[row * (args.logits.positions - 1) + position] = -INFINITY;
  if (position > last)
    return;
  const bool sample_position = position == last;

  const float temperature = args.params.temperature[row];
  const float alpha = args.params.alpha ? args.params.alpha[row] : 1.0f;
  uint32_t param_flags = 0;
  if (!(temperature >= 0.0f) || isinf(temperature))
    param_flags |= kFlagBadParameter;
  if (sample_position && (!(alpha > 0.0f) || isinf(alpha)))
    param_flags |= kFlagBadParameter;

  JobContext job;
  job.c = temperature > 0.0f ? kLog2e / temperature : 0.0f;
  job.alpha = alpha;
  job.seed = args.random.seeds[request];
  job.draw_counter = args.random.draw_counters[request];
  job.particle = static_cast<uint32_t>(row % particles);
  job.stream_word = args.stream_word;

  // The mode is uniform across the CTA (one job per CTA), so this branch does not diverge.
  if (param_flags || temperature == 0.0f) {
    run_job<DTYPE, PassMode::kGreedy>(args, job, row, position, split, sample_position, param_flags);
  } else if (!sample_position) {
    run_job<DTYPE, PassMode::kScore>(args, job, row, position, split, sample_position, 0u);
  } else if (alpha == 1.0f) {
    run_job<DTYPE, PassMode::kRace>(args, job, row, position, split, sample_position, 0u);
  } else {
    run_job<DTYPE, PassMode::kRacePower>(args, job, row, position, split, sample_position, 0u);
  }
}

/// Validates and launches the pass (shared by sample() and score()): `args` carries the caller's logits,
/// row parameters, keys, token inputs and output pointers; the launcher adds the tiling and the workspace.
void launch_logits_pass(const char* where, PassArgs args, SampleWorkspace& workspace, cudaStream_t stream);

} // namespace smcgraph::detail
