#include "reference/ngram_ref.hpp"

namespace smcgraph::reference {

int ngram_proposal(const std::vector<int32_t>& history, int min_n, int max_n, int vocab) {
  const int q = static_cast<int>(history.size()) - 1;
  for (int n = max_n; n >= min_n; --n) {
    if (q < n)
      continue;
    bool suffix_ok = true;
    for (int k = 0; k < n; ++k)
      suffix_ok = suffix_ok && history[q - k] >= 0;
    if (!suffix_ok)
      continue;
    for (int e = q - 1; e >= n - 1; --e) { // the most recent earlier window first
      bool match = true;
      for (int k = 0; k < n && match; ++k)
        match = history[e - k] == history[q - k];
      if (match) {
        const int32_t next = history[e + 1];
        if (next >= 0 && next < vocab)
          return next;
        break; // this n's most recent match is followed by no token: try a shorter n
      }
    }
  }
  return -1;
}

std::vector<float> ngram_logits(int proposal, int vocab, float confidence) {
  std::vector<float> logits(vocab, 0.0f);
  if (proposal >= 0 && proposal < vocab)
    logits[proposal] = confidence;
  return logits;
}

} // namespace smcgraph::reference
