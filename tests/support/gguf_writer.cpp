#include "support/gguf_writer.hpp"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <numbers>

#include "smcgraph/error.hpp"

namespace smcgraph::test {

namespace {

class ByteSink {
public:
  std::vector<uint8_t> bytes;
  template <class T> void put(T value) {
    const size_t at = bytes.size();
    bytes.resize(at + sizeof(T));
    std::memcpy(bytes.data() + at, &value, sizeof(T));
  }
  void put_bits(uint64_t bits, size_t size) {
    for (size_t i = 0; i < size; ++i)
      bytes.push_back(static_cast<uint8_t>(bits >> (8 * i)));
  }
  void put_string(const std::string& text) {
    put<uint64_t>(text.size());
    bytes.insert(bytes.end(), text.begin(), text.end());
  }
  void pad_to(uint64_t alignment) {
    while (bytes.size() % alignment != 0)
      bytes.push_back(0);
  }
};

// The payload of a value (after its type tag).
void put_payload(ByteSink& sink, const GgufMetaValue& value) {
  switch (value.type) {
  case GgufValueType::kString:
    sink.put_string(value.text);
    return;
  case GgufValueType::kArray:
    sink.put<uint32_t>(static_cast<uint32_t>(value.element_type));
    sink.put<uint64_t>(value.items.size());
    for (const GgufMetaValue& item : value.items)
      put_payload(sink, item);
    return;
  default:
    sink.put_bits(value.bits, gguf_value_type_size(value.type));
    return;
  }
}

float half_to_float(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  double magnitude;
  if (exponent == 0)
    magnitude = std::ldexp(static_cast<double>(mantissa), -24);
  else if (exponent == 31)
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else
    magnitude = std::ldexp(static_cast<double>(mantissa + 1024), exponent - 25);
  return static_cast<float>((h & 0x8000) ? -magnitude : magnitude);
}

void check_blocks(GgufType type, size_t count) {
  const size_t block = gguf_type_block_elements(type);
  require(count % block == 0, "quantize_values", "values.size()", count,
          "must be a multiple of the block size");
}

// Deterministic normal-ish numbers: splitmix64 and Box-Muller.
class Stream {
public:
  explicit Stream(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1p-53; } // (0, 1)
  double normal() {
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(2.0 * std::numbers::pi * uniform());
  }

private:
  uint64_t state_;
};

uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : text)
    hash = (hash ^ c) * 0x100000001b3ull;
  return hash;
}

} // namespace

GgufMetaValue GgufMetaValue::integer(GgufValueType type, int64_t value) {
  require(gguf_value_type_size(type) != 0 && type != GgufValueType::kFloat32 &&
              type != GgufValueType::kFloat64,
          "GgufMetaValue::integer", "type", static_cast<uint32_t>(type), "must be an integer type or bool");
  GgufMetaValue v;
  v.type = type;
  v.bits = static_cast<uint64_t>(value);
  return v;
}
GgufMetaValue GgufMetaValue::uint64(uint64_t value) {
  GgufMetaValue v;
  v.type = GgufValueType::kUint64;
  v.bits = value;
  return v;
}
GgufMetaValue GgufMetaValue::boolean(bool value) {
  return integer(GgufValueType::kBool, value ? 1 : 0);
}
GgufMetaValue GgufMetaValue::float32(float value) {
  GgufMetaValue v;
  v.type = GgufValueType::kFloat32;
  v.bits = std::bit_cast<uint32_t>(value);
  return v;
}
GgufMetaValue GgufMetaValue::float64(double value) {
  GgufMetaValue v;
  v.type = GgufValueType::kFloat64;
  v.bits = std::bit_cast<uint64_t>(value);
  return v;
}
GgufMetaValue GgufMetaValue::string(std::string value) {
  GgufMetaValue v;
  v.type = GgufValueType::kString;
  v.text = std::move(value);
  return v;
}
GgufMetaValue GgufMetaValue::array(GgufValueType element_type, std::vector<GgufMetaValue> items) {
  GgufMetaValue v;
  v.type = GgufValueType::kArray;
  v.element_type = element_type;
  v.items = std::move(items);
  return v;
}
GgufMetaValue GgufMetaValue::string_array(const std::vector<std::string>& values) {
  std::vector<GgufMetaValue> items;
  items.reserve(values.size());
  for (const std::string& text : values)
    items.push_back(string(text));
  return array(GgufValueType::kString, std::move(items));
}
GgufMetaValue GgufMetaValue::integer_array(GgufValueType element_type, const std::vector<int64_t>& values) {
  std::vector<GgufMetaValue> items;
  items.reserve(values.size());
  for (int64_t value : values)
    items.push_back(integer(element_type, value));
  return array(element_type, std::move(items));
}
GgufMetaValue GgufMetaValue::float32_array(const std::vector<float>& values) {
  std::vector<GgufMetaValue> items;
  items.reserve(values.size());
  for (float value : values)
    items.push_back(float32(value));
  return array(GgufValueType::kFloat32, std::move(items));
}

uint16_t writer_float_to_bf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t writer_float_to_fp16(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) // NaN: keep it quiet
    return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u) // >= 65520 rounds to infinity
    return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax < 0x38800000u) { // below 2^-14: a half subnormal (or zero); value * 2^24 is exact in float
    const float scaled = std::bit_cast<float>(ax) * 0x1p24f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
  }
  ax += 0xfffu + ((ax >> 13) & 1u); // round to nearest even at bit 13
  ax -= 112u << 23;                 // float bias 127 -> half bias 15
  return static_cast<uint16_t>(sign | (ax >> 13));
}

std::vector<uint8_t> quantize_values(GgufType type, const std::vector<float>& values) {
  check_blocks(type, values.size());
  std::vector<uint8_t> out;
  auto put16 = [&out](uint16_t bits) {
    out.push_back(static_cast<uint8_t>(bits));
    out.push_back(static_cast<uint8_t>(bits >> 8));
  };
  const size_t blocks = values.size() / 32;
  switch (type) {
  case GgufType::kF32:
    out.resize(values.size() * 4);
    std::memcpy(out.data(), values.data(), out.size());
    break;
  case GgufType::kF16:
    for (float v : values)
      put16(writer_float_to_fp16(v));
    break;
  case GgufType::kBF16:
    for (float v : values)
      put16(writer_float_to_bf16(v));
    break;
  case GgufType::kQ4_0: // ggml quantize_row_q4_0_ref
    for (size_t b = 0; b < blocks; ++b) {
      const float* x = values.data() + 32 * b;
      float amax = 0.0f, max = 0.0f;
      for (int j = 0; j < 32; ++j) {
        if (amax < std::fabs(x[j])) {
          amax = std::fabs(x[j]);
          max = x[j];
        }
      }
      const float d = max / -8;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      put16(writer_float_to_fp16(d));
      for (int j = 0; j < 16; ++j) {
        const int q0 = std::min(15, static_cast<int>(x[j] * id + 8.5f));
        const int q1 = std::min(15, static_cast<int>(x[j + 16] * id + 8.5f));
        out.push_back(static_cast<uint8_t>(q0 | (q1 << 4)));
      }
    }
    break;
  case GgufType::kQ4_1: // ggml quantize_row_q4_1_ref
    for (size_t b = 0; b < blocks; ++b) {
      const float* x = values.data() + 32 * b;
      float min = FLT_MAX, max = -FLT_MAX;
      for (int j = 0; j < 32; ++j) {
        min = std::min(min, x[j]);
        max = std::max(max, x[j]);
      }
      const float d = (max - min) / 15;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      put16(writer_float_to_fp16(d));
      put16(writer_float_to_fp16(min));
      for (int j = 0; j < 16; ++j) {
        const int q0 = std::min(15, static_cast<int>((x[j] - min) * id + 0.5f));
        const int q1 = std::min(15, static_cast<int>((x[j + 16] - min) * id + 0.5f));
        out.push_back(static_cast<uint8_t>(q0 | (q1 << 4)));
      }
    }
    break;
  case GgufType::kQ8_0: // ggml quantize_row_q8_0_ref
    for (size_t b = 0; b < blocks; ++b) {
      const float* x = values.data() + 32 * b;
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j)
        amax = std::max(amax, std::fabs(x[j]));
      const float d = amax / 127;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      put16(writer_float_to_fp16(d));
      for (int j = 0; j < 32; ++j)
        out.push_back(static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * id))));
    }
    break;
  }
  return out;
}

std::vector<float> quantized_reconstruction(GgufType type, const std::vector<float>& values) {
  const std::vector<uint8_t> bytes = quantize_values(type, values);
  std::vector<float> out(values.size());
  auto get16 = [&bytes](size_t at) { return static_cast<uint16_t>(bytes[at] | (bytes[at + 1] << 8)); };
  const size_t blocks = values.size() / 32;
  switch (type) {
  case GgufType::kF32:
    return values;
  case GgufType::kF16:
    for (size_t i = 0; i < values.size(); ++i)
      out[i] = half_to_float(get16(2 * i));
    break;
  case GgufType::kBF16:
    for (size_t i = 0; i < values.size(); ++i)
      out[i] = std::bit_cast<float>(static_cast<uint32_t>(get16(2 * i)) << 16);
    break;
  case GgufType::kQ4_0:
    for (size_t b = 0; b < blocks; ++b) {
      const float d = half_to_float(get16(18 * b));
      for (int j = 0; j < 16; ++j) {
        const uint8_t q = bytes[18 * b + 2 + j];
        out[32 * b + j] = static_cast<float>((q & 15) - 8) * d;
        out[32 * b + 16 + j] = static_cast<float>((q >> 4) - 8) * d;
      }
    }
    break;
  case GgufType::kQ4_1:
    for (size_t b = 0; b < blocks; ++b) {
      const float d = half_to_float(get16(20 * b));
      const float m = half_to_float(get16(20 * b + 2));
      for (int j = 0; j < 16; ++j) {
        const uint8_t q = bytes[20 * b + 4 + j];
        out[32 * b + j] = static_cast<float>(q & 15) * d + m;
        out[32 * b + 16 + j] = static_cast<float>(q >> 4) * d + m;
      }
    }
    break;
  case GgufType::kQ8_0:
    for (size_t b = 0; b < blocks; ++b) {
      const float d = half_to_float(get16(34 * b));
      for (int j = 0; j < 32; ++j)
        out[32 * b + j] = static_cast<float>(static_cast<int8_t>(bytes[34 * b + 2 + j])) * d;
    }
    break;
  }
  return out;
}

void GgufWriter::set_alignment(uint64_t alignment, bool write_key) {
  alignment_ = alignment;
  std::erase_if(kvs_, [](const auto& kv) { return kv.first == "general.alignment"; });
  if (write_key)
    add_u32("general.alignment", static_cast<uint32_t>(alignment));
}

void GgufWriter::add(const std::string& key, GgufMetaValue value) {
  kvs_.emplace_back(key, std::move(value));
}

std::vector<float> GgufWriter::add_tensor(const std::string& name, const std::vector<int64_t>& dims,
                                          GgufType type, const std::vector<float>& values) {
  int64_t elements = 1;
  for (int64_t d : dims)
    elements *= d;
  require(static_cast<int64_t>(values.size()) == elements, "GgufWriter::add_tensor", "values.size()",
          values.size(), "must equal the product of dims");
  tensors_.push_back({name, dims, static_cast<uint32_t>(type), quantize_values(type, values)});
  return quantized_reconstruction(type, values);
}

void GgufWriter::add_tensor_raw(const std::string& name, const std::vector<int64_t>& dims, uint32_t type,
                                std::vector<uint8_t> data) {
  tensors_.push_back({name, dims, type, std::move(data)});
}

std::vector<uint8_t> GgufWriter::bytes(GgufLayout* layout) const {
  ByteSink sink;
  GgufLayout map;
  for (char c : {'G', 'G', 'U', 'F'})
    sink.bytes.push_back(static_cast<uint8_t>(c));
  sink.put<uint32_t>(version_);
  sink.put<uint64_t>(tensors_.size());
  sink.put<uint64_t>(kvs_.size());
  for (const auto& [key, value] : kvs_) {
    GgufLayout::Kv kv{key, sink.bytes.size(), 0, 0};
    sink.put_string(key);
    kv.type_offset = sink.bytes.size();
    sink.put<uint32_t>(static_cast<uint32_t>(value.type));
    kv.value_offset = sink.bytes.size();
    put_payload(sink, value);
    map.kvs.push_back(kv);
  }
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  for (const Tensor& tensor : tensors_) {
    offset = (offset + alignment_ - 1) / alignment_ * alignment_;
    offsets.push_back(offset);
    GgufLayout::TensorInfo info{tensor.name, sink.bytes.size(), 0, 0, 0, 0};
    sink.put_string(tensor.name);
    info.n_dims_offset = sink.bytes.size();
    sink.put<uint32_t>(static_cast<uint32_t>(tensor.dims.size()));
    info.dims_offset = sink.bytes.size();
    for (int64_t d : tensor.dims)
      sink.put<uint64_t>(static_cast<uint64_t>(d));
    info.type_offset = sink.bytes.size();
    sink.put<uint32_t>(tensor.type);
    info.offset_offset = sink.bytes.size();
    sink.put<uint64_t>(offset);
    offset += tensor.data.size();
    map.tensors.push_back(info);
  }
  sink.pad_to(alignment_);
  map.data_start = sink.bytes.size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    sink.bytes.resize(map.data_start + offsets[i], 0);
    map.tensor_data_offsets.push_back(sink.bytes.size());
    sink.bytes.insert(sink.bytes.end(), tensors_[i].data.begin(), tensors_[i].data.end());
  }
  if (layout != nullptr)
    *layout = std::move(map);
  return std::move(sink.bytes);
}

void GgufWriter::write(const std::string& path) const {
  const std::vector<uint8_t> data = bytes();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  if (!out)
    throw Error("GgufWriter::write: cannot write '" + path + "'");
}

std::vector<uint8_t> gpt2_byte_order() {
  // bytes_to_unicode: the printable bytes keep their code point and come first, in this order.
  std::vector<uint8_t> order;
  for (int b = '!'; b <= '~'; ++b)
    order.push_back(static_cast<uint8_t>(b));
  for (int b = 0xa1; b <= 0xac; ++b)
    order.push_back(static_cast<uint8_t>(b));
  for (int b = 0xae; b <= 0xff; ++b)
    order.push_back(static_cast<uint8_t>(b));
  for (int b = 0; b < 256; ++b) {
    if (std::find(order.begin(), order.end(), static_cast<uint8_t>(b)) == order.end())
      order.push_back(static_cast<uint8_t>(b));
  }
  return order;
}

std::string gpt2_byte_symbol(uint8_t byte) {
  // The printable bytes map to themselves; the others, in byte order, to U+0100, U+0101, ...
  const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xa1 && byte <= 0xac) || byte >= 0xae;
  uint32_t code_point = byte;
  if (!printable) {
    uint32_t n = 0;
    for (int b = 0; b < byte; ++b) {
      const bool p = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      n += p ? 0 : 1;
    }
    code_point = 256 + n;
  }
  std::string utf8;
  if (code_point < 0x80) {
    utf8.push_back(static_cast<char>(code_point));
  } else {
    utf8.push_back(static_cast<char>(0xc0 | (code_point >> 6)));
    utf8.push_back(static_cast<char>(0x80 | (code_point & 0x3f)));
  }
  return utf8;
}

TinyVocabulary make_tiny_vocabulary(int vocab) {
  require(vocab >= 259, "make_tiny_vocabulary", "vocab", vocab, "must be >= 259 (3 specials + 256 bytes)");
  TinyVocabulary v;
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    v.tokens.push_back(special);
    v.token_types.push_back(3);
  }
  for (uint8_t byte : gpt2_byte_order()) {
    v.tokens.push_back(gpt2_byte_symbol(byte));
    v.token_types.push_back(1);
  }
  // Merges in rank order; each one's parts are bytes or earlier merges (as in a trained BPE vocabulary).
  const std::string space = gpt2_byte_symbol(' ');
  const std::vector<std::pair<std::string, std::string>> merges = {
      {space, "t"}, {space, "a"},        {"i", "n"},   {"h", "e"},    {"r", "e"},
      {"o", "n"},   {space + "t", "he"}, {"e", "r"},   {"a", "t"},    {space, "s"},
      {"e", "n"},   {"o", "r"},          {space, "w"}, {"l", "l"},    {space, space},
      {"in", "g"},  {space, "c"},        {space, "o"}, {"he", "ll"},  {"hell", "o"},
      {space, "h"}, {"w", "or"},         {"wor", "l"}, {"worl", "d"}, {space, "hello"}};
  for (const auto& [left, right] : merges) {
    if (static_cast<int>(v.tokens.size()) >= vocab)
      break;
    v.tokens.push_back(left + right);
    v.token_types.push_back(1);
    v.merges.push_back(left + " " + right);
  }
  for (int filler = 0; static_cast<int>(v.tokens.size()) < vocab; ++filler) {
    v.tokens.push_back("<unused_" + std::to_string(filler) + ">");
    v.token_types.push_back(5);
  }
  return v;
}

GgufWriter tiny_llama_writer(const TinyLlamaSpec& spec) {
  const char* where = "tiny_llama_writer";
  require(spec.layers >= 1, where, "spec.layers", spec.layers, "must be >= 1");
  require(spec.heads >= 1 && spec.hidden % spec.heads == 0, where, "spec.heads", spec.heads,
          "must divide spec.hidden");
  require(spec.kv_heads >= 1 && spec.heads % spec.kv_heads == 0, where, "spec.kv_heads", spec.kv_heads,
          "must divide spec.heads");
  require(spec.hidden > 0 && spec.hidden % 32 == 0, where, "spec.hidden", spec.hidden,
          "must be a positive multiple of 32 (quantisation blocks)");
  require(spec.ffn > 0 && spec.ffn % 32 == 0, where, "spec.ffn", spec.ffn,
          "must be a positive multiple of 32 (quantisation blocks)");
  require(spec.context >= 1, where, "spec.context", spec.context, "must be >= 1");
  const int64_t hidden = spec.hidden, ffn = spec.ffn, vocab = spec.vocab;
  const int64_t head_dim = hidden / spec.heads;
  const int64_t kv_dim = head_dim * spec.kv_heads;

  GgufWriter writer(3);
  writer.add_string("general.architecture", "llama");
  writer.add_string("general.name", "smcgraph tiny llama");
  writer.add_u32("llama.block_count", static_cast<uint32_t>(spec.layers));
  writer.add_u32("llama.context_length", static_cast<uint32_t>(spec.context));
  writer.add_u32("llama.embedding_length", static_cast<uint32_t>(spec.hidden));
  writer.add_u32("llama.feed_forward_length", static_cast<uint32_t>(spec.ffn));
  writer.add_u32("llama.attention.head_count", static_cast<uint32_t>(spec.heads));
  writer.add_u32("llama.attention.head_count_kv", static_cast<uint32_t>(spec.kv_heads));
  writer.add_f32("llama.rope.freq_base", spec.rope_base);
  writer.add_f32("llama.attention.layer_norm_rms_epsilon", spec.eps);
  // llama_ftype of the projections' type ("mostly Q4_1" = 3 as in the real file).
  const uint32_t file_type = spec.weight_type == GgufType::kF32    ? 0
                             : spec.weight_type == GgufType::kF16  ? 1
                             : spec.weight_type == GgufType::kQ4_0 ? 2
                             : spec.weight_type == GgufType::kQ4_1 ? 3
                             : spec.weight_type == GgufType::kQ8_0 ? 7
                                                                   : 32;
  writer.add_u32("general.file_type", file_type);
  writer.add_u32("llama.vocab_size", static_cast<uint32_t>(spec.vocab));
  writer.add_u32("llama.rope.dimension_count", static_cast<uint32_t>(head_dim));

  const TinyVocabulary tokenizer = make_tiny_vocabulary(spec.vocab);
  writer.add_bool("tokenizer.ggml.add_space_prefix", false);
  writer.add_bool("tokenizer.ggml.add_bos_token", false);
  writer.add_string("tokenizer.ggml.model", "gpt2");
  writer.add_string("tokenizer.ggml.pre", "smollm");
  writer.add_string_array("tokenizer.ggml.tokens", tokenizer.tokens);
  writer.add_i32_array("tokenizer.ggml.token_type", tokenizer.token_types);
  writer.add_string_array("tokenizer.ggml.merges", tokenizer.merges);
  writer.add_u32("tokenizer.ggml.bos_token_id", 1);
  writer.add_u32("tokenizer.ggml.eos_token_id", 2);
  writer.add_u32("tokenizer.ggml.unknown_token_id", 0);
  writer.add_u32("tokenizer.ggml.padding_token_id", 2);
  writer.add_string("tokenizer.chat_template",
                    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
                    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                    "{{ '<|im_start|>assistant\n' }}{% endif %}");
  writer.add_u32("general.quantization_version", 2);

  // Values depend on the seed and the tensor's name only (not on the order of the tensors).
  auto matrix = [&](const std::string& name, int64_t ne0, int64_t ne1, GgufType type) {
    Stream stream(spec.seed ^ fnv1a(name));
    const double scale = 1.0 / std::sqrt(static_cast<double>(ne0));
    std::vector<float> values(static_cast<size_t>(ne0 * ne1));
    for (float& v : values)
      v = static_cast<float>(scale * stream.normal());
    writer.add_tensor(name, {ne0, ne1}, type, values);
  };
  auto norm = [&](const std::string& name) {
    Stream stream(spec.seed ^ fnv1a(name));
    std::vector<float> values(static_cast<size_t>(hidden));
    for (float& v : values)
      v = static_cast<float>(1.0 + 0.1 * (2.0 * stream.uniform() - 1.0));
    writer.add_tensor(name, {hidden}, GgufType::kF32, values);
  };

  matrix("token_embd.weight", hidden, vocab, spec.embedding_type);
  for (int layer = 0; layer < spec.layers; ++layer) {
    const std::string block = "blk." + std::to_string(layer) + ".";
    norm(block + "attn_norm.weight");
    matrix(block + "attn_q.weight", hidden, hidden, spec.weight_type);
    matrix(block + "attn_k.weight", hidden, kv_dim, spec.weight_type);
    matrix(block + "attn_v.weight", hidden, kv_dim, spec.weight_type);
    matrix(block + "attn_output.weight", hidden, hidden, spec.weight_type);
    norm(block + "ffn_norm.weight");
    matrix(block + "ffn_gate.weight", hidden, ffn, spec.weight_type);
    matrix(block + "ffn_up.weight", hidden, ffn, spec.weight_type);
    matrix(block + "ffn_down.weight", ffn, hidden, spec.weight_type);
  }
  norm("output_norm.weight");
  if (!spec.tied)
    matrix("output.weight", hidden, vocab, spec.embedding_type);
  return writer;
}

std::vector<uint8_t> make_tiny_llama_gguf(const TinyLlamaSpec& spec) {
  return tiny_llama_writer(spec).bytes();
}

} // namespace smcgraph::test
