// Grouped-query attention over the slot table (page size 1), for any number of query tokens per row: token j
// of row r attends to positions 0 .. min(p_j, seq_len - 1) of its row (its own block causally, since the
// block's KV was written first), reading each position's K and V through slot_table[r].
//
// Split-KV: block (r, kv head, s) takes the positions [s * split_len, (s + 1) * split_len) for every query
// token of row r and every query head of the kv head's group, with an online softmax; with one split it
// writes the output, otherwise (m, l, acc) partials that a second kernel merges. A long row therefore still
// spreads over the GPU when rows are few. Scores: a lane per position (the full dot product from 16-byte
// loads); values: a lane per output dimension pair, the weights broadcast by shuffles.
#include <algorithm>
#include <cmath>

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

__device__ __forceinline__ float bf16_low(uint32_t pair) {
  return __uint_as_float(pair << 16);
}
__device__ __forceinline__ float bf16_high(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

__device__ __forceinline__ int clamp_slot(int slot, int pool_size) {
  return (slot >= 0 && slot < pool_size) ? slot : 0;
}

// Merges the chunk partials of one (token, head) in chunk order and writes the bf16 output (one warp).
__device__ void combine_chunks(const AttentionArgs& a, int t, int head, int chunks, int lane) {
  const int hd = a.head_dim;
  const size_t first = (static_cast<size_t>(t) * a.heads + head) * a.max_chunks;
  float m = -INFINITY;
  // Other blocks wrote these partials: read them through L2 (__ldcg), never a stale L1 line.
  for (int c = 0; c < chunks; ++c)
    if (__ldcg(a.partial_ml + (first + c) * 2 + 1) > 0.0f)
      m = fmaxf(m, __ldcg(a.partial_ml + (first + c) * 2));
  for (int d = lane; d < hd; d += 32) {
    float l = 0.0f, acc = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      const float l_c = __ldcg(a.partial_ml + (first + c) * 2 + 1);
      if (l_c > 0.0f) {
        const float w = expf(__ldcg(a.partial_ml + (first + c) * 2) - m);
        l = fmaf(l_c, w, l);
        acc = fmaf(__ldcg(a.partial_acc + (first + c) * hd + d), w, acc);
      }
    }
    a.out[static_cast<size_t>(t) * a.heads * hd + head * hd + d] =
        __bfloat16_as_ushort(__float2bfloat16_rn(l > 0.0f ? acc / l : 0.0f));
  }
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
  // Chunk c of a (token, head) covers positions [c * kAttentionChunk, (c + 1) * kAttentionChunk); this block
  // takes the chunks c = split, split + splits, ... and writes one (m, l, acc) partial each.
  for (int item = warp; item < pairs * a.max_chunks; item += kWarps) {
    const int pair = item % pairs, chunk = item / pairs;
    if (chunk % a.splits != split)
      continue;
    const int j = pair / group, head = kv_head * group + pair % group;
    const int t = r * a.tokens_per_row + j;
    const int length = min(min(a.positions[t] + 1, seq_len), a.max_seq_len);
    const int begin = chunk * kAttentionChunk;
    const int end = min(begin + kAttentionChunk, length);
    if (begin >= end)
      continue; // the combine reads only chunks below ceil(length / kAttentionChunk)
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
      int slot = 0;
      if (position < end) {
        slot = clamp_slot(slots[position], a.pool_size);
        const uint4* k =
            reinterpret_cast<const uint4*>(a.kv + static_cast<size_t>(slot) * 2 * kv_dim + kv_head * hd);
        float dot = 0.0f;
        for (int v = 0; v < hd / 8; ++v) {
          const uint4 chunk8 = k[v];
          const float* qv = q_shared[warp] + v * 8;
          dot = fmaf(qv[0], bf16_low(chunk8.x), dot);
          dot = fmaf(qv[1], bf16_high(chunk8.x), dot);
          dot = fmaf(qv[2], bf16_low(chunk8.y), dot);
          dot = fmaf(qv[3], bf16_high(chunk8.y), dot);
          dot = fmaf(qv[4], bf16_low(chunk8.z), dot);
          dot = fmaf(qv[5], bf16_high(chunk8.z), dot);
          dot = fmaf(qv[6], bf16_low(chunk8.w), dot);
          dot = fmaf(qv[7], bf16_high(chunk8.w), dot);
        }
        score = dot * a.scale;
      }
      float chunk_max = score;
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1)
        chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, offset));
      const float m_new = fmaxf(m, chunk_max); // finite: lane 0's position is always valid
      const float correction = expf(m - m_new);
      const float p = position < end ? expf(score - m_new) : 0.0f;
      float p_sum = p;
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1)
        p_sum += __shfl_xor_sync(0xffffffffu, p_sum, offset);
      l = l * correction + p_sum;
#pragma unroll
      for (int c = 0; c < kMaxDimsPerLane; ++c)
        acc[c] *= correction;
      const int count = min(32, end - base);
      for (int i = 0; i < count; ++i) {
        const float weight = __shfl_sync(0xffffffffu, p, i);
        const int slot_i = __shfl_sync(0xffffffffu, slot, i);
        const uint16_t* v = a.kv + static_cast<size_t>(slot_i) * 2 * kv_dim + kv_dim + kv_head * hd;
#pragma unroll
        for (int c = 0; c < kMaxDimsPerLane; ++c) {
          if (c * 32 + lane < hd)
            acc[c] = fmaf(weight, __uint_as_float(static_cast<uint32_t>(v[c * 32 + lane]) << 16), acc[c]);
        }
      }
      m = m_new;
    }
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
    __syncwarp();
  }

  // The last block of (r, kv head) to finish merges every chunk (the threadfence-reduction pattern): the
  // merge is the same whatever the split count, so a token's output does not depend on the batch.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = a.counters + static_cast<size_t>(r) * a.kv_heads + kv_head;
    const int arrived = atomicAdd(counter, 1);
    is_last = arrived == a.splits - 1;
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
    combine_chunks(a, t, head, (length + kAttentionChunk - 1) / kAttentionChunk, lane);
  }
}

__global__ void LlamaEmbedKernel(int tokens_per_row, int hidden, int vocab, const int32_t* token_ids,
                                 const uint8_t* live, const uint16_t* token_embd, float* x) {
  const int t = blockIdx.x;
  pdl_wait();
  pdl_trigger();
  float* row = x + static_cast<size_t>(t) * hidden;
  if (!live[t / tokens_per_row]) {
    for (int h = threadIdx.x; h < hidden; h += blockDim.x)
      row[h] = 0.0f;
    return;
  }
  const int token = min(max(token_ids[t], 0), vocab - 1);
  const uint16_t* source = token_embd + static_cast<size_t>(token) * hidden;
  for (int h = threadIdx.x; h < hidden; h += blockDim.x)
    row[h] = __uint_as_float(static_cast<uint32_t>(source[h]) << 16);
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
  if (tokens == 0)
    return;
  launch_pdl(LlamaEmbedKernel, dim3(tokens), dim3(128), 0, stream, tokens_per_row, hidden, vocab, token_ids,
             live, token_embd, x);
}

} // namespace smcgraph::llama
