// cycle_bench: the SMC cycle per bucket — GPU time per cycle replayed as a graph and run eagerly, host time
// per step(), capture time, device memory and tokens/s, with the embedded toy models.
//
//   build/bench/cycle_bench [--vocab 128256] [--particles 8] [--steps 4] [--max-requests 64] [--csv PATH]
//
// Validation first: every request's updates must carry K + 1 in-vocabulary tokens per particle and the slot
// invariants must hold after the timed cycles.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/toy_model.hpp"

using namespace smcgraph;

namespace {

struct Options {
  int vocab = 128256, particles = 8, steps = 4, max_requests = 64, cycles = 30;
  std::string csv = "results/cycle_bench.csv";
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

/// GPU time per cycle: `cycles` step()s back to back between two events (step() waits only when both
/// output buffers are busy, which keeps exactly one cycle queued behind the running one).
double gpu_us_per_cycle(Engine& engine, int cycles) {
  Event start(true), stop(true);
  engine.synchronize();
  while (!engine.poll().empty()) {
  }
  start.record(engine.stream());
  for (int i = 0; i < cycles; ++i)
    engine.step();
  stop.record(engine.stream());
  stop.synchronize();
  while (!engine.poll().empty()) {
  }
  return 1000.0 * stop.elapsed_ms_since(start) / cycles;
}

/// Host time of step() alone: one cycle is in flight when step() is called, so it only launches.
double host_us_per_step(Engine& engine, int cycles) {
  std::vector<double> samples;
  engine.synchronize();
  while (!engine.poll().empty()) {
  }
  engine.step();
  for (int i = 0; i < cycles; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    engine.step();
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    engine.poll();
  }
  while (!engine.poll().empty()) {
  }
  return median(samples);
}

int run(const Options& o) {
  Stream stream;
  size_t free_before = 0, total_memory = 0;
  SMCGRAPH_CUDA_CHECK(cudaMemGetInfo(&free_before, &total_memory));
  EngineConfig config;
  config.vocab = o.vocab;
  config.particles = o.particles;
  config.draft_steps = o.steps;
  config.max_requests = o.max_requests;
  config.max_seq_len = 1024;
  config.slot_pool_size = o.max_requests * o.particles * 1024 / 2 + 4096;
  ToyModelConfig toy;
  toy.vocab = o.vocab;
  toy.hidden = 32;
  toy.pool_size = config.slot_pool_size;
  toy.max_seq_len = config.max_seq_len;
  toy.logits_dtype = DType::kBFloat16;
  toy.weight_seed = 2026;
  ToyModelPair models = ToyModel::pair(toy, 0.3f);
  const auto capture_start = std::chrono::steady_clock::now();
  Engine engine(config, *models.draft, *models.target);
  const double construct_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - capture_start).count();
  size_t free_after = 0;
  SMCGRAPH_CUDA_CHECK(cudaMemGetInfo(&free_after, &total_memory));
  double capture_total_ms = 0.0;
  for (const BucketInfo& info : engine.buckets())
    capture_total_ms += info.capture_ms;

  std::printf("smcgraph cycle_bench on %s: SMC N = %d, K = %d, V = %d (bf16 logits), toy models hidden 32\n",
              bench::device_name().c_str(), o.particles, o.steps, o.vocab);
  std::printf(
      "engine construction %.2f s (capture of %zu buckets x 2 parities: %.0f ms); engine buffers %.1f MB; "
      "device memory used by models + engine %.1f MB\n",
      construct_s, engine.buckets().size(), capture_total_ms, engine.device_bytes() / 1e6,
      (free_before - free_after) / 1e6);
  std::printf("\n%8s %6s %12s %12s %8s %12s %10s %8s %12s\n", "requests", "rows", "graph_us", "eager_us",
              "eager/gr", "host_step_us", "capture_ms", "nodes", "tokens/s");
  bench::Csv csv(o.csv);
  csv.row({"device", "requests", "rows", "particles", "steps", "vocab", "graph_us_per_cycle",
           "eager_us_per_cycle", "host_us_per_step", "capture_ms", "graph_nodes", "request_tokens_per_s",
           "engine_mb"});
  bool valid = true;
  uint64_t seed = 1;
  std::vector<RequestId> admitted;
  for (const BucketInfo& info : engine.buckets()) {
    // Fill exactly this bucket: release everything, admit `requests` fresh requests.
    engine.synchronize();
    while (!engine.poll().empty()) {
    }
    for (RequestId id : admitted)
      engine.release(id);
    admitted.clear();
    for (int q = 0; q < info.requests; ++q) {
      std::vector<int32_t> prompt(32);
      for (int i = 0; i < 32; ++i)
        prompt[i] = static_cast<int32_t>((seed * 7919 + i * 104729) % o.vocab);
      admitted.push_back(engine.admit(prompt, {.seed = seed++}));
    }
    // Validate a few cycles first.
    for (int c = 0; c < 3; ++c) {
      engine.step();
      for (const RequestUpdate& update : engine.poll()) {
        if (update.failed || update.tokens.size() != static_cast<size_t>(o.particles))
          valid = false;
        for (const auto& tokens : update.tokens) {
          if (tokens.size() != static_cast<size_t>(o.steps + 1))
            valid = false;
          for (int32_t t : tokens)
            if (t < 0 || t >= o.vocab)
              valid = false;
        }
      }
    }
    engine.set_eager(false);
    const double graph_us = gpu_us_per_cycle(engine, o.cycles);
    const double host_us = host_us_per_step(engine, o.cycles);
    engine.set_eager(true);
    const double eager_us = gpu_us_per_cycle(engine, std::max(5, o.cycles / 3));
    engine.set_eager(false);
    const SlotCheck check = check_engine_slots(engine);
    if (!check.ok) {
      std::fprintf(stderr, "slot invariants broken at bucket %d: %s\n", info.requests, check.problem.c_str());
      valid = false;
    }
    const double tokens_per_s = info.requests * (o.steps + 1) / (graph_us * 1e-6);
    std::printf("%8d %6d %12.1f %12.1f %8.2f %12.2f %10.1f %8zu %12.0f\n", info.requests,
                info.requests * o.particles, graph_us, eager_us, eager_us / graph_us, host_us,
                info.capture_ms, info.graph_nodes, tokens_per_s);
    csv.row({bench::device_name(), std::to_string(info.requests), std::to_string(info.requests * o.particles),
             std::to_string(o.particles), std::to_string(o.steps), std::to_string(o.vocab),
             bench::format(graph_us, 2), bench::format(eager_us, 2), bench::format(host_us, 3),
             bench::format(info.capture_ms, 1), std::to_string(info.graph_nodes),
             bench::format(tokens_per_s, 0), bench::format(engine.device_bytes() / 1e6, 1)});
    std::fflush(stdout);
  }
  std::printf("\nvalidation: %s; CSV: %s\n", valid ? "ok" : "FAILED", o.csv.c_str());
  return valid ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "cycle_bench: %s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--vocab")
      o.vocab = std::atoi(value("--vocab").c_str());
    else if (arg == "--particles")
      o.particles = std::atoi(value("--particles").c_str());
    else if (arg == "--steps")
      o.steps = std::atoi(value("--steps").c_str());
    else if (arg == "--max-requests")
      o.max_requests = std::atoi(value("--max-requests").c_str());
    else if (arg == "--cycles")
      o.cycles = std::atoi(value("--cycles").c_str());
    else if (arg == "--csv")
      o.csv = value("--csv");
    else if (arg == "--help" || arg == "-h") {
      std::printf(
          "usage: cycle_bench [--vocab V] [--particles N] [--steps K] [--max-requests Q] [--cycles C] "
          "[--csv PATH]\n");
      return 0;
    } else {
      std::fprintf(stderr, "cycle_bench: unknown flag %s (see --help)\n", arg.c_str());
      return 2;
    }
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cycle_bench: %s\n", e.what());
    return 2;
  }
}
