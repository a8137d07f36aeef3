#include "reference/cycle_ref.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <span>

#include "reference/sample_ref.hpp"
#include "reference/smc_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/types.hpp"
#include "support/test_util.hpp"

namespace smcgraph::reference {

namespace {

bool any_failure_flag(uint32_t flags) {
  return (flags & kRequestFailureFlags) != 0;
}

} // namespace

RequestDecision decide_request(uint32_t flags, bool all_finished, bool any_live, int generated,
                               int max_new_tokens) {
  // Every cause that can end a request this cycle, most serious first; the first that applies decides. A
  // fault outranks everything (its tokens are not results), hitting max_seq_len outranks EOS (the row was
  // cut, whatever it sampled), EOS outranks the token budget, and a request with no live row and no other
  // cause has failed.
  struct Cause {
    bool applies, failed;
    std::string reason;
  };
  const Cause causes[] = {
      {any_failure_flag(flags), true,
       any_failure_flag(flags) ? describe_flags(flags & kRequestFailureFlags) : ""},
      {(flags & kFlagMaxLength) != 0, false, "max sequence length"},
      {all_finished, false, "eos"},
      {max_new_tokens > 0 && generated >= max_new_tokens, false, "max_new_tokens"},
      {!any_live, true, "rows not live"},
  };
  for (const Cause& cause : causes)
    if (cause.applies)
      return {!cause.failed, cause.failed, cause.reason};
  return {};
}
namespace {

constexpr const char* kWhere = "SmcCycleReference";

} // namespace

SmcCycleReference::SmcCycleReference(const EngineConfig& config, const ToyModelConfig& draft,
                                     const ToyModelConfig& target)
    : config_(config), draft_model_(draft), target_model_(target) {
  validate_engine_config(config);
  require(config.kind == CycleKind::kSmc, kWhere, "config.kind", static_cast<int>(config.kind),
          "must be kSmc");
  require(draft.vocab == config.vocab, kWhere, "draft.vocab", draft.vocab, "must equal config.vocab");
  require(target.vocab == config.vocab, kWhere, "target.vocab", target.vocab, "must equal config.vocab");
  require(draft.max_seq_len == config.max_seq_len, kWhere, "draft.max_seq_len", draft.max_seq_len,
          "must equal config.max_seq_len");
  require(target.max_seq_len == config.max_seq_len, kWhere, "target.max_seq_len", target.max_seq_len,
          "must equal config.max_seq_len");
  require(draft.logits_dtype == target.logits_dtype, kWhere, "draft.logits_dtype",
          dtype_name(draft.logits_dtype), "must equal target.logits_dtype");
  particles_ = config.particles;
  steps_ = config.draft_steps;
  vocab_ = config.vocab;
  requests_count_ = config.max_requests;
  rows_ = requests_count_ * particles_;
  max_seq_len_ = config.max_seq_len;
  prefill_chunk_ = std::min(128, max_seq_len_); // the reference's results do not depend on it
  dtype_ = target.logits_dtype;

  bucket_list_ = config.buckets;
  if (bucket_list_.empty()) {
    for (int b = 1; b < requests_count_; b *= 2)
      bucket_list_.push_back(b);
    bucket_list_.push_back(requests_count_);
  }

  const int R = rows_, Q = requests_count_, K = steps_;
  slots_ = HostSlots(config.slot_pool_size, R, max_seq_len_);
  draft_kv_.assign(static_cast<size_t>(draft.pool_size) * draft.hidden, 0.0f);
  target_kv_.assign(static_cast<size_t>(target.pool_size) * target.hidden, 0.0f);
  // Every device buffer starts zeroed (zero_all).
  draft_temperature_.assign(R, 0.0f);
  target_temperature_.assign(R, 0.0f);
  alpha_.assign(R, 0.0f);
  logw_.assign(R, 0.0);
  independent_logw_.assign(R, 0.0);
  weight_magnitude_.assign(R, 0.0);
  finished_.assign(R, 0);
  row_flags_.assign(R, 0);
  seeds_.assign(Q, 0);
  draw_counters_.assign(Q, 0);
  tau_.assign(Q, 0.0f);
  ess_.assign(Q, 0.0);
  log_evidence_.assign(Q, 0.0);
  resampled_.assign(Q, 0);
  proposed_.assign(R, 0);
  cycle_slots_.assign(static_cast<size_t>(R) * (K + 1), 0);
  draft_tokens_.assign(static_cast<size_t>(R) * (K + 1), 0);
  draft_logprobs_.assign(static_cast<size_t>(R) * (K + 1), 0.0f);
  target_logprobs_.assign(static_cast<size_t>(R) * K, 0.0f);
  bonus_tokens_.assign(R, 0);
  bonus_logprobs_.assign(R, 0.0f);
  bonus_logz_.assign(R, 0.0f);
  first_eos_.assign(R, 0);
  ancestor_.assign(R, 0);
  cycle_tokens_.assign(static_cast<size_t>(R) * (K + 1), 0);
  own_draft_logprobs_ = draft_logprobs_;
  own_target_logprobs_ = target_logprobs_;
  own_bonus_logz_ = bonus_logz_;
  slot_owner_.assign(Q, -1);

  // The engine's warm-up: one eager cycle at the largest bucket with nothing live. Of its effects only these
  // survive into later state: identity ancestors, no counted columns, padding cycle tokens, ESS 0, and every
  // draw counter advanced once (admission resets a request's counter to 0).
  for (int r = 0; r < R; ++r) {
    ancestor_[r] = r;
    first_eos_[r] = -1;
  }
  std::fill(cycle_tokens_.begin(), cycle_tokens_.end(), kInvalidToken);
  std::fill(draw_counters_.begin(), draw_counters_.end(), 1u);
}

int SmcCycleReference::request_slot(RequestId id) const {
  const auto it = requests_.find(id);
  return it == requests_.end() ? -1 : it->second.slot;
}

int SmcCycleReference::bucket_for() const {
  int highest = -1;
  for (int q = 0; q < requests_count_; ++q)
    if (slot_owner_[q] >= 0)
      highest = q;
  if (highest < 0)
    return 0;
  for (const int b : bucket_list_)
    if (b > highest)
      return b;
  return bucket_list_.back();
}

void SmcCycleReference::round_logits(std::vector<float>& logits) const {
  if (dtype_ == DType::kFloat32)
    return;
  for (float& x : logits)
    x = test::round_to(dtype_, x);
}

SmcCycleReference::Draw SmcCycleReference::draw(const float* logits, int row, float temperature, float alpha,
                                                uint32_t stream_word, const char* what) {
  const int q = row / particles_;
  const SampleResult result =
      sample(logits, vocab_, sample_tile_length(dtype_), temperature, alpha, seeds_[q], draw_counters_[q],
             static_cast<uint32_t>(row % particles_), stream_word);
  ++stats_.samples;
  if (!result.flags && result.near_tie()) {
    ++stats_.near_ties;
    stats_.last_near_tie = std::string(what) + " of row " + std::to_string(row) + " (request slot " +
                           std::to_string(q) + ", draw counter " + std::to_string(draw_counters_[q]) +
                           "): race scores " + std::to_string(result.best_score) + " vs " +
                           std::to_string(result.runner_up_score);
  }
  // The sampler ORs a failed row's flags into row_flags and the status word.
  row_flags_[row] |= result.flags;
  status_ |= result.flags;
  Draw out;
  out.token = result.token;
  out.logprob = static_cast<float>(result.logprob);
  out.logz = static_cast<float>(result.logz);
  return out;
}

ToyForwardInputs SmcCycleReference::forward_inputs(int tokens_per_row) const {
  const int rows = bucket_ * particles_;
  ToyForwardInputs in;
  in.rows = rows;
  in.tokens_per_row = tokens_per_row;
  const size_t tokens = static_cast<size_t>(rows) * tokens_per_row;
  in.tokens.assign(tokens, 0);
  in.positions.assign(tokens, 0);
  in.out_slots.assign(tokens, 0);
  in.seq_lens.assign(rows, 0);
  in.slot_table.assign(slots_.slot_table.begin(),
                       slots_.slot_table.begin() + static_cast<size_t>(rows) * max_seq_len_);
  in.live.assign(slots_.live.begin(), slots_.live.begin() + rows);
  return in;
}

void SmcCycleReference::collect_freed(int before) {
  std::sort(slots_.free_stack.begin() + before, slots_.free_stack.begin() + slots_.free_count);
}

RequestId SmcCycleReference::admit(const std::vector<int32_t>& prompt, const RequestParams& params) {
  const EngineConfig& c = config_;
  const int P = static_cast<int>(prompt.size()), N = particles_;
  require(P >= 1, "SmcCycleReference::admit", "prompt.size()", P, "must be >= 1");
  require(P + 1 + (steps_ + 1) <= max_seq_len_, "SmcCycleReference::admit", "prompt.size()", P,
          "leaves no room for one cycle");
  for (const int32_t token : prompt)
    require(token >= 0 && token < vocab_, "SmcCycleReference::admit", "prompt token", token, "out of range");
  const auto free_slot = std::find(slot_owner_.begin(), slot_owner_.end(), RequestId{-1});
  require(free_slot != slot_owner_.end(), "SmcCycleReference::admit", "live requests", requests_count_,
          "every request slot is taken");
  const int q = static_cast<int>(free_slot - slot_owner_.begin());
  const int row = q * N;
  const float draft_temperature =
      params.draft_temperature < 0.0f ? c.draft_temperature : params.draft_temperature;
  const float target_temperature =
      params.target_temperature < 0.0f ? c.target_temperature : params.target_temperature;
  const float alpha = params.alpha < 0.0f ? c.alpha : params.alpha;
  const float tau = params.tau < 0.0f ? c.tau : params.tau;

  // init_request_rows
  for (int p = 0; p < N; ++p) {
    const int r = row + p;
    draft_temperature_[r] = draft_temperature;
    target_temperature_[r] = target_temperature;
    alpha_[r] = alpha;
    finished_[r] = 0;
    logw_[r] = 0.0;
    independent_logw_[r] = 0.0;
    weight_magnitude_[r] = 0.0;
    row_flags_[r] = 0;
    slots_.live[r] = p == 0 ? 1 : 0;
  }
  seeds_[q] = params.seed;
  draw_counters_[q] = 0;
  tau_[q] = tau;
  ess_[q] = 0.0;
  resampled_[q] = 0;
  log_evidence_[q] = 0.0;

  // The prompt, then admit_alloc: P + 1 slots from the top of the stack, or the row is refused.
  for (int j = 0; j < P; ++j)
    slots_.token(row, j) = prompt[j];
  const int needed = P + 1;
  if (slots_.free_count < needed) {
    slots_.live[row] = 0;
    slots_.seq_len[row] = 0;
    row_flags_[row] |= kFlagSlotsExhausted;
    status_ |= kFlagSlotsExhausted;
  } else {
    for (int j = 0; j < needed; ++j) {
      const int32_t slot = slots_.free_stack[slots_.free_count - 1 - j];
      slots_.slot(row, j) = slot;
      slots_.refcount[slot] = 1;
    }
    slots_.free_count -= needed;
    slots_.seq_len[row] = needed;
  }

  if (slots_.live[row]) {
    // Chunked prefill of both models (KV of positions < P), the target's logits of position P - 1.
    std::vector<float> last_logits(vocab_);
    for (int begin = 0; begin < P; begin += prefill_chunk_) {
      const int length = std::min(prefill_chunk_, P - begin);
      ToyForwardInputs in;
      in.rows = 1;
      in.tokens_per_row = length;
      in.tokens.assign(prompt.begin() + begin, prompt.begin() + begin + length);
      in.positions.resize(length);
      for (int j = 0; j < length; ++j)
        in.positions[j] = begin + j;
      in.slot_table.assign(slots_.slot_table.begin() + slots_.cell(row, 0),
                           slots_.slot_table.begin() + slots_.cell(row, 0) + max_seq_len_);
      in.seq_lens = {begin + length};
      in.out_slots.assign(in.slot_table.begin() + begin, in.slot_table.begin() + begin + length);
      in.live = {1};
      draft_model_.write_kv(in, draft_kv_);
      target_model_.write_kv(in, target_kv_);
      if (begin + length == P)
        target_model_.token_logits(in, target_kv_, 0, length - 1, last_logits.data());
    }
    round_logits(last_logits);
    // x_P from softmax(alpha l / T_t): salt kAdmission step 0, particle 0, draw counter 0.
    const Draw first = draw(last_logits.data(), row, target_temperature, alpha,
                            philox_stream(Salt::kAdmission, 0), "admission token");
    // admit_finish
    if (first.token < 0 || row_flags_[row] != 0) {
      slots_.live[row] = 0;
    } else {
      slots_.token(row, P) = first.token;
      if (first.token == c.eos_id) { // EOS as the first token: every particle starts finished and stopped
        for (int p = 0; p < N; ++p)
          finished_[row + p] = 1;
        slots_.live[row] = 0;
      }
    }
  }
  if (N > 1) {
    std::vector<uint8_t> mask(requests_count_, 0);
    mask[q] = 1;
    const int before = slots_.free_count;
    fan_out_rows_ref(slots_, N, mask);
    collect_freed(before);
  }

  CycleRequestRef request;
  request.id = next_id_++;
  request.slot = q;
  request.prompt_length = P;
  request.length = P + 1;
  request.max_new_tokens = params.max_new_tokens;
  slot_owner_[q] = request.id;
  requests_[request.id] = request;
  return request.id;
}

void SmcCycleReference::release(RequestId id) {
  const auto it = requests_.find(id);
  require(it != requests_.end(), "SmcCycleReference::release", "id", id,
          "unknown or already released request");
  const int q = it->second.slot;
  std::vector<uint8_t> mask(rows_, 0);
  for (int p = 0; p < particles_; ++p)
    mask[q * particles_ + p] = 1;
  const int before = slots_.free_count;
  release_rows_ref(slots_, mask);
  collect_freed(before);
  slot_owner_[q] = -1;
  requests_.erase(it);
}

std::vector<RequestUpdate> SmcCycleReference::cycle() {
  propose();
  return finish();
}

void SmcCycleReference::propose() {
  require(!proposed_cycle_, "SmcCycleReference::propose", "state", "proposed", "call finish() first");
  bucket_ = bucket_for();
  proposed_cycle_ = true;
  if (bucket_ == 0)
    return; // step() launches nothing
  const int N = particles_, K = steps_, V = vocab_, R = rows_;
  const int rows = bucket_ * N;
  status_ = 0;

  // 1. alloc: K + 1 slots per live row for positions L .. L + K (rows beyond the bucket are never live).
  {
    std::vector<int32_t> out;
    alloc_cycle_slots_ref(slots_, N, K + 1, out, row_flags_, status_);
    std::copy(out.begin(), out.begin() + static_cast<size_t>(rows) * (K + 1), cycle_slots_.begin());
  }
  std::vector<int> length(rows, 0);
  for (int r = 0; r < rows; ++r) {
    proposed_[r] = slots_.live[r];
    length[r] = slots_.seq_len[r];
  }
  for (int r = rows; r < R; ++r)
    proposed_[r] = 0;

  // 2. draft head over [x_{L-2}, x_{L-1}] at positions L - 2, L - 1; d_1 from its last column.
  {
    ToyForwardInputs in = forward_inputs(2);
    for (int r = 0; r < rows; ++r) {
      if (!proposed_[r])
        continue;
      const int L = length[r];
      for (int j = 0; j < 2; ++j) {
        in.tokens[2 * r + j] = slots_.token(r, L - 2 + j);
        in.positions[2 * r + j] = L - 2 + j;
        in.out_slots[2 * r + j] = slots_.slot(r, L - 2 + j);
      }
      in.seq_lens[r] = L;
    }
    std::vector<float> logits(static_cast<size_t>(rows) * 2 * V, 0.0f);
    draft_model_.forward(in, draft_kv_, logits);
    round_logits(logits);
    for (int r = 0; r < rows; ++r) {
      if (!proposed_[r])
        continue;
      const Draw d = draw(logits.data() + (static_cast<size_t>(r) * 2 + 1) * V, r, draft_temperature_[r],
                          1.0f, philox_stream(Salt::kDraft, 0), "draft token 1");
      draft_tokens_[draft_index(r, 0)] = d.token;
      draft_logprobs_[draft_index(r, 0)] = d.logprob;
    }
  }
  // 3. draft steps: d_s at position L + s - 1 (reading positions < L + s), then d_{s+1}.
  for (int s = 1; s < K; ++s) {
    ToyForwardInputs in = forward_inputs(1);
    for (int r = 0; r < rows; ++r) {
      if (!proposed_[r])
        continue;
      const int L = length[r];
      in.tokens[r] = draft_tokens_[draft_index(r, s - 1)];
      in.positions[r] = L + s - 1;
      in.out_slots[r] = slots_.slot(r, L + s - 1);
      in.seq_lens[r] = L + s;
    }
    std::vector<float> logits(static_cast<size_t>(rows) * V, 0.0f);
    draft_model_.forward(in, draft_kv_, logits);
    round_logits(logits);
    const std::string what = "draft token " + std::to_string(s + 1);
    for (int r = 0; r < rows; ++r) {
      if (!proposed_[r])
        continue;
      const Draw d = draw(logits.data() + static_cast<size_t>(r) * V, r, draft_temperature_[r], 1.0f,
                          philox_stream(Salt::kDraft, static_cast<uint32_t>(s)), what.c_str());
      draft_tokens_[draft_index(r, s)] = d.token;
      draft_logprobs_[draft_index(r, s)] = d.logprob;
    }
  }
  // 4. target verify over [x_{L-1}, d_1 .. d_K] at positions L - 1 .. L + K - 1 (reading positions < L + K).
  std::vector<float> logits(static_cast<size_t>(rows) * (K + 1) * V, 0.0f);
  {
    ToyForwardInputs in = forward_inputs(K + 1);
    for (int r = 0; r < rows; ++r) {
      if (!proposed_[r])
        continue;
      const int L = length[r];
      const size_t base = static_cast<size_t>(r) * (K + 1);
      in.tokens[base] = slots_.token(r, L - 1);
      for (int k = 0; k < K; ++k)
        in.tokens[base + 1 + k] = draft_tokens_[draft_index(r, k)];
      for (int j = 0; j <= K; ++j) {
        in.positions[base + j] = L - 1 + j;
        in.out_slots[base + j] = slots_.slot(r, L - 1 + j);
      }
      in.seq_lens[r] = L + K;
    }
    target_model_.forward(in, target_kv_, logits);
    round_logits(logits);
  }
  // 5. score: log p(d_{k+1}) under T_t at column k < K; the bonus (alpha, salt kBonus) at column K.
  for (int r = 0; r < rows; ++r) {
    if (!proposed_[r])
      continue;
    const float* row_logits = logits.data() + static_cast<size_t>(r) * (K + 1) * V;
    for (int k = 0; k < K; ++k) {
      uint32_t flags = 0;
      const double logprob = token_logprob(row_logits + static_cast<size_t>(k) * V, V, target_temperature_[r],
                                           draft_tokens_[draft_index(r, k)], &flags);
      target_logprobs_[static_cast<size_t>(r) * K + k] = static_cast<float>(logprob);
      row_flags_[r] |= flags;
      status_ |= flags;
    }
    const Draw bonus = draw(row_logits + static_cast<size_t>(K) * V, r, target_temperature_[r], alpha_[r],
                            philox_stream(Salt::kBonus, 0), "bonus token");
    bonus_tokens_[r] = bonus.token;
    bonus_logprobs_[r] = bonus.logprob;
    bonus_logz_[r] = bonus.logz;
  }
  own_draft_logprobs_ = draft_logprobs_;
  own_target_logprobs_ = target_logprobs_;
  own_bonus_logz_ = bonus_logz_;
}

void SmcCycleReference::adopt_logprobs(const std::vector<float>& draft_logprobs,
                                       const std::vector<float>& target_logprobs,
                                       const std::vector<float>& bonus_logz) {
  require(proposed_cycle_, "SmcCycleReference::adopt_logprobs", "state", "idle", "call propose() first");
  const int K = steps_, R = rows_, rows = bucket_ * particles_;
  require(draft_logprobs.size() >= static_cast<size_t>(K + 1) * R, "SmcCycleReference::adopt_logprobs",
          "draft_logprobs.size()", draft_logprobs.size(), "must be >= (K + 1) * rows");
  require(target_logprobs.size() >= static_cast<size_t>(rows) * K, "SmcCycleReference::adopt_logprobs",
          "target_logprobs.size()", target_logprobs.size(), "must be >= bucket rows * K");
  require(bonus_logz.size() >= static_cast<size_t>(rows), "SmcCycleReference::adopt_logprobs",
          "bonus_logz.size()", bonus_logz.size(), "must be >= bucket rows");
  for (int r = 0; r < rows; ++r) {
    if (!proposed_[r])
      continue;
    for (int k = 0; k < K; ++k) {
      draft_logprobs_[draft_index(r, k)] = draft_logprobs[draft_index(r, k)];
      target_logprobs_[static_cast<size_t>(r) * K + k] = target_logprobs[static_cast<size_t>(r) * K + k];
    }
    bonus_logz_[r] = bonus_logz[r];
  }
}

std::vector<RequestUpdate> SmcCycleReference::finish() {
  require(proposed_cycle_, "SmcCycleReference::finish", "state", "idle", "call propose() first");
  proposed_cycle_ = false;
  if (bucket_ == 0)
    return {};
  const int N = particles_, K = steps_, R = rows_;
  const int rows = bucket_ * N;

  // 6. weights, from the cycle's log-probs (adopted or own) and, independently, from the reference's own.
  {
    std::vector<float> draft(static_cast<size_t>(rows) * K), target(static_cast<size_t>(rows) * K);
    std::vector<float> own_draft(draft.size()), own_target(target.size()), logz(rows), own_logz(rows);
    std::vector<int32_t> tokens(draft.size());
    for (int r = 0; r < rows; ++r) {
      for (int k = 0; k < K; ++k) {
        const size_t dense = static_cast<size_t>(r) * K + k, block = draft_index(r, k);
        draft[dense] = draft_logprobs_[block];
        own_draft[dense] = own_draft_logprobs_[block];
        target[dense] = target_logprobs_[dense];
        own_target[dense] = own_target_logprobs_[dense];
        tokens[dense] = draft_tokens_[block];
      }
      logz[r] = bonus_logz_[r];
      own_logz[r] = own_bonus_logz_[r];
    }
    std::vector<uint8_t> finished_before = finished_;
    std::vector<int32_t> counted, counted_own;
    const std::vector<int32_t> bonus(bonus_tokens_.begin(), bonus_tokens_.begin() + rows);
    accumulate_weights_ref(draft, target, logz, tokens, bonus, alpha_, slots_.live, rows, K, config_.eos_id,
                           logw_, finished_, counted);
    accumulate_weights_ref(own_draft, own_target, own_logz, tokens, bonus, alpha_, slots_.live, rows, K,
                           config_.eos_id, independent_logw_, finished_before, counted_own);
    for (int r = 0; r < rows; ++r) {
      first_eos_[r] = counted[r];
      if (counted[r] < 0)
        continue;
      double magnitude = 0.0;
      for (int k = 0; k < K && k <= counted[r]; ++k) {
        const size_t dense = static_cast<size_t>(r) * K + k;
        magnitude +=
            std::abs(static_cast<double>(alpha_[r]) * own_target[dense]) + std::abs(own_draft[dense]);
      }
      if (counted[r] == K)
        magnitude += std::abs(static_cast<double>(own_logz[r]));
      weight_magnitude_[r] += magnitude;
    }
  }
  // 7. commit: the cycle's tokens at positions L .. L + K, L += K + 1; faulted rows stop.
  for (int r = 0; r < rows; ++r) {
    int32_t* cycle = cycle_tokens_.data() + static_cast<size_t>(r) * (K + 1);
    if (!slots_.live[r]) {
      std::fill(cycle, cycle + K + 1, kInvalidToken);
      continue;
    }
    const int L = slots_.seq_len[r];
    for (int k = 0; k < K; ++k)
      cycle[k] = slots_.token(r, L + k) = draft_tokens_[draft_index(r, k)];
    cycle[K] = slots_.token(r, L + K) = bonus_tokens_[r];
    slots_.seq_len[r] = L + K + 1;
    if (row_flags_[r] & kRowDataFaults)
      slots_.live[r] = 0;
  }
  // 8. resample (bucket requests), then 9. reshuffle with the freed slots pushed in ascending id order.
  {
    std::vector<int32_t> plan;
    std::vector<double> ess;
    std::vector<uint8_t> resampled;
    resample_ref(slots_.live, tau_, seeds_, draw_counters_, bucket_, N, logw_, plan, ess, resampled,
                 log_evidence_);
    std::vector<int32_t> full_plan(R);
    for (int r = 0; r < R; ++r)
      full_plan[r] = r < rows ? plan[r] : r;
    for (int r = 0; r < rows; ++r)
      ancestor_[r] = plan[r];
    for (int q = 0; q < bucket_; ++q) {
      ess_[q] = ess[q];
      resampled_[q] = resampled[q];
      if (!resampled[q])
        continue;
      for (int p = 0; p < N; ++p) {
        independent_logw_[q * N + p] = 0.0;
        weight_magnitude_[q * N + p] = 0.0;
      }
    }
    const int before = slots_.free_count;
    reshuffle_ref(slots_, full_plan, finished_);
    collect_freed(before);
  }
  // 10. draw counters of the bucket's requests.
  for (int q = 0; q < bucket_; ++q)
    ++draw_counters_[q];

  // The updates poll() builds from the packed outputs (process_cycle in engine.cpp).
  std::vector<RequestUpdate> updates;
  for (int q = 0; q < bucket_; ++q) {
    const RequestId id = slot_owner_[q];
    if (id < 0)
      continue;
    CycleRequestRef& request = requests_.at(id);
    if (request.finished || request.failed)
      continue;
    // The request's rows are [first, first + N): their flags ORed, all finished, any live.
    const int first = q * N;
    const auto rows_of = [&](const auto& per_row) { return std::span(per_row).subspan(first, N); };
    const uint32_t request_flags =
        std::accumulate(rows_of(row_flags_).begin(), rows_of(row_flags_).end(), 0u, std::bit_or<>());
    const bool all_finished = std::ranges::all_of(rows_of(finished_), [](uint8_t f) { return f != 0; });
    const bool any_live = std::ranges::any_of(rows_of(slots_.live), [](uint8_t l) { return l != 0; });
    RequestUpdate update;
    update.id = id;
    update.cycle = request.cycles++;
    update.tokens.assign(N, {});
    update.ancestors.assign(N, 0);
    for (int i = 0; i < N; ++i) {
      const int r = first + i;
      update.ancestors[i] = ancestor_[r] - first;
      const int counted = first_eos_[r] < 0 ? 0 : (first_eos_[r] >= K ? K + 1 : first_eos_[r] + 1);
      // A row that committed nothing this cycle (not live, or finished before) reports no tokens. (The engine
      // reads its `committed` count instead, which CommitCycleKernel leaves stale for rows that are not
      // live.)
      if (slots_.live[r] || first_eos_[r] >= 0) {
        const int32_t* tokens = cycle_tokens_.data() + static_cast<size_t>(r) * (K + 1);
        update.tokens[i].assign(tokens, tokens + counted);
      }
    }
    update.resampled = resampled_[q] != 0;
    update.ess = ess_[q];
    request.length = slots_.seq_len[q * N];
    const RequestDecision decision =
        decide_request(request_flags, all_finished, any_live, request.length - request.prompt_length,
                       request.max_new_tokens);
    update.finished = request.finished = decision.finished;
    update.failed = request.failed = decision.failed;
    update.reason = request.reason = decision.reason;
    if (any_failure_flag(request_flags))
      update.tokens.assign(N, {}); // the failed cycle's tokens are not results
    updates.push_back(std::move(update));
  }
  return updates;
}

} // namespace smcgraph::reference
