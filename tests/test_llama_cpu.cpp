// The Llama host side: the config and the weights read from a GGUF file (tiny files written by
// tests/support/gguf_writer, errors from byte-patched ones), the host reference's self-consistency, the
// measurement behind the GPU suite's tolerances, and the real SmolLM2 file when it is present.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "models/llama/llama_kernels.hpp"
#include "reference/llama_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "support/gguf_writer.hpp"
#include "support/test_util.hpp"

using smcgraph::GgufFile;
using smcgraph::GgufType;
using smcgraph::LlamaConfig;
using smcgraph::LlamaHostWeights;
using smcgraph::reference::LlamaForwardInputs;
using smcgraph::reference::LlamaNumerics;
using smcgraph::reference::LlamaReference;
using smcgraph::reference::LlamaSequences;
using smcgraph::test::TinyLlamaSpec;
namespace reference = smcgraph::reference;
namespace test = smcgraph::test;

namespace {

/// A tiny file's bytes and the writer's map of them, to patch one field.
struct PatchedGguf {
  std::vector<uint8_t> bytes;
  test::GgufLayout layout;

  explicit PatchedGguf(const TinyLlamaSpec& spec) { bytes = test::tiny_llama_writer(spec).bytes(&layout); }

  const test::GgufLayout::Kv& kv(const std::string& key) const {
    for (const auto& entry : layout.kvs)
      if (entry.key == key)
        return entry;
    FAIL("no key " << key);
    return layout.kvs.front();
  }
  const test::GgufLayout::TensorInfo& tensor(const std::string& name) const {
    for (const auto& entry : layout.tensors)
      if (entry.name == name)
        return entry;
    FAIL("no tensor " << name);
    return layout.tensors.front();
  }
  void put(size_t offset, uint64_t value, int width) {
    for (int i = 0; i < width; ++i)
      bytes.at(offset + i) = static_cast<uint8_t>(value >> (8 * i));
  }
  /// A new value of the same integer type.
  void set_int(const std::string& key, int64_t value) {
    const auto& entry = kv(key);
    uint32_t type = 0;
    std::memcpy(&type, bytes.data() + entry.type_offset, 4);
    const int widths[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    REQUIRE((type < 13 && widths[type] > 0 && type != 6));
    put(entry.value_offset, static_cast<uint64_t>(value), widths[type]);
  }
  /// Changes the last character of a key (the key is then absent).
  void rename_key(const std::string& key) { bytes.at(kv(key).key_offset + 8 + key.size() - 1) ^= 0x20; }
  /// Same-length replacement of a string value.
  void set_string(const std::string& key, const std::string& value) {
    std::memcpy(bytes.data() + kv(key).value_offset + 8, value.data(), value.size());
  }
  void rename_tensor(const std::string& name) {
    bytes.at(tensor(name).name_offset + 8 + name.size() - 1) ^= 0x20;
  }
  void set_dims(const std::string& name, const std::vector<int64_t>& dims) {
    for (size_t i = 0; i < dims.size(); ++i)
      put(tensor(name).dims_offset + 8 * i, static_cast<uint64_t>(dims[i]), 8);
  }
  GgufFile file() const { return GgufFile::from_bytes(bytes, "patched tiny llama"); }
};

/// The message of the smcgraph::Error `work` throws (fails when it throws nothing).
template <class F> std::string error_of(F&& work) {
  try {
    work();
  } catch (const smcgraph::Error& e) {
    return e.what();
  }
  FAIL("no smcgraph::Error thrown");
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

LlamaHostWeights tiny_weights(const TinyLlamaSpec& spec) {
  return smcgraph::load_llama_host_weights(GgufFile::from_bytes(test::make_tiny_llama_gguf(spec)));
}

TinyLlamaSpec tiny_spec(uint64_t seed, int layers = 2, int hidden = 64, int heads = 4, int kv_heads = 2) {
  TinyLlamaSpec spec;
  spec.layers = layers;
  spec.hidden = hidden;
  spec.ffn = 2 * hidden;
  spec.heads = heads;
  spec.kv_heads = kv_heads;
  spec.vocab = 300;
  spec.context = 1024;
  spec.seed = seed;
  return spec;
}

std::vector<double> run(LlamaReference& ref, const LlamaForwardInputs& in, double poison = -1234.5) {
  std::vector<double> logits(static_cast<size_t>(in.rows) * in.tokens_per_row * ref.config().vocab, poison);
  ref.forward(in, logits);
  return logits;
}

/// Feeds every live row's whole sequence in blocks of `block` tokens (the last block may be shorter);
/// returns the logits of each position of row 0, [length, vocab].
std::vector<double> feed_in_blocks(LlamaReference& ref, LlamaSequences s, int block,
                                   std::mt19937_64& engine) {
  const int length = static_cast<int>(s.tokens[0].size());
  const size_t V = ref.config().vocab;
  std::vector<double> out;
  while (s.done[0] < length) {
    const int count = std::min(block, length - s.done[0]);
    const LlamaForwardInputs in = s.next(count, engine);
    const std::vector<double> logits = run(ref, in);
    out.insert(out.end(), logits.begin(), logits.begin() + count * V);
    s.advance(count);
  }
  return out;
}

std::filesystem::path real_model_path() {
  return smcgraph::default_llama_model_path();
}

} // namespace

TEST_CASE("llama config: every key of a tiny file, tied and untied") {
  for (bool tied : {true, false}) {
    TinyLlamaSpec spec = tiny_spec(7, 3, 128, 4, 2);
    spec.tied = tied;
    spec.ffn = 160;
    spec.vocab = 333;
    spec.context = 512;
    spec.rope_base = 50000.0f;
    spec.eps = 1e-6f;
    const LlamaConfig c =
        smcgraph::llama_config_from_gguf(GgufFile::from_bytes(test::make_tiny_llama_gguf(spec)));
    CAPTURE(tied);
    CHECK(c.layers == 3);
    CHECK(c.hidden == 128);
    CHECK(c.ffn == 160);
    CHECK(c.heads == 4);
    CHECK(c.kv_heads == 2);
    CHECK(c.head_dim == 32);
    CHECK(c.vocab == 333);
    CHECK(c.context == 512);
    CHECK(c.rope_base == 50000.0f);
    CHECK(c.rms_eps == 1e-6f);
    CHECK(c.tied_head == tied);
  }
}

TEST_CASE("llama config errors name the key") {
  const TinyLlamaSpec spec = tiny_spec(3);
  auto config_error = [](const PatchedGguf& patched) {
    return error_of([&] { smcgraph::llama_config_from_gguf(patched.file()); });
  };
  {
    PatchedGguf p(spec);
    p.set_string("general.architecture", "llamb");
    const std::string e = config_error(p);
    CHECK_MESSAGE(contains(e, "general.architecture"), e);
    CHECK_MESSAGE(contains(e, "llamb"), e);
  }
  {
    PatchedGguf p(spec);
    p.rename_key("llama.attention.head_count");
    const std::string e = config_error(p);
    CHECK_MESSAGE(contains(e, "llama.attention.head_count"), e);
  }
  {
    PatchedGguf p(spec); // hidden 64, 3 heads
    p.set_int("llama.attention.head_count", 3);
    p.set_int("llama.attention.head_count_kv", 3);
    const std::string e = config_error(p);
    CHECK_MESSAGE(contains(e, "head_count"), e);
    CHECK_MESSAGE(contains(e, "llama.embedding_length"), e);
  }
  {
    PatchedGguf p(spec); // 4 heads, 3 kv heads
    p.set_int("llama.attention.head_count_kv", 3);
    const std::string e = config_error(p);
    CHECK_MESSAGE(contains(e, "llama.attention.head_count_kv"), e);
  }
  {
    PatchedGguf p(tiny_spec(3, 1, 256, 2, 1)); // head_dim 128 is fine; 1 head makes it 256
    CHECK_NOTHROW(smcgraph::llama_config_from_gguf(p.file()));
    p.set_int("llama.attention.head_count", 1);
    p.set_int("llama.rope.dimension_count", 256);
    const std::string e = config_error(p);
    CHECK_MESSAGE(contains(e, "head_dim"), e);
    CHECK_MESSAGE(contains(e, "256"), e);
  }
  {
    PatchedGguf p(spec); // a hidden size past kLlamaMaxHidden (the GEMMs' register-held norm rows)
    p.set_int("llama.embedding_length", smcgraph::kLlamaMaxHidden + 16);
    const std::string e = config_error(p);
    CHECK_MESSAGE(contains(e, "llama.embedding_length"), e);
    CHECK_MESSAGE(contains(e, "1040"), e);
  }
  {
    PatchedGguf p(spec);
    p.rename_key("llama.block_count");
    const std::string e = config_error(p);
    CHECK_MESSAGE(contains(e, "llama.block_count"), e);
  }
}

TEST_CASE("llama host weights: shapes, bf16 of the file's values, and errors naming the tensor") {
  for (bool tied : {true, false}) {
    TinyLlamaSpec spec = tiny_spec(11, 2, 128, 4, 2);
    spec.tied = tied;
    spec.ffn = 96;
    const GgufFile file = GgufFile::from_bytes(test::make_tiny_llama_gguf(spec));
    const LlamaHostWeights w = smcgraph::load_llama_host_weights(file);
    const size_t H = 128, F = 96, V = spec.vocab, kvd = 64;
    CAPTURE(tied);
    CHECK(w.config.tied_head == tied);
    CHECK(w.token_embd.size() == V * H);
    CHECK(w.output.size() == (tied ? 0 : V * H));
    CHECK(w.output_norm.size() == H);
    REQUIRE(w.layers.size() == 2);
    for (const auto& layer : w.layers) {
      CHECK(layer.attn_norm.size() == H);
      CHECK(layer.ffn_norm.size() == H);
      CHECK(layer.q.size() == H * H);
      CHECK(layer.k.size() == kvd * H);
      CHECK(layer.v.size() == kvd * H);
      CHECK(layer.o.size() == H * H);
      CHECK(layer.gate.size() == F * H);
      CHECK(layer.up.size() == F * H);
      CHECK(layer.down.size() == H * F);
    }
    // Each matrix is the bf16 rounding of the dequantised tensor of the same name (no mix-up of k and v).
    auto bf16_of = [&](const std::string& name, const std::vector<int64_t>& dims) {
      const std::vector<float> values = file.tensor_f32(name, dims);
      std::vector<uint16_t> bits(values.size());
      for (size_t i = 0; i < values.size(); ++i)
        bits[i] = test::float_to_bf16(values[i]);
      return bits;
    };
    CHECK(w.layers[1].k == bf16_of("blk.1.attn_k.weight", {128, 64}));
    CHECK(w.layers[1].v == bf16_of("blk.1.attn_v.weight", {128, 64}));
    CHECK(w.layers[0].down == bf16_of("blk.0.ffn_down.weight", {96, 128}));
    CHECK(w.token_embd == bf16_of("token_embd.weight", {128, spec.vocab}));
    if (!tied)
      CHECK(w.output == bf16_of("output.weight", {128, spec.vocab}));
    CHECK(w.layers[0].attn_norm == file.tensor_f32("blk.0.attn_norm.weight", {128}));
    // The head's Q8_0 blocks as the file stores them (the int8 head's weights): bf16(value * scale) is the
    // head's bf16 weight, every one of them.
    const std::vector<uint16_t>& head = tied ? w.token_embd : w.output;
    REQUIRE(w.head_q8.size() == V * H);
    REQUIRE(w.head_q8_scales.size() == V * H / 32);
    size_t differing = 0;
    for (size_t i = 0; i < head.size(); ++i)
      differing +=
          test::float_to_bf16(static_cast<float>(w.head_q8[i]) * w.head_q8_scales[i / 32]) != head[i];
    CHECK(differing == 0);
  }
  {
    // A head stored another way (here F16) has no int8 copy.
    TinyLlamaSpec spec = tiny_spec(12, 2, 128, 4, 2);
    spec.embedding_type = GgufType::kF16;
    const LlamaHostWeights w =
        smcgraph::load_llama_host_weights(GgufFile::from_bytes(test::make_tiny_llama_gguf(spec)));
    CHECK(w.head_q8.empty());
    CHECK(w.head_q8_scales.empty());
  }
  const TinyLlamaSpec spec = tiny_spec(5); // hidden 64, ffn 128
  {
    PatchedGguf p(spec);
    p.rename_tensor("blk.1.ffn_up.weight");
    const std::string e = error_of([&] { smcgraph::load_llama_host_weights(p.file()); });
    CHECK_MESSAGE(contains(e, "blk.1.ffn_up.weight"), e);
  }
  {
    PatchedGguf p(spec); // same bytes, transposed shape
    p.set_dims("blk.0.ffn_down.weight", {64, 128});
    const std::string e = error_of([&] { smcgraph::load_llama_host_weights(p.file()); });
    CHECK_MESSAGE(contains(e, "blk.0.ffn_down.weight"), e);
    CHECK_MESSAGE(contains(e, "128"), e);
    CHECK_MESSAGE(contains(e, "64"), e);
  }
  {
    PatchedGguf p(spec);
    p.rename_tensor("output_norm.weight");
    const std::string e = error_of([&] { smcgraph::load_llama_host_weights(p.file()); });
    CHECK_MESSAGE(contains(e, "output_norm.weight"), e);
  }
}

TEST_CASE("llama options are validated against the config") {
  const LlamaConfig c = tiny_weights(tiny_spec(1, 3)).config;
  smcgraph::LlamaModelOptions good;
  good.pool_size = 64;
  good.max_seq_len = 256;
  good.max_tokens_per_forward = 64;
  CHECK_NOTHROW(smcgraph::validate_llama_options(c, good));
  good.layers = {0, 2};
  CHECK_NOTHROW(smcgraph::validate_llama_options(c, good));
  auto error_with = [&](auto change) {
    smcgraph::LlamaModelOptions options = good;
    change(options);
    return error_of([&] { smcgraph::validate_llama_options(c, options); });
  };
  using Options = smcgraph::LlamaModelOptions;
  std::string e = error_with([](Options& o) { o.layers = {2, 1}; });
  CHECK_MESSAGE(contains(e, "layers"), e);
  e = error_with([](Options& o) { o.layers = {0, 0}; });
  CHECK_MESSAGE(contains(e, "layers"), e);
  e = error_with([](Options& o) { o.layers = {0, 3}; });
  CHECK_MESSAGE(contains(e, "layers"), e);
  e = error_with([](Options& o) { o.layers = {-1}; });
  CHECK_MESSAGE(contains(e, "layers"), e);
  e = error_with([](Options& o) { o.pool_size = 1; });
  CHECK_MESSAGE(contains(e, "pool_size"), e);
  e = error_with([&](Options& o) { o.max_seq_len = c.context + 1; });
  CHECK_MESSAGE(contains(e, "max_seq_len"), e);
  e = error_with([](Options& o) { o.logits_dtype = smcgraph::DType::kFloat16; });
  CHECK_MESSAGE(contains(e, "logits_dtype"), e);
  e = error_with([](Options& o) { o.max_tokens_per_forward = 0; });
  CHECK_MESSAGE(contains(e, "max_tokens_per_forward"), e);
  e = error_with([](Options& o) { o.tensor_core_attention_tokens = -1; });
  CHECK_MESSAGE(contains(e, "tensor_core_attention_tokens"), e);
  CHECK_MESSAGE(contains(e, "-1"), e);
  good.tensor_core_attention_tokens = 0; // never: valid
  e = error_with([](Options& o) { o.prefill_gemm_tokens = -3; });
  CHECK_MESSAGE(contains(e, "prefill_gemm_tokens"), e);
  CHECK_MESSAGE(contains(e, "-3"), e);
  good.prefill_gemm_tokens = 0; // never: valid
  CHECK_NOTHROW(smcgraph::validate_llama_options(c, good));
}

TEST_CASE("llama attention: the tensor-core kernel serves prefill-sized launches of heads of 64 or 128") {
  smcgraph::llama::AttentionArgs a;
  a.rows = 1;
  a.heads = 9;
  a.kv_heads = 3;
  const auto serves = [&](int tokens, int head_dim, int threshold) {
    a.tokens_per_row = tokens;
    a.head_dim = head_dim;
    a.tensor_core_min_tokens = threshold;
    return smcgraph::llama::tensor_core_attention_serves(a);
  };
  CHECK(serves(64, 64, 64));
  CHECK(serves(3215, 128, 64));
  CHECK_FALSE(serves(63, 64, 64));  // below the threshold: the CUDA-core kernel
  CHECK_FALSE(serves(5, 64, 64));   // a verify block
  CHECK(serves(1, 64, 1));          // a threshold of 1 takes every launch
  CHECK_FALSE(serves(4096, 64, 0)); // 0: never
  CHECK_FALSE(serves(256, 32, 64)); // heads of 32: no tensor-core instance
  CHECK_FALSE(serves(256, 96, 64));
}

TEST_CASE("llama attention: grouped blocks by size only where they fill the GPU") {
  // llama::attention_grid, SmolLM2's heads (9 query heads, 3 KV heads) on 132 SMs: grouped blocks
  // once the per-query grid passes a wave (3 blocks an SM: 396) and the grouped grid has a block an SM.
  using smcgraph::llama::AttentionGrouping;
  const auto by_size = [](int rows, int tokens) {
    return smcgraph::llama::attention_grid(AttentionGrouping::kBySize, rows, tokens, 9, 3, 132).grouped;
  };
  CHECK_FALSE(by_size(8, 1));  // a decode of 8 rows: 72 per-query blocks
  CHECK_FALSE(by_size(8, 5));  // an SMC verify at 1 request: 360 per-query blocks, one wave
  CHECK_FALSE(by_size(1, 44)); // 396 per-query blocks: still one wave
  CHECK_FALSE(by_size(1, 45)); // a 1-row prefill: 405 per-query blocks, but 3 x 9 = 27 grouped ones
  const smcgraph::llama::AttentionGrid prefill_64 =
      smcgraph::llama::attention_grid(AttentionGrouping::kBySize, 1, 64, 9, 3, 132);
  CHECK(prefill_64.per_query_blocks == 64 * 9);
  CHECK(prefill_64.groups == 12); // 64 x 3 queries of a KV head in groups of 16
  CHECK(prefill_64.grouped_blocks == 36);
  CHECK(prefill_64.group_queries == 16);
  // 5 x 3 queries of a KV head: one group of 15.
  CHECK(smcgraph::llama::attention_grid(AttentionGrouping::kBySize, 8, 5, 9, 3, 132).group_queries == 15);
  // 44 x 3 = 132 queries: 9 groups, as even as they go (15 each; the last holds 12).
  CHECK(smcgraph::llama::attention_grid(AttentionGrouping::kBySize, 1, 44, 9, 3, 132).group_queries == 15);
  CHECK_FALSE(by_size(1, 64));  // 36 grouped blocks (ncu, H200: per-query 11.65 us, grouped 26.34)
  CHECK_FALSE(by_size(1, 176)); // 99 grouped blocks
  CHECK(by_size(1, 270));       // 3 x 51 = 153 grouped blocks (per-query 50.79 us, grouped 48.42)
  CHECK(by_size(64, 1));        // a 64-row decode: 576 per-query blocks, 192 grouped
  CHECK(by_size(64, 5));        // a 320-token verify: 192 grouped blocks
  CHECK(by_size(8, 32));        // a prefill of 8 prompts of 32 tokens: 8 x 3 x 6 = 144 grouped blocks
  CHECK_FALSE(by_size(2, 64));  // 2 x 3 x 12 = 72 grouped blocks
  // A smaller GPU: a 64-token prefill fills 36 SMs' waves and groups.
  CHECK(smcgraph::llama::attention_grid(AttentionGrouping::kBySize, 1, 64, 9, 3, 36).grouped);
  // Bad shapes name the parameter.
  const auto error = [](int tokens, int heads, int kv_heads, int multiprocessors) {
    return error_of([&] {
      smcgraph::llama::attention_grid(AttentionGrouping::kBySize, 1, tokens, heads, kv_heads,
                                      multiprocessors);
    });
  };
  CHECK_MESSAGE(contains(error(1, 9, 0, 132), "kv_heads"), error(1, 9, 0, 132));
  CHECK_MESSAGE(contains(error(1, 9, 2, 132), "kv_heads"), error(1, 9, 2, 132));
  CHECK_MESSAGE(contains(error(0, 9, 3, 132), "tokens_per_row"), error(0, 9, 3, 132));
  CHECK_MESSAGE(contains(error(1, 9, 3, 0), "multiprocessors"), error(1, 9, 3, 0));
  // Forced either way, whatever the size.
  for (const auto& [rows, tokens] : {std::pair{1, 1}, std::pair{1, 64}, std::pair{64, 5}}) {
    CHECK(smcgraph::llama::attention_grid(AttentionGrouping::kGrouped, rows, tokens, 9, 3, 132).grouped);
    CHECK_FALSE(
        smcgraph::llama::attention_grid(AttentionGrouping::kPerQuery, rows, tokens, 9, 3, 132).grouped);
  }
}

TEST_CASE("llama reference: layer 0 K and V follow the contract (adjacent-pair RoPE, float angle)") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const LlamaHostWeights w = tiny_weights(tiny_spec(rng.bits(), 2, 128, 4, 2)); // head_dim 32
  const LlamaConfig& c = w.config;
  LlamaReference ref(w, {}, 64, 1024);
  // One row: token t at positions 0 .. 2 in slots 1 .. 3, then the same token at position 777 in slot 4.
  const int32_t t = static_cast<int32_t>(rng.integer(0, c.vocab - 1));
  LlamaForwardInputs in;
  in.rows = 1;
  in.tokens_per_row = 4;
  in.tokens = {t, t, t, t};
  in.positions = {0, 1, 2, 777};
  in.out_slots = {1, 2, 3, 4};
  in.slot_table.assign(1024, 0);
  in.seq_lens = {778};
  in.live = {1};
  run(ref, in);
  // The same token: layer-0 inputs are identical, so V is identical and K differs only by the rotation.
  const int hd = c.head_dim, kvd = c.kv_heads * hd, H = c.hidden;
  auto kv_at = [&](int slot, int kind) {
    return ref.kv().data() + (static_cast<size_t>(slot) * 2 + kind) * kvd;
  };
  std::vector<double> x(H), n(H), k(kvd);
  double squares = 0.0;
  for (int h = 0; h < H; ++h) {
    x[h] = test::bf16_to_float(w.token_embd[static_cast<size_t>(t) * H + h]);
    squares += x[h] * x[h];
  }
  const double scale = 1.0 / std::sqrt(squares / H + c.rms_eps);
  for (int h = 0; h < H; ++h)
    n[h] = test::round_to(smcgraph::DType::kBFloat16,
                          static_cast<float>(x[h] * scale * w.layers[0].attn_norm[h]));
  for (int r = 0; r < kvd; ++r) {
    k[r] = 0.0;
    for (int h = 0; h < H; ++h)
      k[r] += test::bf16_to_float(w.layers[0].k[static_cast<size_t>(r) * H + h]) * n[h];
  }
  for (int slot : {1, 2, 3, 4}) {
    const int p = in.positions[slot - 1];
    CAPTURE(p);
    for (int d = 0; d < kvd; ++d)
      CHECK(kv_at(slot, 1)[d] == kv_at(1, 1)[d]);
    for (int head = 0; head < c.kv_heads; ++head) {
      for (int i = 0; i < hd / 2; ++i) {
        const float inv_freq = static_cast<float>(std::pow(static_cast<double>(c.rope_base), -2.0 * i / hd));
        const double angle = static_cast<float>(static_cast<float>(p) * inv_freq);
        const double a = k[head * hd + 2 * i], b = k[head * hd + 2 * i + 1];
        const double want[2] = {a * std::cos(angle) - b * std::sin(angle),
                                a * std::sin(angle) + b * std::cos(angle)};
        for (int e = 0; e < 2; ++e) {
          const double got = kv_at(slot, 0)[head * hd + 2 * i + e];
          // One bf16 ulp of the value (the sums' order differs from the reference's).
          CHECK(std::abs(got - want[e]) <= std::ldexp(std::abs(want[e]), -7) + 1e-6);
        }
      }
    }
  }
}

TEST_CASE("llama reference: one prefill = one token at a time = 2-token blocks, in every numerics mode") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const LlamaHostWeights w = tiny_weights(tiny_spec(rng.bits(), 2, 64, 4, 2));
  for (LlamaNumerics numerics :
       {LlamaNumerics::kContract, LlamaNumerics::kContractFloat, LlamaNumerics::kExact}) {
    CAPTURE(static_cast<int>(numerics));
    const LlamaSequences s =
        reference::random_llama_sequences({23}, w.config.vocab, 256, 64, 1.0, rng.engine());
    LlamaReference prefill(w, {}, 256, 64, numerics), single(w, {}, 256, 64, numerics),
        pairs(w, {}, 256, 64, numerics);
    const std::vector<double> a = feed_in_blocks(prefill, s, 23, rng.engine());
    const std::vector<double> b = feed_in_blocks(single, s, 1, rng.engine());
    const std::vector<double> c = feed_in_blocks(pairs, s, 2, rng.engine());
    // A token's arithmetic does not depend on how the sequence is cut into forwards: equal bit for bit.
    CHECK(a == b);
    CHECK(a == c);
    CHECK(prefill.kv() == single.kv());
    CHECK(prefill.kv() == pairs.kv());
  }
}

TEST_CASE("llama reference: slot ids, other rows and padding rows do not change a row's logits") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const LlamaHostWeights w = tiny_weights(tiny_spec(rng.bits(), 3, 64, 4, 4));
  const int vocab = w.config.vocab, pool = 512, max_seq_len = 48;
  const size_t V = vocab;
  LlamaSequences lone = reference::random_llama_sequences({20}, vocab, pool, max_seq_len, 1.0, rng.engine());
  LlamaReference a(w, {}, pool, max_seq_len);
  const std::vector<double> base = feed_in_blocks(a, lone, 5, rng.engine());

  // The same tokens in other slots (a permuted slot table).
  LlamaSequences moved = lone;
  std::vector<int32_t> other =
      reference::random_llama_sequences({20}, vocab, pool, max_seq_len, 1.0, rng.engine()).slots[0];
  moved.slots[0] = other;
  LlamaReference b(w, {}, pool, max_seq_len);
  CHECK(feed_in_blocks(b, moved, 5, rng.engine()) == base);

  // Row 3 of a crowd of rows of other lengths, some of them padding (12 steps of 1, then 2 of 4).
  LlamaSequences crowd = reference::random_llama_sequences({30, 26, 40, 20, 33, 21}, vocab, pool, max_seq_len,
                                                           0.6, rng.engine());
  crowd.live[3] = 1;
  crowd.tokens[3] = lone.tokens[0];
  crowd.slots[3].clear();
  for (int32_t slot = 1; crowd.slots[3].size() < 20; ++slot) { // slots no other row uses
    bool used = false;
    for (const auto& slots : crowd.slots)
      used = used || std::find(slots.begin(), slots.end(), slot) != slots.end();
    if (!used)
      crowd.slots[3].push_back(slot);
  }
  LlamaReference c(w, {}, pool, max_seq_len);
  const std::vector<double> kv_zero = c.kv();
  std::vector<double> row3;
  for (int block : {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4, 4}) {
    const LlamaForwardInputs in = crowd.next(block, rng.engine());
    const std::vector<double> logits = run(c, in, -77.0);
    for (int row = 0; row < in.rows; ++row) {
      if (in.live[row])
        continue;
      const auto begin = logits.begin() + static_cast<size_t>(row) * block * V;
      CHECK(std::all_of(begin, begin + block * V, [](double x) { return x == -77.0; }));
    }
    row3.insert(row3.end(), logits.begin() + 3 * block * V, logits.begin() + 4 * block * V);
    crowd.advance(block);
  }
  CHECK(row3 == base);
  // Padding rows wrote nothing: a slot holds KV only if a live row owns it.
  std::vector<uint8_t> owned(pool, 0);
  for (size_t row = 0; row < crowd.slots.size(); ++row)
    for (int p = 0; crowd.live[row] && p < crowd.done[row]; ++p)
      owned[crowd.slots[row][p]] = 1;
  const size_t per_slot = 2 * w.config.kv_heads * w.config.head_dim;
  for (size_t layer = 0; layer < 3; ++layer) {
    for (int slot = 0; slot < pool; ++slot) {
      const auto begin = c.kv().begin() + (layer * pool + slot) * per_slot;
      const bool any = std::any_of(begin, begin + per_slot, [](double x) { return x != 0.0; });
      CHECK(any == static_cast<bool>(owned[slot]));
    }
  }
}

TEST_CASE("llama reference: clamps, invalid slots and the layer subset") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  const LlamaHostWeights w = tiny_weights(tiny_spec(rng.bits(), 3, 64, 4, 2));
  const int vocab = w.config.vocab, pool = 128, max_seq_len = 32;
  LlamaSequences s = reference::random_llama_sequences({10}, vocab, pool, max_seq_len, 1.0, rng.engine());
  LlamaReference prefix(w, {}, pool, max_seq_len);
  LlamaSequences head = s;
  head.tokens[0].resize(9);
  head.slots[0].resize(9);
  feed_in_blocks(prefix, head, 9, rng.engine()); // KV for positions 0 .. 8
  s.done[0] = 9;
  const LlamaForwardInputs in = s.next(1, rng.engine());
  auto logits_of = [&](const LlamaForwardInputs& changed, std::vector<double>* kv = nullptr) {
    LlamaReference ref = prefix;
    std::vector<double> logits = run(ref, changed);
    if (kv)
      *kv = ref.kv();
    return logits;
  };
  std::vector<double> kv_a, kv_b;
  LlamaForwardInputs a = in, b = in;
  a.tokens[0] = -5;
  b.tokens[0] = 0;
  CHECK(logits_of(a, &kv_a) == logits_of(b, &kv_b));
  CHECK(kv_a == kv_b);
  a.tokens[0] = vocab + 3;
  b.tokens[0] = vocab - 1;
  CHECK(logits_of(a, &kv_a) == logits_of(b, &kv_b));
  CHECK(kv_a == kv_b);
  // An invalid slot-table id reads slot 0 (zero KV here); a different valid one changes the logits.
  a = in;
  b = in;
  a.slot_table[4] = -1;
  b.slot_table[4] = 0;
  CHECK(logits_of(a) == logits_of(b));
  a.slot_table[4] = pool + 5;
  CHECK(logits_of(a) == logits_of(b));
  CHECK(logits_of(in) != logits_of(b));
  // A write outside [0, pool) is dropped; the token still attends to the earlier positions.
  a = in;
  a.out_slots[0] = pool;
  const std::vector<double> dropped = logits_of(a, &kv_a);
  CHECK(kv_a == prefix.kv());
  CHECK(std::all_of(dropped.begin(), dropped.end(), [](double x) { return std::isfinite(x); }));
  // Layers {0, 2}: its own KV of two layers; layer 0's KV equals the full model's layer 0.
  LlamaReference subset(w, {0, 2}, pool, max_seq_len), full(w, {}, pool, max_seq_len);
  LlamaSequences t = reference::random_llama_sequences({8}, vocab, pool, max_seq_len, 1.0, rng.engine());
  const std::vector<double> subset_logits = feed_in_blocks(subset, t, 8, rng.engine());
  const std::vector<double> full_logits = feed_in_blocks(full, t, 8, rng.engine());
  const size_t layer_size = full.kv().size() / 3;
  REQUIRE(subset.kv().size() == 2 * layer_size);
  CHECK(std::equal(subset.kv().begin(), subset.kv().begin() + layer_size, full.kv().begin()));
  CHECK(subset_logits != full_logits);
}

// The GPU suite compares the device with the kContract reference under reference::kLlama* tolerances. A
// device differs from kContract in its fp32 summation order (and its fp32 transcendentals); kContractFloat
// stands in for such a device on the host: the same rounding points with fp32 sums in index order (error
// ~sqrt(n) 2^-24 per sum, the size of a device's). Its distance to kContract, and the cascade of bf16 flips
// that distance sets off, must stay well inside every tolerance; |kContract - kExact| shows the noise level
// the tolerances are set at (llama_ref.hpp).
TEST_CASE("llama tolerances: an fp32-summing reference stays well inside them") {
  test::Rng rng;
  MESSAGE("seed ", rng.seed());
  struct Case {
    int layers, hidden, heads, kv_heads, vocab, length, block;
  };
  const Case cases[] = {{2, 64, 4, 2, 300, 37, 37},
                        {3, 128, 4, 2, 1000, 24, 5},
                        {3, 128, 2, 2, 500, 9, 1},
                        {2, 64, 4, 4, 300, 600, 200}};
  for (const Case& k : cases) {
    TinyLlamaSpec spec = tiny_spec(rng.bits(), k.layers, k.hidden, k.heads, k.kv_heads);
    spec.vocab = k.vocab;
    spec.context = 2048;
    const LlamaHostWeights w = tiny_weights(spec);
    const int pool = 2048, max_seq_len = 1024;
    const LlamaSequences s = reference::random_llama_sequences({k.length, k.length, k.length}, k.vocab, pool,
                                                               max_seq_len, 1.0, rng.engine());
    LlamaReference contract(w, {}, pool, max_seq_len),
        device_like(w, {}, pool, max_seq_len, LlamaNumerics::kContractFloat),
        exact(w, {}, pool, max_seq_len, LlamaNumerics::kExact);
    LlamaSequences cursor = s;
    reference::LogitsAgreement worst, worst_exact;
    double error_squares = 0.0, noise_squares = 0.0;
    while (cursor.done[0] < k.length) {
      const int count = std::min(k.block, k.length - cursor.done[0]);
      const LlamaForwardInputs in = cursor.next(count, rng.engine());
      const std::vector<double> want = run(contract, in), got = run(device_like, in), ideal = run(exact, in);
      const reference::LogitsAgreement agreement =
          reference::compare_logits(in, k.vocab, got, want, &ideal, reference::kLlamaLogitTolerance);
      CHECK_MESSAGE(agreement.ok(), agreement.problem);
      const reference::LogitsAgreement exact_agreement =
          reference::compare_logits(in, k.vocab, ideal, want, nullptr, reference::kLlamaLogitTolerance);
      worst = agreement.max_error >= worst.max_error ? agreement : worst;
      worst_exact = exact_agreement.max_error >= worst_exact.max_error ? exact_agreement : worst_exact;
      error_squares += agreement.rms_error * agreement.rms_error * agreement.compared;
      noise_squares += agreement.rms_noise * agreement.rms_noise * agreement.compared;
      cursor.advance(count);
    }
    const reference::KvAgreement kv = reference::compare_kv(
        device_like, contract, reference::kLlamaKvFirstLayerSlack, reference::kLlamaKvSlack);
    const reference::KvAgreement kv_exact = reference::compare_kv(exact, contract, 1.0, 1.0);
    const double noise_ratio = std::sqrt(error_squares / noise_squares);
    CAPTURE(k.hidden);
    CAPTURE(k.length);
    MESSAGE("hidden ", k.hidden, ", ", k.length, " tokens in blocks of ", k.block,
            ": fp32 sums vs contract: ", worst.summary(), ", rms error / rms noise over all forwards ",
            noise_ratio, "; kv: ", kv.differing, " of ", kv.compared, " differ, max excess ", kv.max_excess,
            ". Exact vs contract: max scaled error ", worst_exact.max_error, ", kv max excess ",
            kv_exact.max_excess);
    CHECK_MESSAGE(kv.ok(), kv.problem);
    // Margins: the device-like error stays within half of each tolerance (the noise ratio: below it).
    CHECK(worst.max_error < reference::kLlamaLogitTolerance / 2);
    CHECK(noise_ratio < reference::kLlamaNoiseFraction);
    CHECK(kv.max_excess < reference::kLlamaKvSlack / 2);
    // The contract's rounding points are in effect: the exact math differs from it well above fp32 level.
    CHECK(worst_exact.max_error > 1e-3);
  }
}

TEST_CASE("the real SmolLM2 file: config facts, host weights, and a short greedy forward") {
  const std::filesystem::path path = real_model_path();
  if (!std::filesystem::exists(path)) {
    MESSAGE("skipped: real model file not found (run ./run fetch-model)");
    return;
  }
  const GgufFile file = GgufFile::open(path.string());
  const LlamaConfig c = smcgraph::llama_config_from_gguf(file);
  CHECK(c.layers == 30);
  CHECK(c.hidden == 576);
  CHECK(c.ffn == 1536);
  CHECK(c.heads == 9);
  CHECK(c.kv_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.vocab == 49152);
  CHECK(c.context == 8192);
  CHECK(c.rope_base == 100000.0f);
  CHECK(c.rms_eps == doctest::Approx(1e-5f));
  CHECK(c.tied_head);
  const auto start = std::chrono::steady_clock::now();
  const LlamaHostWeights w = smcgraph::load_llama_host_weights(file);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  REQUIRE(w.layers.size() == 30);
  CHECK(w.output.empty());
  CHECK(w.token_embd.size() == size_t{49152} * 576);
  CHECK(w.layers[29].down.size() == size_t{576} * 1536);
  // token_embd is Q8_0 in this file: the int8 head's weights are there and dequantise to the bf16 head.
  REQUIRE(w.head_q8.size() == size_t{49152} * 576);
  size_t differing = 0;
  for (size_t i = 0; i < w.token_embd.size(); ++i)
    differing +=
        test::float_to_bf16(static_cast<float>(w.head_q8[i]) * w.head_q8_scales[i / 32]) != w.token_embd[i];
  CHECK(differing == 0);
  MESSAGE("host weights loaded in ", load_s, " s");

  // "The capital of France is" (GPT-2 byte-level BPE of the file's vocabulary) -> " Paris" (7042).
  const std::vector<int32_t> prompt = {504, 3575, 282, 4649, 314};
  constexpr int32_t kParis = 7042;
  LlamaForwardInputs in;
  in.rows = 1;
  in.tokens_per_row = static_cast<int>(prompt.size());
  in.tokens = prompt;
  in.live = {1};
  in.seq_lens = {in.tokens_per_row};
  in.slot_table.assign(16, 0);
  for (int p = 0; p < in.tokens_per_row; ++p) {
    in.positions.push_back(p);
    in.out_slots.push_back(p + 1);
    in.slot_table[p] = p + 1;
  }
  const auto forward_start = std::chrono::steady_clock::now();
  LlamaReference contract(w, {}, 16, 16), exact(w, {}, 16, 16, LlamaNumerics::kExact);
  const std::vector<double> want = run(contract, in), ideal = run(exact, in);
  const double forward_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - forward_start).count();
  MESSAGE("two reference forwards of ", prompt.size(), " tokens in ", forward_s, " s");
  const size_t V = c.vocab;
  const auto last = want.begin() + (prompt.size() - 1) * V,
             last_exact = ideal.begin() + (prompt.size() - 1) * V;
  CHECK(std::max_element(last, last + V) - last == kParis);
  CHECK(std::max_element(last_exact, last_exact + V) - last_exact == kParis);
  const reference::LogitsAgreement agreement =
      reference::compare_logits(in, c.vocab, want, ideal, nullptr, 0.25);
  MESSAGE("bf16 contract vs float64: ", agreement.summary());
  CHECK(agreement.top_mismatches == 0);
}
