// A reader for GGUF files (versions 2 and 3), the llama.cpp model format: metadata of every value type, the
// tensor table, and host dequantisation of the tensor types the Llama loader needs (F32, F16, BF16, Q4_0,
// Q4_1, Q8_0). Every malformed input throws smcgraph::Error naming what is wrong and where (field, key,
// tensor, byte offset); the reader never reads outside the bytes it was given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace smcgraph {

/// Tensor types (ggml_type numbers). Only these load; any other type is rejected at load with its number.
enum class GgufType : uint32_t { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kBF16 = 30 };

/// Metadata value types (gguf_type numbers, in order).
// clang-format off
enum class GgufValueType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5, kFloat32 = 6, kBool = 7,
  kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11, kFloat64 = 12,
};
// clang-format on

/// One entry of the tensor table, validated at load: 1..4 dimensions, each > 0, ne[0] a whole number of
/// blocks, `offset` aligned and `offset + bytes` inside the data section.
struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims; ///< ggml ne[], fastest-varying first (a [rows, cols] matrix is {cols, rows})
  GgufType type = GgufType::kF32;
  uint64_t offset = 0; ///< from the start of the data section
  uint64_t bytes = 0;
  int64_t elements = 0;
};

/// A parsed GGUF file held in memory. Copies share the (immutable) bytes.
///
///   const auto file = smcgraph::GgufFile::open("model.gguf");
///   const int64_t layers = file.get_int("llama.block_count");
///   const auto norm = file.tensor_f32("output_norm.weight", {file.get_int("llama.embedding_length")});
class GgufFile {
public:
  /// Reads the whole file into memory and parses it; errors name the path.
  static GgufFile open(const std::string& path);
  /// Parses `bytes`; errors name `source_name`.
  static GgufFile from_bytes(std::vector<uint8_t> bytes, std::string source_name = "<memory>");

  uint32_t version() const;
  /// `general.alignment`, 32 when the key is absent.
  uint64_t alignment() const;
  const std::string& source() const;

  bool has(const std::string& key) const;
  /// kArray for arrays; `array_type_of` gives the element type.
  GgufValueType type_of(const std::string& key) const;
  /// Element type of an array value (throws naming the key when it is not an array).
  GgufValueType array_type_of(const std::string& key) const;
  /// Any integer type or bool; throws naming the key when absent, of another type, or a uint64 above
  /// INT64_MAX.
  int64_t get_int(const std::string& key) const;
  /// `fallback` when absent; still throws on a wrong type.
  int64_t get_int(const std::string& key, int64_t fallback) const;
  /// float32 / float64 or any integer type.
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double fallback) const;
  std::string get_string(const std::string& key) const;
  std::vector<std::string> get_string_array(const std::string& key) const;
  /// Arrays of any integer type or bool.
  std::vector<int64_t> get_int_array(const std::string& key) const;
  /// Arrays of float32 / float64 or any integer type.
  std::vector<double> get_float_array(const std::string& key) const;
  /// Every key, in file order.
  std::vector<std::string> keys() const;

  /// The tensor table, in file order.
  const std::vector<GgufTensorInfo>& tensors() const;
  /// nullptr when absent.
  const GgufTensorInfo* find_tensor(const std::string& name) const;
  /// Throws "missing tensor 'name'" when absent.
  const GgufTensorInfo& tensor(const std::string& name) const;
  /// The tensor's bytes (`info.bytes` of them; unaligned in memory, read them with memcpy).
  const uint8_t* tensor_data(const GgufTensorInfo& info) const;

  /// Dequantised copy of a tensor. `expected_dims` (ggml order) must equal its dims; a mismatch throws
  /// naming the tensor and both shapes.
  std::vector<float> tensor_f32(const std::string& name, const std::vector<int64_t>& expected_dims) const;
  /// bf16 bits of the dequantised values (round to nearest even; NaN stays NaN).
  std::vector<uint16_t> tensor_bf16(const std::string& name, const std::vector<int64_t>& expected_dims) const;

  struct Impl; // defined in gguf.cpp

private:
  explicit GgufFile(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

/// Dequantises `elements` consecutive values (a whole number of blocks) of `type` from `src` into `dst`.
void dequantize_row(GgufType type, const uint8_t* src, int64_t elements, float* dst);
/// Q8_0 blocks as they are: `elements` (a multiple of 32) values into `values` and each block's scale into
/// scales[elements / 32], so that dequantize_row's value i is values[i] * scales[i / 32].
void split_q8_0(const uint8_t* src, int64_t elements, int8_t* values, float* scales);
/// Values per block (1 for F32 / F16 / BF16, 32 for Q4_0 / Q4_1 / Q8_0).
size_t gguf_type_block_elements(GgufType type);
/// Bytes per block (4, 2, 2, 18, 20, 34).
size_t gguf_type_block_bytes(GgufType type);
/// "F32", "Q4_1", ...; "unknown" for a number that is not one of the supported types.
const char* gguf_type_name(GgufType type);
/// "uint8", ..., "array"; "unknown" for a number that is not a value type.
const char* gguf_value_type_name(GgufValueType type);
/// Bytes of one scalar value of `type` in the file (1, 2, 4 or 8); 0 for string, array and unknown numbers.
size_t gguf_value_type_size(GgufValueType type);

/// IEEE half -> float (exact, subnormals, infinities and NaN included).
float gguf_fp16_to_float(uint16_t bits);
/// float -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN with the sign kept.
uint16_t gguf_float_to_bf16(float value);

} // namespace smcgraph
