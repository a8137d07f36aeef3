// Host reference of the whole SMC cycle (graphs/smc_cycle.cpp) together with the engine's admission and
// release (src/runtime/engine.cpp), for the toy model pair. It holds host copies of everything the engine
// keeps on the device (slot pool with the exact free-stack order, slot/token tables, both models' KV,
// per-row parameters, weights and flags, per-request seeds, draw counters, tau, ESS and log Z-hat) and
// applies the same stages in the same order, built from the per-kernel references:
//
//   alloc (alloc_cycle_slots_ref) -> draft head over [x_{L-2}, x_{L-1}] (ToyModelReference) -> d_1
//   (reference::sample, salt kDraft step 0) -> K - 1 one-token draft forwards + samples (kDraft step s) ->
//   target verify over [x_{L-1}, d_1 .. d_K] -> score (token_logprob under T_t; bonus by sample() with
//   alpha, salt kBonus step 0) -> accumulate_weights_ref -> commit (tokens into the table, L += K + 1) ->
//   resample_ref (salt kResample) -> reshuffle_ref -> freed slots pushed in ascending id order (as
//   collect_freed_slots) -> draw counters + 1 -> the RequestUpdates poll() would return.
//
// Logits are the toy reference's floats, rounded to the models' dtype (bf16) before any sampling, exactly
// what the device sampler reads. Random draws use the same Philox counters, so tokens agree with the device
// except at a near tie of either level of the two-level race (SampleResult::near_tie(), counted in
// sample_stats()).
// Log-probabilities are double in the reference and float on the device (they differ by ~1e-6), and the
// resampling decision is discontinuous in the weights; for lockstep runs the cycle is split:
//
//   reference::SmcCycleReference ref(engine_config, models.draft->config(), models.target->config());
//   ref.admit(prompt, params);                         // mirrors engine.admit (same RequestId)
//   engine.step(); auto updates = engine.poll();
//   ref.propose();                                     // alloc .. score
//   ... compare tokens and log-probs with the device's cycle buffers ...
//   ref.adopt_logprobs(device_draft_logprobs, device_target_logprobs, device_bonus_logz);   // optional
//   auto expected = ref.finish();                      // weights .. outputs; compare with `updates`
//
// Without adopt_logprobs the reference uses its own log-probs (rounded to float, as the device stores
// them). Either way it also keeps independent_logw(): the weights accumulated from its own log-probs only
// (reset where the request resampled), and weight_magnitude(): the sum of |terms| that went into them since
// the last reset, the scale of the float-versus-double difference.
//
// Engine behaviour outside the cycle that is mirrored: the construction warm-up (one eager cycle with
// nothing live: every draw counter becomes 1, every ancestor the identity), request slots (the first free
// one), buckets (the smallest covering the highest occupied request slot; stages run on the bucket's rows
// only), chunked prefill (min(128, max_seq_len) tokens per forward). Not mirrored: a failed admission
// (pool exhausted at admission: the device samples stale prefill logits), compact().
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "reference/slots_ref.hpp"
#include "reference/toy_model_ref.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/toy_model.hpp"

namespace smcgraph::reference {

/// Draws the reference made and how many were near ties (SampleResult::near_tie()).
/// What poll() reports for a request after a cycle: finished, failed (with the reason) or neither. Decided
/// here on its own terms, not by calling the engine's detail::classify_request, so that the engine tests can
/// catch a mistake in either (test_engine_cpu compares the two over every combination of inputs).
struct RequestDecision {
  bool finished = false, failed = false;
  std::string reason;
};
/// `flags` ORs the request's row flags this cycle; `generated` = tokens after the prompt; max_new_tokens <= 0
/// is no limit.
RequestDecision decide_request(uint32_t flags, bool all_finished, bool any_live, int generated,
                               int max_new_tokens);

struct CycleSampleStats {
  long samples = 0;          ///< admission first tokens, draft tokens and bonus tokens of live rows
  long near_ties = 0;        ///< draws whose winner the device's float race may legitimately pick differently
  std::string last_near_tie; ///< where the latest near tie happened (request slot, row, which draw)
};

/// The host bookkeeping of one request (as the engine's HostRequest).
struct CycleRequestRef {
  RequestId id = -1;
  int slot = -1;
  int prompt_length = 0;
  int length = 0; ///< L as of the last finished cycle
  int cycles = 0;
  int max_new_tokens = -1;
  bool finished = false, failed = false;
  std::string reason;
};

class SmcCycleReference {
public:
  /// `draft` / `target` are the toy models' configs (ToyModel::config()); the engine must be built from the
  /// same EngineConfig and models. Throws smcgraph::Error for mismatched shapes.
  SmcCycleReference(const EngineConfig& config, const ToyModelConfig& draft, const ToyModelConfig& target);

  /// Engine::admit: rows initialised, prompt slots popped from the top of the free stack, both models
  /// prefilled, x_P sampled from the target (salt kAdmission, particle 0, draw counter 0), fan-out to N
  /// rows. Returns the same id the engine assigns (0, 1, 2, ... in admission order).
  RequestId admit(const std::vector<int32_t>& prompt, const RequestParams& params = {});

  /// Engine::release: the request's rows drop their slots (freed ones pushed in ascending id order).
  void release(RequestId id);

  /// One whole cycle: propose() then finish(). Empty when no request slot is occupied (step() launches
  /// nothing then).
  std::vector<RequestUpdate> cycle();

  /// The first half of a cycle: alloc, draft head and steps with their samples, target verify and score.
  /// Fills cycle_slots(), draft_tokens(), draft_logprobs(), target_logprobs(), bonus_*().
  void propose();

  /// Replaces the log-probs of live bucket rows by the device's (same layouts as the engine's buffers:
  /// draft [K, rows of the largest bucket], target [bucket rows, K], logz [rows]) before finish().
  void adopt_logprobs(const std::vector<float>& draft_logprobs, const std::vector<float>& target_logprobs,
                      const std::vector<float>& bonus_logz);

  /// The second half: weights, commit, resample, reshuffle, freed-slot collection, draw counters, and the
  /// updates poll() returns for this cycle.
  std::vector<RequestUpdate> finish();

  // Configuration and bookkeeping.
  const EngineConfig& config() const { return config_; }
  int rows() const { return rows_; }              ///< all rows (max_requests * N)
  int bucket_requests() const { return bucket_; } ///< request slots of the latest cycle (0: none ran)
  int request_slot(RequestId id) const;           ///< -1 when unknown / released
  const std::vector<RequestId>& slot_owner() const { return slot_owner_; }
  const std::map<RequestId, CycleRequestRef>& requests() const { return requests_; }
  const CycleSampleStats& sample_stats() const { return stats_; }

  // Device state mirrors (layouts as in Engine::State).
  const HostSlots& slots() const { return slots_; }                     ///< pool and tables
  const std::vector<float>& draft_kv() const { return draft_kv_; }      ///< [draft pool_size, hidden]
  const std::vector<float>& target_kv() const { return target_kv_; }    ///< [target pool_size, hidden]
  const std::vector<double>& logw() const { return logw_; }             ///< [rows]
  const std::vector<uint8_t>& finished() const { return finished_; }    ///< [rows]
  const std::vector<uint32_t>& row_flags() const { return row_flags_; } ///< [rows]
  const std::vector<uint64_t>& seeds() const { return seeds_; }         ///< [requests]
  const std::vector<uint32_t>& draw_counters() const { return draw_counters_; } ///< [requests]
  const std::vector<double>& ess() const { return ess_; }                       ///< [requests]
  const std::vector<uint8_t>& resampled() const { return resampled_; }          ///< [requests]
  const std::vector<double>& log_evidence() const { return log_evidence_; }     ///< [requests]

  // The latest cycle's buffers (rows beyond the bucket and rows not live are unspecified on the device).
  const std::vector<int32_t>& cycle_slots() const { return cycle_slots_; } ///< [rows, K + 1]
  /// The draft block [rows, K + 1] (the engine's layout): d_{k+1} of row r at draft_index(r, k); column 0
  /// (x_{L-1} on the device) is not kept here (0).
  const std::vector<int32_t>& draft_tokens() const { return draft_tokens_; }
  const std::vector<float>& draft_logprobs() const { return draft_logprobs_; } ///< [rows, K + 1], as tokens
  size_t draft_index(int row, int k) const { return static_cast<size_t>(row) * (steps_ + 1) + 1 + k; }
  const std::vector<float>& target_logprobs() const { return target_logprobs_; } ///< [bucket rows, K] (dense)
  const std::vector<int32_t>& bonus_tokens() const { return bonus_tokens_; }     ///< [rows]
  const std::vector<float>& bonus_logprobs() const { return bonus_logprobs_; }   ///< [rows]
  const std::vector<float>& bonus_logz() const { return bonus_logz_; }           ///< [rows]
  const std::vector<int32_t>& first_eos() const { return first_eos_; }           ///< [rows]
  const std::vector<int32_t>& ancestor() const { return ancestor_; }             ///< [rows]
  const std::vector<int32_t>& cycle_tokens() const { return cycle_tokens_; }     ///< [rows, K + 1]
  /// The OR of the flags the latest cycle raised for rows that were live (alloc refusals, sampler faults).
  /// The device's status word also collects whatever the samplers raise for padding rows of the bucket.
  uint32_t status() const { return status_; }
  /// Rows that were live when the latest cycle's forwards ran (after alloc): the rows whose buffers above
  /// are meaningful.
  const std::vector<uint8_t>& proposed_rows() const { return proposed_; }

  /// Weights accumulated from the reference's own log-probs (see the file comment) and the sum of the
  /// absolute terms in them since the request last resampled.
  const std::vector<double>& independent_logw() const { return independent_logw_; }
  const std::vector<double>& weight_magnitude() const { return weight_magnitude_; }

private:
  int bucket_for() const;
  /// One draw of row `row` from `logits` (already in the model dtype), counted in the stats.
  struct Draw {
    int32_t token;
    float logprob, logz;
  };
  Draw draw(const float* logits, int row, float temperature, float alpha, uint32_t stream_word,
            const char* what);
  /// Rounds logits to the models' dtype in place (what the device stores).
  void round_logits(std::vector<float>& logits) const;
  /// Inputs of one cycle forward over the bucket's rows: slot table and live flags filled, the rest zero.
  ToyForwardInputs forward_inputs(int tokens_per_row) const;
  /// Sorts the slots pushed since free_count was `before` (the device collects them in ascending id order).
  void collect_freed(int before);

  EngineConfig config_;
  int particles_ = 1, steps_ = 1, vocab_ = 0, requests_count_ = 0, rows_ = 0, max_seq_len_ = 0;
  int prefill_chunk_ = 0;
  DType dtype_ = DType::kFloat32;
  std::vector<int> bucket_list_;
  ToyModelReference draft_model_, target_model_;

  HostSlots slots_;
  std::vector<float> draft_kv_, target_kv_;
  std::vector<float> draft_temperature_, target_temperature_, alpha_;
  std::vector<double> logw_, independent_logw_, weight_magnitude_;
  std::vector<uint8_t> finished_;
  std::vector<uint32_t> row_flags_;
  std::vector<uint64_t> seeds_;
  std::vector<uint32_t> draw_counters_;
  std::vector<float> tau_;
  std::vector<double> ess_, log_evidence_;
  std::vector<uint8_t> resampled_;

  // The cycle in progress.
  bool proposed_cycle_ = false;
  int bucket_ = 0;
  std::vector<uint8_t> proposed_;
  std::vector<int32_t> cycle_slots_, draft_tokens_, bonus_tokens_, first_eos_, ancestor_, cycle_tokens_;
  std::vector<float> draft_logprobs_, target_logprobs_, bonus_logprobs_, bonus_logz_;
  std::vector<float> own_draft_logprobs_, own_target_logprobs_, own_bonus_logz_;
  uint32_t status_ = 0;

  // Host bookkeeping.
  std::vector<RequestId> slot_owner_;
  std::map<RequestId, CycleRequestRef> requests_;
  RequestId next_id_ = 0;
  CycleSampleStats stats_;
};

} // namespace smcgraph::reference
