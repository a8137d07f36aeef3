// GGUF reader: one bounds-checked pass over the bytes builds the metadata map and the tensor table; every
// count is checked against the bytes left before anything is allocated for it, so a hostile header cannot
// make the reader allocate more than a small multiple of the file's size.
#include "smcgraph/gguf.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <unordered_map>
#include <utility>

#include "smcgraph/error.hpp"

namespace smcgraph {

static_assert(std::endian::native == std::endian::little, "the GGUF reader assumes a little-endian host");

namespace {

constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxDims = 4;          // GGML_MAX_DIMS
constexpr int kMaxArrayNesting = 8;  // arrays of arrays deeper than this are rejected (bounded recursion)
constexpr uint64_t kMinKvBytes = 13; // key length (8) + value type (4) + smallest value (1)
constexpr uint64_t kMinTensorInfoBytes =
    32;                                 // name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8)
constexpr uint64_t kMinArrayBytes = 12; // element type (4) + length (8)

template <class T> T load(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

std::string in_quotes(const std::string& text) {
  return "'" + text + "'";
}

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i)
    text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// The T at `p`, as an int64.
template <class T> int64_t as_int64(const uint8_t* p) {
  return static_cast<int64_t>(load<T>(p));
}

// What the reader knows of each metadata value type, indexed by its gguf_type number: its name, the bytes of
// one scalar (0 for string and array) and, for the integer types (bool included), how to read one as an int64
// (a uint64 above INT64_MAX would wrap: integer_at checks it first).
struct ValueTypeInfo {
  const char* name;
  size_t size;
  int64_t (*integer)(const uint8_t*); // null for the other types
};
// clang-format off
constexpr ValueTypeInfo kValueTypes[] = {
    {"uint8", 1, as_int64<uint8_t>}, {"int8", 1, as_int64<int8_t>},     {"uint16", 2, as_int64<uint16_t>},
    {"int16", 2, as_int64<int16_t>}, {"uint32", 4, as_int64<uint32_t>}, {"int32", 4, as_int64<int32_t>},
    {"float32", 4, nullptr},         {"bool", 1, as_int64<uint8_t>},    {"string", 0, nullptr},
    {"array", 0, nullptr},           {"uint64", 8, as_int64<uint64_t>}, {"int64", 8, as_int64<int64_t>},
    {"float64", 8, nullptr}};
// clang-format on
static_assert(std::size(kValueTypes) == static_cast<size_t>(GgufValueType::kFloat64) + 1,
              "one entry per value type");

bool known_value_type(uint32_t type) {
  return type < std::size(kValueTypes);
}

// nullptr for a number that is not a value type.
const ValueTypeInfo* value_type_info(GgufValueType type) {
  const auto index = static_cast<uint32_t>(type);
  return known_value_type(index) ? &kValueTypes[index] : nullptr;
}

// The tensor types this reader loads, with their block layout.
struct TensorTypeInfo {
  GgufType type;
  size_t block_elements, block_bytes;
};
constexpr TensorTypeInfo kTensorTypes[] = {{GgufType::kF32, 1, 4},    {GgufType::kF16, 1, 2},
                                           {GgufType::kBF16, 1, 2},   {GgufType::kQ4_0, 32, 18},
                                           {GgufType::kQ4_1, 32, 20}, {GgufType::kQ8_0, 32, 34}};

// nullptr for a type this reader does not load.
const TensorTypeInfo* tensor_type_info(uint32_t type) {
  for (const TensorTypeInfo& info : kTensorTypes)
    if (static_cast<uint32_t>(info.type) == type)
      return &info;
  return nullptr;
}

bool supported_tensor_type(uint32_t type) {
  return tensor_type_info(type) != nullptr;
}

// Names of the ggml types this reader does not load, so the error says which one the file holds.
const char* ggml_type_name(uint32_t type) {
  // clang-format off
  static constexpr const char* kNames[] = {
      "F32", "F16", "Q4_0", "Q4_1", "Q4_2 (removed)", "Q4_3 (removed)", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
      "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL",
      "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16", "Q4_0_4_4 (removed)",
      "Q4_0_4_8 (removed)", "Q4_0_8_8 (removed)", "TQ1_0", "TQ2_0", "IQ4_NL_4_4 (removed)",
      "IQ4_NL_4_8 (removed)", "IQ4_NL_8_8 (removed)", "MXFP4", "NVFP4", "Q1_0"};
  // clang-format on
  return type < std::size(kNames) ? kNames[type] : "unknown";
}

bool is_integer(GgufValueType type) {
  const ValueTypeInfo* info = value_type_info(type);
  return info != nullptr && info->integer != nullptr;
}

bool is_float(GgufValueType type) {
  return type == GgufValueType::kFloat32 || type == GgufValueType::kFloat64;
}

} // namespace

struct GgufFile::Impl {
  // A metadata value. Scalars and arrays of scalars stay in `bytes` (payload at `offset`); strings and
  // nested arrays are materialised.
  struct Value {
    GgufValueType type = GgufValueType::kUint8;
    GgufValueType element_type = GgufValueType::kUint8; // arrays only
    uint64_t count = 0;                                 // arrays only
    uint64_t offset = 0;                                // scalars and arrays of scalars
    std::vector<std::string> strings;                   // a string (one entry) or an array of strings
    std::vector<Value> arrays;                          // an array of arrays
  };

  std::string source;
  std::vector<uint8_t> bytes;
  uint32_t version = 0;
  uint64_t alignment = kDefaultAlignment;
  uint64_t data_start = 0;
  std::vector<std::string> key_order;
  std::unordered_map<std::string, Value> values;
  std::vector<GgufTensorInfo> tensors;
  std::unordered_map<std::string, size_t> tensor_index;

  [[noreturn]] void fail(const std::string& message) const {
    throw Error("GGUF " + in_quotes(source) + ": " + message);
  }

  const Value& value(const std::string& key) const {
    const auto it = values.find(key);
    if (it == values.end())
      fail("missing key " + in_quotes(key));
    return it->second;
  }

  std::string type_text(const Value& v) const {
    if (v.type == GgufValueType::kArray)
      return std::string("array of ") + gguf_value_type_name(v.element_type);
    return gguf_value_type_name(v.type);
  }

  [[noreturn]] void wrong_type(const std::string& key, const Value& v, const char* expected) const {
    fail("key " + in_quotes(key) + " has type " + type_text(v) + ", expected " + expected);
  }

  // The integer (or bool) stored at `offset` as `type`.
  int64_t integer_at(const std::string& key, GgufValueType type, uint64_t offset) const {
    const uint8_t* p = bytes.data() + offset;
    if (!is_integer(type))
      fail("key " + in_quotes(key) + ": internal error: not an integer type");
    if (type == GgufValueType::kUint64) {
      const uint64_t u = load<uint64_t>(p);
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail("key " + in_quotes(key) + ": uint64 value " + std::to_string(u) + " does not fit in int64");
    }
    return value_type_info(type)->integer(p);
  }

  double number_at(const std::string& key, GgufValueType type, uint64_t offset) const {
    if (type == GgufValueType::kFloat32)
      return load<float>(bytes.data() + offset);
    if (type == GgufValueType::kFloat64)
      return load<double>(bytes.data() + offset);
    if (type == GgufValueType::kUint64)
      return static_cast<double>(load<uint64_t>(bytes.data() + offset));
    return static_cast<double>(integer_at(key, type, offset));
  }

  // The elements of the array `v`, each read by `read_at` (integer_at or number_at).
  template <class T>
  std::vector<T> array_at(const std::string& key, const Value& v,
                          T (Impl::*read_at)(const std::string&, GgufValueType, uint64_t) const) const {
    const size_t element_size = gguf_value_type_size(v.element_type);
    std::vector<T> out(static_cast<size_t>(v.count));
    for (uint64_t i = 0; i < v.count; ++i)
      out[i] = (this->*read_at)(key, v.element_type, v.offset + i * element_size);
    return out;
  }
};

namespace {

using Value = GgufFile::Impl::Value;

// Bounds-checked little-endian reads over the file's bytes. `where` names the key or tensor being read (empty
// in the header); field names are plain literals so the hot path builds no strings.
class Cursor {
public:
  explicit Cursor(const GgufFile::Impl& file)
      : file_(file), data_(file.bytes.data()), size_(file.bytes.size()) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  void set_where(std::string where) { where_ = std::move(where); }
  const std::string& where() const { return where_; }

  [[noreturn]] void fail(const std::string& message) const { file_.fail(message); }
  [[noreturn]] void fail_at(const std::string& message, uint64_t offset) const {
    file_.fail(prefix() + message + " (at offset " + std::to_string(offset) + ")");
  }

  // Fails unless `n` more bytes are there; `field` and `index` name what was being read.
  void need(uint64_t n, const char* field, uint64_t index = kNoIndex) const {
    if (n > remaining()) {
      std::string what = field;
      if (index != kNoIndex)
        what += " [" + std::to_string(index) + "]";
      file_.fail("truncated: " + prefix() + what + " at offset " + std::to_string(pos_) + " needs " +
                 std::to_string(n) + " bytes, only " + std::to_string(remaining()) + " left");
    }
  }

  template <class T> T read(const char* field, uint64_t index = kNoIndex) {
    need(sizeof(T), field, index);
    const T value = load<T>(data_ + pos_);
    pos_ += sizeof(T);
    return value;
  }

  void skip(uint64_t n, const char* field) {
    need(n, field);
    pos_ += n;
  }

  std::string read_string(const char* field, uint64_t index = kNoIndex) {
    const uint64_t start = pos_;
    const uint64_t length = read<uint64_t>(field, index);
    if (length > remaining()) {
      std::string what = std::string(field) + " length";
      if (index != kNoIndex)
        what += " [" + std::to_string(index) + "]";
      fail_at(what + " " + std::to_string(length) + " exceeds the " + std::to_string(remaining()) +
                  " bytes left (truncated or corrupt)",
              start);
    }
    std::string text(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(length));
    pos_ += length;
    return text;
  }

  static constexpr uint64_t kNoIndex = std::numeric_limits<uint64_t>::max();

private:
  std::string prefix() const { return where_.empty() ? std::string() : where_ + ": "; }

  const GgufFile::Impl& file_;
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  std::string where_;
};

void check_bools(Cursor& cursor, const uint8_t* data, uint64_t offset, uint64_t count) {
  for (uint64_t i = 0; i < count; ++i) {
    if (data[offset + i] > 1)
      cursor.fail_at("bool value " + std::to_string(data[offset + i]) + " is neither 0 nor 1", offset + i);
  }
}

Value read_value(Cursor& cursor, const uint8_t* data, uint32_t raw_type, uint64_t type_offset, int depth);

// An array's element type, length and elements (the array type tag was already read).
Value read_array(Cursor& cursor, const uint8_t* data, int depth) {
  if (depth > kMaxArrayNesting)
    cursor.fail_at("arrays nested deeper than " + std::to_string(kMaxArrayNesting) + " levels", cursor.pos());
  Value value;
  value.type = GgufValueType::kArray;
  const uint64_t type_offset = cursor.pos();
  const uint32_t element_type = cursor.read<uint32_t>("array element type");
  if (!known_value_type(element_type))
    cursor.fail_at("unknown array element type " + std::to_string(element_type), type_offset);
  value.element_type = static_cast<GgufValueType>(element_type);
  const uint64_t length_offset = cursor.pos();
  value.count = cursor.read<uint64_t>("array length");
  const size_t element_size = gguf_value_type_size(value.element_type);
  const uint64_t min_element_bytes = element_size                                   ? element_size
                                     : value.element_type == GgufValueType::kString ? 8
                                                                                    : kMinArrayBytes;
  if (value.count > cursor.remaining() / min_element_bytes)
    cursor.fail_at("array length " + std::to_string(value.count) + " of " +
                       gguf_value_type_name(value.element_type) + " needs " +
                       (value.count > std::numeric_limits<uint64_t>::max() / min_element_bytes
                            ? std::string("more than 2^64")
                            : "at least " + std::to_string(value.count * min_element_bytes)) +
                       " bytes, only " + std::to_string(cursor.remaining()) + " left (truncated or corrupt)",
                   length_offset);
  if (element_size) {
    value.offset = cursor.pos();
    cursor.skip(value.count * element_size, "array elements");
    if (value.element_type == GgufValueType::kBool)
      check_bools(cursor, data, value.offset, value.count);
  } else if (value.element_type == GgufValueType::kString) {
    value.strings.reserve(static_cast<size_t>(value.count));
    for (uint64_t i = 0; i < value.count; ++i)
      value.strings.push_back(cursor.read_string("string", i));
  } else {
    value.arrays.reserve(static_cast<size_t>(value.count));
    for (uint64_t i = 0; i < value.count; ++i)
      value.arrays.push_back(read_array(cursor, data, depth + 1));
  }
  return value;
}

Value read_value(Cursor& cursor, const uint8_t* data, uint32_t raw_type, uint64_t type_offset, int depth) {
  if (!known_value_type(raw_type))
    cursor.fail_at("unknown value type " + std::to_string(raw_type), type_offset);
  const auto type = static_cast<GgufValueType>(raw_type);
  if (type == GgufValueType::kArray)
    return read_array(cursor, data, depth + 1);
  Value value;
  value.type = type;
  if (type == GgufValueType::kString) {
    value.strings.push_back(cursor.read_string("string"));
    return value;
  }
  value.offset = cursor.pos();
  cursor.skip(gguf_value_type_size(type), "value");
  if (type == GgufValueType::kBool)
    check_bools(cursor, data, value.offset, 1);
  return value;
}

} // namespace

GgufFile GgufFile::from_bytes(std::vector<uint8_t> bytes, std::string source_name) {
  auto impl = std::make_shared<Impl>();
  impl->source = std::move(source_name);
  impl->bytes = std::move(bytes);
  const uint8_t* data = impl->bytes.data();
  const uint64_t size = impl->bytes.size();
  Cursor cursor(*impl);

  // Header.
  cursor.need(4, "magic");
  if (std::memcmp(data, "GGUF", 4) != 0) {
    std::string shown;
    for (int i = 0; i < 4; ++i)
      shown += (data[i] >= 0x20 && data[i] < 0x7f) ? static_cast<char>(data[i]) : '?';
    cursor.fail_at("bad magic '" + shown + "', expected 'GGUF' (not a GGUF file)", 0);
  }
  cursor.skip(4, "magic");
  impl->version = cursor.read<uint32_t>("version");
  if (impl->version != 2 && impl->version != 3)
    cursor.fail_at("unsupported version " + std::to_string(impl->version) + " (supported: 2, 3)", 4);
  const uint64_t tensor_count = cursor.read<uint64_t>("tensor count");
  const uint64_t kv_count = cursor.read<uint64_t>("kv count");
  if (tensor_count > cursor.remaining() / kMinTensorInfoBytes)
    cursor.fail_at("tensor count " + std::to_string(tensor_count) +
                       " is absurd or the file is truncated: the " + std::to_string(cursor.remaining()) +
                       " bytes left hold at most " +
                       std::to_string(cursor.remaining() / kMinTensorInfoBytes) + " tensor infos",
                   8);
  const uint64_t kv_bytes_left = cursor.remaining() - tensor_count * kMinTensorInfoBytes;
  if (kv_count > kv_bytes_left / kMinKvBytes)
    cursor.fail_at("kv count " + std::to_string(kv_count) + " is absurd or the file is truncated: the " +
                       std::to_string(kv_bytes_left) + " bytes left besides the tensor infos hold at most " +
                       std::to_string(kv_bytes_left / kMinKvBytes) + " key-value pairs",
                   16);

  // Metadata.
  impl->key_order.reserve(static_cast<size_t>(kv_count));
  impl->values.reserve(static_cast<size_t>(kv_count));
  for (uint64_t i = 0; i < kv_count; ++i) {
    cursor.set_where("kv " + std::to_string(i));
    const uint64_t key_offset = cursor.pos();
    std::string key = cursor.read_string("key");
    if (key.empty())
      cursor.fail_at("empty key", key_offset);
    if (impl->values.count(key))
      cursor.fail_at("duplicate key " + in_quotes(key), key_offset);
    cursor.set_where("key " + in_quotes(key));
    const uint64_t type_offset = cursor.pos();
    const uint32_t type = cursor.read<uint32_t>("value type");
    Value value = read_value(cursor, data, type, type_offset, 0);
    impl->key_order.push_back(key);
    impl->values.emplace(std::move(key), std::move(value));
  }
  cursor.set_where("");

  if (const auto it = impl->values.find("general.alignment"); it != impl->values.end()) {
    const Value& v = it->second;
    if (v.type != GgufValueType::kUint32)
      impl->wrong_type("general.alignment", v, "uint32");
    const uint32_t alignment = load<uint32_t>(data + v.offset);
    if (alignment == 0 || !std::has_single_bit(alignment))
      impl->fail("key 'general.alignment' = " + std::to_string(alignment) + " is not a power of two");
    impl->alignment = alignment;
  }

  // Tensor table.
  impl->tensors.reserve(static_cast<size_t>(tensor_count));
  impl->tensor_index.reserve(static_cast<size_t>(tensor_count));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    cursor.set_where("tensor " + std::to_string(i));
    GgufTensorInfo info;
    const uint64_t name_offset = cursor.pos();
    info.name = cursor.read_string("tensor name");
    if (info.name.empty())
      cursor.fail_at("empty tensor name", name_offset);
    if (impl->tensor_index.count(info.name))
      cursor.fail_at("duplicate tensor name " + in_quotes(info.name), name_offset);
    cursor.set_where("tensor " + in_quotes(info.name));
    const uint64_t n_dims_offset = cursor.pos();
    const uint32_t n_dims = cursor.read<uint32_t>("n_dims");
    if (n_dims == 0 || n_dims > kMaxDims)
      cursor.fail_at("n_dims = " + std::to_string(n_dims) + " must be 1.." + std::to_string(kMaxDims),
                     n_dims_offset);
    info.elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim_offset = cursor.pos();
      const uint64_t dim = cursor.read<uint64_t>("dimension", d);
      const std::string dim_name = "dimension ne[" + std::to_string(d) + "]";
      if (dim == 0 || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        cursor.fail_at(dim_name + " = " + std::to_string(static_cast<int64_t>(dim)) + " must be > 0",
                       dim_offset);
      if (static_cast<int64_t>(dim) > std::numeric_limits<int64_t>::max() / info.elements)
        cursor.fail_at("element count overflows int64 at " + dim_name + " = " + std::to_string(dim),
                       dim_offset);
      info.dims.push_back(static_cast<int64_t>(dim));
      info.elements *= static_cast<int64_t>(dim);
    }
    const uint64_t type_offset = cursor.pos();
    const uint32_t type = cursor.read<uint32_t>("type");
    if (!supported_tensor_type(type))
      cursor.fail_at("tensor type " + std::to_string(type) + " (" + ggml_type_name(type) +
                         ") is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0)",
                     type_offset);
    info.type = static_cast<GgufType>(type);
    const uint64_t block_elements = gguf_type_block_elements(info.type);
    if (info.dims[0] % static_cast<int64_t>(block_elements) != 0)
      cursor.fail_at("ne[0] = " + std::to_string(info.dims[0]) + " is not a multiple of the " +
                         gguf_type_name(info.type) + " block size " + std::to_string(block_elements),
                     n_dims_offset);
    const uint64_t blocks = static_cast<uint64_t>(info.elements) / block_elements;
    const uint64_t block_bytes = gguf_type_block_bytes(info.type);
    if (blocks > size / block_bytes)
      cursor.fail_at("needs " + std::to_string(blocks) + " blocks of " + std::to_string(block_bytes) +
                         " bytes, more than the whole file holds (" + std::to_string(size) +
                         " bytes): out of bounds (truncated or corrupt)",
                     n_dims_offset);
    info.bytes = blocks * block_bytes;
    info.offset = cursor.read<uint64_t>("offset");
    impl->tensor_index.emplace(info.name, impl->tensors.size());
    impl->tensors.push_back(std::move(info));
  }
  cursor.set_where("");

  // Data section: starts at the next multiple of the alignment; every tensor aligned and inside it.
  const uint64_t infos_end = cursor.pos();
  const uint64_t padding = (impl->alignment - infos_end % impl->alignment) % impl->alignment;
  impl->data_start = infos_end + padding;
  if (tensor_count > 0 && impl->data_start > size)
    impl->fail("truncated: the data section starts at offset " + std::to_string(impl->data_start) +
               " (tensor infos end at " + std::to_string(infos_end) + ", alignment " +
               std::to_string(impl->alignment) + ") but the file has only " + std::to_string(size) +
               " bytes");
  const uint64_t data_size = impl->data_start <= size ? size - impl->data_start : 0;
  for (const GgufTensorInfo& info : impl->tensors) {
    if (info.offset % impl->alignment != 0)
      impl->fail("tensor " + in_quotes(info.name) + ": offset " + std::to_string(info.offset) +
                 " is misaligned (not a multiple of the alignment " + std::to_string(impl->alignment) + ")");
    if (info.offset > data_size || info.bytes > data_size - info.offset)
      impl->fail("tensor " + in_quotes(info.name) + ": bytes [" + std::to_string(info.offset) + ", " +
                 (info.offset > std::numeric_limits<uint64_t>::max() - info.bytes
                      ? std::string("2^64")
                      : std::to_string(info.offset + info.bytes)) +
                 ") are out of bounds of the data section (" + std::to_string(data_size) +
                 " bytes from file offset " + std::to_string(impl->data_start) + "; truncated or corrupt)");
  }
  return GgufFile(std::move(impl));
}

GgufFile GgufFile::open(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error))
    throw Error("GGUF " + in_quotes(path) + ": cannot open: no such regular file");
  const uintmax_t size = std::filesystem::file_size(path, error);
  if (error)
    throw Error("GGUF " + in_quotes(path) + ": cannot read the file size: " + error.message());
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw Error("GGUF " + in_quotes(path) + ": cannot open for reading");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size));
  if (static_cast<uintmax_t>(in.gcount()) != size)
    throw Error("GGUF " + in_quotes(path) + ": read " + std::to_string(in.gcount()) + " of " +
                std::to_string(size) + " bytes");
  return from_bytes(std::move(bytes), path);
}

uint32_t GgufFile::version() const {
  return impl_->version;
}
uint64_t GgufFile::alignment() const {
  return impl_->alignment;
}
const std::string& GgufFile::source() const {
  return impl_->source;
}

bool GgufFile::has(const std::string& key) const {
  return impl_->values.count(key) != 0;
}

GgufValueType GgufFile::type_of(const std::string& key) const {
  return impl_->value(key).type;
}

GgufValueType GgufFile::array_type_of(const std::string& key) const {
  const Value& v = impl_->value(key);
  if (v.type != GgufValueType::kArray)
    impl_->wrong_type(key, v, "an array");
  return v.element_type;
}

int64_t GgufFile::get_int(const std::string& key) const {
  const Value& v = impl_->value(key);
  if (!is_integer(v.type))
    impl_->wrong_type(key, v, "an integer (uint8..int64 or bool)");
  return impl_->integer_at(key, v.type, v.offset);
}

int64_t GgufFile::get_int(const std::string& key, int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}

double GgufFile::get_float(const std::string& key) const {
  const Value& v = impl_->value(key);
  if (!is_float(v.type) && !is_integer(v.type))
    impl_->wrong_type(key, v, "a number (float32, float64 or an integer)");
  return impl_->number_at(key, v.type, v.offset);
}

double GgufFile::get_float(const std::string& key, double fallback) const {
  return has(key) ? get_float(key) : fallback;
}

std::string GgufFile::get_string(const std::string& key) const {
  const Value& v = impl_->value(key);
  if (v.type != GgufValueType::kString)
    impl_->wrong_type(key, v, "string");
  return v.strings.front();
}

std::vector<std::string> GgufFile::get_string_array(const std::string& key) const {
  const Value& v = impl_->value(key);
  if (v.type != GgufValueType::kArray || v.element_type != GgufValueType::kString)
    impl_->wrong_type(key, v, "array of string");
  return v.strings;
}

std::vector<int64_t> GgufFile::get_int_array(const std::string& key) const {
  const Value& v = impl_->value(key);
  if (v.type != GgufValueType::kArray || !is_integer(v.element_type))
    impl_->wrong_type(key, v, "array of integers (uint8..int64 or bool)");
  return impl_->array_at(key, v, &Impl::integer_at);
}

std::vector<double> GgufFile::get_float_array(const std::string& key) const {
  const Value& v = impl_->value(key);
  if (v.type != GgufValueType::kArray || (!is_float(v.element_type) && !is_integer(v.element_type)))
    impl_->wrong_type(key, v, "array of numbers (float32, float64 or integers)");
  return impl_->array_at(key, v, &Impl::number_at);
}

std::vector<std::string> GgufFile::keys() const {
  return impl_->key_order;
}

const std::vector<GgufTensorInfo>& GgufFile::tensors() const {
  return impl_->tensors;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  const auto it = impl_->tensor_index.find(name);
  return it == impl_->tensor_index.end() ? nullptr : &impl_->tensors[it->second];
}

const GgufTensorInfo& GgufFile::tensor(const std::string& name) const {
  const GgufTensorInfo* info = find_tensor(name);
  if (info == nullptr)
    impl_->fail("missing tensor " + in_quotes(name));
  return *info;
}

const uint8_t* GgufFile::tensor_data(const GgufTensorInfo& info) const {
  // The table was validated at load; this guards against an info that belongs to another file.
  const uint64_t data_size = impl_->bytes.size() - std::min<uint64_t>(impl_->data_start, impl_->bytes.size());
  if (info.offset > data_size || info.bytes > data_size - info.offset)
    impl_->fail("tensor " + in_quotes(info.name) + ": bytes [" + std::to_string(info.offset) + ", +" +
                std::to_string(info.bytes) + ") are outside this file's data section");
  return impl_->bytes.data() + impl_->data_start + info.offset;
}

std::vector<float> GgufFile::tensor_f32(const std::string& name,
                                        const std::vector<int64_t>& expected_dims) const {
  const GgufTensorInfo& info = tensor(name);
  if (info.dims != expected_dims)
    impl_->fail("tensor " + in_quotes(name) + " has shape " + shape_text(info.dims) + ", expected " +
                shape_text(expected_dims));
  std::vector<float> out(static_cast<size_t>(info.elements));
  dequantize_row(info.type, tensor_data(info), info.elements, out.data());
  return out;
}

std::vector<uint16_t> GgufFile::tensor_bf16(const std::string& name,
                                            const std::vector<int64_t>& expected_dims) const {
  const std::vector<float> values = tensor_f32(name, expected_dims);
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    out[i] = gguf_float_to_bf16(values[i]);
  return out;
}

float gguf_fp16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31)
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t gguf_float_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value))
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

size_t gguf_type_block_elements(GgufType type) {
  if (const TensorTypeInfo* info = tensor_type_info(static_cast<uint32_t>(type)))
    return info->block_elements;
  throw Error("gguf_type_block_elements: type = " + std::to_string(static_cast<uint32_t>(type)) +
              ": not a supported GGUF tensor type");
}

size_t gguf_type_block_bytes(GgufType type) {
  if (const TensorTypeInfo* info = tensor_type_info(static_cast<uint32_t>(type)))
    return info->block_bytes;
  throw Error("gguf_type_block_bytes: type = " + std::to_string(static_cast<uint32_t>(type)) +
              ": not a supported GGUF tensor type");
}

const char* gguf_type_name(GgufType type) {
  return supported_tensor_type(static_cast<uint32_t>(type)) ? ggml_type_name(static_cast<uint32_t>(type))
                                                            : "unknown";
}

size_t gguf_value_type_size(GgufValueType type) {
  const ValueTypeInfo* info = value_type_info(type);
  return info != nullptr ? info->size : 0;
}

const char* gguf_value_type_name(GgufValueType type) {
  const ValueTypeInfo* info = value_type_info(type);
  return info != nullptr ? info->name : "unknown";
}

void dequantize_row(GgufType type, const uint8_t* src, int64_t elements, float* dst) {
  const char* where = "dequantize_row";
  require(supported_tensor_type(static_cast<uint32_t>(type)), where, "type", static_cast<uint32_t>(type),
          "must be F32, F16, BF16, Q4_0, Q4_1 or Q8_0");
  const auto block_elements = static_cast<int64_t>(gguf_type_block_elements(type));
  require(elements >= 0 && elements % block_elements == 0, where, "elements", elements,
          "must be a non-negative multiple of the type's block size");
  if (elements == 0)
    return;
  require(src != nullptr && dst != nullptr, where, "src/dst", "nullptr", "must be non-null");
  const int64_t blocks = elements / block_elements;
  switch (type) {
  case GgufType::kF32:
    std::memcpy(dst, src, static_cast<size_t>(elements) * sizeof(float));
    return;
  case GgufType::kF16:
    for (int64_t i = 0; i < elements; ++i)
      dst[i] = gguf_fp16_to_float(load<uint16_t>(src + 2 * i));
    return;
  case GgufType::kBF16:
    for (int64_t i = 0; i < elements; ++i)
      dst[i] = std::bit_cast<float>(static_cast<uint32_t>(load<uint16_t>(src + 2 * i)) << 16);
    return;
  case GgufType::kQ4_0:
    // fp16 d, 16 bytes of nibbles: weight j < 16 the low nibble of byte j, j >= 16 the high nibble of j - 16.
    for (int64_t b = 0; b < blocks; ++b, src += 18, dst += 32) {
      const float d = gguf_fp16_to_float(load<uint16_t>(src));
      for (int j = 0; j < 16; ++j) {
        dst[j] = static_cast<float>((src[2 + j] & 0x0f) - 8) * d;
        dst[j + 16] = static_cast<float>((src[2 + j] >> 4) - 8) * d;
      }
    }
    return;
  case GgufType::kQ4_1:
    // fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m (d * q is exact, so contraction cannot change it).
    for (int64_t b = 0; b < blocks; ++b, src += 20, dst += 32) {
      const float d = gguf_fp16_to_float(load<uint16_t>(src));
      const float m = gguf_fp16_to_float(load<uint16_t>(src + 2));
      for (int j = 0; j < 16; ++j) {
        dst[j] = static_cast<float>(src[4 + j] & 0x0f) * d + m;
        dst[j + 16] = static_cast<float>(src[4 + j] >> 4) * d + m;
      }
    }
    return;
  case GgufType::kQ8_0:
    for (int64_t b = 0; b < blocks; ++b, src += 34, dst += 32) {
      const float d = gguf_fp16_to_float(load<uint16_t>(src));
      for (int j = 0; j < 32; ++j)
        dst[j] = static_cast<float>(static_cast<int8_t>(src[2 + j])) * d;
    }
    return;
  }
}

void split_q8_0(const uint8_t* src, int64_t elements, int8_t* values, float* scales) {
  constexpr const char* kWhere = "split_q8_0";
  require(elements >= 0 && elements % 32 == 0, kWhere, "elements", elements,
          "must be a non-negative multiple of the Q8_0 block size (32)");
  if (elements == 0)
    return;
  require(src != nullptr && values != nullptr && scales != nullptr, kWhere, "src/values/scales", "nullptr",
          "must be non-null");
  // The blocks dequantize_row reads: fp16 d, then 32 int8 values.
  for (int64_t b = 0; b < elements / 32; ++b, src += 34) {
    scales[b] = gguf_fp16_to_float(load<uint16_t>(src));
    std::memcpy(values + 32 * b, src + 2, 32);
  }
}

} // namespace smcgraph
