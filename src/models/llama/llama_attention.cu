// Grouped-query attention over the slot table (page size 1), for any number of query tokens per row: token j
// of row r attends to positions 0 .. min(p_j, seq_len - 1) of its row (its own block causally, since the
// block's KV was written first), reading each position's K and V through slot_table[r].
//
// One block per (row, token, query head), 8 warps. A token's positions are cut into chunks of
// kAttentionChunk = 32; warp w takes chunks w, w + 8, ... . A chunk is one warp pass: a lane per position
// loads the position's key (16-byte loads, to registers) and value (cp.async, to shared memory) at once, so a
// chunk costs one memory latency (the slot loads of the warp's first chunk, and its keys and values of
// positions older than the forward, are issued before the kernel waits for its predecessor, the slot loads
// of the next chunk during the current one); the scores' max and sum are warp
// reductions, and a lane per output dimension sums the weighted values from shared memory in position order.
// The warps merge their (max, sum, accumulator) in warp order in shared memory: no partials in global memory,
// no atomics. Nothing depends on the batch, so a token's output is the same in any batch.
#include <algorithm>
#include <cmath>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include "kernels/launch_checks.hpp"
#include "models/forward_layout.cuh"
#include "models/llama/bf16_rows.cuh"
#include "models/llama/llama_kernels.hpp"
#include "models/llama/pdl.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/llama_model.hpp"

namespace smcgraph::llama {
namespace {

constexpr int kThreads = 256; // 8 warps: a token's first 256 positions in one pass
constexpr int kWarps = kThreads / 32;
/// The largest head size of the attention kernel's small variant (SmolLM2's heads have 64 dimensions).
constexpr int kSmallHeadDim = 64;

__device__ __forceinline__ float bf16_low(uint32_t pair) {
  return __uint_as_float(pair << 16);
}
__device__ __forceinline__ float bf16_high(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

namespace cg = cooperative_groups;

/// The calling warp; warp reductions (cg::reduce) return their result to every lane.
__device__ __forceinline__ cg::thread_block_tile<32> warp_tile() {
  return cg::tiled_partition<32>(cg::this_thread_block());
}

/// fmaxf as a reduction operator (a NaN loses to a number, as in fmaxf).
struct FloatMax {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__device__ __forceinline__ int clamp_slot(int slot, int pool_size) {
  return (slot >= 0 && slot < pool_size) ? slot : 0;
}

/// Dynamic shared memory of a block: each warp's value rows (a chunk of head_dim-wide bf16 rows).
size_t attention_smem_bytes(int head_dim) {
  return static_cast<size_t>(kWarps) * kAttentionChunk * head_dim * sizeof(uint16_t);
}

// One block per (row, token, query head). Its warps take the token's chunks c = warp, warp + kWarps, ... and
// fold them in that order with an online softmax; the block then merges its warps' (m, l, acc) in warp order
// in shared memory. The chunk-to-warp map and both orders depend on the token's own length only, so its
// output is the same in any batch (batch invariance: a decode token equals the same token in a verify block).
template <int MAX_HEAD_DIM>
__global__ void __launch_bounds__(kThreads) LlamaAttentionKernel(const AttentionArgs a) {
  static_assert(kAttentionChunk == 32, "a chunk is one warp pass: a lane per position");
  static_assert(MAX_HEAD_DIM % 32 == 0 && MAX_HEAD_DIM <= kLlamaMaxHeadDim, "a lane holds whole dimensions");
  constexpr int kMaxDimsPerLane = MAX_HEAD_DIM / 32;
  constexpr int kMaxVectorsPerHead = MAX_HEAD_DIM / 8; // 16-byte loads of one key
  const int r = blockIdx.x, j = blockIdx.y, head = blockIdx.z;
  extern __shared__ __align__(16) unsigned char attention_smem[];
  __shared__ float q_shared[MAX_HEAD_DIM];
  __shared__ float p_shared[kWarps][kAttentionChunk];
  __shared__ float warp_acc[kWarps][MAX_HEAD_DIM];
  __shared__ float warp_ml[kWarps][2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hd = a.head_dim, q_dim = a.heads * hd, kv_dim = a.kv_heads * hd;
  const int kv_head = head / (a.heads / a.kv_heads);
  uint16_t* v_shared =
      reinterpret_cast<uint16_t*>(attention_smem) + static_cast<size_t>(warp) * kAttentionChunk * hd;
  // The row's live flag, length, the token's position and the slot table are the forward's inputs, not
  // written by its kernels: complete before the forward's first kernel passed its pdl_wait() (and this kernel
  // starts only after its predecessor's pdl_wait(), pdl.hpp), so they and the first chunk's slots are read
  // before waiting. Q and the KV of the row's own tokens (the QKV projection just wrote them) come after.
  const int t = r * a.tokens_per_row + j;
  const bool live = a.live[r];
  const int position = a.positions[detail::strided_token_index(t, a.tokens_per_row, a.io_row_stride)];
  const int length = min(min(position + 1, a.seq_lens[r]), a.max_seq_len);
  const int32_t* slots = a.slot_table + static_cast<size_t>(r) * a.max_seq_len;
  const int chunks = max(0, (length + kAttentionChunk - 1) / kAttentionChunk);
  int next_slot = 0;
  if (live && warp < chunks && warp * kAttentionChunk + lane < length)
    next_slot = clamp_slot(slots[warp * kAttentionChunk + lane], a.pool_size);
  // The warp's first chunk, for positions before the row's first token in this forward: their K and V were
  // written by earlier forwards (this forward's QKV projection writes the block's own positions only, at
  // freshly allocated slots), so they are loaded before waiting too, and a decode token's attention costs
  // one memory latency after the wait (q and the block's own positions), not two.
  uint4 key[kMaxVectorsPerHead];
  const int first_block_position =
      a.positions[detail::strided_token_index(r * a.tokens_per_row, a.tokens_per_row, a.io_row_stride)];
  const int early_position = warp * kAttentionChunk + lane;
  const bool early =
      live && warp < chunks && early_position < length && early_position < first_block_position;
  if (early) {
    const uint16_t* k_row = a.kv + static_cast<size_t>(next_slot) * 2 * kv_dim + kv_head * hd;
    for (int v = 0; v < hd / 8; ++v)
      __pipeline_memcpy_async(v_shared + lane * hd + v * 8, k_row + kv_dim + v * 8, 16);
#pragma unroll
    for (int v = 0; v < kMaxVectorsPerHead; ++v)
      if (v < hd / 8)
        key[v] = reinterpret_cast<const uint4*>(k_row)[v];
  }
  __pipeline_commit();
  pdl_wait();
  pdl_trigger();
  if (!live)
    return;
  uint16_t* out = a.out + static_cast<size_t>(t) * q_dim + head * hd;
  if (chunks == 0) { // a token that sees no position (bad positions): zeros
    for (int d = threadIdx.x; d < hd; d += kThreads)
      out[d] = 0;
    return;
  }
  const uint16_t* q = a.q + static_cast<size_t>(t) * q_dim + head * hd;
  for (int d = threadIdx.x; d < hd; d += kThreads)
    q_shared[d] = __uint_as_float(static_cast<uint32_t>(q[d]) << 16);
  __syncthreads();

  float m = -INFINITY, l = 0.0f, acc[kMaxDimsPerLane];
#pragma unroll
  for (int c = 0; c < kMaxDimsPerLane; ++c)
    acc[c] = 0.0f;
  for (int chunk = warp; chunk < chunks; chunk += kWarps) {
    // Lane i takes position begin + i: its value row goes straight to shared memory (cp.async) and its key
    // row to registers, so every load of the chunk is in flight at once (one memory latency a chunk).
    const int begin = chunk * kAttentionChunk, count = min(kAttentionChunk, length - begin);
    const bool valid = lane < count;
    const int slot = next_slot;
    const int following = begin + kWarps * kAttentionChunk + lane;
    if (following < length) // the warp's next chunk: its slot load overlaps this chunk
      next_slot = clamp_slot(slots[following], a.pool_size);
    const uint16_t* k_row = a.kv + static_cast<size_t>(slot) * 2 * kv_dim + kv_head * hd;
    const bool load = valid && !(early && chunk == warp); // an early position's rows are in flight already
    if (load)
      for (int v = 0; v < hd / 8; ++v)
        __pipeline_memcpy_async(v_shared + lane * hd + v * 8, k_row + kv_dim + v * 8, 16);
    __pipeline_commit();
#pragma unroll
    for (int v = 0; v < kMaxVectorsPerHead; ++v)
      if (load && v < hd / 8)
        key[v] = reinterpret_cast<const uint4*>(k_row)[v];
    float score = -INFINITY;
    if (valid) {
      float dot = 0.0f;
#pragma unroll
      for (int v = 0; v < kMaxVectorsPerHead; ++v) {
        if (v < hd / 8) {
          const float* qv = q_shared + v * 8;
          dot = fmaf(qv[0], bf16_low(key[v].x), dot);
          dot = fmaf(qv[1], bf16_high(key[v].x), dot);
          dot = fmaf(qv[2], bf16_low(key[v].y), dot);
          dot = fmaf(qv[3], bf16_high(key[v].y), dot);
          dot = fmaf(qv[4], bf16_low(key[v].z), dot);
          dot = fmaf(qv[5], bf16_high(key[v].z), dot);
          dot = fmaf(qv[6], bf16_low(key[v].w), dot);
          dot = fmaf(qv[7], bf16_high(key[v].w), dot);
        }
      }
      score = dot * a.scale;
    }
    // The chunk's max (finite: lane 0's position is always valid) folded into the running one.
    const float m_new = fmaxf(m, cg::reduce(warp_tile(), score, FloatMax{}));
    const float correction = expf(m - m_new); // 0 on the first chunk (m = -inf)
    const float p = valid ? expf(score - m_new) : 0.0f;
    l = l * correction + cg::reduce(warp_tile(), p, cg::plus<float>());
    m = m_new;
    p_shared[warp][lane] = p;
    __pipeline_wait_prior(0);
    __syncwarp();
    // acc[d] += sum over the chunk's positions, in position order, of p * V[d]: lane i holds d = i, i + 32..
#pragma unroll
    for (int c = 0; c < kMaxDimsPerLane; ++c)
      acc[c] *= correction;
    for (int i = 0; i < count; ++i) {
      const float weight = p_shared[warp][i];
#pragma unroll
      for (int c = 0; c < kMaxDimsPerLane; ++c)
        if (c * 32 + lane < hd)
          acc[c] = fmaf(
              weight, __uint_as_float(static_cast<uint32_t>(v_shared[i * hd + c * 32 + lane]) << 16), acc[c]);
    }
    __syncwarp(); // the warp's next chunk reuses its p and value rows
  }
  if (chunks == 1) { // one chunk, warp 0's: the output directly (the merge below would give the same bits)
    if (warp == 0) {
#pragma unroll
      for (int c = 0; c < kMaxDimsPerLane; ++c)
        if (c * 32 + lane < hd)
          out[c * 32 + lane] = float_to_bf16_bits(acc[c] / l);
    }
    return;
  }
  // Merge the warps' partials in warp order (warps without a chunk have l = 0 and weigh nothing).
#pragma unroll
  for (int c = 0; c < kMaxDimsPerLane; ++c)
    if (c * 32 + lane < hd)
      warp_acc[warp][c * 32 + lane] = acc[c];
  if (lane == 0) {
    warp_ml[warp][0] = m;
    warp_ml[warp][1] = l;
  }
  __syncthreads();
  const int used = min(chunks, kWarps);
  float m_all = -INFINITY;
  for (int w = 0; w < used; ++w)
    m_all = fmaxf(m_all, warp_ml[w][0]);
  for (int d = threadIdx.x; d < hd; d += kThreads) {
    float l_all = 0.0f, sum = 0.0f;
    for (int w = 0; w < used; ++w) {
      const float weight = expf(warp_ml[w][0] - m_all);
      l_all = fmaf(warp_ml[w][1], weight, l_all);
      sum = fmaf(warp_acc[w][d], weight, sum);
    }
    out[d] = float_to_bf16_bits(sum / l_all);
  }
}

__global__ void LlamaEmbedKernel(int tokens_per_row, int64_t token_row_stride, int hidden, int vocab,
                                 const int32_t* token_ids, const uint8_t* live, const uint16_t* token_embd,
                                 float* x) {
  const int t = blockIdx.x;
  pdl_wait();
  pdl_trigger();
  // Four elements a thread (8-byte loads, 16-byte stores): hidden is a multiple of 16.
  float4* row = reinterpret_cast<float4*>(x + static_cast<size_t>(t) * hidden);
  const int quads = hidden / 4;
  if (!live[t / tokens_per_row]) {
    for (int h = threadIdx.x; h < quads; h += blockDim.x)
      row[h] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    return;
  }
  const int32_t id = token_ids[detail::strided_token_index(t, tokens_per_row, token_row_stride)];
  const int token = min(max(id, 0), vocab - 1);
  const uint2* source = reinterpret_cast<const uint2*>(token_embd + static_cast<size_t>(token) * hidden);
  for (int h = threadIdx.x; h < quads; h += blockDim.x) {
    const uint2 four = source[h];
    row[h] = make_float4(bf16_low(four.x), bf16_high(four.x), bf16_low(four.y), bf16_high(four.y));
  }
}

} // namespace

void prepare_attention(int head_dim) {
  require(head_dim % 8 == 0 && head_dim >= 8 && head_dim <= kLlamaMaxHeadDim, "llama::prepare_attention",
          "head_dim", head_dim, "must be a multiple of 8 in [8, 128]");
  for (auto kernel : {reinterpret_cast<const void*>(LlamaAttentionKernel<kSmallHeadDim>),
                      reinterpret_cast<const void*>(LlamaAttentionKernel<kLlamaMaxHeadDim>),
                      reinterpret_cast<const void*>(LlamaEmbedKernel)})
    SMCGRAPH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             cudaSharedmemCarveoutMaxShared));
  for (auto kernel : {reinterpret_cast<const void*>(LlamaAttentionKernel<kSmallHeadDim>),
                      reinterpret_cast<const void*>(LlamaAttentionKernel<kLlamaMaxHeadDim>)})
    SMCGRAPH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(attention_smem_bytes(head_dim))));
}

void attention(const AttentionArgs& a, cudaStream_t stream) {
  constexpr const char* kWhere = "llama::attention";
  require(a.rows >= 0 && a.tokens_per_row >= 1, kWhere, "tokens_per_row", a.tokens_per_row, "must be >= 1");
  require(a.io_row_stride >= a.tokens_per_row, kWhere, "io_row_stride", a.io_row_stride,
          "must be >= tokens_per_row");
  require(a.head_dim % 8 == 0 && a.head_dim <= kLlamaMaxHeadDim, kWhere, "head_dim", a.head_dim,
          "must be a multiple of 8 and <= 128");
  require(a.kv_heads >= 1 && a.heads % a.kv_heads == 0, kWhere, "kv_heads", a.kv_heads, "must divide heads");
  if (a.rows == 0)
    return;
  // Heads of up to 64 dimensions take the variant sized for them: its key and accumulator arrays hold 64
  // dimensions, so it needs 78 registers a thread instead of 125 and three blocks fit an SM instead of two (a
  // 40-token verify of SmolLM2 has 360 blocks: one wave instead of two). H100, SmolLM2, graph us per cycle:
  // no draft at 64 requests 1,098-1,099 -> 1,035-1,038, SMC N 8 K 4 at 1 / 8 requests 2,905 / 9,171-9,180 ->
  // 2,832-2,834 / 8,594-8,601, decode at 1-8 requests unchanged. Capping it at 64 registers (four blocks an
  // SM) made decode 0-11 us a cycle slower and the verify gain smaller.
  const auto kernel = a.head_dim <= kSmallHeadDim ? LlamaAttentionKernel<kSmallHeadDim>
                                                  : LlamaAttentionKernel<kLlamaMaxHeadDim>;
  launch_pdl(kernel, dim3(a.rows, a.tokens_per_row, a.heads), dim3(kThreads),
             attention_smem_bytes(a.head_dim), stream, a);
}

void embed(int tokens, int tokens_per_row, int64_t token_row_stride, int hidden, int vocab,
           const int32_t* token_ids, const uint8_t* live, const uint16_t* token_embd, float* x,
           cudaStream_t stream) {
  require(hidden >= 4 && hidden % 4 == 0, "llama::embed", "hidden", hidden,
          "must be a positive multiple of 4");
  if (tokens == 0)
    return;
  launch_pdl(LlamaEmbedKernel, dim3(tokens), dim3(128), 0, stream, tokens_per_row, token_row_stride, hidden,
             vocab, token_ids, live, token_embd, x);
}

} // namespace smcgraph::llama
