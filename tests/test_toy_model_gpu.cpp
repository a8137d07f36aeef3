// ToyModel on the GPU against the bit-exact host reference (tests/reference/toy_model_ref), eagerly and
// inside captured graphs, on fresh random inputs with poisoned logits.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "reference/toy_model_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/toy_model.hpp"
#include "support/test_util.hpp"

using smcgraph::DeviceBuffer;
using smcgraph::DType;
using smcgraph::ForwardArgs;
using smcgraph::Stream;
using smcgraph::ToyModel;
using smcgraph::ToyModelConfig;
using smcgraph::reference::ToyBatchShape;
using smcgraph::reference::ToyForwardInputs;
using smcgraph::reference::ToyModelReference;
namespace test = smcgraph::test;

namespace {

constexpr uint8_t kPoison = 0xff; // NaN in fp32 and in bf16

ToyModelConfig make_config(int vocab, DType dtype, uint64_t seed) {
  ToyModelConfig config;
  config.vocab = vocab;
  config.hidden = 32;
  config.window = 16;
  config.pool_size = 4096;
  config.max_seq_len = 96; // > 64: positions wrap the position table
  config.logits_dtype = dtype;
  config.weight_seed = seed;
  return config;
}

std::vector<float> random_kv(const ToyModelConfig& config, test::Rng& rng) {
  std::vector<float> kv(static_cast<size_t>(config.pool_size) * config.hidden);
  for (float& x : kv)
    x = static_cast<float>(rng.uniform(-5.0, 5.0));
  return kv;
}

ToyForwardInputs random_inputs(const ToyModelConfig& config, test::Rng& rng, int rows, int tokens_per_row,
                               double live_fraction = 0.75, double invalid_fraction = 0.0) {
  ToyBatchShape shape;
  shape.rows = rows;
  shape.tokens_per_row = tokens_per_row;
  shape.live_fraction = live_fraction;
  shape.invalid_fraction = invalid_fraction;
  return smcgraph::reference::random_toy_inputs(config, shape, rng.engine());
}

/// Device copies of a batch's inputs and a logits buffer; args() points at them.
struct DeviceBatch {
  int rows = 0;
  int tokens_per_row = 0;
  DeviceBuffer<int32_t> tokens, positions, slot_table, seq_lens, out_slots;
  DeviceBuffer<uint8_t> live, logits;

  DeviceBatch(const ToyForwardInputs& in, int vocab, DType dtype, cudaStream_t stream)
      : rows(in.rows), tokens_per_row(in.tokens_per_row), tokens(test::to_device(in.tokens, stream)),
        positions(test::to_device(in.positions, stream)), slot_table(test::to_device(in.slot_table, stream)),
        seq_lens(test::to_device(in.seq_lens, stream)), out_slots(test::to_device(in.out_slots, stream)),
        live(test::to_device(in.live, stream)),
        logits(static_cast<size_t>(in.rows) * in.tokens_per_row * vocab * smcgraph::dtype_bytes(dtype)) {}

  /// New values behind the same pointers (same shapes), as a cycle does between replays.
  void upload(const ToyForwardInputs& in, cudaStream_t stream) {
    REQUIRE(in.rows == rows);
    REQUIRE(in.tokens_per_row == tokens_per_row);
    tokens.copy_from_host(in.tokens.data(), in.tokens.size(), stream);
    positions.copy_from_host(in.positions.data(), in.positions.size(), stream);
    slot_table.copy_from_host(in.slot_table.data(), in.slot_table.size(), stream);
    seq_lens.copy_from_host(in.seq_lens.data(), in.seq_lens.size(), stream);
    out_slots.copy_from_host(in.out_slots.data(), in.out_slots.size(), stream);
    live.copy_from_host(in.live.data(), in.live.size(), stream);
  }

  ForwardArgs args() {
    ForwardArgs args;
    args.rows = rows;
    args.tokens_per_row = tokens_per_row;
    args.tokens = tokens.data();
    args.positions = positions.data();
    args.slot_table = slot_table.data();
    args.seq_lens = seq_lens.data();
    args.out_slots = out_slots.data();
    args.live = live.data();
    args.logits = logits.data();
    return args;
  }

  std::vector<uint8_t> download(cudaStream_t stream) const {
    return test::to_host(logits.data(), logits.size(), stream);
  }
};

void upload_kv(ToyModel& model, const std::vector<float>& kv, cudaStream_t stream) {
  REQUIRE(kv.size() == static_cast<size_t>(model.pool_size()) * model.hidden());
  SMCGRAPH_CUDA_CHECK(
      cudaMemcpyAsync(model.kv_data(), kv.data(), kv.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
}

std::vector<float> download_kv(const ToyModel& model, cudaStream_t stream) {
  return test::to_host(model.kv_data(), static_cast<size_t>(model.pool_size()) * model.hidden(), stream);
}

/// KV <- kv0, logits <- poison, then one forward (eagerly, or captured into a graph and replayed once).
void run_forward(ToyModel& model, DeviceBatch& batch, const std::vector<float>& kv0, bool captured,
                 cudaStream_t stream) {
  upload_kv(model, kv0, stream);
  batch.logits.fill_bytes(kPoison, stream);
  const ForwardArgs args = batch.args();
  test::run_on_stream(captured, stream, [&](cudaStream_t s) { model.forward(args, s); });
}

void encode_logit(DType dtype, float value, uint8_t* out) {
  if (dtype == DType::kFloat32) {
    std::memcpy(out, &value, 4);
  } else {
    const uint16_t bits = test::float_to_bf16(value); // round to nearest even, like __float2bfloat16_rn
    std::memcpy(out, &bits, 2);
  }
}

/// The bytes the device must produce: reference logits of live rows in `dtype`, poison for padding rows.
std::vector<uint8_t> expected_bytes(const ToyForwardInputs& in, const std::vector<float>& logits, int vocab,
                                    DType dtype) {
  const size_t element = smcgraph::dtype_bytes(dtype);
  std::vector<uint8_t> bytes(logits.size() * element, kPoison);
  for (int row = 0; row < in.rows; ++row) {
    if (!in.live[row])
      continue;
    const size_t begin = static_cast<size_t>(row) * in.tokens_per_row * vocab;
    const size_t end = begin + static_cast<size_t>(in.tokens_per_row) * vocab;
    for (size_t i = begin; i < end; ++i)
      encode_logit(dtype, logits[i], bytes.data() + i * element);
  }
  return bytes;
}

/// "1.25 (0x3fa00000)": the value and its bits, so a one-ulp difference shows.
std::string describe(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  char text[64];
  std::snprintf(text, sizeof(text), "%.9g (0x%08x)", value, bits);
  return text;
}

float decode_logit(DType dtype, const uint8_t* bytes) {
  if (dtype == DType::kFloat32) {
    float value;
    std::memcpy(&value, bytes, 4);
    return value;
  }
  uint16_t bits;
  std::memcpy(&bits, bytes, 2);
  return test::bf16_to_float(bits);
}

/// Empty when `got` == `want` byte for byte; otherwise the number of differing logits and the first one.
std::string logits_difference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, DType dtype,
                              int tokens_per_row, int vocab) {
  if (got.size() != want.size()) {
    return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  }
  const size_t element = smcgraph::dtype_bytes(dtype);
  size_t differing = 0, first = 0;
  for (size_t i = 0; i < got.size() / element; ++i) {
    if (std::memcmp(got.data() + i * element, want.data() + i * element, element) != 0) {
      if (differing++ == 0)
        first = i;
    }
  }
  if (differing == 0)
    return {};
  const size_t per_row = static_cast<size_t>(tokens_per_row) * vocab;
  return std::to_string(differing) + " logits differ; first at row " + std::to_string(first / per_row) +
         ", token " + std::to_string(first % per_row / vocab) + ", v " + std::to_string(first % vocab) +
         ": got " + describe(decode_logit(dtype, got.data() + first * element)) + ", want " +
         describe(decode_logit(dtype, want.data() + first * element));
}

/// Empty when the KV arrays are bitwise equal; otherwise the first differing (slot, h).
std::string kv_difference(const std::vector<float>& got, const std::vector<float>& want, int hidden) {
  if (got.size() != want.size())
    return "kv size differs";
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      return "kv differs at slot " + std::to_string(i / hidden) + ", h " + std::to_string(i % hidden) +
             ": got " + describe(got[i]) + ", want " + describe(want[i]);
    }
  }
  return {};
}

/// Runs the reference on (in, kv0) and returns the expected logit bytes and the expected KV.
struct Expected {
  std::vector<uint8_t> logits;
  std::vector<float> kv;
};
Expected expect(const ToyModelReference& reference, const ToyForwardInputs& in, const std::vector<float>& kv0,
                DType dtype) {
  const int vocab = reference.config().vocab;
  Expected expected;
  expected.kv = kv0;
  std::vector<float> logits(static_cast<size_t>(in.rows) * in.tokens_per_row * vocab, 0.0f);
  reference.forward(in, expected.kv, logits);
  expected.logits = expected_bytes(in, logits, vocab, dtype);
  return expected;
}

/// Copies row `source_row` of `source` over row `row` of `target` (same tokens_per_row and max_seq_len).
void place_row(const ToyForwardInputs& source, int source_row, ToyForwardInputs& target, int row,
               int max_seq_len) {
  const int per_row = source.tokens_per_row;
  for (int j = 0; j < per_row; ++j) {
    target.tokens[row * per_row + j] = source.tokens[source_row * per_row + j];
    target.positions[row * per_row + j] = source.positions[source_row * per_row + j];
    target.out_slots[row * per_row + j] = source.out_slots[source_row * per_row + j];
  }
  target.seq_lens[row] = source.seq_lens[source_row];
  target.live[row] = source.live[source_row];
  std::copy_n(source.slot_table.begin() + static_cast<size_t>(source_row) * max_seq_len, max_seq_len,
              target.slot_table.begin() + static_cast<size_t>(row) * max_seq_len);
}

std::vector<uint8_t> slice(const std::vector<uint8_t>& bytes, size_t begin, size_t count) {
  return std::vector<uint8_t>(bytes.begin() + begin, bytes.begin() + begin + count);
}

} // namespace

TEST_CASE("toy model forward equals the host reference bit for bit, eagerly and in a graph") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  const uint64_t weight_seed = rng.bits();
  for (int vocab : {7, 1000, 32000}) {
    const ToyModelConfig config_fp32 = make_config(vocab, DType::kFloat32, weight_seed);
    const ToyModelConfig config_bf16 = make_config(vocab, DType::kBFloat16, weight_seed);
    ToyModel model_fp32(config_fp32);
    ToyModel model_bf16(config_bf16);
    const ToyModelReference reference(config_fp32); // the logits dtype plays no part in the float logits
    for (int rows : {1, 3, 64}) {
      for (int per_row : {1, 2, 5}) {
        // A few out-of-range tokens, positions, slots and lengths exercise the documented clamps.
        const ToyForwardInputs in = random_inputs(config_fp32, rng, rows, per_row, 0.75, 0.03);
        const std::vector<float> kv0 = random_kv(config_fp32, rng);
        std::vector<float> kv_expected = kv0;
        std::vector<float> logits(static_cast<size_t>(rows) * per_row * vocab, 0.0f);
        reference.forward(in, kv_expected, logits);
        for (ToyModel* model : {&model_fp32, &model_bf16}) {
          const DType dtype = model->logits_dtype();
          const char* dtype_text = smcgraph::dtype_name(dtype);
          const std::vector<uint8_t> want = expected_bytes(in, logits, vocab, dtype);
          DeviceBatch batch(in, vocab, dtype, stream);
          for (bool captured : {false, true}) {
            CAPTURE(vocab);
            CAPTURE(rows);
            CAPTURE(per_row);
            CAPTURE(dtype_text);
            CAPTURE(captured);
            run_forward(*model, batch, kv0, captured, stream);
            const std::string logits_diff =
                logits_difference(batch.download(stream), want, dtype, per_row, vocab);
            CHECK_MESSAGE(logits_diff.empty(), logits_diff);
            const std::string kv_diff =
                kv_difference(download_kv(*model, stream), kv_expected, config_fp32.hidden);
            CHECK_MESSAGE(kv_diff.empty(), kv_diff);
          }
        }
      }
    }
  }
}

TEST_CASE("toy model: last_token_logits gives each row's last-token logits of the reference and writes "
          "nothing else") {
  // The engine's draft head samples from its last column only: the LM head then runs over rows, not
  // rows x tokens_per_row, tokens and writes a dense [rows, V]; the KV of every token is written as before.
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  const uint64_t weight_seed = rng.bits();
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const ToyModelConfig config = make_config(1000, dtype, weight_seed);
    ToyModel model(config);
    REQUIRE(model.last_token_logits_supported());
    const ToyModelReference reference(config);
    const int vocab = config.vocab;
    const size_t element = smcgraph::dtype_bytes(dtype);
    for (int rows : {1, 3, 64}) {
      for (int per_row : {1, 2, 5}) {
        const ToyForwardInputs in = random_inputs(config, rng, rows, per_row, 0.75, 0.03);
        const std::vector<float> kv0 = random_kv(config, rng);
        std::vector<float> kv_expected = kv0;
        std::vector<float> logits(static_cast<size_t>(rows) * per_row * vocab, 0.0f);
        reference.forward(in, kv_expected, logits);
        // Row r's last token's reference logits at row r; poison for padding rows and everything past rows.
        std::vector<uint8_t> want(static_cast<size_t>(rows) * per_row * vocab * element, kPoison);
        for (int row = 0; row < rows; ++row)
          if (in.live[row])
            for (int v = 0; v < vocab; ++v)
              encode_logit(dtype, logits[(static_cast<size_t>(row) * per_row + per_row - 1) * vocab + v],
                           want.data() + (static_cast<size_t>(row) * vocab + v) * element);
        DeviceBatch batch(in, vocab, dtype, stream);
        for (bool captured : {false, true}) {
          CAPTURE(rows);
          CAPTURE(per_row);
          CAPTURE(captured);
          upload_kv(model, kv0, stream);
          batch.logits.fill_bytes(kPoison, stream);
          ForwardArgs args = batch.args();
          args.last_token_logits = true;
          test::run_on_stream(captured, stream, [&](cudaStream_t st) { model.forward(args, st); });
          const std::string logits_diff = logits_difference(batch.download(stream), want, dtype, 1, vocab);
          CHECK_MESSAGE(logits_diff.empty(), logits_diff);
          const std::string kv_diff = kv_difference(download_kv(model, stream), kv_expected, config.hidden);
          CHECK_MESSAGE(kv_diff.empty(), kv_diff);
        }
      }
    }
  }
}

TEST_CASE("toy model: odd shapes (partial hidden chunk, long window, unaligned or tiny vocabulary)") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  struct Shape {
    int vocab, hidden, window, max_seq_len;
  };
  const Shape shapes[] = {
      {1, 1, 1, 8}, {257, 20, 5, 40}, {1001, 48, 40, 128}, {130, 17, 100, 300}, {4099, 256, 16, 64}};
  for (const Shape& shape : shapes) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      ToyModelConfig config = make_config(shape.vocab, dtype, rng.bits());
      config.hidden = shape.hidden;
      config.window = shape.window;
      config.max_seq_len = shape.max_seq_len;
      config.pool_size = 2048;
      ToyModel model(config);
      const ToyModelReference reference(config);
      // 5 tokens (1-token-per-thread tiles), 15 (2 per thread), 80 (8 per thread, two token tiles).
      const std::pair<int, int> batches[] = {{5, 1}, {5, 3}, {40, 2}};
      for (const auto& [rows, per_row] : batches) {
        const char* dtype_text = smcgraph::dtype_name(dtype);
        CAPTURE(shape.vocab);
        CAPTURE(shape.hidden);
        CAPTURE(shape.window);
        CAPTURE(dtype_text);
        CAPTURE(rows);
        CAPTURE(per_row);
        const ToyForwardInputs in = random_inputs(config, rng, rows, per_row, 0.8, 0.02);
        const std::vector<float> kv0 = random_kv(config, rng);
        const Expected expected = expect(reference, in, kv0, dtype);
        DeviceBatch batch(in, config.vocab, dtype, stream);
        for (bool captured : {false, true}) {
          CAPTURE(captured);
          run_forward(model, batch, kv0, captured, stream);
          const std::string logits_diff =
              logits_difference(batch.download(stream), expected.logits, dtype, per_row, config.vocab);
          CHECK_MESSAGE(logits_diff.empty(), logits_diff);
          const std::string kv_diff = kv_difference(download_kv(model, stream), expected.kv, config.hidden);
          CHECK_MESSAGE(kv_diff.empty(), kv_diff);
        }
      }
    }
  }
}

TEST_CASE("a row's logits do not depend on the other rows or on its row index") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  constexpr int kVocab = 32000, kPerRow = 5, kRows = 64;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const char* dtype_text = smcgraph::dtype_name(dtype);
    CAPTURE(dtype_text);
    const ToyModelConfig config = make_config(kVocab, dtype, rng.bits());
    ToyModel model(config);
    const ToyModelReference reference(config);
    // The lone row reads and writes slots [1, 400); the other rows write only slots >= 400.
    ToyBatchShape lone_shape;
    lone_shape.rows = 1;
    lone_shape.tokens_per_row = kPerRow;
    lone_shape.out_slot_end = 400;
    lone_shape.history_slot_end = 400;
    const ToyForwardInputs lone = smcgraph::reference::random_toy_inputs(config, lone_shape, rng.engine());
    ToyBatchShape crowd_shape;
    crowd_shape.rows = kRows;
    crowd_shape.tokens_per_row = kPerRow;
    crowd_shape.out_slot_begin = 400;
    const std::vector<float> kv0 = random_kv(config, rng);

    const size_t row_bytes = static_cast<size_t>(kPerRow) * kVocab * smcgraph::dtype_bytes(dtype);
    DeviceBatch lone_batch(lone, kVocab, dtype, stream);
    run_forward(model, lone_batch, kv0, false, stream);
    const std::vector<uint8_t> alone = lone_batch.download(stream);
    const Expected expected = expect(reference, lone, kv0, dtype);
    const std::string reference_diff = logits_difference(alone, expected.logits, dtype, kPerRow, kVocab);
    CHECK_MESSAGE(reference_diff.empty(), reference_diff);

    for (int index : {0, 37, kRows - 1}) {
      for (bool captured : {false, true}) {
        CAPTURE(index);
        CAPTURE(captured);
        ToyForwardInputs crowd = smcgraph::reference::random_toy_inputs(config, crowd_shape, rng.engine());
        place_row(lone, 0, crowd, index, config.max_seq_len);
        DeviceBatch batch(crowd, kVocab, dtype, stream);
        run_forward(model, batch, kv0, captured, stream);
        const std::vector<uint8_t> among = slice(batch.download(stream), index * row_bytes, row_bytes);
        const std::string diff = logits_difference(among, alone, dtype, kPerRow, kVocab);
        CHECK_MESSAGE(diff.empty(), diff);
      }
    }
  }
}

TEST_CASE("the window is read through the slot table") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  const ToyModelConfig config = make_config(1000, DType::kFloat32, rng.bits());
  ToyModel model(config);
  const ToyModelReference reference(config);
  ToyForwardInputs in = random_inputs(config, rng, 1, 1, 1.0, 0.0);
  const int p = 40;
  in.positions[0] = p;
  in.seq_lens[0] = p + 1;
  for (int q = 0; q < p; ++q)
    in.slot_table[q] = static_cast<int32_t>(rng.integer(1, config.pool_size - 1));
  in.slot_table[p] = in.out_slots[0];
  const std::vector<float> kv0 = random_kv(config, rng);
  auto run = [&](const ToyForwardInputs& inputs) {
    DeviceBatch batch(inputs, config.vocab, config.logits_dtype, stream);
    run_forward(model, batch, kv0, false, stream);
    return batch.download(stream);
  };
  const std::vector<uint8_t> base = run(in);
  const std::string base_diff = logits_difference(
      base, expect(reference, in, kv0, config.logits_dtype).logits, config.logits_dtype, 1, 1000);
  CHECK_MESSAGE(base_diff.empty(), base_diff);
  auto other_slot = [&](int32_t slot) { return slot % (config.pool_size - 1) + 1; }; // != slot in [1, pool)

  for (int q : {p - 3, p - config.window + 1}) { // inside the window
    CAPTURE(q);
    ToyForwardInputs changed = in;
    changed.slot_table[q] = other_slot(in.slot_table[q]);
    const std::vector<uint8_t> got = run(changed);
    CHECK(got != base);
    const std::string diff = logits_difference(
        got, expect(reference, changed, kv0, config.logits_dtype).logits, config.logits_dtype, 1, 1000);
    CHECK_MESSAGE(diff.empty(), diff);
  }
  for (int q : {p - config.window, p + 1}) { // before the window, and at seq_len
    CAPTURE(q);
    ToyForwardInputs changed = in;
    changed.slot_table[q] =
        other_slot(in.slot_table[q] > 0 && in.slot_table[q] < config.pool_size ? in.slot_table[q] : 1);
    CHECK(run(changed) == base);
  }
}

TEST_CASE("draft with perturbation 0 equals the target exactly; > 0 differs") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const char* dtype_text = smcgraph::dtype_name(dtype);
    CAPTURE(dtype_text);
    ToyModelConfig config = make_config(32000, dtype, rng.bits());
    config.head_perturbation = 0.7f; // pair() overrides it for both models
    smcgraph::ToyModelPair same = ToyModel::pair(config, 0.0f);
    smcgraph::ToyModelPair apart = ToyModel::pair(config, 0.05f);
    CHECK(same.target->config().head_perturbation == 0.0f);
    CHECK(same.draft->config().head_perturbation == 0.0f);
    CHECK(apart.target->config().head_perturbation == 0.0f);
    CHECK(apart.draft->config().head_perturbation == 0.05f);
    CHECK(apart.draft->vocab() == 32000);
    CHECK(apart.draft->logits_dtype() == dtype);
    CHECK(apart.draft->max_seq_len() == config.max_seq_len);

    const ToyForwardInputs in = random_inputs(config, rng, 8, 5);
    const std::vector<float> kv0 = random_kv(config, rng);
    auto run = [&](ToyModel& model, std::vector<float>* kv_after) {
      DeviceBatch batch(in, config.vocab, dtype, stream);
      run_forward(model, batch, kv0, true, stream);
      if (kv_after)
        *kv_after = download_kv(model, stream);
      return batch.download(stream);
    };
    std::vector<float> kv_draft, kv_target;
    const std::vector<uint8_t> same_draft = run(*same.draft, &kv_draft);
    const std::vector<uint8_t> same_target = run(*same.target, &kv_target);
    CHECK(same_draft == same_target);
    CHECK(kv_draft == kv_target); // shared embeddings and positions
    const std::vector<uint8_t> apart_target = run(*apart.target, nullptr);
    const std::vector<uint8_t> apart_draft = run(*apart.draft, &kv_draft);
    CHECK(apart_target == same_target);
    CHECK(apart_draft != apart_target);
    CHECK(kv_draft == kv_target);
    ToyModelConfig draft_config = config;
    draft_config.head_perturbation = 0.05f;
    const std::string diff = logits_difference(
        apart_draft, expect(ToyModelReference(draft_config), in, kv0, dtype).logits, dtype, 5, config.vocab);
    CHECK_MESSAGE(diff.empty(), diff);
  }
}

TEST_CASE("a captured forward replays with new input values behind the same pointers") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  const ToyModelConfig config = make_config(1000, DType::kBFloat16, rng.bits());
  ToyModel model(config);
  const ToyModelReference reference(config);
  const ToyForwardInputs a = random_inputs(config, rng, 16, 5);
  const ToyForwardInputs b = random_inputs(config, rng, 16, 5);
  const std::vector<float> kv0 = random_kv(config, rng);
  DeviceBatch batch(a, config.vocab, config.logits_dtype, stream);
  const ForwardArgs args = batch.args();

  const test::GraphExec exec =
      test::instantiate_graph(stream, [&](cudaStream_t s) { model.forward(args, s); });
  for (const ToyForwardInputs* in : {&a, &b, &a}) {
    batch.upload(*in, stream);
    upload_kv(model, kv0, stream);
    batch.logits.fill_bytes(kPoison, stream);
    test::launch(exec, stream);
    stream.synchronize();
    const Expected expected = expect(reference, *in, kv0, config.logits_dtype);
    const std::string diff =
        logits_difference(batch.download(stream), expected.logits, config.logits_dtype, 5, 1000);
    CHECK_MESSAGE(diff.empty(), diff);
    const std::string kv_diff = kv_difference(download_kv(model, stream), expected.kv, config.hidden);
    CHECK_MESSAGE(kv_diff.empty(), kv_diff);
  }
}

TEST_CASE("tokens, positions, out slots and logits with a row stride give the dense forward's logits and KV, "
          "eagerly and in a graph") {
  // The engine's draft steps read d_k from column k of its [rows, K + 1] draft block; its verify forward over
  // W <= K + 1 columns reads and writes all of its [rows, K + 1] blocks with that stride.
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  const ToyModelConfig config = make_config(1000, DType::kBFloat16, rng.bits());
  ToyModel model(config);
  for (int per_row : {1, 2, 5}) {
    CAPTURE(per_row);
    const ToyForwardInputs in = random_inputs(config, rng, 9, per_row, 0.75, 0.03);
    const std::vector<float> kv0 = random_kv(config, rng);
    DeviceBatch batch(in, config.vocab, config.logits_dtype, stream);
    run_forward(model, batch, kv0, false, stream);
    const std::vector<uint8_t> want = batch.download(stream);
    const std::vector<float> want_kv = download_kv(model, stream);
    const int64_t stride = per_row + 3;
    test::StridedForward strided(
        in.tokens, in.positions, in.out_slots, in.rows, per_row, stride,
        static_cast<size_t>(config.vocab) * smcgraph::dtype_bytes(config.logits_dtype), stream);
    for (bool captured : {false, true}) {
      for (bool io_strided : {false, true}) {
        CAPTURE(captured);
        CAPTURE(io_strided);
        upload_kv(model, kv0, stream);
        batch.logits.fill_bytes(kPoison, stream);
        const ForwardArgs args = strided.args(batch.args(), io_strided, kPoison, stream);
        test::run_on_stream(captured, stream, [&](cudaStream_t s) { model.forward(args, s); });
        bool rest_untouched = true;
        const std::vector<uint8_t> got =
            io_strided ? strided.dense_logits(kPoison, rest_untouched, stream) : batch.download(stream);
        CHECK_MESSAGE(rest_untouched, "the strided forward wrote logits past tokens_per_row");
        const std::string logits_diff =
            logits_difference(got, want, config.logits_dtype, per_row, config.vocab);
        CHECK_MESSAGE(logits_diff.empty(), logits_diff);
        const std::string kv_diff = kv_difference(download_kv(model, stream), want_kv, config.hidden);
        CHECK_MESSAGE(kv_diff.empty(), kv_diff);
      }
    }
  }
}

TEST_CASE("forward validates its arguments on the host; rows = 0 is a no-op") {
  test::Rng rng;
  Stream stream;
  const ToyModelConfig config = make_config(7, DType::kFloat32, rng.bits());
  ToyModel model(config);
  const ToyForwardInputs in = random_inputs(config, rng, 2, 2);
  DeviceBatch batch(in, config.vocab, config.logits_dtype, stream);
  auto check_rejects = [&](ForwardArgs args, const std::string& parameter) {
    CAPTURE(parameter);
    bool thrown = false;
    try {
      model.forward(args, stream);
    } catch (const smcgraph::Error& error) {
      thrown = true;
      const std::string text = error.what();
      INFO("error text: ", text);
      CHECK(text.find(parameter + " = ") != std::string::npos);
      CHECK(error.cuda_error() == cudaSuccess);
    }
    CHECK(thrown);
  };
  ForwardArgs args = batch.args();
  args.rows = -1;
  check_rejects(args, "rows");
  args = batch.args();
  args.tokens_per_row = 0;
  check_rejects(args, "tokens_per_row");
  args = batch.args();
  args.token_row_stride = 1; // < tokens_per_row = 2
  check_rejects(args, "token_row_stride");
  args = batch.args();
  args.io_row_stride = 1; // < tokens_per_row = 2
  check_rejects(args, "io_row_stride");
  const char* names[] = {"tokens", "positions", "slot_table", "seq_lens", "out_slots", "live", "logits"};
  for (int i = 0; i < 7; ++i) {
    args = batch.args();
    switch (i) {
    case 0:
      args.tokens = nullptr;
      break;
    case 1:
      args.positions = nullptr;
      break;
    case 2:
      args.slot_table = nullptr;
      break;
    case 3:
      args.seq_lens = nullptr;
      break;
    case 4:
      args.out_slots = nullptr;
      break;
    case 5:
      args.live = nullptr;
      break;
    default:
      args.logits = nullptr;
      break;
    }
    check_rejects(args, names[i]);
  }
  // rows = 0 enqueues nothing, whatever the pointers; the KV stays as constructed (zero).
  ForwardArgs empty;
  CHECK_NOTHROW(model.forward(empty, stream));
  stream.synchronize();
  const std::vector<float> kv = download_kv(model, stream);
  CHECK(std::all_of(kv.begin(), kv.end(), [](float x) { return x == 0.0f; }));
}

TEST_CASE("bench shapes: validated tokens and KV, eagerly and replayed from a graph") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  constexpr int kVocab = 128256;
  struct Shape {
    int rows, per_row;
  };
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    ToyModelConfig config = make_config(kVocab, dtype, rng.bits());
    config.pool_size = 1 << 16;
    config.max_seq_len = 2048;
    ToyModel model(config);
    const ToyModelReference reference(config);
    const std::vector<float> kv0 = random_kv(config, rng);
    // Under a sanitizer fewer rows (still several 64-token tiles, each CTA walking several work items, the
    // 16-token variant as is). The forward's speed is bucket_sweep's (model_us), not this test's.
    const Shape shapes[] = {
        {test::sanitizer_scaled(512, 128, 40), 5}, {test::sanitizer_scaled(512, 128, 130), 1}, {16, 1}};
    for (const Shape shape : shapes) {
      const char* dtype_text = smcgraph::dtype_name(dtype);
      CAPTURE(dtype_text);
      CAPTURE(shape.rows);
      CAPTURE(shape.per_row);
      const ToyForwardInputs in = random_inputs(config, rng, shape.rows, shape.per_row, 1.0, 0.0);
      DeviceBatch batch(in, kVocab, dtype, stream);
      for (const bool captured : {false, true}) {
        CAPTURE(captured);
        run_forward(model, batch, kv0, captured, stream);

        // Validate a few whole tokens (first, last, random) and the whole KV.
        std::vector<float> kv_expected = kv0;
        reference.write_kv(in, kv_expected);
        const std::string kv_diff = kv_difference(download_kv(model, stream), kv_expected, config.hidden);
        CHECK_MESSAGE(kv_diff.empty(), kv_diff);
        const size_t tokens = static_cast<size_t>(shape.rows) * shape.per_row;
        const size_t token_bytes = static_cast<size_t>(kVocab) * smcgraph::dtype_bytes(dtype);
        std::vector<size_t> checked = {0, tokens - 1};
        for (int i = 0; i < 4; ++i)
          checked.push_back(static_cast<size_t>(rng.integer(0, static_cast<int64_t>(tokens) - 1)));
        std::vector<float> logits(kVocab);
        std::vector<uint8_t> got(token_bytes), want(token_bytes);
        for (size_t token : checked) {
          CAPTURE(token);
          reference.token_logits(in, kv_expected, static_cast<int>(token / shape.per_row),
                                 static_cast<int>(token % shape.per_row), logits.data());
          for (int v = 0; v < kVocab; ++v)
            encode_logit(dtype, logits[v],
                         want.data() + static_cast<size_t>(v) * smcgraph::dtype_bytes(dtype));
          SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(got.data(), batch.logits.data() + token * token_bytes,
                                              token_bytes, cudaMemcpyDeviceToHost, stream));
          stream.synchronize();
          const std::string diff = logits_difference(got, want, dtype, 1, kVocab);
          CHECK_MESSAGE(diff.empty(), diff);
        }
      }
    }
  }
}
