// NgramDraft on the GPU against its host reference (tests/reference/ngram_ref): every logits row bit for bit,
// for prefill-like forwards (every token's logits), head-like forwards (two tokens, the last one's logits,
// row strides) and draft-step-like forwards (one token, a token row stride, masked rows), fp32 and bf16,
// eager and captured, with poisoned logits (padding rows keep the poison).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "reference/ngram_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/ngram_draft.hpp"
#include "smcgraph/runtime.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;

namespace {

constexpr uint8_t kPoison = 0x7f;

/// A row's tokens: random tokens from a small alphabet with planted repeats, so that matches of every length
/// (and misses) occur.
std::vector<int32_t> structured_tokens(test::Rng& rng, int count, int vocab) {
  std::vector<int32_t> tokens;
  while (static_cast<int>(tokens.size()) < count) {
    if (tokens.size() >= 4 && rng.uniform() < 0.4) { // repeat an earlier stretch
      const int length = static_cast<int>(rng.integer(1, 5));
      const int start = static_cast<int>(rng.integer(0, static_cast<int64_t>(tokens.size()) - 1));
      for (int k = 0; k < length && start + k < static_cast<int>(tokens.size()); ++k)
        tokens.push_back(tokens[start + k]);
    } else {
      tokens.push_back(static_cast<int32_t>(rng.integer(0, std::min(vocab, 12) - 1)));
    }
  }
  tokens.resize(count);
  return tokens;
}

/// The expected logits row (as the device writes it in `dtype`) for a proposal.
std::vector<uint8_t> expected_row(int proposal, int vocab, float confidence, DType dtype) {
  const std::vector<float> values = reference::ngram_logits(proposal, vocab, confidence);
  std::vector<uint8_t> bytes(static_cast<size_t>(vocab) * dtype_bytes(dtype));
  for (int v = 0; v < vocab; ++v) {
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * v, &values[v], 4);
    } else {
      const uint16_t bits = test::float_to_bf16(values[v]);
      std::memcpy(bytes.data() + 2 * v, &bits, 2);
    }
  }
  return bytes;
}

} // namespace

TEST_CASE(
    "NgramDraft proposals and logits match the host reference (prefill, head, steps; eager and graphed)") {
  test::Rng rng;
  INFO("seed " << rng.seed());
  Stream stream;
  const int trials = test::sanitizer_scaled(6, 2);
  for (int trial = 0; trial < trials; ++trial)
    for (const DType dtype : {DType::kFloat32, DType::kBFloat16})
      for (const bool captured : {false, true}) {
        CAPTURE(trial);
        CAPTURE(dtype_name(dtype));
        CAPTURE(captured);
        NgramDraftOptions options;
        options.vocab = static_cast<int>(rng.integer(16, 3000));
        options.pool_size = 4096;
        options.max_seq_len = 96;
        options.logits_dtype = dtype;
        options.min_ngram = static_cast<int>(rng.integer(1, 2));
        options.max_ngram = static_cast<int>(rng.integer(options.min_ngram, 4));
        options.confidence = static_cast<float>(rng.uniform(1.0, 40.0));
        NgramDraft draft(options);
        const int rows = static_cast<int>(rng.integer(1, 6)), S = options.max_seq_len, V = options.vocab;
        // Each row: its own slots 1 + r * S + position; a prefill of `prefill` tokens, then one 2-token head
        // and one 1-token step, each over the next positions.
        const int prefill = static_cast<int>(rng.integer(1, 60));
        std::vector<std::vector<int32_t>> text(rows);
        std::vector<int32_t> slot_table(static_cast<size_t>(rows) * S, 0);
        for (int r = 0; r < rows; ++r) {
          text[r] = structured_tokens(rng, prefill + 3, V);
          for (int p = 0; p < S; ++p)
            slot_table[static_cast<size_t>(r) * S + p] = 1 + r * S + p;
        }
        DeviceBuffer<int32_t> d_slot_table = test::to_device(slot_table, stream);
        // Runs one forward over positions first .. first + per_row - 1 of every row (the token of position p
        // at row r: text[r][p]) and checks its logits. io_stride / token_stride > per_row spread the rows.
        auto run = [&](int first, int per_row, int token_stride, int io_stride, bool last_only,
                       const std::vector<uint8_t>& live) {
          std::vector<int32_t> tokens(static_cast<size_t>(rows) * token_stride, -7),
              positions(static_cast<size_t>(rows) * io_stride, 0), out_slots(positions.size(), 0),
              seq_lens(rows, first + per_row);
          for (int r = 0; r < rows; ++r)
            for (int j = 0; j < per_row; ++j) {
              tokens[static_cast<size_t>(r) * token_stride + j] = text[r][first + j];
              positions[static_cast<size_t>(r) * io_stride + j] = first + j;
              out_slots[static_cast<size_t>(r) * io_stride + j] = 1 + r * S + first + j;
            }
          DeviceBuffer<int32_t> d_tokens = test::to_device(tokens, stream),
                                d_positions = test::to_device(positions, stream),
                                d_out_slots = test::to_device(out_slots, stream),
                                d_seq_lens = test::to_device(seq_lens, stream);
          DeviceBuffer<uint8_t> d_live = test::to_device(live, stream);
          const int logit_rows = last_only ? rows : rows * io_stride;
          DeviceBuffer<uint8_t> d_logits(static_cast<size_t>(logit_rows) * V * dtype_bytes(dtype));
          d_logits.fill_bytes(kPoison, stream);
          ForwardArgs args{rows,
                           per_row,
                           d_tokens.data(),
                           d_positions.data(),
                           d_slot_table.data(),
                           d_seq_lens.data(),
                           d_out_slots.data(),
                           d_live.data(),
                           d_logits.data(),
                           token_stride,
                           io_stride};
          args.last_token_logits = last_only;
          test::run_on_stream(captured, stream, [&](cudaStream_t s) { draft.forward(args, s); });
          const std::vector<uint8_t> got = test::to_host(d_logits.data(), d_logits.size(), stream);
          const size_t row_bytes = static_cast<size_t>(V) * dtype_bytes(dtype);
          int wrong = 0, proposals = 0, checked = 0;
          for (int r = 0; r < rows; ++r)
            for (int j = 0; j < per_row; ++j) {
              if (last_only && j != per_row - 1)
                continue;
              const size_t out = last_only ? r : static_cast<size_t>(r) * io_stride + j;
              const uint8_t* row = got.data() + out * row_bytes;
              if (!live[r]) { // padding rows keep the poison
                wrong += std::any_of(row, row + row_bytes, [](uint8_t b) { return b != kPoison; }) ? 1 : 0;
                continue;
              }
              const std::vector<int32_t> history(text[r].begin(), text[r].begin() + first + j + 1);
              const int proposal =
                  reference::ngram_proposal(history, options.min_ngram, options.max_ngram, V);
              proposals += proposal >= 0;
              ++checked;
              const std::vector<uint8_t> want = expected_row(proposal, V, options.confidence, dtype);
              if (std::memcmp(row, want.data(), row_bytes) != 0) {
                if (wrong == 0)
                  MESSAGE("row " << r << " token " << j << ": reference proposal " << proposal);
                ++wrong;
              }
            }
          CHECK(wrong == 0);
          return std::make_pair(proposals, checked);
        };
        std::vector<uint8_t> all_live(rows, 1), some_live(rows, 1);
        if (rows > 1)
          some_live[rng.integer(0, rows - 1)] = 0;
        const auto pre = run(0, prefill, prefill, prefill, false, all_live);
        run(prefill, 2, 2, 3, true, all_live); // head: two tokens, the last one's logits, io rows 3 apart
        run(prefill + 2, 1, 5, 1, true,
            some_live); // a step: one token out of a [rows, 5] block, a masked row
        MESSAGE("prefill proposals " << pre.first << " of " << pre.second);
      }
}

TEST_CASE("NgramDraft: the store holds each written slot's token; slot 0 and out-of-pool slots are never "
          "written") {
  Stream stream;
  NgramDraftOptions options;
  options.vocab = 50;
  options.pool_size = 16;
  options.max_seq_len = 8;
  NgramDraft draft(options);
  // One row, four tokens: slots 3, 0 (dummy), 99 (outside the pool) and 5; token 70 is clamped to 49.
  const std::vector<int32_t> tokens = {7, 8, 9, 70}, positions = {0, 1, 2, 3}, out_slots = {3, 0, 99, 5},
                             slot_table = {3, 0, 99, 5, 0, 0, 0, 0}, seq_lens = {4};
  const std::vector<uint8_t> live = {1};
  auto d_tokens = test::to_device(tokens, stream), d_positions = test::to_device(positions, stream),
       d_out_slots = test::to_device(out_slots, stream), d_slot_table = test::to_device(slot_table, stream),
       d_seq_lens = test::to_device(seq_lens, stream);
  auto d_live = test::to_device(live, stream);
  DeviceBuffer<float> logits(4 * 50);
  draft.forward({1, 4, d_tokens.data(), d_positions.data(), d_slot_table.data(), d_seq_lens.data(),
                 d_out_slots.data(), d_live.data(), logits.data()},
                stream);
  const std::vector<int32_t> store = test::to_host(draft.store_data(), 16, stream);
  std::vector<int32_t> want(16, -1);
  want[3] = 7;
  want[5] = 49;
  CHECK(store == want);
  draft.clear(stream);
  CHECK(test::to_host(draft.store_data(), 16, stream) == std::vector<int32_t>(16, -1));
}
