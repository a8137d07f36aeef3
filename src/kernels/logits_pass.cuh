// The single pass over logits that both sample() and score() are made of.
//
// A job is one (row, position) of `[rows, P, V]` logits. Its V logits are cut into fixed tiles of
// kSplitLength<DTYPE> logits (4096 fp32, 8192 bf16/fp16: a function of the dtype only), one CTA per tile.
// Thread t of a CTA reads the 16-byte vectors t, t + 256, t + 512, t + 768 of its tile, so warp w reads the
// vectors w * 32 + lane + 256 k (lane < 32, k < 4): that set of elements (1024 bf16 / 512 fp32, not
// contiguous) is sub-tile w of the tile, and sub-tile 8 c + w of the row. A warp folds its sub-tile into a
// log-sum-exp in base 2 from its registers in two passes (fold_subtile): the sub-tile's max m (each lane's,
// then the warp's: one redux.sync over order-preserving integer keys), then sums relative to it,
// sum 2^((l - m) c) and, for alpha != 1, sum 2^(alpha (l - m) c), with c = log2(e) / T, each lane's then the
// warp's (exact fixed-point redux.sync adds: warp_sum_unit_terms). That costs one exponential per
// element (two at alpha != 1) and no random number, and the CTA writes its 8 sub-tile states to the
// workspace. The last CTA of the job (a ticket counter it
// resets to 0, so graph replays need no memset) merges all the row's sub-tile states (block_row_standing:
// the row's max first, then every sum relative to it) into lse(l / T) and
// lse(alpha l / T) for the log-prob and log Z outputs, and, when the job samples, draws the token in two
// levels (an exact two-level Gumbel-max):
//
//   1. sub-tile: s* = argmax_s log Z_s + G_s, where Z_s = sum over sub-tile s of exp(alpha l_v / T) and G_s
//             is Gumbel noise from the tile draw of s (philox.hpp: element kTileDrawElement + s, s the
//             sub-tile's index over the row). In base 2, up to an offset common to the row, and in double:
//             argmax_s alpha m_s c + log2(sum_s) - log2(-log2 u_s) (offer_subtile). One Philox word per
//             sub-tile; sub-tiles that are entirely -inf (Z_s = 0), or empty, never win. The key needs no
//             row max, so this race is reduced in the same block reduction as the row's merged state.
//   2. token: the per-element race inside s* alone: argmax_v k_v with k_v = (l_v - m_s*) alpha c - log2 E_v
//             and E_v = -log2 u_v, u_v from the rank draw of v (element kRankDrawElement + j, j the rank of
//             v in s* by ascending vocab id), which is Gumbel-max over alpha l_v / T in base 2 (race_key: one
//             float a element, rounded step by step, so any order of comparison picks the same element).
//             Ties go to the smallest vocab id. The rank draws do not depend on which sub-tile wins, so a CTA
//             draws its share of them (draw_race_noise) before it knows: while its logits load (launches of
//             up to a wave), or while the sub-tile states load. Two places run it, with the same keys and so
//             the same winner:
//             - early race (PassArgs::early_race: launches whose CTAs fit one wave, not walk mode): every
//               warp races its own sub-tile from the registers it just folded, against the CTA's table of
//               the rank noise, before the merge; the merge carries each sub-tile's winner beside its state
//               and the sub-tile race's winner brings its token along. Nothing after the merge.
//             - late race (the rest): the last CTA re-reads sub-tile s* (an L2 hit: its CTA read it moments
//               ago with L2's normal eviction policy; cluster mode: its owner's shared copy), spread over all
//               256 threads, and reduces the threads' winners.
//
// Exactness: the sub-tile draws and the rank draws are distinct Philox words (c.x = 2^31 | s / 4 for
// sub-tiles, 2^31 | 2^30 | j / 4 for ranks), so the noises are independent. Gumbel-max over the sub-tiles
// picks s with probability Z_s / Z. Given s, the rank draws are i.i.d. and independent of the sub-tile draws
// that decided s, so Gumbel-max inside s picks v with probability exp(alpha l_v / T) / Z_s; the product is
// exp(alpha l_v / T) / Z = softmax(alpha l / T)_v, the same law as one Gumbel-max over the whole row. The
// sub-tiles only need to partition the row (they need not be contiguous), so each is exactly the set of
// elements one warp folded. Only the winning sub-tile's ranks get per-element numbers (4 bf16 / 2 fp32 per
// thread), so the first read of the logits is bound by bytes, and the last CTA's serial tail is short. A
// one-tile row (V <= one tile) runs the same two levels over its 8 sub-tiles, from shared memory instead of
// the workspace.
//
// The host reference (tests/reference/sample_ref.cpp) runs the same two levels with the same Philox words
// over the same sub-tiles.
//
// Three ways for a job's tiles to meet (launch_logits_pass picks one per launch; the results are the same
// bits).
//
// Cluster mode (a job of 2 to kMaxClusterTiles tiles, a launch of at most kMaxClusterCtas CTAs, on a device
// that schedules such a thread-block cluster; SMCGRAPH_DISABLE_SAMPLER_CLUSTER=1 turns it off): the job's
// CTAs are one cluster. Each keeps its 8 sub-tile states, and at a sample position its whole tile, in shared
// memory. After one cluster barrier every CTA reads the job's sub-tile states from its peers' shared memory
// (DSMEM), merges them in the fixed order below and runs the sub-tile race, all identically; the CTA that
// owns the winning sub-tile runs the element race over its own shared copy and writes the outputs (in a job
// that does not race, the cluster's first CTA writes them). A second barrier keeps every CTA's shared memory
// alive until its peers have read it. No workspace, no fence, no atomic and no second read from L2.
//
// Ticket mode (more tiles or CTAs, or no cluster support): each CTA writes its sub-tile states to the
// workspace, and the job's last CTA to arrive (a ticket) merges them and re-reads the winning sub-tile from
// L2.
//
// Walk mode (launches that ticket mode would run and whose CTAs fill whole waves; sample.cu's walk_plan,
// smcgraph::set_sample_walk_min_jobs / set_sample_walk_max_walkers), in two instances:
// - the register walk (jobs that fill waves of one CTA a job, 2 an SM): the job's only CTA folds its tiles
//   one after another (walk_tiles: each as the tile's own CTA would, two tiles' loads in flight ahead in
//   registers), keeps the sub-tile states in shared memory and merges and races as the last CTA of ticket
//   mode does. No workspace, fence or ticket.
// - the staged walk (fewer jobs: 64 or 128 rows of 128256): `walkers` CTAs a job, 4 an SM, each folding a
//   run of consecutive tiles (walk_tiles_staged: the next two tiles copied into shared memory by cp.async
//   while one is folded), writing the sub-tile states to the workspace; the job's last walker to arrive (a
//   ticket) merges and races as in ticket mode.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// max.NaN and redux.sync (the pass's maxima and warp reductions) need sm_80.
#error "smcgraph's sampler pass needs compute capability >= 8.0: set the gpu_arch option to 80 or above"
#endif

#include <climits>
#include <cstdint>
#include <type_traits>

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include "kernels/pdl.cuh"
#include "kernels/cluster_barrier.cuh"
#include "kernels/order_key.hpp"
#include "kernels/random.cuh"
#include "kernels/ticket.cuh"
#include "kernels/tree_sum.cuh"
#include "kernels/warp_in_order.cuh"
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

/// How a pass instance meets a job's tiles (the mode header above): ticket or cluster mode, one CTA a tile
/// (kNone); the register walk, one CTA a job (kRegisters); the staged walk, `walkers` CTAs a job (kStaged).
enum class PassWalk : int { kNone = 0, kRegisters = 1, kStaged = 2 };

/// Per-thread and per-tile state of the first read; merged across threads and tiles.
struct PassState {
  float max;       ///< max raw logit seen (NaN once a NaN was seen)
  float sum;       ///< sum 2^((l - max) c)
  float sum_power; ///< sum 2^(alpha (l - max) c) (kRacePower; the merge copies sum into it otherwise)
  int max_index;   ///< greedy: smallest vocab id holding max; -1 when none
  uint32_t flags;  ///< RowFlag bits
};

/// A sub-tile's own element race in a launch that races early (PassArgs::early_race, race_own_subtile): the
/// winner's vocab id (-1 when none) and raw logit. Kept beside the sub-tile's PassState.
struct SubTileWinner {
  int index;
  float logit;
};

/// The workspace's scratch, for the launchers only (not part of SampleWorkspace's public interface): the
/// sampler's pass keeps a PassState per sub-tile there, the stochastic verifier (verify.cu) a result per
/// tile.
struct SampleWorkspaceAccess {
  static void* partials(const SampleWorkspace& w) { return w.partials_; }
  static uint32_t* tickets(const SampleWorkspace& w) { return w.tickets_; }
  static int max_partials(const SampleWorkspace& w) { return w.max_partials_; }
  /// The early race's sub-tile winners, one per partial, after the partials in the same allocation.
  static SubTileWinner* winners(const SampleWorkspace& w) {
    return reinterpret_cast<SubTileWinner*>(static_cast<char*>(w.partials_) +
                                            static_cast<size_t>(w.max_partials_) * sizeof(PassState));
  }
};

__device__ __forceinline__ PassState empty_state() {
  return PassState{-INFINITY, 0.0f, 0.0f, -1, 0u};
}

/// The sub-tile race's standing across threads: the key of the best sub-tile (offer_subtile), its max raw
/// logit and its index over the row; index -1 and key -inf when none.
struct SubtileBest {
  double key;
  float max;
  int index;
};

/// A sub-tile standing that also carries the sub-tile's own element-race winner (launches that race early).
struct RacedSubtileBest : SubtileBest {
  SubTileWinner winner;
};

/// The better of two sub-tile standings: the larger key, ties to the smaller index.
template <class Best> __device__ __forceinline__ Best better_subtile(const Best& a, const Best& b) {
  const bool take_b = b.index >= 0 && (a.index < 0 || b.key > a.key || (b.key == a.key && b.index < a.index));
  return take_b ? b : a;
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

/// Folds N consecutive logits starting at vocab id `first` into a greedy `state` (argmax, ties to the
/// smallest id; a NaN flags the row). At the end of a row the elements past it are -inf (load_vector's fill).
template <int N>
__device__ __forceinline__ void fold_greedy_chunk(PassState& state, const float (&l)[N], int first) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (l[i] != l[i])
      state.flags |= kFlagNanLogit;
    if (l[i] > state.max) {
      state.max = l[i];
      state.max_index = first + i;
    }
  }
}

/// The element race of one thread over its share of a sub-tile: the best key so far. The key of element v
/// is k_v = (l_v - m_s) alpha c - log2 E_v (race_key): Gumbel-max over alpha l_v / T in base 2, m_s the
/// sub-tile's max, E_v = -log2 u_v from the rank draw. One number per element, compared as numbers with ties
/// to the smaller vocab id, so a sub-tile's winner is the same whatever order its elements meet in: the early
/// race (every warp over its own sub-tile, race_own_subtile) and the race over the winning sub-tile alone
/// (race_runs) give the same bits.
struct RaceState {
  float key;   ///< -inf while none
  float logit; ///< raw logit of the best
  int index;   ///< -1 when none
};

/// k = (l - m) alpha c - log2 E, rounded step by step (no contraction into an FMA: every code path that races
/// must compute the same bits). Masked logits (-inf) give -inf and never win; the sub-tile max gives
/// -log2 E, finite.
__device__ __forceinline__ float race_key(float logit, float subtile_max, float power_c, float log_noise) {
  return __fsub_rn(__fmul_rn(__fsub_rn(logit, subtile_max), power_c), log_noise);
}

/// Offers an element to a thread's race; a thread offers its elements by ascending vocab id, so "strictly
/// larger" keeps ties at the smaller id.
__device__ __forceinline__ void offer_element(RaceState& state, float key, float logit, int index) {
  if (key > state.key) {
    state.key = key;
    state.logit = logit;
    state.index = index;
  }
}

/// Races N consecutive logits starting at vocab id `first` into `state`, element i against its noise
/// log2 E_i = log_noise[i] (draw_race_noise). The loaders give elements past the end of the row as -inf
/// (load_run's fill, the shared tile's), whose key -inf never wins: no mask here.
template <int N>
__device__ __forceinline__ void race_chunk(RaceState& state, const float (&logits)[N],
                                           const float (&log_noise)[N], int first, float tile_max,
                                           float power_c) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    offer_element(state, race_key(logits[i], tile_max, power_c, log_noise[i]), logits[i], first + i);
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

template <DType DTYPE> __device__ __forceinline__ uint32_t negative_infinity_bits() {
  if constexpr (DTYPE == DType::kFloat32)
    return 0xff800000u;
  else if constexpr (DTYPE == DType::kBFloat16)
    return 0xff80ff80u;
  else
    return 0xfc00fc00u;
}

/// Loads vector `first .. first + min(count, N)` of a row (count: the elements left in the row from `first`,
/// >= 1, possibly more than a vector): one 16-byte load when the row is aligned and the vector full,
/// element loads otherwise (missing elements read as -inf). Either way the same bits come out, so the fold
/// below does not depend on a row's alignment. The full-vector test reads the unclamped count on purpose:
/// with `count == N` on load_tile's max(0, min(N, left)), CUDA 13.0's ptxas fused the test into that
/// clamp (VIMNMX.RELU with a predicate output) in the streaming path of every pass instance, and a
/// partial last vector (the 517-wide rows' ids 516-519, count 1) took the 16-byte load at aligned score
/// positions: it read the 3 elements past the row (the next position's logits, or a padded row's zeros)
/// instead of the -inf fill. The fold masked them until the forty-ninth session, so no result was wrong,
/// but the unmasked fold failed cycle_gpu and sample_gpu's 517-wide score() case (forty-eighth and
/// forty-ninth sessions, docs/toy_and_kernel_results.md). STREAMING (score positions, greedy, and the
/// verifier in verify.cu): evict-first, the logits are read once. Sampling jobs load with L2's normal
/// policy, so the winning tile is still in L2 when the last CTA reads it again.
template <DType DTYPE, bool STREAMING = true>
__device__ __forceinline__ uint4 load_vector(const typename DTypeTraits<DTYPE>::Scalar* row, int first,
                                             int count, bool aligned) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  if (aligned && count >= kPerVector) {
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

/// A global load issued where it stands in the program: as volatile asm, the compiler neither sinks it into
/// the branches that use its value nor drops it on the paths that do not. For values a kernel needs on most
/// paths whose address is known early (LogitsPassKernel's Philox keys). A plain weak load, as `*p` would be;
/// the "memory" clobber keeps it after the PDL wait (pdl_enter), since the predecessor may write what it
/// reads (the draw counters: advance_draw_counters).
__device__ __forceinline__ uint64_t load_now(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t load_now(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/// The 16-byte vectors of one tile a thread owns, loaded: thread t takes vectors t, t + 256, t + 512, ... of
/// the tile (kUnrollVectors of them, all loads issued before any is used), vector u holding logits
/// first[u] .. first[u] + count[u] (count 0: past the end of the row, -inf loaded: load_tile).
template <DType DTYPE> struct TileVectors {
  uint4 raw[kUnrollVectors];
  int first[kUnrollVectors];
  int count[kUnrollVectors];
};

/// The first logit of this thread's vector u of the tile starting at vocab id `begin` (TileVectors' layout).
template <DType DTYPE> __device__ __forceinline__ int tile_vector_first(int begin, int u) {
  return begin + (u * kPassThreads + static_cast<int>(threadIdx.x)) * DTypeTraits<DTYPE>::kPerVector;
}

/// Issues this thread's loads of the tile starting at vocab id `begin` (it ends at `end`). A vector past the
/// row's end (count 0) holds -inf, as a partial one does past the end (load_vector's fill), so the fold reads
/// every vector without asking. A full tile of an aligned row (every tile of it but the last, where the
/// length is not a multiple of the tile's) takes its four 16-byte loads without the per-vector tests
/// (CTA-uniform). Both against per-vector tests in the loader and in the fold, NVIDIA H200, one call, two
/// rounds, sample_bench us a launch in the chain / after a kernel that flushed L2: 256 x 128256 bf16 24.6 /
/// 29.4-29.5 -> 23.3 / 27.5-27.7 (62.7% -> 66.2% of copy bandwidth), fp32 39.7-39.8 / 40.6-40.9 -> 38.5-38.7
/// / 39.3-39.7 (77.7% -> 79.7-80.1%), 256 x 151936 fp32 80.4% -> 82.4-83.1%; 1-64 rows within 0.15 us; the
/// toy SMC cycle (N 8, V 128256 bf16) at 64 requests, K 4 / 8: 1,814.0 / 3,395.0 -> 1,781.5 / 3,337.8 us.
template <DType DTYPE, bool STREAMING>
__device__ __forceinline__ void load_tile(TileVectors<DTYPE>& tile,
                                          const typename DTypeTraits<DTYPE>::Scalar* row, int begin, int end,
                                          bool aligned) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  if (aligned && end - begin == kSplitLength<DTYPE>) {
#pragma unroll
    for (int u = 0; u < kUnrollVectors; ++u) {
      tile.first[u] = tile_vector_first<DTYPE>(begin, u);
      tile.count[u] = kPerVector;
      const uint4* address = reinterpret_cast<const uint4*>(row + tile.first[u]);
      tile.raw[u] = STREAMING ? __ldcs(address) : __ldcg(address);
    }
    return;
  }
  const uint32_t fill = negative_infinity_bits<DTYPE>();
#pragma unroll
  for (int u = 0; u < kUnrollVectors; ++u) {
    tile.first[u] = tile_vector_first<DTYPE>(begin, u);
    const int left = end - tile.first[u]; // unclamped: load_vector's full-vector test reads it
    tile.count[u] = max(0, min(kPerVector, left));
    if (left > 0)
      tile.raw[u] = load_vector<DTYPE, STREAMING>(row, tile.first[u], left, aligned);
    else
      tile.raw[u] = make_uint4(fill, fill, fill, fill);
  }
}

/// Issues this thread's loads of tile `c` of a job's row: a sample position keeps L2's normal policy (the
/// race re-reads its winning sub-tile), score positions stream (load_vector).
template <DType DTYPE>
__device__ __forceinline__ void load_job_tile(TileVectors<DTYPE>& tile,
                                              const typename DTypeTraits<DTYPE>::Scalar* row, int c,
                                              int vocab, bool sample_position, bool aligned) {
  const int begin = c * kSplitLength<DTYPE>;
  const int end = min(vocab, begin + kSplitLength<DTYPE>);
  if (sample_position)
    load_tile<DTYPE, false>(tile, row, begin, end, aligned);
  else
    load_tile<DTYPE, true>(tile, row, begin, end, aligned);
}

/// The greedy first read of one tile of one job, from its loaded vectors: this thread's argmax (the vectors
/// are folded in the order they were loaded).
template <DType DTYPE> __device__ __forceinline__ PassState fold_greedy_tile(const TileVectors<DTYPE>& tile) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  PassState state = empty_state();
#pragma unroll
  for (int u = 0; u < kUnrollVectors; ++u) {
    if (tile.count[u] > 0) {
      float values[kPerVector];
      unpack<DTYPE>(tile.raw[u], values);
      fold_greedy_chunk<kPerVector>(state, values, tile.first[u]);
    }
  }
  if (state.max == INFINITY)
    state.flags |= kFlagNanLogit;
  return state;
}

/// The largest of this thread's loaded logits, NaN if any is NaN, -inf if it holds none (its vectors hold
/// -inf past the row's end: load_tile). 16-bit logits are compared two at a time
/// in their own format (max.NaN.bf16x2 / f16x2, exact: the max is one of the operands), then widened.
template <DType DTYPE> __device__ __forceinline__ float thread_max(const TileVectors<DTYPE>& tile) {
  if constexpr (DTYPE != DType::kFloat32) {
    constexpr bool kBf16 = DTYPE == DType::kBFloat16;
    uint32_t pair = negative_infinity_bits<DTYPE>();
#pragma unroll
    for (int u = 0; u < kUnrollVectors; ++u) {
      const uint32_t words[4] = {tile.raw[u].x, tile.raw[u].y, tile.raw[u].z, tile.raw[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (kBf16)
          asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(pair) : "r"(pair), "r"(words[i]));
        else
          asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(pair) : "r"(pair), "r"(words[i]));
      }
    }
    float halves[8];
    unpack<DTYPE>(make_uint4(pair, pair, pair, pair), halves);
    return max_nan(halves[0], halves[1]);
  }
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  float m = -INFINITY;
#pragma unroll
  for (int u = 0; u < kUnrollVectors; ++u) {
    float values[kPerVector];
    unpack<DTYPE>(tile.raw[u], values);
#pragma unroll
    for (int i = 0; i < kPerVector; ++i)
      m = max_nan(m, values[i]);
  }
  return m;
}

/// The sum over this warp's lanes of `value`, on every lane: an xor butterfly, each step adding the same two
/// numbers on both lanes of a pair, so every lane ends with the same bits.
template <int UNROLL> __device__ __forceinline__ float warp_sum(float value) {
#pragma unroll(UNROLL)
  for (int offset = 16; offset >= 1; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

/// max_nan over this warp's lanes, on every lane: one redux.sync.max.s32 over order_key (order_key.hpp;
/// test_sample_cpu checks that the larger key maps back to max.NaN's bits), the same bits as a butterfly of
/// max_nan in 12 instructions instead of 5 dependent shuffle + max steps. With warp_merge_greedy: NVIDIA
/// H200, A/B in one call, two rounds, sample_bench us a launch in the chain: 1 / 8 / 64 x 128256
/// bf16 6.60-6.61 / 7.06-7.07 / 13.69-13.77 -> 6.45-6.46 / 6.94 / 13.20-13.29, 256 x 128256 bf16 23.28-23.29
/// -> 22.90-22.94 (66.2-66.3% -> 67.2-67.3% of copy), fp32 38.56-38.69 -> 38.24-38.42 (79.7-80.0%
/// -> 80.3-80.7%); the toy speculative cycle (K 4 / 8, V 128256 bf16) at 1 request 113.4 / 189.1 -> 111.9 /
/// 186.1 us, at 64 364.4 / 638.8 -> 356.6 / 623.6; the SMC cycles within 0.5%.
__device__ __forceinline__ float warp_max_nan(float value) {
  return from_order_key(__reduce_max_sync(0xffffffffu, order_key(value)));
}

/// A warp reduction's winner: its index (-1 when none) and the lane that holds it.
struct WarpArgmax {
  int index, lane;
};

/// What a lane that is no candidate offers to warp_smallest_candidate.
inline constexpr int kNoCandidate = 0x7fffffff;

/// The smallest index the lanes of this warp offer (kNoCandidate from a lane that is no candidate), and the
/// lane that offers it, on every lane (one redux.sync.min and a ballot): warp_argmax's and
/// warp_best_subtile's last step, after each has found the lanes that hold its maximum. Index -1 and any lane
/// when no lane is a candidate.
__device__ __forceinline__ WarpArgmax warp_smallest_candidate(int offered) {
  constexpr unsigned kAll = 0xffffffffu;
  const int best = __reduce_min_sync(kAll, offered);
  const int lane = (__ffs(__ballot_sync(kAll, offered == best)) - 1) & 31;
  return WarpArgmax{best == kNoCandidate ? -1 : best, lane};
}

/// The lane of this warp that holds the largest `value` (never NaN here), ties to the smallest `index`, and
/// that index, on every lane: two redux.sync, the max over order_key, then the min over the indices of the
/// lanes whose value equals it as a float (so -0 ties +0, as the float comparisons of merge_states and
/// offer_element do). A lane without a candidate has index < 0; when no lane has one, index is -1 and the
/// lane any. The order (the larger value, ties to the smaller index) is total on the lanes that hold a
/// candidate, so this picks what any reduction of merge_states<kGreedy> or of the race's comparisons would.
__device__ __forceinline__ WarpArgmax warp_argmax(float value, int index) {
  const float m = warp_max_nan(value); // every lane takes part (a collective: not behind the && below)
  return warp_smallest_candidate(index >= 0 && value == m ? index : kNoCandidate);
}

/// The greedy merge of a warp's lanes, on every lane: warp_argmax over the lanes' maxima (a lane's greedy max
/// is never NaN: fold_greedy_chunk skips NaN and flags it; a lane that holds no element has max -inf and
/// index -1), the winning lane's own max (its zero keeps its sign), the flags' OR: the same state, bit for
/// bit, as any reduction of merge_states<kGreedy> (until the fifty-second session, an xor butterfly of it).
__device__ __forceinline__ PassState warp_merge_greedy(PassState state) {
  const WarpArgmax best = warp_argmax(state.max, state.max_index);
  PassState out = empty_state();
  out.max = __shfl_sync(0xffffffffu, state.max, best.lane); // -inf when no lane holds one
  out.max_index = best.index;
  out.flags = __reduce_or_sync(0xffffffffu, state.flags);
  return out;
}

/// The sum over this warp's lanes of values in [0, TERMS] (a lane's sum of TERMS terms, each in [0, 1]; or
/// NaN), on every lane, in fixed point through two redux.sync.add: each lane splits its value into
/// an integer multiple of 2^-S and a remainder in units of 2^-2S (S as large as 32 lanes' totals fit in an
/// int: 20 for 32 terms), the warp adds each part exactly, and one FMA joins them. The total is that of the
/// values rounded to 2^-2S (2^-40 for 32 terms) and then rounded once to a float: since a sub-tile's sum is
/// >= 1 (its max's own term), more accurate than the five float additions of the butterfly, the same on every
/// lane and independent of the lanes' order. A NaN on any lane gives NaN (the F2I conversions would turn it
/// into 0). The split and the join are FixedPointSum's (order_key.hpp; test_sample_cpu checks the bounds and
/// the rounding on the host). With warp_argmax in the early
/// race: NVIDIA H200, A/B/C in one call, two rounds, sample_bench us a launch in the chain (before / the sums
/// / both): 1 x 128256 bf16 6.47 / 6.39 / 6.29, 8 x 128256 bf16 6.90-6.94 / 6.82 / 6.70-6.71, 1 x 32000
/// bf16 5.74-5.82 / 5.63 / 5.51; 64 rows within 0.05 us; 256 x 128256 bf16 22.93-22.94 / 22.99 / 22.99 and
/// fp32 38.31-38.43 / 38.44-38.46 / 38.45 (the register walk gained nothing); the toy cycles within 1%.
template <int TERMS> __device__ __forceinline__ float warp_sum_unit_terms(float value) {
  using Sum = FixedPointSum<TERMS>;
  constexpr unsigned kAll = 0xffffffffu;
  const typename Sum::Parts parts = Sum::split(value);
  const float total = Sum::join(__reduce_add_sync(kAll, parts.high), __reduce_add_sync(kAll, parts.low));
  return __any_sync(kAll, value != value) ? __int_as_float(0x7fffffff) : total;
}

/// The first read of one sub-tile (this warp's vectors of one tile, in registers) at a sampled or scored
/// position: its state on every lane. Two passes over the registers: the sub-tile's max M (the lanes' maxima,
/// then the warp's), then each lane's sums 2^((l - M) c) (and 2^(alpha (l - M) c) in kRacePower), one
/// exponential an element (two), then the warp's sums. Every exponent is relative to the sub-tile's own max,
/// so nothing is rescaled along the way and the lanes' states need no merge; a NaN or +inf logit flags the
/// sub-tile (max NaN or +inf, sums NaN), a sub-tile of -inf only (or of nothing) keeps sums 0. Against the
/// online fold it replaced (each lane's running max and rescaled sums, then five merges of lane states across
/// the warp: about 350 instructions a thread a bf16 tile, now about 215), NVIDIA H200, one call, two rounds,
/// sample_bench us a launch in the chain / after a kernel that flushed L2: 256 x 128256 bf16 30.3 / 35.5-35.6
/// -> 24.6 / 29.8-30.0 (51.0% -> 62.7% of copy bandwidth), fp32 43.6-43.75 / 46.1-46.35 -> 39.8 / 40.8-41.0
/// (70.7% -> 77.4%), 64 x 128256 bf16 15.0 / 15.9-16.1 -> 13.65 / 14.9-15.0, 1 x 128256 bf16 6.85 /
/// 10.9-11.4 -> 6.63 / 10.75-10.9; the toy SMC cycle (N 8, K 4, V 128256 bf16) at 1 / 8 / 64 requests
/// 156.7-157.4 / 364.9-366.5 / 1,893.2-1,895.1 -> 154.5-154.7 / 355.4-355.6 / 1,811.9-1,814.9 us.
template <DType DTYPE, PassMode MODE, int UNROLL>
__device__ __forceinline__ PassState fold_subtile(const TileVectors<DTYPE>& tile, const JobContext& job) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  PassState state = empty_state();
  const float m = warp_max_nan(thread_max<DTYPE>(tile));
  state.max = m;
  if (m != m || m == INFINITY) { // a NaN or +inf logit in the sub-tile
    state.flags = kFlagNanLogit;
    state.sum = NAN;
    state.sum_power = NAN;
    return state;
  }
  if (m == -INFINITY)
    return state; // all masked (or past the row's end): sums 0
  float sum = 0.0f, sum_power = 0.0f;
#pragma unroll
  for (int u = 0; u < kUnrollVectors; ++u) { // a vector past the row's end is -inf: it adds 0
    float l[kPerVector], e[kPerVector], e_power[kPerVector];
    unpack<DTYPE>(tile.raw[u], l);
#pragma unroll
    for (int i = 0; i < kPerVector; ++i) {
      const float scaled = (l[i] - m) * job.c; // <= 0; -inf for masked
      e[i] = fast_exp2(scaled);
      if constexpr (MODE == PassMode::kRacePower)
        e_power[i] = fast_exp2(job.alpha * scaled);
    }
    sum += device::tree_sum<kPerVector>(e);
    if constexpr (MODE == PassMode::kRacePower)
      sum_power += device::tree_sum<kPerVector>(e_power);
  }
  constexpr int kLaneTerms = kUnrollVectors * kPerVector; // each <= 1: l <= m, c > 0, alpha > 0
  state.sum = warp_sum_unit_terms<kLaneTerms>(sum);
  state.sum_power = MODE == PassMode::kRacePower ? warp_sum_unit_terms<kLaneTerms>(sum_power) : state.sum;
  if (state.sum != state.sum || state.sum_power != state.sum_power) // c = inf (a denormal T): 0 x inf
    state.flags = kFlagNanLogit;
  return state;
}

/// One tile's sub-tile states, one a warp (every lane holds its warp's): an empty state for a row with a bad
/// parameter (greedy mode), else the greedy fold merged across the warp, or fold_subtile. No block-wide
/// reduction: the job's merge combines the sub-tiles.
template <DType DTYPE, PassMode MODE, int UNROLL>
__device__ __forceinline__ PassState subtile_state(const TileVectors<DTYPE>& tile, const JobContext& job,
                                                   uint32_t param_flags) {
  if constexpr (MODE == PassMode::kGreedy) {
    const PassState state = param_flags ? empty_state() : fold_greedy_tile<DTYPE>(tile);
    return warp_merge_greedy(state);
  } else {
    return param_flags ? empty_state() : fold_subtile<DTYPE, MODE, UNROLL>(tile, job);
  }
}

/// Sub-tiles per tile, the unit of the sampler's first level: one per warp of the tile's CTA. Sub-tile w of a
/// tile is the set of elements warp w folds in subtile_state: its lanes' vectors w * 32 + lane + 256 k of the
/// tile, k < kUnrollVectors (not contiguous; the last tile's may be partial or empty).
inline constexpr int kWarpSize = 32;
inline constexpr int kSubTiles = kPassThreads / kWarpSize;
static_assert(kPassThreads % kWarpSize == 0, "a CTA is whole warps");

template <DType DTYPE> inline constexpr int kSubTileLength = kSplitLength<DTYPE> / kSubTiles;

/// Logits per run of the element race: the winning sub-tile spread over the CTA's threads (4 bf16 / 2 fp32
/// each), a run never longer than one Philox group (4) and dividing a vector, so a thread draws one Philox
/// group and pays few log2f. Runs (and so a thread's elements) go by ascending vocab id.
template <DType DTYPE>
inline constexpr int kRaceRun = kSubTileLength<DTYPE> / kPassThreads >= 4   ? 4
                                : kSubTileLength<DTYPE> / kPassThreads >= 2 ? 2
                                                                            : 1;
static_assert(DTypeTraits<DType::kFloat32>::kPerVector % kRaceRun<DType::kFloat32> == 0 &&
                  DTypeTraits<DType::kBFloat16>::kPerVector % kRaceRun<DType::kBFloat16> == 0,
              "a race run lies inside one vector");

/// The float of one element's bits (the low 16 bits for bf16 / fp16).
template <DType DTYPE> __device__ __forceinline__ float element_to_float(uint32_t bits) {
  if constexpr (DTYPE == DType::kFloat32)
    return __uint_as_float(bits);
  else if constexpr (DTYPE == DType::kBFloat16)
    return __uint_as_float(bits << 16);
  else
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

/// Loads the N logits [first, first + min(count, N)) of a row from L2 (the race's re-read: __ldcg, the tile's
/// CTA read it moments ago with L2's normal policy) as floats; missing ones (count < N) read as -inf. One 8-
/// or 16-byte load when the row is aligned and the run full and that wide, element loads otherwise: the same
/// values either way. `count` is the elements left in the row from `first` (>= 1, unclamped: see
/// load_vector for why the full-run test does not read a clamped count).
template <DType DTYPE, int N>
__device__ __forceinline__ void load_run(const typename DTypeTraits<DTYPE>::Scalar* row, int first, int count,
                                         bool aligned, float (&out)[N]) {
  constexpr int kElementBytes = DTYPE == DType::kFloat32 ? 4 : 2;
  constexpr int kBytes = N * kElementBytes;
  if constexpr (kBytes == 8 || kBytes == 16) {
    if (aligned && count >= N) { // row + first is kBytes-aligned: first is a multiple of N
      uint32_t words[kBytes / 4];
      if constexpr (kBytes == 16) {
        const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(row + first));
        words[0] = raw.x;
        words[1] = raw.y;
        words[2] = raw.z;
        words[3] = raw.w;
      } else {
        const uint2 raw = __ldcg(reinterpret_cast<const uint2*>(row + first));
        words[0] = raw.x;
        words[1] = raw.y;
      }
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if constexpr (kElementBytes == 4)
          out[i] = element_to_float<DTYPE>(words[i]);
        else
          out[i] = element_to_float<DTYPE>(words[i / 2] >> (16 * (i % 2)));
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (i < count) {
      if constexpr (kElementBytes == 4)
        out[i] = element_to_float<DTYPE>(__ldcg(reinterpret_cast<const unsigned int*>(row + first + i)));
      else
        out[i] = element_to_float<DTYPE>(__ldcg(reinterpret_cast<const unsigned short*>(row + first + i)));
    } else {
      out[i] = -INFINITY;
    }
  }
}

/// The element race's noise of this thread: log2 E, E = -log2 u, for each element of its runs of a sub-tile
/// (race_runs: run t + 256 i of kRaceRun elements, i < kRunsPerThread), u from the rank draw of the element's
/// rank inside the sub-tile (philox.hpp, kRankDrawElement), not from its vocab id. It depends on the job's
/// keys alone, not on which sub-tile wins, so a CTA can draw it before the race (early: while its logits
/// load) and the serial tail keeps only the keys and the comparisons. log2f, not lg2.approx: winners
/// have u near 1 where the approximation's 2^-22 absolute error is a large relative error of E.
template <DType DTYPE> struct RaceNoise {
  static constexpr int kRun = kRaceRun<DTYPE>;
  static constexpr int kRuns = kSubTileLength<DTYPE> / kRun;
  static constexpr int kRunsPerThread = (kRuns + kPassThreads - 1) / kPassThreads;
  float log_noise[kRunsPerThread][kRun]; ///< log2 E of each element of the thread's runs
};

template <DType DTYPE, int UNROLL>
__device__ __forceinline__ RaceNoise<DTYPE> draw_race_noise(const JobContext& job) {
  using Noise = RaceNoise<DTYPE>;
  constexpr int kRun = Noise::kRun;
  static_assert(kRun <= 4 && 4 % kRun == 0, "a run's ranks lie in one Philox group");
  Noise noise;
#pragma unroll
  for (int i = 0; i < Noise::kRunsPerThread; ++i) {
    // The run's first rank: its elements are ranks run * kRun .. run * kRun + kRun - 1 of the sub-tile.
    const uint32_t rank = static_cast<uint32_t>((static_cast<int>(threadIdx.x) + i * kPassThreads) * kRun);
    const uint4 group = device::philox_rank_group<UNROLL>(job.seed, rank >> 2, job.draw_counter, job.particle,
                                                          job.stream_word);
#pragma unroll
    for (int e = 0; e < kRun; ++e)
      noise.log_noise[i][e] = log2f(
          -log2f(device::uniform_open01(device::group_word(group, (rank & 3u) + static_cast<uint32_t>(e)))));
  }
  return noise;
}

/// The element race over sub-tile `warp` of the tile starting at vocab id `tile_begin` (max tile_max): this
/// thread's best key (race_key). The sub-tile's 32 * kUnrollVectors vectors, j = lane + 32 k (the tile's
/// vector k * 256 + warp * 32 + lane), are cut into runs of kRaceRun logits; thread t races runs t, t + 256,
/// ... (one run per thread at the default tiling). Run `run` holds ranks run * kRaceRun .. of the sub-tile
/// (runs ascend with vocab ids), whose noise the thread drew in `noise`. "Strictly better" keeps ties at the
/// smaller id here as in the reduction across threads. power_c = alpha c (c when alpha = 1).
/// load_run_at(first, vector, offset, left, values) gives a run's logits: vocab ids first .. first +
/// min(left, kRun), `left` the elements left in the row, at element `offset` of the tile's vector `vector`
/// (missing ones -inf).
template <DType DTYPE, class LoadRun>
__device__ __forceinline__ RaceState race_runs(const LoadRun& load_run_at, int vocab, int tile_begin,
                                               int warp, const RaceNoise<DTYPE>& noise, float tile_max,
                                               float power_c) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  constexpr int kRun = kRaceRun<DTYPE>;
  constexpr int kRunsPerVector = kPerVector / kRun;
  constexpr int kRuns = RaceNoise<DTYPE>::kRuns;
  constexpr int kRunsPerThread = RaceNoise<DTYPE>::kRunsPerThread;
  RaceState state{-INFINITY, -INFINITY, -1};
#pragma unroll
  for (int i = 0; i < kRunsPerThread; ++i) {
    const int run = static_cast<int>(threadIdx.x) + i * kPassThreads;
    if (kRuns % kPassThreads != 0 && run >= kRuns)
      break;
    const int j = run / kRunsPerVector; // the sub-tile's j-th vector: lane j % 32 of pass j / 32
    const int vector = (j / kWarpSize) * kPassThreads + warp * kWarpSize + j % kWarpSize;
    const int offset = (run % kRunsPerVector) * kRun; // the run's first element inside its vector
    const int first = tile_begin + vector * kPerVector + offset;
    // The elements left in the row, unclamped for load_run's full-run test (see load_vector); none past the
    // end of the row (a partial last tile): nothing to load.
    const int left = vocab - first;
    if (left <= 0)
      continue;
    float values[kRun];
    load_run_at(first, vector, offset, left, values);
    race_chunk<kRun>(state, values, noise.log_noise[i], first, tile_max, power_c);
  }
  return state;
}

/// The element race over the row in global memory (ticket mode: the re-read from L2).
template <DType DTYPE>
__device__ __forceinline__ RaceState race_subtile(const typename DTypeTraits<DTYPE>::Scalar* row, int vocab,
                                                  int tile_begin, int warp, bool aligned,
                                                  const RaceNoise<DTYPE>& noise, float tile_max,
                                                  float power_c) {
  constexpr int kRun = kRaceRun<DTYPE>;
  const auto load = [&](int first, int, int, int count, float(&values)[kRun]) {
    load_run<DTYPE, kRun>(row, first, count, aligned, values);
  };
  return race_runs<DTYPE>(load, vocab, tile_begin, warp, noise, tile_max, power_c);
}

/// The element race over this CTA's shared copy of its tile (cluster mode: the CTA owns the winning
/// sub-tile): the same runs, threads and arithmetic, so the same winner. `tile` holds the tile's vectors in
/// order, the elements past the end of the row as -inf (load_vector's fill, or a whole -inf vector).
template <DType DTYPE>
__device__ __forceinline__ RaceState race_subtile_shared(const uint4* tile, int vocab, int tile_begin,
                                                         int warp, const RaceNoise<DTYPE>& noise,
                                                         float tile_max, float power_c) {
  constexpr int kRun = kRaceRun<DTYPE>;
  constexpr int kElementsPerWord = DTYPE == DType::kFloat32 ? 1 : 2;
  const auto load = [&](int, int vector, int offset, int, float(&values)[kRun]) {
    // The run's elements offset .. offset + kRun of the vector, by 32-bit shared loads (a 16-bit element is
    // the low or high half of its word, as it lies in memory).
    const uint32_t* words = reinterpret_cast<const uint32_t*>(tile + vector);
#pragma unroll
    for (int e = 0; e < kRun; ++e) {
      const int element = offset + e;
      const uint32_t word = words[element / kElementsPerWord];
      values[e] = element_to_float<DTYPE>(kElementsPerWord == 1 ? word : word >> (16 * (element % 2)));
    }
  };
  return race_runs<DTYPE>(load, vocab, tile_begin, warp, noise, tile_max, power_c);
}

/// The early race (PassArgs::early_race): a warp races its own sub-tile of the tile it just folded, from the
/// vectors still in its registers, against the CTA's table of rank noise (log2 E of rank j at log_noise[j],
/// draw_race_noise's runs written out), and every lane returns the winner.
/// Sub-tile w's vector j = lane + 32 u is the tile's vector u * 256 + w * 32 + lane, its elements ranks j *
/// kPerVector + e: the same keys race_runs computes for that sub-tile, so the same winner. `sub` is the
/// sub-tile's state (subtile_state: its max is the sub-tile's); a sub-tile that is all -inf or holds a NaN
/// races nothing (its state flags it).
template <DType DTYPE, int UNROLL>
__device__ __forceinline__ SubTileWinner race_own_subtile(const PassState& sub,
                                                          const TileVectors<DTYPE>& tile,
                                                          const float* log_noise, float power_c) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  RaceState best{-INFINITY, -INFINITY, -1};
  if (sub.max != -INFINITY && sub.max == sub.max) { // warp-uniform
#pragma unroll
    for (int u = 0; u < kUnrollVectors; ++u) {
      if (tile.count[u] > 0) {
        float values[kPerVector];
        unpack<DTYPE>(tile.raw[u], values); // elements past the row's end are -inf (load_vector)
        const float* noise = log_noise + (lane + kWarpSize * u) * kPerVector;
#pragma unroll
        for (int e = 0; e < kPerVector; ++e)
          offer_element(best, race_key(values[e], sub.max, power_c, noise[e]), values[e], tile.first[u] + e);
      }
    }
  }
  // Every lane ends with the winner (lane 0 stores it beside the state, and the merge needs it in the warp
  // leader's registers): the race's order (the larger key, ties to the smaller vocab id) is total, so any
  // reduction picks the same element; warp_argmax (keys are finite or -inf, a lane without a candidate has
  // index -1). Until the fifty-second session an xor butterfly (warp_in_order::reduce_down to lane 0 gave
  // its bits 0.1-0.15 us slower a launch, forty-fifth session).
  const WarpArgmax winner = warp_argmax(best.key, best.index);
  return SubTileWinner{winner.index, __shfl_sync(kAll, best.logit, winner.lane)};
}

/// The CTA's element-race winner from its threads' standings, on thread 0 (the call holds a
/// __syncthreads(); `totals` is kPassThreads / kWarpSize shared slots). The race's order is total (keys are
/// finite or -inf, vocab ids distinct), so every reduction picks the same element: warp_argmax in each warp,
/// then in warp 0 over the warps' winners (two redux.sync steps each). Against the block reduction it
/// replaced (cub's warp-reductions order as loops: butterflies, then thread 0's fold), NVIDIA H200, A/B in
/// one call, two rounds, sample_bench us a launch in the chain (the late race runs in launches of more than
/// one wave): 64 x 128256 bf16 13.24-13.27 -> 12.56-12.59, fp32 17.64-17.81 -> 17.08-17.15; 256 x 128256
/// bf16 23.00 -> 22.70-22.72 (67.0-67.1% -> 67.9-68.0% of copy), fp32 38.31-38.44 -> 38.00-38.15 (80.2-80.5%
/// -> 80.9-81.2%); 1 / 8 rows 0.05-0.1 us; the toy SMC cycle (K 8) at 8 / 64 requests 620.0 / 3,332.5 ->
/// 614.5 / 3,316.2 us.
__device__ __forceinline__ RaceState block_race_winner(const RaceState& mine, RaceState* totals) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize,
            warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const WarpArgmax in_warp = warp_argmax(mine.key, mine.index);
  if (lane == in_warp.lane) // a lane without a candidate stores its own -inf standing
    totals[warp] = mine;
  __syncthreads();
  RaceState best{-INFINITY, -INFINITY, -1};
  if (warp == 0) {
    const RaceState total = lane < kPassThreads / kWarpSize ? totals[lane] : best;
    const WarpArgmax across = warp_argmax(total.key, total.index);
    best.key = __shfl_sync(kAll, total.key, across.lane);
    best.logit = __shfl_sync(kAll, total.logit, across.lane);
    best.index = across.index;
  }
  return best;
}

/// Cluster mode's limits (the launcher also checks that the device schedules the cluster): at most 8 tiles a
/// job (the portable cluster size) and 64 CTAs a launch. Measured on an H200 (sample_bench, same build, graph
/// us a launch, cluster / ticket): 1 and 8 rows of 4 or 8 tiles gain 0.25-0.6 us; 64 rows of 4 tiles (256
/// CTAs) lose 1-4 us, and 8 rows of 16 tiles lose 0.8 us (waiting for whole clusters to be scheduled costs
/// more than the ticket's fence, atomic and re-read).
inline constexpr int kMaxClusterTiles = 8;
inline constexpr int kMaxClusterCtas = 64;

/// Walk mode's limit: the sub-tile states of a job (kSubTiles a tile) that its CTA keeps in shared memory, so
/// at most 64 tiles a job (bf16 / fp16 vocabularies up to 524288, fp32 up to 262144).
inline constexpr int kMaxWalkSubTiles = 512;

/// Sub-tile s's record (a PassState or a SubTileWinner) kept in shared memory: this CTA's (a one-tile job, or
/// walk mode's), or, in cluster mode, that of the cluster's CTA s / kSubTiles (DSMEM).
template <class T> __device__ __forceinline__ T load_shared_record(const T* shared, bool cluster, int s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster) {
    const T* peer = cooperative_groups::this_cluster().map_shared_rank(const_cast<T*>(shared),
                                                                       static_cast<unsigned>(s / kSubTiles));
    return peer[s % kSubTiles];
  }
#else
  if (cluster) // cluster mode launches only on compute capability >= 9 (sample.cu)
    __trap();
#endif
  return shared[s];
}

/// A job's sub-tile states as its last CTA reads them: from the workspace, where the job's CTAs wrote them
/// (L2 loads: L1 is not coherent across CTAs), or, for a one-tile job, from the CTA's shared memory.
struct SubTileStates {
  const PassState* global; ///< null: one tile or a cluster, read `shared`
  const PassState* shared; ///< this CTA's kSubTiles states
  bool cluster;            ///< sub-tile s is in the shared memory of the cluster's CTA s / kSubTiles
  __device__ __forceinline__ PassState load(int s) const {
    if (cluster || global == nullptr)
      return load_shared_record(shared, cluster, s);
    PassState state;
    state.max = __ldcg(&global[s].max);
    state.sum = __ldcg(&global[s].sum);
    state.sum_power = __ldcg(&global[s].sum_power);
    state.max_index = __ldcg(&global[s].max_index);
    state.flags = __ldcg(&global[s].flags);
    return state;
  }
};

/// A job's sub-tile winners (launches that race early), where SubTileStates finds the states.
struct SubTileWinners {
  const SubTileWinner* global;
  const SubTileWinner* shared;
  bool cluster;
  __device__ __forceinline__ SubTileWinner load(int s) const {
    if (cluster || global == nullptr)
      return load_shared_record(shared, cluster, s);
    return SubTileWinner{__ldcg(&global[s].index), __ldcg(&global[s].logit)};
  }
};

/// log2 E_s of sub-tile s's tile draw (E_s = -log2 u_s, element kTileDrawElement + s): the noise term of its
/// key in offer_subtile.
template <int UNROLL> __device__ __forceinline__ float subtile_noise(const JobContext& job, int s) {
  const uint32_t word = device::philox_tile_word<UNROLL>(job.seed, static_cast<uint32_t>(s), job.draw_counter,
                                                         job.particle, job.stream_word);
  return log2f(-log2f(device::uniform_open01(word)));
}

/// Offers sub-tile s (state `sub`, noise log2 E_s) to this thread's sub-tile race; a thread offers its
/// sub-tiles in ascending order, so ties keep the first. The key is log2 Z_s up to an offset common to the
/// row, minus log2 E_s: m_s alpha c + log2 sum_s - log2 E_s (alpha c = power_c), in double, so m_s alpha c
/// loses nothing to rounding at any scale of the logits. It does not subtract the row max M as
/// log Z_s = (m_s - M) alpha c + log2 sum_s + M alpha c would: M is common to every sub-tile, so the winner
/// is the same without it, and the race can run beside the row's merge (one block reduction for both).
/// Sub-tiles that are entirely -inf or empty (Z_s = 0) never win.
template <PassMode MODE, class Best>
__device__ __forceinline__ void offer_subtile(Best& best, const PassState& sub, float noise, int s,
                                              float power_c, SubTileWinner winner = {}) {
  if (sub.max == -INFINITY)
    return;
  const float sum = MODE == PassMode::kRacePower ? sub.sum_power : sub.sum;
  const double key = fma(static_cast<double>(sub.max), static_cast<double>(power_c),
                         static_cast<double>(log2f(sum) - noise));
  if (best.index < 0 || key > best.key) {
    best.key = key;
    best.max = sub.max;
    best.index = s;
    if constexpr (std::is_same_v<Best, RacedSubtileBest>)
      best.winner = winner;
  }
}

/// A job's merged state and its sub-tile race's standing, reduced together across the CTA.
template <class Best> struct RowStanding {
  PassState state;
  Best subtile;
};

/// The lane holding this warp's best sub-tile standing in better_subtile's order (the larger key, ties to
/// the smaller index; a standing with index < 0 holds none), and its index, on every lane: three redux.sync
/// over the key's order_key (its high word, then its low word among the lanes that share the high word, then
/// the smallest index among the lanes that share the key). `key + 0.0` turns -0 into +0, so keys that compare
/// equal as doubles get equal order keys, as better_subtile's comparison has them.
__device__ __forceinline__ WarpArgmax warp_best_subtile(double key, int index) {
  constexpr unsigned kAll = 0xffffffffu;
  const int64_t k = order_key(key + 0.0);
  const int high = static_cast<int>(k >> 32);
  const unsigned low = static_cast<unsigned>(k);
  const bool held = index >= 0;
  const int best_high = __reduce_max_sync(kAll, held ? high : INT_MIN);
  const bool high_ties = held && high == best_high;
  const unsigned best_low = __reduce_max_sync(kAll, high_ties ? low : 0u);
  return warp_smallest_candidate(high_ties && low == best_low ? index : kNoCandidate);
}

/// A warp's part of a job's row standing (block_row_standing).
template <class Best> struct WarpStanding {
  float sum, sum_power;
  uint32_t flags;
  Best subtile;
};

/// The sub-tile standing of a job that does not race (score positions, greedy, kRace rows past their sample
/// position): block_row_standing reduces the merged state only.
struct NoSubtileRace {};

/// A job's merged state and sub-tile race standing from its threads' (each thread's sub-tiles already merged
/// in ascending order), on thread 0; the call holds two __syncthreads(). Without rescaling merges:
/// the row's max M first (a redux.sync a warp, then every thread folds the warps' maxima from shared memory),
/// then each thread's sums relative to M, 2^((m_t - M) c) sum_t (and with alpha c), a float butterfly a warp,
/// the flags' OR and the best sub-tile (warp_best_subtile) a warp, and thread 0 adds the warps' sums in warp
/// order. The sums are relative to one max, not rescaled at every step, so the row's log Z is as accurate as
/// before or more; the sub-tile winner is the same (better_subtile is a total order on the offered
/// sub-tiles). `valid` threads hold a sub-tile (the others hold empty standings). Against the block reduction
/// it replaced (cub's warp-reductions order as loops: the butterflies of 12-word standings, each
/// step a merge with exponentials, then thread 0's merges of the warps' totals): NVIDIA H200, A/B in one
/// call, two rounds, sample_bench us a launch in the chain: 256 x 128256 bf16 22.47 -> 21.77-21.78 (69.0%
/// -> 71.2% of copy), fp32 37.46-37.51 -> 36.48 (82.7% -> 85.0%), 256 x 151936 fp32 42.90-43.10
/// -> 42.12-42.15, 64 x 128256 fp32 17.19 -> 16.01, bf16 12.51-12.55 -> 12.30-12.33, 1 x 128256 fp32 6.37
/// -> 6.09, bf16 6.21 -> 6.16; 1 x 32000 bf16 5.46 -> 5.54; the toy SMC cycle at 64 requests, K 4 / 8:
/// 1,774.0 / 3,318.4 -> 1,767.8 / 3,305.9 us, the other cycles within 0.5%.
///
/// ONE_WARP: where one warp holds every sub-tile (valid <= 32: bf16 / fp16 rows of at most 4 tiles, V <=
/// 32768; fp32 rows of at most 2), warp 0 returns its own reduction and no barrier runs: the same bits, since
/// the other warps would add nothing. NVIDIA H200, A/B in one call, two rounds, sample_bench us a launch in
/// the chain (fifty-third session): x 32000 bf16 at 1 / 8 / 64 rows 5.52-5.53 / 5.65-5.66 / 7.55-7.58 ->
/// 5.04 / 5.18 / 7.07, every other shape within 0.06 us. The register walk's instance keeps the barriers
/// (kOneWarpMerge): with the path in it, ptxas scheduled its tile loop differently and 256 x 128256 bf16
/// measured 21.98-22.01 -> 22.15-22.17 us, against 9.36-9.38 -> 9.11-9.15 at 256 x 32000.
template <PassMode MODE, int UNROLL, bool ONE_WARP, class Best>
__device__ __forceinline__ RowStanding<Best> block_row_standing(const PassState& state, const Best& subtile,
                                                                float c, float alpha, int valid) {
  static_assert(MODE != PassMode::kGreedy, "greedy jobs merge in block_merge_greedy");
  constexpr bool kRaces = !std::is_same_v<Best, NoSubtileRace>;
  constexpr int kWarps = kPassThreads / kWarpSize;
  __shared__ float warp_maxima[kWarps];
  __shared__ WarpStanding<Best> warp_standings[kWarps];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize,
            warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int warps = (valid + kWarpSize - 1) / kWarpSize; // the warps that hold a sub-tile (>= 1)
  // One warp holds every sub-tile (bf16 rows of at most 4 tiles, fp32 of 2): warp 0 alone, no barrier, the
  // same bits (ONE_WARP: the instance takes this path).
  const bool one_warp = ONE_WARP && warps == 1;
  const float warp_max = warp_max_nan(state.max);
  float m = warp_max;
  if (!one_warp) {
    if (lane == 0)
      warp_maxima[warp] = warp_max;
    __syncthreads();
    m = warp_maxima[0];
#pragma unroll(UNROLL)
    for (int w = 1; w < kWarps; ++w)
      if (w < warps)
        m = max_nan(m, warp_maxima[w]);
  }
  float sum = 0.0f, sum_power = 0.0f;
  if (state.max != -INFINITY) { // a NaN max (or M) gives NaN sums; the flags carry it
    const float shift = (state.max - m) * c;
    sum = state.sum * fast_exp2(shift);
    if constexpr (MODE == PassMode::kRacePower)
      sum_power = state.sum_power * fast_exp2(alpha * shift);
  }
  sum = warp_sum<UNROLL>(sum);
  if constexpr (MODE == PassMode::kRacePower)
    sum_power = warp_sum<UNROLL>(sum_power);
  const uint32_t flags = __reduce_or_sync(0xffffffffu, state.flags);
  Best warp_best{};
  if constexpr (kRaces) {
    const WarpArgmax best = warp_best_subtile(subtile.key, subtile.index);
    warp_best = device::warp_in_order::shuffle_from(subtile, best.lane);
  }
  RowStanding<Best> out;
  if (one_warp) {
    if (threadIdx.x == 0) {
      out.state = PassState{m, sum, MODE == PassMode::kRacePower ? sum_power : sum, -1, flags};
      out.subtile = warp_best;
    }
    return out;
  }
  if (lane == 0)
    warp_standings[warp] = WarpStanding<Best>{sum, sum_power, flags, warp_best};
  __syncthreads();
  if (threadIdx.x == 0) {
    WarpStanding<Best> total = warp_standings[0];
#pragma unroll(UNROLL)
    for (int w = 1; w < kWarps; ++w) {
      if (w < warps) {
        const WarpStanding<Best> next = warp_standings[w];
        total.sum += next.sum;
        total.sum_power += next.sum_power;
        total.flags |= next.flags;
        if constexpr (kRaces)
          total.subtile = better_subtile(total.subtile, next.subtile);
      }
    }
    out.state =
        PassState{m, total.sum, MODE == PassMode::kRacePower ? total.sum_power : total.sum, -1, total.flags};
    out.subtile = total.subtile;
  }
  return out;
}

/// block_row_standing with NoSubtileRace and block_merge_greedy for the jobs that do not race, against the
/// block reduction of merge_states they replaced: NVIDIA H200, A/B in one call, one round, toy cycles (N 8, K
/// 4, V 128256 bf16), graph us at 1 / 8 / 64 requests: SMC 152.0 / 346.4 / 1,768.4 -> 151.6 / 347.1 / 1,754.8
/// (non-model at 64 requests 447.4 -> 429.4, 1.59x -> 1.52x its floor), speculative 111.6 / 145.1 / 356.1 ->
/// 109.1 / 142.3 / 353.4 (non-model at 1 request 47.8 -> 45.5); sample_bench within 0.1 us (its rows race).
///
/// A greedy job's merged state from its threads' (each thread's sub-tiles merged in ascending order), on
/// thread 0; the call holds a __syncthreads() unless one warp holds all `valid` sub-tiles (ONE_WARP).
/// warp_merge_greedy a warp, then thread 0 merges the warps' states in warp order: the same state as any
/// reduction of merge_states<kGreedy>, which selects the greatest max, ties to the smallest vocab id (a total
/// order on the states that hold an element), and ORs the flags.
template <int UNROLL, bool ONE_WARP>
__device__ __forceinline__ PassState block_merge_greedy(const PassState& state, int valid) {
  constexpr int kWarps = kPassThreads / kWarpSize;
  __shared__ PassState warp_states[kWarps];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize,
            warp = static_cast<int>(threadIdx.x) / kWarpSize;
  PassState merged = warp_merge_greedy(state);
  if (ONE_WARP && valid <= kWarpSize) // one warp holds every sub-tile (block_row_standing's ONE_WARP)
    return merged;
  if (lane == 0)
    warp_states[warp] = merged;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll(UNROLL)
    for (int w = 1; w < kWarps; ++w)
      merged = merge_states<PassMode::kGreedy>(merged, warp_states[w], 0.0f, 1.0f); // greedy: no c, alpha
  }
  return merged;
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
  int splits{};   ///< tiles per job: ceil(vocab / kSplitLength<DTYPE>)
  bool cluster{}; ///< a job's CTAs are one thread-block cluster (splits > 1; header comment)
  bool walk{};    ///< a job's CTAs walk its tiles in order (walk mode; header comment)
  /// The staged walk: CTAs a job, walker w folding tiles w * walk_tiles .. (w + 1) * walk_tiles - 1
  int walkers{1};
  int walk_tiles{}; ///< the staged walk: tiles a walker folds (the last walker's may be fewer)
  /// Every CTA of a sampling job draws its element-race noise (draw_race_noise) while its logits load, not
  /// only the job's last CTA after the merge: for launches whose sample positions' CTAs fit one wave, where
  /// the other CTAs' draws cost nothing and the last CTA's tail gets shorter. The same numbers either way.
  bool early_noise{};
  /// Every warp races its own sub-tile while its tile is in registers (race_own_subtile), so the job's merge
  /// ends with the token: no element race after it, no re-read from L2 and no tile copy in shared memory.
  /// Launches whose sample positions' CTAs fit one wave, not walk mode (where a CTA folds many tiles and is
  /// bound by the fold); SMCGRAPH_SAMPLER_RACE=late turns it off. The same bits either way.
  bool early_race{};
  /// splits * kSubTiles sub-tile states per job: sub-tile s (over the row) of job j at j * splits * 8 + s
  PassState* partials{};
  /// early_race in ticket mode: the sub-tiles' winners, beside the partials (same indexing)
  SubTileWinner* winners{};
  uint32_t* tickets{};
};

/// Which job and tile a CTA works on.
struct JobPlace {
  int row, position, job_index, split;
  bool sample_position;
  bool aligned; ///< the job's logits are 16-byte aligned
};

/// Walk mode's first read: the CTA folds every tile of its job in order, each exactly as a tile's own CTA
/// would (the same threads, vectors and warp merge), and keeps sub-tile s's state at states[s]. The loads of
/// the next two tiles are in flight while a tile is folded (three tiles in registers: 126 of them in the
/// walk instance), so a tile does not wait one memory latency after the fold of the one before. `first` holds
/// tile 0's loads, issued by the kernel. (One tile ahead, 3 CTAs an SM: 256 x 128256 bf16 44.9 us against
/// 33.1 with two, H200.)
template <DType DTYPE, PassMode MODE, int UNROLL>
__device__ __forceinline__ void walk_tiles(const PassArgs& args, const JobContext& job, const JobPlace& place,
                                           const typename DTypeTraits<DTYPE>::Scalar* row_logits,
                                           const TileVectors<DTYPE>& first, uint32_t param_flags,
                                           PassState* states) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const auto load = [&](TileVectors<DTYPE>& tile, int c) {
    load_job_tile<DTYPE>(tile, row_logits, c, args.logits.vocab, place.sample_position, place.aligned);
  };
  TileVectors<DTYPE> current = first, ahead;
  if (args.splits > 1)
    load(ahead, 1);
#pragma unroll 1
  for (int c = 0; c < args.splits; ++c) {
    TileVectors<DTYPE> next;
    if (c + 2 < args.splits)
      load(next, c + 2);
    const PassState state = subtile_state<DTYPE, MODE, UNROLL>(current, job, param_flags);
    if (threadIdx.x % kWarpSize == 0)
      states[c * kSubTiles + warp] = state;
    if (c + 1 < args.splits)
      current = ahead;
    if (c + 2 < args.splits)
      ahead = next;
  }
}

/// Staged walk mode's shared staging: kWalkStages tiles' vectors, each thread's own (vector u of stage s at
/// s * kTileVectorSlots + u * kPassThreads + thread), in dynamic shared memory.
inline constexpr int kWalkStages = 3;
inline constexpr int kTileVectorSlots = kUnrollVectors * kPassThreads;
inline constexpr size_t kWalkStagingBytes = size_t{kWalkStages} * kTileVectorSlots * sizeof(uint4);

/// Staged walk mode's first read: the CTA folds tiles first_tile .. first_tile + args.walk_tiles - 1 of its
/// job in order (its part of the row: the job's args.walkers CTAs split its tiles), each exactly as a tile's
/// own CTA would (the same threads, vectors and warp merge), and writes sub-tile s's state at states[s] (the
/// workspace, as ticket mode's CTAs do). The next two tiles are in flight while a tile is folded, copied
/// into `staging` (kWalkStages tiles) by cp.async, not held in registers: a thread holds one tile, so four
/// CTAs fit an SM (64 registers) and a launch of 64 jobs of 16 tiles runs eight CTAs a job. A thread copies
/// and reads back only its own vectors, so no barrier orders them: cp.async's wait makes a thread's copies
/// visible to it. Vectors that are partial (a row's end) or unaligned are loaded by load_vector and stored,
/// the same bits. `first` holds tile first_tile's loads, issued by the kernel.
template <DType DTYPE, PassMode MODE, int UNROLL>
__device__ __forceinline__ void
walk_tiles_staged(const PassArgs& args, const JobContext& job, const JobPlace& place,
                  const typename DTypeTraits<DTYPE>::Scalar* row_logits, const TileVectors<DTYPE>& first,
                  int first_tile, uint32_t param_flags, PassState* states, uint4* staging) {
  constexpr int kPerVector = DTypeTraits<DTYPE>::kPerVector;
  const int thread = static_cast<int>(threadIdx.x);
  const int warp = thread / kWarpSize;
  const int vocab = args.logits.vocab;
  const int end_tile = min(args.splits, first_tile + args.walk_tiles);
  // Tile c's copies into stage `stage`, then a commit (an empty group past the last tile, so that the
  // count of groups in flight stays fixed).
  const auto issue = [&](int c, int stage) {
    if (c < end_tile) {
      const int begin = c * kSplitLength<DTYPE>;
      const int end = min(vocab, begin + kSplitLength<DTYPE>);
      bool rest = false; // a partial or unaligned vector
#pragma unroll
      for (int u = 0; u < kUnrollVectors; ++u) {
        const int element = tile_vector_first<DTYPE>(begin, u);
        const int left = end - element; // unclamped, as load_vector reads it
        if (place.aligned && left >= kPerVector)
          __pipeline_memcpy_async(staging + stage * kTileVectorSlots + u * kPassThreads + thread,
                                  row_logits + element, sizeof(uint4));
        else
          rest = rest || left > 0;
      }
      if (rest) { // rare (a row's end, unaligned rows): a loop, so load_vector's element path is code once
#pragma unroll 1
        for (int u = 0; u < kUnrollVectors; ++u) {
          const int element = tile_vector_first<DTYPE>(begin, u);
          const int left = end - element;
          if (!(place.aligned && left >= kPerVector) && left > 0)
            staging[stage * kTileVectorSlots + u * kPassThreads + thread] =
                load_vector<DTYPE>(row_logits, element, left, place.aligned);
        }
      }
    }
    __pipeline_commit();
  };
  // Tile c from stage `stage` (its copies have landed).
  const auto read = [&](TileVectors<DTYPE>& tile, int c, int stage) {
    const int begin = c * kSplitLength<DTYPE>;
    const int end = min(vocab, begin + kSplitLength<DTYPE>);
#pragma unroll
    for (int u = 0; u < kUnrollVectors; ++u) {
      tile.first[u] = tile_vector_first<DTYPE>(begin, u);
      tile.count[u] = max(0, min(kPerVector, end - tile.first[u]));
      const uint32_t fill = negative_infinity_bits<DTYPE>(); // past the row's end, as load_tile gives it
      tile.raw[u] = tile.count[u] > 0 ? staging[stage * kTileVectorSlots + u * kPassThreads + thread]
                                      : make_uint4(fill, fill, fill, fill);
    }
  };
  // The first tile joins the others in stage 0 (one copy of the fold's code: the instance runs cold).
#pragma unroll
  for (int u = 0; u < kUnrollVectors; ++u)
    if (first.count[u] > 0)
      staging[u * kPassThreads + thread] = first.raw[u];
  issue(first_tile + 1, 1);
  issue(first_tile + 2, 2);
  int stage = 0; // tile c's: tiles first_tile, + 1, + 2, ... take stages 0, 1, 2, 0, ...
#pragma unroll 1
  for (int c = first_tile; c < end_tile; ++c) {
    __pipeline_wait_prior(kWalkStages - 1); // tile c's group; the two after it may still be in flight
    TileVectors<DTYPE> tile;
    read(tile, c, stage);
    const PassState state = subtile_state<DTYPE, MODE, UNROLL>(tile, job, param_flags);
    if (thread % kWarpSize == 0)
      states[c * kSubTiles + warp] = state;
    // The stage is free once its vectors are folded (their registers consumed): tile c + 3 goes there.
    issue(c + kWalkStages, stage);
    stage = stage == kWalkStages - 1 ? 0 : stage + 1;
  }
  __pipeline_wait_prior(0); // no copy outlives the walk (the CTA's shared memory)
}

/// One tile of one job, after the CTA issued its loads: fold it into sub-tile states; for a job of several
/// tiles, the job's last CTA (a ticket counter) then merges every sub-tile state in a fixed order, runs the
/// two-level race and writes the outputs. The register walk (WALK = kRegisters): the CTA is the job's only
/// one and folds all its tiles (walk_tiles) before the same merge and race; the staged walk (kStaged): the
/// CTA is one of the job's walkers and folds its run of tiles (walk_tiles_staged), the last to arrive merges.
template <DType DTYPE, PassMode MODE, int UNROLL, PassWalk WALK, bool EARLY>
__device__ void run_job(const PassArgs& args, const JobContext& job, const JobPlace& place,
                        const typename DTypeTraits<DTYPE>::Scalar* row_logits, const TileVectors<DTYPE>& tile,
                        uint32_t param_flags, uint4* tile_copy, uint4* walk_staging) {
  __shared__ PassState warp_states[kSubTiles]; // a one-tile or cluster job's sub-tile states
  constexpr bool kWalk = WALK != PassWalk::kNone, kStaged = WALK == PassWalk::kStaged;
  // block_row_standing's and block_merge_greedy's one-warp path (rows of at most 32 sub-tiles) in every
  // instance but the register walk's, whose code stays as it was (block_row_standing's comment says why).
  constexpr bool kOneWarpMerge = WALK != PassWalk::kRegisters;

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const bool warp_leader = threadIdx.x % kWarpSize == 0;
  constexpr bool kRaces = MODE == PassMode::kRace || MODE == PassMode::kRacePower;
  const bool cluster = !kWalk && args.cluster;      // uniform across the launch
  const bool early_race = EARLY && args.early_race; // uniform across the launch
  if (kRaces && cluster && !early_race) {
#pragma unroll
    for (int u = 0; u < kUnrollVectors; ++u) {
      const uint32_t fill = negative_infinity_bits<DTYPE>();
      tile_copy[u * kPassThreads + threadIdx.x] =
          tile.count[u] > 0 ? tile.raw[u] : make_uint4(fill, fill, fill, fill);
    }
  }
  // The element race's noise: drawn here, while the tile's loads are in flight, in launches of at most a
  // wave; after the merge, by the CTAs that race, otherwise (PassArgs::early_noise).
  RaceNoise<DTYPE> noise;
  // The early race's table of rank noise, where the other modes keep their tile copy or walk states: thread
  // t's runs written out (rank (t + 256 i) kRaceRun + e).
  float* const rank_log_noise = reinterpret_cast<float*>(tile_copy);
  static_assert(kSubTileLength<DTYPE> * sizeof(float) <= kUnrollVectors * kPassThreads * sizeof(uint4),
                "the noise table fits the tile copy");
  if constexpr (kRaces) {
    if (!kStaged && args.early_noise) // the staged walk's walkers draw late: fewer registers live on the walk
      noise = draw_race_noise<DTYPE, UNROLL>(job);
    if (early_race) {
#pragma unroll
      for (int i = 0; i < RaceNoise<DTYPE>::kRunsPerThread; ++i) {
        const int run = static_cast<int>(threadIdx.x) + i * kPassThreads;
        if (RaceNoise<DTYPE>::kRuns % kPassThreads == 0 || run < RaceNoise<DTYPE>::kRuns) {
#pragma unroll
          for (int e = 0; e < kRaceRun<DTYPE>; ++e)
            rank_log_noise[run * kRaceRun<DTYPE> + e] = noise.log_noise[i][e];
        }
      }
    }
  }

  const int subtile_count = args.splits * kSubTiles;
  const int64_t job_subtiles = static_cast<int64_t>(place.job_index) * subtile_count;
  PassState* subtiles = args.partials + job_subtiles;
  PassState state;
  SubTileWinner own_winner{-1, -INFINITY}; // early race: this warp's sub-tile's
  // The register walk keeps the job's sub-tile states where cluster mode keeps its tile copy
  // (kMaxWalkSubTiles fit); the staged walk's walkers write theirs to the workspace, as ticket mode does.
  PassState* walk_states = reinterpret_cast<PassState*>(tile_copy);
  if constexpr (kStaged) {
    walk_tiles_staged<DTYPE, MODE, UNROLL>(args, job, place, row_logits, tile, place.split * args.walk_tiles,
                                           param_flags, subtiles, walk_staging);
    // The job's last walker merges.
    if (!device::last_to_arrive(&args.tickets[place.job_index], static_cast<uint32_t>(args.walkers)))
      return;
  } else if constexpr (kWalk) {
    walk_tiles<DTYPE, MODE, UNROLL>(args, job, place, row_logits, tile, param_flags, walk_states);
    __syncthreads(); // every sub-tile state, for the merge below
  } else {
    state = subtile_state<DTYPE, MODE, UNROLL>(tile, job, param_flags);
    if constexpr (kRaces && EARLY) {
      if (early_race) {
        __syncthreads(); // the noise table
        own_winner = race_own_subtile<DTYPE, UNROLL>(
            state, tile, rank_log_noise, MODE == PassMode::kRacePower ? job.alpha * job.c : job.c);
      }
    }
  }
  __shared__ SubTileWinner warp_winners[kSubTiles]; // early race: a one-tile or cluster job's
  if constexpr (!kWalk) {
    if (args.splits > 1 && !cluster) {
      if (warp_leader) {
        subtiles[place.split * kSubTiles + warp] = state;
        if (EARLY && early_race)
          args.winners[job_subtiles + place.split * kSubTiles + warp] = own_winner;
      }
      // The job's last CTA merges (the partials are read with __ldcg below).
      if (!device::last_to_arrive(&args.tickets[place.job_index], static_cast<uint32_t>(args.splits)))
        return;
    } else {
      if (warp_leader) {
        warp_states[warp] = state;
        if (EARLY && early_race)
          warp_winners[warp] = own_winner;
      }
      if (cluster) { // every CTA of the job: its peers' states (and its own tile copy) are ready after this
        cluster_arrive();
        cluster_wait();
      } else {
        __syncthreads();
      }
    }
  }
  const SubTileStates states{kStaged || (!kWalk && args.splits > 1 && !cluster) ? subtiles : nullptr,
                             kWalk && !kStaged ? walk_states : warp_states, cluster};
  const SubTileWinners winners{!kWalk && args.splits > 1 && !cluster ? args.winners + job_subtiles : nullptr,
                               warp_winners, cluster};
  // The row's state from its sub-tiles', in a fixed order (each thread's sub-tiles in turn, then a block
  // reduction), the same whatever else the launch holds.
  const int thread = static_cast<int>(threadIdx.x);
  const PassState mine = thread < subtile_count ? states.load(thread) : empty_state();
  static_assert(kMaxClusterTiles * kSubTiles <= kPassThreads, "a cluster job's sub-tiles: one per thread");
  bool writer = !cluster || place.split == 0; // the CTA that writes the job's outputs
  RaceState winner{-INFINITY, -INFINITY, -1};
  if constexpr (kRaces) {
    // Sampling: the row's merge and the sub-tile race (offer_subtile) in one block reduction, then the
    // element race over the winning sub-tile (header comment). The noises depend only on the job's keys:
    // the Philox calls and logs run while the states load (from L2 or a peer), off the serial tail.
    const float mine_noise = thread < subtile_count ? subtile_noise<UNROLL>(job, thread) : 0.0f;
    if (kStaged || !args.early_noise)
      noise = draw_race_noise<DTYPE, UNROLL>(job);
    const float power_c = MODE == PassMode::kRacePower ? job.alpha * job.c : job.c;
    // The one-wave instance carries each sub-tile's own race winner beside its standing (early race).
    using Best = std::conditional_t<EARLY, RacedSubtileBest, SubtileBest>;
    const auto winner_of = [&](int s) {
      return EARLY && early_race ? winners.load(s) : SubTileWinner{-1, -INFINITY};
    };
    Best subtile{};
    subtile.key = -INFINITY;
    subtile.max = -INFINITY;
    subtile.index = -1;
    if (thread < subtile_count)
      offer_subtile<MODE>(subtile, mine, mine_noise, thread, power_c, winner_of(thread));
    state = mine;
    for (int s = thread + kPassThreads; s < subtile_count; s += kPassThreads) { // ascending
      const PassState sub = states.load(s);
      state = merge_states<MODE>(state, sub, job.c, job.alpha);
      offer_subtile<MODE>(subtile, sub, subtile_noise<UNROLL>(job, s), s, power_c, winner_of(s));
    }
    __shared__ RowStanding<Best> row_standing;
    // Only the threads that hold a sub-tile take part (an empty state merges exactly: a 128-sub-tile row's
    // serial step folds 4 warp aggregates, not 8).
    const int valid_threads = min(subtile_count, kPassThreads);
    const RowStanding<Best> standing =
        block_row_standing<MODE, UNROLL, kOneWarpMerge>(state, subtile, job.c, job.alpha, valid_threads);
    // Every loaded state is consumed (a cluster job's sub-tiles are one a thread, `mine`), so the peers'
    // shared memory is no longer needed: they may leave once every CTA has arrived here.
    if (cluster)
      cluster_arrive_relaxed();
    bool raced = false;
    if constexpr (EARLY) {
      if (early_race) {
        // The winning sub-tile's own race decided the token. Only thread 0 reads the standing (it writes the
        // outputs; the others only leave), so it keeps its own: no broadcast and no barrier. NVIDIA H200, A/B
        // in one call (the head's logits_pass.cuh in a second build), two rounds, sample_bench us a launch in
        // the chain: 1 / 8 / 64 x 128256 bf16 6.00-6.01 / 6.45-6.46 / 12.07-12.11 -> 5.87 / 6.33 /
        // 12.06-12.13; 1 x 151936 bf16 6.19-6.20 -> 6.07; 1 x 32000 bf16 4.91-4.96 -> 4.81; the toy SMC
        // cycle at 1 request (one round), K 4 / 8: 149.0 / 260.1 -> 147.7 / 259.3 us. Only the one-wave
        // instances' code changes.
        state = standing.state;
        subtile = standing.subtile;
        winner = RaceState{0.0f, subtile.winner.logit, subtile.winner.index};
        raced = true;
      }
    }
    if (!raced) { // raced is uniform across the launch (early_race)
      if (threadIdx.x == 0)
        row_standing = standing;
      __syncthreads();
      state = row_standing.state; // uniform across the CTA, so are the branches below
      subtile = row_standing.subtile;
    }
    if (!raced && !state.flags && state.max != -INFINITY) {
      // index >= 0: the row has a finite logit, so a sub-tile with Z_s > 0
      __shared__ RaceState race_totals[kPassThreads / kWarpSize];
      const int tile_begin = (subtile.index / kSubTiles) * kSplitLength<DTYPE>;
      if (cluster) { // the owner of the winning sub-tile races it from its shared copy; the others are done
        writer = subtile.index / kSubTiles == place.split;
        if (writer) {
          winner = race_subtile_shared<DTYPE>(tile_copy, args.logits.vocab, tile_begin,
                                              subtile.index % kSubTiles, noise, subtile.max, power_c);
          winner = block_race_winner(winner, race_totals);
        }
      } else {
        winner = race_subtile<DTYPE>(row_logits, args.logits.vocab, tile_begin, subtile.index % kSubTiles,
                                     place.aligned, noise, subtile.max, power_c);
        winner = block_race_winner(winner, race_totals);
      }
    }
  } else {
    state = mine;
    for (int s = thread + kPassThreads; s < subtile_count; s += kPassThreads)
      state = merge_states<MODE>(state, states.load(s), job.c, job.alpha);
    // The whole CTA (cub's partial-block path measured slower here: greedy draft samples of the toy's
    // speculative cycle, +3 us a cycle at 1 request).
    if constexpr (MODE == PassMode::kGreedy)
      state = block_merge_greedy<UNROLL, kOneWarpMerge>(state, subtile_count);
    else
      state = block_row_standing<MODE, UNROLL, kOneWarpMerge>(state, NoSubtileRace{}, job.c, job.alpha,
                                                              kOneWarpMerge ? min(subtile_count, kPassThreads)
                                                                            : kPassThreads)
                  .state;
    if (cluster)
      cluster_arrive_relaxed(); // every loaded state is consumed (above)
  }
  if (cluster)
    cluster_wait(); // the peers have read this CTA's states: its shared memory may go
  if (threadIdx.x != 0 || !writer)
    return;

  const int row = place.row;
  uint32_t flags = state.flags | param_flags;
  if (!flags && state.max == -INFINITY)
    flags |= kFlagAllMasked;
  if (place.sample_position) {
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
    const int32_t token = args.tokens[row * args.token_row_stride + place.position];
    if (token < 0 || token >= args.logits.vocab) {
      flags |= kFlagTokenOutOfRange;
    } else if (!flags) {
      if constexpr (MODE == PassMode::kGreedy) {
        // One-hot at the argmax with ties to the smallest id, the token a greedy draw emits: a draft token
        // that only ties the maximum at a larger id has p = 0, so greedy verification rejects it and emits
        // the argmax, exactly as greedy target-only decoding.
        logprob = token == state.max_index ? 0.0f : -INFINITY;
      } else {
        const float l = DTypeTraits<DTYPE>::to_float(row_logits[token]);
        logprob = kLn2 * ((l - state.max) * job.c - __log2f(state.sum));
      }
    }
    args.token_logprobs[row * (args.logits.positions - 1) + place.position] = logprob;
  }
  if (flags) {
    atomicOr(&args.row_flags[row], flags);
    atomicOr(args.status, flags);
  }
}

/// grid.x = jobs * splits (one CTA per tile); block = kPassThreads; in cluster mode a cluster of `splits`
/// CTAs a job. Launched with programmatic dependent launch (kernels/pdl.cuh): nothing is read before the
/// wait. Two instances a dtype, of the same code and so the same bits: MIN_BLOCKS = kPassMinBlocks CTAs an SM
/// (64 registers), and kPassMinBlocksLarge (40 registers, a few bytes of spills) for launches of many
/// waves, where more CTAs in flight hide more of each CTA's latency chain (launch_logits_pass picks).
#ifndef SMCGRAPH_PASS_MIN_BLOCKS
#define SMCGRAPH_PASS_MIN_BLOCKS 4
#endif
#ifndef SMCGRAPH_PASS_MIN_BLOCKS_LARGE
#define SMCGRAPH_PASS_MIN_BLOCKS_LARGE 6
#endif
#ifndef SMCGRAPH_PASS_MIN_BLOCKS_WALK
#define SMCGRAPH_PASS_MIN_BLOCKS_WALK 2
#endif
#ifndef SMCGRAPH_PASS_MIN_BLOCKS_STAGED
#define SMCGRAPH_PASS_MIN_BLOCKS_STAGED 4
#endif
inline constexpr int kPassMinBlocks = SMCGRAPH_PASS_MIN_BLOCKS;
inline constexpr int kPassMinBlocksLarge = SMCGRAPH_PASS_MIN_BLOCKS_LARGE;
/// The register walk's instance (a CTA a job, three tiles' loads in registers at once): its CTAs an SM.
inline constexpr int kPassMinBlocksWalk = SMCGRAPH_PASS_MIN_BLOCKS_WALK;
/// The staged walk's instance (walkers a job, one tile in registers, two in shared memory): its CTAs an SM.
inline constexpr int kPassMinBlocksStaged = SMCGRAPH_PASS_MIN_BLOCKS_STAGED;
/// The unrolling of the pass's fixed-count loops (the Philox rounds, the warp reductions, the block folds
/// over the warps) in an instance: loops (1) in the kPassMinBlocks one, whose launches of a wave or
/// less run cold in a cycle and wait on their code coming from HBM; unrolled in the kPassMinBlocksLarge one,
/// whose launches of many waves fetch their code once and are bound by instruction issue. The same bits
/// either way. NVIDIA H200, A/B in one call, two rounds, sample_bench us a launch (loops in both instances ->
/// unrolled in the large one): 256 x 128256 bf16 39.84-39.98 -> 38.63-38.68, fp32 61.42-61.59 -> 57.13; 128 x
/// 128256 bf16 25.41-25.58
/// -> 25.45-25.47; the toy SMC cycle at 64 requests 1,967.9-1,971.5 -> 1,965.3-1,966.2 us. The register
/// walk's instance (PassWalk::kRegisters) is unrolled too: its launches fill whole waves. The staged walk's
/// (PassWalk::kStaged) keeps the loops: its launches are one wave of short CTAs (two to four tiles each) that
/// run cold in a cycle. H200, sample_bench after a kernel that flushed L2 (coldL2), 64 x 128256 bf16: ticket
/// mode 18.1-18.2 us, the staged walk unrolled 19.8-20.7, with loops (and one copy of the fold, late
/// noise) 16.0.
template <int MIN_BLOCKS, PassWalk WALK = PassWalk::kNone> __host__ __device__ constexpr int pass_unroll() {
  if (WALK != PassWalk::kNone)
    return WALK == PassWalk::kStaged ? 1 : 16;
  return MIN_BLOCKS == kPassMinBlocksLarge && MIN_BLOCKS != kPassMinBlocks ? 16 : 1;
}
template <DType DTYPE, int MIN_BLOCKS, PassWalk WALK = PassWalk::kNone>
__global__ void __launch_bounds__(kPassThreads, MIN_BLOCKS) LogitsPassKernel(const PassArgs args) {
  using Scalar = typename DTypeTraits<DTYPE>::Scalar;
  constexpr int kUnroll = pass_unroll<MIN_BLOCKS, WALK>();
  constexpr bool kWalk = WALK != PassWalk::kNone, kStaged = WALK == PassWalk::kStaged;
  // Only the one-wave instance may race early (PassArgs::early_race): the others keep their code as it was.
  constexpr bool kEarly = !kWalk && MIN_BLOCKS == kPassMinBlocks;
  // Cluster mode, sample position: the CTA's tile, its vector q at q (the element race may run on it). Walk
  // mode: the job's sub-tile states.
  // (The staged walk uses none: its instance keeps one element, so that four CTAs fit an SM.)
  __shared__ uint4 tile_copy[kStaged ? 1 : kUnrollVectors * kPassThreads];
  static_assert(kStaged || kMaxWalkSubTiles * sizeof(PassState) <= sizeof(tile_copy),
                "walk mode's states fit");
  // The staged walk's staging (walk_tiles_staged): kWalkStagingBytes of dynamic shared memory; none in the
  // others.
  extern __shared__ uint4 walk_staging[];
  pdl_enter();
  JobPlace place;
  const int ctas_per_job = kStaged ? args.walkers : kWalk ? 1 : args.splits;
  place.split = static_cast<int>(blockIdx.x) % ctas_per_job; // walk mode: the walker
  place.job_index = static_cast<int>(blockIdx.x) / ctas_per_job;
  place.row = place.job_index / args.logits.positions;
  place.position = place.job_index % args.logits.positions;
  const int row = place.row, position = place.position;
  const int particles = args.random.particles_per_request;
  const int request = row / particles;
  // The row's sample position: P - 1, or its request's own s_q (score() with request_steps).
  int last = args.logits.positions - 1;
  if (args.request_steps != nullptr)
    last = min(max(args.request_steps[request], 0), last);
  // A token position at or past the row's sample position is not scored: its log-prob is -inf. Past it the
  // logits are not read at all.
  if (position >= last && position < args.logits.positions - 1 && place.split == 0 && threadIdx.x == 0)
    args.token_logprobs[row * (args.logits.positions - 1) + position] = -INFINITY;
  if (position > last)
    return;
  place.sample_position = position == last;

  // The logits loads go first: they depend on nothing the parameters below decide, so their memory latency
  // overlaps the parameters'. Score positions stream (evict-first); a sample position keeps L2's normal
  // policy, so the winning sub-tile is still in L2 when the race reads it again.
  const Scalar* row_logits = static_cast<const Scalar*>(args.logits.data) + row * args.logits.row_stride +
                             position * args.logits.position_stride;
  place.aligned = (reinterpret_cast<uintptr_t>(row_logits) % kVectorBytes) == 0;
  TileVectors<DTYPE> tile;
  load_job_tile<DTYPE>(tile, row_logits, kStaged ? place.split * args.walk_tiles : place.split,
                       args.logits.vocab, place.sample_position, place.aligned);

  const float temperature = args.params.temperature[row];
  const float alpha = args.params.alpha ? args.params.alpha[row] : 1.0f;
  // The keys are loaded here, with the parameters, on every path: left to the compiler, their loads sank
  // past the branch on the temperature below (the greedy path does not read them), so they issued only once
  // the temperature had arrived, a second round trip before the race noise (load_now).
  const uint64_t seed = load_now(args.random.seeds + request);
  const uint32_t draw_counter = load_now(args.random.draw_counters + request);
  uint32_t param_flags = 0;
  if (!(temperature >= 0.0f) || isinf(temperature))
    param_flags |= kFlagBadParameter;
  if (place.sample_position && (!(alpha > 0.0f) || isinf(alpha)))
    param_flags |= kFlagBadParameter;

  JobContext job;
  job.c = temperature > 0.0f ? kLog2e / temperature : 0.0f;
  job.alpha = alpha;
  job.seed = seed;
  job.draw_counter = draw_counter;
  job.particle = static_cast<uint32_t>(row % particles);
  job.stream_word = args.stream_word;

  // The mode is uniform across the CTA (one job per CTA), so this branch does not diverge.
  if (param_flags || temperature == 0.0f) {
    run_job<DTYPE, PassMode::kGreedy, kUnroll, WALK, kEarly>(args, job, place, row_logits, tile, param_flags,
                                                             tile_copy, walk_staging);
  } else if (!place.sample_position) {
    run_job<DTYPE, PassMode::kScore, kUnroll, WALK, kEarly>(args, job, place, row_logits, tile, 0u, tile_copy,
                                                            walk_staging);
  } else if (alpha == 1.0f) {
    run_job<DTYPE, PassMode::kRace, kUnroll, WALK, kEarly>(args, job, place, row_logits, tile, 0u, tile_copy,
                                                           walk_staging);
  } else {
    run_job<DTYPE, PassMode::kRacePower, kUnroll, WALK, kEarly>(args, job, place, row_logits, tile, 0u,
                                                                tile_copy, walk_staging);
  }
}

/// Validates and launches the pass (shared by sample() and score()): `args` carries the caller's logits,
/// row parameters, keys, token inputs and output pointers; the launcher adds the tiling and the workspace.
void launch_logits_pass(const char* where, PassArgs args, SampleWorkspace& workspace, cudaStream_t stream);

} // namespace smcgraph::detail
