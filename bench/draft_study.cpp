// draft_study: which layer subset of SmolLM2-135M-Instruct to draft with, measured on real chat text (issue
// 12: "pick the draft by measurement"). For every draft in --drafts it runs, through the captured cycle:
//
//   * SMC (N = --particles, K = --steps) on every chat question (examples/chat_prompts.hpp, chat template
//     applied) at every (T_d, T_t) pair of --temperatures, --seeds times each, for up to --cycles cycles a
//     request (EOS or --max-new ends one earlier), all requests in one engine (per-request temperatures);
//     per pair it reports the mean ESS / N over the request cycles (ESS before resampling, from
//     RequestUpdate::ess), its standard error over the requests (each request's mean a sample), the share of
//     request cycles that resampled, the request cycles measured, and log Z-hat per generated token (the
//     requests' RequestResult::log_evidence over their tokens, averaged over the requests, with its standard
//     error). The target here is the normalised softmax(alpha l / T_t), so an exact sampler has Z = 1: log
//     Z-hat / token is how many nats a token the particle system falls short of the target, and it is the
//     draft-quality number that ESS is not (ESS measures how even the weights are across particles, and
//     particles that are all equally unlikely under the target have even weights);
//   * greedy speculative decoding (T_d = T_t = 0, K = --steps) on the same questions: the mean fraction of
//     the K draft tokens accepted a cycle (the draft's greedy agreement as the engine sees it) and tokens a
//     cycle.
//
// Cycle times are not measured here (the engine runs every request at once): `bucket_sweep --model smollm2
// --kinds smc --draft-layers D` times the same drafts at 1 and 8 requests.
//
// A draft is a layer list ("0-27", "0-11+18-29") or "ngram" (the weightless NgramDraft: prompt lookup).
//
//   build/bench/draft_study [--model PATH] [--drafts 0-29,0-28,0-27,0-25,0-23,0-21]
//       [--temperatures 0.7:1,1:1,0.7:0.7] [--particles 8] [--steps 4] [--cycles 32] [--max-new 160]
//       [--seeds 2] [--csv results/draft_study.csv]
//
// Exit status: 0 ok (every request ran without a failure); 1 a CUDA / model / engine error or a failed
// request; 2 a bad flag; 77 no CUDA device or no model file.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench_util.hpp"
#include "chat_prompts.hpp"
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

using smcgraph::cli::UsageError;

struct TemperaturePair {
  float draft = 0.7f, target = 1.0f;
};

struct Options {
  std::string model;
  std::vector<std::string> drafts = {"0-29", "0-28", "0-27", "0-25", "0-23", "0-21"};
  std::vector<TemperaturePair> temperatures = {{0.7f, 1.0f}, {1.0f, 1.0f}, {0.7f, 0.7f}};
  int particles = 8;
  int steps = 4;
  int cycles = 32;
  int max_new = 160;
  int seeds = 2;
  std::string csv;
};

Options parse(int argc, char** argv) {
  using smcgraph::cli::parse_float;
  using smcgraph::cli::parse_integer;
  Options o;
  o.model = smcgraph::default_llama_model_path();
  smcgraph::cli::Flags flags(argc, argv);
  while (flags.next()) {
    const std::string& flag = flags.flag();
    if (flag == "--model") {
      o.model = flags.value();
    } else if (flag == "--drafts") {
      const std::string text = flags.value();
      o.drafts = smcgraph::cli::split_list(text);
      if (o.drafts.empty())
        throw smcgraph::cli::bad_value(flag, text, "expected at least one draft");
      // "0-11+18-29": a '+' joins the ranges of one draft (',' separates drafts).
      for (std::string& draft : o.drafts)
        std::replace(draft.begin(), draft.end(), '+', ',');
    } else if (flag == "--temperatures") {
      o.temperatures.clear();
      for (const std::string& pair : smcgraph::cli::split_list(flags.value())) {
        const size_t colon = pair.find(':');
        if (colon == std::string::npos)
          throw smcgraph::cli::bad_value(flag, pair, "expected T_d:T_t, e.g. 0.7:1");
        o.temperatures.push_back({parse_float(flag, pair.substr(0, colon), 0.0f, true, 100.0f),
                                  parse_float(flag, pair.substr(colon + 1), 0.0f, true, 100.0f)});
      }
      if (o.temperatures.empty())
        throw smcgraph::cli::bad_value(flag, flags.value(), "expected at least one T_d:T_t pair");
    } else if (flag == "--particles") {
      o.particles = parse_integer(flag, flags.value(), 2, smcgraph::kMaxResampleParticles);
    } else if (flag == "--steps") {
      o.steps = parse_integer(flag, flags.value(), 1, smcgraph::kMaxDraftSteps);
    } else if (flag == "--cycles") {
      o.cycles = parse_integer(flag, flags.value(), 1, 4096);
    } else if (flag == "--max-new") {
      o.max_new = parse_integer(flag, flags.value(), 1, 1 << 16);
    } else if (flag == "--seeds") {
      o.seeds = parse_integer(flag, flags.value(), 1, 64);
    } else if (flag == "--csv") {
      o.csv = flags.value();
    } else if (flag == "--help" || flag == "-h") {
      throw UsageError{"see the comment at the top of bench/draft_study.cpp for the flags"};
    } else {
      throw UsageError{"unknown flag '" + flags.raw() + "' (see --help)"};
    }
  }
  return o;
}

/// Mean and standard error of the mean.
std::pair<double, double> mean_and_error(const std::vector<double>& values) {
  if (values.empty())
    return {NAN, NAN};
  double sum = 0.0;
  for (double v : values)
    sum += v;
  const double mean = sum / static_cast<double>(values.size());
  if (values.size() < 2)
    return {mean, NAN};
  double squares = 0.0;
  for (double v : values)
    squares += (v - mean) * (v - mean);
  const double variance = squares / static_cast<double>(values.size() - 1);
  return {mean, std::sqrt(variance / static_cast<double>(values.size()))};
}

struct SmcResult {
  TemperaturePair temperatures;
  double ess_over_n = 0.0, ess_error = 0.0, resample_rate = 0.0;
  double log_z_per_token = 0.0, log_z_error = 0.0; ///< log Z-hat / generated token: mean over requests
  long request_cycles = 0;
  int requests = 0;
};

struct GreedyResult {
  double acceptance = 0.0, tokens_per_cycle = 0.0;
  long request_cycles = 0;
};

/// The models and tokenized prompts every engine of a draft shares.
struct Setup {
  std::shared_ptr<const smcgraph::LlamaWeights> weights;
  std::vector<std::vector<int32_t>> prompts;
  int eos_id = -1;
  int max_seq_len = 0;
  int pool_size = 0;
};

/// An engine of one bucket holding every request of a study.
smcgraph::EngineConfig engine_config(smcgraph::CycleKind kind, int particles, int steps, int requests,
                                     const Setup& setup, int vocab) {
  smcgraph::EngineConfig config;
  config.kind = kind;
  config.vocab = vocab;
  config.particles = particles;
  config.draft_steps = steps;
  config.max_requests = requests;
  config.buckets = {requests};
  config.max_seq_len = setup.max_seq_len;
  config.slot_pool_size = setup.pool_size;
  config.eos_id = setup.eos_id;
  return config;
}

/// Runs an engine of `config` on `requests` (prompt index, params) until each finishes or ran `cycles`
/// cycles; calls `on_update` for each update and `on_result` with each request's result before releasing
/// it. Throws on a failed request.
template <class OnUpdate, class OnResult>
void run_requests(const smcgraph::EngineConfig& config, smcgraph::Model& draft, smcgraph::Model& target,
                  const Setup& setup, const std::vector<std::pair<int, smcgraph::RequestParams>>& requests,
                  int cycles, OnUpdate&& on_update, OnResult&& on_result) {
  smcgraph::Engine engine(config, draft, target);
  std::map<smcgraph::RequestId, int> index; // request id -> position in `requests`
  for (size_t i = 0; i < requests.size(); ++i)
    index[engine.admit(setup.prompts[static_cast<size_t>(requests[i].first)], requests[i].second)] =
        static_cast<int>(i);
  std::map<smcgraph::RequestId, int> cycles_run;
  size_t live = requests.size();
  while (live > 0) {
    engine.step();
    for (const smcgraph::RequestUpdate& update : engine.poll()) {
      if (update.failed)
        throw smcgraph::Error("draft_study: request " + std::to_string(update.id) +
                              " failed: " + update.reason);
      on_update(index.at(update.id), update);
      const int ran = ++cycles_run[update.id];
      if (update.finished || ran >= cycles) {
        on_result(index.at(update.id), engine.result(update.id));
        engine.release(update.id);
        --live;
      }
    }
  }
  engine.synchronize();
}

std::vector<SmcResult> study_smc(const Options& o, const Setup& setup, smcgraph::Model& draft,
                                 smcgraph::Model& target) {
  std::vector<std::pair<int, smcgraph::RequestParams>> requests;
  std::vector<int> pair_of; // request position -> temperature pair
  const int questions = static_cast<int>(setup.prompts.size());
  for (size_t p = 0; p < o.temperatures.size(); ++p)
    for (int s = 0; s < o.seeds; ++s)
      for (int q = 0; q < questions; ++q) {
        smcgraph::RequestParams params;
        params.seed = 1000003ull * static_cast<uint64_t>(s + 1) + static_cast<uint64_t>(q);
        params.draft_temperature = o.temperatures[p].draft;
        params.target_temperature = o.temperatures[p].target;
        params.max_new_tokens = o.max_new;
        requests.emplace_back(q, params);
        pair_of.push_back(static_cast<int>(p));
      }
  const smcgraph::EngineConfig config =
      engine_config(smcgraph::CycleKind::kSmc, o.particles, o.steps, static_cast<int>(requests.size()), setup,
                    target.vocab());
  std::vector<double> ess_sum(requests.size(), 0.0);
  std::vector<long> cycles(requests.size(), 0), resampled(requests.size(), 0);
  std::vector<double> log_z_per_token(requests.size(), NAN);
  run_requests(
      config, draft, target, setup, requests, o.cycles,
      [&](int r, const smcgraph::RequestUpdate& update) {
        ess_sum[static_cast<size_t>(r)] += update.ess / o.particles;
        ++cycles[static_cast<size_t>(r)];
        resampled[static_cast<size_t>(r)] += update.resampled ? 1 : 0;
      },
      [&](int r, const smcgraph::RequestResult& result) {
        if (!result.tokens.empty())
          log_z_per_token[static_cast<size_t>(r)] =
              result.log_evidence / static_cast<double>(result.tokens.size());
      });
  std::vector<SmcResult> results;
  for (size_t p = 0; p < o.temperatures.size(); ++p) {
    SmcResult result;
    result.temperatures = o.temperatures[p];
    std::vector<double> per_request, log_z;
    long total_resampled = 0;
    double total_ess = 0.0;
    for (size_t r = 0; r < requests.size(); ++r) {
      if (pair_of[r] != static_cast<int>(p) || cycles[r] == 0)
        continue;
      per_request.push_back(ess_sum[r] / static_cast<double>(cycles[r]));
      if (std::isfinite(log_z_per_token[r]))
        log_z.push_back(log_z_per_token[r]);
      total_ess += ess_sum[r];
      result.request_cycles += cycles[r];
      total_resampled += resampled[r];
      ++result.requests;
    }
    result.ess_over_n = result.request_cycles ? total_ess / static_cast<double>(result.request_cycles) : NAN;
    result.ess_error = mean_and_error(per_request).second;
    std::tie(result.log_z_per_token, result.log_z_error) = mean_and_error(log_z);
    result.resample_rate = result.request_cycles ? static_cast<double>(total_resampled) /
                                                       static_cast<double>(result.request_cycles)
                                                 : NAN;
    results.push_back(result);
  }
  return results;
}

GreedyResult study_greedy(const Options& o, const Setup& setup, smcgraph::Model& draft,
                          smcgraph::Model& target) {
  std::vector<std::pair<int, smcgraph::RequestParams>> requests;
  for (int q = 0; q < static_cast<int>(setup.prompts.size()); ++q) {
    smcgraph::RequestParams params;
    params.max_new_tokens = o.max_new;
    requests.emplace_back(q, params);
  }
  smcgraph::EngineConfig config = engine_config(smcgraph::CycleKind::kSpeculative, 1, o.steps,
                                                static_cast<int>(requests.size()), setup, target.vocab());
  config.draft_temperature = 0.0f;
  config.target_temperature = 0.0f;
  GreedyResult result;
  long accepted = 0, drafted = 0, tokens = 0;
  run_requests(
      config, draft, target, setup, requests, o.cycles,
      [&](int, const smcgraph::RequestUpdate& update) {
        accepted += update.accepted;
        drafted += update.draft_steps;
        tokens += update.tokens.empty() ? 0 : static_cast<long>(update.tokens[0].size());
        ++result.request_cycles;
      },
      [](int, const smcgraph::RequestResult&) {});
  result.acceptance = drafted ? static_cast<double>(accepted) / static_cast<double>(drafted) : NAN;
  result.tokens_per_cycle =
      result.request_cycles ? static_cast<double>(tokens) / static_cast<double>(result.request_cycles) : NAN;
  return result;
}

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

int run(const Options& o) {
  if (smcgraph::cuda_device_count() == 0) {
    std::fprintf(stderr, "draft_study: no CUDA device\n");
    return 77;
  }
  if (!std::filesystem::exists(o.model)) {
    std::fprintf(stderr, "draft_study: SKIP: model file %s not found (./run fetch-model, or --model PATH)\n",
                 o.model.c_str());
    return 77;
  }
  const smcgraph::GgufFile file = smcgraph::GgufFile::open(o.model);
  const smcgraph::Tokenizer tokenizer = smcgraph::Tokenizer::from_gguf(file);
  Setup setup;
  setup.weights = smcgraph::load_llama_weights(file);
  setup.eos_id = tokenizer.eos_id();
  size_t longest = 0;
  for (const char* question : smcgraph::examples::kChatQuestions) {
    const std::vector<std::pair<std::string, std::string>> messages = {{"user", question}};
    setup.prompts.push_back(tokenizer.encode(tokenizer.apply_chat_template(messages, true), true));
    longest = std::max(longest, setup.prompts.back().size());
  }
  const int questions = static_cast<int>(setup.prompts.size());
  const int smc_requests = questions * o.seeds * static_cast<int>(o.temperatures.size());
  const int new_tokens = std::min(o.max_new, o.cycles * (o.steps + 1));
  setup.max_seq_len =
      std::min<int>(setup.weights->config().context,
                    (static_cast<int>(longest) + new_tokens + 2 * (o.steps + 1) + 127) / 128 * 128);
  setup.pool_size =
      smc_requests * o.particles * setup.max_seq_len + 2 * smc_requests * o.particles * (o.steps + 1) + 1;

  smcgraph::LlamaModelOptions model_options;
  model_options.max_seq_len = setup.max_seq_len;
  model_options.pool_size = setup.pool_size;
  model_options.max_tokens_per_forward = std::max(smc_requests * o.particles * (o.steps + 1), 128);
  model_options.logits_dtype = smcgraph::DType::kFloat32;
  smcgraph::LlamaModel target(setup.weights, model_options);
  const std::string device = smcgraph::bench::device_name();
  std::printf("draft_study on %s: %d chat questions x %d seeds x %zu temperature pairs = %d SMC requests "
              "(N %d, K %d), up to %d cycles and %d new tokens a request; greedy speculative K %d on the %d "
              "questions\n",
              device.c_str(), questions, o.seeds, o.temperatures.size(), smc_requests, o.particles, o.steps,
              o.cycles, o.max_new, o.steps, questions);

  std::ofstream csv;
  if (!o.csv.empty()) {
    const std::filesystem::path path(o.csv);
    if (path.has_parent_path())
      std::filesystem::create_directories(path.parent_path());
    csv.open(o.csv);
    if (!csv)
      throw smcgraph::Error("draft_study: cannot write --csv " + o.csv);
    csv << "device,draft,draft_layers,draft_temperature,target_temperature,particles,steps,requests,"
           "request_cycles,ess_over_n,ess_over_n_stderr,resample_rate,log_z_per_token,log_z_per_token_stderr,"
           "greedy_acceptance,greedy_tokens_per_cycle\n";
  }
  std::printf("%-12s %6s %5s %5s %12s %8s %10s %10s %12s %8s %12s\n", "draft", "layers", "T_d", "T_t",
              "ESS/N", "+-se", "resampled", "req.cycles", "logZ/token", "+-se", "greedy acc.");
  for (const std::string& spec : o.drafts) {
    // "ngram": the weightless n-gram draft (NgramDraft, prompt lookup) with its default n-grams and
    // confidence; a layer list: the target's layers it names.
    const std::unique_ptr<smcgraph::Model> draft =
        smcgraph::examples::make_draft(spec, setup.weights, model_options, target);
    const size_t draft_layers = spec == "ngram" ? 0 : smcgraph::parse_llama_layers(spec).size();
    const GreedyResult greedy = study_greedy(o, setup, *draft, target);
    const std::vector<SmcResult> smc = study_smc(o, setup, *draft, target);
    std::string label = spec;
    std::replace(label.begin(), label.end(), ',', '+');
    for (const SmcResult& r : smc) {
      std::printf("%-12s %6zu %5.2f %5.2f %12s %8s %9s%% %10ld %12s %8s %7s (%s t/c)\n", label.c_str(),
                  draft_layers, r.temperatures.draft, r.temperatures.target, fixed(r.ess_over_n, 3).c_str(),
                  fixed(r.ess_error, 3).c_str(), fixed(100.0 * r.resample_rate, 1).c_str(), r.request_cycles,
                  fixed(r.log_z_per_token, 3).c_str(), fixed(r.log_z_error, 3).c_str(),
                  fixed(greedy.acceptance, 3).c_str(), fixed(greedy.tokens_per_cycle, 2).c_str());
      if (csv)
        csv << '"' << device << "\"," << label << ',' << draft_layers << ',' << r.temperatures.draft << ','
            << r.temperatures.target << ',' << o.particles << ',' << o.steps << ',' << r.requests << ','
            << r.request_cycles << ',' << r.ess_over_n << ',' << r.ess_error << ',' << r.resample_rate << ','
            << r.log_z_per_token << ',' << r.log_z_error << ',' << greedy.acceptance << ','
            << greedy.tokens_per_cycle << '\n';
    }
    std::fflush(stdout);
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return smcgraph::cli::run_main("draft_study", [&] { return run(parse(argc, argv)); });
}
