// soak: the engine under random churn for a long run, both cycle kinds one after the other (SMC, then
// speculative), served like a real server (step() for cycle t + 1 before poll() of cycle t), checking that
// nothing leaks, drifts or breaks.
//
//   build/bench/soak                         # 200000 cycles per kind, vocab 512, N 4, K 4, 16 request slots
//   build/bench/soak --kinds spec            # the speculative cycle only
//   build/bench/soak --cycles 20000 --seed 7
//   build/bench/soak --seconds 600           # run for a duration instead
//
// Churn: admissions with random prompt lengths and per-request seed, temperatures, alpha, tau and
// max_new_tokens (a few run to max_seq_len); EOS at random points (small vocabulary plus an EOS id);
// releases at finish and random cancellations of running requests; compaction when the live requests are
// scattered, and at random. Slot-pool pressure: the KV pool is small enough that requests running to
// max_seq_len exhaust it; every --pressure-every cycles a pressure phase admits only such requests until the
// pool runs dry. Requests that fail with "slot pool exhausted" are released and counted as injected faults;
// any other failure is a violation.
//
// Checks: every update and every result() (tokens in range, EOS only last, max_new_tokens respected, cycle
// indices consecutive); check_slot_invariants_device every --check-every cycles; smcgraph's own device
// memory (smcgraph::device_memory_stats: live allocations and bytes of the library's buffers) and host RSS
// (/proc/self/statm) sampled every --check-every cycles must stay flat after warm-up (the first 10 %): any
// change in smcgraph's device bytes or allocations, or RSS growth over 5 %, fails. The device's memory in use
// (cudaMemGetInfo) is reported beside it but not judged: other processes on the GPU move it. At the end every
// request is released and the free stack must hold every slot (free == pool_size - 1).
//
// Exit status: 0 pass, 1 a violation (listed on stderr and in the report), 2 a bad flag, 77 no CUDA device.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <system_error>
#include <unordered_map>
#include <vector>

#include <unistd.h>

#include <cuda_runtime_api.h>

#include "bench_util.hpp"
#include "cli.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/toy_model.hpp"

using namespace smcgraph;

namespace {

constexpr const char* kProgram = "soak";

using smcgraph::cli::bad_value;
using smcgraph::cli::parse_integer;
using smcgraph::cli::parse_positive;
using smcgraph::cli::UsageError;

struct Options {
  std::vector<CycleKind> kinds = {CycleKind::kSmc, CycleKind::kSpeculative};
  int64_t cycles = 200000; // per kind
  double seconds = 0;      // > 0: run for this long instead of --cycles
  uint64_t seed = 1;
  int vocab = 512;
  int particles = 4;
  int steps = 4;
  int max_requests = 16;
  int max_seq_len = 256;
  int hidden = 16;
  int pool_slots = 6144;
  int eos = 3;
  int max_prompt = 64;
  int max_new = 96;
  int64_t pressure_every = 0; // 0: auto
  int pressure_cycles = 2000;
  int64_t check_every = 1000;
  double rss_growth_limit = 0.05;
  bool eager = false;
  bool quiet = false;
  std::string model = "toy"; ///< toy, or smollm2: the real pair from its GGUF file (vocab 49152, EOS 2)
  std::string model_path;    ///< empty: default_llama_model_path()
  std::string draft_layers = "0-27";
};

void print_help() {
  const Options d;
  std::printf(
      "usage: soak [flags]\n"
      "\n"
      "Runs the engine under random churn (admissions, EOS, releases, cancellations, compaction, "
      "slot-pool\n"
      "exhaustion) with overlapped step()/poll(), checking the slot invariants, every update and result(),\n"
      "device memory and host RSS; each cycle kind in turn. Progress on stderr, report on stdout.\n"
      "\n"
      "  --kinds LIST          cycle kinds to soak, comma separated: smc, spec (default smc,spec)\n"
      "  --cycles N            cycles to run per kind (default %" PRId64 ")\n"
      "  --seconds S           run for S seconds instead (warm-up: the first 10 %% of the time)\n"
      "  --seed S              seeds the churn, the prompts and every request's sampling seed (default "
      "%" PRIu64 ")\n"
      "  --vocab V             toy vocabulary (default %d)\n"
      "  --eos ID              EOS token id, -1: none (default %d)\n"
      "  --particles N         SMC particles per request (default %d; the speculative cycle runs 1)\n"
      "  --steps K             draft tokens per cycle (default %d)\n"
      "  --max-requests Q      request slots, the largest bucket (default %d)\n"
      "  --max-seq-len S       tokens per particle (default %d)\n"
      "  --hidden H            toy hidden size (default %d)\n"
      "  --pool-slots P        KV slot pool; small enough that requests running to max-seq-len exhaust it\n"
      "                        (default %d; the speculative run, one row per request, gets P / 2)\n"
      "  --max-prompt N        longest random prompt (default %d)\n"
      "  --max-new N           longest usual max_new_tokens (default %d; 8 %% of requests draw up to\n"
      "                        2.5x that, 2 %% run to max-seq-len)\n"
      "  --pressure-every N    cycles between pool-pressure phases, 0: cycles / 10 clamped to [1000, 20000]\n"
      "                        (20000 with --seconds); -1: none\n"
      "  --pressure-cycles N   longest pressure phase in cycles (default %d)\n"
      "  --check-every N       cycles between invariant checks and memory samples (default %" PRId64 ")\n"
      "  --rss-growth X        allowed host RSS growth after warm-up, fraction (default %g)\n"
      "  --eager               run cycles kernel by kernel instead of replaying graphs\n"
      "  --model toy|smollm2   the embedded toy pair (default) or the real pair SmolLM2-135M-Instruct from "
      "its\n"
      "                        GGUF file (./run fetch-model; sets --vocab 49152 --eos 2; give --vocab/--eos "
      "after it\n"
      "                        only to override)\n"
      "  --model-path PATH     the GGUF file (default $SMCGRAPH_MODEL_PATH or .cache/models/)\n"
      "  --draft-layers LIST   the real draft's layers (default 0-27)\n"
      "  --quiet               no progress line\n"
      "  --help                this text\n"
      "\n"
      "Exit status: 0 pass, 1 violation, 2 bad flag or value, 77 no CUDA device.\n",
      d.cycles, d.seed, d.vocab, d.eos, d.particles, d.steps, d.max_requests, d.max_seq_len, d.hidden,
      d.pool_slots, d.max_prompt, d.max_new, d.pressure_cycles, d.check_every, d.rss_growth_limit);
}

Options parse_options(int argc, char** argv) {
  Options o;
  constexpr int kIntMax = std::numeric_limits<int>::max();
  constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
  smcgraph::cli::Flags flags(argc, argv);
  while (flags.next()) {
    const std::string flag = flags.flag();
    auto value = [&] { return flags.value(); };
    auto no_value = [&] { flags.no_value(); };
    if (flag == "--help" || flag == "-h") {
      print_help();
      std::exit(0);
    } else if (flag == "--kinds") {
      o.kinds.clear();
      std::string list = value(), item;
      for (size_t begin = 0; begin <= list.size();) {
        const size_t end = std::min(list.find(',', begin), list.size());
        item = list.substr(begin, end - begin);
        if (item == "smc")
          o.kinds.push_back(CycleKind::kSmc);
        else if (item == "spec")
          o.kinds.push_back(CycleKind::kSpeculative);
        else
          throw bad_value(flag, list, "a comma-separated list of smc, spec");
        begin = end + 1;
      }
    } else if (flag == "--cycles") {
      o.cycles = parse_integer<int64_t>(flag, value(), 1, kInt64Max);
    } else if (flag == "--seconds") {
      o.seconds = parse_positive(flag, value(), false);
    } else if (flag == "--seed") {
      o.seed = parse_integer<uint64_t>(flag, value(), 0, std::numeric_limits<uint64_t>::max());
    } else if (flag == "--vocab") {
      o.vocab = parse_integer(flag, value(), 2, 1 << 24);
    } else if (flag == "--model") {
      o.model = value();
      if (o.model != "toy" && o.model != "smollm2")
        throw bad_value(flag, o.model, "must be toy or smollm2");
      if (o.model == "smollm2") { // the real vocabulary and EOS (<|im_end|>)
        o.vocab = 49152;
        o.eos = 2;
      }
    } else if (flag == "--model-path") {
      o.model_path = value();
    } else if (flag == "--draft-layers") {
      o.draft_layers = value();
    } else if (flag == "--eos") {
      o.eos = parse_integer(flag, value(), -1, kIntMax);
    } else if (flag == "--particles") {
      o.particles = parse_integer(flag, value(), 1, 256);
    } else if (flag == "--steps") {
      o.steps = parse_integer(flag, value(), 1, 64);
    } else if (flag == "--max-requests") {
      o.max_requests = parse_integer(flag, value(), 1, 4096);
    } else if (flag == "--max-seq-len") {
      o.max_seq_len = parse_integer(flag, value(), 1, 1 << 20);
    } else if (flag == "--hidden") {
      o.hidden = parse_integer(flag, value(), 1, kToyMaxHidden);
    } else if (flag == "--pool-slots") {
      o.pool_slots = parse_integer(flag, value(), 2, 1 << 28);
    } else if (flag == "--max-prompt") {
      o.max_prompt = parse_integer(flag, value(), 1, kIntMax);
    } else if (flag == "--max-new") {
      o.max_new = parse_integer(flag, value(), 1, kIntMax / 4);
    } else if (flag == "--pressure-every") {
      o.pressure_every = parse_integer<int64_t>(flag, value(), -1, kInt64Max);
    } else if (flag == "--pressure-cycles") {
      o.pressure_cycles = parse_integer(flag, value(), 1, kIntMax);
    } else if (flag == "--check-every") {
      o.check_every = parse_integer<int64_t>(flag, value(), 1, kInt64Max);
    } else if (flag == "--rss-growth") {
      o.rss_growth_limit = parse_positive(flag, value(), true);
    } else if (flag == "--eager") {
      no_value();
      o.eager = true;
    } else if (flag == "--quiet") {
      no_value();
      o.quiet = true;
    } else {
      throw UsageError{"unknown flag '" + flags.raw() + "' (see --help)"};
    }
  }
  if (o.eos >= o.vocab)
    throw bad_value("--eos", std::to_string(o.eos), "must be -1 or < --vocab = " + std::to_string(o.vocab));
  const int longest_prompt_allowed = o.max_seq_len - o.steps - 2;
  if (longest_prompt_allowed < 1)
    throw bad_value("--max-seq-len", std::to_string(o.max_seq_len),
                    "must be >= --steps + 3 = " + std::to_string(o.steps + 3));
  if (o.max_prompt > longest_prompt_allowed)
    throw bad_value("--max-prompt", std::to_string(o.max_prompt),
                    "must be <= --max-seq-len - --steps - 2 = " + std::to_string(longest_prompt_allowed));
  if (o.pressure_every == 0)
    o.pressure_every = o.seconds > 0 ? 20000 : std::clamp<int64_t>(o.cycles / 10, 1000, 20000);
  return o;
}

// ---- measurements --------------------------------------------------------------------------------------

struct MemorySample {
  int64_t cycle = 0;
  int64_t library_bytes = 0;       ///< smcgraph's live device bytes (device_memory_stats), judged
  int64_t library_allocations = 0; ///< smcgraph's live device allocations, judged
  int64_t pinned_bytes = 0;        ///< smcgraph's live pinned host bytes, judged
  size_t device_used_bytes = 0;    ///< total - free from cudaMemGetInfo (the whole device; reported only)
  size_t rss_bytes = 0;            ///< resident set from /proc/self/statm
};

size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

MemorySample sample_memory(int64_t cycle) {
  size_t free_bytes = 0, total_bytes = 0;
  SMCGRAPH_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const smcgraph::DeviceMemoryStats library = smcgraph::device_memory_stats();
  return {cycle,
          library.device_bytes,
          library.device_allocations,
          library.pinned_bytes,
          total_bytes - free_bytes,
          resident_bytes()};
}

double mib(double bytes) {
  return bytes / (1024.0 * 1024.0);
}

// ---- the soak ------------------------------------------------------------------------------------------

/// What the host knows of a request it admitted.
struct Tracked {
  int prompt_length = 0;
  int max_new_tokens = -1;
  int next_cycle = 0; ///< the cycle index its next update must carry
  bool hog = false;   ///< admitted by a pressure phase
};

struct Counters {
  int64_t cycles = 0, admitted = 0, served = 0, cancelled = 0, faults = 0, compactions = 0;
  int64_t checks_passed = 0, checks_run = 0, eos_tokens = 0, updates = 0, resampled = 0;
  int64_t pressure_phases = 0, pressure_phases_with_fault = 0;
  std::map<std::string, int64_t> finish_reasons;
};

class Soak {
public:
  Soak(const Options& options, Engine& engine)
      : o_(options), engine_(engine), rng_(options.seed), start_(Clock::now()) {}

  int run();

private:
  using Clock = std::chrono::steady_clock;

  double elapsed_s() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  bool time_is_up() const {
    return o_.seconds > 0 ? elapsed_s() >= o_.seconds : counters_.cycles >= o_.cycles;
  }
  bool warmed_up() const {
    return o_.seconds > 0 ? elapsed_s() >= 0.1 * o_.seconds : counters_.cycles >= (o_.cycles + 9) / 10;
  }

  /// Records a broken rule: counted per kind, the first occurrence of each kind kept (and shown at once).
  void violation(const std::string& kind, const std::string& detail) {
    ++violation_count_;
    Violation& v = violations_[kind];
    if (v.count++ == 0) {
      v.first = "cycle " + std::to_string(counters_.cycles) + ": " + detail;
      if (!o_.quiet)
        std::fprintf(stderr, "\nsoak: VIOLATION %s at %s\n", kind.c_str(), v.first.c_str());
    }
  }

  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng_); }
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return uniform(0.0, 1.0) < p; }

  void admit_one(bool hog);
  void admit_some();
  void launch();
  void handle(const std::vector<RequestUpdate>& updates);
  void check_result(RequestId id, const Tracked& request, const std::string& reason);
  void maybe_compact();
  void periodic_checks();
  void print_progress(bool force);

  const Options& o_;
  Engine& engine_;
  std::mt19937_64 rng_;
  Clock::time_point start_;
  Clock::time_point last_progress_{};
  std::unordered_map<RequestId, Tracked> live_;
  Counters counters_;
  int in_flight_ = 0;
  int64_t next_check_ = 0;
  int64_t next_pressure_ = 0;
  int64_t pressure_until_ = -1; ///< a pressure phase runs while cycles < pressure_until_
  bool pressure_fault_seen_ = false;
  std::vector<MemorySample> samples_;
  int baseline_index_ = -1; ///< first sample taken after warm-up
  struct Violation {
    int64_t count = 0;
    std::string first; ///< where and what, of the first occurrence
  };
  int64_t violation_count_ = 0;
  std::map<std::string, Violation> violations_; ///< by kind
  bool stop_ = false;                           ///< an invariant broke: stop launching
};

void Soak::admit_one(bool hog) {
  // Hogs run to max_seq_len without resampling (tau = 0: no particle shares a sibling's tail), so their
  // slots pile up until the pool runs dry.
  const int max_prompt = hog ? std::min(o_.max_prompt, 32) : o_.max_prompt;
  std::vector<int32_t> prompt(integer(1, max_prompt));
  for (int32_t& token : prompt)
    token = integer(0, o_.vocab - 1);
  RequestParams params;
  params.seed = rng_();
  params.draft_temperature = static_cast<float>(uniform(0.5, 2.5));
  params.target_temperature = static_cast<float>(uniform(0.5, 2.5));
  params.alpha = static_cast<float>(uniform(0.5, 1.5));
  params.tau = hog ? 0.0f : static_cast<float>(uniform(0.0, 1.0));
  if (engine_.config().kind == CycleKind::kSpeculative) {
    params.alpha = 1.0f; // rejection sampling targets the tempered target itself
    if (chance(0.3))
      params.target_temperature = 0.0f; // greedy verification
  }
  const double kind = uniform(0.0, 1.0);
  if (hog || kind < 0.02)
    params.max_new_tokens = -1; // until max_seq_len
  else if (kind < 0.10)
    params.max_new_tokens = integer(o_.max_new + 1, o_.max_new * 5 / 2 + 1); // long
  else
    params.max_new_tokens = integer(1, o_.max_new);
  const RequestId id = engine_.admit(prompt, params);
  if (live_.count(id))
    violation("admit() reused a live id", std::to_string(id));
  live_[id] = Tracked{static_cast<int>(prompt.size()), params.max_new_tokens, 0, hog};
  ++counters_.admitted;
}

void Soak::admit_some() {
  const bool pressure = counters_.cycles < pressure_until_;
  for (int free = o_.max_requests - static_cast<int>(live_.size()); free > 0; --free) {
    if (pressure)
      admit_one(true); // fill every free slot with a hog
    else if (chance(0.6))
      admit_one(false); // usual churn: occupancy wanders below the maximum
  }
}

void Soak::launch() {
  if (stop_ || time_is_up() || engine_.current_bucket() == 0)
    return;
  engine_.step();
  ++in_flight_;
  ++counters_.cycles;
  if (counters_.cycles >= next_pressure_ && o_.pressure_every > 0) {
    pressure_until_ = counters_.cycles + o_.pressure_cycles;
    pressure_fault_seen_ = false;
    next_pressure_ += o_.pressure_every;
    ++counters_.pressure_phases;
  }
}

void Soak::check_result(RequestId id, const Tracked& request, const std::string& reason) {
  const RequestResult result = engine_.result(id);
  const std::string where = "request " + std::to_string(id) + " (" + reason + "): ";
  if (!result.finished || result.failed)
    violation("result() not finished", where + result.reason);
  if (result.particles.size() != static_cast<size_t>(o_.particles)) {
    violation("result() particle count", where + std::to_string(result.particles.size()));
    return;
  }
  if (result.chosen < 0 || result.chosen >= o_.particles || result.tokens != result.particles[result.chosen])
    violation("result().tokens is not particles[chosen]", where);
  if (reason != "eos" && reason != "max_new_tokens" && reason != "max sequence length")
    violation("unexpected finish reason", where);
  const int room = o_.max_seq_len - request.prompt_length;
  for (const std::vector<int32_t>& tokens : result.particles) {
    const int count = static_cast<int>(tokens.size());
    const bool ends_in_eos = count > 0 && tokens.back() == o_.eos;
    if (count == 0 || count > room)
      violation("result() token count outside [1, max_seq_len - prompt]", where + std::to_string(count));
    if (request.max_new_tokens > 0 && count > request.max_new_tokens)
      violation("result() longer than max_new_tokens",
                where + std::to_string(count) + " > " + std::to_string(request.max_new_tokens));
    for (int j = 0; j < count; ++j) {
      if (tokens[j] < 0 || tokens[j] >= o_.vocab)
        violation("result() token out of range", where + std::to_string(tokens[j]));
      if (tokens[j] == o_.eos && j + 1 < count)
        violation("result() tokens continue after EOS", where);
    }
    if (reason == "max_new_tokens" && count != request.max_new_tokens && !ends_in_eos)
      violation("max_new_tokens finish: neither max_new_tokens tokens nor ending in EOS",
                where + std::to_string(count));
    if (reason == "eos" && !ends_in_eos && count != request.max_new_tokens)
      violation("eos finish: a particle neither ends in EOS nor was cut at max_new_tokens", where);
    // Refused at L + K + 1 > max_seq_len, so more than room - (K + 1) tokens unless EOS cut them.
    if (reason == "max sequence length" && !ends_in_eos && count <= room - (o_.steps + 1))
      violation("max length finish: stopped short of max_seq_len without EOS", where + std::to_string(count));
  }
}

void Soak::handle(const std::vector<RequestUpdate>& updates) {
  std::vector<std::pair<RequestId, std::string>> finished, failed;
  for (const RequestUpdate& update : updates) {
    auto it = live_.find(update.id);
    if (it == live_.end()) {
      violation("update for a request that is not live", std::to_string(update.id));
      continue;
    }
    Tracked& request = it->second;
    ++counters_.updates;
    counters_.resampled += update.resampled;
    if (update.cycle != request.next_cycle)
      violation("update.cycle not consecutive", "request " + std::to_string(update.id) + ": " +
                                                    std::to_string(update.cycle) + ", expected " +
                                                    std::to_string(request.next_cycle));
    request.next_cycle = update.cycle + 1;
    if (update.failed) {
      failed.emplace_back(update.id, update.reason);
      continue;
    }
    if (update.tokens.size() != static_cast<size_t>(o_.particles) ||
        update.ancestors.size() != static_cast<size_t>(o_.particles)) {
      violation("update particle count", std::to_string(update.id));
      continue;
    }
    for (int i = 0; i < o_.particles; ++i) {
      const std::vector<int32_t>& tokens = update.tokens[i];
      if (tokens.size() > static_cast<size_t>(o_.steps + 1))
        violation("more than K + 1 tokens in a cycle",
                  "request " + std::to_string(update.id) + ": " + std::to_string(tokens.size()));
      for (size_t j = 0; j < tokens.size(); ++j) {
        if (tokens[j] < 0 || tokens[j] >= o_.vocab)
          violation("streamed token out of range", "request " + std::to_string(update.id) + " (" +
                                                       update.reason + "): particle " + std::to_string(i) +
                                                       " token " + std::to_string(tokens[j]));
        if (tokens[j] == o_.eos) {
          ++counters_.eos_tokens;
          if (j + 1 < tokens.size())
            violation("streamed tokens after EOS", std::to_string(update.id));
        }
      }
      if (update.ancestors[i] < 0 || update.ancestors[i] >= o_.particles)
        violation("ancestor out of range",
                  "request " + std::to_string(update.id) + ": " + std::to_string(update.ancestors[i]));
    }
    if (update.finished)
      finished.emplace_back(update.id, update.reason);
  }

  for (const auto& [id, reason] : finished) {
    check_result(id, live_.at(id), reason);
    ++counters_.finish_reasons[reason];
    ++counters_.served;
    engine_.release(id);
    live_.erase(id);
  }
  for (const auto& [id, reason] : failed) {
    if (reason.find("slot pool exhausted") != std::string::npos) {
      ++counters_.faults; // injected: the pool is sized to run dry under pressure
      if (counters_.cycles < pressure_until_ && !pressure_fault_seen_) {
        pressure_fault_seen_ = true;
        ++counters_.pressure_phases_with_fault;
        pressure_until_ = counters_.cycles; // the pool ran dry: back to the usual churn
      }
    } else {
      violation("request failed other than by slot pool exhaustion",
                "request " + std::to_string(id) + ": " + reason);
    }
    engine_.release(id); // a failed request keeps its slots until released
    live_.erase(id);
  }
}

void Soak::maybe_compact() {
  // As a server would: when the live requests fit a smaller bucket than the one they span. Plus at random,
  // so compact() also runs when it has nothing or little to move.
  const int live = static_cast<int>(live_.size());
  int smallest = o_.max_requests;
  for (const BucketInfo& bucket : engine_.buckets())
    if (bucket.requests >= live) {
      smallest = bucket.requests;
      break;
    }
  if ((live > 0 && engine_.current_bucket() > smallest && chance(0.5)) || chance(0.01)) {
    engine_.compact();
    ++counters_.compactions;
  }
}

void Soak::periodic_checks() {
  if (counters_.cycles < next_check_)
    return;
  next_check_ = counters_.cycles + o_.check_every;
  ++counters_.checks_run;
  const SlotCheck check = check_engine_slots(engine_);
  if (check.ok) {
    ++counters_.checks_passed;
  } else {
    violation("slot invariants", check.problem);
    stop_ = true; // the pool is corrupt: nothing after this is meaningful
  }
  if (engine_.live_requests() != static_cast<int>(live_.size()))
    violation("engine.live_requests() disagrees with the host",
              std::to_string(engine_.live_requests()) + " vs " + std::to_string(live_.size()));
  samples_.push_back(sample_memory(counters_.cycles));
  if (baseline_index_ < 0 && warmed_up())
    baseline_index_ = static_cast<int>(samples_.size()) - 1;
}

void Soak::print_progress(bool force) {
  if (o_.quiet)
    return;
  const Clock::time_point now = Clock::now();
  if (!force && std::chrono::duration<double>(now - last_progress_).count() < 0.5)
    return;
  last_progress_ = now;
  const double elapsed = elapsed_s();
  char target[64];
  if (o_.seconds > 0)
    std::snprintf(target, sizeof(target), "%.0f/%.0f s", elapsed, o_.seconds);
  else
    std::snprintf(target, sizeof(target), "%" PRId64 "/%" PRId64, counters_.cycles, o_.cycles);
  std::fprintf(stderr,
               "\rsoak: cycle %s | live %zu in bucket %d%s | served %" PRId64 " | faults %" PRId64
               " | checks %" PRId64 "/%" PRId64 " | %.0f us/cycle   ",
               target, live_.size(), engine_.current_bucket(),
               counters_.cycles < pressure_until_ ? " (pressure)" : "", counters_.served, counters_.faults,
               counters_.checks_passed, counters_.checks_run,
               counters_.cycles > 0 ? 1e6 * elapsed / static_cast<double>(counters_.cycles) : 0.0);
  std::fflush(stderr);
}

int Soak::run() {
  next_check_ = o_.check_every;
  next_pressure_ = o_.pressure_every > 0 ? o_.pressure_every / 2 : std::numeric_limits<int64_t>::max();
  const MemorySample start_sample = sample_memory(0);

  admit_some();
  if (live_.empty())
    admit_one(false);
  launch(); // cycle 0
  while (in_flight_ > 0) {
    launch(); // cycle t + 1 is queued before cycle t is read
    const std::vector<RequestUpdate> updates = engine_.poll();
    --in_flight_;
    handle(updates);
    // Client disconnects: cancel a running request now and then (its cycle t + 1 may still be running).
    if (!live_.empty() && chance(0.01)) {
      auto victim = live_.begin();
      std::advance(victim, integer(0, static_cast<int>(live_.size()) - 1));
      engine_.release(victim->first);
      live_.erase(victim);
      ++counters_.cancelled;
    }
    if (!stop_ && !time_is_up()) {
      admit_some();
      if (live_.empty())
        admit_one(false); // keep a cycle going until the run is over
      maybe_compact();
    }
    periodic_checks();
    print_progress(false);
  }
  print_progress(true);
  if (!o_.quiet)
    std::fprintf(stderr, "\n");

  // Drain: nothing is in flight; release every request and check that every slot is free again.
  for (const auto& [id, request] : live_)
    engine_.release(id);
  live_.clear();
  const SlotCheck final_check = check_engine_slots(engine_);
  ++counters_.checks_run;
  if (final_check.ok)
    ++counters_.checks_passed;
  else
    violation("final slot invariants", final_check.problem);
  if (final_check.free != o_.pool_slots - 1 || final_check.referenced != 0)
    violation("slots leaked after releasing everything",
              "free " + std::to_string(final_check.free) + ", referenced " +
                  std::to_string(final_check.referenced) +
                  ", expected free == pool_size - 1 = " + std::to_string(o_.pool_slots - 1));
  if (engine_.live_requests() != 0)
    violation("requests left after releasing everything", std::to_string(engine_.live_requests()));
  const MemorySample end_sample = sample_memory(counters_.cycles);

  // Memory drift after warm-up: smcgraph's own allocations are judged (exactly flat), the device's memory in
  // use is only reported (another process on the same GPU changes it).
  int64_t library_drift_max = 0;    // largest |library bytes - baseline| over the samples after the baseline
  int64_t allocation_drift_max = 0; // the same for the number of live allocations
  int64_t pinned_drift_max = 0;
  int64_t device_drift_max = 0; // cudaMemGetInfo, informational
  double rss_growth_max = 0.0;
  auto keep_largest = [](int64_t& largest, int64_t value) {
    if (std::llabs(value) > std::llabs(largest))
      largest = value;
  };
  const bool have_baseline = baseline_index_ >= 0 && baseline_index_ + 1 < static_cast<int>(samples_.size());
  if (have_baseline) {
    const MemorySample& base = samples_[baseline_index_];
    for (size_t i = baseline_index_ + 1; i < samples_.size(); ++i) {
      keep_largest(library_drift_max, samples_[i].library_bytes - base.library_bytes);
      keep_largest(allocation_drift_max, samples_[i].library_allocations - base.library_allocations);
      keep_largest(pinned_drift_max, samples_[i].pinned_bytes - base.pinned_bytes);
      keep_largest(device_drift_max, static_cast<int64_t>(samples_[i].device_used_bytes) -
                                         static_cast<int64_t>(base.device_used_bytes));
      rss_growth_max =
          std::max(rss_growth_max,
                   static_cast<double>(samples_[i].rss_bytes) / static_cast<double>(base.rss_bytes) - 1.0);
    }
    if (library_drift_max != 0 || allocation_drift_max != 0)
      violation("smcgraph device memory drift after warm-up", std::to_string(library_drift_max) + " bytes, " +
                                                                  std::to_string(allocation_drift_max) +
                                                                  " allocations");
    if (pinned_drift_max != 0)
      violation("smcgraph pinned host memory drift after warm-up",
                std::to_string(pinned_drift_max) + " bytes");
    if (rss_growth_max > o_.rss_growth_limit)
      violation("host RSS growth after warm-up", std::to_string(100 * rss_growth_max) + " %");
  }

  // Report.
  const double seconds = elapsed_s();
  std::printf("soak on %s: %s N = %d, K = %d, vocab %d, eos %d, %d request slots, %d KV slots, %s\n",
              bench::device_name().c_str(),
              engine_.config().kind == CycleKind::kSmc ? "SMC cycle" : "speculative cycle", o_.particles,
              o_.steps, o_.vocab, o_.eos, o_.max_requests, o_.pool_slots,
              engine_.eager() ? "eager cycles" : "graph replay");
  std::printf("cycles: %" PRId64 " in %.1f s (%.0f us per cycle, host included)\n", counters_.cycles, seconds,
              counters_.cycles > 0 ? 1e6 * seconds / static_cast<double>(counters_.cycles) : 0.0);
  std::printf("requests: admitted %" PRId64 ", served %" PRId64 ", cancelled %" PRId64
              ", faults injected %" PRId64 " (slot pool exhausted; %" PRId64 " of %" PRId64
              " pressure phases ran the pool dry)\n",
              counters_.admitted, counters_.served, counters_.cancelled, counters_.faults,
              counters_.pressure_phases_with_fault, counters_.pressure_phases);
  std::printf("finish reasons:");
  for (const auto& [reason, count] : counters_.finish_reasons)
    std::printf(" %s %" PRId64 ";", reason.c_str(), count);
  std::printf(" EOS tokens streamed %" PRId64 "; resampled %" PRId64 " of %" PRId64
              " request-cycles; compactions %" PRId64 "\n",
              counters_.eos_tokens, counters_.resampled, counters_.updates, counters_.compactions);
  std::printf("invariant checks passed: %" PRId64 "/%" PRId64
              "; after releasing everything: free %d == pool_size - 1 "
              "= %d: %s\n",
              counters_.checks_passed, counters_.checks_run, final_check.free, o_.pool_slots - 1,
              final_check.free == o_.pool_slots - 1 ? "ok" : "NO");
  if (have_baseline) {
    const MemorySample& base = samples_[baseline_index_];
    std::printf("memory after warm-up (baseline at cycle %" PRId64 ", %zu later samples): smcgraph device "
                "%.1f MiB in %" PRId64 " allocations, drift %+" PRId64 " bytes / %+" PRId64
                " allocations; smcgraph pinned drift %+" PRId64 " bytes; host RSS %.1f MiB, largest growth "
                "%+.2f %% (limit %.1f %%); device in use (cudaMemGetInfo, all processes, not judged) %.1f "
                "MiB, drift %+" PRId64 " bytes\n",
                base.cycle, samples_.size() - baseline_index_ - 1,
                mib(static_cast<double>(base.library_bytes)), base.library_allocations, library_drift_max,
                allocation_drift_max, pinned_drift_max, mib(base.rss_bytes), 100 * rss_growth_max,
                100 * o_.rss_growth_limit, mib(base.device_used_bytes), device_drift_max);
  } else {
    std::printf(
        "memory: too few samples after warm-up to judge drift (raise --cycles or lower --check-every)\n");
  }
  std::printf("memory start to end (warm-up included): smcgraph device %.1f -> %.1f MiB, device in use "
              "%.1f -> %.1f MiB, host RSS %.1f -> %.1f MiB\n",
              mib(static_cast<double>(start_sample.library_bytes)),
              mib(static_cast<double>(end_sample.library_bytes)), mib(start_sample.device_used_bytes),
              mib(end_sample.device_used_bytes), mib(start_sample.rss_bytes), mib(end_sample.rss_bytes));
  if (counters_.pressure_phases > 0 && counters_.faults == 0)
    std::printf("warning: no request failed with 'slot pool exhausted': the fault path was not exercised "
                "(lower --pool-slots)\n");
  if (violation_count_ == 0) {
    std::printf("result: PASS\n");
    return 0;
  }
  std::printf("result: FAIL, %" PRId64 " violations:\n", violation_count_);
  for (const auto& [kind, v] : violations_)
    std::printf("  %s: %" PRId64 " times, first at %s\n", kind.c_str(), v.count, v.first.c_str());
  return 1;
}

int run_engine(const Options& o, CycleKind kind);

int run_kind(Options o, CycleKind kind) {
  if (kind == CycleKind::kSpeculative) {
    // One row per request instead of N: half the pool keeps the pressure phases able to run it dry (16
    // requests x 256 tokens > 3072 slots) while the usual churn rarely does.
    o.particles = 1;
    o.pool_slots = std::max(o.pool_slots / 2, 2 * o.max_seq_len);
  }
  const smcgraph::DeviceMemoryStats before = smcgraph::device_memory_stats();
  const int status = run_engine(o, kind);
  // Everything the engine and the models allocated is returned once they are gone.
  const smcgraph::DeviceMemoryStats after = smcgraph::device_memory_stats();
  if (after.device_allocations != before.device_allocations || after.device_bytes != before.device_bytes ||
      after.pinned_allocations != before.pinned_allocations || after.pinned_bytes != before.pinned_bytes) {
    std::printf("result: FAIL, smcgraph memory not returned after destroying the engine and models: device "
                "%+" PRId64 " bytes in %+" PRId64 " allocations, pinned %+" PRId64 " bytes\n",
                after.device_bytes - before.device_bytes,
                after.device_allocations - before.device_allocations,
                after.pinned_bytes - before.pinned_bytes);
    return 1;
  }
  std::printf("smcgraph memory after destroying the engine and models: every allocation returned\n");
  return status;
}

int run_engine(const Options& o, CycleKind kind) {
  EngineConfig config;
  config.vocab = o.vocab;
  config.particles = o.particles;
  config.draft_steps = o.steps;
  config.max_requests = o.max_requests;
  config.max_seq_len = o.max_seq_len;
  config.slot_pool_size = o.pool_slots;
  config.eos_id = o.eos;
  config.use_graphs = !o.eager;
  config.kind = kind;
  if (o.model == "smollm2") {
    // The real pair: weights loaded once, shared by the draft (a layer subset) and the target.
    const std::string path = o.model_path.empty() ? default_llama_model_path() : o.model_path;
    auto weights = load_llama_weights(GgufFile::open(path));
    LlamaModelOptions options;
    options.pool_size = o.pool_slots;
    options.max_seq_len = o.max_seq_len;
    options.max_tokens_per_forward = std::max(128, o.max_requests * o.particles * (o.steps + 1));
    options.logits_dtype = DType::kBFloat16;
    LlamaModel target(weights, options);
    options.layers = parse_llama_layers(o.draft_layers);
    LlamaModel draft(weights, options);
    std::printf("model: SmolLM2-135M-Instruct (%s), draft layers %s\n", path.c_str(), o.draft_layers.c_str());
    Engine engine(config, draft, target);
    Soak soak(o, engine);
    return soak.run();
  }
  ToyModelConfig toy;
  toy.vocab = o.vocab;
  toy.hidden = o.hidden;
  toy.window = 16;
  toy.pool_size = o.pool_slots;
  toy.max_seq_len = o.max_seq_len;
  toy.logits_dtype = DType::kFloat32;
  toy.weight_seed = o.seed;
  ToyModelPair models = ToyModel::pair(toy, 0.3f);
  Engine engine(config, *models.draft, *models.target);
  Soak soak(o, engine);
  return soak.run();
}

int run(const Options& o) {
  int status = 0;
  for (size_t i = 0; i < o.kinds.size(); ++i) {
    if (i > 0)
      std::printf("\n");
    status = std::max(status, run_kind(o, o.kinds[i]));
  }
  if (o.kinds.size() > 1)
    std::printf("\nsoak overall: %s\n", status == 0 ? "PASS" : "FAIL");
  return status;
}

} // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_options(argc, argv);
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
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\n%s: %s\n", kProgram, e.what());
    return 1;
  }
}
