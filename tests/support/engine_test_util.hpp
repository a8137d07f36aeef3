// Helpers the engine-level GPU suites share: random prompts, one synchronous cycle, the slot invariants.
#pragma once

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "runtime/slot_checker.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/model.hpp"
#include "smcgraph/slots.hpp"
#include "smcgraph/toy_model.hpp"
#include "support/test_util.hpp"

namespace smcgraph::test {

/// A prompt of 1 .. max_length tokens drawn uniformly from [0, vocab).
inline std::vector<int32_t> random_prompt(Rng& rng, int vocab, int max_length) {
  std::vector<int32_t> prompt(rng.integer(1, max_length));
  for (auto& t : prompt)
    t = static_cast<int32_t>(rng.integer(0, vocab - 1));
  return prompt;
}

/// A toy model sized for an engine config (vocabulary, KV pool, row length) with a suite's own weights.
inline ToyModelConfig toy_for(const EngineConfig& c, uint64_t weight_seed, int hidden = 32,
                              DType dtype = DType::kFloat32) {
  ToyModelConfig t;
  t.vocab = c.vocab;
  t.hidden = hidden;
  t.window = 16;
  t.pool_size = c.slot_pool_size;
  t.max_seq_len = c.max_seq_len;
  t.logits_dtype = dtype;
  t.weight_seed = weight_seed;
  return t;
}

/// Waits for the engine and checks its slot pool against its tables.
inline SlotCheck check_invariants(Engine& engine) {
  return check_engine_slots(engine);
}

/// A model that forwards to another; fault-injecting test models derive from it and add their fault after
/// the inner forward (calls() counts forwards, prefill included).
class ForwardingModel : public Model {
public:
  explicit ForwardingModel(Model& inner) : inner_(inner) {}
  void forward(const ForwardArgs& args, cudaStream_t stream) override {
    inner_.forward(args, stream);
    ++calls_;
  }
  int vocab() const override { return inner_.vocab(); }
  DType logits_dtype() const override { return inner_.logits_dtype(); }
  int max_seq_len() const override { return inner_.max_seq_len(); }
  int calls() const { return calls_; }

private:
  Model& inner_;
  int calls_ = 0;
};

/// Steps and polls one cycle (no overlap), returning its updates.
inline std::vector<RequestUpdate> cycle(Engine& engine) {
  engine.step();
  return engine.poll();
}

/// Every update of the cycles that run `ids` to their end (finished or failed), stepping and polling one
/// cycle at a time, at most `max_cycles` cycles; `done` says whether they all ended (callers check it and the
/// updates' `failed`).
struct CompletedRun {
  std::vector<RequestUpdate> updates;
  bool done = false;
};
inline CompletedRun run_to_completion(Engine& engine, const std::vector<RequestId>& ids, int max_cycles) {
  std::set<RequestId> open(ids.begin(), ids.end());
  CompletedRun run;
  for (int c = 0; c < max_cycles && !open.empty(); ++c) {
    for (RequestUpdate& update : cycle(engine)) {
      if (update.finished || update.failed)
        open.erase(update.id);
      run.updates.push_back(std::move(update));
    }
  }
  run.done = open.empty();
  return run;
}

} // namespace smcgraph::test
