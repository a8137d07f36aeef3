// Host-side helpers every kernel launcher shares: grid sizing and the validation of the slot pool and row
// tables views (error texts name the launcher, the field and its value).
#pragma once

#include <cstdint>

#include "smcgraph/error.hpp"
#include "smcgraph/slots.hpp"

namespace smcgraph::detail {

/// ceil(a / b) for a >= 0, b > 0: blocks for `a` items at `b` per block.
constexpr int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

inline void require_pool(const SlotPoolView& pool, const char* where) {
  require(pool.pool_size >= 1, where, "pool.pool_size", pool.pool_size, "must be >= 1 (slot 0 is the dummy)");
  require(pool.free_stack != nullptr, where, "pool.free_stack", "null", "must be a device pointer");
  require(pool.free_count != nullptr, where, "pool.free_count", "null", "must be a device pointer");
  require(pool.refcount != nullptr, where, "pool.refcount", "null", "must be a device pointer");
}

/// Checks the view's shape; the pointers only when it has rows.
inline void require_tables(const RowTablesView& tables, const char* where) {
  require(tables.rows >= 0, where, "tables.rows", tables.rows, "must be >= 0");
  require(tables.max_seq_len >= 1, where, "tables.max_seq_len", tables.max_seq_len, "must be >= 1");
  if (tables.rows == 0)
    return;
  require(tables.slot_table != nullptr, where, "tables.slot_table", "null", "must be a device pointer");
  require(tables.token_table != nullptr, where, "tables.token_table", "null", "must be a device pointer");
  require(tables.seq_len != nullptr, where, "tables.seq_len", "null", "must be a device pointer");
  require(tables.live != nullptr, where, "tables.live", "null", "must be a device pointer");
}

} // namespace smcgraph::detail
