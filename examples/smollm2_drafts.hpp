// The real model's (SmolLM2-135M-Instruct) default drafts, picked by measurement (bench/draft_study, README
// "The SMC draft"), shared by examples/generate, bench/bucket_sweep and the real-model tests:
//   * the speculative cycle's, by greedy acceptance: layers 0-27 (2.20 tokens a cycle at K 4, against 1.52
//     for 0-23); rejection sampling keeps the target's distribution whatever the draft;
//   * the SMC cycle's, by log Z-hat per generated token: every layer (-0.079 at T_d 0.7, T_t 1, N 8, K 4,
//     against -0.47 to -0.83 for the 22-29-layer prefixes, whose particles lose the target's text: "At (, S.
//     . ." for a haiku prompt; ESS / N does not see it). llama_real_gpu's quality case keeps this true.
// And make_draft(), which builds the draft a spec names the same way for all of them.
#pragma once

#include <memory>
#include <string>

#include "smcgraph/llama_model.hpp"
#include "smcgraph/model.hpp"
#include "smcgraph/ngram_draft.hpp"

namespace smcgraph::examples {

inline constexpr const char* kSpecDraftLayers = "0-27";
inline constexpr const char* kSmcDraftLayers = "0-29";
/// log Z-hat per generated token (nats) below which `generate --kind smc` warns that the particles fall short
/// of the target's text, and above which llama_real_gpu requires the default SMC draft to stay.
inline constexpr double kSmcLogZPerTokenFloor = -0.3;

/// The draft `spec` names for `target` (built with `target_options`): "ngram", the weightless NgramDraft over
/// the target's vocabulary with the options' pool, sequence length and logits dtype; otherwise a layer list
/// ("0-27", "0-11+18-29") of the same weights, a LlamaModel that shares the target's KV when its layers are a
/// prefix of the target's (the same bits either way; half the KV memory, and what adaptive K = 0 needs).
inline std::unique_ptr<Model> make_draft(const std::string& spec, std::shared_ptr<const LlamaWeights> weights,
                                         LlamaModelOptions target_options, const LlamaModel& target) {
  if (spec == "ngram") {
    NgramDraftOptions ngram;
    ngram.vocab = target.vocab();
    ngram.pool_size = target_options.pool_size;
    ngram.max_seq_len = target_options.max_seq_len;
    ngram.logits_dtype = target_options.logits_dtype;
    return std::make_unique<NgramDraft>(ngram);
  }
  target_options.layers = parse_llama_layers(spec);
  target_options.kv_owner = llama_layers_prefix(target_options.layers, target.layers()) ? &target : nullptr;
  return std::make_unique<LlamaModel>(std::move(weights), target_options);
}

} // namespace smcgraph::examples
