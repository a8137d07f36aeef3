// host_engine: a small inference server loop on smcgraph::Engine with the embedded toy models.
//
// It serves a stream of requests (synthetic prompts of random lengths, or one prompt per file with
// --prompts DIR) with continuous batching and overlapped scheduling (examples/host_engine_loop.hpp holds
// the loop), then prints requests served, generated tokens, tokens/s, admit-to-finish latency
// percentiles, mean bucket occupancy and the resample rate.
//
//   build/examples/host_engine                                  # 512 synthetic requests, defaults below
//   build/examples/host_engine --vocab 512 --eos 3 --requests 200 --concurrency 32 --results out.tsv
//   build/examples/host_engine --prompts my_prompts/ --max-new 64  # one request per file of token ids
//
// Exit status: 0 served (requests that failed inside the engine are reported, not fatal), 1 a CUDA or
// engine error, 2 a bad flag or value, 77 no CUDA device.
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <cuda_runtime_api.h>

#include "cli.hpp"
#include "host_engine_loop.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/toy_model.hpp"

namespace {

constexpr const char* kProgram = "host_engine";

/// A bad command line: the message names the flag and the value. main() prints it and exits 2.
using smcgraph::cli::bad_value;
using smcgraph::cli::parse_float;
using smcgraph::cli::parse_integer;
using smcgraph::cli::UsageError;

struct Options {
  int requests = 512;
  bool requests_given = false; // with --prompts and no --requests: one request per file
  int concurrency = 16;
  int particles = 4;
  int steps = 4;
  int vocab = 32000;
  int hidden = 32;
  int max_seq_len = 1024;
  int pool_slots = 0; // 0: enough that the pool never runs dry
  int eos = 2;
  int min_new = 16, max_new = 256;
  int min_prompt = 8, max_prompt = 128;
  std::string prompts_dir;
  uint64_t seed = 1;
  float draft_temperature = 0.7f, target_temperature = 1.0f, alpha = 1.0f, tau = 0.5f;
  float draft_perturbation = 0.3f;
  bool bf16 = false;
  bool eager = false;
  bool compact = true;
  bool quiet = false;
  std::string results_path;
};

void print_help() {
  const Options d;
  std::printf(
      "usage: host_engine [flags]\n"
      "\n"
      "Serves a stream of requests through smcgraph::Engine (SMC speculative decoding, one CUDA graph\n"
      "launch per cycle) with the embedded toy draft/target models: continuous batching, overlapped\n"
      "step()/poll(), compaction, per-request results. Prints throughput, latency percentiles, bucket\n"
      "occupancy and the resample rate; a progress line goes to stderr.\n"
      "\n"
      "requests\n"
      "  --requests N            requests to serve (default %d; with --prompts: the number of files,\n"
      "                          and a larger N reuses the files in turn)\n"
      "  --prompts DIR           one request per regular file in DIR (sorted by name): whitespace-separated\n"
      "                          token ids in [0, vocab); default: synthetic prompts\n"
      "  --min-prompt N          shortest synthetic prompt in tokens (default %d)\n"
      "  --max-prompt N          longest synthetic prompt in tokens (default %d)\n"
      "  --min-new N             each request's max_new_tokens is drawn uniformly from\n"
      "  --max-new N               [--min-new, --max-new] (defaults %d, %d), so requests end at different "
      "times\n"
      "  --eos ID                token id that ends a particle; a request finishes when all its particles\n"
      "                          did (default %d; -1: no EOS). The toy models rarely pick one given id from "
      "a\n"
      "                          large vocabulary: try --vocab 512 to see EOS finishes\n"
      "  --seed S                seeds the synthetic prompts and each request's sampling seed (default "
      "%llu)\n"
      "\n"
      "engine\n"
      "  --concurrency N         request slots = EngineConfig::max_requests, the largest bucket (default "
      "%d)\n"
      "  --particles N           SMC particles per request (default %d)\n"
      "  --steps K               draft tokens per cycle (default %d)\n"
      "  --vocab V               vocabulary of both toy models (default %d)\n"
      "  --max-seq-len S         prompt + generated tokens per particle (default %d)\n"
      "  --pool-slots N          KV slots shared by all requests (default: concurrency x particles x\n"
      "                          max-seq-len + 1, never exhausted; smaller pools fail requests when empty)\n"
      "  --draft-temperature T   T_d > 0 (default %g)\n"
      "  --target-temperature T  T_t > 0 (default %g)\n"
      "  --temperature T         sets both\n"
      "  --alpha A               power of the target distribution, > 0 (default %g)\n"
      "  --tau X                 resample when ESS < tau x N, in [0, 1] (default %g)\n"
      "  --eager                 run each cycle kernel by kernel instead of replaying a captured graph\n"
      "  --no-compact            never call compact() (compare the mean bucket occupancy)\n"
      "\n"
      "toy models\n"
      "  --hidden H              hidden size, 1 .. %d (default %d)\n"
      "  --draft-perturbation P  distance of the draft head from the target's, >= 0 (default %g)\n"
      "  --bf16                  bf16 logits instead of fp32\n"
      "\n"
      "output\n"
      "  --results FILE          write one line per request: index, name, status, reason, latency_ms,\n"
      "                          token count, then the chosen particle's tokens (tab-separated)\n"
      "  --quiet                 no progress line\n"
      "  --help                  this text\n"
      "\n"
      "Flags take their value as the next argument or after '=' (--vocab=512). Exit status: 0 done,\n"
      "1 CUDA or engine error, 2 bad flag or value, 77 no CUDA device.\n",
      d.requests, d.min_prompt, d.max_prompt, d.min_new, d.max_new, d.eos,
      static_cast<unsigned long long>(d.seed), d.concurrency, d.particles, d.steps, d.vocab, d.max_seq_len,
      d.draft_temperature, d.target_temperature, d.alpha, d.tau, smcgraph::kToyMaxHidden, d.hidden,
      d.draft_perturbation);
}

// ---- parsing -------------------------------------------------------------------------------------------

Options parse_options(int argc, char** argv) {
  Options o;
  constexpr int kIntMax = std::numeric_limits<int>::max();
  constexpr float kFloatMax = std::numeric_limits<float>::max();
  bool min_new_given = false, max_new_given = false;
  smcgraph::cli::Flags flags(argc, argv);
  while (flags.next()) {
    const std::string flag = flags.flag();
    auto value = [&] { return flags.value(); };
    auto no_value = [&] { flags.no_value(); };
    if (flag == "--help" || flag == "-h") {
      print_help();
      std::exit(0);
    } else if (flag == "--requests") {
      o.requests = parse_integer(flag, value(), 1, kIntMax);
      o.requests_given = true;
    } else if (flag == "--prompts") {
      o.prompts_dir = value();
      if (o.prompts_dir.empty())
        throw bad_value(flag, o.prompts_dir, "expected a directory");
    } else if (flag == "--min-prompt") {
      o.min_prompt = parse_integer(flag, value(), 1, kIntMax);
    } else if (flag == "--max-prompt") {
      o.max_prompt = parse_integer(flag, value(), 1, kIntMax);
    } else if (flag == "--min-new") {
      o.min_new = parse_integer(flag, value(), 1, kIntMax);
      min_new_given = true;
    } else if (flag == "--max-new") {
      o.max_new = parse_integer(flag, value(), 1, kIntMax);
      max_new_given = true;
    } else if (flag == "--eos") {
      o.eos = parse_integer(flag, value(), -1, kIntMax);
    } else if (flag == "--seed") {
      o.seed = parse_integer<uint64_t>(flag, value(), 0, std::numeric_limits<uint64_t>::max());
    } else if (flag == "--concurrency") {
      o.concurrency = parse_integer(flag, value(), 1, 4096);
    } else if (flag == "--particles") {
      o.particles = parse_integer(flag, value(), 1, 256);
    } else if (flag == "--steps") {
      o.steps = parse_integer(flag, value(), 1, 64);
    } else if (flag == "--vocab") {
      o.vocab = parse_integer(flag, value(), 2, 1 << 24);
    } else if (flag == "--max-seq-len") {
      o.max_seq_len = parse_integer(flag, value(), 1, 1 << 20);
    } else if (flag == "--pool-slots") {
      o.pool_slots = parse_integer(flag, value(), 2, kIntMax);
    } else if (flag == "--draft-temperature") {
      o.draft_temperature = parse_float(flag, value(), 0.0f, true, kFloatMax);
    } else if (flag == "--target-temperature") {
      o.target_temperature = parse_float(flag, value(), 0.0f, true, kFloatMax);
    } else if (flag == "--temperature") {
      o.draft_temperature = o.target_temperature = parse_float(flag, value(), 0.0f, true, kFloatMax);
    } else if (flag == "--alpha") {
      o.alpha = parse_float(flag, value(), 0.0f, true, kFloatMax);
    } else if (flag == "--tau") {
      o.tau = parse_float(flag, value(), 0.0f, false, 1.0f);
    } else if (flag == "--hidden") {
      o.hidden = parse_integer(flag, value(), 1, smcgraph::kToyMaxHidden);
    } else if (flag == "--draft-perturbation") {
      o.draft_perturbation = parse_float(flag, value(), 0.0f, false, kFloatMax);
    } else if (flag == "--bf16") {
      no_value();
      o.bf16 = true;
    } else if (flag == "--eager") {
      no_value();
      o.eager = true;
    } else if (flag == "--no-compact") {
      no_value();
      o.compact = false;
    } else if (flag == "--quiet") {
      no_value();
      o.quiet = true;
    } else if (flag == "--results") {
      o.results_path = value();
      if (o.results_path.empty())
        throw bad_value(flag, o.results_path, "expected a file path");
    } else {
      throw UsageError{"unknown flag '" + flags.raw() + "' (see --help)"};
    }
  }

  // Flags that constrain each other. A lone --max-new below the default --min-new lowers --min-new too.
  if (max_new_given && !min_new_given && o.min_new > o.max_new)
    o.min_new = o.max_new;
  if (o.min_new > o.max_new)
    throw bad_value("--max-new", std::to_string(o.max_new),
                    "must be >= --min-new = " + std::to_string(o.min_new));
  if (o.min_prompt > o.max_prompt)
    throw bad_value("--max-prompt", std::to_string(o.max_prompt),
                    "must be >= --min-prompt = " + std::to_string(o.min_prompt));
  if (o.eos >= o.vocab)
    throw bad_value("--eos", std::to_string(o.eos), "must be -1 or < --vocab = " + std::to_string(o.vocab));
  // admit() needs room for the prompt, its first token and one cycle of K + 1 tokens.
  const int longest_prompt_allowed = o.max_seq_len - o.steps - 2;
  if (longest_prompt_allowed < 1)
    throw bad_value("--max-seq-len", std::to_string(o.max_seq_len),
                    "must be >= --steps + 3 = " + std::to_string(o.steps + 3));
  if (o.prompts_dir.empty() && o.max_prompt > longest_prompt_allowed)
    throw bad_value("--max-prompt", std::to_string(o.max_prompt),
                    "leaves no room for a cycle: must be <= --max-seq-len - --steps - 2 = " +
                        std::to_string(longest_prompt_allowed));
  const int64_t never_exhausted = static_cast<int64_t>(o.concurrency) * o.particles * o.max_seq_len + 1;
  if (o.pool_slots == 0) {
    if (never_exhausted > (1 << 28))
      throw UsageError{
          "--concurrency x --particles x --max-seq-len = " + std::to_string(never_exhausted - 1) +
          " KV slots is too large for the default pool: pass --pool-slots"};
    o.pool_slots = static_cast<int>(never_exhausted);
  }
  return o;
}

/// One request per regular file of `dir` (sorted by name); each holds whitespace-separated token ids.
std::vector<std::pair<std::string, std::vector<int32_t>>> read_prompt_files(const Options& o) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (!fs::is_directory(o.prompts_dir, error))
    throw bad_value("--prompts", o.prompts_dir, "not a directory");
  std::vector<fs::path> files;
  for (const fs::directory_entry& entry : fs::directory_iterator(o.prompts_dir, error))
    if (entry.is_regular_file())
      files.push_back(entry.path());
  if (error)
    throw bad_value("--prompts", o.prompts_dir, "cannot list: " + error.message());
  if (files.empty())
    throw bad_value("--prompts", o.prompts_dir, "holds no regular file");
  std::sort(files.begin(), files.end());

  std::vector<std::pair<std::string, std::vector<int32_t>>> prompts;
  for (const fs::path& path : files) {
    std::ifstream in(path);
    if (!in)
      throw bad_value("--prompts", path.string(), "cannot open");
    std::vector<int32_t> tokens;
    std::string word;
    while (in >> word) {
      const std::string where = path.string() + " token " + std::to_string(tokens.size());
      int64_t id = 0;
      const auto [stop, parse_error] = std::from_chars(word.data(), word.data() + word.size(), id);
      if (parse_error != std::errc() || stop != word.data() + word.size())
        throw bad_value("--prompts", where, "'" + word + "' is not an integer token id");
      if (id < 0 || id >= o.vocab)
        throw bad_value("--prompts", where,
                        std::to_string(id) + " is outside [0, --vocab = " + std::to_string(o.vocab) + ")");
      tokens.push_back(static_cast<int32_t>(id));
    }
    if (tokens.empty())
      throw bad_value("--prompts", path.string(), "holds no token id");
    if (static_cast<int>(tokens.size()) > o.max_seq_len - o.steps - 2)
      throw bad_value("--prompts", path.string(),
                      std::to_string(tokens.size()) +
                          " tokens leave no room for a cycle: at most --max-seq-len - "
                          "--steps - 2 = " +
                          std::to_string(o.max_seq_len - o.steps - 2));
    prompts.emplace_back(path.filename().string(), std::move(tokens));
  }
  return prompts;
}

// ---- serving -------------------------------------------------------------------------------------------

/// The requests to serve and a name for each (the prompt file, or "synthetic-<i>").
struct Workload {
  std::vector<smcgraph::examples::ServeRequest> requests;
  std::vector<std::string> names;
  bool from_files = false;
};

/// Prompts, then each request's seed and max_new_tokens, all from one generator so a run repeats.
Workload make_workload(const Options& o) {
  using namespace smcgraph;
  std::mt19937_64 rng(o.seed);
  Workload workload;
  std::vector<std::string>& names = workload.names;
  std::vector<examples::ServeRequest>& requests = workload.requests;
  std::vector<std::pair<std::string, std::vector<int32_t>>> files;
  if (!o.prompts_dir.empty())
    files = read_prompt_files(o);
  const int count = !files.empty() && !o.requests_given ? static_cast<int>(files.size()) : o.requests;
  std::uniform_int_distribution<int> prompt_length(o.min_prompt, o.max_prompt);
  std::uniform_int_distribution<int32_t> token(0, o.vocab - 1);
  std::uniform_int_distribution<int> max_new(o.min_new, o.max_new);
  for (int i = 0; i < count; ++i) {
    examples::ServeRequest request;
    if (!files.empty()) {
      names.push_back(files[i % files.size()].first);
      request.prompt = files[i % files.size()].second;
    } else {
      names.push_back("synthetic-" + std::to_string(i));
      request.prompt.resize(prompt_length(rng));
      for (int32_t& t : request.prompt)
        t = token(rng);
    }
    request.params.seed = rng();
    request.params.max_new_tokens = max_new(rng);
    requests.push_back(std::move(request));
  }
  workload.from_files = !files.empty();
  return workload;
}

int run(const Options& o, const Workload& workload) {
  using namespace smcgraph;
  const std::vector<examples::ServeRequest>& requests = workload.requests;
  const std::vector<std::string>& names = workload.names;
  const int count = static_cast<int>(requests.size());

  // The toy models and the engine (allocates everything once, captures one graph per bucket).
  ToyModelConfig toy;
  toy.vocab = o.vocab;
  toy.hidden = o.hidden;
  toy.pool_size = o.pool_slots; // the models' KV storage is indexed by the engine's slot ids
  toy.max_seq_len = o.max_seq_len;
  toy.logits_dtype = o.bf16 ? DType::kBFloat16 : DType::kFloat32;
  toy.weight_seed = o.seed;
  ToyModelPair models = ToyModel::pair(toy, o.draft_perturbation);

  EngineConfig config;
  config.vocab = o.vocab;
  config.particles = o.particles;
  config.draft_steps = o.steps;
  config.max_requests = o.concurrency;
  config.max_seq_len = o.max_seq_len;
  config.slot_pool_size = o.pool_slots;
  config.draft_temperature = o.draft_temperature;
  config.target_temperature = o.target_temperature;
  config.alpha = o.alpha;
  config.tau = o.tau;
  config.eos_id = o.eos;
  config.use_graphs = !o.eager;
  Engine engine(config, *models.draft, *models.target);
  double capture_ms = 0;
  for (const BucketInfo& bucket : engine.buckets())
    capture_ms += bucket.capture_ms;

  cudaDeviceProp device{};
  int device_index = 0;
  SMCGRAPH_CUDA_CHECK(cudaGetDevice(&device_index));
  SMCGRAPH_CUDA_CHECK(cudaGetDeviceProperties(&device, device_index));
  std::printf("host_engine on %s: %d requests (%s), concurrency %d, SMC N = %d, K = %d, vocab %d, eos %d, "
              "max_new_tokens in [%d, %d], %s\n",
              device.name, count, workload.from_files ? "prompt files" : "synthetic prompts", o.concurrency,
              o.particles, o.steps, o.vocab, o.eos, o.min_new, o.max_new,
              engine.eager() ? "eager cycles" : "graph replay");
  std::printf("engine: %zu buckets captured in %.0f ms, %.1f MB of device buffers, %d KV slots\n",
              engine.buckets().size(), capture_ms, engine.device_bytes() / 1e6, o.pool_slots);
  std::fflush(stdout);

  examples::ServeOptions serve_options;
  serve_options.compact = o.compact;
  serve_options.keep_results = !o.results_path.empty();
  if (!o.quiet) {
    serve_options.on_progress = [](const examples::ServeProgress& p) {
      std::fprintf(stderr,
                   "\r%zu/%zu requests served | %d live in a bucket of %d | %lld cycles | %lld tokens | "
                   "%.0f tokens/s   ",
                   p.served, p.total, p.live, p.bucket, static_cast<long long>(p.cycles),
                   static_cast<long long>(p.generated_tokens),
                   p.elapsed_s > 0 ? static_cast<double>(p.generated_tokens) / p.elapsed_s : 0.0);
      std::fflush(stderr);
    };
  }
  const examples::ServeStats stats = examples::serve(engine, requests, serve_options);
  if (!o.quiet)
    std::fprintf(stderr, "\n");

  std::printf("served %zu of %zu requests (%zu failed) in %.2f s\n", stats.served, stats.requests,
              stats.failed, stats.seconds);
  std::printf("generated tokens: %lld (%.0f tokens/s); particle tokens committed: %lld\n",
              static_cast<long long>(stats.generated_tokens), stats.tokens_per_s,
              static_cast<long long>(stats.particle_tokens));
  std::printf("latency, admit to finish: p50 %.2f ms, p95 %.2f ms, p99 %.2f ms\n", stats.latency_p50_ms,
              stats.latency_p95_ms, stats.latency_p99_ms);
  std::printf("cycles: %lld, mean bucket occupancy %.3f (live requests / bucket request slots), "
              "compactions %d\n",
              static_cast<long long>(stats.cycles), stats.mean_occupancy, stats.compactions);
  std::printf("resample rate: %.3f (%lld of %lld request-cycles resampled)\n", stats.resample_rate,
              static_cast<long long>(stats.resampled_request_cycles),
              static_cast<long long>(stats.request_cycles));
  const double request_cycles = static_cast<double>(std::max<int64_t>(1, stats.request_cycles));
  std::printf("draft length: mean K %.2f of %d, mean acceptance EMA %.3f (%s)\n",
              static_cast<double>(stats.draft_steps) / request_cycles, engine.config().draft_steps,
              stats.acceptance_ema / request_cycles, engine.draft_loop().note.c_str());
  std::printf("finish reasons:");
  for (const auto& [reason, requests_with_reason] : stats.reasons)
    std::printf(" %s %d;", reason.c_str(), requests_with_reason);
  std::printf("\n");

  if (!o.results_path.empty()) {
    std::ofstream out(o.results_path);
    if (!out)
      throw Error("host_engine: --results " + o.results_path + ": cannot open for writing");
    out << "# index\tname\tstatus\treason\tlatency_ms\tnew_tokens\ttokens\n";
    std::vector<const examples::ServedRequest*> by_index(stats.requests, nullptr);
    for (const examples::ServedRequest& done : stats.served_requests)
      by_index[done.index] = &done;
    for (const examples::ServedRequest* done : by_index) {
      if (done == nullptr)
        continue;
      out << done->index << '\t' << names[done->index] << '\t'
          << (done->result.failed ? "failed" : "finished") << '\t' << done->result.reason << '\t'
          << done->latency_ms << '\t' << done->result.tokens.size() << '\t';
      for (size_t j = 0; j < done->result.tokens.size(); ++j)
        out << (j ? " " : "") << done->result.tokens[j];
      out << '\n';
    }
    if (!out)
      throw Error("host_engine: --results " + o.results_path + ": write failed");
    std::printf("results: %s\n", o.results_path.c_str());
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  Options options;
  Workload workload;
  try {
    options = parse_options(argc, argv);
    workload = make_workload(options); // reads --prompts: its errors are usage errors too
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\n", kProgram, e.message.c_str());
    return 2;
  }
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "%s: no CUDA device (%s)\n", kProgram,
                 status != cudaSuccess ? cudaGetErrorString(status) : "device count 0");
    return 77;
  }
  try {
    return run(options, workload);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\n%s: %s\n", kProgram, e.what());
    return 1;
  }
}
