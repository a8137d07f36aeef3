// The fault catalogue's last entry, in a process of its own: a model whose forward faults on the device
// (a trap: a sticky error that poisons the CUDA context for the rest of the process). The engine reports
// it as a clear smcgraph::Error from every later call instead of hanging or exiting, each message saying
// that the context is unusable (destroy the engine, restart the process), and it can be destroyed with the
// request still live.
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/toy_model.hpp"
#include "support/engine_test_util.hpp"
#include "support/fault_kernels.hpp"

using namespace smcgraph;

namespace {

/// Forwards to the inner model, then from call `from_call` on enqueues a trapping kernel.
class TrappingModel final : public test::ForwardingModel {
public:
  TrappingModel(Model& inner, int from_call) : ForwardingModel(inner), from_call_(from_call) {}
  void forward(const ForwardArgs& args, cudaStream_t stream) override {
    ForwardingModel::forward(args, stream);
    if (calls() > from_call_)
      test::launch_device_trap(stream);
  }

private:
  int from_call_;
};

bool names_the_fault(const std::string& what) {
  return what.find("CUDA error") != std::string::npos &&
         (what.find("cudaErrorLaunchFailure") != std::string::npos ||
          what.find("unspecified launch failure") != std::string::npos);
}

/// The error says what a host engine must do now (README, "After a sticky CUDA error").
bool says_restart(const std::string& what) {
  return what.find(kStickyErrorNote) != std::string::npos;
}

} // namespace

TEST_CASE("fault: using the engine after a device fault (sticky CUDA error) gives clear errors, no hang") {
  EngineConfig config;
  config.vocab = 256;
  config.particles = 2;
  config.draft_steps = 4;
  config.max_requests = 2;
  config.max_seq_len = 128;
  config.slot_pool_size = 1 << 12;
  config.use_graphs = false; // the trap must run after admission, not during the construction warm-up
  ToyModelConfig toy;
  toy.vocab = config.vocab;
  toy.hidden = 16;
  toy.pool_size = config.slot_pool_size;
  toy.max_seq_len = config.max_seq_len;
  auto models = std::make_unique<ToyModelPair>(ToyModel::pair(toy, 0.3f));
  TrappingModel target(*models->target, /*from_call=*/1); // call 0: the prompt's prefill
  auto engine = std::make_unique<Engine>(config, *models->draft, target);
  const RequestId id = engine->admit({1, 2, 3}, {.seed = 9});
  const auto start = std::chrono::steady_clock::now();

  // The cycle's verify forward traps. The launch itself may succeed; the fault surfaces at the latest when
  // the cycle's outputs are read.
  std::string first_error;
  cudaError_t first_code = cudaSuccess;
  try {
    engine->step();
    engine->poll();
  } catch (const Error& e) {
    first_error = e.what();
    first_code = e.cuda_error();
  }
  MESSAGE("first error: " << first_error);
  CHECK(names_the_fault(first_error));
  CHECK(is_sticky(first_code));
  CHECK(says_restart(first_error));
  // Every later use reports the same fault as an Error that says the context is gone.
  const auto sticky = doctest::Contains(kStickyErrorNote);
  CHECK_THROWS_WITH_AS(engine->step(), sticky, Error);
  CHECK_THROWS_WITH_AS(engine->poll(), sticky, Error);
  CHECK_THROWS_WITH_AS(engine->result(id), sticky, Error);
  CHECK_THROWS_WITH_AS(engine->synchronize(), sticky, Error);
  CHECK_THROWS_WITH_AS(engine->admit({4, 5}), sticky, Error);
  // A new engine on the poisoned context fails to construct with the same clear error.
  try {
    Engine another(config, *models->draft, *models->target);
    FAIL("an engine was constructed on a faulted context");
  } catch (const Error& e) {
    CHECK(names_the_fault(e.what()));
    CHECK(says_restart(e.what()));
    CHECK(is_sticky(e.cuda_error()));
  }
  // Destroyed with the request live: no throw, no hang.
  CHECK_NOTHROW(engine.reset());
  CHECK_NOTHROW(models.reset());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(seconds < 30.0);
}
