// Host reference of the particle kernels (src/kernels/weights.cu, resample.cu, reshuffle.cu).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "reference/slots_ref.hpp"

namespace smcgraph::reference {

/// accumulate_weights on dense [rows, steps] inputs, same double arithmetic (no FMA) as the kernel; an empty
/// bonus_tokens is the kernel's nullptr (the bonus is not checked for EOS).
void accumulate_weights_ref(const std::vector<float>& draft_logprobs,
                            const std::vector<float>& target_logprobs, const std::vector<float>& logz,
                            const std::vector<int32_t>& draft_tokens,
                            const std::vector<int32_t>& bonus_tokens, const std::vector<float>& alpha,
                            const std::vector<uint8_t>& live, int rows, int steps, int eos_id,
                            std::vector<double>& logw, std::vector<uint8_t>& finished,
                            std::vector<int32_t>& first_eos);

/// The resampling uniform of a request: uniform_open01 of word 0 of Philox(seed) at counter
/// {0, draw_counter, 0, philox_stream(Salt::kResample, 0)}.
double resample_uniform(uint64_t seed, uint32_t draw_counter);

/// Systematic offspring counts of normalised weights for uniform u: count_i = #{m < N : C_{i-1} <= (u + m) /
/// N < C_i} with C_{N-1} = 1, computed as differences of F_i = clamp(ceil(N * C_i - u), 0, N).
std::vector<int> systematic_counts(const std::vector<double>& normalised, double u);

/// Ancestor (particle index within the request) of every particle given offspring counts: survivors keep
/// themselves, the extra copies of survivors in increasing order go to dead particles in increasing order.
std::vector<int> plan_from_counts(const std::vector<int>& counts);

/// resample on host vectors (ancestor [rows]; ess, resampled, log_evidence [requests]).
void resample_ref(const std::vector<uint8_t>& live, const std::vector<float>& tau,
                  const std::vector<uint64_t>& seeds, const std::vector<uint32_t>& draw_counters,
                  int requests, int particles_per_request, std::vector<double>& logw,
                  std::vector<int32_t>& ancestor, std::vector<double>& ess, std::vector<uint8_t>& resampled,
                  std::vector<double>& log_evidence);

/// reshuffle on a host state: every row r with a = ancestor[r] != r (and ancestor[a] == a) becomes a copy
/// of row a, finished included.
void reshuffle_ref(HostSlots& state, const std::vector<int32_t>& ancestor, std::vector<uint8_t>& finished);

/// Test helper: a random valid plan (per request, a random non-empty set of survivors; every other particle
/// takes a random survivor).
std::vector<int32_t> random_plan(std::mt19937_64& rng, int requests, int particles_per_request);

} // namespace smcgraph::reference
