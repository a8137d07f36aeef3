#include "runtime/request_outcome.hpp"

#include "smcgraph/types.hpp"

namespace smcgraph::detail {

RequestVerdict classify_request(const RequestCycleReport& report) {
  if (report.flags & kRequestFailureFlags)
    return {RequestOutcome::kFailed, describe_flags(report.flags & kRequestFailureFlags)};
  if (report.flags & kFlagMaxLength)
    return {RequestOutcome::kMaxLength, "max sequence length"};
  if (report.all_finished)
    return {RequestOutcome::kEos, "eos"};
  if (report.max_new_tokens > 0 && report.length - report.prompt_length >= report.max_new_tokens)
    return {RequestOutcome::kMaxNewTokens, "max_new_tokens"};
  if (!report.any_live)
    return {RequestOutcome::kRowsNotLive, "rows not live"};
  return {};
}

} // namespace smcgraph::detail
