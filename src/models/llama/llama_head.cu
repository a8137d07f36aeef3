// The LM head through cuBLASLt: RMSNorm of each output row into bf16 (one warp a row), then logits = A W^T by
// one cuBLASLt matmul with an algorithm chosen once at construction and pinned (no split-K, no reduction
// scheme), so a row's logits are the same bits whatever the token count: greedy speculative decoding (a
// K + 1-token verify) reproduces greedy decoding (1-token forwards). Own-kernel LM head (llama_gemm.cu,
// kLogits) against cuBLASLt, weights cold (bench/llama_gemm_bench, H100): 55 / 24 us at 8 tokens, 114 / 29 at
// 64, 877 / 68 at 512, 4,206 / 307 at 2,560.
// Forwards of up to kSmallHeadMaxTokens tokens take the small head instead (below): one kernel, the same
// bits, its weights streaming from before the PDL wait. `llama_gemm_bench` (H100, 49152 x 576, cold, us,
// small / norm + cuBLASLt): 22.2 / 25.6 at 1 token, 23.5 / 26.4 at 8, 26.5 / 27.1 at 16; in the forward it
// also saves the norm kernel's node (no draft, 1 request: 458-463 -> 453-456 us a cycle). A variant of 32
// tokens (4 token fragments a warp) took 32.3 against 28.4 at 32 tokens, so forwards of 17+ stay on cuBLASLt.
// Where the file stores the head as Q8_0 (SmolLM2's token_embd), the int8 head serves those forwards instead:
// the small head's tiles and MMA chain over the file's int8 values and scales, dequantised in registers to
// the loader's bf16 values (the same bits), 1.125 bytes a weight instead of 2. `llama_gemm_bench` (H100,
// cold, us, int8 / bf16 small / norm + cuBLASLt): 16.1 / 22.3 / 25.0 at 1 token, 17.1 / 23.6 / 25.9 at
// 8, 19.7 / 26.4 / 26.6 at 16; at 24-64 tokens (a variant of up to 8 token fragments) it lost to cuBLASLt
// (28.1 / 27.7 at 24, 44.5 / 31.1 at 64), so it stops at 16 too.
#include <cublasLt.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include "kernels/launch_checks.hpp"
#include "kernels/smem_limit.hpp"
#include "models/forward_layout.cuh"
#include "models/llama/bf16_rows.cuh"
#include "models/llama/llama_kernels.hpp"
#include "models/llama/lt_matmul.hpp"
#include "models/llama/mma.cuh"
#include "models/llama/pdl.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/runtime.hpp"

namespace smcgraph::llama {
namespace {

namespace cg = cooperative_groups;

constexpr int kNormThreads = 128; // 4 warps, a row each
constexpr int kMaxVectorsPerLane = kLlamaMaxHidden / 4 / 32;
constexpr size_t kWorkspaceBytes = size_t{4} << 20;

constexpr const char* kLtHead = "llama::LtHead";

/// The norm weights a lane of a warp applies in norm_row_bf16 (float4 q at lane + 32 q).
__device__ __forceinline__ void load_norm_weights(int lane, int k, const float* gamma,
                                                  float4 (&g)[kMaxVectorsPerLane]) {
  const float4* g4 = reinterpret_cast<const float4*>(gamma);
#pragma unroll
  for (int q = 0; q < kMaxVectorsPerLane; ++q)
    g[q] = lane + 32 * q < k / 4 ? g4[lane + 32 * q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

/// One warp: the RMSNorm of the k floats at x_row into k bf16 at dst, bf16(x * rsqrt(mean(x^2) + eps) *
/// gamma): each lane sums the squares of its float4s (q = lane + 32 i, in order i), then a warp reduction.
/// Both LM head paths normalise through it, so their A rows are the same bits.
__device__ __forceinline__ void norm_row_bf16(int lane, int k, const float* x_row,
                                              const float4 (&g)[kMaxVectorsPerLane], float eps, uint2* dst) {
  const int k4 = k / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x_row);
  float4 v[kMaxVectorsPerLane];
  float sum_squares = 0.0f;
#pragma unroll
  for (int q = 0; q < kMaxVectorsPerLane; ++q) {
    v[q] = lane + 32 * q < k4 ? x4[lane + 32 * q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    sum_squares += sum_of_squares(v[q]);
  }
  sum_squares = cg::reduce(cg::tiled_partition<32>(cg::this_thread_block()), sum_squares, cg::plus<float>());
  const float inv_rms = rsqrtf(sum_squares / static_cast<float>(k) + eps);
#pragma unroll
  for (int q = 0; q < kMaxVectorsPerLane; ++q)
    if (lane + 32 * q < k4)
      dst[lane + 32 * q] = rms_scaled_bf16x4(v[q], inv_rms, g[q]);
}

/// Output row i of `normed` is slot i % S of row first_row + i / S: token (first_row + i / S) * P + i % S
/// when i % S < P, its x row at x + token * x_row_stride, normalised as bf16(x * rsqrt(mean(x^2) + eps) *
/// gamma); zeros for the slots past P (their logits land in entries nothing reads). Row by row:
/// batch-invariant.
__global__ void __launch_bounds__(kNormThreads)
    LlamaHeadNormKernel(int out_rows, int slots_per_row, int tokens_per_row, int first_row, int k,
                        const float* x, int64_t x_row_stride, const float* gamma, float eps, uint16_t* out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The norm weights before waiting (PDL): the x row is the only load left after it.
  float4 g[kMaxVectorsPerLane];
  load_norm_weights(lane, k, gamma, g);
  pdl_wait();
  pdl_trigger();
  const int i = blockIdx.x * (kNormThreads / 32) + warp;
  if (i >= out_rows)
    return;
  uint2* dst = reinterpret_cast<uint2*>(out + static_cast<int64_t>(i) * k);
  const int slot = i % slots_per_row;
  if (slot >= tokens_per_row) {
    for (int q = lane; q < k / 4; q += 32)
      dst[q] = make_uint2(0u, 0u);
    return;
  }
  const int64_t token = static_cast<int64_t>(first_row + i / slots_per_row) * tokens_per_row + slot;
  norm_row_bf16(lane, k, x + token * x_row_stride, g, eps, dst);
}

/// The small-token LM head (LtHead serves forwards of up to kSmallHeadMaxTokens tokens with it): one kernel
/// in place of the norm kernel and cuBLASLt's matmul, with the same bits, that streams the head's weights at
/// close to the copy bandwidth. One block an SM loops over tiles of kSmallHeadRows vocabulary rows (tile
/// blockIdx.x, + gridDim.x, ...); their weights stream through a ring of kSmallHeadStages shared-memory
/// stages of kSmallHeadChunk columns (cp.async), the first kSmallHeadStages - 1 issued before the PDL wait,
/// so they load while the forward's last kernel still runs. After the wait the block normalises the T token
/// rows once (norm_row_bf16, as the norm kernel does) into shared memory; each warp then multiplies its 16
/// rows of a tile by up to 8 N_FRAGS tokens with m16n8k16 MMAs, one accumulator an output chained over K in
/// order: the order in which the pinned cuBLASLt matmul sums (measured bit-identical on H100s; LtHead checks
/// it at construction and leaves the small head off where it differs). Logits of token t land at (t / P) io V
/// + (t % P) V, padding tokens' too, as cuBLASLt writes them.
struct SmallHeadArgs {
  int tokens = 0, tokens_per_row = 1, k = 0, vocab = 0;
  int64_t io_row_stride = 1, x_row_stride = 0;
  const float* x = nullptr;
  const float* gamma = nullptr;
  float eps = 0.0f;
  const uint16_t* weight = nullptr; ///< [round_up(vocab, 64), k]: whole 64-row blocks readable
  void* logits = nullptr;
  DType dtype = DType::kFloat32;
  bool stream_weights = false; ///< GemmArgs::stream_weights (read by the launcher)
  /// The int8 head's weights (LlamaWeights::head_q8 / head_q8_scales: fragment order, round_up(vocab, 64)
  /// rows); null for the bf16 small head.
  const int8_t* q8 = nullptr;
  const float* q8_scales = nullptr;
};

/// Rows of the head's weights as the small heads read them: the vocabulary rounded up to whole 64-row blocks
/// (LlamaWeights pads the bf16 head and the int8 head's layout to them).
__host__ __device__ constexpr int padded_head_rows(int vocab) {
  return (vocab + 63) / 64 * 64;
}

constexpr int kSmallHeadWarps = 8;
constexpr int kSmallHeadThreads = 32 * kSmallHeadWarps;
constexpr int kSmallHeadRows = 16 * kSmallHeadWarps; // vocabulary rows a tile
constexpr int kSmallHeadChunk = 64;                  // columns (K) a stage
constexpr int kSmallHeadStages = 8;
constexpr int kSmallHeadLd = kSmallHeadChunk + 8; // bf16 a staged row: 144 bytes, 8 rows hit 8 bank groups
constexpr int kSmallHeadPad = 8;                  // bf16 past each normalised token row (same reason)

size_t small_head_smem_bytes(int k, int n_frags) {
  return (static_cast<size_t>(kSmallHeadStages) * kSmallHeadRows * kSmallHeadLd +
          static_cast<size_t>(8 * n_frags) * (k + kSmallHeadPad)) *
         sizeof(uint16_t);
}

/// The small heads' prologue from their weight copies on: the norm weights (before the PDL wait), then the T
/// token rows normalised (norm_row_bf16, as the norm kernel does) into sa ([8 N_FRAGS rows][lda] bf16), zeros
/// past T, a warp a row (the main loop's first barrier publishes them).
template <int N_FRAGS>
__device__ __forceinline__ void small_head_rows(const SmallHeadArgs& a, __nv_bfloat16* sa, int lda, int warp,
                                                int lane) {
  float4 g[kMaxVectorsPerLane];
  load_norm_weights(lane, a.k, a.gamma, g);
  pdl_wait();
  pdl_trigger();
  for (int t = warp; t < 8 * N_FRAGS; t += kSmallHeadWarps) {
    uint2* dst = reinterpret_cast<uint2*>(sa + t * lda);
    if (t < a.tokens)
      norm_row_bf16(lane, a.k, a.x + t * a.x_row_stride, g, a.eps, dst);
    else
      for (int q = lane; q < a.k / 4; q += 32)
        dst[q] = make_uint2(0u, 0u);
  }
}

/// One 16-wide K step of a warp's 16 weight rows (the A fragment wf) into every token fragment's accumulator:
/// the token rows' B fragments from the normalised rows at a_step (this K step's column of lane's row).
template <int N_FRAGS>
__device__ __forceinline__ void small_head_mma(float (&d)[N_FRAGS][4], const uint32_t (&wf)[4],
                                               const __nv_bfloat16* a_step, int lda) {
#pragma unroll
  for (int f = 0; f < N_FRAGS; ++f) {
    uint32_t b[2];
    ldmatrix_x2(b, a_step + f * 8 * lda);
    mma_16816(d[f], wf, b[0], b[1]);
  }
}

/// A warp's finished rows of the block's tile number `tile_of_block` (tile blockIdx.x + tile_of_block x
/// gridDim.x): the logits of vocabulary rows lane / 4 (+ 8) of its 16 for every token of its fragments
/// (m16n8k16 accumulator layout), stored where cuBLASLt writes them; the accumulators restart at 0.
template <int N_FRAGS>
__device__ __forceinline__ void small_head_store(const SmallHeadArgs& a, int tile_of_block, int warp,
                                                 float (&d)[N_FRAGS][4], int lane) {
  const int row =
      (blockIdx.x + tile_of_block * gridDim.x) * kSmallHeadRows + warp * 16 + accumulator_row(lane);
#pragma unroll
  for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int v = row + (i >= 2 ? 8 : 0), t = 8 * f + accumulator_column(lane) + (i & 1);
      if (t < a.tokens && v < a.vocab) {
        const int64_t index =
            (static_cast<int64_t>(t / a.tokens_per_row) * a.io_row_stride + t % a.tokens_per_row) * a.vocab +
            v;
        if (a.dtype == DType::kFloat32)
          static_cast<float*>(a.logits)[index] = d[f][i];
        else
          static_cast<uint16_t*>(a.logits)[index] = float_to_bf16_bits(d[f][i]);
      }
      d[f][i] = 0.0f;
    }
}

template <int N_FRAGS>
__global__ void __launch_bounds__(kSmallHeadThreads, 1) LlamaSmallHeadKernel(const SmallHeadArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __nv_bfloat16* stages = reinterpret_cast<__nv_bfloat16*>(smem); // [stages][kSmallHeadRows][kSmallHeadLd]
  __nv_bfloat16* sa = stages + kSmallHeadStages * kSmallHeadRows * kSmallHeadLd; // [8 N_FRAGS][k + pad]
  const int lda = a.k + kSmallHeadPad;
  const int chunks = (a.k + kSmallHeadChunk - 1) / kSmallHeadChunk; // stages a tile
  const int tiles = (a.vocab + kSmallHeadRows - 1) / kSmallHeadRows;
  const int weight_rows = padded_head_rows(a.vocab);
  const int my_tiles = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int units = my_tiles * chunks; // (tile, chunk) stages this block consumes, in order
  // Unit u's copy: kSmallHeadRows rows x kSmallHeadChunk columns, 16 bytes a copy, 4 a thread.
  const auto issue = [&](int u) {
    if (u < units) {
      const int tile = blockIdx.x + (u / chunks) * gridDim.x, chunk = u % chunks;
      __nv_bfloat16* dst = stages + (u % kSmallHeadStages) * kSmallHeadRows * kSmallHeadLd;
      const int column = chunk * kSmallHeadChunk;
#pragma unroll
      for (int i = 0; i < kSmallHeadRows * kSmallHeadChunk / 8 / kSmallHeadThreads; ++i) {
        const int piece = threadIdx.x + i * kSmallHeadThreads;
        const int r = piece / (kSmallHeadChunk / 8), c = 8 * (piece % (kSmallHeadChunk / 8));
        const int row = tile * kSmallHeadRows + r;
        if (row < weight_rows && column + c < a.k)
          __pipeline_memcpy_async(dst + r * kSmallHeadLd + c,
                                  a.weight + static_cast<int64_t>(row) * a.k + column + c, 16);
      }
    }
    __pipeline_commit(); // an empty group past the last unit keeps the wait counts below uniform
  };
  for (int u = 0; u < kSmallHeadStages - 1; ++u) // the weights are constant: before the wait
    issue(u);
  small_head_rows<N_FRAGS>(a, sa, lda, warp, lane);
  // Lane addresses (mma.cuh): the weights are the A operand, the tokens the B operand.
  const int w_offset = (warp * 16 + a_fragment_row(lane)) * kSmallHeadLd + a_fragment_column(lane);
  const __nv_bfloat16* a_lane = sa + b_row(lane) * lda + b_column(lane);
  float d[N_FRAGS][4] = {};
  for (int u = 0; u < units; ++u) {
    __pipeline_wait_prior(kSmallHeadStages - 2);
    __syncthreads();                 // unit u visible to all; unit u - 1's stage free again
    issue(u + kSmallHeadStages - 1); // into the stage unit u - 1 used
    const int chunk = u % chunks, column = chunk * kSmallHeadChunk;
    const __nv_bfloat16* w_lane = stages + (u % kSmallHeadStages) * kSmallHeadRows * kSmallHeadLd + w_offset;
    const int steps = min(kSmallHeadChunk, a.k - column) / 16;
#pragma unroll
    for (int s = 0; s < kSmallHeadChunk / 16; ++s) {
      if (s < steps) {
        uint32_t wf[4];
        ldmatrix_x4(wf, w_lane + 16 * s);
        small_head_mma<N_FRAGS>(d, wf, a_lane + column + 16 * s, lda);
      }
    }
    if (chunk == chunks - 1)
      small_head_store<N_FRAGS>(a, u / chunks, warp, d, lane);
  }
  __pipeline_wait_prior(0); // no copy outlives the block
}

/// The int8 head: the small head's tiles, ring and MMA chain over the head's Q8_0 values instead of its bf16
/// weights (SmallHeadArgs::q8), 1.125 bytes a weight instead of 2. A stage holds a tile's kSmallHeadRows rows
/// x kSmallHeadChunk columns of int8 values in fragment order (LlamaWeights::head_q8: a warp's 16 rows and a
/// 16-wide K step are 256 contiguous bytes, 8 a lane) and their 32-wide blocks' scales. Each lane turns its 8
/// values into the A fragment's four bf16 pairs as the loader does, bf16(q * scale) (q * scale is exact in
/// fp32: 8 by 11 significant bits; rounded to nearest even), so the MMAs see the bf16 small head's operands
/// and chain them in its order: the same bits. The int8 to float step is exact too: byte q + 128 placed in
/// the mantissa of 2^23 gives 2^23 + q + 128, and subtracting 2^23 + 128 leaves q. It serves the small head's
/// token counts (kQ8HeadMaxTokens): with more token fragments it lost to cuBLASLt (the file comment).
/// Blocks an SM and their ring stages: the dequantisation is a chain of dependent instructions per K step
/// that few warps a scheduler cannot hide. Measured (H100, `llama_gemm_bench`, 1 / 8 / 16 tokens, us cold;
/// the bf16 small head 22.2 / 23.6 / 26.4): one block an SM with 12 stages 23.1 / 23.7 / 27.2; two of 8
/// stages 19.6-19.9 / 20.5-20.8 / 24.1-24.4; three of 6 stages (at most 85 registers a thread) 16.1 / 17.1
/// / 19.7. In the cycle (`bucket_sweep --model smollm2`, graph us, bf16 small head -> two -> three blocks):
/// no draft at 1 request 408.5-408.7 -> 407.3-407.4 -> 402.5-402.8.
constexpr int kQ8HeadBlocksPerSm = 3;
constexpr int kQ8HeadStages = 6;
constexpr int kQ8ValueBytes = kSmallHeadRows * kSmallHeadChunk; // a stage's int8 values
constexpr int kQ8ScaleBytes = kSmallHeadRows * (kSmallHeadChunk / 32) * static_cast<int>(sizeof(float));
constexpr int kQ8StageBytes = kQ8ValueBytes + kQ8ScaleBytes;

size_t q8_head_smem_bytes(int k, int n_frags) {
  return static_cast<size_t>(kQ8HeadStages) * kQ8StageBytes +
         static_cast<size_t>(8 * n_frags) * (k + kSmallHeadPad) * sizeof(uint16_t);
}

/// Two int8 values of `biased` (each byte + 128: q ^ 0x80), bytes `first` and first + 1, times `scale` as a
/// bf16 pair (the lower column in the low half, as ldmatrix leaves it).
__device__ __forceinline__ uint32_t q8_pair_bf16(uint32_t biased, unsigned first, float scale) {
  constexpr float kBias = 8388736.0f; // 2^23 + 128
  const float v0 = __uint_as_float(__byte_perm(biased, 0x4b000000u, 0x7440u + first)) - kBias;
  const float v1 = __uint_as_float(__byte_perm(biased, 0x4b000000u, 0x7441u + first)) - kBias;
  return bf16x2_bits(v0 * scale, v1 * scale);
}

template <int N_FRAGS>
__global__ void __launch_bounds__(kSmallHeadThreads, kQ8HeadBlocksPerSm)
    LlamaQ8HeadKernel(const SmallHeadArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* stages =
      smem; // [stages][values: 8 warps x 4 K steps x 256 bytes; scales: 8 x 2 x 16 floats]
  __nv_bfloat16* sa = reinterpret_cast<__nv_bfloat16*>(smem + kQ8HeadStages * kQ8StageBytes);
  const int lda = a.k + kSmallHeadPad;
  const int k_steps = a.k / 16, k_blocks = a.k / 32;
  const int chunks = (a.k + kSmallHeadChunk - 1) / kSmallHeadChunk;
  const int tiles = (a.vocab + kSmallHeadRows - 1) / kSmallHeadRows;
  const int groups = (a.vocab + 63) / 64 * 4; // 16-row groups of the padded rows
  const int my_tiles = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int units = my_tiles * chunks;
  const auto* values = reinterpret_cast<const unsigned char*>(a.q8);
  const auto* scales = reinterpret_cast<const unsigned char*>(a.q8_scales);
  // Unit u's copy: each warp's group, its chunk's (up to) 4 K steps of values (256 bytes each) and 2 blocks
  // of scales (64 bytes each), 16 bytes a copy.
  const auto issue = [&](int u) {
    if (u < units) {
      const int tile = blockIdx.x + (u / chunks) * gridDim.x, chunk = u % chunks;
      unsigned char* dst = stages + (u % kQ8HeadStages) * kQ8StageBytes;
      const int step0 = chunk * (kSmallHeadChunk / 16), steps = min(kSmallHeadChunk / 16, k_steps - step0);
#pragma unroll
      for (int i = 0; i < kQ8ValueBytes / 16 / kSmallHeadThreads; ++i) {
        const int piece = threadIdx.x + i * kSmallHeadThreads;
        const int w = piece / 64, step = piece % 64 / 16, offset = 16 * (piece % 16);
        const int group = tile * kSmallHeadWarps + w;
        if (step < steps && group < groups)
          __pipeline_memcpy_async(
              dst + (w * 4 + step) * 256 + offset,
              values + (static_cast<int64_t>(group) * k_steps + step0 + step) * 256 + offset, 16);
      }
      if (threadIdx.x < kQ8ScaleBytes / 16) {
        const int w = threadIdx.x / 8, block = threadIdx.x % 8 / 4, offset = 16 * (threadIdx.x % 4);
        const int group = tile * kSmallHeadWarps + w;
        if (2 * block < steps && group < groups)
          __pipeline_memcpy_async(
              dst + kQ8ValueBytes + (w * 2 + block) * 64 + offset,
              scales + (static_cast<int64_t>(group) * k_blocks + step0 / 2 + block) * 64 + offset, 16);
      }
    }
    __pipeline_commit();
  };
  for (int u = 0; u < kQ8HeadStages - 1; ++u) // the weights are constant: before the wait
    issue(u);
  small_head_rows<N_FRAGS>(a, sa, lda, warp, lane);
  const __nv_bfloat16* a_lane = sa + b_row(lane) * lda + b_column(lane);
  float d[N_FRAGS][4] = {};
  for (int u = 0; u < units; ++u) {
    __pipeline_wait_prior(kQ8HeadStages - 2);
    __syncthreads();
    issue(u + kQ8HeadStages - 1);
    const int chunk = u % chunks, column = chunk * kSmallHeadChunk;
    const unsigned char* stage = stages + (u % kQ8HeadStages) * kQ8StageBytes;
    const unsigned char* lane_values = stage + warp * 4 * 256 + 8 * lane;
    const float* warp_scales = reinterpret_cast<const float*>(stage + kQ8ValueBytes) + warp * 32;
    const int steps = min(kSmallHeadChunk, a.k - column) / 16;
#pragma unroll
    for (int s = 0; s < kSmallHeadChunk / 16; ++s) {
      if (s < steps) {
        const uint2 q = *reinterpret_cast<const uint2*>(lane_values + 256 * s);
        const float low = warp_scales[(s / 2) * 16 + lane / 4],
                    high = warp_scales[(s / 2) * 16 + lane / 4 + 8];
        const uint32_t x = q.x ^ 0x80808080u, y = q.y ^ 0x80808080u;
        const uint32_t wf[4] = {q8_pair_bf16(x, 0, low), q8_pair_bf16(x, 2, high), q8_pair_bf16(y, 0, low),
                                q8_pair_bf16(y, 2, high)};
        small_head_mma<N_FRAGS>(d, wf, a_lane + column + 16 * s, lda);
      }
    }
    if (chunk == chunks - 1)
      small_head_store<N_FRAGS>(a, u / chunks, warp, d, lane);
  }
  __pipeline_wait_prior(0);
}

/// One launch of a small head for s.tokens <= 16 (the fewest token fragments that hold them): the int8 head
/// where s.q8 is set (kQ8HeadBlocksPerSm blocks an SM), else the bf16 one (a block an SM).
template <int N_FRAGS> void launch_small_head(const SmallHeadArgs& s, cudaStream_t stream) {
  const int tiles = detail::ceil_div(s.vocab, kSmallHeadRows), sms = current_device_info().multiprocessors;
  // The weights (the int8 values, or the bf16 rows: padded_head_rows either way) as a streaming L2 range
  // where GemmArgs::stream_weights asks for it.
  const auto weight_rows = static_cast<size_t>(padded_head_rows(s.vocab));
  L2StreamingRange streaming{};
  if (s.stream_weights)
    streaming = s.q8 != nullptr ? L2StreamingRange{s.q8, weight_rows * s.k}
                                : L2StreamingRange{s.weight, weight_rows * s.k * sizeof(uint16_t)};
  if (s.q8 != nullptr)
    launch_pdl_streaming(LlamaQ8HeadKernel<N_FRAGS>,
                         dim3(static_cast<unsigned>(std::min(tiles, kQ8HeadBlocksPerSm * sms))),
                         dim3(kSmallHeadThreads), q8_head_smem_bytes(s.k, N_FRAGS), streaming, stream, s);
  else
    launch_pdl_streaming(LlamaSmallHeadKernel<N_FRAGS>, dim3(static_cast<unsigned>(std::min(tiles, sms))),
                         dim3(kSmallHeadThreads), small_head_smem_bytes(s.k, N_FRAGS), streaming, stream, s);
}

void run_small_head(const SmallHeadArgs& s, cudaStream_t stream) {
  if (s.tokens <= 8)
    launch_small_head<1>(s, stream);
  else
    launch_small_head<2>(s, stream);
}
static_assert(kSmallHeadMaxTokens == 16 && kQ8HeadMaxTokens == 16,
              "run_small_head's largest variant holds 2 x 8 tokens");

cudaDataType_t cuda_type(DType dtype) {
  return dtype == DType::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
}

SmallHeadArgs small_args(const GemmArgs& a) {
  SmallHeadArgs s;
  s.tokens = a.tokens;
  s.tokens_per_row = a.tokens_per_row;
  s.io_row_stride = a.io_row_stride;
  s.k = a.k;
  s.vocab = a.logits_cols;
  s.x = a.x;
  s.x_row_stride = a.x_row_stride > 0 ? a.x_row_stride : a.k;
  s.gamma = a.norm_weight;
  s.eps = a.eps;
  s.weight = a.weight;
  s.logits = a.logits;
  s.dtype = a.logits_dtype;
  s.stream_weights = a.stream_weights;
  return s;
}

} // namespace

struct LtHead::Impl {
  std::unique_ptr<LtMatmul> lt; // null where cuBLASLt does not serve the head
  cublasLtMatmulAlgo_t algo{};
  DeviceBuffer<uint8_t> workspace;
  int vocab = 0, hidden = 0, max_tokens = 0;
  DType dtype = DType::kFloat32;
  bool usable = false;
  /// run() takes the small head for up to kSmallHeadMaxTokens tokens (HeadKernels::kBySize or
  /// kSmallBf16, the probe at construction passed).
  bool small = false;
  HeadKernels kernels = HeadKernels::kBySize;
  /// The int8 head's weights (use_q8_weights) and the most tokens it takes (0: off).
  const int8_t* q8 = nullptr;
  const float* q8_scales = nullptr;
  int q8_max_tokens = 0;
  bool q8_prepared = false; ///< the int8 kernels' shared-memory limits are set (once)

  /// W's layout (column-major [hidden, vocab]: W row-major), set once at construction.
  cublasLtMatrixLayoutOpaque_t w{};
  /// Layouts of A ([hidden, tokens]) and Y ([vocab, tokens], leading dimension ldy elements), initialised in
  /// place (cublasLtMatrixLayoutInit): a forward allocates nothing for them.
  struct Layouts {
    cublasLtMatrixLayoutOpaque_t a{}, y{};
  };
  /// The norm kernel and cuBLASLt's matmul (false where the layout does not fit the workspace).
  bool run_cublaslt(const GemmArgs& a, uint16_t* normed, cudaStream_t stream);
  void set_small_head_smem_limits() const;
  /// cuBLASLt's algorithm for the head, pinned (false where it offers none).
  bool pinned_algorithm(cublasLtMatmulAlgo_t& algo);
  /// The probe: the small head and cuBLASLt give the same logits bits (synchronizes; allocates its own
  /// weights for the probe).
  bool small_head_gives_cublaslt_bits();
  void make_layouts(Layouts& l, int tokens, int64_t ldy) const {
    lt_check(cublasLtMatrixLayoutInit(&l.a, CUDA_R_16BF, hidden, tokens, hidden), kLtHead, "layout A");
    lt_check(cublasLtMatrixLayoutInit(&l.y, cuda_type(dtype), vocab, tokens, ldy), kLtHead, "layout Y");
  }
};

void rms_norm_rows(int rows, int k, const float* x, int64_t x_row_stride, const float* gamma, float eps,
                   uint16_t* out, cudaStream_t stream) {
  constexpr const char* kWhere = "llama::rms_norm_rows";
  require(k >= 4 && k % 4 == 0 && k <= kLlamaMaxHidden, kWhere, "k", k,
          "must be a multiple of 4 in [4, kLlamaMaxHidden]");
  require(x_row_stride == 0 || (x_row_stride >= k && x_row_stride % 4 == 0), kWhere, "x_row_stride",
          x_row_stride, "must be 0 (dense) or a multiple of 4 that is >= k");
  if (rows <= 0)
    return;
  launch_pdl(LlamaHeadNormKernel, dim3(static_cast<unsigned>(detail::ceil_div(rows, kNormThreads / 32))),
             dim3(kNormThreads), 0, stream, rows, 1, 1, 0, k, x, x_row_stride > 0 ? x_row_stride : k, gamma,
             eps, out);
}

LtHead::LtHead(int vocab, int hidden, int max_tokens, DType logits_dtype, HeadKernels kernels)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.vocab = vocab;
  m.hidden = hidden;
  m.max_tokens = max_tokens;
  m.dtype = logits_dtype;
  m.kernels = kernels;
  if (kernels == HeadKernels::kOwnGemm) // run() declines, the own GEMM serves
    return;
  if (hidden % 4 != 0 || hidden > kLlamaMaxHidden ||
      (logits_dtype != DType::kFloat32 && logits_dtype != DType::kBFloat16)) // not served
    return;
  m.lt = std::make_unique<LtMatmul>(kLtHead);
  lt_check(cublasLtMatrixLayoutInit(&m.w, CUDA_R_16BF, hidden, vocab, hidden), kLtHead, "layout W");
  m.workspace = DeviceBuffer<uint8_t>(kWorkspaceBytes);
  if (!m.pinned_algorithm(m.algo)) // cuBLASLt offered no algorithm
    return;
  for (int tokens : {1, 2, 3, 5, 8, 16, 17, 40, 64, 128, 320, 512, 1024, 2560, max_tokens}) {
    if (tokens > max_tokens)
      continue;
    for (int64_t stride : {int64_t{1}, int64_t{5}}) {
      Impl::Layouts l;
      m.make_layouts(l, tokens, stride * vocab);
      if (!m.lt->serves(m.algo, m.w, l.a, l.y, kWorkspaceBytes))
        return; // the pinned algorithm does not serve this token count
    }
  }
  m.usable = true;
  if ((kernels == HeadKernels::kBySize || kernels == HeadKernels::kSmallBf16) && hidden % 16 == 0 &&
      small_head_smem_bytes(hidden, 2) <=
          static_cast<size_t>(current_device_info().shared_memory_optin_bytes))
    m.small = m.small_head_gives_cublaslt_bits();
}

void LtHead::Impl::set_small_head_smem_limits() const {
  detail::prepare_forward_kernel(LlamaSmallHeadKernel<1>, small_head_smem_bytes(hidden, 1));
  detail::prepare_forward_kernel(LlamaSmallHeadKernel<2>, small_head_smem_bytes(hidden, 2));
}

bool LtHead::Impl::pinned_algorithm(cublasLtMatmulAlgo_t& algo) {
  // cuBLASLt's first heuristic for a 64-token head, split-K and its reduction switched off (the constructor
  // then checks it for every token count the model may run: it is used for all of them).
  Layouts l;
  make_layouts(l, std::min(64, max_tokens), vocab);
  return lt->pin(w, l.a, l.y, kWorkspaceBytes, algo);
}

bool LtHead::Impl::small_head_gives_cublaslt_bits() {
  set_small_head_smem_limits();
  // The probe makes every difference in summation order visible, also in bf16 logits (with random data bf16
  // rounding hides most of them: measured on an H100, a cuBLASLt kernel that sums K in another order gave
  // other fp32 logits for 25% of a 517-row vocabulary but other bf16 logits for 1 of 4,136). Its A rows are
  // all ones (x = 1, gamma = 1: RMSNorm gives bf16 1.0), and row v of its weights holds small values in [-1,
  // 1) plus, in each 16-wide K step j but the last of an odd count, one +2^20 (j even) or -2^20 (j odd) at
  // column 16 j + (v + j) % 16: the running sum swings by 2^20 every step, so where the rounding of each
  // partial sum falls (ulp(2^20) = 1/8, against logits of about 10 with a bf16 ulp of 1/16) shows in the
  // result. Every variant (8 and 16 tokens) runs both ways with the pinned algorithm and the model's
  // logits type; one differing bit leaves the small head off.
  const int rows = std::min(kSmallHeadMaxTokens, max_tokens);
  const int weight_rows = padded_head_rows(vocab), steps = hidden / 16;
  std::vector<uint16_t> host_w(static_cast<size_t>(weight_rows) * hidden, 0);
  uint32_t state = 0x9e3779b9u;
  const auto next = [&] { // xorshift32
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    return state;
  };
  constexpr uint16_t kPlusBig = 0x4980, kMinusBig = 0xc980; // bf16 +-2^20
  for (int v = 0; v < vocab; ++v)
    for (int k = 0; k < hidden; ++k) {
      const int j = k / 16;
      uint16_t& bits = host_w[static_cast<size_t>(v) * hidden + k];
      if (k % 16 == (v + j) % 16 && !(j == steps - 1 && steps % 2 == 1))
        bits = j % 2 == 0 ? kPlusBig : kMinusBig;
      else // (m - 128) / 128 for m in [0, 256): exact in bf16
        bits = __bfloat16_as_ushort(
            __float2bfloat16(static_cast<float>(static_cast<int>(next() >> 24) - 128) / 128.0f));
    }
  Stream stream;
  DeviceBuffer<uint16_t> weight(host_w.size()), normed(static_cast<size_t>(rows) * hidden);
  weight.copy_from_host(host_w.data(), host_w.size(), stream);
  const std::vector<float> ones(static_cast<size_t>(rows) * hidden, 1.0f);
  DeviceBuffer<float> x(ones.size()), gamma(static_cast<size_t>(hidden));
  x.copy_from_host(ones.data(), ones.size(), stream);
  gamma.copy_from_host(ones.data(), static_cast<size_t>(hidden), stream);
  const size_t max_bytes = static_cast<size_t>(rows) * vocab * dtype_bytes(dtype);
  DeviceBuffer<uint8_t> theirs(max_bytes), ours(max_bytes);
  std::vector<uint8_t> host_theirs(max_bytes), host_ours(max_bytes);
  for (int tokens : {5, rows}) {
    if (tokens > rows)
      continue;
    GemmArgs probe;
    probe.tokens = tokens;
    probe.k = hidden;
    probe.io_row_stride = 1;
    probe.x = x.data();
    probe.norm_weight = gamma.data();
    probe.eps = 1e-5f;
    probe.weight = weight.data();
    probe.logits_cols = vocab;
    probe.logits_dtype = dtype;
    probe.logits = theirs.data();
    if (!run_cublaslt(probe, normed.data(), stream))
      return false;
    probe.logits = ours.data();
    run_small_head(small_args(probe), stream);
    const size_t bytes = static_cast<size_t>(tokens) * vocab * dtype_bytes(dtype);
    theirs.copy_to_host(host_theirs.data(), bytes, stream);
    ours.copy_to_host(host_ours.data(), bytes, stream);
    stream.synchronize();
    if (std::memcmp(host_theirs.data(), host_ours.data(), bytes) != 0)
      return false;
  }
  return true;
}

void q8_head_layout(const int8_t* row_values, const float* row_scales, int rows, int padded_rows, int k,
                    std::vector<int8_t>& values, std::vector<float>& scales) {
  constexpr const char* kWhere = "llama::q8_head_layout";
  require(k >= 32 && k % 32 == 0, kWhere, "k", k, "must be a positive multiple of 32");
  require(rows >= 1 && padded_rows >= rows && padded_rows % 64 == 0, kWhere, "padded_rows", padded_rows,
          "must be a multiple of 64 that is >= rows");
  const size_t groups = static_cast<size_t>(padded_rows) / 16, steps = static_cast<size_t>(k) / 16,
               blocks = static_cast<size_t>(k) / 32, n_rows = static_cast<size_t>(rows);
  values.assign(static_cast<size_t>(padded_rows) * k, 0);
  scales.assign(groups * blocks * 16, 0.0f);
  // Lane l's 8 bytes of (group, step): rows r = 16 group + l / 4 and r + 8, columns c = 16 step + 2 (l % 4):
  // byte j is row r + 8 ((j / 2) % 2), column c + 8 (j / 4) + j % 2 (the A fragment's registers in order).
  for (size_t g = 0; g < groups; ++g)
    for (size_t step = 0; step < steps; ++step)
      for (size_t lane = 0; lane < 32; ++lane)
        for (size_t j = 0; j < 8; ++j) {
          const size_t row = 16 * g + lane / 4 + ((j / 2) % 2) * 8;
          const size_t col = 16 * step + 2 * (lane % 4) + (j / 4) * 8 + j % 2;
          if (row < n_rows)
            values[((g * steps + step) * 32 + lane) * 8 + j] = row_values[row * k + col];
        }
  for (size_t g = 0; g < groups; ++g)
    for (size_t b = 0; b < blocks; ++b)
      for (size_t r = 0; r < 16; ++r)
        if (16 * g + r < n_rows)
          scales[(g * blocks + b) * 16 + r] = row_scales[(16 * g + r) * blocks + b];
}

LtHead::~LtHead() = default;

bool LtHead::usable() const {
  return impl_->usable;
}

void LtHead::use_q8_weights(const int8_t* values, const float* scales) {
  Impl& m = *impl_;
  m.q8 = nullptr;
  m.q8_scales = nullptr;
  m.q8_max_tokens = 0;
  // The int8 head chains the small head's MMAs over the same bf16 operands, so it gives the bits the small
  // head's probe found equal to cuBLASLt's; where that probe failed (or the small head is off) it stays off.
  if (values == nullptr || scales == nullptr || !m.usable || !m.small || m.kernels != HeadKernels::kBySize ||
      m.hidden % 32 != 0)
    return;
  if (q8_head_smem_bytes(m.hidden, 2) > static_cast<size_t>(current_device_info().shared_memory_optin_bytes))
    return;
  if (!m.q8_prepared) {
    detail::prepare_forward_kernel(LlamaQ8HeadKernel<1>, q8_head_smem_bytes(m.hidden, 1));
    detail::prepare_forward_kernel(LlamaQ8HeadKernel<2>, q8_head_smem_bytes(m.hidden, 2));
    m.q8_prepared = true;
  }
  m.q8 = values;
  m.q8_scales = scales;
  m.q8_max_tokens = std::min(kQ8HeadMaxTokens, m.max_tokens);
}

bool LtHead::run(const GemmArgs& a, uint16_t* normed, cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.usable || a.tokens < 1 || a.k != m.hidden || a.logits_cols != m.vocab || a.logits_dtype != m.dtype)
    return false;
  if (m.small && a.tokens <= kSmallHeadMaxTokens) { // the int8 head only ever serves what the small head does
    SmallHeadArgs s = small_args(a);
    if (a.tokens <= m.q8_max_tokens) {
      s.q8 = m.q8;
      s.q8_scales = m.q8_scales;
    }
    run_small_head(s, stream);
    return true;
  }
  return m.run_cublaslt(a, normed, stream);
}

bool LtHead::small_head_serves(int tokens) const {
  const Impl& m = *impl_;
  return m.usable && m.small && tokens >= 1 && tokens <= kSmallHeadMaxTokens; // the int8 head's too
}

const char* LtHead::kernel(int tokens) const {
  const Impl& m = *impl_;
  if (!m.usable || tokens < 1)
    return "own_gemm";
  if (small_head_serves(tokens))
    return tokens <= m.q8_max_tokens ? "small_q8" : "small";
  return "cublaslt";
}

int LtHead::q8_max_tokens() const {
  return impl_->q8_max_tokens;
}

bool LtHead::Impl::run_cublaslt(const GemmArgs& a, uint16_t* normed, cudaStream_t stream) {
  Impl& m = *this;
  const int P = a.tokens_per_row, rows = a.tokens / P;
  const int64_t io = a.io_row_stride;
  const int64_t x_stride = a.x_row_stride > 0 ? a.x_row_stride : a.k;
  const float alpha = 1.0f, beta = 0.0f;
  // One matmul over `out_rows` rows of `normed` into logits + offset with leading dimension ldy.
  auto norm_and_matmul = [&](int out_rows, int slots_per_row, int first_row, int64_t ldy, size_t offset) {
    launch_pdl(LlamaHeadNormKernel,
               dim3(static_cast<unsigned>(detail::ceil_div(out_rows, kNormThreads / 32))), dim3(kNormThreads),
               0, stream, out_rows, slots_per_row, P, first_row, a.k, a.x, x_stride, a.norm_weight, a.eps,
               normed);
    Impl::Layouts l;
    m.make_layouts(l, out_rows, ldy);
    void* y = static_cast<uint8_t*>(a.logits) + offset * dtype_bytes(m.dtype);
    // The head's weights marked streaming in L2 like the small heads' (GemmArgs::stream_weights): cuBLASLt
    // takes no launch attribute, so the stream carries the window for its call. Measured neutral in SMC
    // cycles of 40, 320 and 2,560 head rows (NVIDIA H200, docs/real_model_results.md, forty-sixth session);
    // kept so that every weight read of a forward is marked alike.
    with_streaming_window(stream, weight_range(a), [&] {
      lt_check(cublasLtMatmul(m.lt->handle(), m.lt->op(), &alpha, a.weight, &m.w, normed, &l.a, &beta, y,
                              &l.y, y, &l.y, &m.algo, m.workspace.data(), kWorkspaceBytes, stream),
               kLtHead, "cublasLtMatmul");
    });
  };
  if (P == io || P == 1) { // dense rows, or one token a row io tokens apart: one leading dimension
    if (a.tokens > m.max_tokens)
      return false;
    norm_and_matmul(a.tokens, P, 0, P == io ? m.vocab : io * m.vocab, 0);
    return true;
  }
  // P < io tokens a row: every row's io slots, the ones past P from zero rows (their logits land in entries
  // past tokens_per_row, which nothing reads), in chunks of rows that fit the workspace; the same matmul
  // algorithm throughout, so a token's logits are the same bits as in a dense forward.
  const int chunk_rows = static_cast<int>(m.max_tokens / io);
  if (chunk_rows < 1)
    return false;
  for (int first = 0; first < rows; first += chunk_rows) {
    const int count = std::min(chunk_rows, rows - first);
    norm_and_matmul(count * static_cast<int>(io), static_cast<int>(io), first, m.vocab,
                    static_cast<size_t>(first) * io * m.vocab);
  }
  return true;
}

} // namespace smcgraph::llama
