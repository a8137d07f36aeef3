// The engine's host-side argument checks (see engine_validation.hpp). No CUDA call: the CPU suites and the
// fuzz target run them without a device.
#include "runtime/engine_validation.hpp"

#include <cmath>
#include <string>

#include "smcgraph/error.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/verify.hpp"
#include "smcgraph/smc_kernels.hpp"

namespace smcgraph {

static_assert(kMaxDraftSteps <= kMaxVerifyDraftSteps, "the verifiers must accept K draft tokens");
static_assert(static_cast<uint32_t>(kMaxDraftSteps) < kMaxStep, "every draft step needs its own Philox step");
namespace {

constexpr const char* kConfig = "EngineConfig";

std::string join(const std::vector<int>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i)
    text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

void validate_adaptive(const EngineConfig& c) {
  const AdaptiveDraftSteps& a = c.adaptive;
  auto unit = [](float value) { return std::isfinite(value) && value >= 0.0f && value <= 1.0f; };
  // Used for every request (the EMA is reported even when K is fixed).
  require(unit(a.smoothing), kConfig, "adaptive.smoothing", a.smoothing, "must be in [0, 1]");
  require(unit(a.initial_acceptance), kConfig, "adaptive.initial_acceptance", a.initial_acceptance,
          "must be in [0, 1]");
  if (!a.enabled)
    return;
  // The SMC cycle commits K + 1 tokens for every particle and its score pass draws the bonus at column K of
  // the verify forward for every row alike: a per-request K there is not built
  // (docs/adaptive_draft_steps.md).
  require(c.kind == CycleKind::kSpeculative, kConfig, "adaptive.enabled", a.enabled,
          "needs kind kSpeculative (the SMC cycle drafts a fixed K)");
  require(c.draft_steps >= 1, kConfig, "adaptive.enabled", a.enabled,
          "needs draft_steps >= 1 (draft_steps = 0 decodes with the target alone)");
  require(a.mid_steps >= 1 && a.mid_steps <= c.draft_steps, kConfig, "adaptive.mid_steps", a.mid_steps,
          "must be in [1, draft_steps]");
  require(a.min_steps >= 0 && a.min_steps <= a.mid_steps, kConfig, "adaptive.min_steps", a.min_steps,
          "must be in [0, adaptive.mid_steps]");
  require(unit(a.idle_recovery), kConfig, "adaptive.idle_recovery", a.idle_recovery, "must be in [0, 1]");
  require(unit(a.low_threshold), kConfig, "adaptive.low_threshold", a.low_threshold, "must be in [0, 1]");
  require(unit(a.high_threshold) && a.high_threshold >= a.low_threshold, kConfig, "adaptive.high_threshold",
          a.high_threshold, "must be in [adaptive.low_threshold, 1]");
  require(a.pressure_cap >= 1 && a.pressure_cap <= c.draft_steps, kConfig, "adaptive.pressure_cap",
          a.pressure_cap, "must be in [1, draft_steps]");
  require(unit(a.pressure_free_fraction), kConfig, "adaptive.pressure_free_fraction",
          a.pressure_free_fraction, "must be in [0, 1]");
  require(std::isfinite(a.draft_cost) && a.draft_cost >= 0.0f && a.draft_cost <= 64.0f, kConfig,
          "adaptive.draft_cost", a.draft_cost, "must be in [0, 64]");
}

} // namespace

void validate_engine_config(const EngineConfig& c) {
  require(c.kind == CycleKind::kSmc || c.kind == CycleKind::kSpeculative, kConfig, "kind",
          static_cast<int>(c.kind), "must be kSmc or kSpeculative");
  require(c.draft_loop == DraftLoop::kAuto || c.draft_loop == DraftLoop::kConditional ||
              c.draft_loop == DraftLoop::kMasked,
          kConfig, "draft_loop", static_cast<int>(c.draft_loop), "must be kAuto, kConditional or kMasked");
  require(c.vocab >= 1, kConfig, "vocab", c.vocab, "must be >= 1");
  require(c.kind == CycleKind::kSmc || c.particles == 1, kConfig, "particles", c.particles,
          "must be 1 for the speculative cycle");
  // draft_steps = 0 (speculative only): no draft, the target alone decodes one token per row and cycle.
  static const std::string steps_range = "must be in [1, " + std::to_string(kMaxDraftSteps) +
                                         "] (the speculative cycle also takes 0: the target alone)";
  const int min_steps = c.kind == CycleKind::kSpeculative ? 0 : 1;
  require(c.draft_steps >= min_steps && c.draft_steps <= kMaxDraftSteps, kConfig, "draft_steps",
          c.draft_steps, steps_range.c_str());
  require(c.particles >= 1 && c.particles <= kMaxResampleParticles, kConfig, "particles", c.particles,
          "must be in [1, 256]");
  require(c.max_requests >= 1 && c.max_requests <= 4096, kConfig, "max_requests", c.max_requests,
          "must be in [1, 4096]");
  require(c.max_seq_len >= c.draft_steps + 4, kConfig, "max_seq_len", c.max_seq_len,
          "must be >= draft_steps + 4 (a 1-token prompt, its first token and one cycle)");
  require(c.prefill_chunk >= 0 && c.prefill_chunk <= (1 << 20), kConfig, "prefill_chunk", c.prefill_chunk,
          "must be in [0, 2^20] (0: by the models)");
  require(c.slot_pool_size >= 2, kConfig, "slot_pool_size", c.slot_pool_size,
          "must be >= 2 (slot 0 is the dummy)");
  // Slot ids, counts and the freed-slot bitmap's word count are 32-bit ints on the device.
  require(c.slot_pool_size <= (1 << 30), kConfig, "slot_pool_size", c.slot_pool_size, "must be <= 2^30");
  // SMC weights divide by q, so its draft must sample (T_d > 0); speculative decoding may draft greedily.
  if (c.kind == CycleKind::kSmc)
    require(std::isfinite(c.draft_temperature) && c.draft_temperature > 0.0f, kConfig, "draft_temperature",
            c.draft_temperature, "must be finite and > 0 for the SMC cycle");
  else
    require(std::isfinite(c.draft_temperature) && c.draft_temperature >= 0.0f, kConfig, "draft_temperature",
            c.draft_temperature, "must be finite and >= 0");
  require(std::isfinite(c.target_temperature) && c.target_temperature >= 0.0f, kConfig, "target_temperature",
          c.target_temperature, "must be finite and >= 0");
  require(std::isfinite(c.alpha) && c.alpha > 0.0f, kConfig, "alpha", c.alpha, "must be finite and > 0");
  require(c.tau >= 0.0f && c.tau <= 1.0f, kConfig, "tau", c.tau, "must be in [0, 1]");
  require(c.eos_id >= -1 && c.eos_id < c.vocab, kConfig, "eos_id", c.eos_id, "must be -1 or in [0, vocab)");
  for (size_t i = 0; i < c.buckets.size(); ++i) {
    require(c.buckets[i] >= 1 && c.buckets[i] <= c.max_requests, kConfig, "buckets", join(c.buckets),
            "every bucket must be in [1, max_requests]");
    require(i == 0 || c.buckets[i] > c.buckets[i - 1], kConfig, "buckets", join(c.buckets),
            "must be strictly increasing (sorted, no duplicates)");
  }
  require(c.buckets.empty() || c.buckets.back() == c.max_requests, kConfig, "buckets", join(c.buckets),
          "the largest bucket must equal max_requests");
  validate_adaptive(c);
}

namespace detail {

ResolvedRequestParams validate_request(const EngineConfig& c, const std::vector<int32_t>& prompt,
                                       const RequestParams& params) {
  constexpr const char* kWhere = "Engine::admit";
  require(!prompt.empty(), kWhere, "prompt.size()", 0, "the prompt must hold at least one token");
  // In 64 bits: a prompt longer than INT_MAX must be refused, not wrap around.
  const int64_t P = static_cast<int64_t>(prompt.size());
  require(P + 1 + (c.draft_steps + 1) <= c.max_seq_len, kWhere, "prompt.size()", P,
          "leaves no room for one cycle (needs prompt + draft_steps + 2 <= max_seq_len)");
  for (int64_t i = 0; i < P; ++i) {
    if (prompt[i] < 0 || prompt[i] >= c.vocab)
      throw Error(std::string(kWhere) + ": prompt[" + std::to_string(i) + "] = " + std::to_string(prompt[i]) +
                  ": token out of range [0, " + std::to_string(c.vocab) + ")");
  }
  ResolvedRequestParams resolved;
  resolved.draft_temperature =
      params.draft_temperature < 0.0f ? c.draft_temperature : params.draft_temperature;
  resolved.target_temperature =
      params.target_temperature < 0.0f ? c.target_temperature : params.target_temperature;
  resolved.alpha = params.alpha < 0.0f ? c.alpha : params.alpha;
  resolved.tau = params.tau < 0.0f ? c.tau : params.tau;
  require(std::isfinite(resolved.draft_temperature) &&
              (resolved.draft_temperature > 0.0f ||
               (resolved.draft_temperature == 0.0f && c.kind == CycleKind::kSpeculative)),
          kWhere, "params.draft_temperature", resolved.draft_temperature,
          "must be finite and > 0 (>= 0 for speculative)");
  require(std::isfinite(resolved.target_temperature), kWhere, "params.target_temperature",
          resolved.target_temperature, "must be finite and >= 0");
  require(std::isfinite(resolved.alpha) && resolved.alpha > 0.0f, kWhere, "params.alpha", resolved.alpha,
          "must be finite and > 0");
  require(resolved.tau <= 1.0f, kWhere, "params.tau", resolved.tau, "must be in [0, 1]");
  require(params.max_new_tokens == -1 || params.max_new_tokens >= 1, kWhere, "params.max_new_tokens",
          params.max_new_tokens, "must be -1 or >= 1");
  if (c.kind == CycleKind::kSmc)
    require(params.draft_steps == -1 || params.draft_steps == c.draft_steps, kWhere, "params.draft_steps",
            params.draft_steps, "must be -1 or draft_steps for the SMC cycle (it drafts a fixed K)");
  else
    require(params.draft_steps == -1 || (params.draft_steps >= 1 && params.draft_steps <= c.draft_steps),
            kWhere, "params.draft_steps", params.draft_steps, "must be -1 or in [1, draft_steps]");
  resolved.pinned_draft_steps =
      params.draft_steps > 0 ? params.draft_steps : (c.adaptive.enabled ? 0 : c.draft_steps);
  return resolved;
}

} // namespace detail
} // namespace smcgraph
