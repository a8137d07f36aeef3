// Grouped-query attention over the slot table (page size 1), for any number of query tokens per row: token j
// of row r attends to positions 0 .. min(p_j, seq_len - 1) of its row (its own block causally, since the
// block's KV was written first), reading each position's K and V through slot_table[r].
//
// Work items: (token, query head, chunk of kAttentionChunk positions), dealt round-robin to the `splits`
// blocks of (row, kv head) and their warps, so a short decode row, a long row and a prefill block all spread
// over the GPU. A warp computes its item with an online softmax (scores: a lane per position, the full dot
// product from 16-byte loads; values: a lane per output dimension, the weights broadcast by shuffles, 8
// positions' loads in flight). A token whose positions fit one chunk writes its output directly; a longer one
// writes (m, l, acc) partials that the last block of (row, kv head) to finish merges in chunk order. Nothing
// depends on which block computed an item, so a token's output is the same in any batch.
#include <algorithm>
#include <cmath>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_bf16.h>

#include "kernels/launch_checks.hpp"
#include "models/llama/llama_kernels.hpp"
#include "models/llama/pdl.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/llama_model.hpp"

namespace smcgraph::llama {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxDimsPerLane = kLlamaMaxHeadDim / 32;
constexpr int kMaxVectorsPerHead = kLlamaMaxHeadDim / 8; // 16-byte loads of one key
constexpr int kValueBatch = 8;                           // value rows loaded together (divides 32)

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

// Merges the chunk partials of one (token, head) in chunk order and writes the bf16 output (one warp). The
// chunks' (m, l) pairs are read lane-parallel, 32 at a time, and shuffled to every lane; the sums run in
// chunk order whatever the split count.
__device__ void combine_chunks(const AttentionArgs& a, int t, int head, int chunks, int lane) {
  const int hd = a.head_dim;
  const size_t first = (static_cast<size_t>(t) * a.heads + head) * a.max_chunks;
  // Other blocks wrote these partials: read them through L2 (__ldcg), never a stale L1 line.
  float m = -INFINITY;
  for (int c = lane; c < chunks; c += 32)
    if (__ldcg(a.partial_ml + (first + c) * 2 + 1) > 0.0f)
      m = fmaxf(m, __ldcg(a.partial_ml + (first + c) * 2));
  m = cg::reduce(warp_tile(), m, FloatMax{});
  float l = 0.0f, acc[kMaxDimsPerLane];
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; ++i)
    acc[i] = 0.0f;
  for (int c0 = 0; c0 < chunks; c0 += 32) {
    float l_mine = 0.0f, w_mine = 0.0f;
    if (c0 + lane < chunks) {
      l_mine = __ldcg(a.partial_ml + (first + c0 + lane) * 2 + 1);
      if (l_mine > 0.0f)
        w_mine = expf(__ldcg(a.partial_ml + (first + c0 + lane) * 2) - m);
    }
    const int count = min(32, chunks - c0);
    for (int c = 0; c < count; ++c) {
      const float w = __shfl_sync(0xffffffffu, w_mine, c);
      l = fmaf(__shfl_sync(0xffffffffu, l_mine, c), w, l);
      const float* partial = a.partial_acc + (first + c0 + c) * hd;
#pragma unroll
      for (int i = 0; i < kMaxDimsPerLane; ++i)
        if (i * 32 + lane < hd)
          acc[i] = fmaf(__ldcg(partial + i * 32 + lane), w, acc[i]);
    }
  }
  uint16_t* out = a.out + static_cast<size_t>(t) * a.heads * hd + head * hd;
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; ++i)
    if (i * 32 + lane < hd)
      out[i * 32 + lane] = __bfloat16_as_ushort(__float2bfloat16_rn(l > 0.0f ? acc[i] / l : 0.0f));
}

__global__ void __launch_bounds__(kThreads) LlamaAttentionKernel(const AttentionArgs a) {
  const int r = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  pdl_wait();
  pdl_trigger();
  if (!a.live[r])
    return;
  __shared__ float q_shared[kWarps][kLlamaMaxHeadDim];
  __shared__ bool is_last;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = a.heads / a.kv_heads;
  const int hd = a.head_dim, q_dim = a.heads * hd, kv_dim = a.kv_heads * hd;
  const int seq_len = a.seq_lens[r];
  const int32_t* slots = a.slot_table + static_cast<size_t>(r) * a.max_seq_len;
  const int pairs = a.tokens_per_row * group;
  // The chunks the row needs: its longest token's.
  int row_length = 0;
  for (int j = lane; j < a.tokens_per_row; j += 32)
    row_length = max(row_length, min(min(a.positions[r * a.tokens_per_row + j] + 1, seq_len), a.max_seq_len));
  row_length = cg::reduce(warp_tile(), row_length, cg::greater<int>());
  const int row_chunks = max(1, (row_length + kAttentionChunk - 1) / kAttentionChunk);
  // The row's work items, (token, head, chunk) in chunk-major order, dealt round-robin to the blocks of (r,
  // kv head) and to their warps: an item's result does not depend on who computes it (batch invariance), and
  // a prefill or verify block of many tokens spreads over as many warps as a long decode row. Chunk c covers
  // positions [c * kAttentionChunk, (c + 1) * kAttentionChunk).
  const int total_items = pairs * row_chunks;
  if (split >= total_items)
    return; // no item here; the blocks that have one are min(splits, total_items)
  const int working_blocks = min(a.splits, total_items);
  for (int item = split + warp * a.splits; item < total_items; item += a.splits * kWarps) {
    const int pair = item % pairs, chunk = item / pairs;
    const int j = pair / group, head = kv_head * group + pair % group;
    const int t = r * a.tokens_per_row + j;
    const int length = min(min(a.positions[t] + 1, seq_len), a.max_seq_len);
    const int begin = chunk * kAttentionChunk;
    const int end = min(begin + kAttentionChunk, length);
    uint16_t* out = a.out + static_cast<size_t>(t) * q_dim + head * hd;
    if (begin >= end) {
      if (chunk == 0) // a token that sees no position (bad positions): zeros, as the merge of no chunk
        for (int d = lane; d < hd; d += 32)
          out[d] = 0;
      continue; // the merge reads only chunks below ceil(length / kAttentionChunk)
    }
    const uint16_t* q = a.q + static_cast<size_t>(t) * q_dim + head * hd;
    for (int d = lane; d < hd; d += 32)
      q_shared[warp][d] = __uint_as_float(static_cast<uint32_t>(q[d]) << 16);
    __syncwarp();
    float m = -INFINITY, l = 0.0f;
    float acc[kMaxDimsPerLane];
#pragma unroll
    for (int c = 0; c < kMaxDimsPerLane; ++c)
      acc[c] = 0.0f;
    for (int base = begin; base < end; base += 32) {
      const int position = base + lane;
      float score = -INFINITY;
      int slot = 0; // positions past the end read slot 0 (never written, zero) with weight 0
      if (position < end) {
        slot = clamp_slot(slots[position], a.pool_size);
        const uint4* k =
            reinterpret_cast<const uint4*>(a.kv + static_cast<size_t>(slot) * 2 * kv_dim + kv_head * hd);
        // Every 16-byte load of the key is issued before the first product.
        uint4 key[kMaxVectorsPerHead];
#pragma unroll
        for (int v = 0; v < kMaxVectorsPerHead; ++v)
          if (v < hd / 8)
            key[v] = k[v];
        float dot = 0.0f;
#pragma unroll
        for (int v = 0; v < kMaxVectorsPerHead; ++v) {
          if (v < hd / 8) {
            const float* qv = q_shared[warp] + v * 8;
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
      const float chunk_max = cg::reduce(warp_tile(), score, FloatMax{});
      const float m_new = fmaxf(m, chunk_max); // finite: lane 0's position is always valid
      const float correction = expf(m - m_new);
      const float p = position < end ? expf(score - m_new) : 0.0f;
      const float p_sum = cg::reduce(warp_tile(), p, cg::plus<float>());
      l = l * correction + p_sum;
#pragma unroll
      for (int c = 0; c < kMaxDimsPerLane; ++c)
        acc[c] *= correction;
      // Values, kValueBatch positions at a time: their loads are all in flight before the first product.
      const int count = min(32, end - base);
      for (int i0 = 0; i0 < count; i0 += kValueBatch) {
        float weight[kValueBatch];
        float value[kValueBatch][kMaxDimsPerLane];
#pragma unroll
        for (int u = 0; u < kValueBatch; ++u) {
          weight[u] = __shfl_sync(0xffffffffu, p, i0 + u);
          const int slot_u = __shfl_sync(0xffffffffu, slot, i0 + u);
          const uint16_t* v = a.kv + static_cast<size_t>(slot_u) * 2 * kv_dim + kv_dim + kv_head * hd;
#pragma unroll
          for (int c = 0; c < kMaxDimsPerLane; ++c)
            value[u][c] =
                c * 32 + lane < hd ? __uint_as_float(static_cast<uint32_t>(v[c * 32 + lane]) << 16) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < kValueBatch; ++u) {
#pragma unroll
          for (int c = 0; c < kMaxDimsPerLane; ++c)
            acc[c] = fmaf(weight[u], value[u][c], acc[c]);
        }
      }
      m = m_new;
    }
    if (length <= kAttentionChunk) {
      // One chunk: the output directly. The merge of a single partial gives the same bits (its weight is
      // expf(0) = 1 and the fmaf sums start from 0), so this shortcut keeps batch invariance.
#pragma unroll
      for (int c = 0; c < kMaxDimsPerLane; ++c)
        if (c * 32 + lane < hd)
          out[c * 32 + lane] = __bfloat16_as_ushort(__float2bfloat16_rn(acc[c] / l));
    } else {
      const size_t entry = (static_cast<size_t>(t) * a.heads + head) * a.max_chunks + chunk;
      float* partial = a.partial_acc + entry * hd;
#pragma unroll
      for (int c = 0; c < kMaxDimsPerLane; ++c) {
        if (c * 32 + lane < hd)
          partial[c * 32 + lane] = acc[c];
      }
      if (lane == 0) {
        a.partial_ml[entry * 2] = m;
        a.partial_ml[entry * 2 + 1] = l;
      }
    }
    __syncwarp();
  }
  if (row_chunks == 1)
    return; // every token of the row wrote its output directly

  // The last block of (r, kv head) to finish merges every chunk (the threadfence-reduction pattern): the
  // merge is the same whatever the split count, so a token's output does not depend on the batch.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = a.counters + static_cast<size_t>(r) * a.kv_heads + kv_head;
    const int arrived = atomicAdd(counter, 1);
    is_last = arrived == working_blocks - 1;
    if (is_last)
      *counter = 0; // ready for the next forward (graph replays reuse it)
  }
  __syncthreads();
  if (!is_last)
    return;
  __threadfence();
  for (int pair = warp; pair < pairs; pair += kWarps) {
    const int j = pair / group, head = kv_head * group + pair % group;
    const int t = r * a.tokens_per_row + j;
    const int length = min(min(a.positions[t] + 1, seq_len), a.max_seq_len);
    if (length > kAttentionChunk)
      combine_chunks(a, t, head, (length + kAttentionChunk - 1) / kAttentionChunk, lane);
  }
}

__global__ void LlamaEmbedKernel(int tokens_per_row, int hidden, int vocab, const int32_t* token_ids,
                                 const uint8_t* live, const uint16_t* token_embd, float* x) {
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
  const int token = min(max(token_ids[t], 0), vocab - 1);
  const uint2* source = reinterpret_cast<const uint2*>(token_embd + static_cast<size_t>(token) * hidden);
  for (int h = threadIdx.x; h < quads; h += blockDim.x) {
    const uint2 four = source[h];
    row[h] = make_float4(bf16_low(four.x), bf16_high(four.x), bf16_low(four.y), bf16_high(four.y));
  }
}

} // namespace

void prepare_attention() {
  for (auto kernel :
       {reinterpret_cast<const void*>(LlamaAttentionKernel), reinterpret_cast<const void*>(LlamaEmbedKernel)})
    SMCGRAPH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             cudaSharedmemCarveoutMaxShared));
}

int attention_chunks(int max_seq_len) {
  return static_cast<int>(detail::ceil_div(max_seq_len, kAttentionChunk));
}

int choose_attention_splits(int rows, int kv_heads, int max_seq_len, int multiprocessors) {
  const int64_t blocks = static_cast<int64_t>(std::max(rows, 1)) * kv_heads;
  const int64_t wanted = detail::ceil_div(2 * multiprocessors, blocks);
  return static_cast<int>(std::clamp<int64_t>(wanted, 1, attention_chunks(max_seq_len)));
}

void attention(const AttentionArgs& a, cudaStream_t stream) {
  constexpr const char* kWhere = "llama::attention";
  require(a.rows >= 0 && a.tokens_per_row >= 1, kWhere, "tokens_per_row", a.tokens_per_row, "must be >= 1");
  require(a.head_dim % 8 == 0 && a.head_dim <= kLlamaMaxHeadDim, kWhere, "head_dim", a.head_dim,
          "must be a multiple of 8 and <= 128");
  require(a.kv_heads >= 1 && a.heads % a.kv_heads == 0, kWhere, "kv_heads", a.kv_heads, "must divide heads");
  require(a.max_chunks == attention_chunks(a.max_seq_len), kWhere, "max_chunks", a.max_chunks,
          "must be ceil(max_seq_len / kAttentionChunk)");
  require(a.splits >= 1 && a.splits <= a.max_chunks, kWhere, "splits", a.splits,
          "must be in [1, max_chunks]");
  require(a.partial_acc != nullptr && a.partial_ml != nullptr && a.counters != nullptr, kWhere,
          "partial_acc / partial_ml / counters", "null", "must be device pointers");
  if (a.rows == 0)
    return;
  launch_pdl(LlamaAttentionKernel, dim3(a.rows, a.kv_heads, a.splits), dim3(kThreads), 0, stream, a);
}

void embed(int tokens, int tokens_per_row, int hidden, int vocab, const int32_t* token_ids,
           const uint8_t* live, const uint16_t* token_embd, float* x, cudaStream_t stream) {
  require(hidden >= 4 && hidden % 4 == 0, "llama::embed", "hidden", hidden,
          "must be a positive multiple of 4");
  if (tokens == 0)
    return;
  launch_pdl(LlamaEmbedKernel, dim3(tokens), dim3(128), 0, stream, tokens_per_row, hidden, vocab, token_ids,
             live, token_embd, x);
}

} // namespace smcgraph::llama
