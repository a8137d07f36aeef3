// The single pass over logits that both sample() and score() are made of.
//
// A job is one (row, position) of `[rows, P, V]` logits. Each job reads its V logits once and keeps, per
// thread, an online log-sum-exp in base 2 (max m, sums relative to m) and, when it samples, an
// exponential race: the winner is argmax_v e_v / E_v with e_v = 2^(alpha (l_v - m) c), c = log2(e) / T,
// and E_v = -log2(u_v) for Philox uniforms u_v. That is the Gumbel-max trick (argmax alpha l_v / T + G_v)
// in ratio form: e_v is the same exponential the log-sum-exp needs, so sampling adds one MUFU (lg2) and
// no second exponential per element, and the comparison e_v > best * E_v needs no division.
//
// Few jobs: the vocabulary is split across CTAs; each writes a partial state and the last CTA of the job
// (a ticket counter it resets to 0, so graph replays need no memset) merges them and writes the outputs.
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
  kRace = 2,      ///< sample, alpha = 1: one exponential per element serves the lse and the race
  kRacePower = 3, ///< sample, alpha != 1: lse of l / T and of alpha l / T, race on the latter
};

/// Per-thread and per-split state; merged across threads and splits.
struct PassState {
  float max;              ///< max raw logit seen (NaN once a NaN was seen)
  float sum;              ///< sum 2^((l - max) c)
  float sum_power;        ///< sum 2^(alpha (l - max) c)
  float best;             ///< race: log2 of the best ratio e / E relative to max (while folding: e)
  float best_denominator; ///< while folding: E of the best (the ratio is best / best_denominator)
  float best_logit;       ///< raw logit of the best element
  int best_index;         ///< -1 when none
  uint32_t flags;         ///< RowFlag bits
};

__device__ __forceinline__ PassState empty_state() {
  return PassState{-INFINITY, 0.0f, 0.0f, -INFINITY, 1.0f, -INFINITY, -1, 0u};
}

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

/// Folds up to N consecutive logits starting at vocab id `first` (a multiple of 4) into `state`.
/// `count` < N only at the end of a row; missing elements count as -inf. The per-element work (the
/// exponentials, the Philox words, the approximate logs) is independent across the N elements; the race
/// compares them all against the best ratio at chunk start with a cheap bound, and only a chunk with a
/// possible winner (rare after the first few) takes the serial path with exact logs.
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
        state.best_index = first + i;
      }
    }
    return;
  } else {
    constexpr bool kRaces = MODE == PassMode::kRace || MODE == PassMode::kRacePower;
    uint32_t words[N];
    if constexpr (kRaces) { // issued first: independent of everything below
#pragma unroll
      for (int g = 0; g < N / 4; ++g) {
        const uint4 w = device::philox_group(job.seed, static_cast<uint32_t>((first >> 2) + g),
                                             job.draw_counter, job.particle, job.stream_word);
        words[4 * g] = w.x;
        words[4 * g + 1] = w.y;
        words[4 * g + 2] = w.z;
        words[4 * g + 3] = w.w;
      }
    }
    float chunk_max = l[0];
#pragma unroll
    for (int i = 1; i < N; ++i)
      chunk_max = max_nan(chunk_max, l[i]);
    if (!(chunk_max <= state.max)) { // a new maximum, or NaN: rescale what was summed so far
      const float shift = state.max == -INFINITY ? -INFINITY : (state.max - chunk_max) * job.c;
      state.sum *= fast_exp2(shift);
      if constexpr (MODE == PassMode::kRacePower) {
        const float scale_power = fast_exp2(job.alpha * shift);
        state.sum_power *= scale_power;
        state.best *= scale_power; // the ratio's numerator, relative to max
      } else if constexpr (MODE == PassMode::kRace) {
        state.best *= fast_exp2(shift);
      }
      state.max = chunk_max;
    }
    if (state.max == -INFINITY)
      return; // everything so far is masked
    float e[N], e_power[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float scaled = (l[i] - state.max) * job.c; // <= 0; -inf for masked; NaN poisons the sums
      e[i] = fast_exp2(scaled);
      e_power[i] = MODE == PassMode::kRacePower ? fast_exp2(job.alpha * scaled) : e[i];
    }
    state.sum += tree_sum<N>(e);
    if constexpr (MODE == PassMode::kRacePower)
      state.sum_power += tree_sum<N>(e_power);
    if constexpr (kRaces) {
      // Ratios e / E, E = -log2 u, compared as fractions (no division): a fixed pairwise tree over the
      // chunk, then against the running best. log2f, not lg2.approx: winners have u near 1 where the
      // approximation's 2^-22 absolute error is a large relative error of E.
      float numerator[N], denominator[N], logit[N];
      int index[N];
#pragma unroll
      for (int i = 0; i < N; ++i) {
        numerator[i] = e_power[i];
        denominator[i] = -log2f(device::uniform_open01(words[i]));
        logit[i] = l[i];
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
      if (numerator[0] * state.best_denominator > state.best * denominator[0]) {
        state.best = numerator[0];
        state.best_denominator = denominator[0];
        state.best_logit = logit[0];
        state.best_index = index[0];
      }
    }
  }
}

/// Merges b into a (order-independent up to rounding; ties go to the smaller vocab id).
template <PassMode MODE>
__device__ __forceinline__ PassState merge_states(const PassState& a, const PassState& b, float c,
                                                  float alpha) {
  PassState out;
  out.flags = a.flags | b.flags;
  if constexpr (MODE == PassMode::kGreedy) {
    const bool take_b = b.max > a.max || (b.max == a.max && b.best_index >= 0 &&
                                          (a.best_index < 0 || b.best_index < a.best_index));
    out = take_b ? b : a;
    out.flags = a.flags | b.flags;
    return out;
  } else {
    const float m = max_nan(a.max, b.max);
    out.max = m;
    if (m == -INFINITY || m != m) {
      out.sum = (m != m) ? NAN : 0.0f;
      out.sum_power = out.sum;
      out.best = -INFINITY;
      out.best_logit = -INFINITY;
      out.best_index = -1;
      return out;
    }
    const float shift_a = a.max == -INFINITY ? -INFINITY : (a.max - m) * c;
    const float shift_b = b.max == -INFINITY ? -INFINITY : (b.max - m) * c;
    out.sum = a.sum * fast_exp2(shift_a) + b.sum * fast_exp2(shift_b);
    const float power = MODE == PassMode::kRacePower ? alpha : 1.0f;
    if constexpr (MODE == PassMode::kRacePower) {
      out.sum_power = a.sum_power * fast_exp2(alpha * shift_a) + b.sum_power * fast_exp2(alpha * shift_b);
    } else {
      out.sum_power = out.sum;
    }
    const float best_a = a.best_index >= 0 ? a.best + power * shift_a : -INFINITY;
    const float best_b = b.best_index >= 0 ? b.best + power * shift_b : -INFINITY;
    const bool take_b = best_b > best_a || (best_b == best_a && b.best_index >= 0 &&
                                            (a.best_index < 0 || b.best_index < a.best_index));
    out.best = take_b ? best_b : best_a;
    out.best_index = take_b ? b.best_index : a.best_index;
    out.best_logit = take_b ? b.best_logit : a.best_logit;
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
/// the fold below does not depend on a row's alignment.
template <DType DTYPE>
__device__ __forceinline__ uint4 load_vector(const typename DTypeTraits<DTYPE>::Scalar* row, int first,
                                             int count, bool aligned) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  if (aligned && count == kPerVector)
    return __ldcs(reinterpret_cast<const uint4*>(row + first));
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

/// Logits a split (one CTA) folds: kUnrollVectors 16-byte vectors per thread. A function of the dtype
/// only, so the reduction tree of a row does not depend on how many rows share the launch: a row's
/// results are bit-identical alone or in a batch, at any row index, eager or graphed.
#ifndef SMCGRAPH_PASS_VECTORS_PER_THREAD
#define SMCGRAPH_PASS_VECTORS_PER_THREAD 4
#endif
inline constexpr int kUnrollVectors = SMCGRAPH_PASS_VECTORS_PER_THREAD;
template <DType DTYPE>
inline constexpr int kSplitLength = kPassThreads* kUnrollVectors* DTypeTraits<DTYPE>::kPerVector;

/// Folds the logits [begin, end) of one job: thread t takes vectors t, t + 256, t + 512, t + 768 in order.
template <DType DTYPE, PassMode MODE>
__device__ __forceinline__ PassState fold_range(const typename DTypeTraits<DTYPE>::Scalar* row, int begin,
                                                int end, bool aligned, const JobContext& job) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  PassState state = empty_state();
  state.best = 0.0f; // a fraction best / best_denominator while folding; log2 of it at the end
  const int vectors = (end - begin + kPerVector - 1) / kPerVector;
  for (int base = 0; base < vectors; base += kUnrollVectors * kPassThreads) {
    uint4 raw[kUnrollVectors];
    int firsts[kUnrollVectors], counts[kUnrollVectors];
#pragma unroll
    for (int u = 0; u < kUnrollVectors; ++u) { // all loads first: several in flight per thread
      firsts[u] = begin + (base + u * kPassThreads + static_cast<int>(threadIdx.x)) * kPerVector;
      counts[u] = max(0, min(kPerVector, end - firsts[u]));
      if (counts[u] > 0)
        raw[u] = load_vector<DTYPE>(row, firsts[u], counts[u], aligned);
    }
#pragma unroll
    for (int u = 0; u < kUnrollVectors; ++u) {
      if (counts[u] > 0) {
        float values[kPerVector];
        unpack<DTYPE>(raw[u], values);
        fold_chunk<MODE, kPerVector>(state, values, firsts[u], counts[u], job);
      }
    }
  }
  // Per-thread NaN check: a NaN (or +inf) logit leaves max or the sums NaN.
  if constexpr (MODE != PassMode::kGreedy) {
    if (state.max != state.max || state.sum != state.sum || state.sum_power != state.sum_power)
      state.flags |= kFlagNanLogit;
  }
  if (state.max == INFINITY)
    state.flags |= kFlagNanLogit;
  state.best = state.best_index >= 0 ? log2f(state.best) - log2f(state.best_denominator) : -INFINITY;
  return state;
}

/// Arguments of the pass kernel (launch arguments: fixed for the life of a captured graph).
struct PassArgs {
  const void* logits;
  int rows, positions, vocab;
  int64_t row_stride, position_stride;
  int splits; ///< ceil(vocab / kSplitLength<DTYPE>)
  RowParams params;
  RowRandom random;
  uint32_t stream_word;
  // score(): token log-probs at positions < P - 1
  const int32_t* tokens;
  int64_t token_row_stride;
  float* token_logprobs;
  // the sample at position P - 1
  int32_t* sample_tokens;
  float* sample_logprobs;
  float* sample_logz;
  uint32_t* row_flags;
  uint32_t* status;
  PassState* partials;
  uint32_t* tickets;
};

template <DType DTYPE, PassMode MODE>
__device__ void run_job(const PassArgs& args, const JobContext& job, int row, int position, int split,
                        uint32_t param_flags) {
  using Scalar = typename DTypeTraits<DTYPE>::Scalar;
  using BlockReduce = cub::BlockReduce<PassState, kPassThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  __shared__ bool is_last;

  const int job_index = row * args.positions + position;
  const Scalar* row_logits =
      static_cast<const Scalar*>(args.logits) + row * args.row_stride + position * args.position_stride;
  const int begin = split * kSplitLength<DTYPE>;
  const int end = min(args.vocab, begin + kSplitLength<DTYPE>);
  const bool aligned = (reinterpret_cast<uintptr_t>(row_logits) % kVectorBytes) == 0;

  PassState state =
      param_flags ? empty_state() : fold_range<DTYPE, MODE>(row_logits, begin, end, aligned, job);
  const MergeOp<MODE> merge{job.c, job.alpha};
  state = BlockReduce(reduce_storage).Reduce(state, merge);

  if (args.splits > 1) {
    if (threadIdx.x == 0) {
      args.partials[job_index * args.splits + split] = state;
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
      const PassState* p = args.partials + job_index * args.splits + s;
      PassState other;
      other.max = __ldcg(&p->max);
      other.sum = __ldcg(&p->sum);
      other.sum_power = __ldcg(&p->sum_power);
      other.best = __ldcg(&p->best);
      other.best_denominator = 1.0f;
      other.best_logit = __ldcg(&p->best_logit);
      other.best_index = __ldcg(&p->best_index);
      other.flags = __ldcg(&p->flags);
      state = merge_states<MODE>(state, other, job.c, job.alpha);
    }
    __syncthreads(); // reduce_storage is reused
    state = BlockReduce(reduce_storage).Reduce(state, merge);
  }
  if (threadIdx.x != 0)
    return;

  uint32_t flags = state.flags | param_flags;
  if (!flags && state.max == -INFINITY)
    flags |= kFlagAllMasked;
  const bool sample_position = position == args.positions - 1;
  if (sample_position) {
    int32_t token = kInvalidToken;
    float logprob = -INFINITY, logz = 0.0f;
    if (!flags) {
      if constexpr (MODE == PassMode::kGreedy) {
        token = state.best_index;
        logprob = 0.0f;
      } else if constexpr (MODE == PassMode::kRace || MODE == PassMode::kRacePower) {
        token = state.best_index;
        const float log2_sum = __log2f(state.sum);
        const float log2_sum_power = MODE == PassMode::kRacePower ? __log2f(state.sum_power) : log2_sum;
        const float alpha = MODE == PassMode::kRacePower ? job.alpha : 1.0f;
        logprob = kLn2 * (alpha * (state.best_logit - state.max) * job.c - log2_sum_power);
        logz = MODE == PassMode::kRacePower ? kLn2 * (log2_sum_power - job.alpha * log2_sum) : 0.0f;
      }
    }
    args.sample_tokens[row] = token;
    args.sample_logprobs[row] = logprob;
    args.sample_logz[row] = logz;
  } else {
    float logprob = -INFINITY;
    const int32_t token = args.tokens[row * args.token_row_stride + position];
    if (token < 0 || token >= args.vocab) {
      flags |= kFlagTokenOutOfRange;
    } else if (!flags) {
      const float l = DTypeTraits<DTYPE>::to_float(row_logits[token]);
      if constexpr (MODE == PassMode::kGreedy) {
        logprob = l == state.max ? 0.0f : -INFINITY;
      } else {
        logprob = kLn2 * ((l - state.max) * job.c - __log2f(state.sum));
      }
    }
    args.token_logprobs[row * (args.positions - 1) + position] = logprob;
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
  const int row = job_index / args.positions;
  const int position = job_index % args.positions;
  const bool sample_position = position == args.positions - 1;

  const float temperature = args.params.temperature[row];
  const float alpha = args.params.alpha ? args.params.alpha[row] : 1.0f;
  uint32_t param_flags = 0;
  if (!(temperature >= 0.0f) || isinf(temperature))
    param_flags |= kFlagBadParameter;
  if (sample_position && (!(alpha > 0.0f) || isinf(alpha)))
    param_flags |= kFlagBadParameter;

  const int particles = args.random.particles_per_request;
  const int request = row / particles;
  JobContext job;
  job.c = temperature > 0.0f ? kLog2e / temperature : 0.0f;
  job.alpha = alpha;
  job.seed = args.random.seeds[request];
  job.draw_counter = args.random.draw_counters[request];
  job.particle = static_cast<uint32_t>(row % particles);
  job.stream_word = args.stream_word;

  // The mode is uniform across the CTA (one job per CTA), so this branch does not diverge.
  if (param_flags || temperature == 0.0f) {
    run_job<DTYPE, PassMode::kGreedy>(args, job, row, position, split, param_flags);
  } else if (!sample_position) {
    run_job<DTYPE, PassMode::kScore>(args, job, row, position, split, 0u);
  } else if (alpha == 1.0f) {
    run_job<DTYPE, PassMode::kRace>(args, job, row, position, split, 0u);
  } else {
    run_job<DTYPE, PassMode::kRacePower>(args, job, row, position, split, 0u);
  }
}

/// Validates and launches the pass (shared by sample() and score()): the shape, parameters and keys come
/// from the view and the row structs; `args` carries the caller's token inputs and output pointers.
void launch_logits_pass(const char* where, const LogitsView& logits, const RowParams& params,
                        const RowRandom& random, uint32_t stream_word, PassArgs args,
                        SampleWorkspace& workspace, cudaStream_t stream);

} // namespace smcgraph::detail
