// Admission (cycle_io.hpp): a request's per-row parameters, its prompt's slots, the first token's commit.
// Each kernel is a thin gather/scatter run eagerly at admit(); every value is read from device memory.
#include "kernels/cycle_io.hpp"
#include "kernels/launch_checks.hpp"

#include <algorithm>

#include "smcgraph/error.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::detail {
namespace {

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

} // namespace

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

} // namespace smcgraph::detail
