// Tensor-core attention for forwards of many tokens a row (prefill): the same contract as attention() (token
// j of row r attends to positions 0 .. min(p_j, seq_len - 1, max_seq_len - 1) of its row, K and V read
// through slot_table[r]; padding rows untouched; a token that sees no position gets zeros), computed
// FlashAttention-2 style on m16n8k16 bf16 MMAs with fp32 accumulation instead of the CUDA-core chunk loop.
//
// A block takes 64 of a row's tokens for one query head (two groups of 4 warps, 16 tokens a warp; group g
// takes the key tiles g, g + 2, ..., and the groups' states are merged at the end) and walks the row's
// positions in tiles of 64 (K and V rows gathered by slot into shared memory with cp.async, the next tile's
// copies in flight while the current one is computed): S = Q K^T on tensor cores, an online softmax in the
// log2 domain over each token's row of S (masked past the token's length), then O += P V with P rounded to
// bf16 (the MMA's input type), and O / l stored as bf16 at the end.
//
// A token's output depends on its own query, the keys and values and its own length only: the tiles of keys
// are fixed by position, a tile past a token's length changes none of its state (its scores are -inf: the
// correction is exp2(0) = 1 and its probabilities 0), and the MMAs sum in a fixed order. So it is the same in
// any batch, block or chunk of tokens that uses this kernel (greedy speculative decoding still reproduces
// greedy decoding when both prefill the prompt this way). It is not the CUDA-core kernel's bits: P is rounded
// to bf16 before P V, and the dot products and sums run in another order; the tests hold it to the float64
// reference forward's tolerance (LlamaModelOptions::tensor_core_attention_tokens = 0 keeps every forward on
// the CUDA-core kernel, whose bits do not depend on how a prompt is chunked).
#include <cmath>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include "kernels/launch_checks.hpp"
#include "kernels/smem_limit.hpp"
#include "models/llama/attention_rows.cuh"
#include "models/llama/bf16_rows.cuh"
#include "models/llama/llama_kernels.hpp"
#include "models/llama/mma.cuh"
#include "models/llama/pdl.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"

namespace smcgraph::llama {
namespace {

namespace cg = cooperative_groups;

/// Warp groups of a block: they take the same 64 tokens, group g the key tiles g, g + 2, ..., and their
/// softmax states are merged at the end (group 0's, then group 1's), so a block's longest chain of tiles is
/// half the row's. H200, SmolLM2, the attention kernels of a one-row prefill under ncu, us a layer at 344 /
/// 803 / 3,215 tokens: one group of 4 warps 19.34 / 39.74 / 147.87, two groups 13.31 / 24.02 / 112.98
/// (admission 4.19-4.26 -> 3.95-4.05 ms at 803 tokens, 11.77-11.78 -> 10.89-10.91 at 3,215).
constexpr int kTcGroups = 2;
constexpr int kTcGroupWarps = 4;
constexpr int kTcGroupThreads = 32 * kTcGroupWarps;
constexpr int kTcThreads = kTcGroups * kTcGroupThreads;
constexpr int kTcQueries =
    16 * kTcGroupWarps;     ///< a row's tokens a block takes (16 a warp: one MMA row fragment)
constexpr int kTcKeys = 64; ///< positions a tile
constexpr float kLog2e = 1.4426950408889634f;

/// Shared-memory row stride in bf16 elements: 16 bytes of padding keep ldmatrix's 8 row addresses on
/// distinct bank groups.
template <int HD> constexpr int tc_row_stride() {
  return HD + 8;
}
/// The Q tile plus, for each group, two buffers of K and V tiles (after the loop, group 1's softmax states:
/// kTcQueries x (HD + 2) floats, which fit in the tile buffers).
template <int HD> constexpr size_t tc_smem_bytes() {
  return static_cast<size_t>(kTcQueries + kTcGroups * 4 * kTcKeys) * tc_row_stride<HD>() * sizeof(uint16_t);
}

/// Positions token j of row r attends to (attention()'s rule), 0 past the row's tokens.
__device__ __forceinline__ int token_length(const AttentionArgs& a, int r, int j) {
  return j < a.tokens_per_row ? max(0, query_length(a, r, r * a.tokens_per_row + j)) : 0;
}

/// Barrier of one warp group (named barriers 1 and 2; __syncthreads() is barrier 0).
__device__ __forceinline__ void group_barrier(int group) {
  // Immediate barrier ids: a register id makes ptxas reserve all 16 of the block's barriers.
  if (group == 0)
    asm volatile("bar.sync 1, %0;\n" ::"n"(kTcGroupThreads) : "memory");
  else
    asm volatile("bar.sync 2, %0;\n" ::"n"(kTcGroupThreads) : "memory");
}

/// Heads of 64 fit two blocks an SM (128 registers, no spill); heads of 128 one.
template <int HD>
__global__ void __launch_bounds__(kTcThreads, HD <= 64 ? 2 : 1)
    LlamaTensorCoreAttentionKernel(const AttentionArgs a) {
  static_assert(HD % 16 == 0, "whole MMA K steps of the head");
  constexpr int LD = tc_row_stride<HD>(), VECTORS = HD / 8; // 16-byte vectors a row
  constexpr int K_STEPS = HD / 16, KEY_FRAGS = kTcKeys / 8, DIM_FRAGS = HD / 8;
  constexpr int STATE = HD + 2; // floats of a token's merged state: m, l, then O by dimension
  static_assert(static_cast<size_t>(kTcQueries) * STATE * sizeof(float) <=
                    static_cast<size_t>(kTcGroups) * 4 * kTcKeys * LD * sizeof(uint16_t),
                "group 1's states fit in the tile buffers");
  extern __shared__ __align__(16) unsigned char tc_smem[];
  __nv_bfloat16* const q_tile = reinterpret_cast<__nv_bfloat16*>(tc_smem);
  __shared__ int block_length;

  if (a.trigger_early) // AttentionArgs::trigger_early
    pdl_trigger();
  // The heaviest blocks (the row's last tokens: the most positions) go first.
  const int r = blockIdx.x, j0 = (gridDim.y - 1 - blockIdx.y) * kTcQueries, head = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / kTcGroupWarps, group_warp = warp % kTcGroupWarps;
  const int group_thread = threadIdx.x % kTcGroupThreads;
  // This group's K and V buffers: [2][kTcKeys][LD] each.
  __nv_bfloat16* const k_tiles = q_tile + (kTcQueries + group * 4 * kTcKeys) * LD;
  __nv_bfloat16* const v_tiles = k_tiles + 2 * kTcKeys * LD;
  const int kv_head = head / (a.heads / a.kv_heads);
  const int q_dim = a.heads * HD, kv_dim = a.kv_heads * HD;
  const bool live = a.live[r];
  // Positions, lengths and the slot table are the forward's inputs (complete before its first kernel passed
  // its PDL wait): read before waiting. Q and this forward's K and V come from the QKV projection, after it.
  // This thread's accumulator rows (tokens j0 + row0 and j0 + row0 + 8; both groups hold the same rows),
  // their lengths, the warp's longest and the block's (group 0's warps cover all of its tokens).
  const int row0 = group_warp * 16 + accumulator_row(lane);
  const int length0 = token_length(a, r, j0 + row0), length1 = token_length(a, r, j0 + row0 + 8);
  const int warp_length =
      cg::reduce(cg::tiled_partition<32>(cg::this_thread_block()), max(length0, length1), cg::greater<int>());
  if (threadIdx.x == 0)
    block_length = 0;
  __syncthreads();
  if (group == 0 && lane == 0)
    atomicMax(&block_length, warp_length);
  __syncthreads();
  const int length = block_length;
  const int32_t* slots = a.slot_table + static_cast<size_t>(r) * a.max_seq_len;
  pdl_wait_then_trigger(a.trigger_early);
  if (!live)
    return;

  // Q rows (zeros past the row's tokens), by every thread: one group of copies.
  for (int v = threadIdx.x; v < kTcQueries * VECTORS; v += kTcThreads) {
    const int m = v / VECTORS, column = (v % VECTORS) * 8, j = j0 + m;
    __nv_bfloat16* dst = q_tile + m * LD + column;
    if (j < a.tokens_per_row)
      __pipeline_memcpy_async(
          dst, a.q + (static_cast<size_t>(r) * a.tokens_per_row + j) * q_dim + head * HD + column, 16);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
  }
  __pipeline_commit();
  // Tile `tile`'s K and V rows into this group's buffer `buffer`, by the group's threads: positions past the
  // block's longest token are zeros (their scores are masked; zeros keep 0 x V finite).
  const auto load_tile = [&](int tile, int buffer) {
    __nv_bfloat16* k_dst = k_tiles + buffer * kTcKeys * LD;
    __nv_bfloat16* v_dst = v_tiles + buffer * kTcKeys * LD;
    for (int v = group_thread; v < kTcKeys * VECTORS; v += kTcGroupThreads) {
      const int key = v / VECTORS, column = (v % VECTORS) * 8, position = tile * kTcKeys + key;
      if (position < length) {
        const int slot = clamp_slot(slots[position], a.pool_size);
        const uint16_t* k_row = a.kv + static_cast<size_t>(slot) * 2 * kv_dim + kv_head * HD + column;
        __pipeline_memcpy_async(k_dst + key * LD + column, k_row, 16);
        __pipeline_memcpy_async(v_dst + key * LD + column, k_row + kv_dim, 16);
      } else {
        *reinterpret_cast<uint4*>(k_dst + key * LD + column) = make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(v_dst + key * LD + column) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  const int tiles = (length + kTcKeys - 1) / kTcKeys;
  if (group < tiles)
    load_tile(group, 0);
  __pipeline_commit();
  __pipeline_wait_prior(1); // this thread's Q copies
  __syncthreads();          // everyone's

  const float scale_log2 = a.scale * kLog2e;
  uint32_t q_frag[K_STEPS][4];
#pragma unroll
  for (int ks = 0; ks < K_STEPS; ++ks)
    ldmatrix_x4(q_frag[ks],
                q_tile + (group_warp * 16 + a_fragment_row(lane)) * LD + ks * 16 + a_fragment_column(lane));
  float out[DIM_FRAGS][4];
#pragma unroll
  for (int f = 0; f < DIM_FRAGS; ++f)
    out[f][0] = out[f][1] = out[f][2] = out[f][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f; // running max (log2 units) and partial sums

  for (int tile = group, iteration = 0; tile < tiles; tile += kTcGroups, ++iteration) {
    const int buffer = iteration & 1;
    if (tile + kTcGroups < tiles) // the group's next tile's copies go out before this tile is computed
      load_tile(tile + kTcGroups, buffer ^ 1);
    __pipeline_commit();
    __pipeline_wait_prior(1);
    group_barrier(group);
    const int first_key = tile * kTcKeys;
    if (first_key < warp_length) { // a tile wholly past this warp's tokens changes nothing: skipped
      const __nv_bfloat16* k_tile = k_tiles + buffer * kTcKeys * LD;
      const __nv_bfloat16* v_tile = v_tiles + buffer * kTcKeys * LD;
      // S = Q K^T for the warp's 16 tokens and the tile's 64 positions (8 fragments of 8 positions).
      float s[KEY_FRAGS][4];
#pragma unroll
      for (int f = 0; f < KEY_FRAGS; ++f)
        s[f][0] = s[f][1] = s[f][2] = s[f][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < K_STEPS; ++ks) {
#pragma unroll
        for (int pair = 0; pair < KEY_FRAGS / 2; ++pair) {
          uint32_t b[4];
          ldmatrix_x4(b, k_tile + (pair * 16 + b_pair_row(lane)) * LD + ks * 16 + b_column(lane));
          mma_16816(s[2 * pair], q_frag[ks], b[0], b[1]);
          mma_16816(s[2 * pair + 1], q_frag[ks], b[2], b[3]);
        }
      }
      // Online softmax (log2 domain): mask, the tile's row max over the quad's lanes, rescale, exponentiate.
      float tile_max0 = -INFINITY, tile_max1 = -INFINITY;
#pragma unroll
      for (int f = 0; f < KEY_FRAGS; ++f) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = first_key + f * 8 + accumulator_column(lane) + (e & 1);
          const bool valid = key < (e < 2 ? length0 : length1);
          s[f][e] = valid ? s[f][e] * scale_log2 : -INFINITY;
        }
        tile_max0 = fmaxf(tile_max0, fmaxf(s[f][0], s[f][1]));
        tile_max1 = fmaxf(tile_max1, fmaxf(s[f][2], s[f][3]));
      }
#pragma unroll
      for (int offset = 1; offset <= 2; offset *= 2) {
        tile_max0 = fmaxf(tile_max0, __shfl_xor_sync(0xffffffffu, tile_max0, offset));
        tile_max1 = fmaxf(tile_max1, __shfl_xor_sync(0xffffffffu, tile_max1, offset));
      }
      const float new_max0 = fmaxf(m0, tile_max0), new_max1 = fmaxf(m1, tile_max1);
      // A row with no position yet keeps -inf: subtract 0 instead, so its masked scores give 0, not NaN.
      const float base0 = new_max0 == -INFINITY ? 0.0f : new_max0;
      const float base1 = new_max1 == -INFINITY ? 0.0f : new_max1;
      const float correction0 = exp2f(m0 - base0), correction1 = exp2f(m1 - base1);
      m0 = new_max0;
      m1 = new_max1;
      l0 *= correction0;
      l1 *= correction1;
#pragma unroll
      for (int f = 0; f < DIM_FRAGS; ++f) {
        out[f][0] *= correction0;
        out[f][1] *= correction0;
        out[f][2] *= correction1;
        out[f][3] *= correction1;
      }
#pragma unroll
      for (int f = 0; f < KEY_FRAGS; ++f) {
        s[f][0] = exp2f(s[f][0] - base0);
        s[f][1] = exp2f(s[f][1] - base0);
        s[f][2] = exp2f(s[f][2] - base1);
        s[f][3] = exp2f(s[f][3] - base1);
        l0 += s[f][0] + s[f][1];
        l1 += s[f][2] + s[f][3];
      }
      // O += P V: P's accumulator fragments are the A fragments of the next MMA (16 positions a K step).
#pragma unroll
      for (int ks = 0; ks < kTcKeys / 16; ++ks) {
        const uint32_t p[4] = {
            bf16x2_bits(s[2 * ks][0], s[2 * ks][1]), bf16x2_bits(s[2 * ks][2], s[2 * ks][3]),
            bf16x2_bits(s[2 * ks + 1][0], s[2 * ks + 1][1]), bf16x2_bits(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
        for (int pair = 0; pair < DIM_FRAGS / 2; ++pair) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_tile + (ks * 16 + a_fragment_row(lane)) * LD + pair * 16 +
                                   a_fragment_column(lane));
          mma_16816(out[2 * pair], p, b[0], b[1]);
          mma_16816(out[2 * pair + 1], p, b[2], b[3]);
        }
      }
    }
    group_barrier(group); // the group's next copies overwrite this tile's buffer
  }
  __pipeline_wait_prior(0); // no copy outlives the loop (a group with no tile waited for none)

  // The quad's partial sums added; then group 1 hands its (m, l, O) to group 0 through shared memory (over
  // the tile buffers, which no one reads any more), which merges them in group order, divides and stores.
#pragma unroll
  for (int offset = 1; offset <= 2; offset *= 2) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, offset);
    l1 += __shfl_xor_sync(0xffffffffu, l1, offset);
  }
  float* const states = reinterpret_cast<float*>(q_tile + kTcQueries * LD); // [kTcQueries][STATE]
  __syncthreads();
  if (group == 1) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float* state = states + (row0 + 8 * half) * STATE;
      if (accumulator_column(lane) == 0) {
        state[0] = half == 0 ? m0 : m1;
        state[1] = half == 0 ? l0 : l1;
      }
#pragma unroll
      for (int f = 0; f < DIM_FRAGS; ++f) {
        state[2 + f * 8 + accumulator_column(lane)] = out[f][2 * half];
        state[2 + f * 8 + accumulator_column(lane) + 1] = out[f][2 * half + 1];
      }
    }
  }
  __syncthreads();
  if (group == 1)
    return;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int j = j0 + row0 + 8 * half;
    if (j >= a.tokens_per_row)
      continue;
    const float* state = states + (row0 + 8 * half) * STATE;
    const float m_own = half == 0 ? m0 : m1, l_own = half == 0 ? l0 : l1;
    const float m_other = state[0], l_other = state[1];
    const float m = fmaxf(m_own, m_other);
    const float base = m == -INFINITY ? 0.0f : m;
    const float weight_own = exp2f(m_own - base), weight_other = exp2f(m_other - base);
    const float l = l_own * weight_own + l_other * weight_other;
    const float inverse = l > 0.0f ? 1.0f / l : 0.0f;
    uint32_t* dst =
        reinterpret_cast<uint32_t*>(a.out + (static_cast<size_t>(r) * a.tokens_per_row + j) * q_dim +
                                    head * HD + accumulator_column(lane));
#pragma unroll
    for (int f = 0; f < DIM_FRAGS; ++f) {
      const float* other = state + 2 + f * 8 + accumulator_column(lane);
      const float low = out[f][2 * half] * weight_own + other[0] * weight_other;
      const float high = out[f][2 * half + 1] * weight_own + other[1] * weight_other;
      dst[f * 4] = bf16x2_bits(low * inverse, high * inverse);
    }
  }
}

} // namespace

bool tensor_core_attention_serves(const AttentionArgs& a) {
  return a.tensor_core_min_tokens > 0 && a.tokens_per_row >= a.tensor_core_min_tokens &&
         (a.head_dim == 64 || a.head_dim == 128);
}

void prepare_tensor_core_attention(int head_dim) {
  if (head_dim == 64)
    detail::prepare_forward_kernel(LlamaTensorCoreAttentionKernel<64>, tc_smem_bytes<64>());
  else if (head_dim == 128)
    detail::prepare_forward_kernel(LlamaTensorCoreAttentionKernel<128>, tc_smem_bytes<128>());
}

void tensor_core_attention(const AttentionArgs& a, cudaStream_t stream) {
  require(tensor_core_attention_serves(a), "llama::tensor_core_attention", "tokens_per_row", a.tokens_per_row,
          "is below tensor_core_min_tokens, or head_dim is not 64 or 128");
  const unsigned query_tiles = static_cast<unsigned>(detail::ceil_div(a.tokens_per_row, kTcQueries));
  require(query_tiles <= 65535u, "llama::tensor_core_attention", "tokens_per_row", a.tokens_per_row,
          "gives more than 65535 tiles of 64 tokens");
  const dim3 grid(static_cast<unsigned>(a.rows), query_tiles, static_cast<unsigned>(a.heads));
  if (a.head_dim == 64)
    launch_pdl(LlamaTensorCoreAttentionKernel<64>, grid, dim3(kTcThreads), tc_smem_bytes<64>(), stream, a);
  else
    launch_pdl(LlamaTensorCoreAttentionKernel<128>, grid, dim3(kTcThreads), tc_smem_bytes<128>(), stream, a);
}

} // namespace smcgraph::llama
