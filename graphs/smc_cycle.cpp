// The SMC cycle recipe (DESIGN.md §2, deferred bonus): which stages run, in which order, on which buffers.
// The same function is captured once per bucket and run eagerly for debugging; nothing in it allocates,
// synchronizes or reads a host value that changes between replays.
//
//   alloc -> draft head (2 tokens) -> sample d_1 -> K - 1 x (draft step -> sample d_{s+1}) -> target verify
//   (K + 1 tokens) -> score (log p(d_k), bonus, logZ) -> weights + commit + resample + reshuffle + freed-slot
//   collect (one launch) -> next K report + advance draw counters + pack outputs (one launch)
//
// The commit precedes resample/reshuffle (DESIGN.md lists it last): reshuffle copies whole rows, so the
// copy must already hold this cycle's tokens and slots.
#include "runtime/engine_state.hpp"

#include "smcgraph/smc_kernels.hpp"
#include "smcgraph/slots.hpp"

namespace smcgraph::detail {

void enqueue_smc_cycle(Engine::State& s, int bucket_requests, Enqueue mode, cudaStream_t stream,
                       uint8_t* outputs) {
  const int N = s.config.particles, K = s.draft_steps, V = s.vocab;
  const int rows = bucket_requests * N;
  const CycleBuffers& b = s.buffers;
  RowTablesView tables = b.tables;
  tables.rows = rows;
  const RowRandom random{b.seeds, b.draw_counters, N};
  // Everything after the verify forward (the SMC cycle captures no conditional nodes: it runs once).
  const CycleRest rest = [&](cudaStream_t st) {
    {
      Stage stage(s, "smc.score");
      const LogitsView logits{s.target_logits.data(),
                              s.target->logits_dtype(),
                              rows,
                              K + 1,
                              V,
                              static_cast<int64_t>(K + 1) * V,
                              V};
      score(logits, b.draft_tokens + 1, K + 1, {b.target_temperature, b.alpha}, random,
            philox_stream(Salt::kBonus, 0),
            {b.target_logprobs, b.bonus_tokens, b.bonus_logprobs, b.bonus_logz, b.row_flags, b.status},
            s.workspace, st);
    }
    {
      // The weights, the commit, the resampling and the reshuffle: one launch (commit.cu's smc_cycle_end; the
      // stages' device code lives in weights_device.cuh, resample_device.cuh and reshuffle_device.cuh). A CTA
      // takes a request, so the stages meet at CTA barriers; freed slots go back in id order (slot ids
      // stay deterministic), collected by the launch's last CTA.
      Stage stage(s, "smc.commit_resample_reshuffle");
      WeightInputs in;
      in.draft_logprobs = {b.draft_logprobs + 1, K + 1, 1}; // the draft block's columns 1 .. K
      in.target_logprobs = {b.target_logprobs, K, 1};
      in.logz = b.bonus_logz;
      in.draft_tokens = {b.draft_tokens + 1, K + 1, 1};
      in.alpha = b.alpha;
      in.live = b.tables.live;
      in.bonus_tokens = b.bonus_tokens;
      in.rows = rows;
      in.steps = K;
      in.eos_id = s.config.eos_id;
      smc_cycle_end(b, tables, bucket_requests, in, st);
    }
    {
      // The next K of every request (after the frees: the pressure sees them), the draw counters advanced
      // (the cycle's draws are done) and the outputs packed: one launch (output_packing.cu).
      Stage stage(s, "smc.next_k_and_outputs");
      decide_and_pack_outputs(b, bucket_requests, nullptr, outputs, st);
    }
  };
  enqueue_draft_and_verify(s, bucket_requests, mode, stream, rest);
}

} // namespace smcgraph::detail
