// Host check of the slot pool against the row tables (slot_checker.hpp), and its device convenience wrapper.
#include <string>
#include <vector>

#include "smcgraph/error.hpp"
#include "runtime/slot_checker.hpp"

namespace smcgraph {
namespace {

SlotCheck fail(std::string problem) {
  SlotCheck check;
  check.ok = false;
  check.problem = std::move(problem);
  return check;
}

} // namespace

SlotCheck check_slot_invariants(const std::vector<int32_t>& free_stack, int free_count,
                                const std::vector<int32_t>& refcount, const std::vector<int32_t>& slot_table,
                                const std::vector<int32_t>& seq_len, const std::vector<uint8_t>& live,
                                int rows, int max_seq_len, int pool_size) {
  using std::to_string;
  if (pool_size < 1)
    return fail("pool_size = " + to_string(pool_size) + " < 1");
  if (rows < 0 || max_seq_len < 1)
    return fail("bad table shape " + to_string(rows) + " x " + to_string(max_seq_len));
  if (refcount.size() != static_cast<size_t>(pool_size))
    return fail("refcount has " + to_string(refcount.size()) + " entries");
  if (slot_table.size() != static_cast<size_t>(rows) * max_seq_len ||
      seq_len.size() != static_cast<size_t>(rows) || live.size() != static_cast<size_t>(rows)) {
    return fail("table sizes do not match rows = " + to_string(rows));
  }
  if (free_count < 0 || free_count > pool_size - 1)
    return fail("free_count = " + to_string(free_count) + " out of range");
  if (free_stack.size() < static_cast<size_t>(free_count))
    return fail("free_stack shorter than free_count");

  std::vector<uint8_t> is_free(pool_size, 0);
  for (int i = 0; i < free_count; ++i) {
    const int32_t slot = free_stack[i];
    if (slot < 1 || slot >= pool_size) {
      return fail("free_stack[" + to_string(i) + "] = " + to_string(slot) +
                  " is not a slot id in [1, pool_size)");
    }
    if (is_free[slot])
      return fail("slot " + to_string(slot) + " is on the free stack twice");
    is_free[slot] = 1;
  }

  std::vector<int64_t> references(pool_size, 0);
  for (int r = 0; r < rows; ++r) {
    if (live[r] > 1)
      return fail("live[" + to_string(r) + "] = " + to_string(live[r]) + " is not 0 or 1");
    const int length = seq_len[r];
    if (length < 0 || length > max_seq_len)
      return fail("seq_len[" + to_string(r) + "] = " + to_string(length) + " out of range");
    for (int j = 0; j < length; ++j) {
      const int32_t slot = slot_table[static_cast<size_t>(r) * max_seq_len + j];
      if (slot < 1 || slot >= pool_size) {
        return fail("slot_table[" + to_string(r) + "][" + to_string(j) + "] = " + to_string(slot) +
                    " is not a slot id in [1, pool_size)");
      }
      ++references[slot];
    }
  }

  if (refcount[0] != 0)
    return fail("the dummy slot 0 has refcount " + to_string(refcount[0]));
  int referenced = 0;
  for (int slot = 1; slot < pool_size; ++slot) {
    if (is_free[slot] && references[slot] > 0) {
      return fail("slot " + to_string(slot) + " is free but referenced " + to_string(references[slot]) +
                  " times");
    }
    if (is_free[slot] && refcount[slot] != 0) {
      return fail("free slot " + to_string(slot) + " has refcount " + to_string(refcount[slot]));
    }
    if (refcount[slot] != references[slot]) {
      return fail("slot " + to_string(slot) + " has refcount " + to_string(refcount[slot]) + " but " +
                  to_string(references[slot]) + " references");
    }
    if (!is_free[slot] && references[slot] == 0)
      return fail("slot " + to_string(slot) + " is neither free nor referenced (leaked)");
    referenced += references[slot] > 0 ? 1 : 0;
  }
  if (free_count + referenced != pool_size - 1)
    return fail("free + referenced != pool_size - 1");
  SlotCheck check;
  check.free = free_count;
  check.referenced = referenced;
  return check;
}

SlotCheck check_slot_invariants_device(const SlotPoolView& pool, const RowTablesView& tables,
                                       cudaStream_t stream) {
  constexpr const char* kWhere = "check_slot_invariants_device";
  require(pool.pool_size >= 1, kWhere, "pool.pool_size", pool.pool_size, "must be >= 1");
  require(pool.free_stack != nullptr && pool.free_count != nullptr && pool.refcount != nullptr, kWhere,
          "pool", "null pointer", "needs device pointers");
  require(tables.rows >= 0 && tables.max_seq_len >= 1, kWhere, "tables.rows", tables.rows,
          "needs rows >= 0 and max_seq_len >= 1");
  const size_t rows = static_cast<size_t>(tables.rows), cells = rows * tables.max_seq_len;
  int32_t free_count = 0;
  std::vector<int32_t> free_stack(pool.pool_size - 1), refcount(pool.pool_size), slot_table(cells),
      seq_len(rows);
  std::vector<uint8_t> live(rows);
  auto copy = [stream](void* h_destination, const void* d_source, size_t bytes) {
    if (bytes > 0)
      SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(h_destination, d_source, bytes, cudaMemcpyDeviceToHost, stream));
  };
  copy(&free_count, pool.free_count, sizeof(int32_t));
  copy(free_stack.data(), pool.free_stack, free_stack.size() * sizeof(int32_t));
  copy(refcount.data(), pool.refcount, refcount.size() * sizeof(int32_t));
  if (rows > 0) {
    copy(slot_table.data(), tables.slot_table, cells * sizeof(int32_t));
    copy(seq_len.data(), tables.seq_len, rows * sizeof(int32_t));
    copy(live.data(), tables.live, rows * sizeof(uint8_t));
  }
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return check_slot_invariants(free_stack, free_count, refcount, slot_table, seq_len, live, tables.rows,
                               tables.max_seq_len, pool.pool_size);
}

SlotCheck check_engine_slots(Engine& engine) {
  const EngineConfig& c = engine.config();
  const int32_t free_count = engine.inspect("free_count").as<int32_t>().at(0);
  return check_slot_invariants(
      engine.inspect("free_stack").as<int32_t>(), free_count, engine.inspect("refcount").as<int32_t>(),
      engine.inspect("slot_table").as<int32_t>(), engine.inspect("seq_len").as<int32_t>(),
      engine.inspect("live").as<uint8_t>(), c.max_requests * c.particles, c.max_seq_len, c.slot_pool_size);
}

} // namespace smcgraph
