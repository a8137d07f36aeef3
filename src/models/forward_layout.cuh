// How a model finds a forward's per-token entries (ForwardArgs, include/smcgraph/model.hpp): token j of row r
// of a block laid out [rows, row_stride] sits at r * row_stride + j. Tokens use ForwardArgs::token_stride();
// positions, out slots and logits rows use io_stride(). Shared by the models' kernels (toy, Llama) and their
// argument checks, so both models read the engine's blocks the same way.
#pragma once

#include <cstdint>

#include "smcgraph/error.hpp"
#include "smcgraph/model.hpp"

namespace smcgraph::detail {

/// Index of the forward's token t (row t / tokens_per_row) in a block whose rows are `row_stride` entries
/// apart (row_stride >= tokens_per_row, already resolved from 0 = dense).
__device__ __forceinline__ int64_t strided_token_index(int64_t t, int tokens_per_row, int64_t row_stride) {
  return t / tokens_per_row * row_stride + t % tokens_per_row;
}

/// Throws when a row stride of `args` is set (non-zero) but shorter than a row.
inline void require_row_strides(const ForwardArgs& args, const char* where) {
  require(args.token_row_stride == 0 || args.token_row_stride >= args.tokens_per_row, where,
          "args.token_row_stride", args.token_row_stride, "must be 0 (dense) or >= tokens_per_row");
  require(args.io_row_stride == 0 || args.io_row_stride >= args.tokens_per_row, where, "args.io_row_stride",
          args.io_row_stride, "must be 0 (dense) or >= tokens_per_row");
}

/// The checks every model's forward() makes on its arguments: rows >= 0, tokens_per_row >= 1, the row strides
/// and, when there is a row, every pointer. Returns false for rows == 0 (nothing to do).
inline bool require_forward_args(const ForwardArgs& args, const char* where) {
  require(args.rows >= 0, where, "args.rows", args.rows, "must be >= 0");
  require(args.tokens_per_row >= 1, where, "args.tokens_per_row", args.tokens_per_row, "must be >= 1");
  require_row_strides(args, where);
  if (args.rows == 0)
    return false;
  require(args.tokens && args.positions && args.slot_table && args.seq_lens && args.out_slots && args.live &&
              args.logits,
          where, "a pointer of args", "null", "every ForwardArgs pointer must be a device pointer");
  return true;
}

} // namespace smcgraph::detail
