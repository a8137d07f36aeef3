// Admission (cycle_io.hpp): a request's per-row parameters, its prompt's slots, the first token's commit.
// Each kernel is a thin gather/scatter run eagerly at admit(); every value is read from device memory.
#include "kernels/cycle_io.hpp"
#include "kernels/draft_steps_decide.cuh"
#include "kernels/launch_checks.hpp"

#include <algorithm>

#include "smcgraph/error.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::detail {
namespace {

// What each kernel reads and writes (pointers to const are read only): narrow views of CycleBuffers, filled
// by name (designated initializers, packed: a line per field would repeat one shape in every stage file).
struct RequestRowsView {
  RowTablesView tables; ///< written: live
  int particles = 1;
  float *draft_temperature, *target_temperature, *alpha, *tau;
  uint8_t *finished, *resampled;
  double *logw, *ess, *log_evidence;
  uint32_t *row_flags, *draw_counters;
  uint64_t* seeds;
  DraftStepsPolicy policy;
  int32_t *request_draft_steps, *pinned_draft_steps, *cycle_draft_steps;
  float* acceptance_ema;
};

RequestRowsView request_rows_view(const CycleBuffers& b) {
  // clang-format off
  return {.tables = b.tables, .particles = b.particles, .draft_temperature = b.draft_temperature,
          .target_temperature = b.target_temperature, .alpha = b.alpha, .tau = b.tau, .finished = b.finished,
          .resampled = b.resampled, .logw = b.logw, .ess = b.ess, .log_evidence = b.log_evidence,
          .row_flags = b.row_flags, .draw_counters = b.draw_counters, .seeds = b.seeds, .policy = b.policy,
          .request_draft_steps = b.request_draft_steps, .pinned_draft_steps = b.pinned_draft_steps,
          .cycle_draft_steps = b.cycle_draft_steps, .acceptance_ema = b.acceptance_ema};
  // clang-format on
}

struct AdmitAllocView {
  SlotPoolView pool;    ///< slots popped
  RowTablesView tables; ///< written: slot_table, seq_len, live
  uint32_t *row_flags, *status;
};

AdmitAllocView admit_alloc_view(const CycleBuffers& b) {
  // clang-format off
  return {.pool = b.pool, .tables = b.tables, .row_flags = b.row_flags, .status = b.status};
  // clang-format on
}

struct AdmitFinishView {
  RowTablesView tables; ///< read: live; written: token_table, live
  int particles = 1, eos_id = -1;
  const uint32_t* row_flags;
  uint8_t* finished;
};

AdmitFinishView admit_finish_view(const CycleBuffers& b) {
  // clang-format off
  return {.tables = b.tables, .particles = b.particles, .eos_id = b.eos_id, .row_flags = b.row_flags,
          .finished = b.finished};
  // clang-format on
}

__global__ void InitRequestRowsKernel(RequestRowsView b, int request, uint64_t seed, float draft_temperature,
                                      float target_temperature, float alpha, float tau,
                                      int pinned_draft_steps) {
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
    // The first K is the pin, or the policy's choice at the initial EMA (the seed's thresholds start
    // optimistic, at K_max; the cost-aware rule takes the K it would pick for that EMA). No pressure cap yet:
    // the first cycle's alloc fails the request cleanly if the pool is short.
    const int first_steps = pinned_draft_steps > 0 ? pinned_draft_steps
                            : b.policy.adaptive ? choose_steps(b.policy, b.policy.initial_acceptance, false)
                                                : b.policy.max_steps;
    b.pinned_draft_steps[request] = pinned_draft_steps;
    b.request_draft_steps[request] = first_steps;
    b.cycle_draft_steps[request] = first_steps;
    b.acceptance_ema[request] = b.policy.initial_acceptance;
  }
}

// One thread: admission is rare and eager; slots are popped from the top of the free stack.
__global__ void AdmitAllocKernel(AdmitAllocView b, int row, int prompt_length) {
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

__global__ void AdmitFinishKernel(AdmitFinishView b, int row, int prompt_length, const int32_t* first_token) {
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
                       float target_temperature, float alpha, float tau, int pinned_draft_steps,
                       cudaStream_t stream) {
  require(pinned_draft_steps >= 0 && pinned_draft_steps <= b.draft_steps, "init_request_rows",
          "pinned_draft_steps", pinned_draft_steps, "must be in [0, draft_steps]");
  InitRequestRowsKernel<<<1, std::max(32, b.particles), 0, stream>>>(request_rows_view(b), request, seed,
                                                                     draft_temperature, target_temperature,
                                                                     alpha, tau, pinned_draft_steps);
  SMCGRAPH_CHECK_LAUNCH();
}

void admit_alloc(const CycleBuffers& b, int row, int prompt_length, cudaStream_t stream) {
  AdmitAllocKernel<<<1, 1, 0, stream>>>(admit_alloc_view(b), row, prompt_length);
  SMCGRAPH_CHECK_LAUNCH();
}

void admit_finish(const CycleBuffers& b, int row, int prompt_length, const int32_t* first_token,
                  cudaStream_t stream) {
  AdmitFinishKernel<<<1, 1, 0, stream>>>(admit_finish_view(b), row, prompt_length, first_token);
  SMCGRAPH_CHECK_LAUNCH();
}

void set_int(int32_t* destination, int value, cudaStream_t stream) {
  SetIntKernel<<<1, 1, 0, stream>>>(destination, value);
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace smcgraph::detail
