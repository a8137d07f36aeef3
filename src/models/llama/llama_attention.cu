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
// The warps merge their (max, sum, accumulator) in warp order in shared memory. A token of more than 512
// positions folds them in splits of 16 chunks (warp w takes chunks w and w + 8 of each), each split's warps
// merged in warp order and the splits folded in split order, so a small launch can give each split a block of
// its own (split-KV: a long row's positions spread over the GPU; the token's last block folds the splits'
// states from a workspace, through a ticket). Nothing depends on the batch or on how many blocks share a
// token, so a token's output is the same in any batch and either way.
//
// Launches of more than a wave of those blocks (64-row decodes, 320-token verify blocks) take grouped blocks
// instead: one per (row, KV head, group of up to 16 of the queries that read that KV head), which load each
// position's key and value once for the group, where the per-query blocks load them once a query head and
// token. Each query runs the same arithmetic in the same order in both kernels (chunk_scores,
// chunk_values, merge_warps), so both give the same bits. Grouped blocks split long rows too: in a small
// launch a group's splits take blocks of their own, whose split states the group's last block folds. Heads
// of exactly 64 or 128 dimensions take instances with the head size a compile-time constant (EXACT).
//
// H100, SmolLM2, graph us per cycle (A/B in one call, two rounds), before -> EXACT per-query blocks only ->
// with grouped blocks too: no draft at 1 / 8 / 64 requests 475.7-477.0 / 496.0-497.6 / 973.7-979.3 ->
// 456.0-457.1 / 474.2-474.4 / 924.9-927.1 -> 453.1-456.8 / 474.3-474.8 / 912.8-920.5; speculative K = 1 at 64
// 2,480.9-2,492.6 -> 2,381.3-2,384.4 -> 2,365.5-2,367.2; SMC N 8 K 4 at 1 / 8 requests 2,703.2-2,705.8 /
// 7,580.4-7,581.7 -> 2,596.7-2,602.2 / 7,229.7-7,232.4 -> 2,598.6-2,600.3 / 6,664.9-6,672.1. The gain of
// EXACT: the per-dimension guards (`d < head_dim`) had kept every shared-memory load of the value loop behind
// a branch, so each position cost a load latency; without them the loads issue ahead of the FMA chain.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include "kernels/launch_checks.hpp"
#include "kernels/smem_limit.hpp"
#include "kernels/ticket.cuh"
#include "models/forward_layout.cuh"
#include "models/llama/attention_rows.cuh"
#include "models/llama/bf16_rows.cuh"
#include "models/llama/llama_kernels.hpp"
#include "models/llama/pdl.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/runtime.hpp"

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

/// Chunks of kAttentionChunk positions that `length` positions take.
__device__ __forceinline__ int chunks_of(int length) {
  return max(0, (length + kAttentionChunk - 1) / kAttentionChunk);
}

/// The position of row r's first token in this forward: the positions before it hold keys and values that
/// earlier forwards wrote (this forward's QKV projection writes the row's own positions only, at freshly
/// allocated slots), which a kernel may load before its PDL wait.
__device__ __forceinline__ int first_block_position(const AttentionArgs& a, int r) {
  return a.positions[detail::strided_token_index(r * a.tokens_per_row, a.tokens_per_row, a.io_row_stride)];
}

/// Dynamic shared memory of a block: each warp's value rows (a chunk of head_dim-wide bf16 rows).
__host__ __device__ constexpr size_t attention_smem_bytes(int head_dim) {
  return static_cast<size_t>(kWarps) * kAttentionChunk * head_dim * sizeof(uint16_t);
}

/// Position `slot`'s key (to registers) and value (cp.async into this lane's row of the warp's value rows,
/// `v_row`) for KV head `kv_head`: every load in flight at once.
template <int MAX_HEAD_DIM>
__device__ __forceinline__ void load_key_value(const AttentionArgs& a, int slot, int kv_head, int hd,
                                               uint16_t* v_row, uint4 (&key)[MAX_HEAD_DIM / 8]) {
  const int kv_dim = a.kv_heads * hd;
  const uint16_t* k_row = a.kv + static_cast<size_t>(slot) * 2 * kv_dim + kv_head * hd;
  for (int v = 0; v < hd / 8; ++v)
    __pipeline_memcpy_async(v_row + v * 8, k_row + kv_dim + v * 8, 16);
#pragma unroll
  for (int v = 0; v < MAX_HEAD_DIM / 8; ++v)
    if (v < hd / 8)
      key[v] = reinterpret_cast<const uint4*>(k_row)[v];
}

/// One query's pass over one chunk of (up to) 32 positions, by the calling warp: lane i holds position
/// begin + i's key (`key`, registers) and finds its value row at v_rows + i * hd (shared memory, complete
/// before the values are read: the caller's pipeline wait comes between chunk_scores and chunk_values). The
/// scores, their max and sum (warp reductions) and the online-softmax rescaling of (m, l, acc) are the same
/// operations in the same order in every kernel that calls these two: a query's output does not depend on
/// which kernel, block or batch computed it.
template <int MAX_HEAD_DIM, bool VEC_Q = false>
__device__ __forceinline__ float chunk_scores(const float* q_row, const uint4 (&key)[MAX_HEAD_DIM / 8],
                                              bool valid, int hd, float scale, float* p_row, float& m,
                                              float& l) {
  constexpr int kMaxVectorsPerHead = MAX_HEAD_DIM / 8;
  const int lane = threadIdx.x % 32;
  float score = -INFINITY;
  if (valid) {
    float dot = 0.0f;
#pragma unroll
    for (int v = 0; v < kMaxVectorsPerHead; ++v) {
      if (v < hd / 8) {
        // VEC_Q: q_row is 16-byte aligned, two 16-byte loads for 8 dimensions (the grouped kernel's batch
        // of queries then issues a quarter of the loads); else eight 4-byte loads (the per-query kernel,
        // where the vector loads measured slower in SMC's 8-row forwards at 2,048 positions). The same
        // values.
        float4 q0, q1;
        if constexpr (VEC_Q) {
          q0 = reinterpret_cast<const float4*>(q_row)[2 * v];
          q1 = reinterpret_cast<const float4*>(q_row)[2 * v + 1];
        } else {
          const float* qv = q_row + v * 8;
          q0 = make_float4(qv[0], qv[1], qv[2], qv[3]);
          q1 = make_float4(qv[4], qv[5], qv[6], qv[7]);
        }
        dot = fmaf(q0.x, bf16_low(key[v].x), dot);
        dot = fmaf(q0.y, bf16_high(key[v].x), dot);
        dot = fmaf(q0.z, bf16_low(key[v].y), dot);
        dot = fmaf(q0.w, bf16_high(key[v].y), dot);
        dot = fmaf(q1.x, bf16_low(key[v].z), dot);
        dot = fmaf(q1.y, bf16_high(key[v].z), dot);
        dot = fmaf(q1.z, bf16_low(key[v].w), dot);
        dot = fmaf(q1.w, bf16_high(key[v].w), dot);
      }
    }
    score = dot * scale;
  }
  // The chunk's max (finite: lane 0's position is always valid) folded into the running one.
  const float m_new = fmaxf(m, cg::reduce(warp_tile(), score, FloatMax{}));
  const float correction = expf(m - m_new); // 0 on the first chunk (m = -inf)
  const float p = valid ? expf(score - m_new) : 0.0f;
  l = l * correction + cg::reduce(warp_tile(), p, cg::plus<float>());
  m = m_new;
  p_row[lane] = p;
  return correction;
}

/// acc[d] = acc[d] * correction + the sum over the chunk's `count` positions, in position order, of p * V[d]
/// (lane i holds d = i, i + 32, ...).
template <int MAX_HEAD_DIM>
__device__ __forceinline__ void chunk_values(const float* p_row, const uint16_t* v_rows, int count, int hd,
                                             float correction, float (&acc)[MAX_HEAD_DIM / 32]) {
  constexpr int kMaxDimsPerLane = MAX_HEAD_DIM / 32;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < kMaxDimsPerLane; ++c)
    acc[c] *= correction;
  for (int i = 0; i < count; ++i) {
    const float weight = p_row[i];
#pragma unroll
    for (int c = 0; c < kMaxDimsPerLane; ++c)
      if (c * 32 + lane < hd)
        acc[c] = fmaf(weight, __uint_as_float(static_cast<uint32_t>(v_rows[i * hd + c * 32 + lane]) << 16),
                      acc[c]);
  }
}

/// Chunks of a split (kAttentionSplitPositions positions): warp w of a split folds its chunks w and w +
/// kWarps.
constexpr int kSplitChunks = kAttentionSplitPositions / kAttentionChunk;
static_assert(kSplitChunks == 2 * kWarps, "a split gives each warp two chunks, as a 512-position row did");

__device__ __forceinline__ int splits_of(int chunks) {
  return (chunks + kSplitChunks - 1) / kSplitChunks;
}

/// The chunk warp `warp` folds after `chunk` of split `split`, of a token (or a grouped batch) of `chunks`
/// chunks whose splits this block takes `split_blocks` apart (past the chunks: none to fold). Without SPLIT
/// a block folds every chunk: warp w takes w, w + kWarps, ...
template <bool SPLIT>
__device__ __forceinline__ int next_chunk_of(int chunk, int split, int chunks, int split_blocks, int warp) {
  if constexpr (!SPLIT)
    return chunk + kWarps;
  return chunk + kWarps < min(chunks, (split + 1) * kSplitChunks)
             ? chunk + kWarps
             : (split + split_blocks) * kSplitChunks + warp;
}

/// One split's softmax state for one output dimension: the largest score m, the sum l of exp(score - m) and
/// acc = the sum of exp(score - m) V[d].
struct SplitState {
  float m, l, acc;
};

/// A split's state, dimension d, from its warps' partials (m, l, acc) in warp order (warps without a chunk
/// weigh nothing): the first `used` warps' entries at ml[w * ml_stride] and acc[w * acc_stride].
__device__ __forceinline__ SplitState split_state(const float* ml, int ml_stride, const float* acc,
                                                  int acc_stride, int used) {
  float m_all = -INFINITY;
  for (int w = 0; w < used; ++w)
    m_all = fmaxf(m_all, ml[w * ml_stride]);
  float l_all = 0.0f, sum = 0.0f;
  for (int w = 0; w < used; ++w) {
    const float weight = expf(ml[w * ml_stride] - m_all);
    l_all = fmaf(ml[w * ml_stride + 1], weight, l_all);
    sum = fmaf(acc[w * acc_stride], weight, sum);
  }
  return {m_all, l_all, sum};
}

/// A token's state with its next split folded in (splits in order; the first is taken as it is, so a token of
/// one split gives that split's acc / l). Every kernel and mode folds a token's splits with this, in split
/// order, so a token's output does not depend on how many blocks computed its splits.
__device__ __forceinline__ void fold_split(SplitState& token, const SplitState& split, bool first) {
  if (first) {
    token = split;
    return;
  }
  const float m = fmaxf(token.m, split.m);
  const float a = expf(token.m - m), b = expf(split.m - m);
  token.l = fmaf(split.l, b, token.l * a);
  token.acc = fmaf(split.acc, b, token.acc * a);
  token.m = m;
}

/// The workspace's entry of split `split` of query (token t, head `head`): head_dim + 2 floats (m, l, then
/// acc by dimension), max_splits entries a query, where each kernel publishes a split's state and the last
/// block folds them.
__device__ __forceinline__ float* split_entry(const AttentionArgs& a, int t, int head, int split, int hd) {
  return a.split_states + ((static_cast<size_t>(t) * a.heads + head) * a.max_splits + split) * (hd + 2);
}

/// Thread d's share of a split's state in its entry: dimension d's acc, and m and l from thread 0.
__device__ __forceinline__ void publish_split(float* entry, const SplitState& state, int d) {
  entry[2 + d] = state.acc;
  if (d == 0) {
    entry[0] = state.m;
    entry[1] = state.l;
  }
}

/// Dimension d of a query's `splits` published entries folded into `token` in split order (the first taken
/// as it is; read through L2: other blocks wrote them).
__device__ __forceinline__ void fold_published(SplitState& token, const float* entries, int splits, int hd,
                                               int d) {
  for (int split = 0; split < splits; ++split) {
    const float* entry = entries + static_cast<size_t>(split) * (hd + 2);
    fold_split(token, SplitState{__ldcg(entry), __ldcg(entry + 1), __ldcg(entry + 2 + d)}, split == 0);
  }
}

/// A query of one split: its output from its warps' partials, dimension d.
__device__ __forceinline__ uint16_t merge_warps(const float* ml, int ml_stride, const float* acc,
                                                int acc_stride, int used) {
  const SplitState state = split_state(ml, ml_stride, acc, acc_stride, used);
  return float_to_bf16_bits(state.acc / state.l);
}

// One block per (row, token, query head), or, with the split workspace, split_blocks blocks of them. A
// token's positions are folded in splits of kSplitChunks chunks: in split s, warp w takes chunks 16 s + w and
// 16 s + w
// + 8 and folds them in that order with an online softmax; the split's state is its warps' (m, l, acc) merged
// in warp order in shared memory (split_state), and the token's output folds its splits' states in split
// order (fold_split). A warp thus takes chunks w, w + 8, w + 16, ... as before splits existed, and a token of
// up to 512 positions (one split) gives the bits it gave then. The order depends on the token's own length
// only, so its output is the same in any batch (batch invariance: a decode token equals the same token in a
// verify block) and whichever block folded which split: block g of a token (blockIdx.z = g * heads + head)
// folds splits g, g + split_blocks, ... and, for a token of several splits, writes each split's state to the
// workspace; the token's last block to finish (a ticket) folds them all in split order.
// SPLIT false (a model whose rows hold at most one split, max_seq_len <= 512): one block a (token, head) that
// folds all of the token's chunks as one split, the same bits as SPLIT true for such rows, without the split
// loop's bookkeeping (it cost 1-2% of a short-context forward: H100, SmolLM2, max_seq_len 256, no draft at 1
// / 8 requests 435.3 / 450.0 -> 440.0 / 458.3 graph us a cycle).
template <int MAX_HEAD_DIM, bool EXACT, bool SPLIT>
__global__ void __launch_bounds__(kThreads) LlamaAttentionKernel(const AttentionArgs a) {
  static_assert(kAttentionChunk == 32, "a chunk is one warp pass: a lane per position");
  static_assert(MAX_HEAD_DIM % 32 == 0 && MAX_HEAD_DIM <= kLlamaMaxHeadDim, "a lane holds whole dimensions");
  static_assert(kLlamaMaxHeadDim <= kThreads, "a thread a dimension when the splits are folded");
  constexpr int kMaxDimsPerLane = MAX_HEAD_DIM / 32;
  constexpr int kMaxVectorsPerHead = MAX_HEAD_DIM / 8; // 16-byte loads of one key
  if (a.trigger_early)                                 // AttentionArgs::trigger_early
    pdl_trigger();
  const int r = blockIdx.x, j = blockIdx.y;
  const int head = SPLIT ? static_cast<int>(blockIdx.z) % a.heads : static_cast<int>(blockIdx.z),
            block_of_token = SPLIT ? static_cast<int>(blockIdx.z) / a.heads : 0;
  const int split_blocks = SPLIT ? a.split_blocks : 1; // 1: this block folds all of the token's splits
  extern __shared__ __align__(16) unsigned char attention_smem[];
  __shared__ float q_shared[MAX_HEAD_DIM];
  __shared__ float p_shared[kWarps][kAttentionChunk];
  __shared__ float warp_acc[kWarps][MAX_HEAD_DIM];
  __shared__ float warp_ml[kWarps][2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // EXACT: head_dim is MAX_HEAD_DIM, a constant, so the per-dimension guards fold away and the loops over a
  // chunk's positions issue their shared-memory loads ahead of the FMA chain (no branch between them).
  const int hd = EXACT ? MAX_HEAD_DIM : a.head_dim, q_dim = a.heads * hd;
  const int kv_head = head / (a.heads / a.kv_heads);
  uint16_t* v_shared =
      reinterpret_cast<uint16_t*>(attention_smem) + static_cast<size_t>(warp) * kAttentionChunk * hd;
  // The row's live flag, length, the token's position and the slot table are the forward's inputs, not
  // written by its kernels: complete before the forward's first kernel passed its pdl_wait() (and this kernel
  // starts only after its predecessor's pdl_wait(), pdl.hpp), so they and the first chunk's slots are read
  // before waiting. Q and the KV of the row's own tokens (the QKV projection just wrote them) come after.
  const int t = r * a.tokens_per_row + j;
  const bool live = a.live[r];
  const int length = query_length(a, r, t);
  const int32_t* slots = a.slot_table + static_cast<size_t>(r) * a.max_seq_len;
  const int chunks = chunks_of(length);
  const int splits = SPLIT ? splits_of(chunks) : 1;
  // A block past the token's splits has nothing to fold (block 0 always stays: it writes the output of a
  // token of one split or none).
  if (block_of_token > 0 && block_of_token >= splits)
    return;
  const int first_chunk = block_of_token * kSplitChunks + warp; // this warp's first chunk
  int next_slot = 0;
  if (live && first_chunk < chunks && first_chunk * kAttentionChunk + lane < length)
    next_slot = clamp_slot(slots[first_chunk * kAttentionChunk + lane], a.pool_size);
  // The warp's first chunk, for positions before the row's first token in this forward: their K and V were
  // written by earlier forwards (this forward's QKV projection writes the block's own positions only, at
  // freshly allocated slots), so they are loaded before waiting too, and a decode token's attention costs
  // one memory latency after the wait (q and the block's own positions), not two.
  uint4 key[kMaxVectorsPerHead];
  const int first_position = first_block_position(a, r);
  const int early_position = first_chunk * kAttentionChunk + lane;
  const bool early =
      live && first_chunk < chunks && early_position < length && early_position < first_position;
  if (early)
    load_key_value<MAX_HEAD_DIM>(a, next_slot, kv_head, hd, v_shared + lane * hd, key);
  __pipeline_commit();
  pdl_wait_then_trigger(a.trigger_early);
  if (!live)
    return;
  uint16_t* out = a.out + static_cast<size_t>(t) * q_dim + head * hd;
  if (chunks == 0) { // a token that sees no position (bad positions): zeros
    for (int d = threadIdx.x; d < hd; d += kThreads)
      out[d] = 0;
    return;
  }
  // The warp's first chunk's positions of this forward (the QKV projection just wrote their K and V: not
  // loaded early) go out beside q's load, so both cost one memory latency, as in the grouped kernel (they
  // went out after q's load and barrier before). H100, SmolLM2, graph us a cycle, two rounds in one call:
  // speculative K 4 at 8 requests 2,094.9, 2,090.5 -> 2,078.0, 2,075.2; SMC N 8 K 4 at 1 request 1,949.6,
  // 1,962.2 -> 1,939.1, 1,946.3; no draft at 8 requests 433.8, 435.4 -> 437.6, 437.4 (at 1: unchanged).
  const bool late = first_chunk < chunks && early_position < length && !early;
  if (late)
    load_key_value<MAX_HEAD_DIM>(a, next_slot, kv_head, hd, v_shared + lane * hd, key);
  __pipeline_commit();
  const uint16_t* q = a.q + static_cast<size_t>(t) * q_dim + head * hd;
  for (int d = threadIdx.x; d < hd; d += kThreads)
    q_shared[d] = __uint_as_float(static_cast<uint32_t>(q[d]) << 16);
  __syncthreads();

  // Split-KV: a token of several splits whose splits more than one block shares writes each split's state
  // to the workspace (an entry of head_dim + 2 floats: m, l, acc).
  const bool publish = SPLIT && split_blocks > 1 && splits > 1;
  float* token_states = publish ? split_entry(a, t, head, 0, hd) : nullptr;
  SplitState token{-INFINITY, 0.0f, 0.0f}; // thread d's dimension of the token's state (threads < hd)
  for (int split = block_of_token; split < splits; split += split_blocks) {
    float m = -INFINITY, l = 0.0f, acc[kMaxDimsPerLane];
#pragma unroll
    for (int c = 0; c < kMaxDimsPerLane; ++c)
      acc[c] = 0.0f;
    const int split_end = SPLIT ? min(chunks, (split + 1) * kSplitChunks) : chunks;
    for (int chunk = split * kSplitChunks + warp; chunk < split_end; chunk += kWarps) {
      // Lane i takes position begin + i: its value row goes straight to shared memory (cp.async) and its key
      // row to registers, so every load of the chunk is in flight at once (one memory latency a chunk).
      const int begin = chunk * kAttentionChunk, count = min(kAttentionChunk, length - begin);
      const bool valid = lane < count;
      const int slot = next_slot;
      const int following =
          next_chunk_of<SPLIT>(chunk, split, chunks, split_blocks, warp) * kAttentionChunk + lane;
      if (following < length) // the warp's next chunk: its slot load overlaps this chunk
        next_slot = clamp_slot(slots[following], a.pool_size);
      // The first chunk's rows are in flight already (loaded before the wait, or right after it).
      const bool load = valid && !((early || late) && chunk == first_chunk);
      if (load)
        load_key_value<MAX_HEAD_DIM>(a, slot, kv_head, hd, v_shared + lane * hd, key);
      __pipeline_commit();
      const float correction =
          chunk_scores<MAX_HEAD_DIM>(q_shared, key, valid, hd, a.scale, p_shared[warp], m, l);
      __pipeline_wait_prior(0);
      __syncwarp();
      // acc[d] += sum over the chunk's positions, in position order, of p * V[d]: lane i holds d = i, i
      // + 32..
      chunk_values<MAX_HEAD_DIM>(p_shared[warp], v_shared, count, hd, correction, acc);
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
    // The split's state: its warps' partials merged in warp order (warps without a chunk in it weigh
    // nothing).
#pragma unroll
    for (int c = 0; c < kMaxDimsPerLane; ++c)
      if (c * 32 + lane < hd)
        warp_acc[warp][c * 32 + lane] = acc[c];
    if (lane == 0) {
      warp_ml[warp][0] = m;
      warp_ml[warp][1] = l;
    }
    __syncthreads();
    const int used = min(split_end - split * kSplitChunks, kWarps);
    const int d = threadIdx.x;
    if (d < hd) {
      const SplitState state = split_state(&warp_ml[0][0], 2, &warp_acc[0][d], MAX_HEAD_DIM, used);
      if (publish) {
        publish_split(token_states + static_cast<size_t>(split) * (hd + 2), state, d);
      } else {
        fold_split(token, state, split == 0);
      }
    }
    if (split + split_blocks < splits)
      __syncthreads(); // the next split rewrites the partials
  }
  if (!publish) { // every split of the token folded here
    if (threadIdx.x < hd)
      out[threadIdx.x] = float_to_bf16_bits(token.acc / token.l);
    return;
  }
  if constexpr (!SPLIT)
    return;
  // The token's blocks that hold a split (min(split_blocks, splits)) arrive; the last folds every split's
  // state in split order.
  if (!device::last_to_arrive(&a.split_tickets[static_cast<size_t>(t) * a.heads + head],
                              static_cast<uint32_t>(min(split_blocks, splits))))
    return;
  const int d = threadIdx.x;
  if (d < hd) {
    fold_published(token, token_states, splits, hd, d);
    out[d] = float_to_bf16_bits(token.acc / token.l);
  }
}

/// Queries a grouped block takes at most (LlamaGroupedAttentionKernel), and how many of them a warp runs
/// interleaved.
constexpr int kGroupMaxQueries = 16;
constexpr int kQueryBatch = 4;
/// The batch of groups of up to 3 queries (a decode token of a model with 3 query heads a KV head, as
/// SmolLM2): a batch of 4 would run a fourth, discarded copy of a query (a third more arithmetic a chunk).
/// With it, the weights read four positions to a 16-byte load and the queries' 16-byte loads (the same
/// arithmetic): H100, SmolLM2, SMC N 8 K 4 at 8 requests after 2,048-token prompts (64-row draft steps),
/// grouped attention 98.7 -> 89.2 us a launch (ncu), `bucket_sweep --context 2048` 15,011.8-15,015.4 ->
/// 13,834.7-13,847.3 us a cycle, from 32-token prompts 4,155.8-4,158.4 -> 4,056.0-4,057.0; every other
/// cycle (per-query blocks) within 0.6%.
constexpr int kGroupedSmallBatch = 3;
/// The per-query kernel's blocks an SM (73 registers a thread in SmolLM2's variant, 64 dimensions EXACT:
/// three 256-thread blocks), and the waves of them past which the launch takes grouped blocks. Grouped blocks
/// forced on smaller launches are slower (H100, SmolLM2, graph us per cycle: no draft at 1 / 8 requests
/// 456.9-460.7 / 475.8-476.0 -> 555.3-557.5 / 565.5-566.3, SMC N 8 K 4 at 1 request 2,602.9-2,604.9 ->
/// 3,303.9-3,331.3): a grouped block runs its queries one batch at a time.
constexpr int kPerQueryBlocksPerSm = 3;
constexpr int kGroupedMinWaves = 1;
/// Waves of per-query blocks a split-KV launch may take (attention()).
constexpr int kSplitBlockWaves = 2;
/// Grouped blocks an SM for heads of up to kSmallHeadDim dimensions (their launch bound; one for larger
/// heads): 3 for the instances whose batches take up to kGroupedSmallBatch queries (SmolLM2's 64-row decodes:
/// 192 groups, with split-KV up to 5 blocks each), 2 for the batches of 4 (verify blocks), which spill 52-152
/// bytes at 80 registers (at 3 they lost: below). The bound of 3 holds the batch-of-3 instances to 80
/// registers (94 at 2 without split-KV, 4 bytes of spill at 3; 114-117 with split-KV, 52-76 bytes of spill at
/// 3), so more of their blocks fit on an SM. Nsight Compute put the 2-bound launch of 64 rows at 25%
/// theoretical occupancy (registers), 17.8% achieved, 0.2 instructions issued a cycle per scheduler. H200,
/// SmolLM2, graph us a cycle, two builds alternating in one call each, two rounds (bound 2 -> 3): without
/// split-KV (from 32-token prompts) no draft at 64 requests 855.6, 852.3 -> 837.0, 836.7 (the forward alone
/// 823.6, 822.3 -> 805.2, 805.4), SMC N 8 K 4 at 8 requests (64-row draft steps) 4,309.6, 4,307.1 -> 4,247.5,
/// 4,259.6; with split-KV (`--context 2048`) SMC at 8 requests 13,403.7, 13,413.4 -> 12,723.7, 12,718.6, and
/// in one round no draft at 64 requests 2,828.2 -> 2,817.3, speculative K 4 at 8 5,140.5 -> 5,134.4. What the
/// gain is made of is not understood: a kernel trace of the 64-row decode in two calls
/// (trace_critical_path.py's shares, mean a layer, before -> after) leaves the attention's own share where it
/// was (6.84 -> 6.88 us) and shortens the gate/up launch two kernels later (7.17 -> 6.20 us).
/// SMCGRAPH_GROUPED_SMALL_HEAD_BLOCKS=2 at build time restores the old bound, for A/B runs.
#ifndef SMCGRAPH_GROUPED_SMALL_HEAD_BLOCKS
#define SMCGRAPH_GROUPED_SMALL_HEAD_BLOCKS 3
#endif
constexpr int kGroupedSmallHeadBlocksPerSm = SMCGRAPH_GROUPED_SMALL_HEAD_BLOCKS;
/// The batches of 4 (verify blocks) at 3 blocks an SM lost (H200, forty-eighth session, one call, two rounds,
/// graph us a cycle, 2 -> 3): speculative K 4 at 64 requests (groups of 15 queries) 4,074.3, 4,061.2 ->
/// 4,095.7, 4,096.4; SMC N 8 K 4 at 8 requests 4,265.0, 4,250.3 -> 4,270.3, 4,247.6.
/// SMCGRAPH_GROUPED_SMALL_HEAD_BATCH4_BLOCKS=3 at build time repeats it.
#ifndef SMCGRAPH_GROUPED_SMALL_HEAD_BATCH4_BLOCKS
#define SMCGRAPH_GROUPED_SMALL_HEAD_BATCH4_BLOCKS 2
#endif
constexpr int kGroupedSmallHeadBatch4BlocksPerSm = SMCGRAPH_GROUPED_SMALL_HEAD_BATCH4_BLOCKS;
/// The grouped blocks an SM that a split-KV launch counts its waves in (kGroupedSplitBlockWaves): 2, as
/// before the launch bound of 3. Counting 3 (more blocks a group) was even (H200, forty-eighth session, one
/// call, two rounds, SMC N 8 K 4 at 8 requests from 2,048-token prompts, graph us a cycle, 2 -> 3: 12,688.7,
/// 12,696.8 -> 12,705.6, 12,678.0); SMCGRAPH_GROUPED_SMALL_HEAD_SPLIT_BLOCKS=3 at build time repeats it.
#ifndef SMCGRAPH_GROUPED_SMALL_HEAD_SPLIT_BLOCKS
#define SMCGRAPH_GROUPED_SMALL_HEAD_SPLIT_BLOCKS 2
#endif
constexpr int kGroupedSmallHeadSplitBlocksPerSm = SMCGRAPH_GROUPED_SMALL_HEAD_SPLIT_BLOCKS;
/// Waves of grouped blocks (kGroupedSmallHeadSplitBlocksPerSm an SM, or one for larger heads) a split-KV
/// launch of grouped blocks may take (LlamaGroupedAttentionKernel has the A/B: on an H100, 4 waves give
/// SmolLM2's 64-row decodes up to 5 blocks a group, as many as the row has splits, and gained; 2 waves gave 2
/// and lost).
#ifndef SMCGRAPH_GROUPED_SPLIT_WAVES
#define SMCGRAPH_GROUPED_SPLIT_WAVES 4
#endif
constexpr int kGroupedSplitBlockWaves = SMCGRAPH_GROUPED_SPLIT_WAVES;

/// Dynamic shared memory of a grouped block: each warp's value rows, then the queries as floats, each warp's
/// accumulators per query and each warp's (m, l) per query.
size_t grouped_smem_bytes(int head_dim, int queries) {
  return attention_smem_bytes(head_dim) + static_cast<size_t>(queries) * head_dim * sizeof(float) +
         static_cast<size_t>(kWarps) * queries * head_dim * sizeof(float) +
         static_cast<size_t>(kWarps) * queries * 2 * sizeof(float) +
         static_cast<size_t>(kQueryBatch) * head_dim * sizeof(SplitState);
}

// One block per (row, group of queries, KV head): the queries q = first .. first + count - 1 of the row's
// tokens_per_row x heads-per-KV-head queries that read this KV head (query q is token q / group_heads and
// query head kv_head * group_heads + q % group_heads). The positions the block reads are loaded once for all
// its queries (where a warp has one chunk: a row of up to 256 positions) instead of once a query: a 5-token
// verify of SmolLM2 (3 query heads a KV head) reads each key and value once instead of 15 times. A warp runs
// QB queries at once, interleaved (kQueryBatch, or kGroupedSmallBatch for groups of up to 3). Each query runs
// exactly the per-query kernel's arithmetic in the same order (chunk c on warp c % kWarps, chunk_scores,
// chunk_values' rescale and position-order sums, the warps merged in warp order by merge_warps; a query of
// several splits: each split's warps merged by split_state and the splits folded in order by fold_split), so
// its output is the same bits in either kernel (a test checks it), and both stay batch-invariant. (The split
// loop raised head_dim 128's registers from 127 to 162, one block an SM instead of two; capping them at 128
// spilled 48-76 bytes. Not measured either way: SmolLM2's heads are 64 wide, 109 -> 123 registers, two blocks
// an SM before and after.) In the value loop a lane owns adjacent dimensions (lane D .. lane D + D - 1, D =
// kMaxDimsPerLane) and reads them with one 4- or 8-byte shared-memory load; each dimension's sum keeps its
// order, so the bits are unchanged. The 64-wide instances are held to two blocks an SM by their launch bound
// (94-123 registers, no spill; since the forty-seventh session the QB 3 instances to three:
// kGroupedSmallHeadBlocksPerSm); without it the no-split QB 3 instance spilled. H100: SMC N 8 K 4 at 8
// requests and 2,048 positions 13,829 -> 13,545 us a cycle; 4,059 -> 4,049 from 32-token prompts.
// Split-KV (SPLIT, a.split_blocks > 1: launches of up to kAttentionSplitMaxTokens tokens with the workspace):
// block g of a (row, group, KV head) folds its queries' splits g, g + split_blocks, ..., each split's state
// merged from its warps as above; a query of several splits publishes each split's state to the workspace
// (the per-query kernel's entries of its token and head), and the group's last block (a ticket) folds them
// in split order (fold_split), so the bits are those of one block a group. Queries of one split stay with
// block 0. H100, SmolLM2, SMC N 8 K 4 at 8 requests (64-row draft steps: 192 groups, up to 5 blocks each,
// as many as the row has splits): 13,535-13,559 -> 13,083 us a cycle at 2,048 positions, 40,486-40,523 ->
// 37,294-37,344 at 8,000; from 32-token prompts (one split) unchanged. Two waves (2 blocks a group at 2,048)
// lost: 14,283-14,290.
template <int MAX_HEAD_DIM, bool EXACT, bool SPLIT, int QB>
__global__ void __launch_bounds__(kThreads, MAX_HEAD_DIM > kSmallHeadDim ? 1
                                            : QB > kGroupedSmallBatch    ? kGroupedSmallHeadBatch4BlocksPerSm
                                                                         : kGroupedSmallHeadBlocksPerSm)
    LlamaGroupedAttentionKernel(const AttentionArgs a, int group_queries) {
  static_assert(QB >= 1 && QB <= kQueryBatch, "a batch fits the token states' shared memory");
  static_assert(kAttentionChunk == 32, "a chunk is one warp pass: a lane per position");
  constexpr int kMaxDimsPerLane = MAX_HEAD_DIM / 32;
  constexpr int kMaxVectorsPerHead = MAX_HEAD_DIM / 8;
  if (a.trigger_early) // AttentionArgs::trigger_early
    pdl_trigger();
  // Split-KV (SPLIT, with the workspace): blockIdx.z = g * kv_heads + kv_head, block g of the group folding
  // its queries' splits g, g + split_blocks, ... (as the per-query kernel's blocks of a token do).
  const int r = blockIdx.x;
  const int kv_head = SPLIT ? static_cast<int>(blockIdx.z) % a.kv_heads : static_cast<int>(blockIdx.z),
            block_of_group = SPLIT ? static_cast<int>(blockIdx.z) / a.kv_heads : 0;
  const int split_blocks = SPLIT ? a.split_blocks : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // EXACT: head_dim is MAX_HEAD_DIM, a constant, so the per-dimension guards fold away and the loops over a
  // chunk's positions issue their shared-memory loads ahead of the FMA chain (no branch between them).
  const int hd = EXACT ? MAX_HEAD_DIM : a.head_dim, q_dim = a.heads * hd;
  const int group_heads = a.heads / a.kv_heads;
  const int first = static_cast<int>(blockIdx.y) * group_queries;
  const int count = min(group_queries, a.tokens_per_row * group_heads - first);
  // Query q of the row's tokens_per_row x group_heads queries of this KV head: its token and query head.
  const auto token_of = [&](int q) { return r * a.tokens_per_row + q / group_heads; };
  const auto head_of = [&](int q) { return kv_head * group_heads + q % group_heads; };
  extern __shared__ __align__(16) unsigned char attention_smem[];
  __shared__ __align__(16) float p_shared[kWarps][QB][kAttentionChunk];
  __shared__ int lengths[kGroupMaxQueries]; // each query's query_length()
  uint16_t* v_shared =
      reinterpret_cast<uint16_t*>(attention_smem) + static_cast<size_t>(warp) * kAttentionChunk * hd;
  float* q_shared = reinterpret_cast<float*>(attention_smem + attention_smem_bytes(hd));
  float* warp_acc = q_shared + static_cast<size_t>(group_queries) * hd;         // [kWarps][queries][hd]
  float* warp_ml = warp_acc + static_cast<size_t>(kWarps) * group_queries * hd; // [kWarps][queries][2]
  // [QB][hd]: the token states of a batch's queries of several splits, entry e of thread e (mod
  // kThreads)
  SplitState* token_states =
      reinterpret_cast<SplitState*>(warp_ml + static_cast<size_t>(kWarps) * group_queries * 2);
  // Inputs of the forward (read before waiting, as in the per-query kernel): liveness, each query's length
  // (its token's position), the block's longest, the first chunk's slots and the early positions' K and V.
  const bool live = a.live[r];
  if (threadIdx.x < count) { // one position load a query, all in flight together
    const int t = token_of(first + static_cast<int>(threadIdx.x));
    lengths[threadIdx.x] = query_length(a, r, t);
  }
  __syncthreads();
  int block_length = 0;
  for (int i = 0; i < count; ++i)
    block_length = max(block_length, lengths[i]);
  const int32_t* slots = a.slot_table + static_cast<size_t>(r) * a.max_seq_len;
  const int block_chunks = chunks_of(block_length);
  // A block past its queries' splits has nothing to fold (block 0 always stays: it writes the outputs of the
  // queries of one split). With several blocks a group, its queries of several splits publish their split
  // states to the workspace, and the group's last block folds them.
  const int block_splits = SPLIT ? splits_of(block_chunks) : 1;
  if (block_of_group > 0 && block_of_group >= block_splits)
    return;
  const bool publish = SPLIT && split_blocks > 1 && block_splits > 1;
  // A warp with one chunk (rows of up to kWarps chunks) loads its positions once for every query (a row of
  // one split: block 0 only).
  const bool cached = warp < block_chunks && warp + kWarps >= block_chunks;
  int slot = 0;
  if (live && warp < block_chunks && warp * kAttentionChunk + lane < block_length)
    slot = clamp_slot(slots[warp * kAttentionChunk + lane], a.pool_size);
  uint4 key[kMaxVectorsPerHead];
  const int first_position = first_block_position(a, r);
  const int my_position = warp * kAttentionChunk + lane;
  const bool early = live && cached && my_position < block_length && my_position < first_position;
  const auto load_position = [&](int position_slot) {
    load_key_value<MAX_HEAD_DIM>(a, position_slot, kv_head, hd, v_shared + lane * hd, key);
  };
  if (early)
    load_position(slot);
  __pipeline_commit();
  pdl_wait_then_trigger(a.trigger_early);
  if (!live)
    return;
  // The queries (this forward's QKV projection wrote them), and the cached chunk's own positions.
  for (int e = threadIdx.x; e < count * hd; e += kThreads) {
    const int i = e / hd, d = e % hd, query = first + i;
    const int t = token_of(query), head = head_of(query);
    q_shared[e] =
        __uint_as_float(static_cast<uint32_t>(a.q[static_cast<size_t>(t) * q_dim + head * hd + d]) << 16);
  }
  if (cached && !early && my_position < block_length)
    load_position(slot);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();

  // The queries in batches of QB, interleaved: each query's steps are the per-query kernel's, in
  // its order, but the batch's dot products, reductions and value sums are independent chains that overlap
  // (one query at a time leaves a warp waiting on each chain's latency), and a value row read from shared
  // memory serves the whole batch. A batch past the last query repeats that query and discards the copy.
  // A query of several splits (over 512 positions) folds each split as the per-query kernel does and its
  // splits in split order (fold_split): its warps' partials of a split go through shared memory at the
  // split's end, and thread e of the block keeps the token state of (batch query e / hd, dimension e % hd).
  constexpr int kStatesPerThread = (QB * MAX_HEAD_DIM + kThreads - 1) / kThreads;
  for (int b0 = 0; b0 < count; b0 += QB) {
    int query_index[QB], length[QB], chunks[QB], splits[QB];
    int batch_length = 0;
#pragma unroll
    for (int u = 0; u < QB; ++u) {
      query_index[u] = min(b0 + u, count - 1);
      length[u] = lengths[query_index[u]];
      chunks[u] = chunks_of(length[u]);
      splits[u] = SPLIT ? splits_of(chunks[u]) : 1;
      batch_length = max(batch_length, length[u]);
    }
    const int batch_chunks = chunks_of(batch_length);
    // the same in every warp: a uniform loop
    const int batch_splits = SPLIT ? max(1, splits_of(batch_chunks)) : 1;
    // Uncached (several chunks a warp): warp w takes chunks w, w + kWarps, w + 2 kWarps, ... across the
    // splits (a split is 2 kWarps chunks), so the slot of its next chunk is known a chunk ahead and its load
    // overlaps the current chunk (as in the per-query kernel), leaving one memory latency a chunk, not two.
    // (Measured alone it did not pay: 99.3 -> 99.5 us a grouped launch at 2,048 positions, H100; it is part
    // of the build whose batches of 3 gave the figures at kGroupedSmallBatch.)
    int next_slot = 0;
    const int first_position_of_warp = (block_of_group * kSplitChunks + warp) * kAttentionChunk + lane;
    if (!cached && first_position_of_warp < batch_length)
      next_slot = clamp_slot(slots[first_position_of_warp], a.pool_size);
    float m[QB] = {}, l[QB] = {}, acc[QB][kMaxDimsPerLane] = {}; // set at split 0
    // This warp's partial (m, l, acc) of batch query u (the block's query i), for a merge in warp order.
    const auto store_partial = [&](int u, int i) {
      float* my_acc = warp_acc + (static_cast<size_t>(warp) * group_queries + i) * hd;
#pragma unroll
      for (int c = 0; c < kMaxDimsPerLane; ++c)
        if (lane * kMaxDimsPerLane + c < hd)
          my_acc[lane * kMaxDimsPerLane + c] = acc[u][c];
      if (lane == 0) {
        warp_ml[(warp * group_queries + i) * 2] = m[u];
        warp_ml[(warp * group_queries + i) * 2 + 1] = l[u];
      }
    };
    for (int split = block_of_group; split < batch_splits; split += split_blocks) {
#pragma unroll
      for (int u = 0; u < QB; ++u) {
        if (split > 0 && split >= splits[u])
          continue; // a query's last split keeps its state (one split: for the merge after the batches)
        m[u] = -INFINITY;
        l[u] = 0.0f;
#pragma unroll
        for (int c = 0; c < kMaxDimsPerLane; ++c)
          acc[u][c] = 0.0f;
      }
      const int split_end = SPLIT ? min(batch_chunks, (split + 1) * kSplitChunks) : batch_chunks;
      for (int chunk = split * kSplitChunks + warp; chunk < split_end; chunk += kWarps) {
        const int begin = chunk * kAttentionChunk;
        if (!cached) { // several chunks a warp: the batch loads them itself
          const int position_slot = next_slot,
                    following = next_chunk_of<SPLIT>(chunk, split, batch_chunks, split_blocks, warp) *
                                    kAttentionChunk +
                                lane;
          if (following < batch_length)
            next_slot = clamp_slot(slots[following], a.pool_size);
          if (lane < min(kAttentionChunk, batch_length - begin))
            load_position(position_slot);
          __pipeline_commit();
        }
        float correction[QB];
        int valid_count[QB];
#pragma unroll
        for (int u = 0; u < QB; ++u) {
          valid_count[u] = min(kAttentionChunk, length[u] - begin); // <= 0 where the query has no such chunk
          float m_u = m[u], l_u = l[u];
          correction[u] = chunk_scores<MAX_HEAD_DIM, true>(
              q_shared + static_cast<size_t>(query_index[u]) * hd, key, lane < valid_count[u], hd, a.scale,
              p_shared[warp][u], m_u, l_u);
          if (chunk < chunks[u]) { // a query takes only its own chunks
            m[u] = m_u;
            l[u] = l_u;
          }
        }
        if (!cached)
          __pipeline_wait_prior(0);
        __syncwarp();
        // chunk_values for the whole batch: acc *= correction, then the chunk's positions in order.
#pragma unroll
        for (int u = 0; u < QB; ++u)
#pragma unroll
          for (int c = 0; c < kMaxDimsPerLane; ++c)
            if (chunk < chunks[u])
              acc[u][c] *= correction[u];
        const int batch_count = min(kAttentionChunk, batch_length - begin);
        // The weights four positions at a time (one 16-byte load a query; entries past a query's positions
        // are read and not used), the sums still one position after the other.
        for (int i0 = 0; i0 < batch_count; i0 += 4) {
          float4 weights[QB];
#pragma unroll
          for (int u = 0; u < QB; ++u)
            weights[u] = *reinterpret_cast<const float4*>(&p_shared[warp][u][i0]);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int i = i0 + k;
            if (i >= batch_count)
              break;
            // Lane l sums dimensions l D .. l D + D - 1 (D = kMaxDimsPerLane), read with one 4- or 8-byte
            // load.
            if (lane * kMaxDimsPerLane < hd) {
              const uint16_t* row = v_shared + i * hd + lane * kMaxDimsPerLane;
              float values[kMaxDimsPerLane];
              if constexpr (kMaxDimsPerLane == 2) {
                const uint32_t pair = *reinterpret_cast<const uint32_t*>(row);
                values[0] = bf16_low(pair);
                values[1] = bf16_high(pair);
              } else {
                static_assert(kMaxDimsPerLane == 4, "heads of 64 or 128 dimensions");
                const uint2 quad = *reinterpret_cast<const uint2*>(row);
                values[0] = bf16_low(quad.x);
                values[1] = bf16_high(quad.x);
                values[2] = bf16_low(quad.y);
                values[3] = bf16_high(quad.y);
              }
#pragma unroll
              for (int c = 0; c < kMaxDimsPerLane; ++c) {
#pragma unroll
                for (int u = 0; u < QB; ++u) {
                  const float weight = k == 0   ? weights[u].x
                                       : k == 1 ? weights[u].y
                                       : k == 2 ? weights[u].z
                                                : weights[u].w;
                  if (i < valid_count[u])
                    acc[u][c] = fmaf(weight, values[c], acc[u][c]);
                }
              }
            }
          }
        }
        __syncwarp(); // the next chunk or batch reuses the warp's p (and, uncached, value) rows
      }
      // The split's states of the batch's queries of several splits (none: nothing to do): their warps'
      // partials, merged in warp order by the threads that keep their token states.
      if constexpr (SPLIT) {
        if (batch_splits > 1) {
#pragma unroll
          for (int u = 0; u < QB; ++u)
            if (b0 + u < count && splits[u] > 1 && split < splits[u] &&
                warp < min(chunks[u] - split * kSplitChunks, kWarps))
              store_partial(u, b0 + u);
          __syncthreads();
#pragma unroll
          for (int k = 0; k < kStatesPerThread; ++k) {
            // (the query's chunks from `lengths`: u is not a compile-time index here)
            const int e = static_cast<int>(threadIdx.x) + k * kThreads, u = e / hd, d = e % hd, i = b0 + u;
            const int query_chunks = u < QB && i < count ? chunks_of(lengths[i]) : 0;
            if (splits_of(query_chunks) <= 1 || split >= splits_of(query_chunks))
              continue;
            const int used = min(query_chunks - split * kSplitChunks, kWarps);
            const SplitState state =
                split_state(warp_ml + i * 2, group_queries * 2, warp_acc + static_cast<size_t>(i) * hd + d,
                            group_queries * hd, used);
            if (publish) { // the query's entry for this split in the workspace (as the per-query kernel's)
              const int query = first + i;
              const int t = token_of(query), head = head_of(query);
              publish_split(split_entry(a, t, head, split, hd), state, d);
            } else {
              fold_split(token_states[e], state, split == 0);
            }
          }
          __syncthreads(); // the next split rewrites the partials
        }
      }
    }
    // Queries of several splits: the output from the token state (published: the group's last block).
    if (batch_splits > 1 && !publish) {
#pragma unroll
      for (int k = 0; k < kStatesPerThread; ++k) {
        const int e = static_cast<int>(threadIdx.x) + k * kThreads, u = e / hd, d = e % hd, i = b0 + u;
        if (u >= QB || i >= count || splits_of(chunks_of(lengths[i])) <= 1)
          continue;
        const int query = first + i;
        const int t = token_of(query), head = head_of(query);
        a.out[static_cast<size_t>(t) * q_dim + head * hd + d] =
            float_to_bf16_bits(token_states[e].acc / token_states[e].l);
      }
    }
#pragma unroll
    for (int u = 0; u < QB; ++u) {
      // A repeated query, one of several splits (above), or a block other than split 0's.
      if (b0 + u >= count || splits[u] > 1 || block_of_group > 0)
        continue;
      const int i = b0 + u, query = first + i;
      const int t = token_of(query), head = head_of(query);
      uint16_t* out = a.out + static_cast<size_t>(t) * q_dim + head * hd;
      if (chunks[u] == 0) { // a token that sees no position (bad positions): zeros
        if (warp == 0)
          for (int d = lane; d < hd; d += 32)
            out[d] = 0;
      } else if (chunks[u] == 1) { // warp 0's chunk alone: the output directly, as in the per-query kernel
        if (warp == 0) {
#pragma unroll
          for (int c = 0; c < kMaxDimsPerLane; ++c)
            if (lane * kMaxDimsPerLane + c < hd)
              out[lane * kMaxDimsPerLane + c] = float_to_bf16_bits(acc[u][c] / l[u]);
        }
      } else if (warp < chunks[u]) {
        store_partial(u, i);
      }
    }
  }
  __syncthreads();
  // The queries of several chunks: their warps' partials merged in warp order (block 0's).
  for (int e = threadIdx.x; e < count * hd && block_of_group == 0; e += kThreads) {
    const int i = e / hd, d = e % hd, query = first + i;
    const int chunks = chunks_of(lengths[i]);
    if (chunks <= 1 || (SPLIT && chunks > kSplitChunks)) // one chunk, or several splits: written above
      continue;
    const int t = token_of(query), head = head_of(query);
    a.out[static_cast<size_t>(t) * q_dim + head * hd + d] =
        merge_warps(warp_ml + i * 2, group_queries * 2, warp_acc + static_cast<size_t>(i) * hd + d,
                    group_queries * hd, min(chunks, kWarps));
  }
  if constexpr (SPLIT) {
    if (!publish)
      return;
    // The group's blocks that hold a split (min(split_blocks, block_splits)) arrive, on the ticket of the
    // group's first query (one per group); the last folds each query's split states in split order.
    if (!device::last_to_arrive(
            &a.split_tickets[static_cast<size_t>(token_of(first)) * a.heads + head_of(first)],
            static_cast<uint32_t>(min(split_blocks, block_splits))))
      return;
    for (int e = threadIdx.x; e < count * hd; e += kThreads) {
      const int i = e / hd, d = e % hd, query = first + i;
      const int splits = splits_of(chunks_of(lengths[i]));
      if (splits <= 1)
        continue;
      const int t = token_of(query), head = head_of(query);
      SplitState token{-INFINITY, 0.0f, 0.0f};
      fold_published(token, split_entry(a, t, head, 0, hd), splits, hd, d);
      a.out[static_cast<size_t>(t) * q_dim + head * hd + d] = float_to_bf16_bits(token.acc / token.l);
    }
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

/// Residual rows, `hidden` floats each (block (r, j), gridDim.y = tokens): token j of row r to dst + r *
/// dst_stride + j * hidden, from first + r * first_stride + j * hidden for j < tokens - 1, from last + r *
/// last_stride for the row's last token.
__global__ void LlamaGatherRowsKernel(int hidden, const float* first, int64_t first_stride, const float* last,
                                      int64_t last_stride, float* dst, int64_t dst_stride) {
  const int r = blockIdx.x, j = blockIdx.y, tokens = gridDim.y;
  pdl_wait();
  pdl_trigger();
  const float* source =
      j + 1 < tokens ? first + r * first_stride + static_cast<int64_t>(j) * hidden : last + r * last_stride;
  const float4* from = reinterpret_cast<const float4*>(source);
  float4* to = reinterpret_cast<float4*>(dst + r * dst_stride + static_cast<int64_t>(j) * hidden);
  for (int h = threadIdx.x; h < hidden / 4; h += blockDim.x)
    to[h] = from[h];
}

/// Every attention kernel variant, for one call per attribute.
template <bool SPLIT, class F> void for_each_attention_kernel_of(F&& f) {
  f(reinterpret_cast<const void*>(LlamaAttentionKernel<kSmallHeadDim, true, SPLIT>), false);
  f(reinterpret_cast<const void*>(LlamaAttentionKernel<kSmallHeadDim, false, SPLIT>), false);
  f(reinterpret_cast<const void*>(LlamaAttentionKernel<kLlamaMaxHeadDim, true, SPLIT>), false);
  f(reinterpret_cast<const void*>(LlamaAttentionKernel<kLlamaMaxHeadDim, false, SPLIT>), false);
  const auto grouped = [&](auto qb) {
    constexpr int QB = decltype(qb)::value;
    f(reinterpret_cast<const void*>(LlamaGroupedAttentionKernel<kSmallHeadDim, true, SPLIT, QB>), true);
    f(reinterpret_cast<const void*>(LlamaGroupedAttentionKernel<kSmallHeadDim, false, SPLIT, QB>), true);
    f(reinterpret_cast<const void*>(LlamaGroupedAttentionKernel<kLlamaMaxHeadDim, true, SPLIT, QB>), true);
    f(reinterpret_cast<const void*>(LlamaGroupedAttentionKernel<kLlamaMaxHeadDim, false, SPLIT, QB>), true);
  };
  grouped(std::integral_constant<int, kQueryBatch>{});
  grouped(std::integral_constant<int, kGroupedSmallBatch>{});
}
template <class F> void for_each_attention_kernel(F&& f) {
  for_each_attention_kernel_of<false>(f);
  for_each_attention_kernel_of<true>(f);
}

/// The per-query and grouped kernels' instance for a head size and split mode.
template <bool SPLIT> auto per_query_kernel(bool small, bool exact_small, bool exact_large) {
  return small ? (exact_small ? LlamaAttentionKernel<kSmallHeadDim, true, SPLIT>
                              : LlamaAttentionKernel<kSmallHeadDim, false, SPLIT>)
               : (exact_large ? LlamaAttentionKernel<kLlamaMaxHeadDim, true, SPLIT>
                              : LlamaAttentionKernel<kLlamaMaxHeadDim, false, SPLIT>);
}
template <bool SPLIT, int QB> auto grouped_kernel(bool small, bool exact_small, bool exact_large) {
  return small ? (exact_small ? LlamaGroupedAttentionKernel<kSmallHeadDim, true, SPLIT, QB>
                              : LlamaGroupedAttentionKernel<kSmallHeadDim, false, SPLIT, QB>)
               : (exact_large ? LlamaGroupedAttentionKernel<kLlamaMaxHeadDim, true, SPLIT, QB>
                              : LlamaGroupedAttentionKernel<kLlamaMaxHeadDim, false, SPLIT, QB>);
}

/// Blocks a split-KV launch gives each of its `units` (a (token, head) of per-query blocks, a (row, group, KV
/// head) of grouped ones): as many as `block_budget` blocks hold, at most max_splits; 1 (every split of a
/// unit in one block) without the workspace, for rows of one split, for launches of more than
/// kAttentionSplitMaxTokens tokens (the workspace holds that many), or where fewer than 2 fit. The bits are
/// the same for any count (the kernels say why).
int split_blocks_for(const AttentionArgs& a, bool split, int64_t units, int64_t block_budget) {
  if (!split || a.split_states == nullptr || a.max_splits < 2 ||
      static_cast<int64_t>(a.rows) * a.tokens_per_row > kAttentionSplitMaxTokens)
    return 1;
  const int64_t blocks = std::min<int64_t>(a.max_splits, block_budget / units);
  return blocks < 2 ? 1 : static_cast<int>(blocks);
}

} // namespace

void prepare_attention(int head_dim) {
  require(head_dim % 8 == 0 && head_dim >= 8 && head_dim <= kLlamaMaxHeadDim, "llama::prepare_attention",
          "head_dim", head_dim, "must be a multiple of 8 in [8, 128]");
  detail::prepare_forward_kernel(reinterpret_cast<const void*>(LlamaEmbedKernel), 0);
  detail::prepare_forward_kernel(reinterpret_cast<const void*>(LlamaGatherRowsKernel), 0);
  for_each_attention_kernel([&](const void* kernel, bool grouped) {
    detail::prepare_forward_kernel(kernel, grouped ? grouped_smem_bytes(head_dim, kGroupMaxQueries)
                                                   : attention_smem_bytes(head_dim));
  });
  prepare_tensor_core_attention(head_dim);
}

// Grouped blocks (a block per row, KV head and up to kGroupMaxQueries of the queries that read it: each
// position's K and V loaded once for them all) once the per-query grid is more than kGroupedMinWaves waves of
// kPerQueryBlocksPerSm blocks an SM and the grouped grid has a block for every SM; below that, a block per
// query spreads one token's work widest. Both give the same bits. The second condition keeps a single row's
// prefill of up to 176 tokens (SmolLM2: 27-99 grouped blocks) on per-query blocks. H200, ncu, one launch
// alone, a 1-row prefill of T tokens, per-query / grouped us: T 32 7.32 / 24.80, 64 11.65 / 26.34, 128 20.19
// / 26.97, 176 29.09 / 28.98, 270 (153 grouped blocks) 50.79 / 48.42. The decodes of 64 rows keep grouped
// blocks (192 of them; per-query forced: SMC N 8 K 4 at 8 requests 3,866-3,889 -> 4,096-4,099 us a cycle).
AttentionGrid attention_grid(AttentionGrouping grouping, int rows, int tokens_per_row, int heads,
                             int kv_heads, int multiprocessors) {
  constexpr const char* kWhere = "llama::attention_grid";
  require(kv_heads >= 1 && heads % kv_heads == 0, kWhere, "kv_heads", kv_heads, "must divide heads");
  require(rows >= 0 && tokens_per_row >= 1, kWhere, "tokens_per_row", tokens_per_row, "must be >= 1");
  require(multiprocessors >= 1, kWhere, "multiprocessors", multiprocessors, "must be >= 1");
  AttentionGrid grid;
  grid.per_query_blocks = static_cast<int64_t>(rows) * tokens_per_row * heads;
  // A row's queries of one KV head in groups of at most kGroupMaxQueries, as even as they go.
  const int64_t queries = static_cast<int64_t>(tokens_per_row) * (heads / kv_heads);
  grid.groups = detail::ceil_div(queries, kGroupMaxQueries);
  grid.group_queries = static_cast<int>(detail::ceil_div(queries, grid.groups));
  grid.grouped_blocks = static_cast<int64_t>(rows) * grid.groups * kv_heads;
  grid.grouped =
      grouping == AttentionGrouping::kGrouped ||
      (grouping == AttentionGrouping::kBySize &&
       grid.per_query_blocks > int64_t{kGroupedMinWaves} * kPerQueryBlocksPerSm * multiprocessors &&
       grid.grouped_blocks >= multiprocessors);
  return grid;
}

void attention(const AttentionArgs& a, cudaStream_t stream) {
  constexpr const char* kWhere = "llama::attention";
  require(a.rows >= 0 && a.tokens_per_row >= 1, kWhere, "tokens_per_row", a.tokens_per_row, "must be >= 1");
  require(a.io_row_stride >= a.tokens_per_row, kWhere, "io_row_stride", a.io_row_stride,
          "must be >= tokens_per_row");
  require(a.head_dim % 8 == 0 && a.head_dim <= kLlamaMaxHeadDim, kWhere, "head_dim", a.head_dim,
          "must be a multiple of 8 and <= 128");
  require(a.kv_heads >= 1 && a.heads % a.kv_heads == 0, kWhere, "kv_heads", a.kv_heads, "must divide heads");
  if (a.split_states != nullptr) {
    require(a.split_tickets != nullptr, kWhere, "split_tickets", "null",
            "must be a device pointer with split_states");
    require(a.max_splits >= attention_max_splits(a.max_seq_len), kWhere, "max_splits", a.max_splits,
            "must cover max_seq_len's splits");
  }
  if (a.rows == 0)
    return;
  if (tensor_core_attention_serves(a)) { // prefill-sized launches (llama_attention_tc.cu)
    tensor_core_attention(a, stream);
    return;
  }
  // Heads of up to 64 dimensions take the variant sized for them: its key and accumulator arrays hold 64
  // dimensions, so it needed 78 registers a thread instead of 125 and three blocks fit an SM instead of two
  // (a 40-token verify of SmolLM2 has 360 blocks: one wave instead of two). H100, SmolLM2, graph us per
  // cycle: no draft at 64 requests 1,098-1,099 -> 1,035-1,038, SMC N 8 K 4 at 1 / 8 requests 2,905 /
  // 9,171-9,180 -> 2,832-2,834 / 8,594-8,601, decode at 1-8 requests unchanged. Capping it at 64 registers
  // (four blocks an SM) made decode 0-11 us a cycle slower and the verify gain smaller.
  const bool small = a.head_dim <= kSmallHeadDim;
  // Heads of exactly the variant's size take its EXACT instance (the head size a compile-time constant).
  const bool exact_small = a.head_dim == kSmallHeadDim, exact_large = a.head_dim == kLlamaMaxHeadDim;
  // Rows of more than one split possible (max_seq_len > 512): the split instances, for every launch of the
  // model (whatever its size or the workspace), so a token's bits do not depend on the launch.
  const bool split = attention_max_splits(a.max_seq_len) > 1;
  const int multiprocessors = current_device_info().multiprocessors;
  const AttentionGrid grid =
      attention_grid(a.grouping, a.rows, a.tokens_per_row, a.heads, a.kv_heads, multiprocessors);
  if (!grid.grouped) {
    const auto kernel = split ? per_query_kernel<true>(small, exact_small, exact_large)
                              : per_query_kernel<false>(small, exact_small, exact_large);
    // Split-KV: with the workspace, a launch of up to kAttentionSplitMaxTokens tokens gives each (token,
    // head) as many blocks (split_blocks, at most max_splits) as fit in kSplitBlockWaves waves of the
    // per-query blocks, so a long row's positions spread over the GPU instead of one block's 8 warps. A block
    // past a token's splits returns at once; the bits are the same for any split_blocks (the kernel says
    // why).
    AttentionArgs launch = a;
    launch.split_blocks = split_blocks_for(
        a, split, grid.per_query_blocks, int64_t{kSplitBlockWaves} * kPerQueryBlocksPerSm * multiprocessors);
    launch_pdl(kernel, dim3(a.rows, a.tokens_per_row, a.heads * launch.split_blocks), dim3(kThreads),
               attention_smem_bytes(a.head_dim), stream, launch);
    return;
  }
  require(grid.groups <= 65535, kWhere, "tokens_per_row", a.tokens_per_row,
          "gives too many query groups a row");
  const int group_queries = grid.group_queries;
  // Groups of up to 3 queries take batches of 3 (kGroupedSmallBatch), larger ones of 4: the same arithmetic
  // a query either way.
  const bool small_batch = group_queries <= kGroupedSmallBatch;
  const auto kernel =
      split ? (small_batch ? grouped_kernel<true, kGroupedSmallBatch>(small, exact_small, exact_large)
                           : grouped_kernel<true, kQueryBatch>(small, exact_small, exact_large))
            : (small_batch ? grouped_kernel<false, kGroupedSmallBatch>(small, exact_small, exact_large)
                           : grouped_kernel<false, kQueryBatch>(small, exact_small, exact_large));
  // Split-KV for grouped blocks too: a launch of up to kAttentionSplitMaxTokens tokens with the workspace
  // gives each (row, group, KV head) as many blocks (split_blocks, at most max_splits) as fit in
  // kGroupedSplitBlockWaves waves of grouped blocks (SmolLM2's SMC at 8 requests: 64-row draft steps, 192
  // groups); the same bits for any split_blocks (the kernel says why).
  AttentionArgs launch = a;
  launch.split_blocks = split_blocks_for(
      a, split, grid.grouped_blocks,
      int64_t{kGroupedSplitBlockWaves} * (small ? kGroupedSmallHeadSplitBlocksPerSm : 1) * multiprocessors);
  launch_pdl(kernel, dim3(a.rows, static_cast<unsigned>(grid.groups), a.kv_heads * launch.split_blocks),
             dim3(kThreads), grouped_smem_bytes(a.head_dim, group_queries), stream, launch, group_queries);
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

void gather_rows(int rows, int tokens, int hidden, const float* first, int64_t first_stride,
                 const float* last, int64_t last_stride, float* dst, int64_t dst_stride,
                 cudaStream_t stream) {
  constexpr const char* kWhere = "llama::gather_rows";
  require(hidden >= 4 && hidden % 4 == 0, kWhere, "hidden", hidden, "must be a positive multiple of 4");
  require(tokens >= 1 && tokens <= 65535, kWhere, "tokens", tokens, "must be in [1, 65535]");
  const auto aligned = [](const float* p, int64_t stride) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride % 4 == 0;
  };
  require((tokens == 1 || aligned(first, first_stride)) && aligned(last, last_stride) &&
              aligned(dst, dst_stride),
          kWhere, "rows", "misaligned", "must start 16-byte aligned (float4 copies)");
  if (rows == 0)
    return;
  launch_pdl(LlamaGatherRowsKernel, dim3(rows, tokens), dim3(128), 0, stream, hidden, first, first_stride,
             last, last_stride, dst, dst_stride);
}

} // namespace smcgraph::llama
