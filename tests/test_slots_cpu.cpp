// Slot pool: host reference self-checks, the invariant checker, and launcher validation (no GPU needed:
// launchers validate before any CUDA call).
#include <doctest/doctest.h>

#include <algorithm>
#include <set>

#include "reference/slots_ref.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/types.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;
using reference::HostSlots;

namespace {

// A state with a request that is admitted (prompt of 3, N = 2), one decoded a cycle, one that is empty.
HostSlots small_state(std::mt19937_64& rng) {
  HostSlots state(/*pool_size=*/40, /*rows=*/6, /*max_seq_len=*/12);
  REQUIRE(reference::admit_ref(state, 2, 0, 3, rng));
  REQUIRE(reference::admit_ref(state, 2, 2, 4, rng));
  std::vector<int32_t> out;
  std::vector<uint32_t> flags(6, 0);
  uint32_t status = 0;
  reference::alloc_cycle_slots_ref(state, 2, 2, out, flags, status);
  reference::fake_commit_ref(state, 2, rng);
  reference::copy_row_refcounted_ref(state, 5, 4); // a resample: row 4 takes row 5
  REQUIRE(state.check().ok);
  return state;
}

// Pointers that are never dereferenced: validation throws before anything touches them.
int32_t g_fake_int[4];
uint8_t g_fake_byte[4];
uint32_t g_fake_word[4];

SlotPoolView fake_pool() {
  return {g_fake_int, g_fake_int, g_fake_int, 16};
}
RowTablesView fake_tables(int rows) {
  return {g_fake_int, g_fake_int, g_fake_int, g_fake_byte, rows, 8};
}

} // namespace

TEST_CASE("reference pool starts as [pool_size - 1 .. 1] with refcount 0") {
  HostSlots state(6, 2, 4);
  CHECK(state.free_count == 5);
  CHECK(state.free_stack == std::vector<int32_t>{5, 4, 3, 2, 1});
  CHECK(state.refcount == std::vector<int32_t>(6, 0));
  const SlotCheck check = state.check();
  CHECK(check.ok);
  CHECK(check.free == 5);
  CHECK(check.referenced == 0);
}

TEST_CASE("reference alloc serves requests in order, stops at the first that does not fit") {
  // 5 requests x N = 2, 3 slots per row. Request 0 needs 6; request 1 is at max length (needs nothing,
  // blocks nobody); request 2 needs 6; request 3 has no live rows; request 4 needs 6 but only 4 are left,
  // and request 5 has one live row (needs 3 <= 4) but starves too: service stopped at request 4.
  HostSlots state(/*pool_size=*/17, /*rows=*/12, /*max_seq_len=*/10);
  for (int row : {0, 1, 2, 3, 4, 5, 8, 9, 10})
    state.live[row] = 1;
  state.seq_len[2] = state.seq_len[3] = 8; // 8 + 3 > 10 (no slots referenced: the checker is not run here)
  std::vector<int32_t> out;
  std::vector<uint32_t> flags(12, 0);
  flags[0] = kFlagNanLogit; // OR-ed, never overwritten
  uint32_t status = kFlagAllMasked;
  reference::alloc_cycle_slots_ref(state, 2, 3, out, flags, status);

  // Popped from the top: 1, 2, 3 to row 0, 4, 5, 6 to row 1, 7, 8, 9 to row 4, 10, 11, 12 to row 5.
  const std::vector<int32_t> expected_out = {1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 0, 7, 8, 9, 10, 11, 12,
                                             0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  0,  0};
  CHECK(out == expected_out);
  CHECK(state.free_count == 4);
  CHECK(state.slot(0, 0) == 1);
  CHECK(state.slot(5, 2) == 12);
  for (int slot = 1; slot <= 12; ++slot)
    CHECK(state.refcount[slot] == 1);
  for (int slot = 13; slot <= 16; ++slot)
    CHECK(state.refcount[slot] == 0);
  CHECK(flags == std::vector<uint32_t>{kFlagNanLogit, 0, kFlagMaxLength, kFlagMaxLength, 0, 0, 0, 0,
                                       kFlagSlotsExhausted, kFlagSlotsExhausted, kFlagSlotsExhausted, 0});
  CHECK(status == (kFlagAllMasked | kFlagMaxLength | kFlagSlotsExhausted));
  CHECK(state.live == std::vector<uint8_t>{1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0});
}

TEST_CASE("reference alloc, commit, copy and release keep the invariants and leak nothing") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  for (int trial = 0; trial < 200; ++trial) {
    const int requests = static_cast<int>(rng.integer(1, 12));
    const int particles = static_cast<int>(rng.integer(1, 8));
    const int max_seq_len = static_cast<int>(rng.integer(4, 40));
    const int pool_size = static_cast<int>(rng.integer(1, requests * particles * max_seq_len / 2 + 2));
    HostSlots state = reference::random_slot_state(rng.engine(), requests, particles, max_seq_len, pool_size);
    SlotCheck check = state.check();
    REQUIRE_MESSAGE(check.ok, check.problem);

    std::vector<uint8_t> mask(state.rows);
    for (auto& bit : mask)
      bit = rng.uniform() < 0.3;
    reference::release_rows_ref(state, mask);
    check = state.check();
    REQUIRE_MESSAGE(check.ok, check.problem);

    reference::release_rows_ref(state, std::vector<uint8_t>(state.rows, 1));
    check = state.check();
    REQUIRE_MESSAGE(check.ok, check.problem);
    CHECK(check.free == pool_size - 1);
    CHECK(check.referenced == 0);
  }
}

TEST_CASE("reference fan-out gives a prompt's slots refcount N") {
  test::Rng rng;
  HostSlots state(30, 8, 10);
  REQUIRE(reference::admit_ref(state, 4, 1, 5, rng.engine(), /*fan_out=*/false));
  CHECK(state.check().ok);
  reference::fan_out_rows_ref(state, 4, {0, 1});
  const SlotCheck check = state.check();
  REQUIRE_MESSAGE(check.ok, check.problem);
  CHECK(check.referenced == 5);
  for (int j = 0; j < 5; ++j)
    CHECK(state.refcount[state.slot(4, j)] == 4);
  for (int row = 5; row < 8; ++row) {
    CHECK(state.seq_len[row] == 5);
    CHECK(state.live[row] == 1);
    for (int j = 0; j < 5; ++j)
      CHECK(state.token(row, j) == state.token(4, j));
  }
}

TEST_CASE("reference refcount changes push exactly the slots that reach 0") {
  HostSlots state(8, 1, 4);
  // Hand-made: slots 1 and 2 referenced twice (inc'd), one dec each leaves them held.
  std::vector<int32_t> out;
  std::vector<uint32_t> flags(1, 0);
  uint32_t status = 0;
  state.live[0] = 1;
  reference::alloc_cycle_slots_ref(state, 1, 2, out, flags, status);
  CHECK(out == std::vector<int32_t>{1, 2});
  reference::inc_ref_slots_ref(state, {1, 0, 2}, nullptr); // 0 ignored
  CHECK(state.refcount[1] == 2);
  CHECK(state.refcount[0] == 0);
  const std::vector<uint8_t> mask = {1, 0, 1};
  reference::dec_ref_slots_ref(state, {1, 2, 2}, &mask); // slot 2 once (the middle entry is masked)
  CHECK(state.refcount[1] == 1);
  CHECK(state.refcount[2] == 1);
  CHECK(state.free_count == 5);
  reference::dec_ref_slots_ref(state, {2, 1}, nullptr);
  CHECK(state.free_count == 7);
  CHECK(state.free_stack[5] == 2);
  CHECK(state.free_stack[6] == 1);
}

TEST_CASE("invariant checker detects every kind of corruption") {
  test::Rng rng;
  const HostSlots good = small_state(rng.engine());
  const int32_t referenced_slot = good.slot_table[0]; // row 0, position 0: the shared prompt
  REQUIRE(good.refcount[referenced_slot] >= 2);
  const int32_t free_slot = good.free_stack[0];

  auto expect = [](const HostSlots& state, const char* fragment) {
    const SlotCheck check = state.check();
    CHECK_FALSE(check.ok);
    CHECK_MESSAGE(check.problem.find(fragment) != std::string::npos, check.problem);
  };
  {
    HostSlots bad = good;
    bad.refcount[referenced_slot] += 1;
    expect(bad, "references");
  }
  {
    HostSlots bad = good;
    bad.free_stack[bad.free_count++] = free_slot;
    expect(bad, "twice");
  }
  {
    HostSlots bad = good;
    bad.refcount[free_slot] = 1;
    expect(bad, "free slot");
  }
  {
    HostSlots bad = good;
    bad.free_stack[1] = good.pool_size;
    expect(bad, "not a slot id");
  }
  {
    HostSlots bad = good;
    bad.free_stack[1] = 0;
    expect(bad, "not a slot id");
  }
  {
    HostSlots bad = good;
    bad.slot(0, 1) = -4;
    expect(bad, "slot_table[0][1]");
  }
  {
    HostSlots bad = good;
    bad.slot(0, 1) = 0; // the dummy is never referenced
    expect(bad, "slot_table[0][1]");
  }
  {
    HostSlots bad = good;
    bad.free_count -= 1; // popped, never referenced
    expect(bad, "leaked");
  }
  {
    HostSlots bad = good;
    bad.free_stack[bad.free_count++] = referenced_slot; // freed while referenced
    expect(bad, "free but referenced");
  }
  {
    HostSlots bad = good;
    bad.free_count = good.pool_size;
    expect(bad, "free_count");
  }
  {
    HostSlots bad = good;
    bad.seq_len[1] = good.max_seq_len + 1;
    expect(bad, "seq_len[1]");
  }
  {
    HostSlots bad = good;
    bad.refcount[0] = 1;
    expect(bad, "dummy");
  }
  {
    HostSlots bad = good;
    bad.live[3] = 7;
    expect(bad, "live[3]");
  }
  {
    HostSlots bad = good;
    bad.refcount.pop_back();
    expect(bad, "refcount has");
  }
}

TEST_CASE("slot launchers name the bad parameter before any CUDA call") {
  using doctest::Contains;
  const SlotPoolView pool = fake_pool();
  const RowTablesView tables = fake_tables(8);
  CHECK_THROWS_WITH_AS(init_slot_pool({g_fake_int, g_fake_int, g_fake_int, 0}, nullptr),
                       Contains("init_slot_pool: pool.pool_size = 0"), Error);
  CHECK_THROWS_WITH_AS(init_slot_pool({g_fake_int, g_fake_int, nullptr, 4}, nullptr),
                       Contains("init_slot_pool: pool.refcount"), Error);
  CHECK_THROWS_WITH_AS(init_slot_pool({nullptr, g_fake_int, g_fake_int, 4}, nullptr),
                       Contains("init_slot_pool: pool.free_stack"), Error);

  CHECK_THROWS_WITH_AS(alloc_cycle_slots(pool, tables, 0, 2, g_fake_int, g_fake_word, g_fake_word, nullptr),
                       Contains("alloc_cycle_slots: particles_per_request = 0"), Error);
  CHECK_THROWS_WITH_AS(alloc_cycle_slots(pool, tables, 3, 2, g_fake_int, g_fake_word, g_fake_word, nullptr),
                       Contains("alloc_cycle_slots: tables.rows = 8"), Error);
  CHECK_THROWS_WITH_AS(alloc_cycle_slots(pool, tables, 4, 0, g_fake_int, g_fake_word, g_fake_word, nullptr),
                       Contains("alloc_cycle_slots: slots_per_row = 0"), Error);
  CHECK_THROWS_WITH_AS(alloc_cycle_slots(pool, tables, 4, 9, g_fake_int, g_fake_word, g_fake_word, nullptr),
                       Contains("alloc_cycle_slots: slots_per_row = 9"), Error);
  CHECK_THROWS_WITH_AS(alloc_cycle_slots(pool, tables, 4, 2, nullptr, g_fake_word, g_fake_word, nullptr),
                       Contains("alloc_cycle_slots: out_slots"), Error);
  CHECK_THROWS_WITH_AS(alloc_cycle_slots(pool, tables, 4, 2, g_fake_int, nullptr, g_fake_word, nullptr),
                       Contains("alloc_cycle_slots: row_flags"), Error);
  CHECK_THROWS_WITH_AS(alloc_cycle_slots(pool, tables, 4, 2, g_fake_int, g_fake_word, nullptr, nullptr),
                       Contains("alloc_cycle_slots: status"), Error);
  RowTablesView no_live = tables;
  no_live.live = nullptr;
  CHECK_THROWS_WITH_AS(alloc_cycle_slots(pool, no_live, 4, 2, g_fake_int, g_fake_word, g_fake_word, nullptr),
                       Contains("alloc_cycle_slots: tables.live"), Error);
  RowTablesView negative = tables;
  negative.rows = -4;
  CHECK_THROWS_WITH_AS(alloc_cycle_slots(pool, negative, 4, 2, g_fake_int, g_fake_word, g_fake_word, nullptr),
                       Contains("alloc_cycle_slots: tables.rows = -4"), Error);
  RowTablesView no_length = tables;
  no_length.max_seq_len = 0;
  CHECK_THROWS_WITH_AS(release_rows(pool, no_length, g_fake_byte, nullptr),
                       Contains("release_rows: tables.max_seq_len = 0"), Error);

  CHECK_THROWS_WITH_AS(dec_ref_slots(pool, g_fake_int, nullptr, -1, nullptr),
                       Contains("dec_ref_slots: count = -1"), Error);
  CHECK_THROWS_WITH_AS(inc_ref_slots(pool, nullptr, nullptr, 3, nullptr), Contains("inc_ref_slots: slots"),
                       Error);
  CHECK_THROWS_WITH_AS(release_rows(pool, tables, nullptr, nullptr), Contains("release_rows: release_mask"),
                       Error);
  CHECK_THROWS_WITH_AS(fan_out_rows(pool, tables, 0, g_fake_byte, nullptr),
                       Contains("fan_out_rows: particles_per_request = 0"), Error);
  CHECK_THROWS_WITH_AS(fan_out_rows(pool, tables, 4, nullptr, nullptr),
                       Contains("fan_out_rows: request_mask"), Error);

  // Empty launches are valid and touch nothing (no CUDA call either).
  CHECK_NOTHROW(alloc_cycle_slots(pool, fake_tables(0), 4, 2, nullptr, nullptr, nullptr, nullptr));
  CHECK_NOTHROW(dec_ref_slots(pool, nullptr, nullptr, 0, nullptr));
  CHECK_NOTHROW(release_rows(pool, fake_tables(0), nullptr, nullptr));
}
