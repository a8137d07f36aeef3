// The device KV slot pool and the per-row slot/token tables (DESIGN.md §2 steps 1 and 8, admission and
// retirement).
//
// A slot is one token's KV location (page size 1). Free slots sit on a device stack; a slot referenced by
// k rows (shared prompt prefix, resampled siblings) has refcount k and goes back on the stack when the
// last reference is dropped. Slot 0 is the reserved dummy that padding rows and refused rows write to: it
// is never on the free stack and never refcounted.
//
// A row references slot_table[r][0 .. seq_len[r]) whether or not it is live: a row refused by
// alloc_cycle_slots (pool exhausted, max length) turns non-live but keeps its slots until release_rows.
// Rows nobody uses have seq_len 0.
//
//   smcgraph::SlotPoolView pool{d_free_stack, d_free_count, d_refcount, pool_size};
//   smcgraph::RowTablesView tables{d_slot_table, d_token_table, d_seq_len, d_live, rows, max_seq_len};
//   smcgraph::init_slot_pool(pool, stream);                                      // once
//   smcgraph::alloc_cycle_slots(pool, tables, n, k + 1, d_out_slots, d_row_flags, d_status, stream);
//   ...
//   smcgraph::release_rows(pool, tables, d_release_mask, stream);               // retirement
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace smcgraph {

/// The slot pool, all device memory. free_stack[0 .. *free_count) are the free slot ids (the top of the
/// stack is the end); free_stack has room for pool_size - 1 ids, refcount for pool_size.
struct SlotPoolView {
  int32_t* free_stack = nullptr;
  int32_t* free_count = nullptr;
  int32_t* refcount = nullptr;
  int pool_size = 0;
  /// Optional bitmap [ceil(pool_size / 32)], zeroed: when set, a slot whose last reference drops is marked
  /// here instead of pushed at once, and collect_freed_slots pushes the marked slots in ascending id order.
  /// Concurrent pushes land in whatever order the atomics resolve; the bitmap makes the free stack, and so
  /// every later slot id, a deterministic function of the inputs (graph and eager runs give identical
  /// tables).
  uint32_t* freed = nullptr;
  /// Optional with `freed`: a bit per word of it [ceil(ceil(pool_size / 32) / 32)], zeroed, set when the word
  /// gets a mark, so collect_freed_slots reads the words that have marks rather than the whole bitmap.
  uint32_t* freed_summary = nullptr;
};

/// Per-row tables, all device memory, sized once for the largest bucket. Row r belongs to request
/// r / particles_per_request; all particles of a request have the same length.
struct RowTablesView {
  int32_t* slot_table = nullptr;  ///< [rows, max_seq_len] slot ids in position order
  int32_t* token_table = nullptr; ///< [rows, max_seq_len] token ids in position order
  int32_t* seq_len = nullptr;     ///< [rows] L: positions 0 .. L - 1 are referenced
  uint8_t* live = nullptr;        ///< [rows] 1 for rows being decoded
  int rows = 0;
  int max_seq_len = 0;
};

/// Empties the pool: free stack = [pool_size - 1, ..., 1] (so slot 1 is popped first), every refcount 0,
/// free_count = pool_size - 1. Does not touch any table.
void init_slot_pool(const SlotPoolView& pool, cudaStream_t stream);

/// The bulk pop of a cycle (DESIGN.md §2 step 1), one CTA, no host involvement.
///
/// Every live row needs `slots_per_row` new slots for positions L .. L + slots_per_row - 1, granted all or
/// nothing per request (its live rows together). Requests are served in increasing request order through
/// a device prefix sum, and service STOPS at the first request the free slots cannot cover: every later
/// request that needs slots is refused too (first come, first served: a large request is never starved
/// by smaller ones behind it). A request whose rows would pass max_seq_len is refused on its own (it
/// needs nothing, so it blocks nobody).
///
/// Granted rows: out_slots[r, j] = slot_table[r][L + j] = the popped slot, refcount 1; seq_len is NOT
/// advanced (the commit does that) and token_table is untouched. Refused rows: kFlagSlotsExhausted or
/// kFlagMaxLength is OR-ed into row_flags[r] and status[0], live[r] = 0, out_slots[r, *] = 0 (dummy).
/// Non-live rows: out_slots[r, *] = 0. free_count drops by the number granted.
void alloc_cycle_slots(const SlotPoolView& pool, const RowTablesView& tables, int particles_per_request,
                       int slots_per_row, int32_t* out_slots, uint32_t* row_flags, uint32_t* status,
                       cudaStream_t stream);

/// Per-request slot counts (device memory, read at every launch): request q's live rows each need
/// clamp(counts[q] + add, 1, slots_per_row) slots (e.g. its draft length K_q with add = 1). Null counts:
/// slots_per_row for every row.
struct RequestSlotCounts {
  const int32_t* counts = nullptr; ///< [requests]
  int add = 0;
};

/// alloc_cycle_slots with a count per request: row r of request q pops its own count c_q, for positions
/// L .. L + c_q - 1 (the max-length check uses c_q); out_slots keeps the stride slots_per_row and holds the
/// dummy 0 at j >= c_q; slot_table entries past L + c_q - 1 are not written. Pops are in request order as
/// above, so with every c_q = slots_per_row the result is the fixed-count launch's, bit for bit.
void alloc_cycle_slots(const SlotPoolView& pool, const RowTablesView& tables, int particles_per_request,
                       int slots_per_row, const RequestSlotCounts& counts, int32_t* out_slots,
                       uint32_t* row_flags, uint32_t* status, cudaStream_t stream);

/// refcount[slots[i]] -= 1 for every i < count with mask_or_null[i] != 0 (all i when null); a slot that
/// reaches 0 is pushed on the free stack. Slot id 0 (and any id outside the pool) is ignored.
void dec_ref_slots(const SlotPoolView& pool, const int32_t* slots, const uint8_t* mask_or_null, int count,
                   cudaStream_t stream);

/// refcount[slots[i]] += 1, same selection rules as dec_ref_slots.
void inc_ref_slots(const SlotPoolView& pool, const int32_t* slots, const uint8_t* mask_or_null, int count,
                   cudaStream_t stream);

/// Pushes every slot marked in pool.freed onto the free stack in ascending id order and clears the marks
/// (and pool.freed_summary's bits; one CTA; a no-op when pool.freed is null). Launch it after the kernels
/// that release slots.
void collect_freed_slots(const SlotPoolView& pool, cudaStream_t stream);

/// Retirement: for every row with release_mask[r] != 0 (live or not), dec_ref slot_table[r][0 .. L), then
/// live = 0 and seq_len = 0. One CTA per row (static grid).
void release_rows(const SlotPoolView& pool, const RowTablesView& tables, const uint8_t* release_mask,
                  cudaStream_t stream);

/// Admission fan-out: for every request q with request_mask[q] != 0, rows q * N + 1 .. q * N + N - 1 become
/// copies of row q * N (slot_table and token_table up to its length, seq_len, live) and each copied slot
/// gains a reference (a prompt's slots end with refcount N). Whatever a destination row referenced before
/// is released. `request_mask` has rows / N entries.
void fan_out_rows(const SlotPoolView& pool, const RowTablesView& tables, int particles_per_request,
                  const uint8_t* request_mask, cudaStream_t stream);

} // namespace smcgraph
