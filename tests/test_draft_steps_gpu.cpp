// The device's draft-length decision (src/kernels/draft_steps.cu) against the host reference
// (tests/reference/draft_steps_ref.cpp) on fresh random inputs, eagerly and inside a captured graph, with
// poisoned outputs: the EMA bit for bit, the next K, the K of this cycle and the KV-pressure flag; alone and
// folded into the output packing (decide_and_pack_outputs).
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "kernels/cycle_io.hpp"
#include "reference/draft_steps_ref.hpp"
#include "smcgraph/runtime.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;
namespace test = smcgraph::test;

namespace {

uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

} // namespace

TEST_CASE(
    "decide_draft_steps (alone and fused with the output packing) matches the host reference: EMA bits, "
    "next K (K = 0 included), pressure cap, pins") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  Stream stream;
  const int trials = test::sanitizer_scaled(60, 8, 4);
  for (int trial = 0; trial < trials; ++trial) {
    EngineConfig config;
    config.kind = CycleKind::kSpeculative;
    config.particles = 1;
    config.draft_steps = static_cast<int>(rng.integer(1, 16));
    config.slot_pool_size = static_cast<int>(rng.integer(2, 5000));
    config.adaptive.enabled = rng.uniform() < 0.8;
    config.adaptive.mid_steps = static_cast<int>(rng.integer(1, config.draft_steps));
    // min_steps 0 (a request may draft nothing) in a quarter of the trials: such a cycle moves the EMA
    // toward 1 by idle_recovery.
    config.adaptive.min_steps =
        rng.uniform() < 0.25 ? 0 : static_cast<int>(rng.integer(1, config.adaptive.mid_steps));
    config.adaptive.idle_recovery = static_cast<float>(rng.uniform());
    config.adaptive.pressure_cap = static_cast<int>(rng.integer(1, config.draft_steps));
    config.adaptive.smoothing = static_cast<float>(rng.uniform());
    config.adaptive.low_threshold = static_cast<float>(rng.uniform(0.0, 0.7));
    config.adaptive.high_threshold = static_cast<float>(rng.uniform(config.adaptive.low_threshold, 1.0));
    config.adaptive.pressure_free_fraction = static_cast<float>(rng.uniform());
    // Half the trials take the cost-aware rule (yields compared in double on both sides).
    config.adaptive.draft_cost = rng.uniform() < 0.5 ? 0.0f : static_cast<float>(rng.uniform(0.01, 3.0));
    validate_engine_config(config);
    const reference::DraftStepsRule rule = reference::draft_steps_rule(config);
    const int requests = static_cast<int>(rng.integer(1, 300)), K = config.draft_steps;
    const int free_slots = static_cast<int>(rng.integer(0, config.slot_pool_size - 1));

    // Half the trials fold the draw-counter advance into the launch (as the cycles do).
    const bool advance = trial % 2 == 0;
    std::vector<uint32_t> counters(requests);
    for (uint32_t& c : counters)
      c = static_cast<uint32_t>(rng.bits());
    std::vector<int32_t> committed(requests), accepted(requests), pinned(requests), steps(requests);
    std::vector<float> ema(requests);
    for (int q = 0; q < requests; ++q) {
      committed[q] = rng.uniform() < 0.85 ? static_cast<int32_t>(rng.integer(1, K + 1)) : 0;
      pinned[q] = rng.uniform() < 0.2 ? static_cast<int32_t>(rng.integer(1, K)) : 0;
      steps[q] = static_cast<int32_t>(rng.integer(config.adaptive.min_steps == 0 ? 0 : 1, K));
      accepted[q] = static_cast<int32_t>(rng.integer(0, steps[q]));
      // Values that sit on a threshold are the ones a rounding difference would flip.
      const double pick = rng.uniform();
      ema[q] = pick < 0.1   ? config.adaptive.high_threshold
               : pick < 0.2 ? config.adaptive.low_threshold
                            : static_cast<float>(rng.uniform());
    }
    // The fused end-of-cycle launch (decide_and_pack_outputs: the decision, the draw counters and the output
    // packing) must leave the same state, and pack the decision's values.
    for (const bool fused : {false, true})
      for (bool captured : {false, true}) {
        CAPTURE(trial);
        CAPTURE(fused);
        CAPTURE(captured);
        const bool advanced = fused || advance;
        DeviceBuffer<int32_t> d_committed(requests), d_accepted(requests), d_pinned(requests),
            d_steps(requests), d_cycle_steps(requests), d_free(1), d_decision_free(1);
        DeviceBuffer<float> d_ema(requests);
        DeviceBuffer<uint8_t> d_pressure(1);
        DeviceBuffer<uint32_t> d_counters(requests);
        d_counters.copy_from_host(counters.data(), requests, stream);
        d_committed.copy_from_host(committed.data(), requests, stream);
        d_accepted.copy_from_host(accepted.data(), requests, stream);
        d_pinned.copy_from_host(pinned.data(), requests, stream);
        d_steps.copy_from_host(steps.data(), requests, stream);
        d_ema.copy_from_host(ema.data(), requests, stream);
        d_free.copy_from_host(&free_slots, 1, stream);
        for (auto* poisoned : {&d_cycle_steps, &d_decision_free})
          poisoned->fill_bytes(0x7f, stream);
        d_pressure.fill_bytes(0x7f, stream);
        detail::CycleBuffers b;
        b.pool.free_count = d_free.data();
        b.pool.pool_size = config.slot_pool_size;
        b.particles = 1;
        b.draft_steps = K;
        b.max_rows = requests;
        b.policy = detail::draft_steps_policy(config);
        b.committed = d_committed.data();
        b.pinned_draft_steps = d_pinned.data();
        b.request_draft_steps = d_steps.data();
        b.cycle_draft_steps = d_cycle_steps.data();
        b.acceptance_ema = d_ema.data();
        b.decision_free_slots = d_decision_free.data();
        b.kv_pressure = d_pressure.data();
        b.draw_counters = d_counters.data();
        // What the packing reads besides the decision (particles = 1: request q is row q).
        const detail::OutputLayout layout = detail::output_layout(requests, requests, K);
        DeviceBuffer<int32_t> d_zeros_i32(static_cast<size_t>(requests) * (K + 1)), d_seq_len(requests);
        DeviceBuffer<uint32_t> d_zeros_u32(requests), d_status(1);
        DeviceBuffer<uint8_t> d_zeros_u8(requests), d_out(layout.bytes);
        DeviceBuffer<double> d_ess(requests);
        for (auto* zero : {&d_zeros_i32, &d_seq_len})
          zero->fill_bytes(0, stream);
        d_zeros_u32.fill_bytes(0, stream);
        d_status.fill_bytes(0, stream);
        d_zeros_u8.fill_bytes(0, stream);
        d_ess.fill_bytes(0, stream);
        d_out.fill_bytes(0x7f, stream);
        b.tables.live = d_zeros_u8.data();
        b.tables.seq_len = d_seq_len.data();
        b.cycle_tokens = d_zeros_i32.data();
        b.first_eos = d_zeros_i32.data();
        b.ancestor = d_zeros_i32.data();
        b.accepted = d_accepted.data();
        b.row_flags = d_zeros_u32.data();
        b.status = d_status.data();
        b.finished = d_zeros_u8.data();
        b.resampled = d_zeros_u8.data();
        b.ess = d_ess.data();
        test::run_on_stream(captured, stream, [&](cudaStream_t s) {
          if (fused)
            detail::decide_and_pack_outputs(b, requests, d_accepted.data(), d_out.data(), s);
          else
            detail::decide_draft_steps(b, requests, d_accepted.data(), s, advance);
        });
        std::vector<uint8_t> out(layout.bytes);
        d_out.copy_to_host(out.data(), out.size(), stream);
        std::vector<uint32_t> got_counters(requests);
        d_counters.copy_to_host(got_counters.data(), requests, stream);
        std::vector<int32_t> got_steps(requests), got_cycle(requests);
        std::vector<float> got_ema(requests);
        int32_t got_free = 0;
        uint8_t got_pressure = 0;
        d_steps.copy_to_host(got_steps.data(), requests, stream);
        d_cycle_steps.copy_to_host(got_cycle.data(), requests, stream);
        d_ema.copy_to_host(got_ema.data(), requests, stream);
        d_decision_free.copy_to_host(&got_free, 1, stream);
        d_pressure.copy_to_host(&got_pressure, 1, stream);
        stream.synchronize();
        CHECK(got_free == free_slots);
        CHECK(got_pressure == (reference::kv_pressure(rule, free_slots) ? 1 : 0));
        if (fused)
          CHECK(out[layout.kv_pressure] == got_pressure);
        int mismatches = 0;
        for (int q = 0; q < requests; ++q) {
          reference::RequestDraftState state{ema[q], steps[q], pinned[q]};
          const int used = reference::advance(rule, state, committed[q] > 0, accepted[q], free_slots);
          mismatches += got_cycle[q] != used;
          mismatches += got_steps[q] != state.steps;
          mismatches += float_bits(got_ema[q]) != float_bits(state.ema);
          if (fused) { // the packed copy of the decision
            int32_t packed_cycle, packed_next, packed_committed, packed_accepted;
            float packed_ema;
            std::memcpy(&packed_cycle, out.data() + layout.cycle_draft_steps + 4 * q, 4);
            std::memcpy(&packed_next, out.data() + layout.next_draft_steps + 4 * q, 4);
            std::memcpy(&packed_ema, out.data() + layout.acceptance_ema + 4 * q, 4);
            std::memcpy(&packed_committed, out.data() + layout.committed + 4 * q, 4);
            std::memcpy(&packed_accepted, out.data() + layout.accepted + 4 * q, 4);
            mismatches += packed_cycle != used;
            mismatches += packed_next != state.steps;
            mismatches += float_bits(packed_ema) != float_bits(state.ema);
            mismatches += packed_committed != committed[q];
            mismatches += packed_accepted != accepted[q];
          }
          if (mismatches > 0 && mismatches < 4)
            MESSAGE("request " << q << ": K " << got_cycle[q] << " -> " << got_steps[q] << " ema "
                               << got_ema[q] << "; reference " << used << " -> " << state.steps << " ema "
                               << state.ema);
        }
        CHECK(mismatches == 0);
        int counter_mismatches = 0;
        for (int q = 0; q < requests; ++q)
          counter_mismatches += got_counters[q] != counters[q] + (advanced ? 1u : 0u);
        CHECK(counter_mismatches == 0);
      }
  }
}
