// What both attention kernels (llama_attention.cu's CUDA-core kernels, llama_attention_tc.cu's tensor-core
// one) read of a row the same way: how many positions a token attends to, and a slot-table entry made safe to
// index the KV with.
#pragma once

#include "models/forward_layout.cuh"
#include "models/llama/llama_kernels.hpp"

namespace smcgraph::llama {

/// A slot id from the slot table, or slot 0 (the padding dummy) where it is outside [0, pool_size).
__device__ __forceinline__ int clamp_slot(int slot, int pool_size) {
  return (slot >= 0 && slot < pool_size) ? slot : 0;
}

/// Positions token t (of row r; t = r * tokens_per_row + j) attends to: up to its own, within the row's
/// length and max_seq_len (negative where its position is).
__device__ __forceinline__ int query_length(const AttentionArgs& a, int r, int t) {
  const int position = a.positions[detail::strided_token_index(t, a.tokens_per_row, a.io_row_stride)];
  return min(min(position + 1, a.seq_lens[r]), a.max_seq_len);
}

} // namespace smcgraph::llama
