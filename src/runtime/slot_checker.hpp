// The slot invariant checker (internal: tests, benches and the soak use it; src/runtime/slot_checker.cpp):
// the pool of include/smcgraph/slots.hpp checked against the row tables on the host.
//
//   assert(smcgraph::check_slot_invariants_device(pool, tables, stream).ok);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "smcgraph/engine.hpp"
#include "smcgraph/slots.hpp"

namespace smcgraph {

/// Result of the slot invariant check.
struct SlotCheck {
  bool ok = true;
  std::string problem; ///< the first violation found, empty when ok
  int free = 0;        ///< free_count
  int referenced = 0;  ///< distinct slots referenced by the tables
};

/// Host check of the pool against the tables: ids in range; no id twice on the free stack; slot 0 never
/// free, never referenced, refcount 0; every slot's refcount equals the number of references to it
/// (slot_table[r][0 .. seq_len[r]) over all rows); free slots have refcount 0; free + referenced ==
/// pool_size - 1 (no slot leaked). `slot_table` is [rows, max_seq_len]; `free_stack` holds at least
/// free_count ids.
SlotCheck check_slot_invariants(const std::vector<int32_t>& free_stack, int free_count,
                                const std::vector<int32_t>& refcount, const std::vector<int32_t>& slot_table,
                                const std::vector<int32_t>& seq_len, const std::vector<uint8_t>& live,
                                int rows, int max_seq_len, int pool_size);

/// Copies pool and tables to the host (synchronizing `stream`) and runs check_slot_invariants. For tests
/// and debugging; not capturable.
SlotCheck check_slot_invariants_device(const SlotPoolView& pool, const RowTablesView& tables,
                                       cudaStream_t stream);

/// Waits for the engine and checks its slot pool against all of its rows' tables (through Engine::inspect).
SlotCheck check_engine_slots(Engine& engine);

} // namespace smcgraph
