// The serving loop of examples/host_engine.cpp, header-only so tests can drive exactly the code users copy.
//
// A host inference server built on smcgraph::Engine does four things per cycle:
//   1. step()      queue cycle t + 1 (one graph launch) BEFORE reading cycle t, so the GPU never waits for
//                  the host: the engine keeps two pinned output buffers and step() returns at once;
//   2. poll()      read cycle t's outputs (waits only for cycle t) and stream them to clients;
//   3. finish      for every request that finished (EOS in every particle, max_new_tokens, max_seq_len) or
//                  failed: result() for its tokens, then release() so its request slot and KV slots go back;
//   4. admit       fill the freed request slots with waiting requests (continuous batching), and compact()
//                  when the live requests are scattered so that a smaller captured bucket covers them.
//
// clang-format off
//   smcgraph::examples::ServeOptions options;
//   options.on_finish = [](const smcgraph::examples::ServedRequest& done) {
//     send(done.index, done.result.tokens);
//   };
//   smcgraph::examples::ServeStats stats = smcgraph::examples::serve(engine, requests, options);
//   std::printf("%.0f tokens/s, p99 latency %.1f ms\n", stats.tokens_per_s, stats.latency_p99_ms);
// clang-format on
//
// Two consequences of overlapping that a server must know about:
//   - a request that finishes in cycle t has already been queued into cycle t + 1 (step() ran before poll()),
//     so it computes one extra cycle whose tokens result() drops (EOS and max_new_tokens cut the output);
//   - result() synchronizes the engine's stream, so a cycle in which some request finishes costs that
//     cycle's overlap. The loop reads every finished request's result() in one go after poll().
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"

namespace smcgraph::examples {

/// One request waiting to be served.
struct ServeRequest {
  std::vector<int32_t> prompt;
  RequestParams params; ///< seed, temperatures, max_new_tokens (-1: until max_seq_len)
};

/// A request that left the engine: finished, failed in a cycle, or refused by admit().
struct ServedRequest {
  size_t index = 0;      ///< position in the request list given to serve()
  RequestId id = -1;     ///< engine id (-1 when admit() refused the request)
  RequestResult result;  ///< result() at finish; for a refused request only failed and reason are set
  double latency_ms = 0; ///< admit() to the poll() that reported the finish
  int cycles = 0;        ///< cycles the request was polled for
};

/// Snapshot for a progress line.
struct ServeProgress {
  size_t served = 0, total = 0; ///< requests that left the engine / requests given
  int live = 0;                 ///< requests in the engine
  int bucket = 0;               ///< request slots the next cycle covers
  int64_t cycles = 0;           ///< cycles launched
  int64_t generated_tokens = 0; ///< result() tokens of the finished requests
  double elapsed_s = 0;
};

struct ServeOptions {
  bool compact = true;      ///< compact() when the live requests fit a smaller bucket than the current one
  bool keep_results = true; ///< keep every ServedRequest in ServeStats::served
  double progress_interval_s = 0.5;
  std::function<void(const ServeProgress&)> on_progress; ///< every progress_interval_s, and once at the end
  std::function<void(const RequestUpdate&)> on_update;   ///< every polled update (streaming to clients)
  std::function<void(const ServedRequest&)> on_finish;   ///< after result(), before release()
};

struct ServeStats {
  size_t requests = 0;                  ///< requests given
  size_t served = 0;                    ///< requests that finished (not failed)
  size_t failed = 0;                    ///< failed in a cycle or refused by admit()
  int64_t generated_tokens = 0;         ///< sum of result().tokens.size() over finished requests
  int64_t particle_tokens = 0;          ///< tokens committed over all particles (from poll())
  int64_t cycles = 0;                   ///< cycles launched
  int64_t request_cycles = 0;           ///< (request, cycle) pairs polled
  int64_t resampled_request_cycles = 0; ///< of those, how many resampled
  int64_t draft_steps = 0;              ///< K summed over the polled (request, cycle) pairs
  double acceptance_ema = 0;            ///< the device's acceptance EMA summed over them
  int compactions = 0;
  double seconds = 0;        ///< wall time of serve()
  double tokens_per_s = 0;   ///< generated_tokens / seconds
  double mean_occupancy = 0; ///< mean over cycles of live requests / bucket request slots
  double resample_rate = 0;  ///< resampled_request_cycles / request_cycles
  double latency_p50_ms = 0, latency_p95_ms = 0, latency_p99_ms = 0; ///< admit to finish, finished requests
  std::map<std::string, int> reasons;                                ///< finish / failure reason -> requests
  std::vector<ServedRequest> served_requests; ///< in finishing order (when keep_results)
};

/// Nearest-rank percentile (p in [0, 100]) of `values`; 0 when empty.
inline double percentile(std::vector<double> values, double p) {
  if (values.empty())
    return 0.0;
  std::sort(values.begin(), values.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(values.size()));
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(values.size()))) - 1;
  return values[index];
}

/// The smallest captured bucket that holds `live` requests.
inline int smallest_bucket_for(const Engine& engine, int live) {
  for (const BucketInfo& bucket : engine.buckets()) // ascending
    if (bucket.requests >= live)
      return bucket.requests;
  return engine.config().max_requests;
}

/// Serves `requests` with continuous batching and overlapped scheduling until every one has left the
/// engine, then returns the statistics. Requests are admitted in list order. A request admit() refuses
/// (prompt too long, token out of range) is reported as failed and the others go on; CUDA errors throw.
/// The engine must be idle (no cycle in flight, no request admitted) when serve() starts and is idle again
/// when it returns.
inline ServeStats serve(Engine& engine, const std::vector<ServeRequest>& requests,
                        const ServeOptions& options = {}) {
  using Clock = std::chrono::steady_clock;
  struct Running {
    size_t index = 0;
    Clock::time_point admitted;
    int cycles = 0;
  };

  const Clock::time_point start = Clock::now();
  auto seconds_since = [](Clock::time_point from) {
    return std::chrono::duration<double>(Clock::now() - from).count();
  };

  ServeStats stats;
  stats.requests = requests.size();
  std::unordered_map<RequestId, Running> running;
  std::vector<double> latencies_ms;
  double occupancy_sum = 0.0;
  size_t next_request = 0;
  int in_flight = 0; // cycles launched and not polled yet: 0, 1 or 2
  Clock::time_point last_progress = start;

  auto record = [&](ServedRequest&& done) {
    ++stats.reasons[done.result.reason];
    if (done.result.failed) {
      ++stats.failed;
    } else {
      ++stats.served;
      stats.generated_tokens += static_cast<int64_t>(done.result.tokens.size());
      latencies_ms.push_back(done.latency_ms);
    }
    if (options.on_finish)
      options.on_finish(done);
    if (options.keep_results)
      stats.served_requests.push_back(std::move(done));
  };

  // Continuous batching: fill every free request slot with the next waiting request.
  auto admit_waiting = [&] {
    while (next_request < requests.size() &&
           static_cast<int>(running.size()) < engine.config().max_requests) {
      const size_t index = next_request++;
      try {
        const RequestId id = engine.admit(requests[index].prompt, requests[index].params);
        running[id] = Running{index, Clock::now(), 0};
      } catch (const Error& refused) {
        if (refused.cuda_error() != cudaSuccess)
          throw; // a CUDA failure is not the request's fault
        ServedRequest done;
        done.index = index;
        done.result.failed = true;
        done.result.reason = refused.what();
        record(std::move(done));
      }
    }
    // Admission fills the lowest free slots first, so holes remain only once the queue runs dry.
    const int live = static_cast<int>(running.size());
    if (options.compact && live > 0 && engine.current_bucket() > smallest_bucket_for(engine, live)) {
      engine.compact();
      ++stats.compactions;
    }
  };

  // Queues one cycle for every request in the engine (none when the engine is empty).
  auto launch = [&] {
    const int bucket = engine.current_bucket();
    if (bucket == 0)
      return;
    occupancy_sum += static_cast<double>(engine.live_requests()) / bucket;
    engine.step();
    ++in_flight;
    ++stats.cycles;
  };

  auto report_progress = [&](bool force) {
    if (!options.on_progress)
      return;
    const Clock::time_point now = Clock::now();
    if (!force && std::chrono::duration<double>(now - last_progress).count() < options.progress_interval_s)
      return;
    last_progress = now;
    options.on_progress(ServeProgress{stats.served + stats.failed, requests.size(), engine.live_requests(),
                                      engine.current_bucket(), stats.cycles, stats.generated_tokens,
                                      seconds_since(start)});
  };

  admit_waiting();
  launch(); // cycle 0
  while (in_flight > 0) {
    launch(); // cycle t + 1 runs on the GPU while the host reads cycle t below
    const std::vector<RequestUpdate> updates = engine.poll(); // cycle t
    --in_flight;
    const Clock::time_point polled = Clock::now();

    std::vector<RequestId> done_ids;
    for (const RequestUpdate& update : updates) {
      auto it = running.find(update.id);
      if (it == running.end())
        continue; // not ours (cannot happen while the engine is ours alone)
      ++it->second.cycles;
      ++stats.request_cycles;
      stats.resampled_request_cycles += update.resampled ? 1 : 0;
      stats.draft_steps += update.draft_steps;
      stats.acceptance_ema += update.acceptance_ema;
      for (const std::vector<int32_t>& particle : update.tokens)
        stats.particle_tokens += static_cast<int64_t>(particle.size());
      if (options.on_update)
        options.on_update(update);
      if (update.finished || update.failed)
        done_ids.push_back(update.id);
    }
    for (RequestId id : done_ids) {
      const Running& request = running.at(id);
      ServedRequest done;
      done.index = request.index;
      done.id = id;
      done.result = engine.result(id); // synchronizes: waits for cycle t + 1 too
      done.latency_ms = std::chrono::duration<double, std::milli>(polled - request.admitted).count();
      done.cycles = request.cycles;
      record(std::move(done));
      engine.release(id); // stream-ordered after cycle t + 1, which still computed this request's rows
      running.erase(id);
    }
    admit_waiting(); // new requests join at cycle t + 2
    report_progress(false);
  }

  stats.seconds = seconds_since(start);
  stats.tokens_per_s = stats.seconds > 0 ? static_cast<double>(stats.generated_tokens) / stats.seconds : 0.0;
  stats.mean_occupancy = stats.cycles > 0 ? occupancy_sum / static_cast<double>(stats.cycles) : 0.0;
  stats.resample_rate = stats.request_cycles > 0 ? static_cast<double>(stats.resampled_request_cycles) /
                                                       static_cast<double>(stats.request_cycles)
                                                 : 0.0;
  stats.latency_p50_ms = percentile(latencies_ms, 50);
  stats.latency_p95_ms = percentile(latencies_ms, 95);
  stats.latency_p99_ms = percentile(latencies_ms, 99);
  report_progress(true);
  return stats;
}

} // namespace smcgraph::examples
