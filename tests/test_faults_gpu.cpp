// The fault catalogue (device part): bad inputs and faults that need a GPU, each with its expected error
// text or flag, and where requests run alongside, their outputs compared with a clean run. The
// configuration faults are in test_engine_cpu.cpp and test_sample_cpu.cpp; sampler-level faults (NaN,
// +inf, all -inf rows, bad T / alpha) in test_sample_gpu.cpp; prompt / release / capacity errors in
// test_engine_gpu.cpp.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include "smcgraph/engine.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/toy_model.hpp"
#include "support/engine_test_util.hpp"
#include "support/test_util.hpp"

using namespace smcgraph;
namespace test = smcgraph::test;
using test::check_invariants;
using test::cycle;
using test::random_prompt;

namespace {

EngineConfig config_for(int particles, int max_requests) {
  EngineConfig c;
  c.vocab = 256;
  c.particles = particles;
  c.draft_steps = 4;
  c.max_requests = max_requests;
  c.max_seq_len = 128;
  c.slot_pool_size = 1 << 14;
  return c;
}

ToyModelConfig toy_for(const EngineConfig& c) {
  return test::toy_for(c, /*weight_seed=*/5, /*hidden=*/16);
}

/// A model wrapper that misbehaves on purpose.
class Saboteur final : public test::ForwardingModel {
public:
  enum class Act { kNone, kAllMasked, kAllocate, kThrow, kBadCopy };
  Saboteur(Model& inner, Act act, int from_call = 0)
      : ForwardingModel(inner), act_(act), from_call_(from_call) {
    const size_t count = static_cast<size_t>(64) * inner.vocab();
    std::vector<float> masked(count, -std::numeric_limits<float>::infinity());
    masked_ = test::to_device(masked, nullptr);
    SMCGRAPH_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void forward(const ForwardArgs& args, cudaStream_t stream) override {
    ForwardingModel::forward(args, stream);
    if (calls() <= from_call_)
      return;
    switch (act_) {
    case Act::kNone:
      break;
    case Act::kAllMasked: // row 0's logits all -inf (fp32 model), in cycle forwards only (not prefill)
      if (args.rows > 1)
        SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(args.logits, masked_.data(),
                                            sizeof(float) * args.tokens_per_row * vocab(),
                                            cudaMemcpyDeviceToDevice, stream));
      break;
    case Act::kAllocate: {
      void* scratch = nullptr;
      SMCGRAPH_CUDA_CHECK(cudaMalloc(&scratch, 1 << 20));
      cudaFree(scratch);
      break;
    }
    case Act::kThrow:
      throw std::runtime_error("saboteur: forward refused");
    case Act::kBadCopy: // an invalid copy: the CUDA call fails at once
      SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(args.logits, reinterpret_cast<const void*>(0x10), 1 << 30,
                                          cudaMemcpyDeviceToDevice, stream));
      break;
    }
  }

private:
  Act act_;
  int from_call_;
  DeviceBuffer<float> masked_;
};

} // namespace

TEST_CASE("fault: temperatures and seeds at their edges") {
  const EngineConfig config = config_for(4, 4);
  ToyModelPair models = ToyModel::pair(toy_for(config), 0.3f);
  Engine engine(config, *models.draft, *models.target);
  const RequestId greedy = engine.admit({1, 2, 3}, {.seed = 0, .target_temperature = 0.0f});
  const RequestId hot =
      engine.admit({1, 2, 3}, {.seed = UINT64_MAX, .draft_temperature = 1e30f, .target_temperature = 1e30f});
  const RequestId low_seed = engine.admit({4, 5}, {.seed = 0});
  const RequestId high_seed = engine.admit({4, 5}, {.seed = UINT64_MAX});
  for (int c = 0; c < 5; ++c) {
    for (const RequestUpdate& update : cycle(engine)) {
      CHECK_FALSE(update.failed); // T = 0 (greedy target), huge T and seeds 0 / 2^64 - 1 are all legal
      for (const auto& tokens : update.tokens)
        for (int32_t t : tokens)
          CHECK((t >= 0 && t < config.vocab));
    }
  }
  CHECK(engine.result(low_seed).particles != engine.result(high_seed).particles);
  (void)greedy;
  (void)hot;
  CHECK_THROWS_WITH_AS(engine.admit({1}, {.alpha = 0.0f}), doctest::Contains("params.alpha = 0"), Error);
  CHECK_THROWS_WITH_AS(engine.admit({1}, {.draft_temperature = 0.0f}),
                       doctest::Contains("params.draft_temperature = 0"), Error);
  CHECK_THROWS_WITH_AS(engine.admit({1}, {.max_new_tokens = 0}),
                       doctest::Contains("params.max_new_tokens = 0"), Error);
}

TEST_CASE("fault: a row reaching max_seq_len finishes its request with that reason") {
  EngineConfig config = config_for(2, 2);
  config.max_seq_len = 40;
  ToyModelPair models = ToyModel::pair(toy_for(config), 0.3f);
  Engine engine(config, *models.draft, *models.target);
  const RequestId id = engine.admit(std::vector<int32_t>(10, 3));
  bool finished = false;
  for (int c = 0; c < 20 && !finished; ++c)
    for (const RequestUpdate& update : cycle(engine))
      if (update.id == id && update.finished) {
        CHECK(update.reason == "max sequence length");
        finished = true;
      }
  CHECK(finished);
  const RequestResult result = engine.result(id);
  CHECK(result.tokens.size() <= static_cast<size_t>(config.max_seq_len - 10));
  engine.release(id);
  CHECK(check_invariants(engine).free == config.slot_pool_size - 1);
}

TEST_CASE("fault: a model producing all -inf logits fails the affected request only") {
  const EngineConfig config = config_for(1, 2);
  ToyModelPair models = ToyModel::pair(toy_for(config), 0.3f);
  Saboteur masked(*models.target, Saboteur::Act::kAllMasked, 2); // after both prefills
  Engine engine(config, *models.draft, masked);
  const RequestId a = engine.admit({1, 2, 3}, {.seed = 1});
  const RequestId b = engine.admit({1, 2, 3}, {.seed = 2});
  bool a_failed = false, b_ok = true;
  for (int c = 0; c < 3; ++c)
    for (const RequestUpdate& update : cycle(engine)) {
      if (update.id == a && update.failed) {
        CHECK(update.reason.find("all logits -inf") != std::string::npos);
        a_failed = true;
      }
      if (update.id == b && update.failed)
        b_ok = false;
    }
  CHECK(a_failed);
  CHECK(b_ok);
}

TEST_CASE("fault: a model that allocates during capture fails the capture, naming the step") {
  const EngineConfig config = config_for(2, 2);
  ToyModelPair models = ToyModel::pair(toy_for(config), 0.3f);
  Saboteur allocating(*models.target, Saboteur::Act::kAllocate);
  CHECK_THROWS_WITH_AS(Engine(config, *models.draft, allocating),
                       doctest::Contains("capture of bucket 2 failed at step smc.verify"), Error);
}

TEST_CASE("fault: a model forward that throws") {
  const EngineConfig config = config_for(2, 2);
  ToyModelPair models = ToyModel::pair(toy_for(config), 0.3f);
  {
    // The eager warm-up makes K = 4 draft calls; the first capture's draft head throws.
    Saboteur thrower(*models.draft, Saboteur::Act::kThrow, 4);
    CHECK_THROWS_WITH_AS(Engine(config, thrower, *models.target),
                         doctest::Contains("failed at step smc.draft: exception: saboteur: forward refused"),
                         Error);
  }
  {
    Saboteur thrower(*models.draft, Saboteur::Act::kThrow, 0); // throws during the eager warm-up
    CHECK_THROWS_WITH_AS(Engine(config, thrower, *models.target),
                         doctest::Contains("warm-up failed at step smc.draft: saboteur: forward refused"),
                         Error);
  }
  {
    EngineConfig eager = config;
    eager.use_graphs = false;
    Saboteur thrower(*models.draft, Saboteur::Act::kThrow, 5); // warm-up (4) and the admission prefill pass
    Engine engine(eager, thrower, *models.target);
    engine.admit({1, 2});
    CHECK_THROWS_WITH_AS(engine.step(), doctest::Contains("saboteur: forward refused"), std::runtime_error);
  } // destroyed with a request live: no hang, no error
}

TEST_CASE("fault: a failing CUDA call inside the cycle gives a clear error, and the engine stays usable") {
  EngineConfig config = config_for(1, 1);
  config.use_graphs = false;
  ToyModelPair models = ToyModel::pair(toy_for(config), 0.3f);
  Saboteur bad(*models.target, Saboteur::Act::kBadCopy, 2);
  Engine engine(config, *models.draft, bad);
  engine.admit({1, 2});
  CHECK_THROWS_WITH_AS(engine.step(), doctest::Contains("CUDA error in cudaMemcpyAsync"), Error);
  CHECK_THROWS_AS(engine.step(), Error); // the same clear error again, no hang
  engine.synchronize();                  // the stream itself is healthy
}

TEST_CASE("device_memory_stats counts smcgraph's own buffers, exactly and once") {
  // Relative to a snapshot: the counters are process-wide and other tests' objects may still be alive.
  const DeviceMemoryStats start = device_memory_stats();
  {
    DeviceBuffer<float> a(1000);
    DeviceBuffer<uint8_t> empty(0); // no allocation
    PinnedBuffer<int32_t> pinned(77);
    const DeviceMemoryStats held = device_memory_stats();
    CHECK(held.device_allocations == start.device_allocations + 1);
    CHECK(held.device_bytes == start.device_bytes + 4000);
    CHECK(held.peak_device_bytes >= held.device_bytes);
    CHECK(held.pinned_allocations == start.pinned_allocations + 1);
    CHECK(held.pinned_bytes == start.pinned_bytes + 77 * 4);
    DeviceBuffer<float> moved(std::move(a)); // a move hands the allocation over: still one
    DeviceBuffer<float> assigned(10);
    assigned = std::move(moved); // the 10 floats are freed, the 1000 move in
    const DeviceMemoryStats after_moves = device_memory_stats();
    CHECK(after_moves.device_allocations == start.device_allocations + 1);
    CHECK(after_moves.device_bytes == start.device_bytes + 4000);
    SampleWorkspace workspace(8, 1000); // library objects that allocate count too
    CHECK(device_memory_stats().device_bytes ==
          start.device_bytes + 4000 + static_cast<int64_t>(workspace.bytes()));
  }
  const DeviceMemoryStats end = device_memory_stats();
  CHECK(end.device_allocations == start.device_allocations);
  CHECK(end.device_bytes == start.device_bytes);
  CHECK(end.pinned_allocations == start.pinned_allocations);
  CHECK(end.pinned_bytes == start.pinned_bytes);
}

TEST_CASE("fault: destroying the engine with requests live leaks nothing") {
  // Counted with smcgraph's own allocation counters (device_memory_stats), not cudaMemGetInfo: other
  // processes on the same GPU (meson runs suites in parallel) move the device's free memory at any time.
  // Graphs and module loading are CUDA's own memory; compute-sanitizer's --leak-check full (memcheck setup)
  // reports any cudaMalloc without its cudaFree.
  const EngineConfig config = config_for(4, 4);
  ToyModelPair models = ToyModel::pair(toy_for(config), 0.3f);
  const DeviceMemoryStats before = device_memory_stats();
  for (int round = 0; round < 3; ++round) {
    EngineConfig round_config = config;
    round_config.use_graphs = round != 1; // graphed, eager, graphed
    Engine engine(round_config, *models.draft, *models.target);
    for (int i = 0; i < 4; ++i)
      engine.admit({1, 2, 3, static_cast<int32_t>(i)}, {.seed = static_cast<uint64_t>(i)});
    engine.step();
    engine.step(); // two cycles in flight at destruction
    const DeviceMemoryStats during = device_memory_stats();
    CHECK(during.device_bytes - before.device_bytes >= static_cast<int64_t>(engine.device_bytes()));
    CHECK(during.pinned_allocations > before.pinned_allocations); // the engine's pinned output buffers
  }
  const DeviceMemoryStats after = device_memory_stats();
  CHECK(after.device_allocations == before.device_allocations);
  CHECK(after.device_bytes == before.device_bytes);
  CHECK(after.pinned_allocations == before.pinned_allocations);
  CHECK(after.pinned_bytes == before.pinned_bytes);
}

TEST_CASE(
    "fault: slot pool exhausted mid-cycle starves the later request; the earlier one matches a clean run") {
  EngineConfig config = config_for(2, 2);
  const std::vector<int32_t> prompt_a = {7, 8, 9, 10}, prompt_b = {11, 12, 13};
  auto run = [&](int pool_size, std::string* starved_reason) {
    EngineConfig c = config;
    c.slot_pool_size = pool_size;
    ToyModelConfig toy = toy_for(c);
    ToyModelPair models = ToyModel::pair(toy, 0.3f);
    Engine engine(c, *models.draft, *models.target);
    const RequestId a = engine.admit(prompt_a, {.seed = 11});
    const RequestId b = engine.admit(prompt_b, {.seed = 12});
    std::vector<std::vector<std::vector<int32_t>>> a_tokens;
    for (int cycle_index = 0; cycle_index < 5; ++cycle_index) {
      for (const RequestUpdate& update : cycle(engine)) {
        if (update.id == a) {
          CHECK_FALSE(update.failed);
          a_tokens.push_back(update.tokens);
        }
        if (update.id == b && update.failed && starved_reason) {
          *starved_reason = update.reason;
          engine.release(b);
        }
      }
    }
    CHECK(check_invariants(engine).ok);
    return a_tokens;
  };
  // 59 usable slots; admission takes (4 + 1) + (3 + 1); each cycle 2 rows x 5 per request (N = 2 and
  // tau = 0.5 never resample: ESS >= 1). Cycle 3 serves a with the last 10 slots and starves b; releasing b
  // returns 25, enough for a's cycles 4 and 5.
  std::string reason;
  const auto pressured = run(60, &reason);
  const auto clean = run(1 << 14, nullptr);
  CHECK(reason.find("slot pool exhausted") != std::string::npos);
  CHECK(pressured == clean);
}
