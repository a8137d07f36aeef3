// The Llama forward's GEMMs: Y[T, N] = A[T, K] W[N, K]^T on tensor cores (bf16, fp32 accumulation) with
// the neighbouring element-wise work fused in: the RMSNorm that produces A, and RoPE + KV write, the residual
// add, SwiGLU or the logits store after it. A block stages its A rows once in shared memory (the norm needs
// whole rows anyway), reads its W columns (in the narrow shape copied to shared memory before its PDL wait
// where they fit, else from global memory), and finishes its tile in shared memory, where a column and its
// RoPE / SwiGLU partner meet.
//
// Three shapes: narrow (up to kNarrowMaxTokens tokens: decode, verify blocks, small prefills): 16 columns and
// 16 rows per block and the 4 warps split K (8 warps up to 16 tokens, a warp per partial accumulator), so
// even a 576-wide projection spreads over 36+ blocks (gate/up takes 32 columns a block from 17 tokens, 8 in
// 8-warp blocks: two column fragments a warp), fragments loaded with ldmatrix into m16n8k16 MMAs where W is
// in shared memory (GemmArgs::fragments: or wmma, the same bits); wide (more tokens, and the LM head): 64
// columns per block, one warp per 16 columns, up to 64 rows per block; pipelined (the layer GEMMs from
// kPipelinedMinTokens tokens, gate/up from kPipelinedMinTokensGateUp): 32-64 rows and columns a block, K
// streamed through shared-memory stages, A from bf16 rows (an RMSNorm kernel first for the norm epilogues).
// All three sum K in one order, so a token's outputs are the same bits in any.
#include <algorithm>
#include <cmath>
#include <utility>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <mma.h>

#include "kernels/launch_checks.hpp"
#include "kernels/tree_sum.cuh"
#include "kernels/smem_limit.hpp"
#include "models/forward_layout.cuh"
#include "models/llama/bf16_rows.cuh"
#include "models/llama/llama_kernels.hpp"
#include "models/llama/mma.cuh"
#include "models/llama/pdl.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/runtime.hpp"

namespace smcgraph::llama {
namespace {

using namespace nvcuda;
namespace cg = cooperative_groups;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
/// The slices of K that every tiling sums in order (((s0 + s1) + s2) + s3): one a warp in the 4-warp narrow
/// and wide kernels and in the pipelined kernel's K loop.
constexpr int kKSlices = 4;
/// Warps of a narrow block (LlamaGemmKernel with one column warp): 8 give each of a slice's two partial
/// accumulators its own warp (the same tiles in the same order as one warp's two chains, so the same bits),
/// which halves the tensor-core chain and the instructions each warp issues; 4 keep one warp a slice.
/// GemmArgs::narrow_warps picks (LlamaModel: SMCGRAPH_GEMM_NARROW_WARPS, for tests and A/B runs); by size
/// (the default), launches of up to kNarrowSplitMaxTokens tokens take 8 warps, larger ones 4.
constexpr int kNarrowSplitWarps = 2 * kKSlices;
/// H100, SmolLM2, graph us per cycle, one call, second of two rounds (4 warps / 8 warps up to 16 tokens / 8
/// warps up to 48 tokens / 8 warps always): no draft at 1 / 8 / 64 requests 451.6 / 473.7 / 917.4 -> 434.4
/// / 453.1 / 917.6 -> 434.9 / 453.0 / 919.1 -> 433.0 / 453.1 / 926.1; speculative K = 1 at 1 / 8 / 64
/// 875.5 / 1,012.2 / 2,268.7 -> 840.7 / 914.1 / 2,272.0 -> 840.7 / 913.5 / 2,267.0 -> 840.4 / 913.7 /
/// 2,274.1; K = 4 at 8 / 64 2,474.3 / 6,139.5 -> 2,398.9 / 6,124.0 -> 2,390.1 / 6,127.8 -> 2,428.1 /
/// 6,175.9; SMC N 8 K 4 at 1 / 8 2,607.5 / 6,197.1 -> 2,530.8 / 6,201.3 -> 2,572.5 / 6,203.2 -> 2,590.5 /
/// 6,305.6. The decode forward alone at 8 rows: 451.9 -> 431.6 us.
constexpr int kNarrowSplitMaxTokens = 16;
constexpr int kRowPad = 8; // bf16 elements of padding per staged A row (bank spread, keeps 32-byte alignment)
/// float4s of an RMSNorm row each lane holds in registers: rows up to 32 * 4 * kNormVec = 1024 wide.
constexpr int kNormVec = 8;
constexpr int kMaxNormK = 32 * 4 * kNormVec;
/// Rows of A a block holds at most (4 fragments of 16).
constexpr int kMaxBlockRows = 64;
/// Forwards of up to this many tokens use narrow 16-row tiles for the layer GEMMs (gemm()).
constexpr int kNarrowMaxTokens = 384;
/// Independent tensor-core accumulators per row fragment in a K slice (LlamaGemmKernel's main loop).
/// SmolLM2's decode forward alone (H100, us at 1 / 8 rows, two rounds in one call): one accumulator 499-500 /
/// 509-512, two 488-496 / 499-500, four 493-498 / 504-505.
constexpr int kPartials = 2;
static_assert(kPartials == 1 || kPartials == 2 || kPartials == 4, "1, 2 or 4 partial accumulators");
static_assert(kWarps == kKSlices, "the 4-warp kernels give each K slice one warp");

/// Rows a warp normalises at once (a block has at least 16 rows, 4 a warp).
constexpr int kNormRows = 2;
static_assert(kMaxNormK == kLlamaMaxHidden,
              "the RMSNorm prologue must hold a row of the largest hidden size");

/// Narrow gate/up projections of at least this many tokens give each warp two column fragments (32 columns a
/// block): every block normalises and stages the same activation rows from L2, so half as many blocks read
/// half as much of them in all. H100, SmolLM2, graph us per cycle (A/B in one call, two rounds): no draft at
/// 64 requests 1,028.6 -> 972.0-972.4, speculative K = 1 at 64 2,602.0-2,606.2 -> 2,488.1-2,490.9, SMC N 8 K
/// 4 at 1 / 8 requests 2,755.7-2,756.8 / 8,040.7-8,041.1 -> 2,706.3-2,706.7 / 7,545.3-7,554.0. (Alone in
/// llama_gemm_bench, whose launches do not overlap through PDL, it does not gain: 7.76 -> 8.65 us at 40
/// tokens, cold.) Up to 16 tokens the 4-warp single-fragment blocks stay (decode: more blocks stream the
/// weights); 8-warp blocks (kNarrowSplitMaxTokens) pair their columns from kPairedSplitMinTokens tokens
/// (H100, A/B in one call, two rounds: speculative K = 1 at 8 requests 912.2-915.8 -> 905.8-906.2 us a cycle,
/// SMC N 8 K 4 at 1 2,526.5-2,529.2 -> 2,517.9-2,521.6; paired 8-warp blocks at 1 token cost a 1-row decode
/// forward about 11 us, so they start at 8).
constexpr int kPairedColumnsMinTokens = 17;
constexpr int kPairedSplitMinTokens = 8;

/// Shared memory of a variant: the A rows, the fp32 tile (one per warp in the narrow shape: a K slice, or a
/// slice's partial with 8 warps) and, when `stage_w`, the block's weight rows (16 a column fragment; narrow
/// shape only).
size_t smem_bytes(int m_frags, bool wide, int k, bool stage_w, int n_frags = 1, int warps = kWarps) {
  const int n_warps = wide ? 4 : 1, block_columns = 16 * n_warps * n_frags;
  return static_cast<size_t>(16 * m_frags) * (k + kRowPad) * sizeof(uint16_t) +
         static_cast<size_t>(wide ? 1 : warps) * (16 * m_frags) * block_columns * sizeof(float) +
         (stage_w ? static_cast<size_t>(block_columns) * (k + kRowPad) * sizeof(uint16_t) : 0);
}

template <int EPILOGUE> constexpr bool uses_norm() {
  return EPILOGUE != static_cast<int>(GemmEpilogue::kResidualAdd);
}

/// The epilogues' per-element steps, shared by LlamaGemmKernel and LlamaPipelinedGemmKernel (the same bits in
/// either): the SwiGLU output of gate column `col` and its up partner, RoPE's rotation of a Q/K column with
/// its pair's other column, and the QKV store (q to out_bf16; k and v to the KV at the row's slot, live rows
/// only).
__device__ __forceinline__ void store_swiglu(uint16_t* act, int act_cols, int t, int col, float gate,
                                             float up) {
  const int j = (col / (2 * kSwiGluGroup)) * kSwiGluGroup + col % (2 * kSwiGluGroup);
  const float silu = gate / (1.0f + expf(-gate));
  act[static_cast<size_t>(t) * act_cols + j] = float_to_bf16_bits(silu * up);
}

/// Q / K column `col`'s dimension within its head (adjacent pairs (2i, 2i + 1) rotate together: the GGUF row
/// order of llama Q/K).
__device__ __forceinline__ int rope_dim(const GemmArgs& a, int col) {
  return (col < a.q_dim ? col : col - a.q_dim) % a.head_dim;
}

__device__ __forceinline__ float rope_rotate(float value, float partner, int d, float s, float c) {
  return (d % 2 == 0) ? value * c - partner * s : partner * s + value * c;
}

__device__ __forceinline__ void store_qkv(const GemmArgs& a, int t, int col, uint16_t bits,
                                          const unsigned char& live, const int& slot) {
  if (col < a.q_dim) {
    a.out_bf16[static_cast<size_t>(t) * a.q_dim + col] = bits;
  } else if (live) {
    if (slot > 0 && slot < a.pool_size) {
      const bool is_v = col >= a.q_dim + a.kv_dim;
      const int kv_col = is_v ? a.kv_dim + (col - a.q_dim - a.kv_dim) : col - a.q_dim;
      a.kv[static_cast<size_t>(slot) * 2 * a.kv_dim + kv_col] = bits;
    }
  }
}

template <int EPILOGUE, int M_FRAGS, int N_WARPS, int N_FRAGS, int WARPS = kWarps>
__global__ void __launch_bounds__(32 * WARPS) LlamaGemmKernel(const GemmArgs a, bool stage_w) {
  static_assert(N_FRAGS == 1 || N_WARPS == 1, "several column fragments a warp in the narrow shape only");
  static_assert(WARPS == kWarps || (N_WARPS == 1 && WARPS == kNarrowSplitWarps),
                "4 warps, or 8 in the narrow shape (a warp per partial accumulator)");
  // One warp per partial accumulator of a K slice (narrow, 8 warps): warp w runs partial w % 2 of slice w
  // / 2.
  constexpr bool kSplitPartials = WARPS == kNarrowSplitWarps;
  static_assert(!kSplitPartials || kPartials == 2, "a warp per partial needs the two-partial order");
  constexpr int THREADS = 32 * WARPS;
  // fp32 tiles in shared memory: the narrow shape's one a warp, the wide shape's one.
  constexpr int STAGES = N_WARPS == 1 ? WARPS : 1;
  constexpr int BM = 16 * M_FRAGS, BN = 16 * N_WARPS * N_FRAGS;
  extern __shared__ __align__(128) unsigned char smem[];
  const int K = a.k, N = a.n, T = a.tokens;
  const int lda = K + kRowPad;
  __nv_bfloat16* a_tile = reinterpret_cast<__nv_bfloat16*>(smem);
  float* stage = reinterpret_cast<float*>(smem + static_cast<size_t>(BM) * lda * sizeof(uint16_t));
  __nv_bfloat16* w_tile = reinterpret_cast<__nv_bfloat16*>(stage + static_cast<size_t>(STAGES) * BM * BN);
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (a.trigger_early) // the next launch reads nothing before its wait that this kernel's predecessor writes
    pdl_trigger();
  // The weights do not depend on the previous kernel: start copying this block's BN rows of W (narrow shape)
  // into shared memory before waiting for it (PDL), so their latency hides under its tail and the prologue.
  if (N_WARPS == 1 && stage_w) {
    const int vectors_per_row = K / 8;
    const uint16_t* w_rows = a.weight + static_cast<size_t>(n0) * K;
    for (int v = threadIdx.x; v < BN * vectors_per_row; v += THREADS) {
      const int row = v / vectors_per_row, column = (v % vectors_per_row) * 8;
      __pipeline_memcpy_async(w_tile + static_cast<size_t>(row) * lda + column,
                              w_rows + static_cast<size_t>(row) * K + column, 16);
    }
    __pipeline_commit();
  }
  // The epilogue's per-row inputs (position, KV slot, live) and the RoPE frequencies are not written by the
  // forward's kernels: they were complete before its first kernel (embed) passed its pdl_wait(), and this
  // kernel starts only after its predecessor's pdl_wait() (pdl.hpp), so they are read here, before waiting,
  // and their latency leaves the critical path.
  __shared__ int row_position[kMaxBlockRows], row_slot[kMaxBlockRows];
  __shared__ unsigned char row_live[kMaxBlockRows];
  __shared__ float rope_freq[kLlamaMaxHeadDim / 2];
  constexpr bool kQkv = EPILOGUE == static_cast<int>(GemmEpilogue::kQkvRope);
  constexpr bool kLogitsOut = EPILOGUE == static_cast<int>(GemmEpilogue::kLogits);
  if constexpr (kQkv || kLogitsOut) {
    if (threadIdx.x < BM && m0 + static_cast<int>(threadIdx.x) < T) {
      const int t = m0 + threadIdx.x;
      row_live[threadIdx.x] = a.live[t / a.tokens_per_row];
      if constexpr (kQkv) {
        const int64_t io = detail::strided_token_index(t, a.tokens_per_row, a.io_row_stride);
        row_position[threadIdx.x] = a.positions[io];
        row_slot[threadIdx.x] = a.out_slots[io];
      }
    }
    if (kQkv && threadIdx.x < a.head_dim / 2)
      rope_freq[threadIdx.x] = a.inv_freq[threadIdx.x];
  }
  // Narrow QKV: the RoPE rotation (sin, cos) of each row and column pair of the block's tile, computed before
  // waiting (positions and frequencies are forward inputs): the epilogue then only looks them up. The same
  // float angle goes through the same sincosf as in the wide shape, so both give the same bits.
  constexpr bool kRopeTable = kQkv && M_FRAGS == 1 && N_WARPS == 1 && N_FRAGS == 1;
  __shared__ float2 rope_table[kRopeTable ? BM * BN / 2 : 1];
  if constexpr (kRopeTable) {
    static_assert(BM * BN / 2 <= THREADS, "one rotation a thread");
    const int m = threadIdx.x / (BN / 2), col = n0 + 2 * (threadIdx.x % (BN / 2)), t = m0 + m;
    if (threadIdx.x < BM * BN / 2 && t < T && col < a.q_dim + a.kv_dim) {
      const int d = (col < a.q_dim ? col : col - a.q_dim) % a.head_dim;
      const int position = a.positions[detail::strided_token_index(t, a.tokens_per_row, a.io_row_stride)];
      float s, c;
      sincosf(static_cast<float>(position) * a.inv_freq[d / 2], &s, &c);
      rope_table[threadIdx.x] = make_float2(s, c);
    }
  }
  // The residual tile of the epilogue (narrow shape), where the caller vouches that the predecessor kernel
  // does not write it (GemmArgs::residual_ready_before_wait): its load latency leaves the critical path too.
  constexpr int kEpiloguePerThread = BM * BN / THREADS;
  static_assert(BM * BN % THREADS == 0, "the epilogue gives every thread the same number of elements");
  constexpr bool kPrefetchResidual = EPILOGUE == static_cast<int>(GemmEpilogue::kResidualAdd) && N_WARPS == 1;
  float residual_early[kPrefetchResidual ? kEpiloguePerThread : 1];
  const bool residual_prefetched = kPrefetchResidual && a.residual_ready_before_wait;
  if constexpr (kPrefetchResidual) {
    if (residual_prefetched) {
#pragma unroll
      for (int i = 0; i < kEpiloguePerThread; ++i) {
        const int e = threadIdx.x + i * THREADS, t = m0 + e / BN;
        residual_early[i] = t < T ? a.residual[static_cast<size_t>(t) * N + n0 + e % BN] : 0.0f;
      }
    }
  }
  // The RMSNorm weights are weights too (and cold in L2 by the time a forward comes back to them): loaded
  // before waiting, so only the activation rows' latency is left after it.
  float4 gamma[uses_norm<EPILOGUE>() ? kNormVec : 1];
  if constexpr (uses_norm<EPILOGUE>()) {
    const float4* norm4 = reinterpret_cast<const float4*>(a.norm_weight);
#pragma unroll
    for (int i = 0; i < kNormVec; ++i)
      gamma[i] = lane + 32 * i < K / 4 ? norm4[lane + 32 * i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  pdl_wait_then_trigger(a.trigger_early);
  if constexpr (kPrefetchResidual) {
    // A residual that may still be written before the wait (GemmArgs::residual_ready_before_wait false):
    // loaded right after it, its latency beside the A rows' rather than in the epilogue.
    if (!residual_prefetched) {
#pragma unroll
      for (int i = 0; i < kEpiloguePerThread; ++i) {
        const int e = threadIdx.x + i * THREADS, t = m0 + e / BN;
        residual_early[i] = t < T ? a.residual[static_cast<size_t>(t) * N + n0 + e % BN] : 0.0f;
      }
    }
  }

  // Prologue: stage A's rows (zeros past T) as bf16. Every global load of a row is issued before the first
  // one is used, so a row costs one memory latency, not one per 32 elements.
  if constexpr (uses_norm<EPILOGUE>()) {
    const int k4 = K / 4;
    // A lane's float4 steps over a row (warp-uniform): in 8-warp blocks (decodes of up to 16 tokens) the
    // unrolled loops below stop after them, so a row of K = 576 costs 5 steps, not kNormVec = 8 predicated
    // ones, and a padding row beside a real one is zeros without a reduction. 4-warp blocks keep the full
    // predicated loops: there the trimmed loops cost the 64-row SMC cycle 3,930-3,940 -> 4,001-4,012 us,
    // while the 8-row decode gained 420.6-422.6 -> 416.3-418.0 (H200, one call, three rounds).
    constexpr bool kTrimSteps = WARPS == 8;
    const int steps = kTrimSteps ? (k4 + 31) / 32 : kNormVec;
    const int64_t x_stride = a.x_row_stride > 0 ? a.x_row_stride : K;
    const auto zero_row = [&](int m) {
      uint2* dst = reinterpret_cast<uint2*>(a_tile + static_cast<size_t>(m) * lda);
#pragma unroll
      for (int i = 0; i < kNormVec && i < steps; ++i)
        if (lane + 32 * i < k4)
          dst[lane + 32 * i] = make_uint2(0u, 0u);
    };
    // kNormRows rows a warp at a time: their loads are in flight together.
    for (int m_first = warp; m_first < BM; m_first += kNormRows * WARPS) {
      // Padding rows (past T) are zeros and need no loads or reductions: at a decode's 1-8 tokens most of
      // the block's 16 rows are padding, and skipping them took 1.2 us off each layer (QKV and gate/up).
      if (m0 + m_first >= T) { // every row of this pass is padding (its rows go up from m_first)
#pragma unroll
        for (int r = 0; r < kNormRows; ++r)
          zero_row(m_first + r * WARPS);
        continue;
      }
      float4 v[kNormRows][kNormVec];
#pragma unroll
      for (int r = 0; r < kNormRows; ++r) {
        const int t = m0 + m_first + r * WARPS;
        const float4* x4 = reinterpret_cast<const float4*>(a.x + static_cast<int64_t>(t) * x_stride);
#pragma unroll
        for (int i = 0; i < kNormVec && i < steps; ++i)
          v[r][i] = (t < T && lane + 32 * i < k4) ? x4[lane + 32 * i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int r = 0; r < kNormRows; ++r) {
        const int m = m_first + r * WARPS, t = m0 + m;
        if (kTrimSteps && t >= T) { // a padding row beside a real one (decodes of up to 8 tokens)
          zero_row(m);
          continue;
        }
        // The terms past `steps` were zeros: leaving them out keeps the sum's bits.
        float sum_squares = 0.0f;
#pragma unroll
        for (int i = 0; i < kNormVec && i < steps; ++i)
          sum_squares += sum_of_squares(v[r][i]);
        sum_squares =
            cg::reduce(cg::tiled_partition<32>(cg::this_thread_block()), sum_squares, cg::plus<float>());
        const float inv_rms = t < T ? rsqrtf(sum_squares / static_cast<float>(K) + a.eps) : 0.0f;
        uint2* dst = reinterpret_cast<uint2*>(a_tile + static_cast<size_t>(m) * lda);
#pragma unroll
        for (int i = 0; i < kNormVec && i < steps; ++i) {
          // Both store forms give the same bytes; the 4-warp blocks keep their measured SASS (the packed
          // form changes it).
          if constexpr (kTrimSteps) {
            const uint2 packed = rms_scaled_bf16x4(v[r][i], inv_rms, gamma[i]); // zeros on idle lanes
            if (lane + 32 * i < k4)
              dst[lane + 32 * i] = packed;
          } else if (lane + 32 * i < k4) {
            dst[lane + 32 * i] = rms_scaled_bf16x4(v[r][i], inv_rms, gamma[i]);
          }
        }
      }
    }
  } else if (a.a_staging == GemmAStaging::kRegisters) {
    // Warp w stages rows w and w + WARPS, then w + 2 WARPS and w + 3 WARPS, ...: every lane's 16-byte vectors
    // of both rows are loaded into registers (from L2: __ldcg, as cp.async's copies) before the first is
    // stored, so a row pair costs one memory latency; padding rows are zeros without loads. Stamps in every
    // block of the decode forward (H200, 8 rows) put cp.async's staging at 0.85 us of the O launch and 1.11
    // us of the down launch, whose 12 copies a thread took 1.05 us to issue. Through registers the forward at
    // 8 rows went from 421.0-423.2 to 400.6-400.8 us (one build, SMCGRAPH_GEMM_A_STAGING both ways, two
    // rounds; docs/real_model_results.md, thirty-sixth session).
    constexpr int kVectorBatch = 8; // a lane's vectors of a row in flight at once (K up to 2048 in one batch)
    const int vectors_per_row = K / 8;
    for (int m_first = warp; m_first < BM; m_first += 2 * WARPS) {
      for (int v0 = 0; v0 < vectors_per_row; v0 += 32 * kVectorBatch) {
        uint4 held[2][kVectorBatch];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int m = m_first + r * WARPS, t = m0 + m;
          const uint4* row =
              reinterpret_cast<const uint4*>(a.a_bf16 + static_cast<size_t>(t < T ? t : 0) * K);
#pragma unroll
          for (int i = 0; i < kVectorBatch; ++i) {
            const int v = v0 + lane + 32 * i;
            held[r][i] =
                (m < BM && t < T && v < vectors_per_row) ? __ldcg(row + v) : make_uint4(0u, 0u, 0u, 0u);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int m = m_first + r * WARPS;
          if (m >= BM)
            continue;
          uint4* dst = reinterpret_cast<uint4*>(a_tile + static_cast<size_t>(m) * lda);
#pragma unroll
          for (int i = 0; i < kVectorBatch; ++i) {
            const int v = v0 + lane + 32 * i;
            if (v < vectors_per_row)
              dst[v] = held[r][i];
          }
        }
      }
    }
  } else {
    // Copied straight into shared memory (cp.async): all of the block's loads are in flight at once.
    const int vectors_per_row = K / 8;
    for (int v = threadIdx.x; v < BM * vectors_per_row; v += THREADS) {
      const int m = v / vectors_per_row, column = (v % vectors_per_row) * 8, t = m0 + m;
      __nv_bfloat16* dst = a_tile + static_cast<size_t>(m) * lda + column;
      if (t < T)
        __pipeline_memcpy_async(dst, a.a_bf16 + static_cast<size_t>(t) * K + column, 16);
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
    __pipeline_commit();
  }
  __pipeline_wait_prior(0);
  __syncthreads();

  // Tensor-core main loop. K is cut into kKSlices slices of whole 16-wide tiles; each slice is accumulated
  // from zero and the slices are added in order (((s0 + s1) + s2) + s3), in both shapes: a row's result then
  // depends on its own inputs only, not on T or the variant (batch invariance: a token's logits are the same
  // in a 1-token decode and in a K + 1-token verify, so greedy speculative decoding reproduces greedy
  // decoding). Narrow: warp w computes slice w of columns n0 .. n0 + BN - 1 (one or two column fragments,
  // each summed exactly as alone; with 8 warps, partial w % 2 of slice w / 2). Wide: warp w computes every
  // slice of columns n0 + 16 w .. n0 + 16 w + 15.
  const int k_tiles = K / 16;
  const int tiles_per_slice = (k_tiles + kKSlices - 1) / kKSlices;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> total[M_FRAGS][N_FRAGS];
  const int wn = N_WARPS == 1 ? 0 : warp;
  const bool w_in_smem = N_WARPS == 1 && stage_w;
  const __nv_bfloat16* w_col =
      w_in_smem ? w_tile
                : reinterpret_cast<const __nv_bfloat16*>(a.weight) + static_cast<size_t>(n0 + wn * 16) * K;
  const int ldw = w_in_smem ? lda : K;
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  using WTile = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major>[N_FRAGS];
  // The W fragments of the 16-wide K tile at column k + offset (one a column fragment), and every row
  // fragment's MMAs with them into the accumulator acc_of(f, c) names. (k and a constant offset are added to
  // the pointer one after the other, so the compiler folds the offset into the load.)
  const auto load_w = [&](WTile& b, int k, int offset) {
#pragma unroll
    for (int c = 0; c < N_FRAGS; ++c)
      wmma::load_matrix_sync(b[c], w_col + static_cast<size_t>(16 * c) * ldw + k + offset, ldw);
  };
  const auto mma_tile = [&](const WTile& b, int k, int offset, auto&& acc_of) {
#pragma unroll
    for (int f = 0; f < M_FRAGS; ++f) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a_frag;
      wmma::load_matrix_sync(a_frag, a_tile + static_cast<size_t>(f * 16) * lda + k + offset, lda);
#pragma unroll
      for (int c = 0; c < N_FRAGS; ++c) {
        Acc& acc = acc_of(f, c);
        wmma::mma_sync(acc, a_frag, b[c], acc);
      }
    }
  };
  // Narrow blocks (one row fragment, one column warp) with their W rows in shared memory: ldmatrix loads and
  // m16n8k16 MMAs, the two HMMA.16816 steps a wmma 16 x 16 x 16 step issues, on the same tiles in the same
  // order (the same bits; GemmArgs::fragments). wmma's fragment loads compile to generic 32-bit loads (LD.E),
  // four a fragment; ldmatrix is one shared load a fragment. H200, SmolLM2, graph us a cycle at 1 / 8
  // requests, one build, SMCGRAPH_GEMM_FRAGMENTS wmma -> ldmatrix in the 8-warp blocks (up to 16 tokens), two
  // rounds: no draft 394.6, 393.9 / 417.5, 418.2 -> 380.2, 383.0 / 403.3, 405.0; speculative K 4 1,832.7,
  // 1,840.9 / 1,986.2, 1,988.1 -> 1,806.1, 1,801.0 / 1,935.0, 1,934.0; SMC N 8 K 4 1,806.7, 1,807.5 ->
  // 1,761.4, 1,756.1. The 4-warp blocks (17 or more tokens) too, two builds alternating: SMC at 8 requests
  // 3,962.0, 3,956.2 -> 3,881.7, 3,871.7, 3,888.5; at 64 requests no draft 890.5 -> 855.4, speculative K 4
  // 4,305.8 -> 4,160.8; the rest unchanged.
  constexpr bool kLdmatrixPath = M_FRAGS == 1 && N_WARPS == 1;
  const bool ldmatrix = kLdmatrixPath && w_in_smem && a.fragments == GemmFragments::kLdmatrix;
  if (ldmatrix) { // the warp's partial (8 warps) or slice (4 warps) straight into its stage tile
    if constexpr (kLdmatrixPath) {
      // 8 warps: partial w % 2 of slice w / 2 (tiles w % 2, w % 2 + 2, ... of the slice); 4 warps: slice w,
      // tile j into partial j % 2, the two added at the end (tree_sum's p0 + p1), as the wmma loop below.
      constexpr int kWarpPartials = kSplitPartials ? 1 : kPartials;
      static_assert(kWarpPartials == 1 || kWarpPartials == 2, "one or two partials a warp");
      const int slice = kSplitPartials ? warp / 2 : warp, part = kSplitPartials ? warp % 2 : 0;
      const int k_begin = slice * tiles_per_slice * 16;
      const int k_end = min(K, k_begin + tiles_per_slice * 16);
      float acc[kWarpPartials][N_FRAGS][2][4];
#pragma unroll
      for (int p = 0; p < kWarpPartials; ++p)
#pragma unroll
        for (int c = 0; c < N_FRAGS; ++c)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              acc[p][c][h][i] = 0.0f;
      // Lane addresses (mma.cuh): a column fragment's W rows are a B pair, registers 0-1 / 2-3 the B operands
      // of its two n8 halves.
      const __nv_bfloat16* a_lane =
          a_tile + static_cast<size_t>(a_fragment_row(lane)) * lda + a_fragment_column(lane);
      const __nv_bfloat16* w_lane = w_tile + static_cast<size_t>(b_pair_row(lane)) * lda + b_column(lane);
      const auto tile = [&](int k, float(&into)[N_FRAGS][2][4]) {
        uint32_t a_frag[4], w_frag[N_FRAGS][4];
        ldmatrix_x4(a_frag, a_lane + k);
#pragma unroll
        for (int c = 0; c < N_FRAGS; ++c)
          ldmatrix_x4(w_frag[c], w_lane + static_cast<size_t>(16 * c) * lda + k);
#pragma unroll
        for (int c = 0; c < N_FRAGS; ++c) {
          mma_16816(into[c][0], a_frag, w_frag[c][0], w_frag[c][1]);
          mma_16816(into[c][1], a_frag, w_frag[c][2], w_frag[c][3]);
        }
      };
      for (int k = k_begin + 16 * part; k < k_end; k += 32) {
        tile(k, acc[0]);
        if constexpr (kWarpPartials == 2) {
          if (k + 16 < k_end)
            tile(k + 16, acc[1]);
        }
      }
      float* mine = stage + static_cast<size_t>(warp) * BM * BN;
      const int row = accumulator_row(lane), column = accumulator_column(lane);
      const auto value = [&](int c, int h, int i) {
        if constexpr (kWarpPartials == 2) {
          const float pair[2] = {acc[0][c][h][i], acc[1][c][h][i]};
          return device::tree_sum(pair);
        } else {
          return acc[0][c][h][i];
        }
      };
#pragma unroll
      for (int c = 0; c < N_FRAGS; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* at = mine + row * BN + 16 * c + 8 * h + column;
          *reinterpret_cast<float2*>(at) = make_float2(value(c, h, 0), value(c, h, 1));
          *reinterpret_cast<float2*>(at + 8 * BN) = make_float2(value(c, h, 2), value(c, h, 3));
        }
    }
  } else {
    if constexpr (kSplitPartials) {
      // Warp w: partial w % 2 of slice w / 2, i.e. the slice's tiles w % 2, w % 2 + 2, ... chained into one
      // accumulator from zero, in order: exactly the chain that partial keeps in the 4-warp loop below.
      const int slice = warp / 2, part = warp % 2;
      const int k_begin = slice * tiles_per_slice * 16;
      const int k_end = min(K, k_begin + tiles_per_slice * 16);
#pragma unroll
      for (int f = 0; f < M_FRAGS; ++f)
#pragma unroll
        for (int c = 0; c < N_FRAGS; ++c)
          wmma::fill_fragment(total[f][c], 0.0f);
      const auto into_total = [&](int f, int c) -> Acc& { return total[f][c]; };
      constexpr int kLoadsInFlight = 4; // this warp's next tiles, 32 apart in K
      int k = k_begin + 16 * part;
      for (; k + 32 * (kLoadsInFlight - 1) < k_end; k += 32 * kLoadsInFlight) {
        WTile b[kLoadsInFlight];
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u)
          load_w(b[u], k + 32 * u, 0);
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u)
          mma_tile(b[u], k + 32 * u, 0, into_total);
      }
      for (; k < k_end; k += 32) {
        WTile b;
        load_w(b, k, 0);
        mma_tile(b, k, 0, into_total);
      }
    } else {
      const int first_slice = N_WARPS == 1 ? warp : 0, last_slice = N_WARPS == 1 ? warp + 1 : kKSlices;
      for (int slice = first_slice; slice < last_slice; ++slice) {
        const int k_begin = slice * tiles_per_slice * 16;
        const int k_end = min(K, k_begin + tiles_per_slice * 16);
        // kPartials independent accumulators per row fragment (tile j of the slice goes to partial j %
        // kPartials), added in a fixed tree at the end of the slice: the tensor-core chain of a slice is
        // kPartials times shorter than one accumulator's, and the sum order is a function of K alone (batch
        // invariance).
        Acc acc[M_FRAGS][N_FRAGS][kPartials];
#pragma unroll
        for (int f = 0; f < M_FRAGS; ++f)
#pragma unroll
          for (int c = 0; c < N_FRAGS; ++c)
#pragma unroll
            for (int p = 0; p < kPartials; ++p)
              wmma::fill_fragment(acc[f][c][p], 0.0f);
        // W streams from global memory: issue kLoadsInFlight tiles' loads before their MMAs (latency hiding).
        constexpr int kLoadsInFlight = (N_WARPS == 4 && M_FRAGS == 1) ? 8 : 4;
        static_assert(kLoadsInFlight % kPartials == 0, "a load group starts at partial 0");
        int kk = k_begin;
        // Tile u of the load group at kk goes into partial u % kPartials.
        const auto into_partial = [&](int u) {
          return [&acc, u](int f, int c) -> Acc& { return acc[f][c][u % kPartials]; };
        };
        for (; kk + 16 * kLoadsInFlight <= k_end; kk += 16 * kLoadsInFlight) {
          WTile b[kLoadsInFlight];
#pragma unroll
          for (int u = 0; u < kLoadsInFlight; ++u)
            load_w(b[u], kk, 16 * u);
#pragma unroll
          for (int u = 0; u < kLoadsInFlight; ++u)
            mma_tile(b[u], kk, 16 * u, into_partial(u));
        }
        // The last tiles (fewer than a load group; the group's first goes to partial 0).
#pragma unroll
        for (int u = 0; u < kLoadsInFlight - 1; ++u) {
          if (kk + 16 * u < k_end) {
            WTile b;
            load_w(b, kk, 16 * u);
            mma_tile(b, kk, 16 * u, into_partial(u));
          }
        }
#pragma unroll
        for (int f = 0; f < M_FRAGS; ++f) {
#pragma unroll
          for (int c = 0; c < N_FRAGS; ++c) {
#pragma unroll
            for (int i = 0; i < acc[f][c][0].num_elements; ++i) {
              float partial[kPartials];
#pragma unroll
              for (int p = 0; p < kPartials; ++p)
                partial[p] = acc[f][c][p].x[i];
              const float slice_sum = device::tree_sum(partial);
              total[f][c].x[i] = slice == first_slice ? slice_sum : total[f][c].x[i] + slice_sum;
            }
          }
        }
      }
    }
    // Narrow: slice w (or, with 8 warps, partial w % 2 of slice w / 2) lands in stage[w]; wide: the finished
    // columns of warp w land in stage[0].
    const int stage_index = N_WARPS == 1 ? warp : 0;
#pragma unroll
    for (int f = 0; f < M_FRAGS; ++f)
#pragma unroll
      for (int c = 0; c < N_FRAGS; ++c)
        wmma::store_matrix_sync(stage + static_cast<size_t>(stage_index) * BM * BN + f * 16 * BN +
                                    (wn * N_FRAGS + c) * 16,
                                total[f][c], BN, wmma::mem_row_major);
  }
  __syncthreads();
  // An element of the finished tile: the K slices' sums added in slice order (((s0 + s1) + s2) + s3), read
  // where the epilogue needs them (no second pass and barrier over the tile).
  // With a warp per partial, a slice's sum is its two partials' tiles added first (p0 + p1, as tree_sum adds
  // them in the 4-warp loop).
  const auto tile_value = [&](int e) {
    if constexpr (kSplitPartials) {
      float sum = stage[e] + stage[BM * BN + e];
#pragma unroll
      for (int s = 1; s < kKSlices; ++s)
        sum += stage[(2 * s) * BM * BN + e] + stage[(2 * s + 1) * BM * BN + e];
      return sum;
    } else {
      float sum = stage[e];
#pragma unroll
      for (int s = 1; s < STAGES; ++s)
        sum += stage[s * BM * BN + e];
      return sum;
    }
  };

  // Epilogue over the finished [BM, BN] tile (unrolled only where the prefetched residual sits in registers).
#pragma unroll(kPrefetchResidual ? kEpiloguePerThread : 1)
  for (int i = 0; i < kEpiloguePerThread; ++i) {
    const int e = threadIdx.x + i * THREADS;
    const int m = e / BN, n = e % BN, t = m0 + m, col = n0 + n;
    if (t >= T)
      continue;
    const float value = tile_value(e);
    if constexpr (EPILOGUE == static_cast<int>(GemmEpilogue::kResidualAdd)) {
      float* residual = a.residual + static_cast<size_t>(t) * N + col;
      if constexpr (kPrefetchResidual)
        *residual = residual_early[i] + value; // loaded before or right after the wait
      else
        *residual += value;
    } else if constexpr (EPILOGUE == static_cast<int>(GemmEpilogue::kLogits)) {
      if (col >= a.logits_cols || !row_live[m])
        continue;
      const size_t index =
          static_cast<size_t>(detail::strided_token_index(t, a.tokens_per_row, a.io_row_stride)) *
              a.logits_cols +
          col;
      if (a.logits_dtype == DType::kFloat32)
        static_cast<float*>(a.logits)[index] = value;
      else
        static_cast<uint16_t*>(a.logits)[index] = float_to_bf16_bits(value);
    } else if constexpr (EPILOGUE == static_cast<int>(GemmEpilogue::kSwiGlu)) {
      const int within = col % (2 * kSwiGluGroup);
      if (within >= kSwiGluGroup)
        continue; // the up half: its gate partner writes the output
      store_swiglu(a.out_bf16, N / 2, t, col, value, tile_value(e + kSwiGluGroup));
    } else { // kQkvRope
      float out = value;
      if (!(col >= a.q_dim + a.kv_dim)) { // q and k columns rotate; v does not
        const int d = rope_dim(a, col);
        const float partner = tile_value(e ^ 1);
        float s, c;
        if constexpr (kRopeTable) {
          const float2 sc = rope_table[m * (BN / 2) + n / 2];
          s = sc.x;
          c = sc.y;
        } else {
          const float angle = static_cast<float>(row_position[m]) * rope_freq[d / 2];
          sincosf(angle, &s, &c);
        }
        out = rope_rotate(value, partner, d, s, c);
      }
      store_qkv(a, t, col, float_to_bf16_bits(out), row_live[m], row_slot[m]);
    }
  }
}

/// The pipelined kernel's per-row epilogue inputs (QKV: position, KV slot, live; the RoPE frequencies). They
/// are not written by the forward's kernels, so, as in LlamaGemmKernel, they are read before the PDL wait.
struct QkvRows {
  int position[kMaxBlockRows], slot[kMaxBlockRows];
  unsigned char live[kMaxBlockRows];
  float rope_freq[kLlamaMaxHeadDim / 2];

  __device__ __forceinline__ void load(const GemmArgs& a, int m0, int rows) {
    if (threadIdx.x < rows && m0 + static_cast<int>(threadIdx.x) < a.tokens) {
      const int t = m0 + threadIdx.x;
      live[threadIdx.x] = a.live[t / a.tokens_per_row];
      const int64_t io = detail::strided_token_index(t, a.tokens_per_row, a.io_row_stride);
      position[threadIdx.x] = a.positions[io];
      slot[threadIdx.x] = a.out_slots[io];
    }
    if (threadIdx.x < a.head_dim / 2)
      rope_freq[threadIdx.x] = a.inv_freq[threadIdx.x];
  }
};

/// The pipelined kernel's epilogue over its finished [BM, BN] tile at (m0, n0) in `tile`: the arithmetic of
/// LlamaGemmKernel's epilogue (the same bits), which keeps its own copy (sharing this function changed its
/// generated code and cost a decode forward 7-9 us on an H100). The residual add loads every element of the
/// thread before its first store: a load after a store the compiler cannot tell apart from it waits for it.
template <int EPILOGUE, int BM, int BN>
__device__ __forceinline__ void pipelined_epilogue(const GemmArgs& a, const float* tile, int m0, int n0,
                                                   const QkvRows& rows) {
  constexpr int kPerThread = BM * BN / kThreads;
  static_assert(BM * BN % kThreads == 0, "the epilogue gives every thread the same number of elements");
  constexpr bool kResidual = EPILOGUE == static_cast<int>(GemmEpilogue::kResidualAdd);
  const int T = a.tokens, N = a.n;
  float residual[kResidual ? kPerThread : 1];
  if constexpr (kResidual) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int e = threadIdx.x + i * kThreads, t = m0 + e / BN;
      residual[i] = t < T ? a.residual[static_cast<size_t>(t) * N + n0 + e % BN] : 0.0f;
    }
  }
#pragma unroll(kResidual ? kPerThread : 1)
  for (int i = 0; i < kPerThread; ++i) {
    const int e = threadIdx.x + i * kThreads;
    const int m = e / BN, n = e % BN, t = m0 + m, col = n0 + n;
    if (t >= T)
      continue;
    const float value = tile[e];
    if constexpr (kResidual) {
      a.residual[static_cast<size_t>(t) * N + col] = residual[i] + value;
    } else if constexpr (EPILOGUE == static_cast<int>(GemmEpilogue::kSwiGlu)) {
      const int within = col % (2 * kSwiGluGroup);
      if (within >= kSwiGluGroup)
        continue; // the up half: its gate partner writes the output
      store_swiglu(a.out_bf16, N / 2, t, col, value, tile[e + kSwiGluGroup]);
    } else { // kQkvRope
      static_assert(EPILOGUE == static_cast<int>(GemmEpilogue::kQkvRope), "QKV, residual add or SwiGLU");
      float out = value;
      if (!(col >= a.q_dim + a.kv_dim)) { // q and k columns rotate; v does not
        const int d = rope_dim(a, col);
        float s, c;
        sincosf(static_cast<float>(rows.position[m]) * rows.rope_freq[d / 2], &s, &c);
        out = rope_rotate(value, tile[e ^ 1], d, s, c);
      }
      store_qkv(a, t, col, float_to_bf16_bits(out), rows.live[m], rows.slot[m]);
    }
  }
}

/// The pipelined tiles (GemmTiles::kPipelined): a block computes a [BM, BN] tile (BM, BN in {32, 64}) with
/// four warps in a 2 x 2 grid, each a [BM / 2, BN / 2] warp tile of m16n8k16 tensor-core steps, over K in
/// chunks of kPipeBK streamed by cp.async through kPipeStages shared-memory stages (the first chunks' weights
/// issued before the PDL wait). A comes as bf16 rows: the O / down input, or the rows an RMSNorm kernel wrote
/// for x into GemmArgs::a_bf16 with the prologue's arithmetic (rms_norm_rows).
///
/// The same bits as the narrow and wide tiles: each 16-wide K tile is one m16n8k16 bf16 step per 8 output
/// columns, the instruction the narrow / wide kernels' wmma 16 x 16 x 16 step issues twice
/// (HMMA.16816.F32.BF16 on sm_90), and the tiles are summed in their order: K cut into 4 slices of ceil(K /
/// 16 / 4) tiles, tile j of a slice into partial j % 2, a slice's sum partial 0 + partial 1, and the output
/// ((s0 + s1) + s2) + s3 (an empty slice adds +0, as the narrow kernel's idle warp does). Here the two
/// partials and the running total are three accumulator sets, folded at each slice boundary.
constexpr int kPipeBK = 64;
constexpr int kPipeStages = 4;
constexpr int kPipeLd = kPipeBK + 8; // bf16 a staged row: 144 bytes, so ldmatrix's 8 rows hit 8 bank groups

size_t pipe_smem_bytes(int bm, int bn) {
  return std::max(static_cast<size_t>(kPipeStages) * (bm + bn) * kPipeLd * sizeof(uint16_t),
                  static_cast<size_t>(bm) * bn * sizeof(float));
}

template <int EPILOGUE, int BM, int BN>
__global__ void __launch_bounds__(kThreads) LlamaPipelinedGemmKernel(const GemmArgs a) {
  static_assert((BM == 32 || BM == 64) && (BN == 32 || BN == 64), "32- or 64-wide tiles");
  constexpr int MF = BM / 32;              // m16 fragments of a warp tile
  constexpr int NF = BN / 16;              // n8 fragments of a warp tile
  constexpr int kRowVectors = kPipeBK / 8; // 16-byte vectors of a staged chunk row
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* s_a = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* s_w = s_a + kPipeStages * BM * kPipeLd;
  const int K = a.k, T = a.tokens;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / 2, wn = warp % 2;
  const int k_tiles = K / 16, chunks = (K + kPipeBK - 1) / kPipeBK;
  const uint16_t* a_rows = a.a_bf16 + static_cast<size_t>(m0) * K;
  const uint16_t* w_rows = a.weight + static_cast<size_t>(n0) * K;
  const int valid_rows = min(BM, T - m0);
  // Copy slots of this thread, the same in every chunk: column copy_col of rows copy_row + 16 i (16-byte
  // vectors; a chunk row is kRowVectors of them). Past K (a last, partial chunk) and past T (A's padding
  // rows) the stage gets zeros.
  constexpr int kRowsPerPass = kThreads / kRowVectors;
  static_assert(BM % kRowsPerPass == 0 && BN % kRowsPerPass == 0, "whole copy passes");
  const int copy_row = threadIdx.x / kRowVectors, copy_col = (threadIdx.x % kRowVectors) * 8;
  const int copy_dst = copy_row * kPipeLd + copy_col;
  const uint16_t* w_src = w_rows + static_cast<size_t>(copy_row) * K + copy_col;
  const uint16_t* a_src = a_rows + static_cast<size_t>(copy_row) * K + copy_col;
  const auto load_w = [&](int stage, int chunk) {
    const int k0 = chunk * kPipeBK;
    const bool in_k = k0 + copy_col < K;
    __nv_bfloat16* dst = s_w + stage * BN * kPipeLd + copy_dst;
#pragma unroll
    for (int i = 0; i < BN / kRowsPerPass; ++i) {
      if (in_k)
        __pipeline_memcpy_async(dst + i * kRowsPerPass * kPipeLd,
                                w_src + static_cast<size_t>(i) * kRowsPerPass * K + k0, 16);
      else
        *reinterpret_cast<uint4*>(dst + i * kRowsPerPass * kPipeLd) = make_uint4(0u, 0u, 0u, 0u);
    }
  };
  const auto load_a = [&](int stage, int chunk) {
    const int k0 = chunk * kPipeBK;
    const bool in_k = k0 + copy_col < K;
    __nv_bfloat16* dst = s_a + stage * BM * kPipeLd + copy_dst;
#pragma unroll
    for (int i = 0; i < BM / kRowsPerPass; ++i) {
      if (in_k && copy_row + i * kRowsPerPass < valid_rows)
        __pipeline_memcpy_async(dst + i * kRowsPerPass * kPipeLd,
                                a_src + static_cast<size_t>(i) * kRowsPerPass * K + k0, 16);
      else
        *reinterpret_cast<uint4*>(dst + i * kRowsPerPass * kPipeLd) = make_uint4(0u, 0u, 0u, 0u);
    }
  };
  if (a.trigger_early) // as in LlamaGemmKernel
    pdl_trigger();
  // The weights of the first stages before waiting (one commit group), then the epilogue's row inputs.
  for (int s = 0; s < kPipeStages - 1 && s < chunks; ++s)
    load_w(s, s);
  __pipeline_commit();
  __shared__ QkvRows rows;
  if constexpr (EPILOGUE == static_cast<int>(GemmEpilogue::kQkvRope))
    rows.load(a, m0, BM);
  pdl_wait_then_trigger(a.trigger_early);
  for (int s = 0; s < kPipeStages - 1; ++s) {
    if (s < chunks)
      load_a(s, s);
    __pipeline_commit();
  }

  float partial0[MF][NF][4], partial1[MF][NF][4], total[MF][NF][4];
  const auto clear = [](float(&acc)[MF][NF][4]) {
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
      for (int g = 0; g < NF; ++g)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          acc[f][g][i] = 0.0f;
  };
  clear(partial0);
  clear(partial1);
  clear(total);
  constexpr int kSlices = kKSlices; // the narrow kernel's K split
  const int tiles_per_slice = (k_tiles + kSlices - 1) / kSlices;
  int slice = 0, in_slice = 0;
  // Lane addresses of ldmatrix (mma.cuh): the W rows of two adjacent n8 fragments are a B pair.
  // (Written out, not through the helpers: those gave this kernel's SASS another instruction order.)
  const int a_row = wm * (BM / 2) + lane % 16, a_col = (lane / 16) * 8;
  const int w_row = wn * (BN / 2) + lane % 8 + (lane / 16) * 8, w_col = ((lane / 8) % 2) * 8;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    __pipeline_wait_prior(kPipeStages - 2);
    __syncthreads();
    const int next = chunk + kPipeStages - 1;
    if (next < chunks) {
      load_w(next % kPipeStages, next);
      load_a(next % kPipeStages, next);
    }
    __pipeline_commit();
    const __nv_bfloat16* sa = s_a + (chunk % kPipeStages) * BM * kPipeLd;
    const __nv_bfloat16* sw = s_w + (chunk % kPipeStages) * BN * kPipeLd;
#pragma unroll
    for (int u = 0; u < kPipeBK / 16; ++u) {
      if (chunk * (kPipeBK / 16) + u >= k_tiles)
        break;
      uint32_t a_frag[MF][4], w_frag[NF / 2][4];
#pragma unroll
      for (int f = 0; f < MF; ++f)
        ldmatrix_x4(a_frag[f], sa + (a_row + 16 * f) * kPipeLd + 16 * u + a_col);
#pragma unroll
      for (int g = 0; g < NF / 2; ++g)
        ldmatrix_x4(w_frag[g], sw + (w_row + 16 * g) * kPipeLd + 16 * u + w_col);
      const auto step = [&](float(&acc)[MF][NF][4]) {
#pragma unroll
        for (int f = 0; f < MF; ++f)
#pragma unroll
          for (int g = 0; g < NF; ++g)
            mma_16816(acc[f][g], a_frag[f], w_frag[g / 2][2 * (g % 2)], w_frag[g / 2][2 * (g % 2) + 1]);
      };
      if (in_slice % 2 == 0)
        step(partial0);
      else
        step(partial1);
      if (++in_slice == tiles_per_slice || chunk * (kPipeBK / 16) + u == k_tiles - 1) {
#pragma unroll
        for (int f = 0; f < MF; ++f)
#pragma unroll
          for (int g = 0; g < NF; ++g)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float pair[2] = {partial0[f][g][i], partial1[f][g][i]};
              const float slice_sum = device::tree_sum(pair);
              total[f][g][i] = slice == 0 ? slice_sum : total[f][g][i] + slice_sum;
            }
        clear(partial0);
        clear(partial1);
        ++slice;
        in_slice = 0;
      }
    }
  }
  // Empty slices (K of fewer than 4 slices' tiles) add +0, as the narrow kernel's idle warps do.
  for (; slice < kSlices; ++slice)
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
      for (int g = 0; g < NF; ++g)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          total[f][g][i] = total[f][g][i] + 0.0f;

  // The finished tile into shared memory (over the stages, now idle), then the epilogue.
  __pipeline_wait_prior(0);
  __syncthreads();
  float* stage = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int f = 0; f < MF; ++f)
#pragma unroll
    for (int g = 0; g < NF; ++g) {
      const int m = wm * (BM / 2) + 16 * f + accumulator_row(lane),
                n = wn * (BN / 2) + 8 * g + accumulator_column(lane);
      *reinterpret_cast<float2*>(stage + m * BN + n) = make_float2(total[f][g][0], total[f][g][1]);
      *reinterpret_cast<float2*>(stage + (m + 8) * BN + n) = make_float2(total[f][g][2], total[f][g][3]);
    }
  __syncthreads();
  pipelined_epilogue<EPILOGUE, BM, BN>(a, stage, m0, n0, rows);
}

/// Static shared memory of the kernel, rounded up for alignment: the epilogue's per-row inputs, the RoPE
/// frequencies and the narrow QKV tile's rotations.
constexpr int kStaticSmemBytes = 2048;
static_assert(kMaxBlockRows * (2 * sizeof(int) + 1) + kLlamaMaxHeadDim / 2 * sizeof(float) +
                      16 * 16 / 2 * sizeof(float2) + 128 <=
                  kStaticSmemBytes,
              "the static shared memory must fit its reserve");

/// Dynamic shared memory a block of the current device may opt in to next to the static part (cached per
/// device).
int max_optin_smem() {
  return current_device_info().shared_memory_optin_bytes - kStaticSmemBytes;
}

template <int EPILOGUE, int M_FRAGS, int N_WARPS, int N_FRAGS = 1, int WARPS = kWarps>
void launch_variant(const GemmArgs& a, cudaStream_t stream) {
  constexpr int BM = 16 * M_FRAGS, BN = 16 * N_WARPS * N_FRAGS;
  const bool wide = N_WARPS == 4;
  const bool stage_w =
      !wide && smem_bytes(M_FRAGS, false, a.k, true, N_FRAGS, WARPS) <= static_cast<size_t>(max_optin_smem());
  const dim3 grid(static_cast<unsigned>(a.n / BN), static_cast<unsigned>(detail::ceil_div(a.tokens, BM)));
  launch_pdl_streaming(LlamaGemmKernel<EPILOGUE, M_FRAGS, N_WARPS, N_FRAGS, WARPS>, grid, dim3(32 * WARPS),
                       smem_bytes(M_FRAGS, wide, a.k, stage_w, N_FRAGS, WARPS), weight_range(a), stream, a,
                       stage_w);
}

/// Narrow tiles (one row fragment, one column warp with one column fragment, or two for `paired`; 8 warps
/// for `split`, else 4); wide ones (four column warps) with `m_frags` row fragments.
template <int EPILOGUE>
void launch_epilogue(int m_frags, bool wide, bool paired, bool split, const GemmArgs& a,
                     cudaStream_t stream) {
  if constexpr (EPILOGUE == static_cast<int>(GemmEpilogue::kSwiGlu)) {
    if (!wide && paired)
      return split ? launch_variant<EPILOGUE, 1, 1, 2, kNarrowSplitWarps>(a, stream)
                   : launch_variant<EPILOGUE, 1, 1, 2>(a, stream);
  }
  if (!wide)
    return split ? launch_variant<EPILOGUE, 1, 1, 1, kNarrowSplitWarps>(a, stream)
                 : launch_variant<EPILOGUE, 1, 1>(a, stream);
  switch (m_frags) {
  case 1:
    return launch_variant<EPILOGUE, 1, 4>(a, stream);
  case 2:
    return launch_variant<EPILOGUE, 2, 4>(a, stream);
  default:
    return launch_variant<EPILOGUE, 4, 4>(a, stream);
  }
}

template <int EPILOGUE, int BM, int BN> void launch_pipelined(const GemmArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.n / BN), static_cast<unsigned>(detail::ceil_div(a.tokens, BM)));
  launch_pdl_streaming(LlamaPipelinedGemmKernel<EPILOGUE, BM, BN>, grid, dim3(kThreads),
                       pipe_smem_bytes(BM, BN), weight_range(a), stream, a);
}

template <int EPILOGUE>
void launch_pipelined_epilogue(int bm, int bn, const GemmArgs& a, cudaStream_t stream) {
  if (bm == 64)
    return bn == 64 ? launch_pipelined<EPILOGUE, 64, 64>(a, stream)
                    : launch_pipelined<EPILOGUE, 64, 32>(a, stream);
  return bn == 64 ? launch_pipelined<EPILOGUE, 32, 64>(a, stream)
                  : launch_pipelined<EPILOGUE, 32, 32>(a, stream);
}

/// The pipelined tile shape for T tokens and N columns (N a multiple of 32): the largest of 64 x 64, 64 x 32,
/// 32 x 64 whose grid covers every SM, else 32 x 32 (the most blocks).
void pipelined_tile(int tokens, int n, int& bm, int& bn) {
  const int multiprocessors = current_device_info().multiprocessors;
  for (const auto& [m, c] : {std::pair{64, 64}, std::pair{64, 32}, std::pair{32, 64}}) {
    if (n % c == 0 && static_cast<int64_t>(n / c) * detail::ceil_div(tokens, m) >= multiprocessors) {
      bm = m;
      bn = c;
      return;
    }
  }
  bm = 32;
  bn = 32;
}

template <class Kernel> void set_smem_limit(Kernel kernel, size_t bytes) {
  detail::prepare_forward_kernel(kernel, std::min(bytes, static_cast<size_t>(max_optin_smem())));
}

template <int EPILOGUE> void set_smem_limits(int max_k) {
  set_smem_limit(LlamaGemmKernel<EPILOGUE, 1, 1, 1>, smem_bytes(1, false, max_k, true));
  set_smem_limit(LlamaGemmKernel<EPILOGUE, 1, 1, 1, kNarrowSplitWarps>,
                 smem_bytes(1, false, max_k, true, 1, kNarrowSplitWarps));
  if constexpr (EPILOGUE == static_cast<int>(GemmEpilogue::kSwiGlu)) {
    set_smem_limit(LlamaGemmKernel<EPILOGUE, 1, 1, 2>, smem_bytes(1, false, max_k, true, 2));
    set_smem_limit(LlamaGemmKernel<EPILOGUE, 1, 1, 2, kNarrowSplitWarps>,
                   smem_bytes(1, false, max_k, true, 2, kNarrowSplitWarps));
  }
  set_smem_limit(LlamaGemmKernel<EPILOGUE, 1, 4, 1>, smem_bytes(1, true, max_k, false));
  set_smem_limit(LlamaGemmKernel<EPILOGUE, 2, 4, 1>, smem_bytes(2, true, max_k, false));
  set_smem_limit(LlamaGemmKernel<EPILOGUE, 4, 4, 1>, smem_bytes(4, true, max_k, false));
  if constexpr (EPILOGUE != static_cast<int>(GemmEpilogue::kLogits)) {
    set_smem_limit(LlamaPipelinedGemmKernel<EPILOGUE, 64, 64>, pipe_smem_bytes(64, 64));
    set_smem_limit(LlamaPipelinedGemmKernel<EPILOGUE, 64, 32>, pipe_smem_bytes(64, 32));
    set_smem_limit(LlamaPipelinedGemmKernel<EPILOGUE, 32, 64>, pipe_smem_bytes(32, 64));
    set_smem_limit(LlamaPipelinedGemmKernel<EPILOGUE, 32, 32>, pipe_smem_bytes(32, 32));
  }
}

} // namespace

void prepare_gemm(int max_k) {
  require(max_k >= 16 && max_k % 16 == 0, "llama::prepare_gemm", "max_k", max_k,
          "must be a positive multiple of 16");
  require(smem_bytes(1, true, max_k, false) <= static_cast<size_t>(max_optin_smem()), "llama::prepare_gemm",
          "max_k", max_k, "needs more shared memory than the device offers");
  set_smem_limits<0>(max_k);
  set_smem_limits<1>(max_k);
  set_smem_limits<2>(max_k);
  set_smem_limits<3>(max_k);
}

bool pipelined_tiles(GemmEpilogue epilogue, const GemmArgs& a) {
  const bool serves = epilogue != GemmEpilogue::kLogits && a.n % 32 == 0 && a.k % 16 == 0 && a.k >= 16 &&
                      pipe_smem_bytes(64, 64) <= static_cast<size_t>(max_optin_smem());
  require(a.tiles != GemmTiles::kPipelined || serves, "llama::gemm", "tiles", "kPipelined",
          "serves kQkvRope, kResidualAdd and kSwiGlu with n a multiple of 32");
  if (!serves || a.tiles == GemmTiles::kNarrowWide)
    return false;
  return a.tiles == GemmTiles::kPipelined ||
         a.tokens >= (epilogue == GemmEpilogue::kSwiGlu ? kPipelinedMinTokensGateUp : kPipelinedMinTokens);
}

namespace {

/// gemm_epilogue_fp32's kernel: block row blockIdx.y is row `first + blockIdx.y` (y's row blockIdx.y), and a
/// thread takes one pair of its columns: a RoPE pair (2p, 2p + 1), whose rotation shares one sincosf, or a
/// SwiGLU gate column and its up partner kSwiGluGroup further on.
__global__ void LlamaGemmEpilogueFp32Kernel(const GemmArgs a, int first, const float* y, bool swiglu) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= a.n / 2)
    return;
  const int t = first + static_cast<int>(blockIdx.y);
  const float* row = y + static_cast<size_t>(blockIdx.y) * a.n;
  if (swiglu) {
    const int col = (p / kSwiGluGroup) * 2 * kSwiGluGroup + p % kSwiGluGroup;
    store_swiglu(a.out_bf16, a.n / 2, t, col, row[col], row[col + kSwiGluGroup]);
    return;
  }
  const int col = 2 * p; // n, q_dim, kv_dim and head_dim are even: the pair never straddles q / k / v
  const float2 pair = reinterpret_cast<const float2*>(row)[p];
  const int64_t io = detail::strided_token_index(t, a.tokens_per_row, a.io_row_stride);
  float out0 = pair.x, out1 = pair.y;
  if (col < a.q_dim + a.kv_dim) { // q and k rotate; v does not
    const int d = rope_dim(a, col);
    float s, c;
    sincosf(static_cast<float>(a.positions[io]) * a.inv_freq[d / 2], &s, &c);
    out0 = rope_rotate(pair.x, pair.y, d, s, c);
    out1 = rope_rotate(pair.y, pair.x, d + 1, s, c);
  }
  const unsigned char live = a.live[t / a.tokens_per_row];
  const int slot = a.out_slots[io];
  store_qkv(a, t, col, float_to_bf16_bits(out0), live, slot);
  store_qkv(a, t, col + 1, float_to_bf16_bits(out1), live, slot);
}

} // namespace

void gemm_epilogue_fp32(GemmEpilogue epilogue, const GemmArgs& a, int first, int tokens, const float* y,
                        cudaStream_t stream) {
  require(epilogue == GemmEpilogue::kQkvRope || epilogue == GemmEpilogue::kSwiGlu,
          "llama::gemm_epilogue_fp32", "epilogue", static_cast<int>(epilogue), "must be kQkvRope or kSwiGlu");
  if (tokens <= 0)
    return;
  require(a.n % 2 == 0, "llama::gemm_epilogue_fp32", "n", a.n, "must be even");
  require(tokens <= 65535, "llama::gemm_epilogue_fp32", "tokens", tokens,
          "must be <= 65535 (a grid row each)");
  constexpr int kThreadsPerBlock = 128;
  const dim3 grid(static_cast<unsigned>(detail::ceil_div(a.n / 2, kThreadsPerBlock)),
                  static_cast<unsigned>(tokens));
  LlamaGemmEpilogueFp32Kernel<<<grid, kThreadsPerBlock, 0, stream>>>(a, first, y,
                                                                     epilogue == GemmEpilogue::kSwiGlu);
  SMCGRAPH_CUDA_CHECK(cudaGetLastError());
}

void gemm(GemmEpilogue epilogue, const GemmArgs& a, cudaStream_t stream) {
  constexpr const char* kWhere = "llama::gemm";
  require(a.tokens >= 0, kWhere, "tokens", a.tokens, "must be >= 0");
  require(a.n >= 16 && a.n % 16 == 0, kWhere, "n", a.n, "must be a positive multiple of 16");
  require(a.k >= 16 && a.k % 16 == 0, kWhere, "k", a.k, "must be a positive multiple of 16");
  require(a.weight != nullptr, kWhere, "weight", "null", "must be a device pointer");
  require(a.narrow_warps == 0 || a.narrow_warps == kWarps || a.narrow_warps == kNarrowSplitWarps, kWhere,
          "narrow_warps", static_cast<int>(a.narrow_warps), "must be 0 (by size), 4 or 8");
  if (a.tokens == 0)
    return;
  if (epilogue == GemmEpilogue::kResidualAdd) {
    require(a.a_bf16 != nullptr && a.residual != nullptr, kWhere, "a_bf16 / residual", "null", "must be set");
    require(reinterpret_cast<uintptr_t>(a.a_bf16) % 16 == 0, kWhere, "a_bf16", "misaligned",
            "must be 16-byte aligned (cp.async)");
  } else {
    require(a.x != nullptr && a.norm_weight != nullptr, kWhere, "x / norm_weight", "null", "must be set");
    require(a.k <= kMaxNormK, kWhere, "k", a.k,
            "must be <= 1024 for an RMSNorm prologue (a row is held in registers)");
    require(reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
                reinterpret_cast<uintptr_t>(a.norm_weight) % 16 == 0,
            kWhere, "x / norm_weight", "misaligned", "must be 16-byte aligned (float4 loads)");
    require(a.x_row_stride == 0 || (a.x_row_stride >= a.k && a.x_row_stride % 4 == 0), kWhere, "x_row_stride",
            a.x_row_stride, "must be 0 (dense) or a multiple of 4 that is >= k");
  }
  if (epilogue == GemmEpilogue::kQkvRope) {
    require(a.head_dim <= kLlamaMaxHeadDim, kWhere, "head_dim", a.head_dim,
            "must be <= kLlamaMaxHeadDim (128)");
    require(a.head_dim % 2 == 0 && a.q_dim % a.head_dim == 0 && a.kv_dim % a.head_dim == 0 &&
                a.n == a.q_dim + 2 * a.kv_dim,
            kWhere, "n", a.n, "must equal q_dim + 2 kv_dim with head_dim dividing both");
  }
  if (epilogue == GemmEpilogue::kQkvRope || epilogue == GemmEpilogue::kLogits)
    require(a.io_row_stride >= a.tokens_per_row, kWhere, "io_row_stride", a.io_row_stride,
            "must be >= tokens_per_row (positions, out_slots and logits rows are read or written)");
  if (epilogue == GemmEpilogue::kLogits)
    require(a.logits != nullptr && a.logits_cols >= 1 && a.logits_cols <= a.n, kWhere, "logits_cols",
            a.logits_cols, "must be in [1, n] with logits set");
  if (epilogue == GemmEpilogue::kSwiGlu)
    require(a.n % (2 * kSwiGluGroup) == 0, kWhere, "n", a.n, "must be a multiple of 16 (gate/up groups)");
  if (pipelined_tiles(epilogue, a)) {
    require(a.a_bf16 != nullptr && reinterpret_cast<uintptr_t>(a.a_bf16) % 16 == 0, kWhere, "a_bf16",
            a.a_bf16 == nullptr ? "null" : "misaligned",
            "must be 16-byte aligned A rows on pipelined tiles (rms_norm_rows(x) for an RMSNorm epilogue)");
    int bm = 0, bn = 0;
    pipelined_tile(a.tokens, a.n, bm, bn);
    switch (epilogue) {
    case GemmEpilogue::kQkvRope:
      return launch_pipelined_epilogue<0>(bm, bn, a, stream);
    case GemmEpilogue::kResidualAdd:
      return launch_pipelined_epilogue<1>(bm, bn, a, stream);
    default:
      return launch_pipelined_epilogue<2>(bm, bn, a, stream);
    }
  }
  // The tiles, by the forward's token count T (bench/llama_gemm_bench and bucket_sweep on an H100, SmolLM2's
  // shapes): up to kNarrowMaxTokens, 16-row narrow tiles, ceil(T / 16) of them down each column block (their
  // weight tiles come from L2 after the first): at T = 40-320 they run the layer GEMMs 1.1-2.2x faster than
  // 64-row tiles, whose A rows (up to 197 KB for the down projection) leave one block per SM; beyond it, 64 x
  // 64 wide tiles (T = 512 and 1024-2560: 6-27% faster forwards than narrow). The LM head (N alone gives
  // every SM two blocks) always takes wide tiles with the fewest row fragments that cover T.
  const int multiprocessors = current_device_info().multiprocessors;
  const bool wide = a.n % 64 == 0 && (a.tokens > kNarrowMaxTokens || a.n / 64 >= 2 * multiprocessors);
  int m_frags = !wide ? 1 : a.tokens <= 16 ? 1 : a.tokens <= 32 ? 2 : 4;
  while (m_frags > 1 && smem_bytes(m_frags, wide, a.k, false) > static_cast<size_t>(max_optin_smem()))
    m_frags /= 2;
  require(smem_bytes(m_frags, wide, a.k, false) <= static_cast<size_t>(max_optin_smem()), kWhere, "k", a.k,
          "needs more shared memory than the device offers");
  // Narrow blocks of 8 warps (GemmArgs::narrow_warps; by size up to kNarrowSplitMaxTokens tokens), and paired
  // column fragments (gate/up only, from kPairedColumnsMinTokens; kPairedSplitMinTokens in 8-warp blocks):
  // the same sums in the same order.
  const bool split =
      a.narrow_warps == kNarrowSplitWarps || (a.narrow_warps == 0 && a.tokens <= kNarrowSplitMaxTokens);
  const bool paired =
      !wide && a.n % 32 == 0 && a.tokens >= (split ? kPairedSplitMinTokens : kPairedColumnsMinTokens);
  switch (epilogue) {
  case GemmEpilogue::kQkvRope:
    return launch_epilogue<0>(m_frags, wide, false, split, a, stream);
  case GemmEpilogue::kResidualAdd:
    return launch_epilogue<1>(m_frags, wide, false, split, a, stream);
  case GemmEpilogue::kSwiGlu:
    return launch_epilogue<2>(m_frags, wide, paired, split, a, stream);
  case GemmEpilogue::kLogits:
    return launch_epilogue<3>(m_frags, wide, false, split, a, stream);
  }
}

} // namespace smcgraph::llama
