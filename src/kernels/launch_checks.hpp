// Host-side helpers every kernel launcher shares: grid sizing and the validation of the slot pool and row
// tables views (error texts name the launcher, the field and its value).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "smcgraph/error.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/slots.hpp"

namespace smcgraph::detail {

/// ceil(a / b) for a >= 0, b > 0: blocks for `a` items at `b` per block.
constexpr int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

/// A pointer a launcher requires, with the name its error text gives it.
struct NamedPointer {
  const char* name;
  const void* pointer;
};

/// Checks the pointers in order: the first null one throws
/// "<where>: <name> = null: must be a device pointer".
///
///   require_device_pointers(kWhere, {{"in.live", in.live}, {"logw", logw}});
inline void require_device_pointers(const char* where, std::initializer_list<NamedPointer> pointers) {
  for (const NamedPointer& p : pointers)
    require(p.pointer != nullptr, where, p.name, "null", "must be a device pointer");
}

inline void require_pool(const SlotPoolView& pool, const char* where) {
  require(pool.pool_size >= 1, where, "pool.pool_size", pool.pool_size, "must be >= 1 (slot 0 is the dummy)");
  require_device_pointers(where, {{"pool.free_stack", pool.free_stack},
                                  {"pool.free_count", pool.free_count},
                                  {"pool.refcount", pool.refcount}});
  require(pool.freed_summary == nullptr || pool.freed != nullptr, where, "pool.freed_summary", "set",
          "needs pool.freed (it marks the bitmap's words)");
}

/// Checks the view's shape; the pointers only when it has rows.
inline void require_tables(const RowTablesView& tables, const char* where) {
  require(tables.rows >= 0, where, "tables.rows", tables.rows, "must be >= 0");
  require(tables.max_seq_len >= 1, where, "tables.max_seq_len", tables.max_seq_len, "must be >= 1");
  if (tables.rows == 0)
    return;
  require_device_pointers(where, {{"tables.slot_table", tables.slot_table},
                                  {"tables.token_table", tables.token_table},
                                  {"tables.seq_len", tables.seq_len},
                                  {"tables.live", tables.live}});
}

/// Checks the Philox keys and draw counters of a RowRandom, and its particles per request.
inline void require_random(const RowRandom& random, const char* where) {
  require_device_pointers(where,
                          {{"random.seeds", random.seeds}, {"random.draw_counters", random.draw_counters}});
  require(random.particles_per_request >= 1, where, "random.particles_per_request",
          random.particles_per_request, "must be >= 1");
}

} // namespace smcgraph::detail
