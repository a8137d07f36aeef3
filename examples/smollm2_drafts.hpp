// The real model's (SmolLM2-135M-Instruct) default drafts, picked by measurement (bench/draft_study, README
// "The SMC draft"), shared by examples/generate, bench/bucket_sweep and the real-model tests:
//   * the speculative cycle's, by greedy acceptance: layers 0-27 (2.20 tokens a cycle at K 4, against 1.52
//     for 0-23); rejection sampling keeps the target's distribution whatever the draft;
//   * the SMC cycle's, by log Z-hat per generated token: every layer (-0.079 at T_d 0.7, T_t 1, N 8, K 4,
//     against -0.47 to -0.83 for the 22-29-layer prefixes, whose particles lose the target's text: "At (, S.
//     . ." for a haiku prompt; ESS / N does not see it). llama_real_gpu's quality case keeps this true.
#pragma once

namespace smcgraph::examples {

inline constexpr const char* kSpecDraftLayers = "0-27";
inline constexpr const char* kSmcDraftLayers = "0-29";
/// log Z-hat per generated token (nats) below which `generate --kind smc` warns that the particles fall short
/// of the target's text, and above which llama_real_gpu requires the default SMC draft to stay.
inline constexpr double kSmcLogZPerTokenFloor = -0.3;

} // namespace smcgraph::examples
