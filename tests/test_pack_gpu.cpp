// verify_and_pack() and pack_accepted() on the GPU against the host reference: seed 000's parity grid (every
// value of every axis), odd widths and alignments, edge cases, poisoned outputs, eager and captured runs,
// and graph replays that must find the look-back workspace reset.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "reference/verify_ref.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/types.hpp"
#include "smcgraph/verify.hpp"
#include "support/test_util.hpp"

using smcgraph::DeviceBuffer;
using smcgraph::DType;
namespace reference = smcgraph::reference;
namespace test = smcgraph::test;

namespace {

constexpr int kGuardRows = 3; // packed rows past the capacity that must stay poisoned

struct PackCase {
  int rows, draft_steps;
  double alpha;
  int width;
  DType dtype;
  bool include_next = false;
  bool with_tokens = true;
  int vocab = 4096;
  int64_t extra_row_stride = 0; // payload elements between rows beyond positions * width
  int payload_offset = 0;       // elements: a misaligned payload start
  bool ready = false;           // PayloadView::ready_before_wait (small launches preload the payload)
  float expected_packed = 0.0f; // PayloadView::expected_packed_fraction (large ready launches: source order)
};

std::string describe(const PackCase& c) {
  return "rows " + std::to_string(c.rows) + " draft_steps " + std::to_string(c.draft_steps) + " alpha " +
         std::to_string(c.alpha) + " D " + std::to_string(c.width) + " " + smcgraph::dtype_name(c.dtype) +
         (c.include_next ? " +next" : "") + (c.with_tokens ? " +tokens" : "") + " stride+" +
         std::to_string(c.extra_row_stride) + " offset " + std::to_string(c.payload_offset) +
         (c.ready ? " ready" : "") + " expected packed " + std::to_string(c.expected_packed);
}

struct Outputs {
  std::vector<int32_t> accepted, next_tokens, offsets, tokens;
  std::vector<uint8_t> mismatch, packed; // packed: the whole buffer, guard rows included
  std::vector<uint32_t> flags;
  int32_t total = -1;
  uint32_t status = 0;
};

/// One case's host inputs, device buffers and launches.
struct DeviceCase {
  PackCase c;
  smcgraph::Stream& stream;
  int positions, element_bytes;
  int64_t row_stride, capacity, position_bytes;
  reference::OracleBatch batch;
  std::vector<uint8_t> payload;
  DeviceBuffer<int32_t> draft, target, accepted, next_tokens, offsets, total, tokens;
  DeviceBuffer<uint8_t> payload_buffer, packed, mismatch;
  DeviceBuffer<uint32_t> flags, status;

  DeviceCase(const PackCase& pack_case, test::Rng& rng, smcgraph::Stream& s)
      : c(pack_case), stream(s), positions(c.draft_steps + (c.include_next ? 1 : 0)),
        element_bytes(dtype_bytes(c.dtype)), row_stride(int64_t{positions} * c.width + c.extra_row_stride),
        capacity(int64_t{c.rows} * positions), position_bytes(int64_t{c.width} * element_bytes),
        draft(static_cast<size_t>(c.rows) * c.draft_steps),
        target(static_cast<size_t>(c.rows) * (c.draft_steps + 1)), accepted(c.rows), next_tokens(c.rows),
        offsets(c.rows), total(1), tokens(capacity + kGuardRows),
        payload_buffer((c.payload_offset + c.rows * row_stride) * element_bytes),
        packed((capacity + kGuardRows) * position_bytes), mismatch(c.rows), flags(c.rows), status(1) {
    // pack_accepted leaves the verdict buffers alone; give them defined bytes so read() never copies
    // uninitialized memory (initcheck).
    for (auto* buffer : {&mismatch})
      buffer->fill_bytes(0, stream);
    flags.fill_bytes(0, stream);
    status.fill_bytes(0, stream);
    upload(reference::make_oracle_batch(rng.engine(), c.rows, c.draft_steps, c.vocab, c.alpha), rng);
  }

  /// New inputs copied into the same buffers (a captured graph reads them on its next replay).
  void upload(reference::OracleBatch new_batch, test::Rng& rng) {
    batch = std::move(new_batch);
    payload.resize(c.rows * row_stride * element_bytes);
    for (size_t i = 0; i < payload.size(); i += 8) {
      const uint64_t bits = rng.bits();
      std::memcpy(payload.data() + i, &bits, std::min<size_t>(8, payload.size() - i));
    }
    upload_tokens();
    SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(payload_buffer.data() + c.payload_offset * element_bytes,
                                        payload.data(), payload.size(), cudaMemcpyHostToDevice, stream));
    stream.synchronize();
  }
  void upload_tokens() {
    draft.copy_from_host(batch.draft.data(), batch.draft.size(), stream);
    target.copy_from_host(batch.target.data(), batch.target.size(), stream);
  }

  void poison_pack() {
    for (auto* buffer : {&offsets, &total, &tokens})
      buffer->fill_bytes(0xff, stream);
    packed.fill_bytes(0xff, stream);
  }
  void poison() {
    poison_pack();
    accepted.fill_bytes(0xff, stream);
    next_tokens.fill_bytes(0xff, stream);
    mismatch.fill_bytes(0xff, stream);
    flags.fill_bytes(0, stream);
    status.fill_bytes(0, stream);
  }

  smcgraph::TokenVerifyInputs inputs() const {
    return {draft.data(), c.draft_steps, target.data(), c.draft_steps + 1, c.rows, c.draft_steps, c.vocab};
  }
  smcgraph::PayloadView payload_view() const {
    return {payload_buffer.data() + c.payload_offset * element_bytes,
            c.dtype,
            c.width,
            row_stride,
            c.ready,
            c.expected_packed};
  }
  smcgraph::PackOutputs pack_outputs() {
    return {packed.data(), capacity, offsets.data(), total.data(), c.with_tokens ? tokens.data() : nullptr};
  }

  void launch_fused(smcgraph::PackWorkspace& workspace, cudaStream_t s) {
    smcgraph::verify_and_pack(
        inputs(), payload_view(), c.include_next,
        {accepted.data(), next_tokens.data(), mismatch.data(), flags.data(), status.data()}, pack_outputs(),
        workspace, s);
  }
  /// pack_accepted() reading the accepted counts (and next tokens) a previous fused run left on the device.
  void launch_counts(smcgraph::PackWorkspace& workspace, cudaStream_t s) {
    const smcgraph::AcceptedRows rows{accepted.data(), c.rows,        c.draft_steps,
                                      draft.data(),    c.draft_steps, next_tokens.data()};
    smcgraph::pack_accepted(rows, payload_view(), c.include_next, pack_outputs(), workspace, s);
  }

  Outputs read() {
    Outputs out;
    out.accepted = test::to_host(accepted.data(), c.rows, stream);
    out.next_tokens = test::to_host(next_tokens.data(), c.rows, stream);
    out.mismatch = test::to_host(mismatch.data(), c.rows, stream);
    out.flags = test::to_host(flags.data(), c.rows, stream);
    out.status = test::to_host(status.data(), 1, stream)[0];
    out.offsets = test::to_host(offsets.data(), c.rows, stream);
    out.total = test::to_host(total.data(), 1, stream)[0];
    out.tokens = test::to_host(tokens.data(), capacity + kGuardRows, stream);
    out.packed = test::to_host(packed.data(), packed.size(), stream);
    return out;
  }

  /// Checks `out` against the oracle and the references; `verdict_written` is false after pack_accepted.
  void check(const Outputs& out, bool verdict_written) const {
    INFO(describe(c));
    const auto verdict = reference::verify_greedy(batch.draft.data(), c.draft_steps, batch.target.data(),
                                                  c.draft_steps + 1, c.rows, c.draft_steps, c.vocab);
    REQUIRE(verdict.accepted == batch.accepted); // the reference agrees with the oracle
    if (verdict_written) {
      CHECK(out.accepted == verdict.accepted);
      CHECK(out.next_tokens == verdict.next_tokens);
      CHECK(out.mismatch == verdict.mismatch);
      CHECK(out.flags == verdict.row_flags);
      CHECK(out.status == verdict.status);
    }
    const auto expected = reference::pack(verdict.accepted.data(), verdict.next_tokens.data(),
                                          batch.draft.data(), c.draft_steps, payload.data(), row_stride,
                                          c.rows, c.draft_steps, c.width, element_bytes, c.include_next);
    CHECK(out.offsets == expected.offsets);
    REQUIRE(out.total == expected.total);
    const size_t packed_bytes = static_cast<size_t>(expected.total) * position_bytes;
    CHECK(std::memcmp(out.packed.data(), expected.bytes.data(), packed_bytes) == 0);
    size_t untouched = 0;
    for (size_t i = packed_bytes; i < out.packed.size(); ++i)
      untouched += out.packed[i] == 0xff;
    CHECK(untouched == out.packed.size() - packed_bytes); // nothing written past the packed rows
    if (c.with_tokens) {
      CHECK(std::vector<int32_t>(out.tokens.begin(), out.tokens.begin() + expected.total) == expected.tokens);
      for (size_t i = expected.total; i < out.tokens.size(); ++i)
        CHECK(out.tokens[i] == -1);
    }
  }
};

/// Runs the fused kernel eagerly and captured, then pack_accepted on its counts; all against the reference.
void run_case(const PackCase& c, test::Rng& rng, smcgraph::Stream& stream,
              smcgraph::PackWorkspace& workspace) {
  DeviceCase device_case(c, rng, stream);
  for (bool captured : {false, true}) {
    device_case.poison();
    test::run_on_stream(captured, stream, [&](cudaStream_t s) { device_case.launch_fused(workspace, s); });
    device_case.check(device_case.read(), true);
  }
  device_case.poison_pack(); // the verdict stays: pack_accepted reads it
  test::run_on_stream(true, stream, [&](cudaStream_t s) { device_case.launch_counts(workspace, s); });
  device_case.check(device_case.read(), false);
}

TEST_CASE("verify_and_pack matches the reference on seed 000's parity grid") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  smcgraph::PackWorkspace workspace(4096);
  const DType f32 = DType::kFloat32, bf16 = DType::kBFloat16, f16 = DType::kFloat16;
  // Every b x draft_steps pair once; alpha, D and dtype rotate so every value of every axis is covered (a few
  // widths shrink where b * draft_steps * D would be large).
  const std::vector<PackCase> grid = {
      {1, 1, 0.3, 128, f16},      {1, 8, 0.6, 512, bf16},     {1, 64, 0.9, 1024, f32},
      {1, 128, 0.3, 2048, f16},   {1, 256, 0.6, 128, bf16},   {4, 1, 0.9, 512, f32},
      {4, 8, 0.3, 1024, f16},     {4, 64, 0.6, 2048, bf16},   {4, 128, 0.9, 128, f32},
      {4, 256, 0.3, 512, f16},    {16, 1, 0.6, 1024, bf16},   {16, 8, 0.9, 2048, f32},
      {16, 64, 0.3, 128, f16},    {16, 128, 0.6, 512, bf16},  {16, 256, 0.9, 1024, f32},
      {32, 1, 0.3, 2048, f16},    {32, 8, 0.6, 128, bf16},    {32, 64, 0.9, 512, f32},
      {32, 128, 0.3, 1024, f16},  {32, 256, 0.6, 2048, bf16}, {256, 1, 0.9, 128, f32},
      {256, 8, 0.3, 512, f16},    {256, 64, 0.6, 1024, bf16}, {256, 128, 0.9, 128, f32},
      {256, 256, 0.3, 128, bf16}, {32, 128, 0.9, 2048, f16},  {256, 8, 0.9, 1024, f16},
  };
  for (size_t i = 0; i < grid.size(); ++i) {
    PackCase c = grid[i];
    c.include_next = i % 2 == 1;
    c.with_tokens = i % 3 != 2;
    run_case(c, rng, stream, workspace);
  }
}

TEST_CASE("verify_and_pack: any width, alignment and row stride (16, 8, 4 and 2-byte copies)") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  smcgraph::PackWorkspace workspace(512);
  const std::vector<PackCase> cases = {
      {7, 5, 0.6, 1, DType::kFloat16},                             // 2-byte positions
      {9, 8, 0.6, 3, DType::kFloat32},                             // 12-byte positions: 4-byte copies
      {9, 8, 0.6, 6, DType::kBFloat16},                            // 12-byte positions
      {33, 8, 0.7, 100, DType::kFloat16},                          // 200 bytes: 8-byte copies
      {40, 9, 0.7, 129, DType::kBFloat16},                         // odd width: 2-byte copies, 2 tiles
      {20, 16, 0.5, 64, DType::kFloat16, true, true, 4096, 24},    // padded rows: stride = positions * D + 24
      {20, 16, 0.5, 64, DType::kFloat16, false, true, 4096, 0, 1}, // payload starts 2 bytes off alignment
      {300, 3, 0.5, 40, DType::kFloat32, true, true, 50, 0, 3},    // misaligned fp32, several tiles
  };
  for (const PackCase& c : cases)
    run_case(c, rng, stream, workspace);
}

TEST_CASE("verify_and_pack: any number of rows (no single-block ceiling)") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  smcgraph::PackWorkspace workspace(4096);
  for (const PackCase& c : {PackCase{4096, 8, 0.6, 128, DType::kFloat16, true},
                            PackCase{4096, 3, 0.5, 32, DType::kBFloat16, false, true},
                            PackCase{1000, 33, 0.8, 16, DType::kFloat32, false, false},
                            PackCase{2049, 300, 0.95, 8, DType::kFloat16, true, true}}) {
    CHECK(smcgraph::pack_launch_shape(c.rows, c.draft_steps, c.width, c.dtype, c.include_next, false).tiles >
          1);
    run_case(c, rng, stream, workspace);
  }
}

TEST_CASE("verify_and_pack: payloads ready before the wait, preloaded or not") {
  // PayloadView::ready_before_wait lets a small single-tile launch load every stored position before its PDL
  // wait and store the accepted ones after the scan (pack_preloads); chained or larger launches, or shares of
  // more than one copy batch, copy as without it. Same bits as the reference either way: eager, captured, and
  // pack_accepted.
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  smcgraph::PackWorkspace workspace(512);
  const DType f32 = DType::kFloat32, bf16 = DType::kBFloat16, f16 = DType::kFloat16;
  struct Expected {
    PackCase c;
    int vector_bytes; // the copy unit the launcher picks for these (aligned) buffers
    bool preload;
  };
  const std::vector<Expected> cases = {
      {{32, 8, 0.3, 128, f16}, 16, true},                        // seed 000's small shape, 4 CTAs
      {{32, 8, 0.6, 128, bf16, true}, 16, true},                 // + next: 9 positions, 5 CTAs
      {{4, 8, 0.9, 2048, f16}, 16, true},                        // 8 CTAs of one batch
      {{32, 128, 0.3, 128, f16}, 16, false},                     // 16 chained tiles
      {{64, 4, 0.7, 128, f16, true, false}, 16, false},          // 2 chained tiles, no tokens
      {{9, 8, 0.6, 3, f32}, 4, true},                            // 12-byte positions
      {{7, 5, 0.6, 1, f16}, 2, true},                            // 2-byte positions
      {{12, 16, 0.5, 64, f16, true, true, 4096, 24}, 16, true},  // padded rows, one tile
      {{20, 16, 0.5, 64, f16, true, true, 4096, 24}, 16, false}, // padded rows, 2 tiles
      {{33, 8, 0.7, 100, f16}, 8, false},                        // 2 tiles of two 8-byte batches a CTA
      {{32, 128, 0.9, 2048, f16}, 16, false},                    // 16 MB: more than 16 KiB an SM
      {{300, 3, 0.5, 40, f32, true, true, 50, 0, 3}, 4, false},  // misaligned, several tiles
  };
  for (Expected e : cases) {
    e.c.ready = true;
    INFO(describe(e.c));
    CHECK(smcgraph::pack_preloads(e.c.rows, e.c.draft_steps, e.c.width, e.c.dtype, e.c.include_next, false,
                                  e.vector_bytes) == e.preload);
    run_case(e.c, rng, stream, workspace);
  }
  CHECK_THROWS_WITH(smcgraph::pack_preloads(4, 8, 3, f16, false, false, 4),
                    doctest::Contains("vector_bytes"));
  CHECK_THROWS_WITH(smcgraph::pack_preloads(4, 8, 8, f16, false, false, 32),
                    doctest::Contains("vector_bytes"));
}

TEST_CASE("verify_and_pack: large ready launches copy in source order when the caller expects most packed") {
  // A wide launch (more than 16 KiB a CTA) with PayloadView::ready_before_wait and expected_packed_fraction
  // >= kSourceOrderMinPacked loads its first batch of stored positions before its PDL wait and stores the
  // packed ones after the scan. The hint only picks the order: a wrong one (few accepted, all, none) gives
  // the same bits. Eager, captured, and pack_accepted (run_case); SMCGRAPH_PACK_ORDER=packed / source forces
  // either.
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  smcgraph::PackWorkspace workspace(512);
  const DType f32 = DType::kFloat32, bf16 = DType::kBFloat16, f16 = DType::kFloat16;
  std::vector<PackCase> cases = {
      {32, 128, 0.9, 2048, f16},                            // the configuration, 16 tiles x 33 CTAs
      {32, 128, 0.3, 2048, bf16, true},                     // + next; the hint overstates the acceptance
      {32, 128, 1.0, 2048, f16, false, false},              // all accepted, no tokens
      {32, 128, 0.0, 2048, f16, true},                      // all rejected: only the next positions
      {4, 256, 0.8, 4096, f32},                             // 4 one-row tiles of 16 KiB positions
      {24, 100, 0.7, 2048, f16, true, true, 4096, 8},       // padded rows, a partial last tile
      {300, 16, 0.95, 1024, bf16, false, true, 4096, 0, 0}, // 19 tiles
  };
  // SMCGRAPH_PACK_ORDER (A/B runs): "packed" turns source order off, "source" on whatever the hint.
  const std::string order = std::getenv("SMCGRAPH_PACK_ORDER") ? std::getenv("SMCGRAPH_PACK_ORDER") : "";
  const bool forced_packed = order == "packed", forced_source = order == "source";
  for (PackCase& c : cases) {
    c.ready = true;
    c.expected_packed = c.alpha >= 0.5 ? static_cast<float>(c.alpha) : 0.9f;
    INFO(describe(c));
    const smcgraph::PayloadView payload{nullptr, c.dtype, c.width, 0, true, c.expected_packed};
    CHECK(smcgraph::pack_source_order(c.rows, c.draft_steps, payload, c.include_next, false, 16) ==
          !forced_packed);
    CHECK(smcgraph::pack_source_order(c.rows, c.draft_steps, payload, c.include_next, true, 16) ==
          !forced_packed);
    smcgraph::PayloadView unmarked = payload, low = payload;
    unmarked.ready_before_wait = false;
    low.expected_packed_fraction = 0.5f;
    CHECK_FALSE(smcgraph::pack_source_order(c.rows, c.draft_steps, unmarked, c.include_next, false, 16));
    CHECK(smcgraph::pack_source_order(c.rows, c.draft_steps, low, c.include_next, false, 16) ==
          forced_source);
    run_case(c, rng, stream, workspace);
  }
  // Small or narrow launches never do: a preloaded one, a 4-byte copy.
  CHECK_FALSE(smcgraph::pack_source_order(32, 8, {nullptr, f16, 128, 0, true, 1.0f}, false, false, 16));
  CHECK_FALSE(smcgraph::pack_source_order(32, 128, {nullptr, f32, 1, 0, true, 1.0f}, false, true, 4));
}

TEST_CASE("verify_and_pack: all accepted, all rejected, out-of-range ids") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  smcgraph::PackWorkspace workspace(256);
  for (int rows : {1, 32, 256}) {
    for (int draft_steps : {1, 8, 128}) {
      for (double alpha : {0.0, 1.0}) { // alpha 1: every row accepts all; alpha 0: every row rejects at 0
        PackCase c{rows, draft_steps, alpha, 64, DType::kFloat16, rows == 32};
        DeviceCase device_case(c, rng, stream);
        device_case.poison();
        test::run_on_stream(true, stream, [&](cudaStream_t s) { device_case.launch_fused(workspace, s); });
        const Outputs out = device_case.read();
        device_case.check(out, true);
        CHECK(out.total == (alpha == 1.0 ? rows * draft_steps : 0) + (c.include_next ? rows : 0));
      }
    }
  }
  // -1 padding and ids >= vocab: a mismatch there, flagged; a target next token out of range is flagged too.
  // 64 rows x 12 steps verify by ballots over two tiles; 32 x 8 (one tile, <= 8 steps) a lane a row.
  for (const PackCase& c : {PackCase{64, 12, 0.9, 32, DType::kBFloat16, true},
                            PackCase{32, 8, 0.9, 32, DType::kBFloat16, true}}) {
    CAPTURE(describe(c));
    DeviceCase device_case(c, rng, stream);
    auto batch = device_case.batch;
    const int steps = c.draft_steps;
    for (int row = 0; row < c.rows; row += 3) {
      const int j = static_cast<int>(rng.integer(0, steps - 1));
      batch.draft[row * steps + j] = row % 2 ? -1 : c.vocab + 5;
      batch.accepted[row] = std::min(batch.accepted[row], j);
    }
    for (int row = 1; row < c.rows; row += 5)
      batch.target[row * (steps + 1) + batch.accepted[row]] = -7; // the next token
    device_case.batch = batch;
    device_case.upload_tokens();
    device_case.poison();
    test::run_on_stream(false, stream, [&](cudaStream_t s) { device_case.launch_fused(workspace, s); });
    const Outputs out = device_case.read();
    device_case.check(out, true);
    CHECK(out.status == smcgraph::kFlagTokenOutOfRange);
  }
}

TEST_CASE("captured verify_and_pack replays correctly: the look-back workspace resets itself") {
  test::Rng rng;
  MESSAGE("seed " << rng.seed());
  smcgraph::Stream stream;
  smcgraph::PackWorkspace workspace(512);
  DeviceCase chained(PackCase{256, 8, 0.6, 512, DType::kFloat16, false, true}, rng, stream);
  DeviceCase single(PackCase{32, 8, 0.6, 128, DType::kBFloat16, true, true}, rng, stream);
  REQUIRE(smcgraph::pack_launch_shape(256, 8, 512, DType::kFloat16, false, false).tiles > 1);
  REQUIRE(smcgraph::pack_launch_shape(32, 8, 128, DType::kBFloat16, true, false).tiles == 1);

  auto instantiate = [&](DeviceCase& device_case) {
    return test::instantiate_graph(stream, [&](cudaStream_t s) { device_case.launch_fused(workspace, s); });
  };
  const test::GraphExec chained_exec = instantiate(chained);
  const test::GraphExec single_exec = instantiate(single);
  Outputs first;
  for (int replay = 0; replay < 4; ++replay) {
    chained.poison();
    test::launch(chained_exec, stream);
    const Outputs out = chained.read();
    chained.check(out, true);
    if (replay == 0)
      first = out;
    CHECK(out.packed == first.packed); // identical replays
    CHECK(out.offsets == first.offsets);
    single.poison();
    test::launch(single_exec, stream); // interleaved, same workspace
    single.check(single.read(), true);
  }
  // New tokens and payload in the same buffers: the replay reads them from device memory.
  for (int round = 0; round < 3; ++round) {
    chained.upload(reference::make_oracle_batch(rng.engine(), 256, 8, 4096, 0.3 + 0.3 * round), rng);
    chained.poison();
    for (int replay = 0; replay < 3; ++replay)
      test::launch(chained_exec, stream);
    chained.check(chained.read(), true);
  }
  // And an eager launch after the replays still finds the workspace ready.
  chained.poison();
  chained.launch_fused(workspace, stream);
  chained.check(chained.read(), true);
}

TEST_CASE("pack_accepted clamps counts outside [0, draft_steps]") {
  test::Rng rng;
  smcgraph::Stream stream;
  smcgraph::PackWorkspace workspace(64);
  PackCase c{40, 6, 0.5, 24, DType::kFloat32, true, true};
  DeviceCase device_case(c, rng, stream);
  std::vector<int32_t> counts(40), next(40);
  for (int row = 0; row < 40; ++row) {
    counts[row] = static_cast<int32_t>(rng.integer(-3, 9));
    next[row] = static_cast<int32_t>(rng.integer(0, 4095));
  }
  device_case.accepted.copy_from_host(counts.data(), counts.size(), stream);
  device_case.next_tokens.copy_from_host(next.data(), next.size(), stream);
  device_case.poison_pack();
  test::run_on_stream(false, stream, [&](cudaStream_t s) { device_case.launch_counts(workspace, s); });
  const Outputs out = device_case.read();
  const auto expected = reference::pack(counts.data(), next.data(), device_case.batch.draft.data(),
                                        c.draft_steps, device_case.payload.data(), device_case.row_stride,
                                        c.rows, c.draft_steps, c.width, 4, true);
  CHECK(out.offsets == expected.offsets);
  REQUIRE(out.total == expected.total);
  CHECK(std::memcmp(out.packed.data(), expected.bytes.data(), expected.bytes.size()) == 0);
  CHECK(std::vector<int32_t>(out.tokens.begin(), out.tokens.begin() + expected.total) == expected.tokens);
}

} // namespace
