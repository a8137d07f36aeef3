// How a request stands after a cycle, decided from what its rows reported: a pure function, so the engine's
// poll() and the tests share one definition (tests/test_engine_cpu.cpp checks it case by case and against the
// independent decision of tests/reference/cycle_ref.cpp over every combination of its inputs).
#pragma once

#include <cstdint>
#include <string>

namespace smcgraph::detail {

/// What one cycle's rows of a request reported, and the request's counts.
struct RequestCycleReport {
  uint32_t flags = 0;        ///< the OR of the request's row flags this cycle
  bool all_finished = false; ///< every particle has emitted EOS
  bool any_live = false;     ///< some row of the request is still live
  int length = 0;            ///< tokens in the sequence after the cycle, prompt included
  int prompt_length = 0;
  int max_new_tokens = -1; ///< <= 0: no limit
};

enum class RequestOutcome : int {
  kRunning = 0,
  kFailed,       ///< a row reported a failure flag (kRequestFailureFlags): NaN logits, bad tokens, no slots
  kMaxLength,    ///< a row reached max_seq_len
  kEos,          ///< every particle emitted EOS
  kMaxNewTokens, ///< max_new_tokens generated
  kRowsNotLive,  ///< no row is live and none of the above says why
};

struct RequestVerdict {
  RequestOutcome outcome = RequestOutcome::kRunning;
  std::string reason; ///< empty while running; the failure flags' names, or the finish reason
  bool finished() const {
    return outcome == RequestOutcome::kMaxLength || outcome == RequestOutcome::kEos ||
           outcome == RequestOutcome::kMaxNewTokens;
  }
  bool failed() const {
    return outcome == RequestOutcome::kFailed || outcome == RequestOutcome::kRowsNotLive;
  }
};

/// The first that holds, in this order: a failure flag (failed; the reason names the flags), max_seq_len
/// reached, every particle at EOS, max_new_tokens generated (finished), no live row (failed), else running.
RequestVerdict classify_request(const RequestCycleReport& report);

} // namespace smcgraph::detail
