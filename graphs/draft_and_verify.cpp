// The phase both cycle recipes share (graphs/smc_cycle.cpp, graphs/spec_cycle.cpp): slot allocation for
// K + 1 positions, the draft head (2 tokens) and its sample d_1, K - 1 draft steps each with its sample, and
// the target verify forward over K + 1 tokens. The speculative cycle also keeps the draft's logits at every
// position (its verifier's residual needs q). Nothing here allocates, synchronizes or reads a host value that
// changes between replays.
#include "runtime/engine_state.hpp"

#include "smcgraph/sample.hpp"
#include "smcgraph/slots.hpp"

namespace smcgraph::detail {

void enqueue_draft_and_verify(Engine::State& s, int bucket_requests, cudaStream_t stream) {
  const bool speculative = s.config.kind == CycleKind::kSpeculative;
  const char* const alloc_name = speculative ? "spec.alloc" : "smc.alloc";
  const char* const draft_name = speculative ? "spec.draft" : "smc.draft";
  const char* const verify_name = speculative ? "spec.verify_forward" : "smc.verify";
  const int N = s.config.particles, K = s.draft_steps, V = s.vocab;
  const int rows = bucket_requests * N;
  const CycleBuffers& b = s.buffers;
  RowTablesView tables = b.tables;
  tables.rows = rows; // the bucket's rows only
  const DType dtype = s.draft->logits_dtype();
  const size_t element_bytes = dtype_bytes(dtype);
  const size_t step_logits_bytes = static_cast<size_t>(s.rows) * V * element_bytes; // one [rows, V] block

  s.stage = "reset_status";
  SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(b.status, 0, sizeof(uint32_t), stream));
  {
    Stage stage(s, alloc_name);
    alloc_cycle_slots(b.pool, tables, N, K + 1, b.cycle_slots, b.row_flags, b.status, stream);
    prepare_draft_inputs(b, rows, stream);
  }
  const RowParams draft_params{b.draft_temperature, nullptr};
  const RowRandom random{b.seeds, b.draw_counters, N};
  {
    Stage stage(s, draft_name);
    ForwardArgs head{rows,
                     2,
                     b.head_tokens,
                     b.head_positions,
                     b.tables.slot_table,
                     b.head_seq_lens,
                     b.head_out_slots,
                     b.tables.live,
                     s.draft_logits.data()};
    s.draft->forward(head, stream);
    // d_1 from the head's last column: rows of [2, V], the second position.
    const LogitsView head_last{s.draft_logits.data() + static_cast<size_t>(V) * element_bytes,
                               dtype,
                               rows,
                               1,
                               V,
                               2 * static_cast<int64_t>(V),
                               V};
    sample(head_last, draft_params, random, philox_stream(Salt::kDraft, 0),
           {b.draft_tokens, b.draft_logprobs, b.scratch_logz, b.row_flags, b.status}, s.workspace, stream);
    if (speculative) // the verifier's residual needs q at every position: keep [K, rows, V]
      SMCGRAPH_CUDA_CHECK(cudaMemcpy2DAsync(s.draft_step_logits.data(), V * element_bytes,
                                            s.draft_logits.data() + V * element_bytes, 2 * V * element_bytes,
                                            V * element_bytes, rows, cudaMemcpyDeviceToDevice, stream));
    for (int step = 1; step < K; ++step) {
      const size_t offset = static_cast<size_t>(step - 1) * s.rows;
      uint8_t* logits =
          speculative ? s.draft_step_logits.data() + step * step_logits_bytes : s.draft_logits.data();
      ForwardArgs one{rows,
                      1,
                      b.draft_tokens + offset,
                      b.step_positions + offset,
                      b.tables.slot_table,
                      b.step_seq_lens + offset,
                      b.step_out_slots + offset,
                      b.tables.live,
                      logits};
      s.draft->forward(one, stream);
      const LogitsView view{logits, dtype, rows, 1, V, V, V};
      sample(view, draft_params, random, philox_stream(Salt::kDraft, static_cast<uint32_t>(step)),
             {b.draft_tokens + offset + s.rows, b.draft_logprobs + offset + s.rows, b.scratch_logz,
              b.row_flags, b.status},
             s.workspace, stream);
    }
  }
  {
    Stage stage(s, verify_name);
    prepare_verify_inputs(b, rows, stream);
    ForwardArgs verify{rows,
                       K + 1,
                       b.verify_tokens,
                       b.verify_positions,
                       b.tables.slot_table,
                       b.verify_seq_lens,
                       b.verify_out_slots,
                       b.tables.live,
                       s.target_logits.data()};
    s.target->forward(verify, stream);
  }
}

} // namespace smcgraph::detail
