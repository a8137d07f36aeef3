// A small GGUF writer for tests: metadata of every value type, tensors quantised on the host with ggml's
// reference quantisers, a byte map of what it wrote (so a test can corrupt one field), and a complete tiny
// Llama-architecture file with a byte-level GPT-2 tokenizer section.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "smcgraph/gguf.hpp"

namespace smcgraph::test {

/// One metadata value to write. Integers and bools keep their bits in `bits`; floats theirs.
struct GgufMetaValue {
  GgufValueType type = GgufValueType::kUint8;
  uint64_t bits = 0; ///< scalar payload, little-endian, `value_type_size` bytes written
  std::string text;  ///< kString
  GgufValueType element_type = GgufValueType::kUint8; ///< kArray
  std::vector<GgufMetaValue> items;                   ///< kArray: elements (each of `element_type`)

  /// Any integer type (kUint8 .. kInt64) or kBool; `value` is truncated to the type's width.
  static GgufMetaValue integer(GgufValueType type, int64_t value);
  static GgufMetaValue uint64(uint64_t value);
  static GgufMetaValue boolean(bool value);
  static GgufMetaValue float32(float value);
  static GgufMetaValue float64(double value);
  static GgufMetaValue string(std::string value);
  static GgufMetaValue array(GgufValueType element_type, std::vector<GgufMetaValue> items);
  static GgufMetaValue string_array(const std::vector<std::string>& values);
  static GgufMetaValue integer_array(GgufValueType element_type, const std::vector<int64_t>& values);
  static GgufMetaValue float32_array(const std::vector<float>& values);
};

/// Where the writer put each field (byte offsets into `bytes()`), for tests that corrupt one of them.
struct GgufLayout {
  struct Kv {
    std::string key;
    size_t key_offset = 0;  ///< the key's u64 length
    size_t type_offset = 0; ///< the u32 value type
    size_t value_offset = 0;
  };
  struct TensorInfo {
    std::string name;
    size_t name_offset = 0;   ///< the name's u64 length
    size_t n_dims_offset = 0; ///< u32
    size_t dims_offset = 0;   ///< first u64 dimension
    size_t type_offset = 0;   ///< u32
    size_t offset_offset = 0; ///< u64 offset within the data section
  };
  std::vector<Kv> kvs;
  std::vector<TensorInfo> tensors;
  size_t data_start = 0;
  std::vector<size_t> tensor_data_offsets; ///< absolute file offsets of each tensor's bytes
};

/// Quantises `values` (a whole number of blocks) to `type` with ggml's reference quantisers.
std::vector<uint8_t> quantize_values(GgufType type, const std::vector<float>& values);
/// The floats the bytes of `quantize_values(type, values)` represent, computed here independently of the
/// reader (d and m as fp16, w = d*q (+ m)).
std::vector<float> quantized_reconstruction(GgufType type, const std::vector<float>& values);
/// float -> IEEE half, round to nearest even (the writer's own conversion, as ggml's GGML_FP32_TO_FP16).
uint16_t writer_float_to_fp16(float value);
/// float -> bf16 bits, round to nearest even, NaN kept (the writer's own conversion).
uint16_t writer_float_to_bf16(float value);

class GgufWriter {
public:
  explicit GgufWriter(uint32_t version = 3) : version_(version) {}

  void set_version(uint32_t version) { version_ = version; }
  /// Aligns the data section and every tensor to `alignment`; writes `general.alignment` (uint32) unless
  /// `write_key` is false (then the file claims the default 32).
  void set_alignment(uint64_t alignment, bool write_key = true);

  void add(const std::string& key, GgufMetaValue value);
  void add_u32(const std::string& key, uint32_t value) {
    add(key, GgufMetaValue::integer(GgufValueType::kUint32, value));
  }
  void add_i32(const std::string& key, int32_t value) {
    add(key, GgufMetaValue::integer(GgufValueType::kInt32, value));
  }
  void add_f32(const std::string& key, float value) { add(key, GgufMetaValue::float32(value)); }
  void add_bool(const std::string& key, bool value) { add(key, GgufMetaValue::boolean(value)); }
  void add_string(const std::string& key, std::string value) {
    add(key, GgufMetaValue::string(std::move(value)));
  }
  void add_string_array(const std::string& key, const std::vector<std::string>& values) {
    add(key, GgufMetaValue::string_array(values));
  }
  void add_i32_array(const std::string& key, const std::vector<int64_t>& values) {
    add(key, GgufMetaValue::integer_array(GgufValueType::kInt32, values));
  }

  /// Quantises `values` (ggml ne order `dims`) to `type` and returns the floats the file will hold.
  std::vector<float> add_tensor(const std::string& name, const std::vector<int64_t>& dims, GgufType type,
                                const std::vector<float>& values);
  /// A tensor with raw bytes and any type number (no checks: for malformed files).
  void add_tensor_raw(const std::string& name, const std::vector<int64_t>& dims, uint32_t type,
                      std::vector<uint8_t> data);

  /// The file; the last tensor's bytes end the file (no trailing padding).
  std::vector<uint8_t> bytes(GgufLayout* layout = nullptr) const;
  void write(const std::string& path) const;

private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> dims;
    uint32_t type = 0;
    std::vector<uint8_t> data;
  };
  uint32_t version_;
  uint64_t alignment_ = 32;
  std::vector<std::pair<std::string, GgufMetaValue>> kvs_;
  std::vector<Tensor> tensors_;
};

/// A tiny Llama-architecture model. head_dim = hidden / heads; hidden and ffn must be multiples of 32.
struct TinyLlamaSpec {
  int layers = 2;
  int hidden = 64;
  int ffn = 128;
  int heads = 4;
  int kv_heads = 2;
  int vocab = 300; ///< >= 259: 3 specials + 256 byte symbols, then merged tokens, then unused fillers
  int context = 256;
  float rope_base = 10000.0f;
  float eps = 1e-5f;
  uint64_t seed = 1;
  GgufType weight_type = GgufType::kQ4_1;    ///< projections
  GgufType embedding_type = GgufType::kQ8_0; ///< token_embd (and output when untied)
  bool tied = true;                          ///< no output.weight (token_embd is the LM head)
};

/// The GPT-2 byte-level symbol of each byte (bytes_to_unicode), as UTF-8.
std::string gpt2_byte_symbol(uint8_t byte);
/// The 256 bytes in GPT-2's bytes_to_unicode order (printable ones first): the order of the byte tokens.
std::vector<uint8_t> gpt2_byte_order();

/// Tokenizer part of the tiny file: tokens, token types, merges (for tests of the tokenizer).
struct TinyVocabulary {
  std::vector<std::string> tokens;
  std::vector<int64_t> token_types; ///< 1 normal, 3 control, 5 unused
  std::vector<std::string> merges;
};
TinyVocabulary make_tiny_vocabulary(int vocab);

/// The tiny model's writer (add more before calling bytes()) and its bytes.
GgufWriter tiny_llama_writer(const TinyLlamaSpec& spec);
std::vector<uint8_t> make_tiny_llama_gguf(const TinyLlamaSpec& spec);

} // namespace smcgraph::test
