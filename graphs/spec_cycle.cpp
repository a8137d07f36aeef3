// The speculative (rejection) cycle recipe (DESIGN.md §3), N = 1, rows are requests with their own lengths:
//
//   alloc -> draft head + K - 1 steps with samples (shared with SMC; q of every position kept) -> target
//   verify forward (K + 1 tokens) -> score (log p(d_k) under T_t) -> stochastic verification (accept with
//   min(1, p/q), residual max(0, p - q) by Gumbel-max, bonus from p; T_t = 0 makes it exact greedy
//   verification) -> fused pack of the accepted tokens and their log-probs (offsets and total on the device)
//   -> commit (tokens, L += k + 1, rejected positions' slots released), collect freed slots, next K per
//   request (EMA of the acceptance rate, KV-pressure cap), the draw counters advanced and the outputs packed:
//   one launch (one CTA) for buckets of up to 1024 rows
//
// Each request drafts its own K_q <= K (draft_steps.cu): it pops K_q + 1 slots, its rows are masked in the
// draft steps past K_q (skipped altogether by the captured cycle's conditional nodes once no live row needs
// them), and it is verified with its own K_q.
//
// With draft_steps = 0 there is no draft: alloc (one slot), the verify forward over the last committed token,
// its sample (score's bonus pass: greedy at T_t = 0, else an exact draw from p), commit, collect, outputs,
// the target decoding alone through the same captured cycle.
//
// Row lengths differ after a cycle; they live in device memory, so the same graph replays.
#include "runtime/engine_state.hpp"

#include "smcgraph/slots.hpp"
#include "smcgraph/verify.hpp"

namespace smcgraph::detail {

void enqueue_spec_cycle(Engine::State& s, int bucket_requests, Enqueue mode, cudaStream_t stream,
                        uint8_t* outputs) {
  const int K = s.draft_steps, V = s.vocab;
  const int rows = bucket_requests; // N = 1
  const CycleBuffers& b = s.buffers;
  const RowRandom random{b.seeds, b.draw_counters, 1};
  const DType dtype = s.target->logits_dtype();
  // Everything after the verify forward: once per verify width when captured with conditional nodes.
  const CycleRest rest = [&](cudaStream_t st) {
    {
      Stage stage(s, "spec.score");
      const LogitsView logits{s.target_logits.data(),          dtype, rows, K + 1, V,
                              static_cast<int64_t>(K + 1) * V, V};
      score(logits, b.draft_tokens + 1, K + 1, {b.target_temperature, nullptr}, random,
            philox_stream(Salt::kBonus, 0),
            {b.target_logprobs, K == 0 ? b.next_tokens : b.bonus_tokens, b.bonus_logprobs, b.bonus_logz,
             b.row_flags, b.status},
            s.workspace, st, b.request_draft_steps); // row q scores its own K_q columns (+ the bonus)
    }
    // Without a draft (K = 0) the bonus, the target's sample at the one column, is the next token: nothing to
    // verify or pack, and `accepted` stays 0 (zeroed at construction, never written).
    if (K > 0) {
      Stage stage(s, "spec.verify");
      StochasticVerifyInputs in;
      in.draft_tokens = b.draft_tokens + 1; // the draft block [rows, K + 1], columns 1 .. K
      in.draft_token_row_stride = K + 1;
      in.draft_logprobs = b.draft_logprobs + 1;
      in.draft_logprob_row_stride = K + 1;
      in.target_logprobs = b.target_logprobs;
      in.target_logprob_row_stride = K;
      // Draft logits are position-major [K, rows, V]; target logits row-major [rows, K + 1, V].
      in.draft_logits = {s.draft_step_logits.data(), dtype, rows, K, V, V, static_cast<int64_t>(s.rows) * V};
      in.target_logits = {s.target_logits.data(), dtype, rows, K + 1, V, static_cast<int64_t>(K + 1) * V, V};
      in.draft_temperature = b.draft_temperature;
      in.target_temperature = b.target_temperature;
      in.random = random;
      in.draft_steps = K;
      in.row_draft_steps = b.request_draft_steps; // N = 1: request q is row q; it verifies its own K_q
      verify_stochastic(in, {b.accepted, b.next_tokens, nullptr, b.row_flags, b.status}, s.workspace, st);
    }
    {
      // The pack of the accepted tokens and their log-probs, the commit, the freed slots pushed, the next K
      // of every request (after the frees: the pressure sees them), the draw counters advanced (the cycle's
      // draws are done) and the outputs packed: one launch for buckets of up to 1024 rows (commit.cu,
      // pack_device.cuh, output_packing_device.cuh).
      Stage stage(s, "spec.commit_and_outputs");
      commit_speculative_and_pack_outputs(b, bucket_requests, outputs, s.pack_workspace, st);
    }
  };
  enqueue_draft_and_verify(s, bucket_requests, mode, stream, rest);
}

} // namespace smcgraph::detail
