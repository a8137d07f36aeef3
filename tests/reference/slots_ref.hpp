// Host reference of the slot-pool kernels (src/kernels/slots.cu), a device mirror of the same state for
// the GPU tests, and helpers that build random consistent states.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "runtime/slot_checker.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/slots.hpp"

namespace smcgraph::reference {

/// Pool and tables on the host, laid out like the device views.
struct HostSlots {
  int pool_size = 0, rows = 0, max_seq_len = 0;
  std::vector<int32_t> free_stack; ///< pool_size - 1 entries; [0, free_count) are free
  int32_t free_count = 0;
  std::vector<int32_t> refcount;    ///< [pool_size]
  std::vector<int32_t> slot_table;  ///< [rows, max_seq_len]
  std::vector<int32_t> token_table; ///< [rows, max_seq_len]
  std::vector<int32_t> seq_len;     ///< [rows]
  std::vector<uint8_t> live;        ///< [rows]

  HostSlots() = default;
  /// Empty tables and an initialised pool.
  HostSlots(int pool_size, int rows, int max_seq_len);
  int32_t& slot(int row, int position) { return slot_table[cell(row, position)]; }
  int32_t slot(int row, int position) const { return slot_table[cell(row, position)]; }
  int32_t& token(int row, int position) { return token_table[cell(row, position)]; }
  int32_t token(int row, int position) const { return token_table[cell(row, position)]; }
  size_t cell(int row, int position) const { return static_cast<size_t>(row) * max_seq_len + position; }
  SlotCheck check() const;
};

void init_slot_pool_ref(HostSlots& state);
/// Same semantics as alloc_cycle_slots (serve in request order, stop at the first that does not fit).
void alloc_cycle_slots_ref(HostSlots& state, int particles_per_request, int slots_per_row,
                           std::vector<int32_t>& out_slots, std::vector<uint32_t>& row_flags,
                           uint32_t& status);
/// Pushes happen in index order (the device order is unspecified: compare free stacks as sets).
void dec_ref_slots_ref(HostSlots& state, const std::vector<int32_t>& slots, const std::vector<uint8_t>* mask);
void inc_ref_slots_ref(HostSlots& state, const std::vector<int32_t>& slots, const std::vector<uint8_t>* mask);
void release_rows_ref(HostSlots& state, const std::vector<uint8_t>& release_mask);
void fan_out_rows_ref(HostSlots& state, int particles_per_request, const std::vector<uint8_t>& request_mask);
/// Row `dst` becomes a copy of row `source` with refcounts moved (the body of fan-out and reshuffle).
void copy_row_refcounted_ref(HostSlots& state, int source, int dst);

/// Empty string when equal, else the first difference. The free stacks' live part [0, free_count) is
/// compared in order when `exact_stack_order`, else as a set (device pushes race for positions); the
/// entries above free_count are compared only when exact. Every table cell is compared.
std::string compare_slots(const HostSlots& expected, const HostSlots& actual, bool exact_stack_order);

/// Test helper: the commit of a cycle. Every live row gains `slots_per_row` positions (whose slots
/// alloc_cycle_slots already wrote) with random tokens.
void fake_commit_ref(HostSlots& state, int slots_per_row, std::mt19937_64& rng);

/// Test helper: admits request `request` (whose rows must be empty) with a `prompt_length`-token prompt by
/// popping from the host stack into its first row (as the engine's admission would), then fans out unless
/// `fan_out` is false; false when the pool is too small.
bool admit_ref(HostSlots& state, int particles_per_request, int request, int prompt_length,
               std::mt19937_64& rng, bool fan_out = true);

/// Test helper: a random consistent state. Some requests are admitted, decoded for a few cycles with random
/// resampling-like row copies; unreferenced table cells and stack entries above free_count hold junk so
/// kernels that read or write past the live data are caught.
HostSlots random_slot_state(std::mt19937_64& rng, int requests, int particles_per_request, int max_seq_len,
                            int pool_size);

/// The same state in device memory (for the GPU tests).
class DeviceSlots {
public:
  DeviceSlots(int pool_size, int rows, int max_seq_len);
  void upload(const HostSlots& state, cudaStream_t stream);
  HostSlots download(cudaStream_t stream) const; ///< synchronizes
  SlotPoolView pool();
  RowTablesView tables();

private:
  int pool_size_, rows_, max_seq_len_;
  DeviceBuffer<int32_t> free_stack_, free_count_, refcount_, slot_table_, token_table_, seq_len_;
  DeviceBuffer<uint8_t> live_;
};

} // namespace smcgraph::reference
