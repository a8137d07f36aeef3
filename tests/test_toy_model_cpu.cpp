// Toy model on the host: config validation (before any CUDA call), deterministic weights, and the
// reference's own consistency (incremental = batched forward, batch invariance, window semantics, clamps).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "reference/toy_model_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/toy_model.hpp"
#include "support/test_util.hpp"

using smcgraph::DType;
using smcgraph::Error;
using smcgraph::ToyModelConfig;
using smcgraph::reference::ToyBatchShape;
using smcgraph::reference::ToyForwardInputs;
using smcgraph::reference::ToyModelReference;

namespace {

ToyModelConfig small_config(uint64_t seed) {
  ToyModelConfig config;
  config.vocab = 1000;
  config.hidden = 32;
  config.window = 16;
  config.pool_size = 512;
  config.max_seq_len = 96;
  config.weight_seed = seed;
  return config;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> random_kv(const ToyModelConfig& config, smcgraph::test::Rng& rng) {
  std::vector<float> kv(static_cast<size_t>(config.pool_size) * config.hidden);
  for (float& x : kv)
    x = static_cast<float>(rng.uniform(-5.0, 5.0));
  return kv;
}

// Expects `action` to throw smcgraph::Error whose text names `parameter` and that is not a CUDA error.
template <class F> void check_rejects(F&& action, const std::string& parameter) {
  bool thrown = false;
  try {
    action();
  } catch (const Error& error) {
    thrown = true;
    const std::string text = error.what();
    INFO("error text: ", text);
    CHECK(text.find(parameter) != std::string::npos);
    CHECK(error.cuda_error() == cudaSuccess);
  }
  CHECK_MESSAGE(thrown, "expected an smcgraph::Error naming ", parameter);
}

} // namespace

TEST_CASE("toy model config validation names the parameter, before any CUDA call") {
  struct Case {
    const char* parameter;
    void (*mutate)(ToyModelConfig&);
  };
  const Case cases[] = {
      {"vocab", [](ToyModelConfig& c) { c.vocab = 0; }},
      {"vocab", [](ToyModelConfig& c) { c.vocab = -5; }},
      {"hidden", [](ToyModelConfig& c) { c.hidden = 0; }},
      {"hidden", [](ToyModelConfig& c) { c.hidden = -1; }},
      {"hidden", [](ToyModelConfig& c) { c.hidden = smcgraph::kToyMaxHidden + 1; }},
      {"window", [](ToyModelConfig& c) { c.window = 0; }},
      {"pool_size", [](ToyModelConfig& c) { c.pool_size = 1; }},
      {"max_seq_len", [](ToyModelConfig& c) { c.max_seq_len = 0; }},
      {"logits_dtype", [](ToyModelConfig& c) { c.logits_dtype = DType::kFloat16; }},
      {"logits_dtype", [](ToyModelConfig& c) { c.logits_dtype = static_cast<DType>(7); }},
      {"head_perturbation", [](ToyModelConfig& c) { c.head_perturbation = -0.1f; }},
      {"head_perturbation", [](ToyModelConfig& c) { c.head_perturbation = std::nanf(""); }},
      {"head_perturbation", [](ToyModelConfig& c) { c.head_perturbation = INFINITY; }},
  };
  for (const Case& c : cases) {
    ToyModelConfig config = small_config(1);
    c.mutate(config);
    CAPTURE(c.parameter);
    check_rejects([&] { smcgraph::validate_toy_model_config(config); }, c.parameter);
    check_rejects([&] { (void)smcgraph::make_toy_model_weights(config); }, c.parameter);
    check_rejects([&] { ToyModelReference reference(config); }, c.parameter);
    // The constructor validates before touching CUDA, so this is the validation error even without a GPU.
    check_rejects([&] { smcgraph::ToyModel model(config); }, c.parameter);
  }
  check_rejects([&] { (void)smcgraph::ToyModel::pair(small_config(1), -1.0f); }, "draft_perturbation");
  check_rejects([&] { (void)smcgraph::ToyModel::pair(small_config(1), NAN); }, "draft_perturbation");
  ToyModelConfig bad = small_config(1);
  bad.window = 0;
  check_rejects([&] { (void)smcgraph::ToyModel::pair(bad, 0.5f); }, "window");

  // Boundary values are accepted.
  ToyModelConfig edge = small_config(1);
  edge.vocab = 1;
  edge.hidden = 1;
  edge.window = 1;
  edge.pool_size = 2;
  edge.max_seq_len = 1;
  edge.logits_dtype = DType::kBFloat16;
  CHECK_NOTHROW(smcgraph::validate_toy_model_config(edge));
  edge.hidden = smcgraph::kToyMaxHidden;
  CHECK_NOTHROW(smcgraph::validate_toy_model_config(edge));
}

TEST_CASE("toy model weights are a deterministic function of the seed") {
  smcgraph::test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const uint64_t seed = rng.bits();
  const ToyModelConfig config = small_config(seed);
  const smcgraph::ToyModelWeights a = smcgraph::make_toy_model_weights(config);
  const smcgraph::ToyModelWeights b = smcgraph::make_toy_model_weights(config);
  REQUIRE(a.embedding.size() == 1000u * 32u);
  REQUIRE(a.position.size() == static_cast<size_t>(smcgraph::kToyPositionPeriod) * 32u);
  REQUIRE(a.head.size() == 1000u * 32u);
  REQUIRE(a.bias.size() == 1000u);
  CHECK(same_bits(a.embedding, b.embedding));
  CHECK(same_bits(a.position, b.position));
  CHECK(same_bits(a.head, b.head));
  CHECK(same_bits(a.bias, b.bias));

  // Element i depends on (seed, tensor, i) only: a larger vocabulary extends the tensors.
  ToyModelConfig wider = config;
  wider.vocab = 1500;
  const smcgraph::ToyModelWeights c = smcgraph::make_toy_model_weights(wider);
  CHECK(std::memcmp(a.embedding.data(), c.embedding.data(), a.embedding.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(a.head.data(), c.head.data(), a.head.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(a.bias.data(), c.bias.data(), a.bias.size() * sizeof(float)) == 0);
  CHECK(same_bits(a.position, c.position));

  // Another seed gives other weights; tensors are not copies of one another.
  ToyModelConfig other = config;
  other.weight_seed = seed ^ 1;
  const smcgraph::ToyModelWeights d = smcgraph::make_toy_model_weights(other);
  CHECK_FALSE(same_bits(a.embedding, d.embedding));
  CHECK_FALSE(same_bits(a.head, d.head));
  CHECK_FALSE(same_bits(a.bias, d.bias));
  CHECK(std::memcmp(a.embedding.data(), a.head.data(), 64 * sizeof(float)) != 0);

  // Documented ranges, and roughly centred uniforms.
  const double head_scale = 1.5 * std::sqrt(32.0 / config.hidden);
  auto check_range = [](const std::vector<float>& values, double scale) {
    double sum = 0.0, sum_sq = 0.0;
    bool inside = true;
    for (float x : values) {
      inside = inside && std::abs(x) <= scale;
      sum += x;
      sum_sq += static_cast<double>(x) * x;
    }
    const double n = static_cast<double>(values.size());
    CHECK(inside);
    CHECK(std::abs(sum / n) < 0.1 * scale);
    CHECK(std::abs(std::sqrt(sum_sq / n) - scale / std::sqrt(3.0)) < 0.1 * scale);
  };
  check_range(a.embedding, 4.0);
  check_range(a.position, 1.0);
  check_range(a.head, head_scale);
  check_range(a.bias, 1.0);
}

TEST_CASE("draft head = target head + perturbation * noise; everything else shared") {
  smcgraph::test::Rng rng;
  MESSAGE("seed ", rng.seed());
  ToyModelConfig config = small_config(rng.bits());
  const smcgraph::ToyModelWeights target = smcgraph::make_toy_model_weights(config);
  config.head_perturbation = 0.0f;
  CHECK(same_bits(smcgraph::make_toy_model_weights(config).head, target.head));

  const double head_scale = 1.5 * std::sqrt(32.0 / config.hidden);
  for (float perturbation : {0.01f, 0.3f, 2.0f}) {
    CAPTURE(perturbation);
    config.head_perturbation = perturbation;
    const smcgraph::ToyModelWeights draft = smcgraph::make_toy_model_weights(config);
    CHECK(same_bits(draft.embedding, target.embedding));
    CHECK(same_bits(draft.position, target.position));
    CHECK(same_bits(draft.bias, target.bias));
    size_t changed = 0;
    double max_delta = 0.0;
    for (size_t i = 0; i < draft.head.size(); ++i) {
      changed += draft.head[i] != target.head[i];
      max_delta = std::max(max_delta, std::abs(static_cast<double>(draft.head[i]) - target.head[i]));
    }
    CHECK(changed > draft.head.size() * 9 / 10);
    CHECK(max_delta <= perturbation * head_scale * (1.0 + 1e-6));
    CHECK(max_delta > 0.5 * perturbation * head_scale);
  }
}

TEST_CASE("toy reference: activations and logits follow the documented formula") {
  smcgraph::test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const ToyModelConfig config = small_config(rng.bits());
  const ToyModelReference reference(config);
  ToyBatchShape shape;
  shape.rows = 6;
  shape.tokens_per_row = 3;
  ToyForwardInputs in = smcgraph::reference::random_toy_inputs(config, shape, rng.engine());
  std::vector<float> kv = random_kv(config, rng);
  const std::vector<float> kv_before = kv;
  std::vector<float> logits(static_cast<size_t>(shape.rows) * shape.tokens_per_row * config.vocab, -123.0f);
  reference.forward(in, kv, logits);
  const auto& w = reference.weights();
  const int H = config.hidden;

  for (int row = 0; row < in.rows; ++row) {
    for (int j = 0; j < in.tokens_per_row; ++j) {
      const size_t token = static_cast<size_t>(row) * in.tokens_per_row + j;
      const float* l = logits.data() + token * config.vocab;
      if (!in.live[row]) {
        for (int v = 0; v < config.vocab; ++v)
          REQUIRE(l[v] == -123.0f); // padding: untouched
        continue;
      }
      // KV at the out slot: E[token] + P[position % 64], exactly.
      const int slot = in.out_slots[token];
      const int p = in.positions[token];
      for (int h = 0; h < H; ++h) {
        REQUIRE(kv[static_cast<size_t>(slot) * H + h] ==
                w.embedding[static_cast<size_t>(in.tokens[token]) * H + h] + w.position[(p % 64) * H + h]);
      }
      // Activations in double: g(mean over the window read through the slot table).
      const int first = std::max(0, p - config.window + 1);
      std::vector<double> g(H);
      for (int h = 0; h < H; ++h) {
        double sum = 0.0;
        for (int q = first; q <= p; ++q)
          sum += kv[static_cast<size_t>(in.slot_table[row * config.max_seq_len + q]) * H + h];
        const double mean = sum / (p - first + 1);
        g[h] = mean / (1.0 + std::abs(mean));
      }
      const std::vector<float> activations = reference.activations(in, kv, row, j);
      for (int h = 0; h < H; ++h)
        REQUIRE(smcgraph::test::close_to(activations[h], g[h], 1e-5));
      for (int v = 0; v < config.vocab; v += 37) {
        double expected = w.bias[v];
        for (int h = 0; h < H; ++h)
          expected += static_cast<double>(w.head[static_cast<size_t>(v) * H + h]) * g[h];
        REQUIRE(smcgraph::test::close_to(l[v], expected, 1e-4));
      }
    }
  }
  // Only live out slots changed.
  std::vector<uint8_t> written(config.pool_size, 0);
  for (int row = 0; row < in.rows; ++row)
    for (int j = 0; j < in.tokens_per_row; ++j)
      if (in.live[row])
        written[in.out_slots[static_cast<size_t>(row) * in.tokens_per_row + j]] = 1;
  for (int s = 0; s < config.pool_size; ++s) {
    if (written[s])
      continue;
    CHECK(std::memcmp(kv.data() + static_cast<size_t>(s) * H, kv_before.data() + static_cast<size_t>(s) * H,
                      H * sizeof(float)) == 0);
  }
}

TEST_CASE("toy reference: a multi-token forward equals one-token forwards in sequence") {
  smcgraph::test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const ToyModelConfig config = small_config(rng.bits());
  const ToyModelReference reference(config);
  ToyBatchShape shape;
  shape.rows = 4;
  shape.tokens_per_row = 5;
  shape.live_fraction = 1.0;
  // History slots apart from the written ones: the batched forward writes all KV before reading any.
  shape.history_slot_end = 200;
  shape.out_slot_begin = 200;
  const ToyForwardInputs batched = smcgraph::reference::random_toy_inputs(config, shape, rng.engine());
  const std::vector<float> kv0 = random_kv(config, rng);
  const size_t V = config.vocab;

  std::vector<float> kv_batched = kv0;
  std::vector<float> logits_batched(batched.rows * 5 * V);
  reference.forward(batched, kv_batched, logits_batched);

  std::vector<float> kv_step = kv0;
  for (int j = 0; j < 5; ++j) {
    ToyForwardInputs step = batched;
    step.tokens_per_row = 1;
    step.tokens.resize(batched.rows);
    step.positions.resize(batched.rows);
    step.out_slots.resize(batched.rows);
    for (int row = 0; row < batched.rows; ++row) {
      step.tokens[row] = batched.tokens[row * 5 + j];
      step.positions[row] = batched.positions[row * 5 + j];
      step.out_slots[row] = batched.out_slots[row * 5 + j];
      step.seq_lens[row] = batched.positions[row * 5 + j] + 1;
    }
    std::vector<float> logits_step(batched.rows * V);
    reference.forward(step, kv_step, logits_step);
    for (int row = 0; row < batched.rows; ++row) {
      CAPTURE(row);
      CAPTURE(j);
      CHECK(std::memcmp(logits_step.data() + row * V, logits_batched.data() + (row * 5 + j) * V,
                        V * sizeof(float)) == 0);
    }
  }
  CHECK(same_bits(kv_step, kv_batched));
}

TEST_CASE("toy reference: a row's logits do not depend on the other rows or its index") {
  smcgraph::test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const ToyModelConfig config = small_config(rng.bits());
  const ToyModelReference reference(config);
  const size_t V = config.vocab;
  // The lone row reads and writes slots [1, 100); the others write in [100, pool).
  ToyBatchShape lone_shape;
  lone_shape.tokens_per_row = 2;
  lone_shape.out_slot_end = 100;
  lone_shape.history_slot_end = 100;
  const ToyForwardInputs lone = smcgraph::reference::random_toy_inputs(config, lone_shape, rng.engine());
  ToyBatchShape crowd_shape = lone_shape;
  crowd_shape.rows = 12;
  crowd_shape.out_slot_begin = 100;
  crowd_shape.out_slot_end = 0;
  crowd_shape.history_slot_end = 0;
  ToyForwardInputs crowd = smcgraph::reference::random_toy_inputs(config, crowd_shape, rng.engine());
  const int index = 7;
  crowd.live[index] = 1;
  for (int j = 0; j < 2; ++j) {
    crowd.tokens[index * 2 + j] = lone.tokens[j];
    crowd.positions[index * 2 + j] = lone.positions[j];
    crowd.out_slots[index * 2 + j] = lone.out_slots[j];
  }
  crowd.seq_lens[index] = lone.seq_lens[0];
  std::copy(lone.slot_table.begin(), lone.slot_table.end(),
            crowd.slot_table.begin() + index * config.max_seq_len);

  const std::vector<float> kv0 = random_kv(config, rng);
  std::vector<float> kv_lone = kv0, kv_crowd = kv0;
  std::vector<float> logits_lone(2 * V), logits_crowd(crowd.rows * 2 * V);
  reference.forward(lone, kv_lone, logits_lone);
  reference.forward(crowd, kv_crowd, logits_crowd);
  CHECK(std::memcmp(logits_lone.data(), logits_crowd.data() + index * 2 * V, 2 * V * sizeof(float)) == 0);
}

TEST_CASE("toy reference: the window is read through the slot table") {
  smcgraph::test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const ToyModelConfig config = small_config(rng.bits());
  const ToyModelReference reference(config);
  const size_t V = config.vocab;
  ToyBatchShape shape;
  shape.tokens_per_row = 1;
  ToyForwardInputs in = smcgraph::reference::random_toy_inputs(config, shape, rng.engine());
  // Put the token far enough in that the window starts after position 0.
  const int p = config.window + 10;
  in.positions[0] = p;
  in.seq_lens[0] = p + 1;
  in.slot_table[p] = in.out_slots[0];
  for (int q = 0; q < p; ++q)
    in.slot_table[q] = static_cast<int32_t>(rng.integer(1, config.pool_size - 1));
  const std::vector<float> kv0 = random_kv(config, rng);
  auto logits_of = [&](const ToyForwardInputs& inputs) {
    std::vector<float> kv = kv0;
    std::vector<float> logits(V);
    reference.forward(inputs, kv, logits);
    return logits;
  };
  const std::vector<float> base = logits_of(in);
  auto with_slot = [&](int q, int32_t slot) {
    ToyForwardInputs changed = in;
    changed.slot_table[q] = slot;
    return changed;
  };
  auto other_slot = [&](int32_t slot) {
    return slot % (config.pool_size - 1) + 1;
  }; // != slot for slot in [1, pool)
  // Inside the window: another slot id changes the logits; an invalid id reads slot 0.
  CHECK_FALSE(same_bits(logits_of(with_slot(p - 3, other_slot(in.slot_table[p - 3]))), base));
  CHECK_FALSE(same_bits(
      logits_of(with_slot(p - config.window + 1, other_slot(in.slot_table[p - config.window + 1]))), base));
  CHECK(same_bits(logits_of(with_slot(p - 2, -7)), logits_of(with_slot(p - 2, 0))));
  CHECK(same_bits(logits_of(with_slot(p - 2, config.pool_size)), logits_of(with_slot(p - 2, 0))));
  // Outside the window (before it, or at or after seq_len): no effect.
  CHECK(
      same_bits(logits_of(with_slot(p - config.window, other_slot(in.slot_table[p - config.window]))), base));
  CHECK(same_bits(logits_of(with_slot(p + 1, 5)), base));
  // A shorter seq_len cuts the window: position p itself is no longer read.
  ToyForwardInputs shorter = in;
  shorter.seq_lens[0] = p;
  CHECK_FALSE(same_bits(logits_of(shorter), base));
  // seq_len 0: empty window, activations 0, logits = bias.
  ToyForwardInputs empty = in;
  empty.seq_lens[0] = 0;
  CHECK(same_bits(logits_of(empty), reference.weights().bias));
}

TEST_CASE("toy reference: out-of-range inputs are clamped as documented") {
  smcgraph::test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const ToyModelConfig config = small_config(rng.bits());
  const ToyModelReference reference(config);
  const size_t V = config.vocab;
  ToyBatchShape shape;
  shape.tokens_per_row = 1;
  ToyForwardInputs in = smcgraph::reference::random_toy_inputs(config, shape, rng.engine());
  const std::vector<float> kv0 = random_kv(config, rng);
  auto run = [&](const ToyForwardInputs& inputs, std::vector<float>& kv) {
    kv = kv0;
    std::vector<float> logits(V);
    reference.forward(inputs, kv, logits);
    return logits;
  };
  std::vector<float> kv_a, kv_b;
  // Token below 0 acts as token 0; above vocab - 1 as vocab - 1.
  ToyForwardInputs a = in, b = in;
  a.tokens[0] = -3;
  b.tokens[0] = 0;
  CHECK(same_bits(run(a, kv_a), run(b, kv_b)));
  CHECK(same_bits(kv_a, kv_b));
  a.tokens[0] = config.vocab + 9;
  b.tokens[0] = config.vocab - 1;
  CHECK(same_bits(run(a, kv_a), run(b, kv_b)));
  CHECK(same_bits(kv_a, kv_b));
  // Writes to slot 0 or out of range are dropped.
  for (int32_t slot : {0, -1, config.pool_size, config.pool_size + 77}) {
    a = in;
    a.out_slots[0] = slot;
    run(a, kv_a);
    CHECK(same_bits(kv_a, kv0));
  }
  // Positions clamp into [0, max_seq_len).
  a = in;
  b = in;
  a.positions[0] = config.max_seq_len + 40;
  b.positions[0] = config.max_seq_len - 1;
  a.seq_lens[0] = b.seq_lens[0] = config.max_seq_len;
  CHECK(same_bits(run(a, kv_a), run(b, kv_b)));
  CHECK(same_bits(kv_a, kv_b));
}

TEST_CASE("toy logits spread by a few units") {
  smcgraph::test::Rng rng;
  MESSAGE("seed ", rng.seed());
  ToyModelConfig config = small_config(rng.bits());
  config.vocab = 4000;
  for (int window : {1, 16}) {
    CAPTURE(window);
    config.window = window;
    const ToyModelReference ref(config);
    ToyBatchShape shape;
    shape.rows = 8;
    shape.live_fraction = 1.0;
    ToyForwardInputs in = smcgraph::reference::random_toy_inputs(config, shape, rng.engine());
    // KV as the model writes it: embeddings plus position terms.
    std::vector<float> kv(static_cast<size_t>(config.pool_size) * config.hidden);
    for (int s = 0; s < config.pool_size; ++s) {
      const size_t t = rng.integer(0, config.vocab - 1);
      for (int h = 0; h < config.hidden; ++h) {
        kv[static_cast<size_t>(s) * config.hidden + h] = ref.weights().embedding[t * config.hidden + h] +
                                                         ref.weights().position[(s % 64) * config.hidden + h];
      }
    }
    std::vector<float> logits(static_cast<size_t>(shape.rows) * config.vocab);
    ref.forward(in, kv, logits);
    for (int row = 0; row < shape.rows; ++row) {
      double sum = 0.0, sum_sq = 0.0;
      for (int v = 0; v < config.vocab; ++v) {
        const double x = logits[static_cast<size_t>(row) * config.vocab + v];
        sum += x;
        sum_sq += x * x;
      }
      const double mean = sum / config.vocab;
      const double stddev = std::sqrt(sum_sq / config.vocab - mean * mean);
      CAPTURE(stddev);
      CHECK(stddev > 0.7);
      CHECK(stddev < 6.0);
    }
  }
}
