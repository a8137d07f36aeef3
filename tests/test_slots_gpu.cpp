// Slot pool kernels against the host reference, eagerly and inside a captured graph, plus a randomized
// multi-round run (admit / alloc / commit / resample / reshuffle / release) checked after every step.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "kernels/cycle_io.hpp"
#include "runtime/engine_validation.hpp"
#include "reference/slots_ref.hpp"
#include "reference/smc_ref.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/smc_kernels.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/types.hpp"
#include "smcgraph/verify.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;
using reference::DeviceSlots;
using reference::HostSlots;
using test::run_on_stream;
using test::to_device;
using test::to_host;

namespace {

constexpr bool kModes[] = {false, true}; // eager, captured

#define REQUIRE_SAME(expected, actual, exact_order)                                                          \
  do {                                                                                                       \
    const std::string difference_ = reference::compare_slots((expected), (actual), (exact_order));           \
    REQUIRE_MESSAGE(difference_.empty(), difference_);                                                       \
  } while (0)

#define REQUIRE_INVARIANTS(state)                                                                            \
  do {                                                                                                       \
    const SlotCheck check_ = (state).check();                                                                \
    REQUIRE_MESSAGE(check_.ok, check_.problem);                                                              \
  } while (0)

// The live part of the free stack below `old_count` must not move when a kernel only pushes.
void require_stack_prefix_kept(const HostSlots& before, const HostSlots& after) {
  for (int i = 0; i < std::min(before.free_count, after.free_count); ++i) {
    REQUIRE(after.free_stack[i] == before.free_stack[i]);
  }
}

struct AllocResult {
  HostSlots state;
  std::vector<int32_t> out_slots;
  std::vector<uint32_t> row_flags;
  uint32_t status = 0;
};

// Runs alloc_cycle_slots on a fresh upload of `initial` with poisoned out_slots.
AllocResult device_alloc(const HostSlots& initial, int particles, int slots_per_row,
                         const std::vector<uint32_t>& row_flags, uint32_t status, bool captured,
                         Stream& stream) {
  DeviceSlots device(initial.pool_size, initial.rows, initial.max_seq_len);
  device.upload(initial, stream);
  DeviceBuffer<int32_t> d_out(static_cast<size_t>(initial.rows) * slots_per_row);
  d_out.fill_bytes(0xff, stream);
  DeviceBuffer<uint32_t> d_flags = to_device(row_flags, stream);
  DeviceBuffer<uint32_t> d_status = to_device(std::vector<uint32_t>{status}, stream);
  run_on_stream(captured, stream, [&](cudaStream_t s) {
    alloc_cycle_slots(device.pool(), device.tables(), particles, slots_per_row, d_out.data(), d_flags.data(),
                      d_status.data(), s);
  });
  AllocResult result;
  result.state = device.download(stream);
  result.out_slots = to_host(d_out.data(), d_out.size(), stream);
  result.row_flags = to_host(d_flags.data(), d_flags.size(), stream);
  result.status = to_host(d_status.data(), 1, stream)[0];
  return result;
}

void check_alloc_against_reference(const HostSlots& initial, int particles, int slots_per_row, test::Rng& rng,
                                   Stream& stream) {
  std::vector<uint32_t> row_flags(initial.rows);
  for (auto& flags : row_flags)
    flags = rng.uniform() < 0.2 ? kFlagNanLogit : kFlagNone;
  const uint32_t status = rng.uniform() < 0.5 ? kFlagTokenOutOfRange : kFlagNone;
  HostSlots expected = initial;
  std::vector<int32_t> expected_out;
  std::vector<uint32_t> expected_flags = row_flags;
  uint32_t expected_status = status;
  reference::alloc_cycle_slots_ref(expected, particles, slots_per_row, expected_out, expected_flags,
                                   expected_status);
  for (const bool captured : kModes) {
    CAPTURE(captured);
    const AllocResult actual =
        device_alloc(initial, particles, slots_per_row, row_flags, status, captured, stream);
    REQUIRE_SAME(expected, actual.state, /*exact_order=*/true); // pops only: the stack is untouched
    REQUIRE(actual.out_slots == expected_out);
    REQUIRE(actual.row_flags == expected_flags);
    REQUIRE(actual.status == expected_status);
    HostSlots committed = actual.state;
    reference::fake_commit_ref(committed, slots_per_row, rng.engine());
    REQUIRE_INVARIANTS(committed);
  }
}

} // namespace

TEST_CASE("init_slot_pool matches the reference") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  for (const int pool_size : {1, 2, 3, 257, static_cast<int>(rng.integer(2, 100000))}) {
    CAPTURE(pool_size);
    HostSlots junk(pool_size, 3, 5);
    std::fill(junk.free_stack.begin(), junk.free_stack.end(), -1); // as 0xff poison
    std::fill(junk.refcount.begin(), junk.refcount.end(), -1);
    junk.free_count = -1;
    for (int32_t& cell : junk.slot_table)
      cell = static_cast<int32_t>(rng.integer(-5, 5));
    HostSlots expected = junk;
    reference::init_slot_pool_ref(expected);
    for (const bool captured : kModes) {
      CAPTURE(captured);
      DeviceSlots device(pool_size, 3, 5);
      device.upload(junk, stream);
      run_on_stream(captured, stream, [&](cudaStream_t s) { init_slot_pool(device.pool(), s); });
      REQUIRE_SAME(expected, device.download(stream), true);
    }
  }
}

TEST_CASE("alloc_cycle_slots matches the reference on random states") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  for (int trial = 0; trial < 40; ++trial) {
    const int requests = static_cast<int>(rng.integer(1, 40));
    const int particles = std::vector<int>{1, 2, 3, 4, 8}[rng.integer(0, 4)];
    const int max_seq_len = static_cast<int>(rng.integer(4, 64));
    const int slots_per_row = static_cast<int>(rng.integer(1, std::min(9, max_seq_len)));
    const int pool_size = static_cast<int>(rng.integer(1, requests * particles * max_seq_len / 3 + 2));
    CAPTURE(trial);
    CAPTURE(requests);
    CAPTURE(particles);
    CAPTURE(slots_per_row);
    CAPTURE(pool_size);
    const HostSlots initial =
        reference::random_slot_state(rng.engine(), requests, particles, max_seq_len, pool_size);
    REQUIRE_INVARIANTS(initial);
    check_alloc_against_reference(initial, particles, slots_per_row, rng, stream);
  }
}

TEST_CASE("alloc_cycle_slots serves more requests than one CTA pass (several tiles)") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  // 2500 requests x 2 and 3000 x 1: three passes of 1024; the pool runs out in the second or third pass.
  for (const auto& [requests, particles] : {std::pair{2500, 2}, std::pair{3000, 1}}) {
    CAPTURE(requests);
    const int max_seq_len = 12;
    HostSlots initial(requests * particles * 5, requests * particles, max_seq_len);
    for (int request = 0; request < requests; ++request) {
      if (rng.uniform() < 0.8)
        reference::admit_ref(initial, particles, request, static_cast<int>(rng.integer(1, 4)), rng.engine());
    }
    for (int request = 0; request < requests; ++request) { // a few at max length, a few refused-but-holding
      const double coin = rng.uniform();
      if (coin < 0.02) {
        for (int p = 0; p < particles; ++p)
          initial.seq_len[request * particles + p] = max_seq_len - 1;
      } else if (coin < 0.04) {
        for (int p = 0; p < particles; ++p)
          initial.live[request * particles + p] = 0;
      }
    }
    // Lengths were bumped without slots and part of the stack is hidden (run out mid-way): not a consistent
    // state, but alloc only reads lengths, live flags and the live part of the stack.
    initial.free_count = std::min(initial.free_count, requests * particles * 3 / 2);
    for (int i = initial.free_count; i < initial.pool_size - 1; ++i)
      initial.free_stack[i] = -7;
    const int slots_per_row = 3;
    std::vector<uint32_t> row_flags(initial.rows, 0);
    HostSlots expected = initial;
    std::vector<int32_t> expected_out;
    uint32_t expected_status = 0;
    reference::alloc_cycle_slots_ref(expected, particles, slots_per_row, expected_out, row_flags,
                                     expected_status);
    CHECK((expected_status & kFlagSlotsExhausted) != 0);
    for (const bool captured : kModes) {
      CAPTURE(captured);
      const AllocResult actual = device_alloc(initial, particles, slots_per_row,
                                              std::vector<uint32_t>(initial.rows, 0), 0, captured, stream);
      REQUIRE_SAME(expected, actual.state, true);
      REQUIRE(actual.out_slots == expected_out);
      REQUIRE(actual.row_flags == row_flags);
      REQUIRE(actual.status == expected_status);
    }
  }
}

TEST_CASE("pool exhaustion: starved requests are flagged, earlier ones get their slots") {
  test::Rng rng;
  Stream stream;
  constexpr int kRequests = 6, kN = 4, kSlotsPerRow = 5, kMaxLen = 64;
  // Requests 0, 2, 3: prompt 3, need 20 each. Request 1: prompt 62 (62 + 5 > 64: max length, needs
  // nothing). Request 4: needs 20 with 7 left: exhausted. Request 5: one live row, needs 5 <= 7, but service
  // stopped at request 4: exhausted too.
  const int prompt_slots = 5 * 3 + 62; // shared by each request's particles
  const int pool_size = 1 + prompt_slots + 3 * 20 + 7;
  HostSlots initial(pool_size, kRequests * kN, kMaxLen);
  for (int request = 0; request < kRequests; ++request) {
    REQUIRE(reference::admit_ref(initial, kN, request, request == 1 ? 62 : 3, rng.engine()));
  }
  std::vector<uint8_t> release(kRequests * kN, 0);
  for (int p = 1; p < kN; ++p)
    release[5 * kN + p] = 1;
  reference::release_rows_ref(initial, release);
  REQUIRE_INVARIANTS(initial);
  REQUIRE(initial.free_count == 3 * 20 + 7); // the released rows shared their prompt: nothing came back
  for (const bool captured : kModes) {
    CAPTURE(captured);
    const AllocResult actual = device_alloc(initial, kN, kSlotsPerRow,
                                            std::vector<uint32_t>(kRequests * kN, 0), 0, captured, stream);
    CHECK(actual.state.free_count == 7);
    CHECK(actual.status == (kFlagMaxLength | kFlagSlotsExhausted));
    std::set<int32_t> granted;
    for (int row = 0; row < kRequests * kN; ++row) {
      const int request = row / kN;
      CAPTURE(row);
      const bool gets_slots = request == 0 || request == 2 || request == 3;
      const uint32_t expected_flag = request == 1    ? kFlagMaxLength
                                     : request == 4  ? kFlagSlotsExhausted
                                     : row == 5 * kN ? kFlagSlotsExhausted
                                                     : kFlagNone;
      CHECK(actual.row_flags[row] == expected_flag);
      CHECK(actual.state.live[row] == (gets_slots ? 1 : 0));
      for (int j = 0; j < kSlotsPerRow; ++j) {
        const int32_t slot = actual.out_slots[row * kSlotsPerRow + j];
        if (gets_slots) {
          CHECK(slot > 0);
          CHECK(granted.insert(slot).second);
          CHECK(actual.state.slot(row, 3 + j) == slot);
          CHECK(actual.state.refcount[slot] == 1);
        } else {
          CHECK(slot == 0);
        }
      }
    }
    CHECK(granted.size() == 60);
  }
}

TEST_CASE("dec_ref_slots and inc_ref_slots match the reference") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  for (int trial = 0; trial < 30; ++trial) {
    const int requests = static_cast<int>(rng.integer(1, 30));
    const int particles = static_cast<int>(rng.integer(1, 8));
    const int max_seq_len = static_cast<int>(rng.integer(4, 48));
    const int pool_size =
        static_cast<int>(rng.integer(requests * particles * 2, requests * particles * max_seq_len));
    CAPTURE(trial);
    const HostSlots initial =
        reference::random_slot_state(rng.engine(), requests, particles, max_seq_len, pool_size);
    // Each referenced slot up to refcount times (so several threads of one launch may free the same slot
    // together), with dummies and out-of-pool ids mixed in; shuffled.
    std::vector<int32_t> slots;
    for (int slot = 1; slot < pool_size; ++slot) {
      const int copies = static_cast<int>(rng.integer(0, initial.refcount[slot]));
      for (int c = 0; c < copies; ++c)
        slots.push_back(slot);
    }
    for (int extra = 0; extra < 5; ++extra)
      slots.push_back(rng.uniform() < 0.5 ? 0 : pool_size + 3);
    std::shuffle(slots.begin(), slots.end(), rng.engine());
    std::vector<uint8_t> mask(slots.size());
    for (auto& bit : mask)
      bit = rng.uniform() < 0.8;
    const bool use_mask = rng.uniform() < 0.5;
    DeviceBuffer<int32_t> d_slots = to_device(slots, stream);
    DeviceBuffer<uint8_t> d_mask = to_device(mask, stream);
    const int count = static_cast<int>(slots.size());

    HostSlots expected_dec = initial, expected_inc = initial;
    reference::dec_ref_slots_ref(expected_dec, slots, use_mask ? &mask : nullptr);
    reference::inc_ref_slots_ref(expected_inc, slots, use_mask ? &mask : nullptr);
    for (const bool captured : kModes) {
      CAPTURE(captured);
      DeviceSlots device(pool_size, initial.rows, max_seq_len);
      device.upload(initial, stream);
      run_on_stream(captured, stream, [&](cudaStream_t s) {
        dec_ref_slots(device.pool(), d_slots.data(), use_mask ? d_mask.data() : nullptr, count, s);
      });
      const HostSlots after_dec = device.download(stream);
      REQUIRE_SAME(expected_dec, after_dec, false);
      require_stack_prefix_kept(initial, after_dec);

      device.upload(initial, stream);
      run_on_stream(captured, stream, [&](cudaStream_t s) {
        inc_ref_slots(device.pool(), d_slots.data(), use_mask ? d_mask.data() : nullptr, count, s);
      });
      REQUIRE_SAME(expected_inc, device.download(stream), true);
    }
  }
}

TEST_CASE("release_rows and fan_out_rows match the reference") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  for (int trial = 0; trial < 30; ++trial) {
    const int requests = static_cast<int>(rng.integer(1, 30));
    const int particles = static_cast<int>(rng.integer(1, 8));
    const int max_seq_len = static_cast<int>(rng.integer(4, 200)); // > 128: CTAs loop over positions
    const int pool_size =
        static_cast<int>(rng.integer(requests * particles * 2, requests * particles * max_seq_len));
    CAPTURE(trial);
    const HostSlots initial =
        reference::random_slot_state(rng.engine(), requests, particles, max_seq_len, pool_size);
    std::vector<uint8_t> release_mask(initial.rows), request_mask(requests);
    for (auto& bit : release_mask)
      bit = rng.uniform() < 0.4;
    for (auto& bit : request_mask)
      bit = rng.uniform() < 0.5;
    DeviceBuffer<uint8_t> d_release = to_device(release_mask, stream);
    DeviceBuffer<uint8_t> d_requests = to_device(request_mask, stream);
    HostSlots expected_release = initial, expected_fan_out = initial;
    reference::release_rows_ref(expected_release, release_mask);
    reference::fan_out_rows_ref(expected_fan_out, particles, request_mask);
    for (const bool captured : kModes) {
      CAPTURE(captured);
      DeviceSlots device(pool_size, initial.rows, max_seq_len);
      device.upload(initial, stream);
      run_on_stream(captured, stream, [&](cudaStream_t s) {
        release_rows(device.pool(), device.tables(), d_release.data(), s);
      });
      HostSlots actual = device.download(stream);
      REQUIRE_SAME(expected_release, actual, false);
      require_stack_prefix_kept(initial, actual);
      REQUIRE_INVARIANTS(actual);

      device.upload(initial, stream);
      run_on_stream(captured, stream, [&](cudaStream_t s) {
        fan_out_rows(device.pool(), device.tables(), particles, d_requests.data(), s);
      });
      actual = device.download(stream);
      REQUIRE_SAME(expected_fan_out, actual, false);
      require_stack_prefix_kept(initial, actual);
      REQUIRE_INVARIANTS(actual);
      const SlotCheck device_check = check_slot_invariants_device(device.pool(), device.tables(), stream);
      CHECK(device_check.ok);
    }
  }
}

TEST_CASE(
    "randomized rounds of admit / alloc / commit / resample / reshuffle / release keep the invariants") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  constexpr int kRequests = 7, kN = 4, kRows = kRequests * kN, kMaxLen = 48, kSlotsPerRow = 3, kRounds = 300;
  constexpr int kPoolSize = 260; // tight: exhaustion and max length both happen
  DeviceSlots device(kPoolSize, kRows, kMaxLen);
  HostSlots initial(kPoolSize, kRows, kMaxLen);
  for (int32_t& cell : initial.slot_table)
    cell = static_cast<int32_t>(rng.integer(-3, kPoolSize + 3));
  device.upload(initial, stream);

  DeviceBuffer<int32_t> d_out_slots(kRows * kSlotsPerRow);
  DeviceBuffer<uint32_t> d_row_flags(kRows), d_status(1), d_draw_counters(kRequests);
  DeviceBuffer<uint8_t> d_mask(kRows), d_finished(kRows), d_resampled(kRequests);
  DeviceBuffer<double> d_logw(kRows), d_ess(kRequests), d_evidence(kRequests);
  DeviceBuffer<int32_t> d_ancestor(kRows);
  DeviceBuffer<float> d_tau(kRequests);
  DeviceBuffer<uint64_t> d_seeds(kRequests);
  std::vector<uint64_t> seeds(kRequests);
  for (auto& seed : seeds)
    seed = rng.bits();
  d_seeds.copy_from_host(seeds.data(), kRequests, stream);
  int admitted = 0, exhausted = 0, too_long = 0, resampled_requests = 0;

  for (int round = 0; round < kRounds; ++round) {
    CAPTURE(round);
    const bool captured = round % 2 == 1;

    // Admission: the host pops a prompt into an empty request's first row, the device fans it out.
    HostSlots state = device.download(stream);
    std::vector<uint8_t> request_mask(kRequests, 0);
    for (int request = 0; request < kRequests; ++request) {
      bool empty = true;
      for (int p = 0; p < kN; ++p)
        empty = empty && state.seq_len[request * kN + p] == 0;
      if (empty && rng.uniform() < 0.5 &&
          reference::admit_ref(state, kN, request, static_cast<int>(rng.integer(1, 12)), rng.engine(),
                               false)) {
        request_mask[request] = 1;
        ++admitted;
      }
    }
    device.upload(state, stream);
    HostSlots expected = state;
    reference::fan_out_rows_ref(expected, kN, request_mask);
    DeviceBuffer<uint8_t> d_request_mask = to_device(request_mask, stream);
    run_on_stream(captured, stream, [&](cudaStream_t s) {
      fan_out_rows(device.pool(), device.tables(), kN, d_request_mask.data(), s);
    });
    state = device.download(stream);
    REQUIRE_SAME(expected, state, false);
    REQUIRE_INVARIANTS(state);

    // Alloc (poisoned outputs), then the commit on the host.
    std::vector<int32_t> expected_out;
    std::vector<uint32_t> expected_flags(kRows, 0);
    uint32_t expected_status = 0;
    expected = state;
    reference::alloc_cycle_slots_ref(expected, kN, kSlotsPerRow, expected_out, expected_flags,
                                     expected_status);
    d_out_slots.fill_bytes(0xff, stream);
    d_row_flags.fill_bytes(0, stream);
    d_status.fill_bytes(0, stream);
    run_on_stream(captured, stream, [&](cudaStream_t s) {
      alloc_cycle_slots(device.pool(), device.tables(), kN, kSlotsPerRow, d_out_slots.data(),
                        d_row_flags.data(), d_status.data(), s);
    });
    state = device.download(stream);
    REQUIRE_SAME(expected, state, true);
    REQUIRE(to_host(d_out_slots.data(), d_out_slots.size(), stream) == expected_out);
    REQUIRE(to_host(d_row_flags.data(), kRows, stream) == expected_flags);
    REQUIRE(to_host(d_status.data(), 1, stream)[0] == expected_status);
    exhausted += (expected_status & kFlagSlotsExhausted) ? 1 : 0;
    too_long += (expected_status & kFlagMaxLength) ? 1 : 0;
    reference::fake_commit_ref(state, kSlotsPerRow, rng.engine());
    REQUIRE_INVARIANTS(state);
    device.upload(state, stream);

    // Resample on random weights, then reshuffle with the device's plan.
    std::vector<double> logw(kRows), evidence(kRequests);
    std::vector<float> tau(kRequests);
    std::vector<uint32_t> counters(kRequests, static_cast<uint32_t>(round));
    std::vector<uint8_t> finished(kRows);
    const double spread = rng.uniform(0.1, 4.0);
    for (auto& w : logw)
      w = rng.normal(0.0, spread);
    for (auto& t : tau)
      t = std::vector<float>{0.0f, 0.5f, 1.0f, 2.0f}[rng.integer(0, 3)];
    for (auto& e : evidence)
      e = rng.normal();
    for (auto& f : finished)
      f = rng.uniform() < 0.2;
    d_logw.copy_from_host(logw.data(), kRows, stream);
    d_tau.copy_from_host(tau.data(), kRequests, stream);
    d_draw_counters.copy_from_host(counters.data(), kRequests, stream);
    d_evidence.copy_from_host(evidence.data(), kRequests, stream);
    d_finished.copy_from_host(finished.data(), kRows, stream);
    d_ancestor.fill_bytes(0xff, stream);
    d_ess.fill_bytes(0xff, stream);
    d_resampled.fill_bytes(0xff, stream);
    std::vector<int32_t> expected_ancestor;
    std::vector<double> expected_ess;
    std::vector<uint8_t> expected_resampled;
    reference::resample_ref(state.live, tau, seeds, counters, kRequests, kN, logw, expected_ancestor,
                            expected_ess, expected_resampled, evidence);
    expected = state;
    std::vector<uint8_t> expected_finished = finished;
    reference::reshuffle_ref(expected, expected_ancestor, expected_finished);
    const RowTablesView tables = device.tables();
    run_on_stream(captured, stream, [&](cudaStream_t s) {
      resample({tables.live, d_tau.data(), d_seeds.data(), d_draw_counters.data(), kRequests, kN},
               d_logw.data(), {d_ancestor.data(), d_ess.data(), d_resampled.data(), d_evidence.data()}, s);
    });
    REQUIRE(to_host(d_ancestor.data(), kRows, stream) == expected_ancestor);
    REQUIRE(to_host(d_resampled.data(), kRequests, stream) == expected_resampled);
    const std::vector<double> ess = to_host(d_ess.data(), kRequests, stream);
    const std::vector<double> evidence_after = to_host(d_evidence.data(), kRequests, stream);
    const std::vector<double> logw_after = to_host(d_logw.data(), kRows, stream);
    for (int request = 0; request < kRequests; ++request) {
      REQUIRE(test::close_to(ess[request], expected_ess[request], 1e-12));
      REQUIRE(test::close_to(evidence_after[request], evidence[request], 1e-12));
      resampled_requests += expected_resampled[request];
    }
    for (int row = 0; row < kRows; ++row)
      REQUIRE(test::close_to(logw_after[row], logw[row], 1e-12));

    run_on_stream(captured, stream, [&](cudaStream_t s) {
      reshuffle(device.pool(), device.tables(), d_ancestor.data(), d_finished.data(), s);
    });
    state = device.download(stream);
    REQUIRE_SAME(expected, state, false);
    REQUIRE(to_host(d_finished.data(), kRows, stream) == expected_finished);
    REQUIRE_INVARIANTS(state);

    // Retirement: requests refused this cycle, and now and then a live one.
    std::vector<uint8_t> release_mask(kRows, 0);
    for (int request = 0; request < kRequests; ++request) {
      const int row = request * kN;
      const bool refused = !state.live[row] && state.seq_len[row] > 0;
      if (refused || (state.live[row] && rng.uniform() < 0.05)) {
        for (int p = 0; p < kN; ++p)
          release_mask[row + p] = 1;
      }
    }
    expected = state;
    reference::release_rows_ref(expected, release_mask);
    d_mask.copy_from_host(release_mask.data(), kRows, stream);
    run_on_stream(captured, stream,
                  [&](cudaStream_t s) { release_rows(device.pool(), device.tables(), d_mask.data(), s); });
    state = device.download(stream);
    REQUIRE_SAME(expected, state, false);
    REQUIRE_INVARIANTS(state);
  }

  std::vector<uint8_t> everything(kRows, 1);
  d_mask.copy_from_host(everything.data(), kRows, stream);
  run_on_stream(false, stream,
                [&](cudaStream_t s) { release_rows(device.pool(), device.tables(), d_mask.data(), s); });
  const SlotCheck final_check = check_slot_invariants_device(device.pool(), device.tables(), stream);
  REQUIRE_MESSAGE(final_check.ok, final_check.problem);
  CHECK(final_check.free == kPoolSize - 1); // nothing leaked
  CHECK(final_check.referenced == 0);
  MESSAGE("admitted " << admitted << ", rounds with exhaustion " << exhausted << ", with max length "
                      << too_long << ", resampled requests " << resampled_requests);
  CHECK(exhausted > 0);
  CHECK(too_long > 0);
  CHECK(resampled_requests > 0);
}

TEST_CASE(
    "alloc_and_prepare_draft_inputs (one launch) leaves what alloc_cycle_slots then prepare_draft_inputs "
    "leave") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  const int trials = test::sanitizer_scaled(30, 6, 3);
  for (int trial = 0; trial < trials; ++trial) {
    const int requests = static_cast<int>(rng.integer(1, 70));
    const int particles = std::vector<int>{1, 2, 4, 8}[rng.integer(0, 3)];
    const int K = static_cast<int>(rng.integer(1, 6));
    const int max_seq_len = static_cast<int>(rng.integer(K + 4, 64));
    const int pool_size = static_cast<int>(rng.integer(2, requests * particles * max_seq_len / 3 + 3));
    const int rows = requests * particles;
    CAPTURE(trial);
    CAPTURE(requests);
    CAPTURE(particles);
    CAPTURE(K);
    CAPTURE(pool_size);
    HostSlots initial =
        reference::random_slot_state(rng.engine(), requests, particles, max_seq_len, pool_size);
    for (int r = 0; r < rows; ++r) // the draft head reads positions L - 2 and L - 1 of a live row
      if (initial.seq_len[r] < 2)
        initial.live[r] = 0;
    std::vector<int32_t> steps(requests);
    for (int32_t& k : steps)
      k = static_cast<int32_t>(rng.integer(1, K));
    std::vector<uint32_t> flags(rows);
    for (uint32_t& f : flags)
      f = rng.uniform() < 0.2 ? kFlagNanLogit : kFlagNone;

    struct Result {
      HostSlots state;
      std::vector<std::vector<int32_t>> ints;
      std::vector<uint8_t> step_live;
      std::vector<uint32_t> flags;
      uint32_t status = 0;
    };
    auto run = [&](bool fused, bool captured) {
      DeviceSlots device(initial.pool_size, rows, max_seq_len);
      device.upload(initial, stream);
      DeviceBuffer<int32_t> d_steps = to_device(steps, stream);
      DeviceBuffer<uint32_t> d_flags = to_device(flags, stream);
      DeviceBuffer<uint32_t> d_status = to_device(std::vector<uint32_t>{kFlagTokenOutOfRange}, stream);
      const size_t kp1 = static_cast<size_t>(rows) * (K + 1),
                   km1 = static_cast<size_t>(rows) * std::max(K - 1, 1);
      // Poisoned outputs: every one the stages write must be written.
      std::vector<DeviceBuffer<int32_t>> outs;
      for (size_t size : {kp1, size_t(2) * rows, size_t(2) * rows, size_t(2) * rows, size_t(rows), km1, km1,
                          km1, kp1, kp1, size_t(rows)}) {
        outs.emplace_back(size);
        outs.back().fill_bytes(0x7f, stream);
      }
      DeviceBuffer<uint8_t> d_step_live(km1);
      d_step_live.fill_bytes(0x7f, stream);
      detail::CycleBuffers b;
      b.pool = device.pool();
      b.tables = device.tables();
      b.particles = particles;
      b.draft_steps = K;
      b.max_rows = rows;
      b.request_draft_steps = d_steps.data();
      b.row_flags = d_flags.data();
      b.status = d_status.data();
      b.cycle_slots = outs[0].data();
      b.head_tokens = outs[1].data();
      b.head_positions = outs[2].data();
      b.head_out_slots = outs[3].data();
      b.head_seq_lens = outs[4].data();
      b.step_positions = outs[5].data();
      b.step_out_slots = outs[6].data();
      b.step_seq_lens = outs[7].data();
      b.verify_positions = outs[8].data();
      b.verify_out_slots = outs[9].data();
      b.verify_seq_lens = outs[10].data();
      b.step_live = d_step_live.data();
      const RequestSlotCounts counts{d_steps.data(), 1};
      run_on_stream(captured, stream, [&](cudaStream_t s) {
        if (fused) {
          detail::alloc_and_prepare_draft_inputs(b, rows, K + 1, counts, s);
        } else {
          SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(b.status, 0, sizeof(uint32_t), s));
          RowTablesView tables = b.tables;
          tables.rows = rows;
          alloc_cycle_slots(b.pool, tables, particles, K + 1, counts, b.cycle_slots, b.row_flags, b.status,
                            s);
          detail::prepare_draft_inputs(b, rows, s);
        }
      });
      Result result;
      result.state = device.download(stream);
      for (auto& out : outs)
        result.ints.push_back(to_host(out.data(), out.size(), stream));
      result.step_live = to_host(d_step_live.data(), d_step_live.size(), stream);
      result.flags = to_host(d_flags.data(), d_flags.size(), stream);
      result.status = to_host(d_status.data(), 1, stream)[0];
      return result;
    };
    const Result separate = run(false, false);
    CHECK(std::find(separate.ints[0].begin(), separate.ints[0].end(), 0x7f7f7f7f) == separate.ints[0].end());
    for (const bool captured : kModes) {
      CAPTURE(captured);
      const Result fused = run(true, captured);
      REQUIRE_SAME(separate.state, fused.state, /*exact_order=*/true);
      for (size_t i = 0; i < fused.ints.size(); ++i) {
        CAPTURE(i);
        CHECK(fused.ints[i] == separate.ints[i]);
      }
      CHECK(fused.step_live == separate.step_live);
      CHECK(fused.flags == separate.flags);
      CHECK(fused.status == separate.status);
    }
  }
}

TEST_CASE("the end of a speculative cycle: pack + commit + collect + decide + outputs in one launch, commit "
          "with the collect folded in, and the separate launches leave the same state and outputs") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  Stream stream;
  const int trials = test::sanitizer_scaled(20, 5, 3);
  for (int trial = 0; trial < trials; ++trial) {
    // Up to 1300 rows: past one CTA (1024 rows) in some trials, where the one-launch path falls back.
    const int rows =
        trial % 4 == 0 ? static_cast<int>(rng.integer(1025, 1300)) : static_cast<int>(rng.integer(1, 200));
    const int K = static_cast<int>(rng.integer(1, 6));
    const int max_seq_len = static_cast<int>(rng.integer(K + 4, 48));
    const int pool_size = static_cast<int>(rng.integer(rows * (K + 3), rows * max_seq_len + 2));
    CAPTURE(trial);
    CAPTURE(rows);
    CAPTURE(K);
    CAPTURE(pool_size);
    EngineConfig config;
    config.kind = CycleKind::kSpeculative;
    config.particles = 1;
    config.draft_steps = K;
    config.slot_pool_size = pool_size;
    config.adaptive.enabled = true;
    config.adaptive.mid_steps = static_cast<int>(rng.integer(1, K));
    config.adaptive.min_steps = 1;
    config.adaptive.pressure_cap = static_cast<int>(rng.integer(1, K));
    config.adaptive.pressure_free_fraction = static_cast<float>(rng.uniform());
    validate_engine_config(config);
    const HostSlots initial = reference::random_slot_state(rng.engine(), rows, 1, max_seq_len, pool_size);
    std::vector<int32_t> steps(rows), accepted(rows), next(rows), drafts(static_cast<size_t>(rows) * (K + 1));
    std::vector<int32_t> pinned(rows, 0);
    std::vector<uint32_t> flags(rows), counters(rows);
    std::vector<float> ema(rows);
    for (int r = 0; r < rows; ++r) {
      steps[r] = static_cast<int32_t>(rng.integer(1, K));
      accepted[r] = static_cast<int32_t>(rng.integer(0, steps[r]));
      next[r] = static_cast<int32_t>(rng.integer(0, 99));
      flags[r] = rng.uniform() < 0.1 ? kFlagNanLogit : kFlagNone;
      counters[r] = static_cast<uint32_t>(rng.bits());
      ema[r] = static_cast<float>(rng.uniform());
      if (rng.uniform() < 0.2)
        pinned[r] = static_cast<int32_t>(rng.integer(1, K));
    }
    for (int32_t& d : drafts)
      d = static_cast<int32_t>(rng.integer(0, 99));
    std::vector<float> logprobs(static_cast<size_t>(rows) * K); // the packed payload: target log-probs
    for (float& l : logprobs)
      l = static_cast<float>(-4.0 * rng.uniform());
    const int words = (pool_size + 31) / 32, summary_words = (words + 31) / 32;
    const detail::OutputLayout layout = detail::output_layout(rows, rows, K);
    struct Result {
      HostSlots state;
      std::vector<int32_t> ints;
      std::vector<uint8_t> bytes, out;
      std::vector<uint32_t> counters;
      std::vector<float> ema;
      std::vector<int32_t> packed_ints; // [packed tokens (rows * K) | offsets (rows) | total]
      std::vector<float> packed_logprobs;
    };
    enum class Mode { kSeparate, kCommitCollect, kOneLaunch };
    auto run = [&](Mode mode, bool captured) {
      DeviceSlots device(initial.pool_size, rows, max_seq_len);
      device.upload(initial, stream);
      DeviceBuffer<uint32_t> d_freed(words), d_summary(summary_words), d_ticket(1), d_status(1);
      for (auto* zero : {&d_freed, &d_summary, &d_ticket, &d_status})
        zero->fill_bytes(0, stream);
      DeviceBuffer<int32_t> d_steps = to_device(steps, stream), d_accepted = to_device(accepted, stream),
                            d_next = to_device(next, stream), d_drafts = to_device(drafts, stream),
                            d_pinned = to_device(pinned, stream);
      DeviceBuffer<uint32_t> d_flags = to_device(flags, stream), d_counters = to_device(counters, stream);
      DeviceBuffer<float> d_ema = to_device(ema, stream), d_logprobs = to_device(logprobs, stream);
      // The accepted tokens and log-probs packed, poisoned: [packed tokens | offsets | total]
      const size_t packed_size = static_cast<size_t>(rows) * K;
      DeviceBuffer<int32_t> d_packed(packed_size + rows + 1);
      DeviceBuffer<float> d_packed_logprobs(packed_size);
      d_packed.fill_bytes(0x7f, stream);
      d_packed_logprobs.fill_bytes(0xff, stream);
      PackWorkspace pack_workspace(rows, stream);
      // Outputs of the stages, poisoned: [cycle tokens | committed | first_eos | cycle K | ancestor | free]
      const size_t cycle_size = static_cast<size_t>(rows) * (K + 1);
      DeviceBuffer<int32_t> d_slots(cycle_size), d_ints(cycle_size + 4 * static_cast<size_t>(rows) + 1);
      d_ints.fill_bytes(0x7f, stream);
      DeviceBuffer<uint8_t> d_bytes(2 * static_cast<size_t>(rows) + 1), d_out(layout.bytes);
      d_bytes.fill_bytes(0, stream);
      d_out.fill_bytes(0x7f, stream);
      DeviceBuffer<double> d_ess(rows);
      d_ess.fill_bytes(0, stream);
      int32_t* ints = d_ints.data();
      detail::CycleBuffers b;
      b.pool = device.pool();
      b.pool.freed = d_freed.data();
      b.pool.freed_summary = d_summary.data();
      b.tables = device.tables();
      b.particles = 1;
      b.draft_steps = K;
      b.max_rows = rows;
      b.eos_id = 7;
      b.policy = detail::draft_steps_policy(config);
      b.request_draft_steps = d_steps.data();
      b.pinned_draft_steps = d_pinned.data();
      b.acceptance_ema = d_ema.data();
      b.draw_counters = d_counters.data();
      b.accepted = d_accepted.data();
      b.next_tokens = d_next.data();
      b.draft_tokens = d_drafts.data();
      b.row_flags = d_flags.data();
      b.status = d_status.data();
      b.cycle_slots = d_slots.data();
      b.cycle_tokens = ints;
      b.committed = ints + cycle_size;
      b.first_eos = ints + cycle_size + rows;
      b.cycle_draft_steps = ints + cycle_size + 2 * rows;
      b.ancestor = ints + cycle_size + 3 * rows;
      b.decision_free_slots = ints + cycle_size + 4 * rows;
      b.finished = d_bytes.data();
      b.resampled = d_bytes.data() + rows;
      b.kv_pressure = d_bytes.data() + 2 * rows;
      b.ess = d_ess.data();
      b.collect_ticket = d_ticket.data();
      b.target_logprobs = d_logprobs.data();
      b.packed_tokens = d_packed.data();
      b.packed_offsets = d_packed.data() + packed_size;
      b.packed_total = d_packed.data() + packed_size + rows;
      b.packed_logprobs = d_packed_logprobs.data();
      // alloc first (K_q + 1 slots a row, as the cycle does); the commit releases the rejected ones.
      alloc_cycle_slots(b.pool, b.tables, 1, K + 1, RequestSlotCounts{d_steps.data(), 1}, b.cycle_slots,
                        b.row_flags, b.status, stream);
      run_on_stream(captured, stream, [&](cudaStream_t s) {
        if (mode == Mode::kOneLaunch) {
          detail::commit_speculative_and_pack_outputs(b, rows, d_out.data(), pack_workspace, s);
          return;
        }
        // The pack as its own launch (pack.cu), as the cycle ran it before it was folded in.
        const AcceptedRows accepted_rows{b.accepted, rows, K, b.draft_tokens + 1, K + 1, nullptr};
        const PayloadView payload{b.target_logprobs, DType::kFloat32, 1, K};
        const PackOutputs packed{b.packed_logprobs, static_cast<int64_t>(packed_size), b.packed_offsets,
                                 b.packed_total, b.packed_tokens};
        pack_accepted(accepted_rows, payload, false, packed, pack_workspace, s);
        if (mode == Mode::kCommitCollect) {
          detail::commit_speculative(b, rows, s, /*collect_freed=*/true);
        } else {
          detail::commit_speculative(b, rows, s);
          collect_freed_slots(b.pool, s);
        }
        detail::decide_and_pack_outputs(b, rows, b.accepted, d_out.data(), s);
      });
      Result result;
      result.state = device.download(stream);
      result.ints = to_host(d_ints.data(), d_ints.size(), stream);
      result.bytes = to_host(d_bytes.data(), d_bytes.size(), stream);
      result.out = to_host(d_out.data(), d_out.size(), stream);
      result.counters = to_host(d_counters.data(), rows, stream);
      result.ema = to_host(d_ema.data(), rows, stream);
      result.packed_ints = to_host(d_packed.data(), d_packed.size(), stream);
      result.packed_logprobs = to_host(d_packed_logprobs.data(), d_packed_logprobs.size(), stream);
      CHECK(to_host(d_ticket.data(), 1, stream)[0] == 0u);
      const auto freed = to_host(d_freed.data(), words, stream);
      CHECK(std::all_of(freed.begin(), freed.end(), [](uint32_t w) { return w == 0; }));
      return result;
    };
    const Result separate = run(Mode::kSeparate, false);
    for (const Mode mode : {Mode::kCommitCollect, Mode::kOneLaunch}) {
      for (const bool captured : kModes) {
        CAPTURE(static_cast<int>(mode));
        CAPTURE(captured);
        const Result fused = run(mode, captured);
        REQUIRE_SAME(separate.state, fused.state, /*exact_order=*/true);
        CHECK(fused.ints == separate.ints);
        CHECK(fused.bytes == separate.bytes);
        CHECK(fused.out == separate.out);
        CHECK(fused.counters == separate.counters);
        CHECK(std::memcmp(fused.ema.data(), separate.ema.data(), rows * sizeof(float)) == 0);
        CHECK(fused.packed_ints == separate.packed_ints);
        CHECK(std::memcmp(fused.packed_logprobs.data(), separate.packed_logprobs.data(),
                          fused.packed_logprobs.size() * sizeof(float)) == 0);
        REQUIRE_INVARIANTS(fused.state);
      }
    }
  }
}
