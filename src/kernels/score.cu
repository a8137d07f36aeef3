// score(): for logits [rows, P, V] and tokens [rows, P - 1], the tempered log-prob of each given token at
// positions < P - 1 and a bonus sample at position P - 1, all in one launch and one read of the logits
// (the pass kernel in logits_pass.cuh, instantiated in sample.cu). With per-request steps s_q, row r scores
// positions < s_q and samples at s_q; the CTAs of its later positions return at once.
#include "kernels/launch_checks.hpp"
#include "kernels/logits_pass.cuh"

#include "smcgraph/error.hpp"

namespace smcgraph {

void score(const LogitsView& logits, const int32_t* tokens, int64_t token_row_stride, const RowParams& params,
           const RowRandom& random, uint32_t stream_word, const ScoreOutputs& out, SampleWorkspace& workspace,
           cudaStream_t stream, const int32_t* request_steps) {
  constexpr const char* kWhere = "smcgraph::score";
  if (logits.positions > 1) {
    require(tokens != nullptr, kWhere, "tokens", "null", "must be a device pointer when positions > 1");
    require(token_row_stride >= logits.positions - 1, kWhere, "token_row_stride", token_row_stride,
            "must be >= positions - 1");
    require(out.token_logprobs != nullptr, kWhere, "out.token_logprobs", "null", "must be a device pointer");
  }
  detail::require_device_pointers(kWhere, {{"out.bonus_tokens", out.bonus_tokens},
                                           {"out.bonus_logprobs", out.bonus_logprobs},
                                           {"out.logz", out.logz}});
  // clang-format off
  const detail::PassArgs args{.logits = logits, .params = params, .random = random, .stream_word = stream_word,
                              .tokens = tokens, .token_row_stride = token_row_stride,
                              .token_logprobs = out.token_logprobs, .sample_tokens = out.bonus_tokens,
                              .sample_logprobs = out.bonus_logprobs, .sample_logz = out.logz,
                              .row_flags = out.row_flags, .status = out.status,
                              .request_steps = request_steps};
  // clang-format on
  detail::launch_logits_pass(kWhere, args, workspace, stream);
}

} // namespace smcgraph
