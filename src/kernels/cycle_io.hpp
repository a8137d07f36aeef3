// Small kernels that move data between the engine's tables and the model/sampler buffers of a cycle:
// admission (row init, prompt slots, first token), forward inputs, commit and the per-cycle output block.
// Internal to the library (graphs/ and src/runtime/ use them). One file per stage: admission.cu,
// forward_inputs.cu, commit.cu, output_packing.cu.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "smcgraph/engine.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/smc_kernels.hpp"
#include "smcgraph/verify.hpp"

namespace smcgraph::detail {

/// The draft-length rule of AdaptiveDraftSteps as the kernels read it (fixed for the engine's lifetime, so
/// it may be a launch argument): K_max = max_steps, the watermark in slots.
struct DraftStepsPolicy {
  bool adaptive = false; ///< false: every request keeps its pin (draft_steps when none was given)
  int min_steps = 1, mid_steps = 1, max_steps = 1, pressure_cap = 1;
  int pressure_watermark_slots = 0; ///< KV pressure while free_count < this
  float smoothing = 0.2f, initial_acceptance = 0.8f, high_threshold = 0.8f, low_threshold = 0.5f;
  float draft_cost = 0.0f;    ///< > 0: the cost-aware rule (AdaptiveDraftSteps::draft_cost)
  float idle_recovery = 0.0f; ///< the EMA's step toward 1 after a K = 0 cycle (AdaptiveDraftSteps)
};
DraftStepsPolicy draft_steps_policy(const EngineConfig& config);

/// Device buffers every cycle kernel reads or writes (fixed addresses, sized for the largest bucket; declared
/// and wired by the cycle-state table, runtime/cycle_state.cpp). The launchers below take it whole; each
/// kernel receives a narrow view of it, declared in its stage file, that lists what it reads (pointers to
/// const) and writes.
struct CycleBuffers {
  SlotPoolView pool;
  RowTablesView tables; ///< rows = the largest bucket's rows
  int particles = 1;    ///< N
  int draft_steps = 1;  ///< K (EngineConfig::draft_steps)
  int max_rows = 0;     ///< rows of the largest bucket (= tables.rows)
  // per row [rows]: the row's temperatures and alpha, whether it finished, its log-weight and fault flags
  float *draft_temperature = nullptr, *target_temperature = nullptr, *alpha = nullptr;
  uint8_t* finished = nullptr;
  double* logw = nullptr;
  uint32_t* row_flags = nullptr;
  // per request [requests]: the Philox key and draw counter, resampling threshold and the SMC results
  uint64_t* seeds = nullptr;
  uint32_t* draw_counters = nullptr;
  float* tau = nullptr;
  double *ess = nullptr, *log_evidence = nullptr;
  uint8_t* resampled = nullptr;
  uint32_t* status = nullptr;         ///< [1]
  uint32_t* collect_ticket = nullptr; ///< [1] zeroed; the launches that fold collect_freed_slots in reset it
  // forward inputs
  int32_t* head_tokens = nullptr;      ///< [rows, 2]
  int32_t* head_positions = nullptr;   ///< [rows, 2]
  int32_t* head_out_slots = nullptr;   ///< [rows, 2]
  int32_t* head_seq_lens = nullptr;    ///< [rows]
  int32_t* step_positions = nullptr;   ///< [K - 1, rows]
  int32_t* step_out_slots = nullptr;   ///< [K - 1, rows]
  int32_t* step_seq_lens = nullptr;    ///< [K - 1, rows]
  int32_t* verify_positions = nullptr; ///< [rows, K + 1]
  int32_t* verify_out_slots = nullptr; ///< [rows, K + 1]
  int32_t* verify_seq_lens = nullptr;  ///< [rows]
  // sampler / scorer outputs
  int32_t* cycle_slots = nullptr; ///< [rows, K + 1] popped by alloc
  // The draft block, [rows, K + 1] end to end: column k of row r holds d_k (k >= 1), written by the draft
  // sampler of step k - 1, read by draft step k's forward, the target's verify forward (column 0 is
  // x_{L-1}), score, the weights or the verifier, and the commit.
  int32_t* draft_tokens = nullptr;  ///< [rows, K + 1]: x_{L-1}, d_1 .. d_K
  float* draft_logprobs = nullptr;  ///< [rows, K + 1]: 0, log q(d_1) .. log q(d_K)
  float* scratch_logz = nullptr;    ///< [rows] (draft samples' logZ, unused: alpha = 1 for the draft)
  float* target_logprobs = nullptr; ///< [rows, K]
  int32_t* bonus_tokens = nullptr;  ///< [rows]
  float* bonus_logprobs = nullptr;  ///< [rows]
  float* bonus_logz = nullptr;      ///< [rows]
  int32_t* first_eos = nullptr;     ///< [rows]
  int32_t* ancestor = nullptr;      ///< [rows]
  int32_t* cycle_tokens = nullptr;  ///< [rows, K + 1] tokens committed this cycle
  int32_t* committed = nullptr;     ///< [rows] how many of them count (EOS cut; accepted + 1 for spec)
  int eos_id = -1;
  // speculative cycle
  int32_t* accepted = nullptr;       ///< [rows] draft tokens accepted
  int32_t* next_tokens = nullptr;    ///< [rows] correction or bonus token
  int32_t* packed_offsets = nullptr; ///< [rows] exclusive offsets of the packed accepted tokens
  int32_t* packed_total = nullptr;   ///< [1]
  int32_t* packed_tokens = nullptr;  ///< [rows * K] accepted draft tokens, packed
  float* packed_logprobs = nullptr;  ///< [rows * K] their target log-probs, packed
  // per-request draft length (draft_steps.cu); K_q below is clamp(request_draft_steps[q], 1, K)
  DraftStepsPolicy policy;
  int32_t* request_draft_steps = nullptr; ///< [requests] K_q of the next cycle (decided on the device)
  int32_t* pinned_draft_steps = nullptr;  ///< [requests] the request's fixed K, 0: adaptive
  float* acceptance_ema = nullptr;        ///< [requests] EMA of accepted / K_q
  int32_t* cycle_draft_steps = nullptr;   ///< [requests] K_q of the cycle just run (outputs)
  uint8_t* step_live = nullptr;           ///< [K - 1, rows] row drafts at step s (live and s < K_q)
  /// The verify resumes after the draft's layers (Engine::resumed_layers): step s then also runs for rows
  /// with s = K_q (live in step_live), whose d_{K_q} must hand its residual and its KV of the draft's layers
  /// over (its sample, d_{K_q + 1}, is never read).
  bool hand_over_last_draft = false;
  int32_t* decision_free_slots = nullptr; ///< [1] free slots when the next K was chosen
  uint8_t* kv_pressure = nullptr;         ///< [1] 1 when they were under the watermark
};

/// Byte layout of the per-cycle output block for `rows` rows / `requests` requests (what poll() reads).
struct OutputLayout {
  size_t tokens = 0;            ///< int32 [rows, K + 1]
  size_t first_eos = 0;         ///< int32 [rows]
  size_t ancestor = 0;          ///< int32 [rows]
  size_t row_flags = 0;         ///< uint32 [rows]
  size_t seq_len = 0;           ///< int32 [rows]
  size_t finished = 0;          ///< uint8 [rows]
  size_t live = 0;              ///< uint8 [rows]
  size_t committed = 0;         ///< int32 [rows]
  size_t accepted = 0;          ///< int32 [rows] (speculative)
  size_t resampled = 0;         ///< uint8 [requests]
  size_t cycle_draft_steps = 0; ///< int32 [requests] K_q of this cycle
  size_t next_draft_steps = 0;  ///< int32 [requests] K_q of the next one
  size_t acceptance_ema = 0;    ///< float [requests]
  size_t kv_pressure = 0;       ///< uint8
  size_t ess = 0;               ///< double [requests]
  size_t status = 0;            ///< uint32
  size_t bytes = 0;
};
OutputLayout output_layout(int rows, int requests, int draft_steps);

// Admission (eager).
/// `pinned_draft_steps` 0 makes the request adaptive: its EMA the initial value, its first K the policy's
/// choice for it (K_max with the seed's thresholds).
void init_request_rows(const CycleBuffers& b, int request, uint64_t seed, float draft_temperature,
                       float target_temperature, float alpha, float tau, int pinned_draft_steps,
                       cudaStream_t stream);
/// Pops prompt_length + 1 slots for `row` (positions 0 .. P) if the pool has them: seq_len = P + 1;
/// else kFlagSlotsExhausted and live = 0.
void admit_alloc(const CycleBuffers& b, int row, int prompt_length, cudaStream_t stream);
/// token_table[row][P] = *first_token, or live = 0 if the sample failed. A first token equal to eos_id
/// finishes the request's N rows and stops them (live = 0): the request is complete before its first cycle.
void admit_finish(const CycleBuffers& b, int row, int prompt_length, const int32_t* first_token,
                  cudaStream_t stream);
void set_int(int32_t* destination, int value, cudaStream_t stream);

// The cycle.
/// The conditions of a captured speculative cycle's conditional nodes (graphs/draft_and_verify.cpp): handle
/// s - 1 is the IF node of draft step s (s = 1 .. count), whose then-branch runs step s and whose else-branch
/// verifies s + 1 columns and runs the rest of the cycle. Graph replays only (cudaGraphSetConditional).
struct DraftLoopConditions {
  unsigned long long handles[kMaxDraftSteps] = {}; ///< cudaGraphConditionalHandle of step s at s - 1
  int count = 0;                                   ///< 0: no conditional nodes (eager, SMC, K = 1)
  /// The draft head's node (AdaptiveDraftSteps::min_steps = 0): set to m > 0. 0: none.
  unsigned long long head = 0;
};
/// Forward inputs of the draft head and steps; a row drafts its request's K_q steps (step_live; with
/// b.hand_over_last_draft also step K_q, which forwards d_{K_q} for the resumed verify), the later
/// steps write the dummy slot and the verify positions past K_q repeat position L - 1 + K_q. With
/// conditions.count > 0 the same launch sets condition s to (s < m), m = max K_q over the live rows (0 when
/// none is live), so a captured cycle runs m - 1 draft steps and verifies max(m, 1) + 1 columns.
void prepare_draft_inputs(const CycleBuffers& b, int rows, cudaStream_t stream,
                          const DraftLoopConditions& conditions = {});
/// The top of a cycle in one launch (one CTA): the status word cleared, alloc_cycle_slots(b.pool, the
/// bucket's tables, b.particles, slots_per_row, counts, b.cycle_slots, b.row_flags, b.status) and then
/// prepare_draft_inputs(b, rows, stream, conditions) on the tables alloc wrote. The recipes use it; the
/// stages keep their own entry points and host references.
void alloc_and_prepare_draft_inputs(const CycleBuffers& b, int rows, int slots_per_row,
                                    const RequestSlotCounts& counts, cudaStream_t stream,
                                    const DraftLoopConditions& conditions = {});
void prepare_verify_inputs(const CycleBuffers& b, int rows, cudaStream_t stream);
/// Writes this cycle's tokens into the token table and cycle_tokens, L += K + 1, and turns rows with a
/// fault flag non-live (their request fails). `weights` (optional): the weights stage folded into the same
/// launch, accumulate_weights(*weights, b.logw, b.finished, b.first_eos) row by row, each row's weight before
/// its commit (which reads first_eos); weights->rows must be `rows`.
void commit_cycle(const CycleBuffers& b, int rows, cudaStream_t stream,
                  const WeightInputs* weights = nullptr);
/// The SMC cycle's end after the score, in one launch: commit_cycle(b, rows, stream, &weights) (the weights
/// folded in), resample({tables.live, b.tau, b.seeds, b.draw_counters, requests, N}, b.logw, {b.ancestor,
/// b.ess, b.resampled, b.log_evidence}) and reshuffle_and_collect(b, tables) (commit.cu: a CTA a request,
/// the stages meet at CTA barriers). `tables` holds the bucket's rows, requests * N of them. The
/// recipe uses it; the three stages keep their own entry points and host references.
void smc_cycle_end(const CycleBuffers& b, const RowTablesView& tables, int requests,
                   const WeightInputs& weights, cudaStream_t stream);
/// Speculative commit: d_1 .. d_k and the next token into the table, L += k + 1, the slots of the
/// rejected positions L + k + 1 .. L + K released (collect_freed_slots pushes them), EOS finishes the row.
/// `collect_freed`: collect_freed_slots(b.pool) folded into the same launch (its last CTA, after every
/// row's releases; b.collect_ticket counts the CTAs).
void commit_speculative(const CycleBuffers& b, int rows, cudaStream_t stream, bool collect_freed = false);
/// End of a speculative cycle: for every request that drafted (committed > 0) the EMA takes accepted / K_q,
/// and K_q of the next cycle follows the policy (pins kept); cycle_draft_steps keeps this cycle's K_q. Reads
/// free_count after the cycle's frees were collected. `accepted` null (SMC): the EMA does not move.
/// advance_draw_counters: also draw_counters[q] += 1 for q < requests (the recipe's draw-counter stage folded
/// into this launch; the cycle's draws are all done by then).
void decide_draft_steps(const CycleBuffers& b, int requests, const int32_t* accepted, cudaStream_t stream,
                        bool advance_draw_counters = false);
/// reshuffle(b.pool, tables, b.ancestor, b.finished) and collect_freed_slots(b.pool) in one launch (its last
/// CTA collects after every row's copy; b.collect_ticket counts the CTAs). `tables` holds the bucket's rows.
void reshuffle_and_collect(const CycleBuffers& b, const RowTablesView& tables, cudaStream_t stream);
/// The argument checks of resample() and of reshuffle_and_collect(), for the launches that fold those stages
/// in (smc_cycle_end); errors name `where`.
void check_resample(const ResampleInputs& in, const double* logw, const ResampleOutputs& out,
                    const char* where);
void check_reshuffle_and_collect(const CycleBuffers& b, const RowTablesView& tables, const char* where);
/// Packs the bucket's outputs into `out` (layout output_layout(rows, rows / N, K)).
void pack_outputs(const CycleBuffers& b, int rows, uint8_t* out, cudaStream_t stream);
/// The end of a cycle in one launch: decide_draft_steps(b, requests, accepted, stream, true) and then
/// pack_outputs(b, requests * particles, out, stream) (thread q decides request q before it packs request q's
/// values). The recipes use it; the two stages keep their own entry points and host references.
void decide_and_pack_outputs(const CycleBuffers& b, int requests, const int32_t* accepted, uint8_t* out,
                             cudaStream_t stream);
/// The end of a speculative cycle: with K > 0 the pack of the accepted draft tokens and their target
/// log-probs (pack_accepted into b.packed_*), then commit_speculative(b, rows, stream, true) (the collect
/// folded in) and decide_and_pack_outputs(b, requests, b.accepted, out, stream). One single-CTA launch when
/// the bucket's rows fit one CTA (1024; the pack then by pack_device.cuh), those three launches otherwise
/// (`pack_workspace` serves only them).
void commit_speculative_and_pack_outputs(const CycleBuffers& b, int requests, uint8_t* out,
                                         PackWorkspace& pack_workspace, cudaStream_t stream);

} // namespace smcgraph::detail
