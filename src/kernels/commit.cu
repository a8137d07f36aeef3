// Commit (cycle_io.hpp): the cycle's tokens into the tables and lengths of every live row, for the SMC cycle
// (K + 1 tokens) and the speculative one (accepted + 1, rejected slots back to the pool).
#include "kernels/pdl.cuh"
#include "kernels/cycle_io.hpp"
#include "kernels/draft_steps_device.cuh"
#include "kernels/output_packing_device.cuh"
#include "kernels/pack_device.cuh"
#include "kernels/prefix_load.cuh"
#include "kernels/resample_device.cuh"
#include "kernels/reshuffle_device.cuh"
#include "kernels/row_launch.cuh"
#include "kernels/slots_device.cuh"
#include "kernels/weights_device.cuh"

#include <algorithm>

#include "smcgraph/error.hpp"
#include "smcgraph/types.hpp"
#include "smcgraph/verify.hpp"

namespace smcgraph::detail {
namespace {

// What each kernel reads and writes (pointers to const are read only): narrow views of CycleBuffers, filled
// by name (designated initializers, packed: a line per field would repeat one shape in every stage file).
struct CommitView {
  RowTablesView tables; ///< read: live, seq_len; written: token_table, seq_len, live
  int draft_steps = 1;
  const int32_t *draft_tokens, *bonus_tokens, *first_eos;
  const uint32_t* row_flags;
  int32_t *cycle_tokens, *committed;
};

CommitView commit_view(const CycleBuffers& b) {
  // clang-format off
  return {.tables = b.tables, .draft_steps = b.draft_steps, .draft_tokens = b.draft_tokens,
          .bonus_tokens = b.bonus_tokens, .first_eos = b.first_eos, .row_flags = b.row_flags,
          .cycle_tokens = b.cycle_tokens, .committed = b.committed};
  // clang-format on
}

struct SpeculativeCommitView {
  RowTablesView tables; ///< read: live, seq_len, slot_table; written: token_table, seq_len, live
  SlotPoolView pool;    ///< the rejected positions' slots are released into it
  int draft_steps = 1, eos_id = -1, particles = 1;
  const int32_t *draft_tokens, *accepted, *next_tokens, *request_draft_steps;
  const uint32_t* row_flags;
  int32_t *cycle_tokens, *committed, *first_eos;
  uint8_t* finished;
};

SpeculativeCommitView speculative_commit_view(const CycleBuffers& b) {
  // clang-format off
  return {.tables = b.tables, .pool = b.pool, .draft_steps = b.draft_steps, .eos_id = b.eos_id,
          .particles = b.particles, .draft_tokens = b.draft_tokens, .accepted = b.accepted,
          .next_tokens = b.next_tokens, .request_draft_steps = b.request_draft_steps, .row_flags = b.row_flags,
          .cycle_tokens = b.cycle_tokens, .committed = b.committed, .first_eos = b.first_eos, .finished = b.finished};
  // clang-format on
}

/// This thread's row r of the bucket and, when the row is live, its cycle-token row [K + 1], its token-table
/// row and its length L before the commit. A row that is not live commits nothing this cycle (its cycle
/// tokens are invalid, none counts); then, as past the bucket (r >= rows), `cycle` is null.
struct CommitRow {
  int r = 0, L = 0;
  int32_t* cycle = nullptr;
  int32_t* tokens = nullptr;
};

/// A row that is not live commits nothing this cycle: its cycle tokens are invalid and none counts.
template <class View> __device__ __forceinline__ void commit_nothing(const View& b, int r) {
  int32_t* cycle = b.cycle_tokens + r * (b.draft_steps + 1);
  for (int k = 0; k <= b.draft_steps; ++k)
    cycle[k] = kInvalidToken;
  b.committed[r] = 0;
}

template <class View> __device__ __forceinline__ CommitRow commit_row(const View& b, int rows, int r) {
  CommitRow row;
  row.r = r;
  if (row.r >= rows)
    return row;
  const int stride = b.draft_steps + 1;
  int32_t* cycle = b.cycle_tokens + row.r * stride;
  const int length = b.tables.seq_len[row.r]; // loaded beside live, not after it
  if (!b.tables.live[row.r]) {
    commit_nothing(b, row.r);
    return row;
  }
  row.cycle = cycle;
  row.tokens = b.tables.token_table + static_cast<int64_t>(row.r) * b.tables.max_seq_len;
  row.L = length;
  return row;
}

/// The weights stage folded into the SMC commit launch (commit_cycle's `weights`); `on` false: none.
struct FoldedWeights {
  bool on = false;
  WeightInputs in;
  double* logw = nullptr;
  uint8_t* finished = nullptr;
  int32_t* first_eos = nullptr;
};

/// Row `row_index`'s SMC commit (>= rows: nothing), its weight first when folded in (accumulate_row_weight
/// returns the row's first_eos, which the commit needs). The commit's loads (the row's length, flags and
/// cycle tokens) are issued before the weight's, and those before the first store, so the row costs about
/// one memory latency before it stores (prefix_load.cuh).
__device__ __forceinline__ void commit_smc_row(const CommitView& b, int rows, int row_index,
                                               const FoldedWeights& weights) {
  if (row_index >= rows)
    return;
  const int r = row_index, K = b.draft_steps, stride = K + 1;
  const bool live = b.tables.live[r] != 0;
  const int L = b.tables.seq_len[r];
  const device::PrefixLoad<8, int32_t> drafted(b.draft_tokens + r * stride + 1, K);
  const int32_t bonus = b.bonus_tokens[r];
  const uint32_t flags = b.row_flags[r];
  const int eos =
      weights.on ? accumulate_row_weight(weights.in, r, weights.logw, weights.finished, weights.first_eos)
                 : b.first_eos[r];
  if (!live) {
    commit_nothing(b, r);
    return;
  }
  int32_t* cycle = b.cycle_tokens + r * stride;
  int32_t* tokens = b.tables.token_table + static_cast<int64_t>(r) * b.tables.max_seq_len;
  drafted.for_each([&](int k, int32_t token) { cycle[k] = tokens[L + k] = token; });
  cycle[K] = tokens[L + K] = bonus;
  b.tables.seq_len[r] = L + stride;
  // first_eos (from the weights): -1 nothing counts (finished before), K none, else the EOS column.
  b.committed[r] = eos < 0 ? 0 : (eos >= K ? stride : eos + 1);
  if (flags & kRowDataFaults)
    b.tables.live[r] = 0; // the request fails; its rows stop here
}

__global__ void CommitCycleKernel(CommitView b, int rows, FoldedWeights weights) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  commit_smc_row(b, rows, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), weights);
}

/// The SMC cycle's end in one launch (smc_cycle_end): a CTA of kEndThreads takes one request (its N rows are
/// contiguous), so every stage after the first reads only rows its own CTA wrote, and a __syncthreads()
/// between the stages orders them: the weights and the commit (a thread a row), the resampling (warp 0,
/// resample_device.cuh), the reshuffle (the whole CTA, 1024 / n' threads a row: reshuffle_request in
/// reshuffle_device.cuh), then the launch's last CTA collects the freed slots. The same results per row and
/// request as the three launches it replaces (the reshuffle by the whole CTA, reshuffle_request, as
/// reshuffle_row does it). (A CTA of up to 32 requests measured slower at 8 and 64 requests: fewer CTAs did
/// the same serial work.)
constexpr int kEndThreads = device::kCollectThreads;
static_assert(kEndThreads >= kMaxResampleParticles, "a thread per row of a request");

struct SmcEndArgs {
  CommitView commit;
  FoldedWeights weights;
  ResampleInputs resample;
  double* logw;
  ResampleOutputs plan;
  SlotPoolView pool;
  RowTablesView tables; ///< rows = the bucket's rows
  uint8_t* finished;
  uint32_t* collect_ticket;
};

__global__ void __launch_bounds__(kEndThreads) SmcCycleEndKernel(SmcEndArgs a) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  __shared__ device::ResampleWarpStorage resample_storage;
  __shared__ device::ReshuffleRequestStorage<kMaxResampleParticles> reshuffle_storage;
  const int n = a.resample.particles_per_request, request = static_cast<int>(blockIdx.x);
  const int first_row = request * n, warp = static_cast<int>(threadIdx.x) / 32;
  if (static_cast<int>(threadIdx.x) < n)
    commit_smc_row(a.commit, a.tables.rows, first_row + static_cast<int>(threadIdx.x), a.weights);
  __syncthreads(); // the request's weights, live flags and tables, for its resampling and reshuffle
  if (warp == 0)
    device::resample_request(a.resample, a.logw, a.plan, request, resample_storage);
  __syncthreads(); // the request's plan
  device::reshuffle_request<kEndThreads>(a.pool, a.tables, a.plan.ancestor, a.finished, first_row, n,
                                         reshuffle_storage);
  device::collect_freed_after_launch<kEndThreads>(a.pool, a.collect_ticket);
}

/// The weights stage checked and folded into a commit launch of `rows` rows (errors name `where`).
FoldedWeights fold_weights(const CycleBuffers& b, int rows, const WeightInputs& weights, const char* where) {
  require(weights.rows == rows, where, "weights.rows", weights.rows, "must equal the commit's rows");
  require(weights.steps == b.draft_steps, where, "weights.steps", weights.steps,
          "must equal the engine's draft_steps");
  validate_weight_inputs(weights, b.logw, b.finished, b.first_eos, where);
  return {true, weights, b.logw, b.finished, b.first_eos};
}

} // namespace

void commit_cycle(const CycleBuffers& b, int rows, cudaStream_t stream, const WeightInputs* weights) {
  const FoldedWeights folded =
      weights != nullptr ? fold_weights(b, rows, *weights, "commit_cycle") : FoldedWeights{};
  launch_per_row(CommitCycleKernel, rows, stream, commit_view(b), rows, folded);
}

void smc_cycle_end(const CycleBuffers& b, const RowTablesView& tables, int requests,
                   const WeightInputs& weights, cudaStream_t stream) {
  // The three stages' own checks, and that the requests' rows are the bucket's (a CTA a request).
  constexpr const char* kWhere = "smc_cycle_end";
  const int n = b.particles, rows = tables.rows;
  SmcEndArgs a{};
  a.commit = commit_view(b);
  a.weights = fold_weights(b, rows, weights, kWhere);
  a.resample = {tables.live, b.tau, b.seeds, b.draw_counters, requests, n};
  a.logw = b.logw;
  a.plan = {b.ancestor, b.ess, b.resampled, b.log_evidence};
  check_resample(a.resample, a.logw, a.plan, kWhere);
  check_reshuffle_and_collect(b, tables, kWhere);
  require(requests >= 1 && static_cast<int64_t>(requests) * n == rows, kWhere, "requests", requests,
          "must be >= 1 and requests * particles must equal tables.rows");
  a.pool = b.pool;
  a.tables = tables;
  a.finished = b.finished;
  a.collect_ticket = b.collect_ticket;
  launch_pdl(SmcCycleEndKernel, dim3(static_cast<unsigned>(requests)), dim3(kEndThreads), 0, stream, a);
}

namespace {

/// One row of the speculative commit (the thread's row; none past `rows`). Every value is loaded before the
/// first store (as in pack_row): the compiler keeps a load after a store it cannot tell apart from the
/// load's buffer, so interleaved, each would wait one memory latency for the store before it.
__device__ void commit_speculative_row(const SpeculativeCommitView& b, int rows) {
  const CommitRow row = commit_row(b, rows, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x));
  if (row.cycle == nullptr) {
    if (row.r < rows)
      b.first_eos[row.r] = -1; // nothing of this cycle counts
    return;
  }
  const int r = row.r, L = row.L, stride = b.draft_steps + 1;
  int32_t *cycle = row.cycle, *tokens = row.tokens;
  const int steps =
      request_draft_steps_of(b.request_draft_steps, r / b.particles, b.draft_steps); // slots taken
  const int accepted = min(max(b.accepted[r], 0), steps);
  const int32_t next_token = b.next_tokens[r];
  const uint32_t row_flags = b.row_flags[r];
  const int32_t* slots = b.tables.slot_table + static_cast<int64_t>(r) * b.tables.max_seq_len;
  // The first accepted draft tokens and the first rejected positions' slots (positions past K_q took none),
  // loaded with the rest.
  const device::PrefixLoad<8, int32_t> drafted(b.draft_tokens + r * stride + 1, accepted);
  const device::PrefixLoad<8, int32_t> rejected_slots(slots + L + accepted + 1, steps - accepted);
  int eos = -1;
  const auto commit_token = [&](int k, int32_t token) {
    cycle[k] = tokens[L + k] = token;
    if (eos < 0 && token == b.eos_id)
      eos = k;
  };
  drafted.for_each(commit_token);
  commit_token(accepted, next_token);
  for (int k = accepted + 1; k < stride; ++k)
    cycle[k] = kInvalidToken;
  // The slots of rejected positions go back (the KV written there is stale and never read).
  rejected_slots.for_each([&](int, int32_t slot) { device::release_slot(b.pool, slot); });
  b.tables.seq_len[r] = L + accepted + 1;
  b.committed[r] = eos < 0 ? accepted + 1 : eos + 1;
  b.first_eos[r] = eos < 0 ? b.draft_steps : eos;
  if (eos >= 0) {
    b.finished[r] = 1;
    b.tables.live[r] = 0; // a finished speculative row stops decoding
  }
  if (row_flags & kRowDataFaults)
    b.tables.live[r] = 0;
}

__global__ void __launch_bounds__(kRowThreads) CommitSpeculativeKernel(SpeculativeCommitView b, int rows) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  commit_speculative_row(b, rows);
}

/// With collect_freed_slots folded in: kCollectThreads rows a CTA (one CTA up to that many rows), and the
/// launch's last CTA pushes the freed slots (slots_device.cuh), with as many threads as the standalone
/// collect.
constexpr int kCollectThreads = device::kCollectThreads;
__global__ void __launch_bounds__(kCollectThreads)
    CommitSpeculativeCollectKernel(SpeculativeCommitView b, int rows, uint32_t* collect_ticket) {
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  commit_speculative_row(b, rows);
  device::collect_freed_after_launch<kCollectThreads>(b.pool, collect_ticket);
}

/// The end of a speculative cycle in one CTA (rows <= kCollectThreads): thread r commits row r and packs its
/// accepted tokens and their log-probs (pack_device.cuh; when `pack.accepted` is set), the CTA pushes the
/// freed slots, then decides and packs the outputs as decide_and_pack_outputs does (thread q: request q, row
/// q). The barriers between the phases make each phase's global writes visible to the next.
__global__ void __launch_bounds__(kCollectThreads)
    CommitCollectPackKernel(SpeculativeCommitView b, int rows, device::AcceptedPack pack, OutputsView outputs,
                            uint8_t* out, OutputLayout layout, FoldedDecision decision) {
  __shared__ typename cub::BlockScan<int, kCollectThreads>::TempStorage pack_scan;
  pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  commit_speculative_row(b, rows);
  if (pack.accepted != nullptr) // launch-uniform
    device::pack_accepted_block<kCollectThreads>(pack, rows, pack_scan);
  __syncthreads(); // every row's releases are marked
  if (b.pool.freed != nullptr)
    device::collect_freed_block<kCollectThreads>(b.pool);
  __syncthreads(); // free_count is final: the decision's pressure reads it
  pack_row(outputs, static_cast<int>(threadIdx.x), rows, out, layout, decision);
}

} // namespace

void commit_speculative_and_pack_outputs(const CycleBuffers& b, int requests, uint8_t* out,
                                         PackWorkspace& pack_workspace, cudaStream_t stream) {
  constexpr const char* kWhere = "commit_speculative_and_pack_outputs";
  require(requests >= 1 && requests * b.particles <= b.max_rows, kWhere, "requests", requests,
          "must be in [1, max_rows / particles]");
  const int rows = requests * b.particles, K = b.draft_steps;
  if (rows > kCollectThreads) { // more rows than one CTA: the pack, commit and outputs launches
    if (K > 0) {
      const AcceptedRows accepted{b.accepted, rows, K, b.draft_tokens + 1, K + 1, nullptr};
      const PayloadView payload{b.target_logprobs, DType::kFloat32, 1, K};
      const PackOutputs packed{b.packed_logprobs, static_cast<int64_t>(b.max_rows) * K, b.packed_offsets,
                               b.packed_total, b.packed_tokens};
      pack_accepted(accepted, payload, false, packed, pack_workspace, stream);
    }
    commit_speculative(b, rows, stream, /*collect_freed=*/true);
    decide_and_pack_outputs(b, requests, b.accepted, out, stream);
    return;
  }
  device::AcceptedPack pack;
  if (K > 0) { // without a draft nothing is accepted or packed
    require(b.packed_tokens != nullptr && b.packed_logprobs != nullptr && b.packed_offsets != nullptr &&
                b.packed_total != nullptr,
            kWhere, "b.packed_*", "null", "must be device pointers when draft_steps > 0");
    // clang-format off
    pack = {.accepted = b.accepted, .draft_steps = K, .draft_tokens = b.draft_tokens + 1, .draft_row_stride = K + 1,
            .payload = b.target_logprobs, .payload_row_stride = K, .packed_payload = b.packed_logprobs,
            .packed_tokens = b.packed_tokens, .offsets = b.packed_offsets, .total = b.packed_total};
    // clang-format on
  }
  const OutputLayout layout = output_layout(rows, requests, b.draft_steps);
  const FoldedDecision decision{true, decide_view(b, /*advance_draw_counters=*/true), b.accepted};
  launch_pdl(CommitCollectPackKernel, dim3(1), dim3(kCollectThreads), 0, stream, speculative_commit_view(b),
             rows, pack, outputs_view(b), out, layout, decision);
}

void commit_speculative(const CycleBuffers& b, int rows, cudaStream_t stream, bool collect_freed) {
  if (collect_freed) {
    require(b.collect_ticket != nullptr, "commit_speculative", "b.collect_ticket", "null",
            "must be a device pointer when the collect is folded in");
    const auto blocks = static_cast<unsigned>(ceil_div(rows, kCollectThreads));
    launch_pdl(CommitSpeculativeCollectKernel, dim3(blocks), dim3(kCollectThreads), 0, stream,
               speculative_commit_view(b), rows, b.collect_ticket);
  } else {
    launch_per_row(CommitSpeculativeKernel, rows, stream, speculative_commit_view(b), rows);
  }
}

} // namespace smcgraph::detail
