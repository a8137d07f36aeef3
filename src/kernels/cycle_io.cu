// Admission, forward-input preparation and output packing (see cycle_io.hpp). Each kernel is a thin
// per-row gather/scatter; every value that changes between replays is read from device memory.
#include "kernels/cycle_io.hpp"
#include "kernels/launch_checks.hpp"
#include "kernels/slots_device.cuh"

#include <algorithm>

#include "smcgraph/error.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::detail {
namespace {

constexpr int kThreads = 128;

int blocks_for(int count) {
  return static_cast<int>(ceil_div(count, kThreads));
}

size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

__global__ void InitRequestRowsKernel(CycleBuffers b, int request, uint64_t seed, float draft_temperature,
                                      float target_temperature, float alpha, float tau) {
  const int particle = threadIdx.x;
  if (particle < b.particles) {
    const int row = request * b.particles + particle;
    b.draft_temperature[row] = draft_temperature;
    b.target_temperature[row] = target_temperature;
    b.alpha[row] = alpha;
    b.finished[row] = 0;
    b.logw[row] = 0.0;
    b.row_flags[row] = 0;
    b.tables.live[row] = particle == 0 ? 1 : 0; // the others become live by fan-out
  }
  if (particle == 0) {
    b.seeds[request] = seed;
    b.draw_counters[request] = 0;
    b.tau[request] = tau;
    b.ess[request] = 0.0;
    b.resampled[request] = 0;
    b.log_evidence[request] = 0.0;
  }
}

// One thread: admission is rare and eager; slots are popped from the top of the free stack.
__global__ void AdmitAllocKernel(CycleBuffers b, int row, int prompt_length) {
  const int needed = prompt_length + 1;
  const int available = *b.pool.free_count;
  int32_t* slots = b.tables.slot_table + static_cast<int64_t>(row) * b.tables.max_seq_len;
  if (available < needed) {
    b.tables.live[row] = 0;
    b.tables.seq_len[row] = 0;
    b.row_flags[row] |= kFlagSlotsExhausted;
    atomicOr(b.status, kFlagSlotsExhausted);
    return;
  }
  for (int j = 0; j < needed; ++j) {
    const int32_t slot = b.pool.free_stack[available - 1 - j];
    slots[j] = slot;
    b.pool.refcount[slot] = 1;
  }
  *b.pool.free_count = available - needed;
  b.tables.seq_len[row] = needed;
}

__global__ void AdmitFinishKernel(CycleBuffers b, int row, int prompt_length, const int32_t* first_token) {
  const int32_t token = *first_token;
  if (!b.tables.live[row])
    return;
  if (token < 0 || b.row_flags[row] != 0) {
    b.tables.live[row] = 0;
    return;
  }
  b.tables.token_table[static_cast<int64_t>(row) * b.tables.max_seq_len + prompt_length] = token;
  if (token == b.eos_id) { // EOS first: the request is done before its first cycle, for either cycle kind
    for (int p = 0; p < b.particles; ++p)
      b.finished[row + p] = 1;
    b.tables.live[row] = 0; // no cycle allocates, forwards or commits for it (fan-out copies live)
  }
}

__global__ void SetIntKernel(int32_t* destination, int value) {
  *destination = value;
}

__global__ void PrepareDraftInputsKernel(CycleBuffers b, int rows) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows)
    return;
  const int max_len = b.tables.max_seq_len;
  const bool live = b.tables.live[r] != 0;
  const int L = b.tables.seq_len[r];
  const int32_t* slots = b.tables.slot_table + static_cast<int64_t>(r) * max_len;
  const int32_t* tokens = b.tables.token_table + static_cast<int64_t>(r) * max_len;
  // Live rows have L >= 2 and slots for positions < L + K + 1 (alloc ran first); padding rows point at the
  // dummy slot 0 and position 0.
  for (int j = 0; j < 2; ++j) {
    const int position = L - 2 + j;
    b.head_tokens[2 * r + j] = live ? tokens[position] : 0;
    b.head_positions[2 * r + j] = live ? position : 0;
    b.head_out_slots[2 * r + j] = live ? slots[position] : 0;
  }
  b.head_seq_lens[r] = live ? L : 0;
  for (int s = 1; s < b.steps; ++s) {
    const int position = L + s - 1;
    b.step_positions[(s - 1) * b.max_rows + r] = live ? position : 0;
    b.step_out_slots[(s - 1) * b.max_rows + r] = live ? slots[position] : 0;
    b.step_seq_lens[(s - 1) * b.max_rows + r] = live ? position + 1 : 0;
  }
  for (int j = 0; j <= b.steps; ++j) {
    const int position = L - 1 + j;
    b.verify_positions[r * (b.steps + 1) + j] = live ? position : 0;
    b.verify_out_slots[r * (b.steps + 1) + j] = live ? slots[position] : 0;
  }
  b.verify_seq_lens[r] = live ? L + b.steps : 0;
}

__global__ void PrepareVerifyInputsKernel(CycleBuffers b, int rows) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows)
    return;
  const bool live = b.tables.live[r] != 0;
  const int L = b.tables.seq_len[r];
  int32_t* out = b.verify_tokens + r * (b.steps + 1);
  out[0] = live ? b.tables.token_table[static_cast<int64_t>(r) * b.tables.max_seq_len + L - 1] : 0;
  for (int k = 0; k < b.steps; ++k)
    out[1 + k] = live ? b.draft_tokens[k * b.max_rows + r] : 0;
  if (b.draft_logprobs_rows != nullptr)
    for (int k = 0; k < b.steps; ++k)
      b.draft_logprobs_rows[r * b.steps + k] = b.draft_logprobs[k * b.max_rows + r];
}

__global__ void CommitCycleKernel(CycleBuffers b, int rows) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows)
    return;
  const int stride = b.steps + 1;
  int32_t* cycle = b.cycle_tokens + r * stride;
  if (!b.tables.live[r]) {
    for (int k = 0; k < stride; ++k)
      cycle[k] = kInvalidToken;
    b.committed[r] = 0;
    return;
  }
  const int L = b.tables.seq_len[r];
  int32_t* tokens = b.tables.token_table + static_cast<int64_t>(r) * b.tables.max_seq_len;
  for (int k = 0; k < b.steps; ++k)
    cycle[k] = tokens[L + k] = b.draft_tokens[k * b.max_rows + r];
  cycle[b.steps] = tokens[L + b.steps] = b.bonus_tokens[r];
  b.tables.seq_len[r] = L + stride;
  // first_eos (from the weights): -1 nothing counts (finished before), K none, else the EOS column.
  const int eos = b.first_eos[r];
  b.committed[r] = eos < 0 ? 0 : (eos >= b.steps ? stride : eos + 1);
  if (b.row_flags[r] & kRowDataFaults)
    b.tables.live[r] = 0; // the request fails; its rows stop here
}

__global__ void CommitSpeculativeKernel(CycleBuffers b, int rows) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows)
    return;
  const int stride = b.steps + 1;
  int32_t* cycle = b.cycle_tokens + r * stride;
  if (!b.tables.live[r]) {
    for (int k = 0; k < stride; ++k)
      cycle[k] = kInvalidToken;
    b.committed[r] = 0;
    b.first_eos[r] = -1;
    return;
  }
  const int L = b.tables.seq_len[r];
  const int accepted = min(max(b.accepted[r], 0), b.steps);
  int32_t* tokens = b.tables.token_table + static_cast<int64_t>(r) * b.tables.max_seq_len;
  const int32_t* slots = b.tables.slot_table + static_cast<int64_t>(r) * b.tables.max_seq_len;
  int eos = -1;
  for (int k = 0; k <= accepted; ++k) {
    const int32_t token = k < accepted ? b.draft_tokens[k * b.max_rows + r] : b.next_tokens[r];
    cycle[k] = tokens[L + k] = token;
    if (eos < 0 && token == b.eos_id)
      eos = k;
  }
  for (int k = accepted + 1; k < stride; ++k)
    cycle[k] = kInvalidToken;
  // The slots of rejected positions go back (the KV written there is stale and never read).
  for (int position = L + accepted + 1; position <= L + b.steps; ++position)
    device::release_slot(b.pool, slots[position]);
  b.tables.seq_len[r] = L + accepted + 1;
  b.committed[r] = eos < 0 ? accepted + 1 : eos + 1;
  b.first_eos[r] = eos < 0 ? b.steps : eos;
  if (eos >= 0) {
    b.finished[r] = 1;
    b.tables.live[r] = 0; // a finished speculative row stops decoding
  }
  if (b.row_flags[r] & kRowDataFaults)
    b.tables.live[r] = 0;
}

__global__ void PackOutputsKernel(CycleBuffers b, int rows, uint8_t* out, OutputLayout layout) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  const int requests = rows / b.particles;
  if (r < rows) {
    const int stride = b.steps + 1;
    int32_t* tokens = reinterpret_cast<int32_t*>(out + layout.tokens) + r * stride;
    for (int k = 0; k < stride; ++k)
      tokens[k] = b.cycle_tokens[r * stride + k];
    reinterpret_cast<int32_t*>(out + layout.first_eos)[r] = b.first_eos[r];
    reinterpret_cast<int32_t*>(out + layout.ancestor)[r] = b.particles > 1 ? b.ancestor[r] : r;
    reinterpret_cast<uint32_t*>(out + layout.row_flags)[r] = b.row_flags[r];
    reinterpret_cast<int32_t*>(out + layout.seq_len)[r] = b.tables.seq_len[r];
    reinterpret_cast<int32_t*>(out + layout.committed)[r] = b.committed[r];
    reinterpret_cast<int32_t*>(out + layout.accepted)[r] = b.accepted != nullptr ? b.accepted[r] : 0;
    out[layout.finished + r] = b.finished[r];
    out[layout.live + r] = b.tables.live[r];
  }
  if (r < requests) {
    out[layout.resampled + r] = b.resampled[r];
    reinterpret_cast<double*>(out + layout.ess)[r] = b.ess[r];
  }
  if (r == 0)
    *reinterpret_cast<uint32_t*>(out + layout.status) = *b.status;
}

} // namespace

OutputLayout output_layout(int rows, int requests, int steps) {
  OutputLayout layout;
  size_t offset = 0;
  auto take = [&](size_t bytes, size_t alignment) {
    offset = align_up(offset, alignment);
    const size_t at = offset;
    offset += bytes;
    return at;
  };
  layout.ess = take(sizeof(double) * requests, 8);
  layout.tokens = take(sizeof(int32_t) * rows * (steps + 1), 4);
  layout.first_eos = take(sizeof(int32_t) * rows, 4);
  layout.ancestor = take(sizeof(int32_t) * rows, 4);
  layout.row_flags = take(sizeof(uint32_t) * rows, 4);
  layout.seq_len = take(sizeof(int32_t) * rows, 4);
  layout.committed = take(sizeof(int32_t) * rows, 4);
  layout.accepted = take(sizeof(int32_t) * rows, 4);
  layout.status = take(sizeof(uint32_t), 4);
  layout.finished = take(rows, 1);
  layout.live = take(rows, 1);
  layout.resampled = take(requests, 1);
  layout.bytes = align_up(offset, 8);
  return layout;
}

void init_request_rows(const CycleBuffers& b, int request, uint64_t seed, float draft_temperature,
                       float target_temperature, float alpha, float tau, cudaStream_t stream) {
  InitRequestRowsKernel<<<1, std::max(32, b.particles), 0, stream>>>(b, request, seed, draft_temperature,
                                                                     target_temperature, alpha, tau);
  SMCGRAPH_CHECK_LAUNCH();
}

void admit_alloc(const CycleBuffers& b, int row, int prompt_length, cudaStream_t stream) {
  AdmitAllocKernel<<<1, 1, 0, stream>>>(b, row, prompt_length);
  SMCGRAPH_CHECK_LAUNCH();
}

void admit_finish(const CycleBuffers& b, int row, int prompt_length, const int32_t* first_token,
                  cudaStream_t stream) {
  AdmitFinishKernel<<<1, 1, 0, stream>>>(b, row, prompt_length, first_token);
  SMCGRAPH_CHECK_LAUNCH();
}

void set_int(int32_t* destination, int value, cudaStream_t stream) {
  SetIntKernel<<<1, 1, 0, stream>>>(destination, value);
  SMCGRAPH_CHECK_LAUNCH();
}

void prepare_draft_inputs(const CycleBuffers& b, int rows, cudaStream_t stream) {
  PrepareDraftInputsKernel<<<blocks_for(rows), kThreads, 0, stream>>>(b, rows);
  SMCGRAPH_CHECK_LAUNCH();
}

void prepare_verify_inputs(const CycleBuffers& b, int rows, cudaStream_t stream) {
  PrepareVerifyInputsKernel<<<blocks_for(rows), kThreads, 0, stream>>>(b, rows);
  SMCGRAPH_CHECK_LAUNCH();
}

void commit_cycle(const CycleBuffers& b, int rows, cudaStream_t stream) {
  CommitCycleKernel<<<blocks_for(rows), kThreads, 0, stream>>>(b, rows);
  SMCGRAPH_CHECK_LAUNCH();
}

void commit_speculative(const CycleBuffers& b, int rows, cudaStream_t stream) {
  CommitSpeculativeKernel<<<blocks_for(rows), kThreads, 0, stream>>>(b, rows);
  SMCGRAPH_CHECK_LAUNCH();
}

void pack_outputs(const CycleBuffers& b, int rows, uint8_t* out, cudaStream_t stream) {
  const OutputLayout layout = output_layout(rows, rows / b.particles, b.steps);
  PackOutputsKernel<<<blocks_for(rows), kThreads, 0, stream>>>(b, rows, out, layout);
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace smcgraph::detail
