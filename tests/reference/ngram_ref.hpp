// Host reference of NgramDraft (include/smcgraph/ngram_draft.hpp), written from its header: the proposal for
// a history h[0 .. q] and the logits row it gives.
//
//   const int token = reference::ngram_proposal(history, /*min_n=*/1, /*max_n=*/3, vocab);   // -1: none
#pragma once

#include <cstdint>
#include <vector>

namespace smcgraph::reference {

/// The token that followed the most recent earlier occurrence of the history's last n tokens, for n = max_n
/// down to min_n (the first n whose match is followed by a token in [0, vocab)); -1 when none. Tokens < 0
/// (unwritten slots) never match.
int ngram_proposal(const std::vector<int32_t>& history, int min_n, int max_n, int vocab);

/// The logits row of a proposal: `confidence` at it, 0 elsewhere (all 0 for -1).
std::vector<float> ngram_logits(int proposal, int vocab, float confidence);

} // namespace smcgraph::reference
