// LlamaModel on the GPU against the host reference (tests/reference/llama_ref) on tiny random Llama files
// (tests/support/gguf_writer), eagerly and inside captured graphs, with poisoned logits; then the engine
// driving a tiny target and its layer-subset draft.
//
// Tolerance. The device follows the contract's rounding points but sums in fp32 in its own order (and uses
// fp32 transcendentals), while the reference sums in double: every fp32 result differs by ~2^-24 relative,
// which flips a bf16 rounding now and then, and each flip changes the next layer's inputs, so the
// difference cascades towards the contract's own bf16 noise (its distance to the exact math, kExact), and at
// most to that of two independent bf16 roundings (~1.4x). The bounds (reference::kLlama*, derived and
// re-measured in tests/test_llama_cpu.cpp with an fp32-summing host reference) sit at that level:
// |gpu - ref| <= 0.15 max(1, |ref|) per logit, argmax equal unless the reference's top-2 gap is within that
// tolerance, rms(gpu - ref) <= rms(ref - exact) over the fp32 logits of a schedule, KV within one bf16 ulp
// plus a slack of the head vector's rms (1/256 in the first layer run, whose inputs are the exact embeddings;
// 0.125 deeper), plus what two RMSNorm outputs rounding to the neighbouring bf16 value would change
// (LlamaReference::kv_flip: the device's rsqrtf scale is within 2 ulp of the contract's; without it a
// first-layer V once differed by 3 ulp, seed 11713376921205938077). Wrong math (RoPE pairing, head mapping, a
// missed or extra position, a wrong slot) moves logits and KV by their own size, far outside. The tensor-core
// prefill attention (llama_attention_tc.cu) rounds the softmax weights to bf16 besides, and the cuBLASLt
// prefill GEMMs (llama_prefill_gemm.cu) sum in their own order: both are held to the same bounds (their own
// cases), and every other case pins them off (options_of) to test the CUDA-core kernels' and own GEMMs' bits.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "reference/llama_ref.hpp"
#include "runtime/slot_checker.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/ngram_draft.hpp"
#include "smcgraph/runtime.hpp"
#include "support/engine_test_util.hpp"
#include "support/gguf_writer.hpp"
#include "support/test_util.hpp"

using smcgraph::DeviceBuffer;
using smcgraph::DType;
using smcgraph::ForwardArgs;
using smcgraph::GgufType;
using smcgraph::LlamaHostWeights;
using smcgraph::LlamaModel;
using smcgraph::LlamaModelOptions;
using smcgraph::LlamaWeights;
using smcgraph::Stream;
using smcgraph::reference::LlamaForwardInputs;
using smcgraph::reference::LlamaNumerics;
using smcgraph::reference::LlamaReference;
using smcgraph::reference::LlamaSequences;
using smcgraph::test::TinyLlamaSpec;
namespace reference = smcgraph::reference;
namespace test = smcgraph::test;

namespace {

constexpr uint8_t kPoison = 0xff; // NaN in fp32 and in bf16

/// A tiny model file loaded twice: host weights for the reference, device weights for the models.
struct Tiny {
  TinyLlamaSpec spec;
  LlamaHostWeights host;
  std::shared_ptr<const LlamaWeights> weights;
};

std::unique_ptr<Tiny> make_tiny(const TinyLlamaSpec& spec) {
  auto tiny = std::make_unique<Tiny>();
  tiny->spec = spec;
  tiny->host =
      smcgraph::load_llama_host_weights(smcgraph::GgufFile::from_bytes(test::make_tiny_llama_gguf(spec)));
  tiny->weights = std::make_shared<const LlamaWeights>(tiny->host);
  return tiny;
}

struct Shape {
  int layers, hidden, heads, kv_heads, ffn, vocab;
  bool tied;
  GgufType weight_type, embedding_type;
};

TinyLlamaSpec spec_of(const Shape& s, uint64_t seed, int context = 2048) {
  TinyLlamaSpec spec;
  spec.layers = s.layers;
  spec.hidden = s.hidden;
  spec.heads = s.heads;
  spec.kv_heads = s.kv_heads;
  spec.ffn = s.ffn;
  spec.vocab = s.vocab;
  spec.tied = s.tied;
  spec.weight_type = s.weight_type;
  spec.embedding_type = s.embedding_type;
  spec.context = context;
  spec.seed = seed;
  return spec;
}

/// A test's random source (its seed printed), a stream and a tiny model file of `shape` drawn from it.
struct TinySetup {
  test::Rng rng;
  Stream stream;
  std::unique_ptr<Tiny> tiny;
  explicit TinySetup(const Shape& shape) {
    MESSAGE("seed ", rng.seed());
    tiny = make_tiny(spec_of(shape, rng.bits()));
  }
};

/// A model's options. The cases of this file hold the CUDA-core attention kernels and the library's own GEMMs
/// to their bits (tensor_core_tokens and prefill_gemm_tokens 0: every forward on them) unless they test the
/// prefill paths (the tensor-core attention, the cuBLASLt GEMMs).
LlamaModelOptions options_of(int pool_size, int max_seq_len, int max_tokens, DType dtype,
                             std::vector<int> layers = {}, int tensor_core_tokens = 0,
                             int prefill_gemm_tokens = 0) {
  LlamaModelOptions options;
  options.pool_size = pool_size;
  options.max_seq_len = max_seq_len;
  options.max_tokens_per_forward = max_tokens;
  options.logits_dtype = dtype;
  options.layers = std::move(layers);
  options.tensor_core_attention_tokens = tensor_core_tokens;
  options.prefill_gemm_tokens = prefill_gemm_tokens;
  return options;
}

/// Device copies of a forward's inputs and a logits buffer; args() points at them.
struct DeviceBatch {
  int rows = 0, tokens_per_row = 0;
  DeviceBuffer<int32_t> tokens, positions, slot_table, seq_lens, out_slots;
  DeviceBuffer<uint8_t> live, logits;

  DeviceBatch(const LlamaForwardInputs& in, int vocab, DType dtype, cudaStream_t stream)
      : rows(in.rows), tokens_per_row(in.tokens_per_row), tokens(test::to_device(in.tokens, stream)),
        positions(test::to_device(in.positions, stream)), slot_table(test::to_device(in.slot_table, stream)),
        seq_lens(test::to_device(in.seq_lens, stream)), out_slots(test::to_device(in.out_slots, stream)),
        live(test::to_device(in.live, stream)),
        logits(static_cast<size_t>(in.rows) * in.tokens_per_row * vocab * smcgraph::dtype_bytes(dtype)) {}

  ForwardArgs args() {
    return ForwardArgs{rows,
                       tokens_per_row,
                       tokens.data(),
                       positions.data(),
                       slot_table.data(),
                       seq_lens.data(),
                       out_slots.data(),
                       live.data(),
                       logits.data()};
  }
  std::vector<uint8_t> download(cudaStream_t stream) const {
    return test::to_host(logits.data(), logits.size(), stream);
  }
};

/// Logits <- poison, then one forward (eagerly, or captured into a graph and replayed once); the bytes.
std::vector<uint8_t> run_forward(LlamaModel& model, DeviceBatch& batch, bool captured, cudaStream_t stream) {
  batch.logits.fill_bytes(kPoison, stream);
  const ForwardArgs args = batch.args();
  test::run_on_stream(captured, stream, [&](cudaStream_t s) { model.forward(args, s); });
  return batch.download(stream);
}

std::vector<double> decode_logits(const std::vector<uint8_t>& bytes, DType dtype) {
  const size_t element = smcgraph::dtype_bytes(dtype);
  std::vector<double> values(bytes.size() / element);
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      float value;
      std::memcpy(&value, bytes.data() + 4 * i, 4);
      values[i] = value;
    } else {
      uint16_t bits;
      std::memcpy(&bits, bytes.data() + 2 * i, 2);
      values[i] = test::bf16_to_float(bits);
    }
  }
  return values;
}

/// Empty when every padding row holds either the poison (not written: the own-kernel LM head skips padding
/// rows) or finite logits only (the cuBLASLt LM head writes every row; nothing reads a padding row's logits).
std::string padding_problem(const LlamaForwardInputs& in, const std::vector<uint8_t>& bytes, DType dtype) {
  const std::vector<double> values = decode_logits(bytes, dtype);
  const size_t row_bytes = bytes.size() / in.rows, row_values = values.size() / in.rows;
  for (int row = 0; row < in.rows; ++row) {
    if (in.live[row])
      continue;
    const auto begin = bytes.begin() + row * row_bytes;
    const bool untouched = std::all_of(begin, begin + row_bytes, [](uint8_t b) { return b == kPoison; });
    const auto first = values.begin() + row * row_values;
    const bool finite = std::all_of(first, first + row_values, [](double v) { return std::isfinite(v); });
    if (!untouched && !finite)
      return "padding row " + std::to_string(row) + " holds partly written or non-finite logits";
  }
  return {};
}

std::vector<uint16_t> download_kv(const LlamaModel& model, cudaStream_t stream) {
  const smcgraph::LlamaConfig& c = model.config();
  const size_t count =
      model.layers().size() * static_cast<size_t>(model.options().pool_size) * 2 * c.kv_heads * c.head_dim;
  return test::to_host(model.kv_data(), count, stream);
}

/// The forward that feeds `tokens_per_row` tokens of the live rows for which `active(row)` holds (the other
/// rows are padding this time), and advances them.
template <class Active>
LlamaForwardInputs step_inputs(LlamaSequences& s, int tokens_per_row, Active active,
                               std::mt19937_64& engine) {
  LlamaSequences view = s;
  for (size_t row = 0; row < s.live.size(); ++row)
    view.live[row] = s.live[row] && active(static_cast<int>(row)) ? 1 : 0;
  const LlamaForwardInputs in = view.next(tokens_per_row, engine);
  view.advance(tokens_per_row);
  s.done = view.done;
  return in;
}

/// One layer list under test: an fp32-logits and a bf16-logits model sharing the weights, and the contract
/// and exact references of the same layers.
struct Subject {
  std::vector<int> layers;
  std::unique_ptr<LlamaModel> fp32, bf16;
  std::unique_ptr<LlamaReference> contract, exact;
  double error_squares = 0.0, noise_squares = 0.0;
  size_t compared = 0;
  int near_ties = 0;
  double max_error = 0.0;

  Subject(const Tiny& tiny, std::vector<int> layer_list, int pool, int max_seq_len, int max_tokens,
          int tensor_core_tokens = 0, int prefill_gemm_tokens = 0)
      : layers(std::move(layer_list)) {
    fp32 = std::make_unique<LlamaModel>(tiny.weights,
                                        options_of(pool, max_seq_len, max_tokens, DType::kFloat32, layers,
                                                   tensor_core_tokens, prefill_gemm_tokens));
    bf16 = std::make_unique<LlamaModel>(tiny.weights,
                                        options_of(pool, max_seq_len, max_tokens, DType::kBFloat16, layers,
                                                   tensor_core_tokens, prefill_gemm_tokens));
    contract =
        std::make_unique<LlamaReference>(tiny.host, layers, pool, max_seq_len, LlamaNumerics::kContract);
    exact = std::make_unique<LlamaReference>(tiny.host, layers, pool, max_seq_len, LlamaNumerics::kExact);
  }

  /// One forward on both models (eager, then captured: bit-identical) against the references; KV checked.
  void forward(const LlamaForwardInputs& in, cudaStream_t stream) {
    const int vocab = contract->config().vocab;
    std::vector<double> want(static_cast<size_t>(in.rows) * in.tokens_per_row * vocab, 0.0), ideal = want;
    contract->forward(in, want);
    exact->forward(in, ideal);
    std::vector<uint8_t> fp32_bytes;
    for (LlamaModel* model : {fp32.get(), bf16.get()}) {
      const DType dtype = model->logits_dtype();
      const char* dtype_text = smcgraph::dtype_name(dtype);
      CAPTURE(dtype_text);
      DeviceBatch batch(in, vocab, dtype, stream);
      // The forward is idempotent: it rewrites the same KV before reading it, so the replay sees the same
      // state.
      const std::vector<uint8_t> eager = run_forward(*model, batch, false, stream);
      const std::vector<uint8_t> graphed = run_forward(*model, batch, true, stream);
      CHECK_MESSAGE(eager == graphed, "graph replay differs from the eager forward");
      const std::string padding = padding_problem(in, eager, dtype);
      CHECK_MESSAGE(padding.empty(), padding);
      const reference::LogitsAgreement agreement = reference::compare_logits(
          in, vocab, decode_logits(eager, dtype), want, &ideal, reference::kLlamaLogitTolerance);
      CHECK_MESSAGE(agreement.ok(), agreement.problem << " (" << agreement.summary() << ")");
      const reference::KvAgreement kv =
          reference::compare_kv(download_kv(*model, stream), *contract, reference::kLlamaKvFirstLayerSlack,
                                reference::kLlamaKvSlack);
      CHECK_MESSAGE(kv.ok(), kv.problem);
      if (dtype == DType::kFloat32) {
        fp32_bytes = eager;
        error_squares += agreement.rms_error * agreement.rms_error * agreement.compared;
        noise_squares += agreement.rms_noise * agreement.rms_noise * agreement.compared;
        compared += agreement.compared;
        near_ties += agreement.near_ties;
        max_error = std::max(max_error, agreement.max_error);
        continue;
      }
      // bf16 logits are the fp32 logits rounded to nearest even (same weights, same KV, same kernels).
      size_t differing = 0;
      for (size_t i = 0; i < eager.size() / 2; ++i) {
        if (!in.live[i / (static_cast<size_t>(in.tokens_per_row) * vocab)])
          continue;
        float value;
        std::memcpy(&value, fp32_bytes.data() + 4 * i, 4);
        uint16_t bits;
        std::memcpy(&bits, eager.data() + 2 * i, 2);
        differing += bits != test::float_to_bf16(value);
      }
      CHECK_MESSAGE(differing == 0, differing << " bf16 logits are not the rounded fp32 logits");
    }
  }

  /// The schedule's noise ratio (fp32 logits) and a summary line.
  std::string finish() const {
    const double ratio = noise_squares > 0.0 ? std::sqrt(error_squares / noise_squares) : 0.0;
    CHECK_MESSAGE(ratio <= reference::kLlamaNoiseFraction,
                  "rms(gpu - contract) / rms(contract - exact) = " << ratio);
    return std::to_string(compared) + " fp32 logits: max scaled error " + std::to_string(max_error) +
           ", rms error / contract noise " + std::to_string(ratio) + ", near ties " +
           std::to_string(near_ties);
  }
};

std::string layers_text(const std::vector<int>& layers) {
  if (layers.empty())
    return "all";
  std::string text;
  for (int l : layers) {
    if (!text.empty())
      text += ',';
    text += std::to_string(l);
  }
  return text;
}

} // namespace

TEST_CASE("llama forward equals the reference: shapes, block sizes, slot tables, padding, graphs, drafts") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  const Shape shapes[] = {
      {3, 64, 4, 2, 96, 300, true, GgufType::kQ4_1, GgufType::kQ8_0},    // head_dim 16, grouped KV
      {3, 128, 4, 4, 256, 1000, false, GgufType::kQ8_0, GgufType::kF16}, // head_dim 32, untied head
      {2, 128, 2, 1, 160, 517, true, GgufType::kF16, GgufType::kF16},    // head_dim 64, one KV head
      {3, 256, 2, 2, 256, 700, false, GgufType::kQ4_1, GgufType::kQ8_0}, // head_dim 128 (the maximum)
  };
  constexpr int kPool = 1024, kMaxSeqLen = 128, kMaxTokens = 256, kRows = 6;
  for (const Shape& shape : shapes) {
    const std::unique_ptr<Tiny> tiny = make_tiny(spec_of(shape, rng.bits()));
    const std::vector<int> subset = shape.layers == 3 ? std::vector<int>{0, 2} : std::vector<int>{1};
    for (const std::vector<int>& layers : {std::vector<int>{}, subset}) {
      const std::string layer_list = layers_text(layers);
      CAPTURE(shape.hidden);
      CAPTURE(shape.heads);
      CAPTURE(shape.kv_heads);
      CAPTURE(layer_list);
      Subject subject(*tiny, layers, kPool, kMaxSeqLen, kMaxTokens);
      // Random distinct slots (never 0); even rows start with a 37-token prefill block, odd rows join later,
      // so rows sit at different positions in every later forward.
      LlamaSequences s = reference::random_llama_sequences(std::vector<int>(kRows, 80), shape.vocab, kPool,
                                                           kMaxSeqLen, 0.7, rng.engine());
      // Racecheck tracks every shared-memory access: there each block length (prefill, K+1, 2, 1) runs once.
      const std::vector<std::pair<int, int>> schedule =
          test::sanitizer_tool() == test::SanitizerTool::kRacecheck
              ? std::vector<std::pair<int, int>>{{37, 0}, {5, 2}, {2, 2}, {1, 2}}
              : std::vector<std::pair<int, int>>{{37, 0}, {9, 2}, {5, 2}, {2, 2}, {1, 2}, {1, 1}, {5, 2}};
      for (const auto& [per_row, who] : schedule) {
        CAPTURE(per_row);
        const auto active = [who = who](int row) { return who == 2 || row % 2 == who; };
        const LlamaForwardInputs in = step_inputs(s, per_row, active, rng.engine());
        subject.forward(in, stream);
      }
      MESSAGE("hidden ", shape.hidden, ", layers ", layer_list, ": ", subject.finish());
    }
  }
}

TEST_CASE("llama forward: a long row runs the split-KV attention and matches the reference") {
  const Shape shape{2, 64, 4, 2, 128, 300, true, GgufType::kQ4_1, GgufType::kQ8_0};
  TinySetup setup(shape);
  test::Rng& rng = setup.rng;
  Stream& stream = setup.stream;
  const std::unique_ptr<Tiny>& tiny = setup.tiny;
  constexpr int kPool = 2048, kMaxSeqLen = 2048, kMaxTokens = 1024; // 2 rows x 499
  Subject subject(*tiny, {}, kPool, kMaxSeqLen, kMaxTokens);
  // Racecheck tracks every shared-memory access of the attention's position loop: a 600-token row there (10
  // chunks of 64 positions, still several splits), 1500 elsewhere.
  const int long_length = test::sanitizer_scaled(1500, 1500, 600);
  LlamaSequences s = reference::random_llama_sequences({long_length, 302}, shape.vocab, kPool, kMaxSeqLen,
                                                       1.0, rng.engine());
  const auto row = [](int which) { return [which](int r) { return r == which; }; };
  const auto every_row = [](int) { return true; };
  for (int block = 0; block < 3; ++block) { // row 0's prefill in 3 blocks (499 tokens each), row 1 padding
    const LlamaForwardInputs in = step_inputs(s, (long_length - 3) / 3, row(0), rng.engine());
    subject.forward(in, stream);
  }
  subject.forward(step_inputs(s, 299, row(1), rng.engine()), stream);
  // Both rows decode one token at a time: row 0 reads ~1500 positions (several splits), row 1 ~300.
  for (int decode = 0; decode < 3; ++decode) {
    CAPTURE(decode);
    subject.forward(step_inputs(s, 1, every_row, rng.engine()), stream);
  }
  CHECK(s.done[0] == long_length);
  MESSAGE("long row: ", subject.finish());
}

TEST_CASE("llama forward: the prefill paths match the reference (tensor-core attention, cuBLASLt GEMMs)") {
  // Blocks of at least 16 tokens a row take the tensor-core attention kernel here (the default threshold is
  // 64), with the library's own GEMMs and then with the cuBLASLt ones (default from 2048 tokens): 37-, 70-
  // and 300-token prefills over several key tiles and query tiles, rows at different positions, padding rows,
  // then verify blocks and decodes on the CUDA-core kernels reading the KV the prefills wrote; every forward
  // eagerly and in a captured graph, against the float64 / contract references.
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  Stream stream;
  const Shape shapes[] = {
      {2, 128, 2, 1, 160, 517, true, GgufType::kF16, GgufType::kF16},    // head_dim 64, one KV head
      {2, 384, 6, 2, 256, 300, true, GgufType::kQ4_1, GgufType::kQ8_0},  // head_dim 64, 3 queries a KV head
      {2, 256, 2, 2, 256, 700, false, GgufType::kQ4_1, GgufType::kQ8_0}, // head_dim 128
  };
  constexpr int kPool = 4096, kMaxSeqLen = 512, kMaxTokens = 1200, kRows = 4, kTensorCoreTokens = 16;
  const bool racecheck = test::sanitizer_tool() == test::SanitizerTool::kRacecheck;
  for (const auto& [shape, gemm_tokens] :
       std::vector<std::pair<Shape, int>>{{shapes[0], 0},
                                          {shapes[0], kTensorCoreTokens},
                                          {shapes[1], kTensorCoreTokens},
                                          {shapes[2], 0},
                                          {shapes[2], kTensorCoreTokens}}) {
    CAPTURE(shape.hidden);
    CAPTURE(shape.heads);
    CAPTURE(gemm_tokens);
    const std::unique_ptr<Tiny> tiny = make_tiny(spec_of(shape, rng.bits()));
    Subject subject(*tiny, {}, kPool, kMaxSeqLen, kMaxTokens, kTensorCoreTokens, gemm_tokens);
    LlamaSequences s = reference::random_llama_sequences(std::vector<int>(kRows, 460), shape.vocab, kPool,
                                                         kMaxSeqLen, 0.8, rng.engine());
    const std::vector<std::pair<int, int>> schedule =
        racecheck
            ? std::vector<std::pair<int, int>>{{37, 0}, {70, 2}, {5, 2}}
            : std::vector<std::pair<int, int>>{{37, 0}, {70, 2}, {300, 1}, {5, 2}, {1, 2}, {20, 2}, {1, 0}};
    for (const auto& [per_row, who] : schedule) {
      CAPTURE(per_row);
      const auto active = [who = who](int row) { return who == 2 || row % 2 == who; };
      subject.forward(step_inputs(s, per_row, active, rng.engine()), stream);
    }
    MESSAGE("hidden ", shape.hidden, ", heads ", shape.heads, ", cuBLASLt GEMMs from ", gemm_tokens,
            " tokens: ", subject.finish());
  }
}

TEST_CASE("llama forward: the prefill paths are chunk- and batch-invariant among their launches") {
  // A 200-token prompt prefilled in one forward, in chunks of 100 + 100 and of 64 + 136 (all at or above the
  // thresholds), alone and beside another row: the last token's logits and the KV are the same bits. Both
  // prefill paths on (the tensor-core attention; the cuBLASLt GEMMs, whose pinned algorithms must not depend
  // on the launch's token count), then the attention alone.
  const Shape shape{2, 128, 2, 1, 160, 517, true, GgufType::kF16, GgufType::kF16}; // head_dim 64
  TinySetup setup(shape);
  constexpr int kPool = 1024, kMaxSeqLen = 256, kPrompt = 200, kThreshold = 64;
  const int vocab = shape.vocab;
  std::vector<int32_t> prompt(kPrompt), other(kPrompt);
  for (int i = 0; i < kPrompt; ++i) {
    prompt[i] = static_cast<int32_t>(setup.rng.engine()() % vocab);
    other[i] = static_cast<int32_t>(setup.rng.engine()() % vocab);
  }
  // Row 0 holds `prompt` at slots 1.., row 1 (when present) `other` at slots 1 + kMaxSeqLen..
  const auto prefill = [&](const std::vector<int>& chunks, bool two_rows, int gemm_tokens) {
    LlamaModel model(setup.tiny->weights, options_of(kPool, kMaxSeqLen, 2 * kPrompt, DType::kFloat32, {},
                                                     kThreshold, gemm_tokens));
    const int rows = two_rows ? 2 : 1;
    std::vector<uint8_t> last;
    int begin = 0;
    for (const int chunk : chunks) {
      LlamaForwardInputs in;
      in.rows = rows;
      in.tokens_per_row = chunk;
      for (int r = 0; r < rows; ++r) {
        const std::vector<int32_t>& tokens = r == 0 ? prompt : other;
        for (int j = 0; j < chunk; ++j) {
          in.tokens.push_back(tokens[begin + j]);
          in.positions.push_back(begin + j);
          in.out_slots.push_back(1 + r * kMaxSeqLen + begin + j);
        }
        for (int p = 0; p < kMaxSeqLen; ++p)
          in.slot_table.push_back(1 + r * kMaxSeqLen + p);
        in.seq_lens.push_back(begin + chunk);
        in.live.push_back(1);
      }
      DeviceBatch batch(in, vocab, DType::kFloat32, setup.stream);
      const std::vector<uint8_t> bytes = run_forward(model, batch, false, setup.stream);
      // Row 0's last token of this chunk.
      const size_t row_bytes = static_cast<size_t>(vocab) * 4;
      last.assign(bytes.begin() + (chunk - 1) * row_bytes, bytes.begin() + chunk * row_bytes);
      begin += chunk;
    }
    const std::vector<uint16_t> kv = download_kv(model, setup.stream);
    // Row 0's slots only (row 1's are absent in the one-row runs), of every layer: the KV is [layers, pool,
    // 2 * kv_heads * head_dim].
    const size_t per_slot = size_t{2} * model.config().kv_heads * model.config().head_dim;
    std::vector<uint16_t> row0;
    for (size_t layer = 0; layer < model.layers().size(); ++layer) {
      const auto first = kv.begin() + (layer * kPool + 1) * per_slot;
      row0.insert(row0.end(), first, first + kPrompt * per_slot);
    }
    return std::make_pair(last, row0);
  };
  for (const int gemm_tokens : {kThreshold, 0}) {
    CAPTURE(gemm_tokens);
    const auto whole = prefill({kPrompt}, false, gemm_tokens);
    for (const auto& [chunks, two_rows] : std::vector<std::pair<std::vector<int>, bool>>{
             {{100, 100}, false}, {{64, 136}, false}, {{kPrompt}, true}, {{100, 100}, true}}) {
      CAPTURE(chunks.front());
      CAPTURE(two_rows);
      const auto got = prefill(chunks, two_rows, gemm_tokens);
      CHECK(got.first == whole.first);
      CHECK(got.second == whole.second);
    }
  }
}

TEST_CASE("llama forward is batch-invariant: a token's logits are the same bits in any block and batch") {
  // The GEMM picks its tiles by the forward's token count (narrow 16-row tiles for few tokens, with two
  // column fragments a warp for gate/up from 17 tokens, wide 64 x 64 tiles for many; llama_gemm.cu) and
  // attention splits positions by a token's own length only, so a token's logits must not depend on how many
  // tokens share its forward: a 40-token block of 16 rows (640 tokens: wide tiles), the same tokens in blocks
  // of 8 (128 tokens: narrow, gate/up paired) and one at a time (16 tokens: narrow, one column fragment) give
  // the same bits. Greedy speculative decoding reproducing greedy decoding rests on this.
  const Shape shape{2, 128, 4, 2, 256, 300, true, GgufType::kQ4_1, GgufType::kQ8_0};
  TinySetup setup(shape);
  constexpr int kRows = 16, kLength = 40, kPool = 1024, kMaxSeqLen = 64;
  const LlamaSequences start = reference::random_llama_sequences(
      std::vector<int>(kRows, kLength), shape.vocab, kPool, kMaxSeqLen, 1.0, setup.rng.engine());
  const auto every_row = [](int) { return true; };
  const size_t vocab = static_cast<size_t>(shape.vocab);
  std::vector<uint8_t> whole; // [rows, kLength, vocab] fp32 from one forward
  for (int block : {kLength, 8, 1}) {
    CAPTURE(block);
    LlamaModel model(setup.tiny->weights, options_of(kPool, kMaxSeqLen, kRows * kLength, DType::kFloat32));
    LlamaSequences s = start;
    for (int first = 0; first < kLength; first += block) {
      const LlamaForwardInputs in = step_inputs(s, block, every_row, setup.rng.engine());
      DeviceBatch batch(in, shape.vocab, DType::kFloat32, setup.stream);
      const std::vector<uint8_t> got = run_forward(model, batch, block == 1, setup.stream);
      if (block == kLength) {
        whole = got;
        continue;
      }
      size_t differing = 0;
      for (int row = 0; row < kRows; ++row)
        for (int j = 0; j < block; ++j)
          differing +=
              std::memcmp(got.data() + ((size_t(row) * block + j) * vocab) * 4,
                          whole.data() + ((size_t(row) * kLength + first + j) * vocab) * 4, vocab * 4) != 0;
      CHECK_MESSAGE(differing == 0, differing << " tokens of block " << first / block
                                              << " have logits that differ from the whole-prefill forward");
    }
  }
}

using test::ScopedEnv;

/// The rows and forwards of check_same_logits_when_forced: `rows` rows of `length` positions (their tokens),
/// then `schedule`: (tokens a row, which rows: 2 all, 0 the even ones).
struct ForcedRun {
  int rows, length, pool, max_seq_len, max_tokens;
  std::vector<std::pair<int, int>> schedule;
};

/// 6 rows: a 270-token prefill, then verify blocks and decodes, some with padding rows.
ForcedRun short_rows() {
  return {6, 320, 4096, 512, 2048, {{270, 2}, {1, 2}, {2, 2}, {5, 2}, {5, 0}, {1, 0}, {9, 2}, {1, 2}}};
}

/// 3 rows prefilled to about 1,000 positions (two 500-token blocks; racecheck: 300), then decodes, a 4-token
/// verify block, a decode with padding rows and a 40-token block. A row of more than 512 positions folds its
/// attention in splits (llama_attention.cu): the prefills' later queries (grouped blocks) and every later
/// query have 2-3 splits, and the small launches give a token's splits blocks of their own (split-KV).
ForcedRun long_rows() {
  const int prefill = test::sanitizer_scaled(500, 500, 300);
  return {3,    2 * prefill + 60,
          8192, 2048,
          2048, {{prefill, 2}, {prefill, 2}, {1, 2}, {4, 2}, {1, 0}, {40, 2}, {1, 2}, {1, 2}}};
}

/// Two models of `shape`, built with the environment variable `name` set to `first` and to `second` (read by
/// the constructor), fed the same forwards (`run`), every other one captured in a graph. Checks that both
/// give the same logits bits; returns the positions row 0 has then done.
int check_same_logits_when_forced(const Shape& shape, const char* name, const char* first, const char* second,
                                  DType logits = DType::kFloat32, const ForcedRun& run = short_rows()) {
  TinySetup setup(shape);
  const auto model_with = [&](const char* value) {
    const ScopedEnv scoped(name, value);
    return std::make_unique<LlamaModel>(setup.tiny->weights,
                                        options_of(run.pool, run.max_seq_len, run.max_tokens, logits));
  };
  const std::unique_ptr<LlamaModel> model_a = model_with(first), model_b = model_with(second);
  LlamaSequences s = reference::random_llama_sequences(std::vector<int>(run.rows, run.length), shape.vocab,
                                                       run.pool, run.max_seq_len, 1.0, setup.rng.engine());
  const auto every_row = [](int) { return true; };
  const auto even_rows = [](int row) { return row % 2 == 0; };
  int forward = 0;
  for (const auto& [per_row, who] : run.schedule) {
    CAPTURE(forward);
    CAPTURE(per_row);
    const LlamaForwardInputs in = who == 2 ? step_inputs(s, per_row, every_row, setup.rng.engine())
                                           : step_inputs(s, per_row, even_rows, setup.rng.engine());
    DeviceBatch batch(in, shape.vocab, logits, setup.stream);
    const bool captured = forward % 2 == 1;
    const std::vector<uint8_t> a = run_forward(*model_a, batch, captured, setup.stream);
    const std::vector<uint8_t> b = run_forward(*model_b, batch, captured, setup.stream);
    CHECK_MESSAGE(a == b, "forward " << forward << ": " << name << " = " << second << " changed the logits");
    ++forward;
  }
  return s.done[0];
}

/// Shapes of the attention kernel-choice cases: 3 query heads a KV head (head_dim 32), 2 (head_dim 32), and 2
/// with head_dim 128.
const Shape kAttentionShapes[] = {{2, 192, 6, 2, 256, 300, true, GgufType::kQ4_1, GgufType::kQ8_0},
                                  {2, 128, 4, 2, 256, 300, true, GgufType::kQ4_1, GgufType::kQ8_0},
                                  {1, 256, 2, 1, 256, 300, false, GgufType::kQ8_0, GgufType::kF16}};

TEST_CASE("llama forward: grouped attention blocks give the per-query blocks' bits") {
  // The attention launch takes a block per query for small launches and a block per (row, KV head, group of
  // up to 16 queries) for large ones (llama_attention.cu); SMCGRAPH_ATTENTION_GROUPING forces either. Both
  // run each query's arithmetic in the same order, so two models forced each way, fed the same forwards
  // (prefills of 1-9 chunks of positions: one chunk a warp, where the grouped block loads the positions once,
  // and more, where each query loads its own; the 270-token prefill's last queries see 9 chunks, so warp 0
  // takes two; verify blocks; decodes; padding rows; graphs), give the same logits bits. Shapes: 3 query
  // heads a KV head (head_dim 32), 2 (head_dim 32), and 2 with head_dim 128 (kAttentionShapes).
  for (const Shape& shape : kAttentionShapes) {
    CAPTURE(shape.hidden);
    CAPTURE(shape.heads);
    const int done =
        check_same_logits_when_forced(shape, "SMCGRAPH_ATTENTION_GROUPING", "per_query", "grouped");
    CHECK(done > 8 * 32); // more than 8 chunks of 32 positions: several a warp
    // Rows of several splits (more than 512 positions): both kernels fold each split and then the splits.
    const int long_done = check_same_logits_when_forced(shape, "SMCGRAPH_ATTENTION_GROUPING", "per_query",
                                                        "grouped", DType::kFloat32, long_rows());
    CHECK(long_done > 512);
  }
}

TEST_CASE("llama forward: split-KV attention blocks give the bits of one block a token") {
  // A launch of up to 64 tokens with rows of up to more than 512 positions gives a token's splits blocks of
  // their own (llama_attention.cu: split_blocks; grouped blocks: a group's splits), whose states the token's
  // (the group's) last block folds in split order;
  // SMCGRAPH_ATTENTION_SPLIT=off folds every split in one block. The same order either way, so the same bits:
  // decodes and a 4-token verify block over rows of 2-3 splits, padding rows, graphs (replays find the
  // tickets reset). Shapes: head_dim 32 (3 and 2 query heads a KV head) and 128 (kAttentionShapes).
  for (const Shape& shape : kAttentionShapes) {
    CAPTURE(shape.hidden);
    CHECK(check_same_logits_when_forced(shape, "SMCGRAPH_ATTENTION_SPLIT", "off", "by_size", DType::kFloat32,
                                        long_rows()) > 512);
    // Grouped blocks (forced) split the same way: a (row, group, KV head) of several splits takes blocks of
    // its own, the group's last block folding its queries' splits.
    const ScopedEnv grouped("SMCGRAPH_ATTENTION_GROUPING", "grouped");
    CHECK(check_same_logits_when_forced(shape, "SMCGRAPH_ATTENTION_SPLIT", "off", "by_size", DType::kFloat32,
                                        long_rows()) > 512);
  }
}

/// Shapes that exercise the GEMMs' K order (4 slices of 16-wide tiles, two partials a slice): hidden 192 (K
/// of 3 whole pipeline chunks), 96 (6 K tiles, so the fourth slice is empty; down K 160: 10 tiles, a one-tile
/// last slice whose odd partial stays zero) and 256 with head_dim 128.
const Shape kKOrderShapes[] = {{2, 192, 6, 2, 256, 300, true, GgufType::kQ4_1, GgufType::kQ8_0},
                               {2, 96, 3, 1, 160, 300, true, GgufType::kQ4_1, GgufType::kQ8_0},
                               {1, 256, 2, 1, 256, 300, false, GgufType::kQ8_0, GgufType::kF16}};

/// check_same_logits_when_forced over every kKOrderShapes shape, with fp32 and with bf16 logits.
void check_k_order_shapes_when_forced(const char* name, const char* first, const char* second) {
  for (const Shape& shape : kKOrderShapes) {
    CAPTURE(shape.hidden);
    for (const DType logits : {DType::kFloat32, DType::kBFloat16}) {
      const int logits_dtype = static_cast<int>(logits);
      CAPTURE(logits_dtype);
      check_same_logits_when_forced(shape, name, first, second, logits);
    }
  }
}

TEST_CASE("llama forward: the pipelined GEMM tiles give the narrow and wide tiles' bits") {
  // The layer GEMMs of 256+ tokens (gate/up: 128+) take K-pipelined tiles (llama_gemm.cu), smaller ones
  // narrow tiles, and those past 384 tokens without the pipelined tiles wide ones; all sum K in the same
  // order, so a token's logits are the same bits whichever ran. Two models forced each way
  // (SMCGRAPH_GEMM_TILES: narrow_wide, pipelined at every size), fed the same forwards (a prefill of 6 x 270
  // tokens: wide tiles; verify blocks of 30 and 54 tokens: narrow, paired gate/up columns; decodes; padding
  // rows; graphs), give the same logits bits. Shapes: hidden 192 (K of 3 whole pipeline chunks), 96 (1.5
  // chunks: 6 K tiles, so the fourth slice is empty; down K 160: a short last slice) and head_dim 128.
  for (const Shape& shape : kKOrderShapes) {
    CAPTURE(shape.hidden);
    CAPTURE(shape.ffn);
    check_same_logits_when_forced(shape, "SMCGRAPH_GEMM_TILES", "narrow_wide", "pipelined");
  }
}

TEST_CASE("llama forward: 8-warp narrow GEMM blocks give the 4-warp blocks' bits") {
  // A narrow GEMM block (up to 384 tokens) runs a warp per K slice, whose two partial accumulators take the
  // slice's even and odd tiles, or (by default) a warp per partial accumulator: the same chains summed in the
  // same order (llama_gemm.cu), so two models forced each way (SMCGRAPH_GEMM_NARROW_WARPS: 4, 8), fed the
  // same forwards (decodes of 6 rows; verify blocks of 30 and 54 tokens: paired gate/up columns; padding
  // rows; graphs), give the same logits bits. Shapes: hidden 192, 96 (6 K tiles: the fourth slice is empty;
  // down K 160: 10 tiles, so the last slice has one and its odd partial stays zero) and 256 with head_dim
  // 128; fp32 and bf16 logits.
  check_k_order_shapes_when_forced("SMCGRAPH_GEMM_NARROW_WARPS", "4", "8");
}

TEST_CASE("llama forward: ldmatrix fragments give wmma's bits") {
  // The narrow GEMM blocks with their W rows in shared memory (8 warps up to 16 tokens, 4 warps beyond) load
  // their tensor-core fragments with ldmatrix and run m16n8k16 MMAs (the default), or with wmma
  // (SMCGRAPH_GEMM_FRAGMENTS): the same HMMA steps on the same tiles in the same order, so two models forced
  // each way, fed the same forwards (decodes of 6 rows with padding rows: one column fragment a block;
  // 12-token verify blocks: paired gate/up columns in 8-warp blocks; 30- and 54-token blocks: 4-warp blocks,
  // a warp's two partials, paired columns at 54; graphs), give the same logits bits. Shapes: hidden 192, 96
  // (the fourth K slice empty; down K 160: the last slice one tile, its odd partial zero) and 256 with
  // head_dim 128; fp32 and bf16 logits.
  check_k_order_shapes_when_forced("SMCGRAPH_GEMM_FRAGMENTS", "wmma", "ldmatrix");
}

TEST_CASE("llama forward: A rows staged through registers give cp.async's bits") {
  // The narrow and wide GEMM blocks stage the O and down projections' bf16 input rows in shared memory
  // through registers (the default) or with cp.async (SMCGRAPH_GEMM_A_STAGING): the same bytes, so two models
  // forced each way, fed the same forwards (decodes of 6 rows with padding rows, verify blocks of 30 and 54
  // tokens, graphs), give the same logits bits. Shapes: hidden 192, 96 and 256 with head_dim 128 (O K 192,
  // 96, 256; down K 256, 160, 256: one vector batch a lane, lanes without a vector); fp32 and bf16 logits.
  // Then the wide blocks (64 rows, 4 warps: a warp stages two row pairs): prefills of 500 tokens with the
  // pipelined tiles off.
  check_k_order_shapes_when_forced("SMCGRAPH_GEMM_A_STAGING", "cp_async", "registers");
  // A down projection of K 2,304 (288 vectors a row: a lane's second batch of vectors).
  check_same_logits_when_forced(Shape{1, 128, 4, 2, 2304, 300, true, GgufType::kQ4_1, GgufType::kQ8_0},
                                "SMCGRAPH_GEMM_A_STAGING", "cp_async", "registers");
  const ScopedEnv wide("SMCGRAPH_GEMM_TILES", "narrow_wide");
  check_same_logits_when_forced(kKOrderShapes[0], "SMCGRAPH_GEMM_A_STAGING", "cp_async", "registers",
                                DType::kFloat32, long_rows());
}

TEST_CASE("llama forward: early PDL triggers give the same bits") {
  // SMCGRAPH_LLAMA_TRIGGER=early_o_down (the default) lets the O and down launches start their successors at
  // their top, early the attention launches too, early_all the QKV launches too, early_max every layer launch
  // (llama_model.cu): the same kernels and
  // arithmetic, only the launch order's overlap changes, so the logits of decodes, verify blocks, padding
  // rows and graphs are the same bits (a read before a wait that the early start made stale would change
  // them).
  for (const Shape& shape : kKOrderShapes) {
    CAPTURE(shape.hidden);
    check_same_logits_when_forced(shape, "SMCGRAPH_LLAMA_TRIGGER", "after_wait", "early_o_down");
    check_same_logits_when_forced(shape, "SMCGRAPH_LLAMA_TRIGGER", "after_wait", "early");
    check_same_logits_when_forced(shape, "SMCGRAPH_LLAMA_TRIGGER", "after_wait", "early_all");
    check_same_logits_when_forced(shape, "SMCGRAPH_LLAMA_TRIGGER", "after_wait", "early_max");
  }
}

TEST_CASE("llama forward: weights marked streaming in L2 give the same bits") {
  // SMCGRAPH_LLAMA_WEIGHT_CACHE=streaming (the default) launches the GEMMs and the small LM heads with an
  // access-policy window that marks their weights streaming in L2 (llama_model.cu): a cache hint, so the
  // logits of decodes, verify blocks, padding rows and graphs are the same bits as without it.
  for (const Shape& shape : kKOrderShapes) {
    CAPTURE(shape.hidden);
    check_same_logits_when_forced(shape, "SMCGRAPH_LLAMA_WEIGHT_CACHE", "normal", "streaming");
  }
}

/// One forward of `model` over `batch` captured into a graph (not run): how many of its kernel nodes carry an
/// access-policy window, each checked to mark its range streaming in L2 for hits and misses. Also checks that
/// the capture left the stream without a window (with_streaming_window puts the old one back).
int streaming_kernel_nodes(LlamaModel& model, DeviceBatch& batch, cudaStream_t stream) {
  const test::CapturedGraph graph =
      test::capture_graph(stream, [&](cudaStream_t s) { model.forward(batch.args(), s); });
  size_t count = 0;
  SMCGRAPH_CUDA_CHECK(cudaGraphGetNodes(graph.get(), nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  SMCGRAPH_CUDA_CHECK(cudaGraphGetNodes(graph.get(), nodes.data(), &count));
  int marked = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    SMCGRAPH_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeKernel)
      continue;
    cudaKernelNodeAttrValue value{};
    SMCGRAPH_CUDA_CHECK(
        cudaGraphKernelNodeGetAttribute(node, cudaKernelNodeAttributeAccessPolicyWindow, &value));
    const cudaAccessPolicyWindow& window = value.accessPolicyWindow;
    if (window.num_bytes == 0)
      continue;
    CHECK(window.hitProp == cudaAccessPropertyStreaming);
    CHECK(window.missProp == cudaAccessPropertyStreaming);
    CHECK(window.base_ptr != nullptr);
    ++marked;
  }
  cudaStreamAttrValue after{};
  SMCGRAPH_CUDA_CHECK(cudaStreamGetAttribute(stream, cudaStreamAttributeAccessPolicyWindow, &after));
  CHECK_MESSAGE(after.accessPolicyWindow.num_bytes == 0, "the forward left a window on its stream");
  return marked;
}

TEST_CASE("llama forward: a captured forward's GEMMs and LM head carry the streaming window") {
  // SMCGRAPH_LLAMA_WEIGHT_CACHE=streaming: each layer's four GEMM launches and the LM head carry a window
  // over their weights, in a captured graph's kernel nodes too. A decode of 6 rows takes the small head (a
  // launch attribute); a verify block of 6 x 5 tokens takes cuBLASLt, which takes no launch attribute: its
  // kernel gets the window from the stream for the call (with_streaming_window). normal marks nothing.
  const Shape shape = kKOrderShapes[0];
  TinySetup setup(shape);
  const ScopedEnv head("SMCGRAPH_LM_HEAD", "by_size");
  const auto model_with = [&](const char* value) {
    const ScopedEnv scoped("SMCGRAPH_LLAMA_WEIGHT_CACHE", value);
    return std::make_unique<LlamaModel>(setup.tiny->weights, options_of(4096, 512, 64, DType::kFloat32));
  };
  const std::unique_ptr<LlamaModel> streaming = model_with("streaming"), normal = model_with("normal");
  const bool windows = smcgraph::current_device_info().access_policy_max_window_bytes > 0;
  LlamaSequences s = reference::random_llama_sequences(std::vector<int>(6, 64), shape.vocab, 4096, 512, 1.0,
                                                       setup.rng.engine());
  for (const int per_row : {1, 5}) {
    CAPTURE(per_row);
    const LlamaForwardInputs in = step_inputs(
        s, per_row, [](int) { return true; }, setup.rng.engine());
    DeviceBatch batch(in, shape.vocab, DType::kFloat32, setup.stream);
    CHECK(streaming_kernel_nodes(*streaming, batch, setup.stream) == (windows ? 4 * shape.layers + 1 : 0));
    CHECK(streaming_kernel_nodes(*normal, batch, setup.stream) == 0);
  }
}

TEST_CASE("llama forward: the small LM head gives cuBLASLt's bits") {
  // Forwards of up to 16 head rows take the small head (llama_head.cu: one kernel that normalises its rows
  // and chains one m16n8k16 MMA per 16 of K, the order of the pinned cuBLASLt matmul), larger ones the norm
  // kernel and cuBLASLt; the model checks the small head's bits against cuBLASLt's at construction and
  // leaves it off where they differ, so here it must be on. Two models, SMCGRAPH_LM_HEAD=small_bf16 (the
  // small head without the int8 head, which by_size takes for Q8_0 heads: next case) and cublaslt, fed the
  // same forwards (decodes of 6 rows: 8-token variant; 2 tokens a row: 16; 5, 9 and 270: cuBLASLt in both;
  // padding rows; graphs), give the same logits bits, fp32 and bf16. Shapes: hidden 192 with a vocabulary of
  // 300 (the last block's rows past it), 96 and 256.
  if (const char* head = std::getenv("SMCGRAPH_LM_HEAD");
      head != nullptr && std::string(head) == "own_gemm") {
    const Shape shape{1, 128, 4, 2, 256, 300, true, GgufType::kQ4_1, GgufType::kQ8_0};
    TinySetup setup(shape);
    const LlamaModel model(setup.tiny->weights, options_of(256, 64, 64, DType::kFloat32));
    CHECK(std::string(model.lm_head_kernel(1)) == "own_gemm"); // the small head is part of the cuBLASLt head
    return;
  }
  const Shape shapes[] = {{2, 192, 6, 2, 256, 300, true, GgufType::kQ4_1, GgufType::kQ8_0},
                          {2, 96, 3, 1, 160, 320, true, GgufType::kQ4_1, GgufType::kQ8_0},
                          {1, 256, 2, 1, 256, 300, false, GgufType::kQ8_0, GgufType::kF16}};
  for (const Shape& shape : shapes) {
    CAPTURE(shape.hidden);
    for (const DType logits : {DType::kFloat32, DType::kBFloat16}) {
      const int logits_dtype = static_cast<int>(logits);
      CAPTURE(logits_dtype);
      {
        TinySetup setup(shape);
        const ScopedEnv small("SMCGRAPH_LM_HEAD", "small_bf16");
        const LlamaModel model(setup.tiny->weights, options_of(256, 64, 64, logits));
        for (int tokens : {1, 8, 9, 16})
          CHECK(std::string(model.lm_head_kernel(tokens)) == "small");
        CHECK(std::string(model.lm_head_kernel(17)) == "cublaslt");
        const ScopedEnv scoped("SMCGRAPH_LM_HEAD", "cublaslt");
        const LlamaModel forced(setup.tiny->weights, options_of(256, 64, 64, logits));
        CHECK(std::string(forced.lm_head_kernel(1)) == "cublaslt");
      }
      check_same_logits_when_forced(shape, "SMCGRAPH_LM_HEAD", "cublaslt", "small_bf16", logits);
    }
  }
}

/// 8 rows, then forwards whose head rows cover both token-fragment counts of the int8 head (8 x 1-2 tokens a
/// row: 1-2 fragments of 8) and cuBLASLt's sizes past it (24 and 800 head rows), some with padding rows.
ForcedRun q8_head_rows() {
  return {8, 220, 4096, 512, 2048, {{100, 2}, {1, 2}, {2, 2}, {2, 0}, {1, 0}, {3, 2}, {1, 2}}};
}

TEST_CASE("llama forward: the int8 LM head gives cuBLASLt's bits") {
  // Where the file stores the head as Q8_0, forwards of up to 16 head rows take the int8 head (llama_head.cu:
  // the small head's MMA chain over bf16(q * scale), the loader's own dequantisation, so its operands and
  // order are the small head's), larger ones cuBLASLt. Two models, by size and SMCGRAPH_LM_HEAD=cublaslt, fed
  // the same forwards (1-2 token fragments, 24 and 800 head rows on cuBLASLt; padding rows; graphs), give
  // the same logits bits, fp32 and bf16. Shapes: a tied Q8_0 head of 300 rows (the last tile's groups past
  // the padded 320 rows are never loaded), hidden 96 (K in 1.5 chunks of 64) and an untied Q8_0 head of
  // hidden 128 with 320 rows; an F16 head leaves the int8 head off (the small head serves).
  const Shape shapes[] = {{2, 192, 6, 2, 256, 300, true, GgufType::kQ4_1, GgufType::kQ8_0},
                          {2, 96, 3, 1, 160, 320, true, GgufType::kQ4_1, GgufType::kQ8_0},
                          {1, 128, 4, 2, 256, 320, false, GgufType::kQ8_0, GgufType::kQ8_0}};
  if (const char* head = std::getenv("SMCGRAPH_LM_HEAD"); head != nullptr && std::string(head) != "by_size")
    return; // a forced head choice (the suite run with SMCGRAPH_LM_HEAD set) leaves nothing to compare
  for (const Shape& shape : shapes) {
    CAPTURE(shape.hidden);
    CAPTURE(shape.tied);
    {
      TinySetup setup(shape);
      const LlamaModel model(setup.tiny->weights, options_of(256, 64, 128, DType::kFloat32));
      for (int tokens : {1, 8, 9, 16})
        CHECK(std::string(model.lm_head_kernel(tokens)) == "small_q8");
      CHECK(std::string(model.lm_head_kernel(17)) == "cublaslt");
      // The floor counts the bytes the int8 head reads: a byte a weight plus a float scale a 32.
      const size_t bf16_head = size_t(shape.vocab) * shape.hidden * 2;
      const size_t q8_head =
          size_t(shape.vocab) * shape.hidden + size_t(shape.vocab) * (shape.hidden / 32) * 4;
      CHECK(model.weight_bytes_per_forward(17) - model.weight_bytes_per_forward(1) == bf16_head - q8_head);
      const ScopedEnv scoped("SMCGRAPH_LM_HEAD", "small_bf16");
      const LlamaModel bf16(setup.tiny->weights, options_of(256, 64, 128, DType::kFloat32));
      CHECK(std::string(bf16.lm_head_kernel(1)) == "small");
    }
    for (const DType logits : {DType::kFloat32, DType::kBFloat16}) {
      const int logits_dtype = static_cast<int>(logits);
      CAPTURE(logits_dtype);
      check_same_logits_when_forced(shape, "SMCGRAPH_LM_HEAD", "cublaslt", "by_size", logits, q8_head_rows());
      check_same_logits_when_forced(shape, "SMCGRAPH_LM_HEAD", "small_bf16", "by_size", logits);
    }
  }
  const Shape f16{1, 256, 2, 1, 256, 300, false, GgufType::kQ8_0, GgufType::kF16};
  TinySetup setup(f16);
  const LlamaModel model(setup.tiny->weights, options_of(256, 64, 64, DType::kFloat32));
  CHECK(std::string(model.lm_head_kernel(1)) == "small");
  CHECK(std::string(model.lm_head_kernel(17)) == "cublaslt");
}

TEST_CASE(
    "llama forward: a model built later with smaller shapes leaves an earlier model's kernels launchable") {
  // A kernel's dynamic shared-memory limit holds for the whole process. The first model here needs more than
  // the default 48 KB in the narrow GEMM of its down projection (K 1024: 70 KB), the small LM head (over 140
  // KB at any size) and attention for head_dim 128; the second one, with smaller shapes, used to set lower
  // limits, so the first model's next forward failed to launch. Its logits must stay the same bits.
  const Shape big{1, 256, 2, 1, 1024, 300, true, GgufType::kQ4_1, GgufType::kQ8_0};
  const Shape later{1, 96, 3, 1, 160, 300, true, GgufType::kQ4_1, GgufType::kQ8_0};
  TinySetup setup(big);
  LlamaModel model(setup.tiny->weights, options_of(1024, 64, 64, DType::kFloat32));
  LlamaSequences s = reference::random_llama_sequences(std::vector<int>(6, 40), big.vocab, 1024, 64, 1.0,
                                                       setup.rng.engine());
  const LlamaForwardInputs in = step_inputs(
      s, 1, [](int) { return true; }, setup.rng.engine());
  DeviceBatch batch(in, big.vocab, DType::kFloat32, setup.stream);
  const std::vector<uint8_t> before = run_forward(model, batch, false, setup.stream);
  {
    TinySetup other(later);
    const LlamaModel smaller(other.tiny->weights, options_of(256, 64, 64, DType::kFloat32));
  }
  std::vector<uint8_t> after;
  REQUIRE_NOTHROW(after = run_forward(model, batch, false, setup.stream));
  CHECK(before == after);
}

TEST_CASE("llama forward: the kernel-choice variables must name a choice") {
  const Shape shape{1, 128, 4, 2, 256, 300, true, GgufType::kQ4_1, GgufType::kQ8_0};
  TinySetup setup(shape);
  for (const char* name :
       {"SMCGRAPH_ATTENTION_GROUPING", "SMCGRAPH_GEMM_TILES", "SMCGRAPH_GEMM_NARROW_WARPS",
        "SMCGRAPH_GEMM_A_STAGING", "SMCGRAPH_GEMM_FRAGMENTS", "SMCGRAPH_LM_HEAD", "SMCGRAPH_ATTENTION_SPLIT",
        "SMCGRAPH_LLAMA_TRIGGER", "SMCGRAPH_LLAMA_WEIGHT_CACHE"}) {
    CAPTURE(name);
    const ScopedEnv scoped(name, "sideways");
    const std::string expected = std::string(name) + " = 'sideways'";
    CHECK_THROWS_WITH_AS(LlamaModel(setup.tiny->weights, options_of(256, 64, 64, DType::kFloat32)),
                         doctest::Contains(expected.c_str()), smcgraph::Error);
  }
}

TEST_CASE("llama forward: tokens, positions, out slots and logits with a row stride give the dense forward's "
          "logits") {
  // The engine's draft steps read d_k from column k of its [rows, K + 1] draft block; its verify forward over
  // W <= K + 1 columns reads and writes all of its [rows, K + 1] blocks with that stride.
  const Shape shape{2, 64, 4, 2, 96, 300, true, GgufType::kQ4_1, GgufType::kQ8_0};
  TinySetup setup(shape);
  test::Rng& rng = setup.rng;
  Stream& stream = setup.stream;
  const std::unique_ptr<Tiny>& tiny = setup.tiny;
  LlamaModel model(tiny->weights, options_of(256, 64, 64, DType::kFloat32));
  LlamaSequences s =
      reference::random_llama_sequences(std::vector<int>(5, 30), shape.vocab, 256, 64, 0.7, rng.engine());
  const auto every_row = [](int) { return true; };
  for (int per_row : {9, 1, 5, 2}) {
    CAPTURE(per_row);
    const LlamaForwardInputs in = step_inputs(s, per_row, every_row, rng.engine());
    DeviceBatch batch(in, shape.vocab, DType::kFloat32, stream);
    const std::vector<uint8_t> dense = run_forward(model, batch, false, stream);
    const int64_t stride = per_row + 2;
    test::StridedForward strided(in.tokens, in.positions, in.out_slots, in.rows, per_row, stride,
                                 static_cast<size_t>(shape.vocab) * sizeof(float), stream);
    for (bool captured : {false, true}) {
      for (bool io_strided : {false, true}) {
        CAPTURE(captured);
        CAPTURE(io_strided);
        batch.logits.fill_bytes(kPoison, stream);
        const ForwardArgs args = strided.args(batch.args(), io_strided, kPoison, stream);
        test::run_on_stream(captured, stream, [&](cudaStream_t st) { model.forward(args, st); });
        bool rest_untouched = true;
        const std::vector<uint8_t> got =
            io_strided ? strided.dense_logits(kPoison, rest_untouched, stream) : batch.download(stream);
        if (io_strided && !rest_untouched) { // the cuBLASLt head writes zero logits past tokens_per_row
          const std::vector<uint8_t> raw =
              test::to_host(strided.logits.data(), strided.logits.size(), stream);
          for (int row = 0; row < in.rows; ++row)
            for (int64_t j = per_row; j < stride; ++j) {
              const auto begin = raw.begin() + (row * stride + j) * strided.row_bytes;
              const bool poison =
                  std::all_of(begin, begin + strided.row_bytes, [](uint8_t b) { return b == kPoison; });
              const bool zeros =
                  std::all_of(begin, begin + strided.row_bytes, [](uint8_t b) { return b == 0; });
              CHECK_MESSAGE((poison || zeros), "row "
                                                   << row << " column " << j
                                                   << " past tokens_per_row holds neither poison nor zeros");
            }
        }
        CHECK_MESSAGE(got == dense, "the strided forward's logits differ from the dense one");
      }
    }
  }
}

TEST_CASE(
    "llama forward: last_token_logits gives the bits of each row's last column and writes nothing else") {
  // The engine's draft head samples from its last column only; with last_token_logits the LM head reads the
  // last token of each row (rows GEMM rows, not rows x tokens_per_row) and writes a dense [rows, V].
  const Shape shape{2, 64, 4, 2, 96, 300, true, GgufType::kQ4_1, GgufType::kQ8_0};
  TinySetup setup(shape);
  test::Rng& rng = setup.rng;
  Stream& stream = setup.stream;
  constexpr int kRows = 6, kPool = 256, kMaxSeqLen = 64;
  LlamaSequences s = reference::random_llama_sequences(std::vector<int>(kRows, 20), shape.vocab, kPool,
                                                       kMaxSeqLen, 0.7, rng.engine());
  const auto all_but_row_2 = [](int row) { return row != 2; }; // row 2 is padding
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    LlamaModel model(setup.tiny->weights, options_of(kPool, kMaxSeqLen, 64, dtype));
    REQUIRE(model.last_token_logits_supported());
    const size_t row_bytes = static_cast<size_t>(shape.vocab) * smcgraph::dtype_bytes(dtype);
    for (int per_row : {2, 5, 1}) {
      CAPTURE(per_row);
      const LlamaForwardInputs in = step_inputs(s, per_row, all_but_row_2, rng.engine());
      DeviceBatch batch(in, shape.vocab, dtype, stream);
      const std::vector<uint8_t> full = run_forward(model, batch, false, stream);
      for (bool captured : {false, true}) {
        CAPTURE(captured);
        batch.logits.fill_bytes(kPoison, stream); // [rows, per_row, V] of poison: only [rows, V] may change
        ForwardArgs args = batch.args();
        args.last_token_logits = true;
        test::run_on_stream(captured, stream, [&](cudaStream_t st) { model.forward(args, st); });
        const std::vector<uint8_t> got = batch.download(stream);
        for (int row = 0; row < kRows; ++row) {
          CAPTURE(row);
          const uint8_t* last = got.data() + row * row_bytes;
          if (!in.live[row]) { // untouched (own LM head) or finite logits (cuBLASLt head): padding_problem
            continue;
          }
          const uint8_t* want = full.data() + (static_cast<size_t>(row) * per_row + per_row - 1) * row_bytes;
          CHECK_MESSAGE(std::memcmp(last, want, row_bytes) == 0,
                        "the last-token logits differ from the full forward's last column");
        }
        CHECK_MESSAGE(
            std::all_of(got.begin() + kRows * row_bytes, got.end(), [](uint8_t b) { return b == kPoison; }),
            "the last-token forward wrote past [rows, V]");
        const std::vector<uint8_t> dense(got.begin(), got.begin() + kRows * row_bytes);
        LlamaForwardInputs rows_only = in;
        rows_only.tokens_per_row = 1;
        const std::string padding = padding_problem(rows_only, dense, dtype);
        CHECK_MESSAGE(padding.empty(), padding);
      }
    }
  }
}

TEST_CASE("llama forward: argument errors and option validation") {
  Stream stream;
  const Shape shape{3, 64, 4, 2, 96, 300, true, GgufType::kQ4_1, GgufType::kQ8_0};
  const std::unique_ptr<Tiny> tiny = make_tiny(spec_of(shape, 7, 256));
  LlamaModel model(tiny->weights, options_of(64, 32, 16, DType::kFloat32));
  CHECK(model.vocab() == 300);
  CHECK(model.max_seq_len() == 32);
  CHECK(model.layers() == std::vector<int>{0, 1, 2});
  CHECK(model.launches_per_forward() >= 2 + 3 * 5);
  CHECK(model.weight_bytes_per_forward() > static_cast<size_t>(300) * 64 * 2);
  CHECK(tiny->weights->device_bytes() > 0);

  test::Rng rng(5);
  LlamaSequences s = reference::random_llama_sequences({8, 8, 8, 8}, 300, 64, 32, 1.0, rng.engine());
  const LlamaForwardInputs in = s.next(5, rng.engine()); // 4 x 5 = 20 tokens > 16
  DeviceBatch batch(in, 300, DType::kFloat32, stream);
  auto message_of = [&](const ForwardArgs& args) -> std::string {
    try {
      model.forward(args, stream);
    } catch (const smcgraph::Error& e) {
      return e.what();
    }
    return "no error";
  };
  std::string e = message_of(batch.args());
  CHECK_MESSAGE(e.find("max_tokens_per_forward") != std::string::npos, e);
  ForwardArgs fits = batch.args();
  fits.rows = 3; // 15 tokens fit
  CHECK_NOTHROW(model.forward(fits, stream));
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  ForwardArgs narrow = fits;
  narrow.token_row_stride = 4; // < tokens_per_row = 5
  e = message_of(narrow);
  CHECK_MESSAGE(e.find("args.token_row_stride = 4") != std::string::npos, e);
  narrow = fits;
  narrow.io_row_stride = 3; // < tokens_per_row = 5
  e = message_of(narrow);
  CHECK_MESSAGE(e.find("args.io_row_stride = 3") != std::string::npos, e);
  for (int which = 0; which < 7; ++which) {
    CAPTURE(which);
    ForwardArgs args = fits;
    switch (which) {
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
    e = message_of(args);
    CHECK_MESSAGE(e.find("pointer") != std::string::npos, e);
  }
  ForwardArgs bad = fits;
  bad.tokens_per_row = 0;
  CHECK_THROWS_AS(model.forward(bad, stream), smcgraph::Error);
  bad = fits;
  bad.rows = 0; // a no-op
  CHECK_NOTHROW(model.forward(bad, stream));

  auto construction_error = [&](const LlamaModelOptions& options) -> std::string {
    try {
      LlamaModel m(tiny->weights, options);
    } catch (const smcgraph::Error& error) {
      return error.what();
    }
    return "no error";
  };
  e = construction_error(options_of(64, 32, 16, DType::kFloat32, {1, 0}));
  CHECK_MESSAGE(e.find("layers") != std::string::npos, e);
  e = construction_error(options_of(64, 32, 16, DType::kFloat32, {0, 3}));
  CHECK_MESSAGE(e.find("layers") != std::string::npos, e);
  e = construction_error(options_of(64, 32, 16, DType::kFloat32, {2, 2}));
  CHECK_MESSAGE(e.find("layers") != std::string::npos, e);
  e = construction_error(options_of(1, 32, 16, DType::kFloat32));
  CHECK_MESSAGE(e.find("pool_size") != std::string::npos, e);
  e = construction_error(options_of(64, 257, 16, DType::kFloat32)); // context 256
  CHECK_MESSAGE(e.find("max_seq_len") != std::string::npos, e);
  e = construction_error(options_of(64, 32, 16, DType::kFloat16));
  CHECK_MESSAGE(e.find("logits_dtype") != std::string::npos, e);
  e = construction_error(options_of(64, 32, 0, DType::kFloat32));
  CHECK_MESSAGE(e.find("max_tokens_per_forward") != std::string::npos, e);
  CHECK_THROWS_AS(LlamaModel(nullptr, options_of(64, 32, 16, DType::kFloat32)), smcgraph::Error);
}

namespace {

constexpr int kEnginePool = 1 << 13, kEngineMaxSeqLen = 160, kEngineMaxTokens = 256;

/// A target (all layers) and a layer-subset draft over one tiny model, with their own KV.
/// The tiny target and a draft of its first layers (two by default); with `share_kv` the draft reads and
/// writes the target's KV (LlamaModelOptions::kv_owner), so the target's verify may resume after the draft's
/// layers.
struct PrefixPair {
  LlamaModel target, draft;
  explicit PrefixPair(const Tiny& tiny, bool share_kv = true, std::vector<int> draft_layers = {0, 1})
      : target(tiny.weights, options_of(kEnginePool, kEngineMaxSeqLen, kEngineMaxTokens, DType::kFloat32)),
        draft(tiny.weights, [&] {
          LlamaModelOptions o = options_of(kEnginePool, kEngineMaxSeqLen, kEngineMaxTokens, DType::kFloat32,
                                           std::move(draft_layers));
          if (share_kv)
            o.kv_owner = &target;
          return o;
        }()) {}
};

struct LlamaPair {
  std::unique_ptr<LlamaModel> draft, target;
  explicit LlamaPair(const Tiny& tiny) {
    target = std::make_unique<LlamaModel>(
        tiny.weights, options_of(kEnginePool, kEngineMaxSeqLen, kEngineMaxTokens, DType::kFloat32));
    draft = std::make_unique<LlamaModel>(
        tiny.weights, options_of(kEnginePool, kEngineMaxSeqLen, kEngineMaxTokens, DType::kFloat32, {0, 2}));
  }
};

smcgraph::EngineConfig engine_config(smcgraph::CycleKind kind, int vocab) {
  smcgraph::EngineConfig c;
  c.kind = kind;
  c.vocab = vocab;
  c.max_seq_len = kEngineMaxSeqLen;
  c.slot_pool_size = kEnginePool;
  return c;
}

/// An SMC engine of 4 particles on the tiny models, sampling (draft T 0.9, target T 1).
smcgraph::EngineConfig smc_config(int vocab, int draft_steps, int max_requests) {
  smcgraph::EngineConfig c = engine_config(smcgraph::CycleKind::kSmc, vocab);
  c.particles = 4;
  c.draft_steps = draft_steps;
  c.max_requests = max_requests;
  c.draft_temperature = 0.9f;
  c.target_temperature = 1.0f;
  return c;
}

/// Whether each generated token is the target's greedy choice given the prompt and the tokens before it:
/// one teacher-forced forward of the whole sequence on a separate target model. A token other than the
/// argmax is excused when within the logit tolerance of it (the engine's forwards batch differently).
struct GreedyCheck {
  int tokens = 0, exact = 0, near_ties = 0;
  std::string problem;
};
void check_greedy(LlamaModel& checker, const std::vector<int32_t>& prompt,
                  const std::vector<int32_t>& generated, GreedyCheck& check, cudaStream_t stream) {
  const int P = static_cast<int>(prompt.size()), G = static_cast<int>(generated.size());
  const int vocab = checker.vocab(), max_seq_len = checker.max_seq_len();
  LlamaForwardInputs in;
  in.rows = 1;
  in.tokens_per_row = P + G - 1;
  in.tokens = prompt;
  in.tokens.insert(in.tokens.end(), generated.begin(), generated.end() - 1);
  in.slot_table.assign(max_seq_len, 0);
  for (int p = 0; p < in.tokens_per_row; ++p) {
    in.positions.push_back(p);
    in.out_slots.push_back(p + 1);
    in.slot_table[p] = p + 1;
  }
  in.seq_lens = {in.tokens_per_row};
  in.live = {1};
  DeviceBatch batch(in, vocab, DType::kFloat32, stream);
  const std::vector<double> logits =
      decode_logits(run_forward(checker, batch, false, stream), DType::kFloat32);
  for (int i = 0; i < G; ++i) {
    const double* l = logits.data() + static_cast<size_t>(P - 1 + i) * vocab;
    const int top = static_cast<int>(std::max_element(l, l + vocab) - l);
    ++check.tokens;
    if (generated[i] == top) {
      ++check.exact;
      continue;
    }
    const double gap = l[top] - l[generated[i]];
    if (generated[i] >= 0 && generated[i] < vocab &&
        gap <= reference::kLlamaLogitTolerance * std::max(1.0, std::abs(l[top]))) {
      ++check.near_ties;
    } else if (check.problem.empty()) {
      check.problem = "token " + std::to_string(i) + " = " + std::to_string(generated[i]) + ", greedy " +
                      std::to_string(top) + " (gap " + std::to_string(gap) + ")";
    }
  }
}

/// Greedy decoding through `engine` in buckets of 1, 2, 4 and 8 requests (prompts 0, 1-2, 3-6, 7-14), each
/// request's first `new_tokens` tokens checked against the checker's teacher-forced greedy choice, and the
/// slot invariants checked after every cycle. `pin(i)` is prompt i's RequestParams::draft_steps; `on_cycle`
/// sees each cycle's updates. Returns the tokens in prompt order.
std::vector<std::vector<int32_t>>
greedy_buckets(smcgraph::Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int new_tokens,
               LlamaModel& checker, GreedyCheck& check, cudaStream_t checker_stream,
               const std::function<int(size_t)>& pin,
               const std::function<void(const std::vector<smcgraph::RequestUpdate>&)>& on_cycle) {
  std::vector<std::vector<int32_t>> outputs;
  size_t next_prompt = 0;
  for (int bucket : {1, 2, 4, 8}) {
    std::vector<smcgraph::RequestId> ids;
    std::vector<size_t> prompt_of;
    for (int i = 0; i < bucket; ++i) {
      prompt_of.push_back(next_prompt);
      ids.push_back(engine.admit(prompts[next_prompt],
                                 {.seed = 1, .max_new_tokens = new_tokens, .draft_steps = pin(next_prompt)}));
      ++next_prompt;
    }
    CHECK(engine.current_bucket() == bucket);
    std::set<smcgraph::RequestId> open(ids.begin(), ids.end());
    while (!open.empty()) {
      engine.step();
      const std::vector<smcgraph::RequestUpdate> updates = engine.poll();
      for (const smcgraph::RequestUpdate& update : updates) {
        REQUIRE_FALSE(update.failed);
        if (update.finished)
          open.erase(update.id);
      }
      on_cycle(updates);
      const smcgraph::SlotCheck slots = test::check_invariants(engine);
      REQUIRE_MESSAGE(slots.ok, slots.problem);
    }
    for (int i = 0; i < bucket; ++i) {
      const smcgraph::RequestResult result = engine.result(ids[i]);
      REQUIRE(result.tokens.size() >= static_cast<size_t>(new_tokens));
      const std::vector<int32_t> generated(result.tokens.begin(), result.tokens.begin() + new_tokens);
      check_greedy(checker, prompts[prompt_of[i]], generated, check, checker_stream);
      outputs.push_back(generated);
      engine.release(ids[i]);
    }
  }
  CHECK_MESSAGE(check.problem.empty(), check.problem);
  CHECK(check.near_ties * 10 <= check.tokens); // the engine's and the checker's forwards batch differently
  CHECK(test::check_invariants(engine).free == engine.config().slot_pool_size - 1);
  return outputs;
}

/// The greedy engine tests' setup: a tiny 3-layer model, its teacher-forced checker, 15 prompts (buckets of
/// 1, 2, 4 and 8 requests) and a greedy speculative config with K_max = 4.
struct GreedySetup {
  test::Rng rng;
  const Shape shape{3, 128, 4, 2, 256, 512, true, GgufType::kQ4_1, GgufType::kQ8_0};
  std::unique_ptr<Tiny> tiny;
  std::unique_ptr<LlamaModel> checker;
  Stream checker_stream;
  // Racecheck: 8 tokens (two cycles at K 4, every bucket still). At 16 the greedy layer-subset case ran past
  // 420 s alone and the adaptive K 0 case took 420 s (NVIDIA H100, one case a cell, 20 cells side by side).
  const int new_tokens = test::sanitizer_scaled(48, 48, 8);
  std::vector<std::vector<int32_t>> prompts;
  smcgraph::EngineConfig config;

  GreedySetup() {
    MESSAGE("seed ", rng.seed());
    tiny = make_tiny(spec_of(shape, rng.bits()));
    checker = std::make_unique<LlamaModel>(
        tiny->weights, options_of(256, kEngineMaxSeqLen, kEngineMaxTokens, DType::kFloat32));
    for (int i = 0; i < 8 + 4 + 2 + 1; ++i)
      prompts.push_back(test::random_prompt(rng, shape.vocab, 32));
    config = engine_config(smcgraph::CycleKind::kSpeculative, shape.vocab);
    config.particles = 1;
    config.draft_steps = 4;
    config.max_requests = 8;
    config.draft_temperature = 0.0f;
    config.target_temperature = 0.0f;
  }
  std::vector<std::vector<int32_t>>
  run(smcgraph::Engine& engine, GreedyCheck& check, const std::function<int(size_t)>& pin,
      const std::function<void(const std::vector<smcgraph::RequestUpdate>&)>& on_cycle) {
    return greedy_buckets(engine, prompts, new_tokens, *checker, check, checker_stream, pin, on_cycle);
  }
};

} // namespace

TEST_CASE(
    "llama engine: greedy speculative decoding with a layer-subset draft is the target's greedy decoding") {
  GreedySetup setup;
  std::vector<std::vector<int32_t>> first_run;
  for (bool graphs : {true, false}) {
    smcgraph::EngineConfig config = setup.config;
    config.use_graphs = graphs;
    LlamaPair models(*setup.tiny);
    smcgraph::Engine engine(config, *models.draft, *models.target);
    GreedyCheck check;
    long accepted = 0, cycles = 0;
    const std::vector<std::vector<int32_t>> outputs = setup.run(
        engine, check, [](size_t) { return -1; },
        [&](const std::vector<smcgraph::RequestUpdate>& updates) {
          ++cycles;
          for (const smcgraph::RequestUpdate& update : updates)
            accepted += static_cast<long>(update.tokens[0].size()) - 1;
        });
    MESSAGE(std::string(graphs ? "graphed" : "eager"), ": ", check.tokens, " tokens, ", check.exact,
            " the teacher-forced argmax, ", check.near_ties,
            " near ties; mean accepted draft tokens per cycle ",
            static_cast<double>(accepted) / std::max<long>(1, cycles));
    if (first_run.empty())
      first_run = outputs;
    else
      CHECK(outputs == first_run); // graph and eager run the same kernels on the same inputs
  }
}

TEST_CASE("llama engine: SMC cycles with a layer-subset draft keep the slot invariants") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const Shape shape{3, 64, 4, 2, 96, 400, true, GgufType::kQ4_1, GgufType::kQ8_0};
  const std::unique_ptr<Tiny> tiny = make_tiny(spec_of(shape, rng.bits()));
  const smcgraph::EngineConfig config = smc_config(shape.vocab, 4, 4);
  LlamaPair models(*tiny);
  smcgraph::Engine engine(config, *models.draft, *models.target);
  std::vector<smcgraph::RequestId> ids;
  for (int i = 0; i < 3; ++i)
    ids.push_back(engine.admit(test::random_prompt(rng, shape.vocab, 20), {.seed = rng.bits()}));
  REQUIRE(test::check_invariants(engine).ok);
  for (int c = 0; c < 20; ++c) {
    CAPTURE(c);
    const std::vector<smcgraph::RequestUpdate> updates = test::cycle(engine);
    REQUIRE(updates.size() == ids.size());
    for (const smcgraph::RequestUpdate& update : updates) {
      CHECK_FALSE(update.failed);
      REQUIRE(update.tokens.size() == static_cast<size_t>(config.particles));
      for (const std::vector<int32_t>& tokens : update.tokens) {
        CHECK(tokens.size() == static_cast<size_t>(config.draft_steps + 1));
        for (int32_t t : tokens)
          CHECK((t >= 0 && t < shape.vocab));
      }
    }
    const smcgraph::SlotCheck check = test::check_invariants(engine);
    CHECK_MESSAGE(check.ok, check.problem);
  }
  for (smcgraph::RequestId id : ids) {
    const smcgraph::RequestResult result = engine.result(id);
    CHECK(result.tokens.size() == static_cast<size_t>(1 + 20 * (config.draft_steps + 1)));
    CHECK(std::isfinite(result.log_evidence));
    engine.release(id);
  }
  const smcgraph::SlotCheck check = test::check_invariants(engine);
  CHECK(check.ok);
  CHECK(check.free == config.slot_pool_size - 1);
}

TEST_CASE(
    "llama engine: the admission prefill's chunk size changes no token; the prefill keeps one logits row") {
  // admit() prefills a prompt in forwards of EngineConfig::prefill_chunk tokens (one row), asking each model
  // for its last token's logits only. A token's KV and logits are the same bits in any forward (batch
  // invariance), so SMC requests of 150-token prompts must commit the same tokens whatever the chunk: 1 (a
  // forward a token), 7, 128 (two forwards), 150 and the default (one forward: as many tokens as the models
  // serve, up to max_seq_len). Both a draft with its own KV (prefilled too) and one sharing the target's (not
  // prefilled) are run, graphed and eager.
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const Shape shape{3, 64, 4, 2, 96, 400, true, GgufType::kQ4_1, GgufType::kQ8_0};
  const std::unique_ptr<Tiny> tiny = make_tiny(spec_of(shape, rng.bits()));
  constexpr int kPromptLength = 150, kCycles = 2;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> seeds;
  for (int i = 0; i < 2; ++i) {
    std::vector<int32_t> prompt;
    for (int j = 0; j < kPromptLength; ++j)
      prompt.push_back(static_cast<int32_t>(rng.integer(0, shape.vocab - 1)));
    prompts.push_back(std::move(prompt));
    seeds.push_back(rng.bits());
  }
  for (const bool share_kv : {false, true}) {
    CAPTURE(share_kv);
    std::vector<std::vector<int32_t>> first;
    size_t first_bytes = 0;
    for (const int chunk : {0, 1, 7, 128, kPromptLength}) {
      for (const bool graphs : {true, false}) {
        CAPTURE(chunk);
        CAPTURE(graphs);
        smcgraph::EngineConfig config = smc_config(shape.vocab, 3, 2);
        config.prefill_chunk = chunk;
        config.use_graphs = graphs;
        PrefixPair models(*tiny, share_kv);
        smcgraph::Engine engine(config, models.draft, models.target);
        // The default: max_seq_len (160), which the models serve (kEngineMaxTokens = 256 tokens a forward).
        CHECK(engine.prefill_chunk() == (chunk == 0 ? kEngineMaxSeqLen : chunk));
        std::vector<smcgraph::RequestId> ids;
        for (size_t i = 0; i < prompts.size(); ++i)
          ids.push_back(engine.admit(prompts[i], {.seed = seeds[i]}));
        for (int c = 0; c < kCycles; ++c)
          for (const smcgraph::RequestUpdate& update : test::cycle(engine))
            CHECK_FALSE(update.failed);
        std::vector<std::vector<int32_t>> tokens;
        for (const smcgraph::RequestId id : ids) {
          tokens.push_back(engine.result(id).tokens);
          CHECK(tokens.back().size() == static_cast<size_t>(1 + kCycles * (config.draft_steps + 1)));
          engine.release(id);
        }
        CHECK(test::check_invariants(engine).ok);
        if (first.empty()) {
          first = tokens;
          first_bytes = engine.device_bytes();
        } else {
          CHECK(tokens == first);
          // One row of prefill logits whatever the chunk (both models serve last_token_logits).
          CHECK(engine.device_bytes() == first_bytes);
        }
      }
    }
  }
  // Chunks past max_seq_len are clamped to it; past what a prefilled model serves, the constructor throws,
  // and the default stops there.
  smcgraph::EngineConfig config = smc_config(shape.vocab, 3, 2);
  {
    config.prefill_chunk = 200; // > max_seq_len 160, <= 256
    PrefixPair models(*tiny, false);
    CHECK(smcgraph::Engine(config, models.draft, models.target).prefill_chunk() == kEngineMaxSeqLen);
  }
  LlamaModel small(tiny->weights, options_of(kEnginePool, kEngineMaxSeqLen, 64, DType::kFloat32));
  config.prefill_chunk = 100;
  CHECK_THROWS_WITH_AS(smcgraph::Engine(config, small, small),
                       doctest::Contains("config.prefill_chunk = 100: exceeds the tokens one forward of the "
                                         "prefilled models serves (Model::max_forward_tokens = 64)"),
                       smcgraph::Error);
  config.prefill_chunk = 0;
  CHECK(smcgraph::Engine(config, small, small).prefill_chunk() == 64);
}

TEST_CASE(
    "llama: a layer-prefix draft shares its target's KV storage; other layer lists and pools are refused") {
  test::Rng rng;
  const Shape shape{3, 64, 4, 2, 96, 400, true, GgufType::kQ4_1, GgufType::kQ8_0};
  const std::unique_ptr<Tiny> tiny = make_tiny(spec_of(shape, rng.bits()));
  LlamaModel target(tiny->weights,
                    options_of(kEnginePool, kEngineMaxSeqLen, kEngineMaxTokens, DType::kFloat32));
  LlamaModelOptions shared =
      options_of(kEnginePool, kEngineMaxSeqLen, kEngineMaxTokens, DType::kFloat32, {0, 1});
  shared.kv_owner = &target;
  LlamaModel draft(tiny->weights, shared);
  CHECK(draft.kv_data() == target.kv_data());
  CHECK(draft.kv_follows(target));
  // The premise of sharing: the draft's forward over tokens the target already processed writes the same KV
  // bits (a 30-token target forward, then the draft over its last 2 tokens as the engine's head does, and
  // over its last token alone as a draft step does; 3 rows with their own slot ranges).
  Stream stream;
  const int rows = 3, length = 30;
  LlamaForwardInputs all;
  all.rows = rows;
  all.tokens_per_row = length;
  all.slot_table.assign(static_cast<size_t>(rows) * kEngineMaxSeqLen, 0);
  for (int r = 0; r < rows; ++r) {
    for (int p = 0; p < length; ++p) {
      all.tokens.push_back(static_cast<int32_t>(rng.integer(0, shape.vocab - 1)));
      all.positions.push_back(p);
      const int slot = 1 + r * length + p;
      all.out_slots.push_back(slot);
      all.slot_table[static_cast<size_t>(r) * kEngineMaxSeqLen + p] = slot;
    }
    all.seq_lens.push_back(length);
    all.live.push_back(1);
  }
  DeviceBatch whole(all, shape.vocab, DType::kFloat32, stream);
  run_forward(target, whole, false, stream);
  const std::vector<uint16_t> written = download_kv(target, stream);
  for (const int tail : {2, 1}) {
    CAPTURE(tail);
    LlamaForwardInputs last = all;
    last.tokens_per_row = tail;
    last.tokens.clear();
    last.positions.clear();
    last.out_slots.clear();
    for (int r = 0; r < rows; ++r)
      for (int p = length - tail; p < length; ++p) {
        last.tokens.push_back(all.tokens[static_cast<size_t>(r) * length + p]);
        last.positions.push_back(p);
        last.out_slots.push_back(all.out_slots[static_cast<size_t>(r) * length + p]);
      }
    DeviceBatch again(last, shape.vocab, DType::kFloat32, stream);
    run_forward(draft, again, tail == 1, stream);
    CHECK(download_kv(target, stream) == written);
  }
  CHECK_FALSE(target.kv_follows(draft));
  LlamaModel own(tiny->weights,
                 options_of(kEnginePool, kEngineMaxSeqLen, kEngineMaxTokens, DType::kFloat32, {0, 1}));
  CHECK_FALSE(own.kv_follows(target));
  LlamaModelOptions skip = shared;
  skip.layers = {0, 2};
  CHECK_THROWS_WITH_AS(LlamaModel(tiny->weights, skip), doctest::Contains("options.layers"), smcgraph::Error);
  LlamaModelOptions pool = shared;
  pool.pool_size = kEnginePool / 2;
  CHECK_THROWS_WITH_AS(LlamaModel(tiny->weights, pool), doctest::Contains("options.kv_owner"),
                       smcgraph::Error);
  const std::unique_ptr<Tiny> other = make_tiny(spec_of(shape, rng.bits()));
  CHECK_THROWS_WITH_AS(LlamaModel(other->weights, shared), doctest::Contains("options.kv_owner"),
                       smcgraph::Error);
}

TEST_CASE("llama forward: a verify resuming after a prefix draft's layers gives the full verify's logits and "
          "KV bits") {
  // Two target + prefix-draft pairs (layers {0, 1} of 3, the draft's KV the target's; and all three layers,
  // where the resumed verify runs only the last token's layers and the LM head), the same 20-token prefill of
  // 3 rows (the third a padding row in the verify). Pair A verifies 4 tokens a row with every layer; pair B
  // runs the draft over the first 3 of them one at a time (a draft step's forward, handing over each token's
  // residual into a buffer of 4 or 5 columns a row, as the engine's [rows, K + 1] one at a narrower verify),
  // then the target resuming after the draft's layers (the last token runs them alone first). Logits and the
  // whole KV must be the same bits, eager and captured, and the target must not write the buffer.
  test::Rng rng;
  INFO("seed " << rng.seed());
  const Shape shape{3, 64, 4, 2, 96, 400, true, GgufType::kQ4_1, GgufType::kQ8_0};
  const std::unique_ptr<Tiny> tiny = make_tiny(spec_of(shape, rng.bits()));
  constexpr int kRows = 3, kPrefix = 20, kWidth = 4;
  const int hidden = tiny->weights->config().hidden;
  // Row r's positions 0 .. kPrefix + kWidth - 1 at slots 1 + r * 64 + p.
  const auto inputs = [&](const std::vector<int32_t>& all_tokens, int first, int count, bool pad_last_row) {
    LlamaForwardInputs in;
    in.rows = kRows;
    in.tokens_per_row = count;
    in.slot_table.assign(static_cast<size_t>(kRows) * kEngineMaxSeqLen, 0);
    for (int r = 0; r < kRows; ++r) {
      for (int p = 0; p < kPrefix + kWidth; ++p)
        in.slot_table[static_cast<size_t>(r) * kEngineMaxSeqLen + p] = 1 + r * 64 + p;
      for (int p = first; p < first + count; ++p) {
        in.tokens.push_back(all_tokens[static_cast<size_t>(r) * (kPrefix + kWidth) + p]);
        in.positions.push_back(p);
        in.out_slots.push_back(1 + r * 64 + p);
      }
      in.seq_lens.push_back(first + count);
      in.live.push_back(pad_last_row && r == kRows - 1 ? 0 : 1);
    }
    return in;
  };
  std::vector<int32_t> tokens;
  for (int i = 0; i < kRows * (kPrefix + kWidth); ++i)
    tokens.push_back(static_cast<int32_t>(rng.integer(0, shape.vocab - 1)));
  for (const auto& [captured, columns, draft_layers] :
       {std::tuple{false, kWidth, std::vector<int>{0, 1}},
        std::tuple{true, kWidth + 1, std::vector<int>{0, 1}},
        std::tuple{false, kWidth, std::vector<int>{0, 1, 2}},
        std::tuple{true, kWidth + 1, std::vector<int>{0, 1, 2}}}) {
    CAPTURE(captured);
    CAPTURE(columns);
    const int R = static_cast<int>(draft_layers.size());
    CAPTURE(R);
    PrefixPair a(*tiny, true, draft_layers), b(*tiny, true, draft_layers);
    REQUIRE(a.target.resumable_layers(a.draft) == R);
    Stream stream;
    for (PrefixPair* pair : {&a, &b}) {
      DeviceBatch prefill(inputs(tokens, 0, kPrefix, false), shape.vocab, DType::kFloat32, stream);
      run_forward(pair->target, prefill, false, stream);
    }
    DeviceBatch full(inputs(tokens, kPrefix, kWidth, true), shape.vocab, DType::kFloat32, stream);
    const std::vector<uint8_t> expected = run_forward(a.target, full, captured, stream);
    // Pair B: the draft over columns 0 .. kWidth - 2, each handing over its residual into column j.
    const int64_t row_stride = static_cast<int64_t>(columns) * hidden;
    DeviceBuffer<float> residual(static_cast<size_t>(kRows) * row_stride);
    residual.fill_bytes(0, stream);
    for (int j = 0; j + 1 < kWidth; ++j) {
      DeviceBatch step(inputs(tokens, kPrefix + j, 1, true), shape.vocab, DType::kFloat32, stream);
      ForwardArgs args = step.args();
      args.hidden = residual.data() + static_cast<size_t>(j) * hidden;
      args.hidden_row_stride = row_stride;
      test::run_on_stream(captured, stream, [&](cudaStream_t st) { b.draft.forward(args, st); });
    }
    const std::vector<float> handed_over = test::to_host(residual.data(), residual.size(), stream);
    DeviceBatch resumed(inputs(tokens, kPrefix, kWidth, true), shape.vocab, DType::kFloat32, stream);
    resumed.logits.fill_bytes(kPoison, stream);
    ForwardArgs args = resumed.args();
    args.hidden = residual.data();
    args.hidden_row_stride = row_stride;
    args.resume_layers = R;
    test::run_on_stream(captured, stream, [&](cudaStream_t st) { b.target.forward(args, st); });
    const std::vector<uint8_t> got = resumed.download(stream);
    const size_t row_bytes = static_cast<size_t>(kWidth) * shape.vocab * 4;
    for (int r = 0; r + 1 < kRows; ++r) // the live rows (the padding row's logits may be anything)
      CHECK_MESSAGE(std::memcmp(got.data() + r * row_bytes, expected.data() + r * row_bytes, row_bytes) == 0,
                    "row " << r << ": the resumed verify's logits differ from the full verify's");
    CHECK(download_kv(b.target, stream) == download_kv(a.target, stream));
    CHECK(test::to_host(residual.data(), residual.size(), stream) == handed_over); // read only
  }
  // Argument errors name the field.
  PrefixPair p(*tiny);
  Stream stream;
  DeviceBatch batch(inputs(tokens, kPrefix, kWidth, false), shape.vocab, DType::kFloat32, stream);
  DeviceBuffer<float> residual(static_cast<size_t>(kRows) * kWidth * hidden);
  ForwardArgs args = batch.args();
  args.resume_layers = 2;
  CHECK_THROWS_WITH_AS(p.target.forward(args, stream), doctest::Contains("args.hidden"), smcgraph::Error);
  args.hidden = residual.data();
  args.hidden_row_stride = hidden;
  CHECK_THROWS_WITH_AS(p.target.forward(args, stream), doctest::Contains("args.hidden_row_stride"),
                       smcgraph::Error);
  args.hidden_row_stride = static_cast<int64_t>(kWidth) * hidden;
  args.resume_layers = 4; // more than the target's 3 layers
  CHECK_THROWS_WITH_AS(p.target.forward(args, stream), doctest::Contains("args.resume_layers = 4"),
                       smcgraph::Error);
  args.resume_layers = 1; // a draft sharing its owner's KV never resumes
  CHECK_THROWS_WITH_AS(p.draft.forward(args, stream), doctest::Contains("owns its KV"), smcgraph::Error);
  CHECK(p.target.resumable_layers(p.target) == 0); // not a prefix draft of itself
  CHECK(p.draft.resumable_layers(p.target) == 0);
  CHECK(p.target.hidden_size() == hidden);
}

TEST_CASE(
    "llama engine: a draft sharing the target's KV (its head forwards x_{L-1} alone, the verify resumes "
    "after "
    "its layers) gives the SMC results of the same draft with its own KV (its head recomputes x_{L-2}, the "
    "verify runs every layer)") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const Shape shape{3, 64, 4, 2, 96, 400, true, GgufType::kQ4_1, GgufType::kQ8_0};
  const std::unique_ptr<Tiny> tiny = make_tiny(spec_of(shape, rng.bits()));
  const smcgraph::EngineConfig config = smc_config(shape.vocab, 3, 3);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> seeds;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(test::random_prompt(rng, shape.vocab, 12 + 5 * i));
    seeds.push_back(rng.bits());
  }
  struct Run {
    std::vector<std::vector<std::vector<int32_t>>> cycle_tokens; // per cycle, per request: the particles'
    std::vector<smcgraph::RequestResult> results;
  };
  const auto run = [&](bool shared_kv, bool graphs, bool resume) {
    std::optional<ScopedEnv> no_resume;
    if (!resume)
      no_resume.emplace("SMCGRAPH_DISABLE_PREFIX_RESUME", "1");
    PrefixPair models(*tiny, shared_kv);
    LlamaModel &target = models.target, &draft = models.draft;
    CHECK(smcgraph::draft_head_tokens(draft, target) == (shared_kv ? 1 : 2));
    smcgraph::EngineConfig c = config;
    c.use_graphs = graphs;
    smcgraph::Engine engine(c, draft, target);
    // A prefix draft's verify resumes after its 2 layers (the target's third alone runs over every token);
    // prefix_resume_layers says so before an engine is built (bucket_sweep's adaptive cost reads it), and
    // nothing without a draft step.
    CHECK(engine.resumed_layers() == (shared_kv && resume ? 2 : 0));
    CHECK(smcgraph::prefix_resume_layers(draft, target, c.draft_steps) == engine.resumed_layers());
    CHECK(smcgraph::prefix_resume_layers(draft, target, 0) == 0);
    CHECK(target.resumable_layers(draft) == (shared_kv ? 2 : 0));
    std::vector<smcgraph::RequestId> ids;
    for (size_t i = 0; i < prompts.size(); ++i)
      ids.push_back(engine.admit(prompts[i], {.seed = seeds[i]}));
    Run out;
    for (int cycle = 0; cycle < 12; ++cycle) {
      std::vector<smcgraph::RequestUpdate> updates = test::cycle(engine);
      REQUIRE(updates.size() == ids.size());
      std::vector<std::vector<int32_t>> tokens;
      for (smcgraph::RequestUpdate& update : updates) {
        CHECK_FALSE(update.failed);
        for (std::vector<int32_t>& particle : update.tokens)
          tokens.push_back(std::move(particle));
      }
      out.cycle_tokens.push_back(std::move(tokens));
    }
    for (smcgraph::RequestId id : ids)
      out.results.push_back(engine.result(id));
    const smcgraph::SlotCheck check = test::check_invariants(engine);
    CHECK_MESSAGE(check.ok, check.problem);
    return out;
  };
  const Run own = run(false, true, true);
  for (const auto& [graphs, resume] :
       {std::pair{true, true}, std::pair{false, true}, std::pair{true, false}}) {
    CAPTURE(graphs);
    CAPTURE(resume);
    const Run shared = run(true, graphs, resume);
    CHECK(shared.cycle_tokens == own.cycle_tokens);
    REQUIRE(shared.results.size() == own.results.size());
    for (size_t i = 0; i < own.results.size(); ++i) {
      CHECK(shared.results[i].particles == own.results[i].particles);
      CHECK(shared.results[i].log_weights == own.results[i].log_weights); // the same bits
      CHECK(shared.results[i].log_evidence == own.results[i].log_evidence);
    }
  }
}

TEST_CASE(
    "llama engine: speculative decoding with the verify resumed after a KV-sharing draft's layers gives "
    "the every-layer verify's results bit for bit") {
  // Sampled (draft T 0.8, target T 1: the stochastic verifier), K = 3, requests pinned to K 1 and 2 or left
  // to the adaptive rule, so rows of one batch draft different K: the steps past a row's K are masked (or,
  // graphed, skipped), and a row's last drafted token reaches the verify from a draft step, not from the
  // verify's own run of the draft's layers. Both draft loops: conditional nodes (graphed) and masked steps.
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const Shape shape{3, 64, 4, 2, 96, 400, true, GgufType::kQ4_1, GgufType::kQ8_0};
  const std::unique_ptr<Tiny> tiny = make_tiny(spec_of(shape, rng.bits()));
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> seeds;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(test::random_prompt(rng, shape.vocab, 10 + 4 * i));
    seeds.push_back(rng.bits());
  }
  const std::vector<int> pins = {1, -1, 2, -1};
  // Racecheck: 20 tokens a request (384 s with 40, NVIDIA H100, one case a cell, 20 cells side by side).
  const int new_tokens = test::sanitizer_scaled(40, 40, 20);
  struct Run {
    std::vector<smcgraph::RequestUpdate> updates;
    std::vector<smcgraph::RequestResult> results;
  };
  const auto run = [&](smcgraph::DraftLoop loop, bool graphs, bool resume) {
    std::optional<ScopedEnv> no_resume;
    if (!resume)
      no_resume.emplace("SMCGRAPH_DISABLE_PREFIX_RESUME", "1");
    PrefixPair models(*tiny);
    smcgraph::EngineConfig c = engine_config(smcgraph::CycleKind::kSpeculative, shape.vocab);
    c.particles = 1;
    c.draft_steps = 3;
    c.max_requests = 4;
    c.draft_temperature = 0.8f;
    c.target_temperature = 1.0f;
    c.adaptive.enabled = true;
    c.adaptive.mid_steps = 2;
    c.draft_loop = loop;
    c.use_graphs = graphs;
    smcgraph::Engine engine(c, models.draft, models.target);
    CHECK(engine.resumed_layers() == (resume ? 2 : 0));
    std::vector<smcgraph::RequestId> ids;
    for (size_t i = 0; i < prompts.size(); ++i)
      ids.push_back(
          engine.admit(prompts[i], {.seed = seeds[i], .max_new_tokens = new_tokens, .draft_steps = pins[i]}));
    Run out;
    test::CompletedRun completed = test::run_to_completion(engine, ids, 42);
    REQUIRE(completed.done);
    for (const smcgraph::RequestUpdate& update : completed.updates)
      REQUIRE_MESSAGE(!update.failed, update.reason);
    out.updates = std::move(completed.updates);
    for (smcgraph::RequestId id : ids)
      out.results.push_back(engine.result(id));
    const smcgraph::SlotCheck check = test::check_invariants(engine);
    CHECK_MESSAGE(check.ok, check.problem);
    return out;
  };
  for (const auto& [loop, graphs] :
       {std::pair{smcgraph::DraftLoop::kConditional, true}, std::pair{smcgraph::DraftLoop::kMasked, true},
        std::pair{smcgraph::DraftLoop::kMasked, false}}) {
    CAPTURE(static_cast<int>(loop));
    CAPTURE(graphs);
    // Under a sanitizer the conditional loop runs as masked steps (test_util.hpp): the next pair would repeat
    // it.
    if (loop == smcgraph::DraftLoop::kConditional && test::sanitizer_blocks_conditional_nodes())
      continue;
    const Run every_layer = run(loop, graphs, false), resumed = run(loop, graphs, true);
    REQUIRE(resumed.updates.size() == every_layer.updates.size());
    int drafted_below_max = 0;
    for (size_t u = 0; u < resumed.updates.size(); ++u) {
      const smcgraph::RequestUpdate &a = resumed.updates[u], &b = every_layer.updates[u];
      CAPTURE(u);
      CHECK(a.id == b.id);
      CHECK(a.tokens == b.tokens);
      CHECK(a.draft_steps == b.draft_steps);
      CHECK(a.accepted == b.accepted);
      CHECK(a.acceptance_ema == b.acceptance_ema);
      drafted_below_max += a.draft_steps >= 1 && a.draft_steps < 3 ? 1 : 0;
    }
    CHECK(drafted_below_max > 0); // rows whose last drafted token came from a draft step
    for (size_t i = 0; i < resumed.results.size(); ++i)
      CHECK(resumed.results[i].tokens == every_layer.results[i].tokens);
  }
}

TEST_CASE("llama engine: adaptive K down to 0 (a draft sharing the target's KV) decodes the target's greedy "
          "tokens") {
  GreedySetup setup;
  smcgraph::EngineConfig config = setup.config;
  config.adaptive.enabled = true;
  // EMA < 0.95: no draft; [0.95, 0.99): 2; >= 0.99: 4. A new request (EMA 0.8) starts without a draft, and
  // four idle cycles bring it back to a K = 2 probe.
  config.adaptive.min_steps = 0;
  config.adaptive.mid_steps = 2;
  config.adaptive.low_threshold = 0.95f;
  config.adaptive.high_threshold = 0.99f;
  config.adaptive.idle_recovery = 0.25f;
  {
    LlamaPair own_kv(*setup.tiny); // a draft with its own KV cannot skip cycles
    CHECK_THROWS_WITH_AS(smcgraph::Engine(config, *own_kv.draft, *own_kv.target),
                         doctest::Contains("adaptive.min_steps = 0"), smcgraph::Error);
  }
  std::vector<std::vector<int32_t>> first_run;
  for (bool graphs : {true, false}) {
    config.use_graphs = graphs;
    PrefixPair models(*setup.tiny);
    smcgraph::Engine engine(config, models.draft, models.target);
    // (compute-sanitizer runs keep conditional nodes off: test_util.hpp)
    CHECK(engine.draft_loop().conditional == (graphs && !test::sanitizer_blocks_conditional_nodes()));
    GreedyCheck check;
    std::map<int, long> cycles_at_k; // requests' cycles by their K
    long all_idle_cycles = 0;        // cycles where no request drafted (the head skipped when graphed)
    // Every third request pins K = 1, so batches mix rows that draft with rows that do not.
    const std::vector<std::vector<int32_t>> outputs = setup.run(
        engine, check, [](size_t prompt) { return prompt % 3 == 2 ? 1 : -1; },
        [&](const std::vector<smcgraph::RequestUpdate>& updates) {
          bool any_drafted = false;
          for (const smcgraph::RequestUpdate& update : updates) {
            ++cycles_at_k[update.draft_steps];
            any_drafted = any_drafted || update.draft_steps > 0;
            CHECK(update.tokens[0].size() <= static_cast<size_t>(update.draft_steps + 1));
          }
          all_idle_cycles += !updates.empty() && !any_drafted ? 1 : 0;
        });
    CHECK(cycles_at_k[0] > 0);
    CHECK(cycles_at_k[1] + cycles_at_k[2] + cycles_at_k[4] > 0);
    CHECK(all_idle_cycles > 0);
    MESSAGE(std::string(graphs ? "graphed" : "eager"), ": ", check.tokens, " tokens, ", check.exact,
            " the teacher-forced argmax; request cycles at K = 0 / 1 / 2 / 4: ", cycles_at_k[0], " / ",
            cycles_at_k[1], " / ", cycles_at_k[2], " / ", cycles_at_k[4], "; cycles with no draft at all ",
            all_idle_cycles);
    if (first_run.empty())
      first_run = outputs;
    else
      CHECK(outputs == first_run);
  }
}

TEST_CASE("llama engine: greedy speculative decoding with an n-gram draft is the target's greedy decoding") {
  GreedySetup setup;
  // Prompts that repeat themselves (a random phrase three times, then half of it), so the draft proposes.
  for (std::vector<int32_t>& prompt : setup.prompts) {
    const std::vector<int32_t> phrase(prompt.begin(), prompt.begin() + std::min<size_t>(8, prompt.size()));
    prompt.clear();
    for (int copy = 0; copy < 3; ++copy)
      prompt.insert(prompt.end(), phrase.begin(), phrase.end());
    prompt.insert(prompt.end(), phrase.begin(), phrase.begin() + phrase.size() / 2);
  }
  std::vector<std::vector<int32_t>> first_run;
  for (bool graphs : {true, false}) {
    smcgraph::EngineConfig config = setup.config;
    config.use_graphs = graphs;
    LlamaModel target(setup.tiny->weights,
                      options_of(kEnginePool, kEngineMaxSeqLen, kEngineMaxTokens, DType::kFloat32));
    smcgraph::NgramDraftOptions draft_options;
    draft_options.vocab = target.vocab();
    draft_options.pool_size = kEnginePool;
    draft_options.max_seq_len = kEngineMaxSeqLen;
    smcgraph::NgramDraft draft(draft_options);
    smcgraph::Engine engine(config, draft, target);
    GreedyCheck check;
    long accepted = 0, cycles = 0;
    const std::vector<std::vector<int32_t>> outputs = setup.run(
        engine, check, [](size_t) { return -1; },
        [&](const std::vector<smcgraph::RequestUpdate>& updates) {
          for (const smcgraph::RequestUpdate& update : updates) {
            ++cycles;
            accepted += update.accepted;
          }
        });
    // (How much is accepted depends on whether the random target repeats itself; the real pair's bench
    // measures it.)
    MESSAGE(std::string(graphs ? "graphed" : "eager"), ": ", check.tokens, " tokens, ", check.exact,
            " the teacher-forced argmax; accepted draft tokens per request cycle ",
            static_cast<double>(accepted) / std::max<long>(1, cycles));
    if (first_run.empty())
      first_run = outputs;
    else
      CHECK(outputs == first_run);
  }
}
