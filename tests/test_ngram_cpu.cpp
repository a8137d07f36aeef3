// NgramDraft's option checks and its host reference's rule (tests/reference/ngram_ref), on the CPU.
#include <doctest/doctest.h>

#include <functional>
#include <limits>
#include <vector>

#include "reference/ngram_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/ngram_draft.hpp"

using namespace smcgraph;

TEST_CASE(
    "the n-gram rule: the longest recent match first, then shorter ones, never across unwritten tokens") {
  using reference::ngram_proposal;
  // "a b c d a b c" -> the 3-gram "a b c" occurred at 0..2, followed by d.
  CHECK(ngram_proposal({1, 2, 3, 4, 1, 2, 3}, 1, 3, 10) == 4);
  // The most recent occurrence wins: "x y" at 0..1 (then 5) and at 3..4 (then 6).
  CHECK(ngram_proposal({7, 8, 5, 7, 8, 6, 7, 8}, 1, 2, 10) == 6);
  // No 3-gram or 2-gram match: the 1-gram "3" occurred at 1, followed by 9.
  CHECK(ngram_proposal({2, 3, 9, 4, 3}, 1, 3, 10) == 9);
  // min_ngram 2: the 1-gram match does not count.
  CHECK(ngram_proposal({2, 3, 9, 4, 3}, 2, 3, 10) == -1);
  // Too short a history, or an unwritten token (-1) in the suffix: no proposal.
  CHECK(ngram_proposal({5}, 1, 3, 10) == -1);
  CHECK(ngram_proposal({}, 1, 3, 10) == -1);
  CHECK(ngram_proposal({4, -1, 4, -1}, 1, 1, 10) == -1);
  // A match followed by an unwritten token falls back to a shorter n-gram.
  CHECK(ngram_proposal({1, 2, -1, 5, 2, 6, 1, 2}, 1, 2, 10) == 6);
  // A proposal outside the vocabulary is none.
  CHECK(ngram_proposal({1, 12, 1}, 1, 1, 10) == -1);
  const std::vector<float> logits = reference::ngram_logits(2, 4, 30.0f);
  CHECK(logits == std::vector<float>{0.0f, 0.0f, 30.0f, 0.0f});
  CHECK(reference::ngram_logits(-1, 3, 30.0f) == std::vector<float>{0.0f, 0.0f, 0.0f});
}

TEST_CASE("every NgramDraftOptions field out of range is named with its value") {
  auto expect = [](const std::function<void(NgramDraftOptions&)>& edit, const char* text) {
    NgramDraftOptions options;
    edit(options);
    CHECK_THROWS_WITH_AS(validate_ngram_draft_options(options), doctest::Contains(text), Error);
  };
  CHECK_NOTHROW(validate_ngram_draft_options(NgramDraftOptions{}));
  expect([](auto& o) { o.vocab = 0; }, "vocab = 0");
  expect([](auto& o) { o.pool_size = 1; }, "pool_size = 1");
  expect([](auto& o) { o.max_seq_len = 0; }, "max_seq_len = 0");
  expect([](auto& o) { o.max_seq_len = kNgramMaxSeqLen + 1; }, "max_seq_len = 16385");
  expect([](auto& o) { o.logits_dtype = DType::kFloat16; }, "logits_dtype");
  expect([](auto& o) { o.min_ngram = 0; }, "min_ngram = 0");
  expect([](auto& o) { o.max_ngram = 9; }, "max_ngram = 9");
  expect(
      [](auto& o) {
        o.min_ngram = 3;
        o.max_ngram = 2;
      },
      "max_ngram = 2");
  expect([](auto& o) { o.confidence = 0.0f; }, "confidence = 0");
  expect([](auto& o) { o.confidence = std::numeric_limits<float>::infinity(); }, "confidence = inf");
}
