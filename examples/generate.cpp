// generate: text in, text out, through the captured cycle with the real model pair (SmolLM2-135M-Instruct
// from its GGUF file): the chat template applied, SMC or speculative decoding, tokens/s.
//
//   ./run fetch-model                                   # once: .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
//   build/examples/generate --prompt "What is the capital of France?"   # greedy (speculative, T = 0)
//   build/examples/generate --kind smc --particles 8 --steps 4 --prompt "Write a haiku about GPUs."
//   build/examples/generate --kind spec --temperature 0.8 --seed 7 --prompt "Tell me a story."
//
// --adaptive (greedy / spec): each cycle's K chosen on the device from the acceptance EMA, K in
// {1, ceil(K/2), K} (EngineConfig::adaptive); the K of every cycle is printed at the end.
// --kind greedy (default): speculative decoding with a greedy target, exactly the target's greedy text;
// --kind spec: rejection-based speculative decoding at the given target temperature; --kind smc: SMC
// speculative decoding, the particle drawn by weight is printed. --draft-layers picks the draft's layers
// (default 0-27, all but the last two, for greedy / spec: the best greedy acceptance; 0-29, every layer,
// for smc: the only draft whose particles keep the target's text, log Z-hat -0.08 nats a token against
// -0.47 to -0.83 for prefixes of 22-29 layers, bench/draft_study; a prefix of the layers shares the
// target's KV, and the verify resumes after it), or `ngram` for the n-gram draft (NgramDraft: prompt
// lookup, no weights); --steps 0 (greedy / spec) decodes with the target alone, no draft. --min-steps 0 (with
// --adaptive and a layer-prefix draft) lets a cycle draft nothing.
// --raw sends the prompt without the chat template. --prefill-chunk N: prompt tokens per prefill forward
// (EngineConfig::prefill_chunk; 0, the default, takes the engine's). The summary prints the admission time
// (the prefill and the first token's sample: the time to the first token). --tensor-core-attention N:
// forwards of at least N tokens a row (prefill) run attention on tensor cores (LlamaModelOptions::
// tensor_core_attention_tokens, default 64; 0: never). --prefill-gemm N: forwards of at least N tokens a row
// run their layer GEMMs through cuBLASLt (LlamaModelOptions::prefill_gemm_tokens, default 2048; 0: never).
//
// Exit status: 0 ok, 1 a CUDA / model / engine error, 2 a bad flag, 77 no CUDA device.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cli.hpp"
#include "smollm2_drafts.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/smc_kernels.hpp"
#include "smcgraph/tokenizer.hpp"

namespace {

using smcgraph::cli::parse_float;
using smcgraph::cli::parse_integer;
using smcgraph::cli::UsageError;

struct Options {
  std::string model;
  std::string prompt = "What is the capital of France? Answer in one sentence.";
  std::string system;
  std::string kind = "greedy";
  int particles = 8, steps = 4, max_new = 128;
  float temperature = -1.0f; // -1: the kind's default
  uint64_t seed = 1;
  std::string draft_layers; // empty: 0-29 for smc, 0-27 otherwise
  bool raw = false;
  bool adaptive = false; // --adaptive: per-request K chosen on the device (speculative kinds)
  int min_steps = 1;     // --min-steps: AdaptiveDraftSteps::min_steps
  int prefill_chunk = 0; // --prefill-chunk: EngineConfig::prefill_chunk (0: the engine's default)
  /// --tensor-core-attention: LlamaModelOptions::tensor_core_attention_tokens
  int tensor_core_attention = smcgraph::kTensorCoreAttentionTokens;
  int prefill_gemm = smcgraph::kPrefillGemmTokens; ///< --prefill-gemm: LlamaModelOptions::prefill_gemm_tokens
};

Options parse(int argc, char** argv) {
  Options o;
  o.model = smcgraph::default_llama_model_path();
  constexpr int kIntMax = std::numeric_limits<int>::max();
  smcgraph::cli::Flags flags(argc, argv);
  while (flags.next()) {
    const std::string& flag = flags.flag();
    if (flag == "--model")
      o.model = flags.value();
    else if (flag == "--prompt")
      o.prompt = flags.value();
    else if (flag == "--system")
      o.system = flags.value();
    else if (flag == "--kind")
      o.kind = flags.value();
    else if (flag == "--particles")
      o.particles = parse_integer(flag, flags.value(), 1, smcgraph::kMaxResampleParticles);
    else if (flag == "--steps")
      o.steps = parse_integer(flag, flags.value(), 0, smcgraph::kMaxDraftSteps); // 0: no draft (not smc)
    else if (flag == "--max-new")
      o.max_new = parse_integer(flag, flags.value(), 1, kIntMax / 2);
    else if (flag == "--temperature")
      o.temperature = parse_float(flag, flags.value(), 0.0f, false, 1e6f);
    else if (flag == "--seed")
      o.seed = parse_integer<uint64_t>(flag, flags.value(), 0, std::numeric_limits<uint64_t>::max());
    else if (flag == "--draft-layers")
      o.draft_layers = flags.value();
    else if (flag == "--min-steps")
      o.min_steps = parse_integer(flag, flags.value(), 0, smcgraph::kMaxDraftSteps);
    else if (flag == "--prefill-chunk")
      o.prefill_chunk = parse_integer(flag, flags.value(), 0, 1 << 20);
    else if (flag == "--tensor-core-attention")
      o.tensor_core_attention = parse_integer(flag, flags.value(), 0, 1 << 20);
    else if (flag == "--prefill-gemm")
      o.prefill_gemm = parse_integer(flag, flags.value(), 0, 1 << 20);
    else if (flag == "--adaptive") {
      flags.no_value();
      o.adaptive = true;
    } else if (flag == "--raw") {
      flags.no_value();
      o.raw = true;
    } else if (flag == "--help" || flag == "-h")
      throw UsageError{"see the comment at the top of examples/generate.cpp for the flags"};
    else
      throw UsageError{"unknown flag '" + flags.raw() + "'"};
  }
  if (o.kind != "greedy" && o.kind != "spec" && o.kind != "smc")
    throw smcgraph::cli::bad_value("--kind", o.kind, "must be greedy, spec or smc");
  if (o.adaptive && o.kind == "smc")
    throw smcgraph::cli::bad_value("--adaptive", "smc", "needs --kind greedy or spec (SMC drafts a fixed K)");
  if (o.draft_layers.empty())
    o.draft_layers =
        o.kind == "smc" ? smcgraph::examples::kSmcDraftLayers : smcgraph::examples::kSpecDraftLayers;
  return o;
}

int run(const Options& o) {
  if (smcgraph::cuda_device_count() == 0) {
    std::fprintf(stderr, "generate: no CUDA device\n");
    return 77;
  }
  smcgraph::require(std::filesystem::exists(o.model), "generate", "--model", o.model,
                    "not found (run ./run fetch-model, or pass --model PATH)");
  const auto load_start = std::chrono::steady_clock::now();
  const smcgraph::GgufFile file = smcgraph::GgufFile::open(o.model);
  const smcgraph::Tokenizer tokenizer = smcgraph::Tokenizer::from_gguf(file);
  auto weights = smcgraph::load_llama_weights(file);

  std::vector<std::pair<std::string, std::string>> messages;
  if (!o.system.empty())
    messages.emplace_back("system", o.system);
  messages.emplace_back("user", o.prompt);
  const std::string text = o.raw ? o.prompt : tokenizer.apply_chat_template(messages, true);
  const std::vector<int32_t> prompt = tokenizer.encode(text, /*parse_special=*/true);

  const bool smc = o.kind == "smc";
  const int particles = smc ? o.particles : 1;
  const int max_seq_len =
      std::min<int>(weights->config().context,
                    (static_cast<int>(prompt.size()) + o.max_new + 2 * (o.steps + 1) + 127) / 128 * 128);
  smcgraph::LlamaModelOptions model_options;
  model_options.max_seq_len = max_seq_len;
  model_options.pool_size = particles * max_seq_len + 2 * particles * (o.steps + 1) + 1;
  // Forwards as long as the prompt (or --prefill-chunk): admission prefills it in one forward by default.
  model_options.max_tokens_per_forward = std::max(
      particles * (o.steps + 1), o.prefill_chunk > 0 ? std::min(o.prefill_chunk, max_seq_len) : max_seq_len);
  model_options.logits_dtype = smcgraph::DType::kFloat32;
  model_options.tensor_core_attention_tokens = o.tensor_core_attention;
  model_options.prefill_gemm_tokens = o.prefill_gemm;
  smcgraph::LlamaModel target(weights, model_options);
  // The draft: the n-gram draft, or a layer subset (a prefix of the layers shares the target's KV).
  const std::unique_ptr<smcgraph::Model> draft =
      smcgraph::examples::make_draft(o.draft_layers, weights, model_options, target);

  smcgraph::EngineConfig config;
  config.kind = smc ? smcgraph::CycleKind::kSmc : smcgraph::CycleKind::kSpeculative;
  config.vocab = target.vocab();
  config.particles = particles;
  config.draft_steps = o.steps;
  config.max_requests = 1;
  config.max_seq_len = max_seq_len;
  config.prefill_chunk = o.prefill_chunk;
  config.slot_pool_size = model_options.pool_size;
  config.eos_id = tokenizer.eos_id();
  config.adaptive.enabled = o.adaptive;
  if (config.adaptive.enabled) {
    config.adaptive.mid_steps = std::max(1, (o.steps + 1) / 2); // {min, ceil(K/2), K}
    config.adaptive.min_steps = std::min(o.min_steps, config.adaptive.mid_steps);
  }
  if (o.kind == "greedy") {
    config.draft_temperature = 0.0f;
    config.target_temperature = 0.0f;
  } else if (o.kind == "spec") {
    config.target_temperature = o.temperature >= 0 ? o.temperature : 0.8f;
    config.draft_temperature = config.target_temperature > 0 ? config.target_temperature : 0.0f;
  } else {
    config.target_temperature = o.temperature >= 0 ? o.temperature : 1.0f;
  }
  smcgraph::Engine engine(config, o.steps == 0 ? target : *draft, target); // K = 0 never runs the draft
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  const auto start = std::chrono::steady_clock::now();
  const smcgraph::RequestId id = engine.admit(prompt, {.seed = o.seed, .max_new_tokens = o.max_new});
  engine.synchronize(); // time to the first token: the prefill chunks and the first token's sample
  const double admit_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int cycles = 0;
  bool done = false;
  std::string failure;
  std::string draft_lengths; // K of every cycle
  float acceptance_ema = 0.0f;
  while (!done) {
    engine.step();
    ++cycles;
    for (const smcgraph::RequestUpdate& update : engine.poll()) {
      if (update.failed)
        failure = update.reason;
      done = done || update.finished || update.failed;
      if (!draft_lengths.empty())
        draft_lengths += ' ';
      draft_lengths += std::to_string(update.draft_steps);
      acceptance_ema = update.acceptance_ema;
    }
  }
  const smcgraph::RequestResult result = engine.result(id);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  engine.release(id);
  if (!failure.empty())
    throw smcgraph::Error("generate: the request failed: " + failure);

  std::vector<int32_t> tokens = result.tokens;
  const bool ended_with_eos = !tokens.empty() && tokens.back() == tokenizer.eos_id();
  std::printf("%s\n", tokenizer.decode_lossy(tokens, /*skip_special=*/true).c_str());
  std::fprintf(stderr,
               "\n[%s: %zu prompt tokens, %zu new tokens%s in %d cycles (%.2f tokens/cycle), %.3f s = %.1f "
               "tokens/s incl. admission; admission (prefill + first token) %.2f ms, prefill chunk %d; model "
               "load + engine capture %.2f s; draft %s of %d layers]\n",
               o.kind.c_str(), prompt.size(), tokens.size(), ended_with_eos ? " (EOS)" : "", cycles,
               cycles ? static_cast<double>(tokens.size()) / cycles : 0.0, seconds, tokens.size() / seconds,
               admit_s * 1e3, engine.prefill_chunk(), load_s, o.draft_layers.c_str(), target.config().layers);
  std::fprintf(stderr, "[draft length per cycle: %s; acceptance EMA %.3f; %s]\n", draft_lengths.c_str(),
               acceptance_ema, engine.draft_loop().note.c_str());
  if (smc) {
    // log Z-hat a token: how far the particles fall short of the target (0 for an exact sampler; the draft of
    // every layer measured -0.08 at T_d 0.7 : T_t 1, prefixes of 22-29 layers -0.47 to -0.83: README).
    const double per_token = tokens.empty() ? 0.0 : result.log_evidence / static_cast<double>(tokens.size());
    std::fprintf(stderr, "[smc: particle %d of %d drawn by weight, log Z-hat %.3f (%.3f a token)%s]\n",
                 result.chosen, particles, result.log_evidence, per_token,
                 per_token < smcgraph::examples::kSmcLogZPerTokenFloor
                     ? "; the draft is far from the target: its particles lose the target's text"
                     : "");
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return smcgraph::cli::run_main("generate", [&] { return run(parse(argc, argv)); });
}
