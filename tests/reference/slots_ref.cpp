#include "reference/slots_ref.hpp"

#include <algorithm>

#include "smcgraph/types.hpp"

namespace smcgraph::reference {

HostSlots::HostSlots(int pool_size_in, int rows_in, int max_seq_len_in)
    : pool_size(pool_size_in), rows(rows_in), max_seq_len(max_seq_len_in),
      free_stack(std::max(pool_size_in - 1, 0)), refcount(pool_size_in),
      slot_table(static_cast<size_t>(rows_in) * max_seq_len_in), token_table(slot_table.size()),
      seq_len(rows_in), live(rows_in) {
  init_slot_pool_ref(*this);
}

SlotCheck HostSlots::check() const {
  return check_slot_invariants(free_stack, free_count, refcount, slot_table, seq_len, live, rows, max_seq_len,
                               pool_size);
}

void init_slot_pool_ref(HostSlots& state) {
  for (int i = 0; i < state.pool_size - 1; ++i)
    state.free_stack[i] = state.pool_size - 1 - i;
  std::fill(state.refcount.begin(), state.refcount.end(), 0);
  state.free_count = state.pool_size - 1;
}

void alloc_cycle_slots_ref(HostSlots& state, int particles, int slots_per_row,
                           std::vector<int32_t>& out_slots, std::vector<uint32_t>& row_flags,
                           uint32_t& status) {
  const int requests = state.rows / particles;
  const int free = state.free_count;
  out_slots.assign(static_cast<size_t>(state.rows) * slots_per_row, 0);
  int popped = 0;
  bool stopped = false; // after the first request that does not fit, every later one that needs slots starves
  for (int request = 0; request < requests; ++request) {
    std::vector<int> live_rows;
    bool too_long = false;
    for (int p = 0; p < particles; ++p) {
      const int row = request * particles + p;
      if (!state.live[row])
        continue;
      live_rows.push_back(row);
      const int length = state.seq_len[row];
      too_long = too_long || length < 0 || length + slots_per_row > state.max_seq_len;
    }
    if (live_rows.empty())
      continue;
    const int need = static_cast<int>(live_rows.size()) * slots_per_row;
    uint32_t refusal = kFlagNone;
    if (too_long) {
      refusal = kFlagMaxLength;
    } else if (stopped || popped + need > free) {
      refusal = kFlagSlotsExhausted;
      stopped = true;
    }
    for (const int row : live_rows) {
      if (refusal != kFlagNone) {
        row_flags[row] |= refusal;
        status |= refusal;
        state.live[row] = 0;
        continue;
      }
      for (int j = 0; j < slots_per_row; ++j) {
        const int32_t slot = state.free_stack[free - 1 - popped++];
        out_slots[static_cast<size_t>(row) * slots_per_row + j] = slot;
        state.slot(row, state.seq_len[row] + j) = slot;
        state.refcount[slot] = 1;
      }
    }
  }
  state.free_count = free - popped;
}

static void change_refs(HostSlots& state, const std::vector<int32_t>& slots, const std::vector<uint8_t>* mask,
                        int delta) {
  for (size_t i = 0; i < slots.size(); ++i) {
    const int32_t slot = slots[i];
    if ((mask != nullptr && !(*mask)[i]) || slot <= 0 || slot >= state.pool_size)
      continue;
    state.refcount[slot] += delta;
    if (delta < 0 && state.refcount[slot] == 0)
      state.free_stack[state.free_count++] = slot;
  }
}

void dec_ref_slots_ref(HostSlots& state, const std::vector<int32_t>& slots,
                       const std::vector<uint8_t>* mask) {
  change_refs(state, slots, mask, -1);
}

void inc_ref_slots_ref(HostSlots& state, const std::vector<int32_t>& slots,
                       const std::vector<uint8_t>* mask) {
  change_refs(state, slots, mask, +1);
}

void release_rows_ref(HostSlots& state, const std::vector<uint8_t>& release_mask) {
  for (int row = 0; row < state.rows; ++row) {
    if (!release_mask[row])
      continue;
    const int length = std::clamp(state.seq_len[row], 0, state.max_seq_len);
    std::vector<int32_t> slots(length);
    for (int j = 0; j < length; ++j)
      slots[j] = state.slot(row, j);
    dec_ref_slots_ref(state, slots, nullptr);
    state.seq_len[row] = 0;
    state.live[row] = 0;
  }
}

void copy_row_refcounted_ref(HostSlots& state, int source, int dst) {
  const int source_length = std::clamp(state.seq_len[source], 0, state.max_seq_len);
  const int dst_length = std::clamp(state.seq_len[dst], 0, state.max_seq_len);
  std::vector<int32_t> old_slots(dst_length), new_slots(source_length);
  for (int j = 0; j < dst_length; ++j)
    old_slots[j] = state.slot(dst, j);
  for (int j = 0; j < source_length; ++j) {
    new_slots[j] = state.slot(source, j);
    state.slot(dst, j) = new_slots[j];
    state.token(dst, j) = state.token(source, j);
  }
  inc_ref_slots_ref(state, new_slots, nullptr);
  dec_ref_slots_ref(state, old_slots, nullptr);
  state.seq_len[dst] = source_length;
  state.live[dst] = state.live[source];
}

void fan_out_rows_ref(HostSlots& state, int particles, const std::vector<uint8_t>& request_mask) {
  for (int row = 0; row < state.rows; ++row) {
    const int request = row / particles;
    if (row % particles != 0 && request_mask[request])
      copy_row_refcounted_ref(state, request * particles, row);
  }
}

template <class T>
static std::string first_difference(const char* name, const std::vector<T>& expected,
                                    const std::vector<T>& actual) {
  if (expected.size() != actual.size())
    return std::string(name) + ": sizes differ";
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] != actual[i]) {
      return std::string(name) + "[" + std::to_string(i) + "]: expected " + std::to_string(expected[i]) +
             ", got " + std::to_string(actual[i]);
    }
  }
  return {};
}

std::string compare_slots(const HostSlots& expected, const HostSlots& actual, bool exact_stack_order) {
  if (expected.pool_size != actual.pool_size || expected.rows != actual.rows ||
      expected.max_seq_len != actual.max_seq_len) {
    return "shapes differ";
  }
  if (expected.free_count != actual.free_count) {
    return "free_count: expected " + std::to_string(expected.free_count) + ", got " +
           std::to_string(actual.free_count);
  }
  std::string problem;
  if (exact_stack_order) {
    problem = first_difference("free_stack", expected.free_stack, actual.free_stack);
  } else {
    const auto live_part = [](const HostSlots& state) {
      std::vector<int32_t> part(state.free_stack.begin(),
                                state.free_stack.begin() + std::max(state.free_count, 0));
      std::sort(part.begin(), part.end());
      return part;
    };
    problem = first_difference("sorted free_stack", live_part(expected), live_part(actual));
  }
  if (problem.empty())
    problem = first_difference("refcount", expected.refcount, actual.refcount);
  if (problem.empty())
    problem = first_difference("slot_table", expected.slot_table, actual.slot_table);
  if (problem.empty())
    problem = first_difference("token_table", expected.token_table, actual.token_table);
  if (problem.empty())
    problem = first_difference("seq_len", expected.seq_len, actual.seq_len);
  if (problem.empty())
    problem = first_difference("live", expected.live, actual.live);
  return problem;
}

void fake_commit_ref(HostSlots& state, int slots_per_row, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> token(0, 50000);
  for (int row = 0; row < state.rows; ++row) {
    if (!state.live[row])
      continue;
    for (int j = 0; j < slots_per_row; ++j)
      state.token(row, state.seq_len[row] + j) = token(rng);
    state.seq_len[row] += slots_per_row;
  }
}

bool admit_ref(HostSlots& state, int particles, int request, int prompt_length, std::mt19937_64& rng,
               bool fan_out) {
  if (prompt_length > state.free_count || prompt_length > state.max_seq_len)
    return false;
  std::uniform_int_distribution<int32_t> token(0, 50000);
  const int first_row = request * particles;
  for (int j = 0; j < prompt_length; ++j) {
    const int32_t slot = state.free_stack[--state.free_count];
    state.refcount[slot] = 1;
    state.slot(first_row, j) = slot;
    state.token(first_row, j) = token(rng);
  }
  state.seq_len[first_row] = prompt_length;
  state.live[first_row] = 1;
  if (!fan_out)
    return true;
  std::vector<uint8_t> mask(state.rows / particles, 0);
  mask[request] = 1;
  fan_out_rows_ref(state, particles, mask);
  return true;
}

HostSlots random_slot_state(std::mt19937_64& rng, int requests, int particles, int max_seq_len,
                            int pool_size) {
  HostSlots state(pool_size, requests * particles, max_seq_len);
  std::uniform_int_distribution<int32_t> junk(-3, pool_size + 3);
  for (int32_t& cell : state.slot_table)
    cell = junk(rng);
  for (int32_t& cell : state.token_table)
    cell = junk(rng);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::uniform_int_distribution<int> prompt(1, std::max(1, max_seq_len / 3));
  const int slots_per_row = 2;
  for (int request = 0; request < requests; ++request) {
    if (coin(rng) < 0.75)
      admit_ref(state, particles, request, prompt(rng), rng);
  }
  const int cycles = std::uniform_int_distribution<int>(0, 3)(rng);
  for (int cycle = 0; cycle < cycles; ++cycle) {
    std::vector<int32_t> out_slots;
    std::vector<uint32_t> row_flags(state.rows, 0);
    uint32_t status = 0;
    alloc_cycle_slots_ref(state, particles, slots_per_row, out_slots, row_flags, status);
    fake_commit_ref(state, slots_per_row, rng);
    // Resampling-like copies: some particles of each request take a surviving sibling's row.
    for (int request = 0; request < requests; ++request) {
      const int first_row = request * particles;
      for (int p = 1; p < particles; ++p) {
        if (coin(rng) < 0.3)
          copy_row_refcounted_ref(state, first_row, first_row + p);
      }
    }
  }
  // Junk above the live part of the stack, as popped entries leave on the device.
  for (int i = state.free_count; i < pool_size - 1; ++i)
    state.free_stack[i] = junk(rng);
  return state;
}

DeviceSlots::DeviceSlots(int pool_size, int rows, int max_seq_len)
    : pool_size_(pool_size), rows_(rows), max_seq_len_(max_seq_len), free_stack_(std::max(pool_size - 1, 1)),
      free_count_(1), refcount_(pool_size), slot_table_(static_cast<size_t>(rows) * max_seq_len),
      token_table_(static_cast<size_t>(rows) * max_seq_len), seq_len_(rows), live_(rows) {}

// Zero-length copies are skipped: an empty host vector may have no storage at all.
template <class T>
static void upload_vector(DeviceBuffer<T>& d_buffer, const std::vector<T>& host, cudaStream_t stream) {
  if (!host.empty())
    d_buffer.copy_from_host(host.data(), host.size(), stream);
}
template <class T>
static void download_vector(const DeviceBuffer<T>& d_buffer, std::vector<T>& host, cudaStream_t stream) {
  if (!host.empty())
    d_buffer.copy_to_host(host.data(), host.size(), stream);
}

void DeviceSlots::upload(const HostSlots& state, cudaStream_t stream) {
  require(state.pool_size == pool_size_ && state.rows == rows_ && state.max_seq_len == max_seq_len_,
          "DeviceSlots::upload", "state", "shape", "must match the device buffers");
  upload_vector(free_stack_, state.free_stack, stream);
  free_count_.copy_from_host(&state.free_count, 1, stream);
  upload_vector(refcount_, state.refcount, stream);
  upload_vector(slot_table_, state.slot_table, stream);
  upload_vector(token_table_, state.token_table, stream);
  upload_vector(seq_len_, state.seq_len, stream);
  upload_vector(live_, state.live, stream);
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream)); // the host vectors may go away after this call
}

HostSlots DeviceSlots::download(cudaStream_t stream) const {
  HostSlots state;
  state.pool_size = pool_size_;
  state.rows = rows_;
  state.max_seq_len = max_seq_len_;
  state.free_stack.resize(std::max(pool_size_ - 1, 0));
  state.refcount.resize(pool_size_);
  state.slot_table.resize(static_cast<size_t>(rows_) * max_seq_len_);
  state.token_table.resize(state.slot_table.size());
  state.seq_len.resize(rows_);
  state.live.resize(rows_);
  download_vector(free_stack_, state.free_stack, stream);
  free_count_.copy_to_host(&state.free_count, 1, stream);
  download_vector(refcount_, state.refcount, stream);
  download_vector(slot_table_, state.slot_table, stream);
  download_vector(token_table_, state.token_table, stream);
  download_vector(seq_len_, state.seq_len, stream);
  download_vector(live_, state.live, stream);
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return state;
}

SlotPoolView DeviceSlots::pool() {
  return {free_stack_.data(), free_count_.data(), refcount_.data(), pool_size_};
}

RowTablesView DeviceSlots::tables() {
  return {slot_table_.data(), token_table_.data(), seq_len_.data(), live_.data(), rows_, max_seq_len_};
}

} // namespace smcgraph::reference
