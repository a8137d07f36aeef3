// GGUF reader: round trips of every metadata and tensor type through the test writer, the ggml block layouts,
// bf16 / fp16 conversions against CUDA's host conversions, the tiny Llama file, one case per malformation
// (each names what is wrong), truncation at every byte, and the facts of the real SmolLM2 file when present.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <set>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "smcgraph/error.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "support/gguf_writer.hpp"

using smcgraph::Error;
using smcgraph::GgufFile;
using smcgraph::GgufType;
using smcgraph::GgufValueType;
using smcgraph::test::GgufLayout;
using smcgraph::test::GgufMetaValue;
using smcgraph::test::GgufWriter;

namespace {

constexpr GgufType kAllTypes[] = {GgufType::kF32,  GgufType::kF16,  GgufType::kBF16,
                                  GgufType::kQ4_0, GgufType::kQ4_1, GgufType::kQ8_0};

// Fresh values per run unless SMCGRAPH_TEST_SEED is set; the seed is printed so a failure reproduces.
uint64_t test_seed() {
  static const uint64_t seed = [] {
    if (const char* fixed = std::getenv("SMCGRAPH_TEST_SEED"))
      return static_cast<uint64_t>(std::strtoull(fixed, nullptr, 0));
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }();
  return seed;
}

std::vector<float> normal_values(size_t count, double scale, uint64_t salt) {
  std::mt19937_64 engine(test_seed() ^ salt);
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<float> values(count);
  for (float& v : values)
    v = static_cast<float>(normal(engine));
  return values;
}

template <class T> void poke(std::vector<uint8_t>& bytes, size_t at, T value) {
  REQUIRE(at + sizeof(T) <= bytes.size());
  std::memcpy(bytes.data() + at, &value, sizeof(T));
}

// doctest::Contains from a computed message (it copies the text).
doctest::Contains contains(const std::string& text) {
  return doctest::Contains(text.c_str());
}

bool same_bits(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// Every metadata value type, arrays of each, an empty array, nested arrays.
GgufWriter metadata_writer() {
  GgufWriter writer;
  writer.add("v.u8", GgufMetaValue::integer(GgufValueType::kUint8, 200));
  writer.add("v.i8", GgufMetaValue::integer(GgufValueType::kInt8, -100));
  writer.add("v.u16", GgufMetaValue::integer(GgufValueType::kUint16, 60000));
  writer.add("v.i16", GgufMetaValue::integer(GgufValueType::kInt16, -30000));
  writer.add("v.u32", GgufMetaValue::integer(GgufValueType::kUint32, 4000000000ll));
  writer.add("v.i32", GgufMetaValue::integer(GgufValueType::kInt32, -2000000000ll));
  writer.add("v.f32", GgufMetaValue::float32(1.5f));
  writer.add("v.bool", GgufMetaValue::boolean(true));
  writer.add("v.string", GgufMetaValue::string("h\xc3\xa9llo <|im_start|>"));
  writer.add("v.u64", GgufMetaValue::uint64(1ull << 62));
  writer.add("v.u64_huge", GgufMetaValue::uint64((1ull << 63) + 5));
  writer.add("v.i64", GgufMetaValue::integer(GgufValueType::kInt64, -(1ll << 62)));
  writer.add("v.f64", GgufMetaValue::float64(0.1));
  writer.add("a.u8", GgufMetaValue::integer_array(GgufValueType::kUint8, {0, 255, 7}));
  writer.add("a.i8", GgufMetaValue::integer_array(GgufValueType::kInt8, {-128, 127}));
  writer.add("a.u16", GgufMetaValue::integer_array(GgufValueType::kUint16, {65535, 1}));
  writer.add("a.i16", GgufMetaValue::integer_array(GgufValueType::kInt16, {-32768, 32767}));
  writer.add("a.u32", GgufMetaValue::integer_array(GgufValueType::kUint32, {4294967295ll}));
  writer.add("a.i32", GgufMetaValue::integer_array(GgufValueType::kInt32, {-5, 0, 5, 2147483647}));
  writer.add("a.u64", GgufMetaValue::integer_array(GgufValueType::kUint64, {1ll << 40}));
  writer.add("a.i64",
             GgufMetaValue::integer_array(GgufValueType::kInt64, {std::numeric_limits<int64_t>::min()}));
  writer.add("a.bool", GgufMetaValue::integer_array(GgufValueType::kBool, {1, 0, 1}));
  writer.add("a.f32", GgufMetaValue::float32_array({0.25f, -3.0f}));
  writer.add("a.f64", GgufMetaValue::array(GgufValueType::kFloat64,
                                           {GgufMetaValue::float64(1e300), GgufMetaValue::float64(-2.5)}));
  writer.add("a.string", GgufMetaValue::string_array({"", "a b", "\xc4\xa0the"}));
  writer.add("a.empty", GgufMetaValue::string_array({}));
  writer.add("a.nested", GgufMetaValue::array(GgufValueType::kArray,
                                              {GgufMetaValue::integer_array(GgufValueType::kInt32, {1, 2}),
                                               GgufMetaValue::string_array({"x"}),
                                               GgufMetaValue::array(GgufValueType::kArray,
                                                                    {GgufMetaValue::float32_array({})})}));
  return writer;
}

// A small valid file: metadata of every type and one tensor of every type (the last tensor ends the file).
GgufWriter small_writer() {
  GgufWriter writer = metadata_writer();
  size_t salt = 100;
  for (GgufType type : kAllTypes)
    writer.add_tensor(std::string("t.") + smcgraph::gguf_type_name(type), {32, 2}, type,
                      normal_values(64, 1.0, salt++));
  return writer;
}

std::string message_of(const std::vector<uint8_t>& bytes) {
  try {
    GgufFile::from_bytes(bytes, "bad.gguf");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::optional<std::filesystem::path> real_model_path() {
  std::error_code error;
  const std::filesystem::path path = smcgraph::default_llama_model_path();
  return std::filesystem::is_regular_file(path, error) ? std::optional(path) : std::nullopt;
}

} // namespace

TEST_CASE("metadata of every value type round-trips, in file order") {
  for (uint32_t version : {2u, 3u}) {
    CAPTURE(version);
    GgufWriter writer = metadata_writer();
    writer.set_version(version);
    const GgufFile file = GgufFile::from_bytes(writer.bytes(), "meta.gguf");
    CHECK(file.version() == version);
    CHECK(file.source() == "meta.gguf");
    CHECK(file.alignment() == 32);
    CHECK(file.tensors().empty());
    const std::vector<std::string> keys = file.keys();
    REQUIRE(keys.size() == 27);
    CHECK(keys.front() == "v.u8");
    CHECK(keys[8] == "v.string");
    CHECK(keys.back() == "a.nested");

    CHECK(file.type_of("v.u8") == GgufValueType::kUint8);
    CHECK(file.get_int("v.u8") == 200);
    CHECK(file.get_int("v.i8") == -100);
    CHECK(file.get_int("v.u16") == 60000);
    CHECK(file.get_int("v.i16") == -30000);
    CHECK(file.get_int("v.u32") == 4000000000ll);
    CHECK(file.get_int("v.i32") == -2000000000ll);
    CHECK(file.type_of("v.f32") == GgufValueType::kFloat32);
    CHECK(file.get_float("v.f32") == 1.5);
    CHECK(file.type_of("v.bool") == GgufValueType::kBool);
    CHECK(file.get_int("v.bool") == 1);
    CHECK(file.get_string("v.string") == "h\xc3\xa9llo <|im_start|>");
    CHECK(file.get_int("v.u64") == (1ll << 62));
    CHECK(file.get_float("v.u64_huge") == static_cast<double>((1ull << 63) + 5));
    CHECK(file.get_int("v.i64") == -(1ll << 62));
    CHECK(file.type_of("v.f64") == GgufValueType::kFloat64);
    CHECK(file.get_float("v.f64") == 0.1);
    CHECK(file.get_float("v.i32") == -2000000000.0); // integers read as numbers too

    CHECK(file.get_int_array("a.u8") == std::vector<int64_t>{0, 255, 7});
    CHECK(file.get_int_array("a.i8") == std::vector<int64_t>{-128, 127});
    CHECK(file.get_int_array("a.u16") == std::vector<int64_t>{65535, 1});
    CHECK(file.get_int_array("a.i16") == std::vector<int64_t>{-32768, 32767});
    CHECK(file.get_int_array("a.u32") == std::vector<int64_t>{4294967295ll});
    CHECK(file.get_int_array("a.i32") == std::vector<int64_t>{-5, 0, 5, 2147483647});
    CHECK(file.get_int_array("a.u64") == std::vector<int64_t>{1ll << 40});
    CHECK(file.get_int_array("a.i64") == std::vector<int64_t>{std::numeric_limits<int64_t>::min()});
    CHECK(file.get_int_array("a.bool") == std::vector<int64_t>{1, 0, 1});
    CHECK(file.get_float_array("a.f32") == std::vector<double>{0.25, -3.0});
    CHECK(file.get_float_array("a.f64") == std::vector<double>{1e300, -2.5});
    CHECK(file.get_float_array("a.i16") == std::vector<double>{-32768.0, 32767.0});
    CHECK(file.type_of("a.string") == GgufValueType::kArray);
    CHECK(file.array_type_of("a.string") == GgufValueType::kString);
    CHECK(file.get_string_array("a.string") == std::vector<std::string>{"", "a b", "\xc4\xa0the"});
    CHECK(file.get_string_array("a.empty").empty());
    CHECK(file.array_type_of("a.nested") == GgufValueType::kArray);

    CHECK(file.has("v.u8"));
    CHECK_FALSE(file.has("v.missing"));
    CHECK(file.get_int("v.missing", -7) == -7);
    CHECK(file.get_float("v.missing", 2.5) == 2.5);
    CHECK(file.get_int("v.u16", -7) == 60000);
    CHECK(file.get_float("v.f32", 2.5) == 1.5);
  }
}

TEST_CASE(
    "every tensor type round-trips: the reader's values equal the quantiser's reconstruction bit for bit") {
  MESSAGE("seed " << test_seed() << " (set SMCGRAPH_TEST_SEED to repeat)");
  for (GgufType type : kAllTypes) {
    CAPTURE(smcgraph::gguf_type_name(type));
    std::vector<float> values = normal_values(96 * 5, 0.7, static_cast<uint64_t>(type));
    if (type == GgufType::kF32 || type == GgufType::kF16 || type == GgufType::kBF16) {
      // Values the 16-bit formats must keep exactly or round in a known way.
      values[0] = std::numeric_limits<float>::quiet_NaN();
      values[1] = std::numeric_limits<float>::infinity();
      values[2] = -0.0f;
      values[3] = 0x1p-24f;       // smallest fp16 subnormal
      values[4] = 65504.0f;       // largest fp16
      values[5] = 1.0f + 0x1p-8f; // a bf16 tie (rounds to even: 1.0)
    }
    if (type == GgufType::kQ4_1 || type == GgufType::kQ4_0 || type == GgufType::kQ8_0)
      std::fill(values.begin() + 32, values.begin() + 64, 0.25f); // a constant block (d = 0 for Q4_1)
    GgufWriter writer;
    writer.add_string("general.architecture", "test");
    const std::vector<float> expected = writer.add_tensor("w", {96, 5}, type, values);
    writer.add_tensor("after", {32}, GgufType::kF32, std::vector<float>(32, 3.0f));
    const GgufFile file = GgufFile::from_bytes(writer.bytes());

    const smcgraph::GgufTensorInfo& info = file.tensor("w");
    CHECK(info.name == "w");
    CHECK(info.dims == std::vector<int64_t>{96, 5});
    CHECK(info.type == type);
    CHECK(info.elements == 480);
    CHECK(info.bytes ==
          480 / smcgraph::gguf_type_block_elements(type) * smcgraph::gguf_type_block_bytes(type));
    CHECK(std::memcmp(file.tensor_data(info), smcgraph::test::quantize_values(type, values).data(),
                      info.bytes) == 0);

    const std::vector<float> read = file.tensor_f32("w", {96, 5});
    REQUIRE(read.size() == expected.size());
    size_t mismatches = 0;
    for (size_t i = 0; i < read.size(); ++i)
      mismatches += same_bits(read[i], expected[i]) ? 0 : 1;
    CHECK(mismatches == 0);
    if (type != GgufType::kF32 && type != GgufType::kBF16 && type != GgufType::kF16) {
      double max_error = 0.0;
      for (size_t i = 0; i < read.size(); ++i)
        max_error = std::max(max_error, static_cast<double>(std::fabs(read[i] - values[i])));
      CHECK(max_error < 0.7); // a quantiser's error is below its step (scale ~ 0.7, at most ~ 5 sigma / 7)
      CHECK(read[40] == doctest::Approx(0.25).epsilon(0.01));
    }
    if (type == GgufType::kBF16) {
      CHECK(std::isnan(read[0]));
      CHECK(read[1] == std::numeric_limits<float>::infinity());
      CHECK(std::signbit(read[2]));
      CHECK(read[5] == 1.0f);
    }
    if (type == GgufType::kF16) {
      CHECK(std::isnan(read[0]));
      CHECK(read[3] == 0x1p-24f);
      CHECK(read[4] == 65504.0f);
    }

    const std::vector<uint16_t> bf16 = file.tensor_bf16("w", {96, 5});
    REQUIRE(bf16.size() == read.size());
    size_t bf16_mismatches = 0;
    for (size_t i = 0; i < read.size(); ++i) {
      const float back = std::bit_cast<float>(static_cast<uint32_t>(bf16[i]) << 16);
      if (std::isnan(read[i]))
        bf16_mismatches += std::isnan(back) ? 0 : 1;
      else
        bf16_mismatches += bf16[i] == smcgraph::test::writer_float_to_bf16(read[i]) ? 0 : 1;
    }
    CHECK(bf16_mismatches == 0);
    CHECK(file.tensor_f32("after", {32}) == std::vector<float>(32, 3.0f));
  }
}

TEST_CASE("dequantize_row follows the ggml block layouts") {
  // Q4_1: d = 0.5 (fp16 0x3800), m = -1 (0xbc00); byte j holds q = j (low nibble, weight j) and 15 - j (high
  // nibble, weight j + 16).
  std::vector<uint8_t> q4_1 = {0x00, 0x38, 0x00, 0xbc};
  for (int j = 0; j < 16; ++j)
    q4_1.push_back(static_cast<uint8_t>(j | ((15 - j) << 4)));
  std::vector<float> out(32);
  smcgraph::dequantize_row(GgufType::kQ4_1, q4_1.data(), 32, out.data());
  for (int j = 0; j < 16; ++j) {
    CHECK(out[j] == 0.5f * j - 1.0f);
    CHECK(out[j + 16] == 0.5f * (15 - j) - 1.0f);
  }
  // Q4_0: d = 2 (0x4000); w = d * (q - 8).
  std::vector<uint8_t> q4_0 = {0x00, 0x40};
  for (int j = 0; j < 16; ++j)
    q4_0.push_back(static_cast<uint8_t>(j | ((15 - j) << 4)));
  smcgraph::dequantize_row(GgufType::kQ4_0, q4_0.data(), 32, out.data());
  for (int j = 0; j < 16; ++j) {
    CHECK(out[j] == 2.0f * (j - 8));
    CHECK(out[j + 16] == 2.0f * (7 - j));
  }
  // Q8_0: d = 0.25 (0x3400); int8 weights.
  std::vector<uint8_t> q8_0 = {0x00, 0x34};
  for (int j = 0; j < 32; ++j)
    q8_0.push_back(static_cast<uint8_t>(static_cast<int8_t>(j * 8 - 128)));
  smcgraph::dequantize_row(GgufType::kQ8_0, q8_0.data(), 32, out.data());
  for (int j = 0; j < 32; ++j)
    CHECK(out[j] == 0.25f * (j * 8 - 128));
  // The same Q8_0 block split into its values and scale (the int8 LM head's weights): value * scale is
  // dequantize_row's value.
  std::vector<int8_t> values(32);
  float scale = 0.0f;
  smcgraph::split_q8_0(q8_0.data(), 32, values.data(), &scale);
  CHECK(scale == 0.25f);
  for (int j = 0; j < 32; ++j)
    CHECK(static_cast<float>(values[j]) * scale == out[j]);
  CHECK_THROWS_WITH_AS(smcgraph::split_q8_0(q8_0.data(), 31, values.data(), &scale),
                       doctest::Contains("elements = 31"), Error);
  // Two blocks in a row, starting at an odd address (reads are unaligned-safe).
  std::vector<uint8_t> two(1 + 2 * q4_1.size());
  std::memcpy(two.data() + 1, q4_1.data(), q4_1.size());
  std::memcpy(two.data() + 1 + q4_1.size(), q4_1.data(), q4_1.size());
  std::vector<float> out2(64);
  smcgraph::dequantize_row(GgufType::kQ4_1, two.data() + 1, 64, out2.data());
  CHECK(out2[31] == out2[63]);
  CHECK(out2[0] == -1.0f);

  CHECK_THROWS_WITH_AS(smcgraph::dequantize_row(GgufType::kQ4_1, q4_1.data(), 31, out.data()),
                       doctest::Contains("elements = 31"), Error);
  CHECK_THROWS_WITH_AS(smcgraph::dequantize_row(static_cast<GgufType>(12), q4_1.data(), 32, out.data()),
                       doctest::Contains("type = 12"), Error);
  CHECK(smcgraph::gguf_type_block_bytes(GgufType::kQ4_1) == 20);
  CHECK(smcgraph::gguf_type_block_bytes(GgufType::kQ4_0) == 18);
  CHECK(smcgraph::gguf_type_block_bytes(GgufType::kQ8_0) == 34);
  CHECK(smcgraph::gguf_type_block_elements(GgufType::kBF16) == 1);
  CHECK(std::string(smcgraph::gguf_type_name(GgufType::kBF16)) == "BF16");
  CHECK(std::string(smcgraph::gguf_type_name(static_cast<GgufType>(12))) == "unknown");
  CHECK(std::string(smcgraph::gguf_value_type_name(GgufValueType::kFloat64)) == "float64");
}

TEST_CASE("fp16 and bf16 conversions equal CUDA's host conversions (round to nearest even, NaN kept)") {
  for (uint32_t h = 0; h < 65536; ++h) {
    __half_raw raw;
    raw.x = static_cast<unsigned short>(h);
    const float cuda = __half2float(__half(raw));
    const float ours = smcgraph::gguf_fp16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(cuda))
      REQUIRE(std::isnan(ours));
    else
      REQUIRE(same_bits(ours, cuda));
  }
  // bf16: the tie and NaN cases explicitly, then random bit patterns against CUDA.
  CHECK(smcgraph::gguf_float_to_bf16(1.0f) == 0x3f80);
  CHECK(smcgraph::gguf_float_to_bf16(std::bit_cast<float>(0x3f808000u)) == 0x3f80); // tie, even stays
  CHECK(smcgraph::gguf_float_to_bf16(std::bit_cast<float>(0x3f818000u)) == 0x3f82); // tie, odd rounds up
  CHECK(smcgraph::gguf_float_to_bf16(std::bit_cast<float>(0x3f808001u)) == 0x3f81);
  CHECK(smcgraph::gguf_float_to_bf16(std::bit_cast<float>(0x7f7fffffu)) == 0x7f80); // rounds to infinity
  CHECK(smcgraph::gguf_float_to_bf16(-0.0f) == 0x8000);
  const uint16_t nan = smcgraph::gguf_float_to_bf16(std::bit_cast<float>(0x7f800001u)); // would round to inf
  CHECK((nan & 0x7f80) == 0x7f80);
  CHECK((nan & 0x7f) != 0);
  CHECK((smcgraph::gguf_float_to_bf16(std::bit_cast<float>(0xffc00000u)) & 0x8000) == 0x8000);
  std::mt19937_64 engine(test_seed());
  for (int i = 0; i < 200000; ++i) {
    const float value = std::bit_cast<float>(static_cast<uint32_t>(engine()));
    const __nv_bfloat16 converted = __float2bfloat16_rn(value);
    uint16_t cuda;
    std::memcpy(&cuda, &converted, sizeof(cuda));
    const uint16_t ours = smcgraph::gguf_float_to_bf16(value);
    if (std::isnan(value))
      REQUIRE(std::isnan(std::bit_cast<float>(static_cast<uint32_t>(ours) << 16)));
    else
      REQUIRE(ours == cuda);
    // The writer's fp16 quantiser, likewise.
    const __half half = __float2half_rn(value);
    const uint16_t half_bits = __half_raw(half).x;
    const uint16_t writer_half = smcgraph::test::writer_float_to_fp16(value);
    if (std::isnan(value))
      REQUIRE(std::isnan(smcgraph::gguf_fp16_to_float(writer_half)));
    else
      REQUIRE(writer_half == half_bits);
  }
}

TEST_CASE("alignment: the default 32, general.alignment 32 and 64 align the data section and every tensor") {
  for (uint64_t alignment : {0ull, 32ull, 64ull, 128ull}) {
    CAPTURE(alignment);
    GgufWriter writer;
    writer.add_string("general.name", "x"); // odd-sized metadata, so the padding is not trivially zero
    if (alignment != 0)
      writer.set_alignment(alignment);
    const std::vector<float> a = writer.add_tensor("a", {32}, GgufType::kQ8_0, normal_values(32, 1.0, 1));
    const std::vector<float> b = writer.add_tensor("b", {3}, GgufType::kF32, {1.0f, 2.0f, 3.0f});
    const std::vector<float> c = writer.add_tensor("c", {64}, GgufType::kQ4_1, normal_values(64, 1.0, 2));
    GgufLayout layout;
    const std::vector<uint8_t> bytes = writer.bytes(&layout);
    const uint64_t expected = alignment == 0 ? 32 : alignment;
    CHECK(layout.data_start % expected == 0);
    const GgufFile file = GgufFile::from_bytes(bytes);
    CHECK(file.alignment() == expected);
    for (const auto& info : file.tensors())
      CHECK(info.offset % expected == 0);
    CHECK(file.tensor("b").offset == (34 + expected - 1) / expected * expected); // a: 34 bytes at 0
    CHECK(file.tensor_f32("a", {32}) == a);
    CHECK(file.tensor_f32("b", {3}) == b);
    CHECK(file.tensor_f32("c", {64}) == c);
    CHECK(file.tensor_data(file.tensor("c")) == file.tensor_data(file.tensor("a")) + file.tensor("c").offset);
  }
}

TEST_CASE("open() reads a written file and names the path when it cannot") {
  const auto path =
      std::filesystem::temp_directory_path() / ("smcgraph_gguf_test_" + std::to_string(test_seed()));
  GgufWriter writer = small_writer();
  writer.write(path.string());
  const GgufFile file = GgufFile::open(path.string());
  CHECK(file.source() == path.string());
  CHECK(file.tensors().size() == 6);
  CHECK(file.get_int("v.u8") == 200);
  std::filesystem::remove(path);
  CHECK_THROWS_WITH_AS(GgufFile::open(path.string()), contains(path.string()), Error);
  CHECK_THROWS_WITH_AS(GgufFile::open(std::filesystem::temp_directory_path().string()),
                       doctest::Contains("no such regular file"), Error);
}

TEST_CASE("the tiny Llama file parses with the keys, shapes, types and vocabulary of the real one") {
  smcgraph::test::TinyLlamaSpec spec;
  const std::vector<uint8_t> bytes = smcgraph::test::make_tiny_llama_gguf(spec);
  CHECK(bytes == smcgraph::test::make_tiny_llama_gguf(spec)); // deterministic
  const GgufFile file = GgufFile::from_bytes(bytes, "tiny.gguf");
  CHECK(file.version() == 3);
  CHECK(file.get_string("general.architecture") == "llama");
  CHECK(file.get_int("llama.block_count") == spec.layers);
  CHECK(file.get_int("llama.embedding_length") == spec.hidden);
  CHECK(file.get_int("llama.feed_forward_length") == spec.ffn);
  CHECK(file.get_int("llama.attention.head_count") == spec.heads);
  CHECK(file.get_int("llama.attention.head_count_kv") == spec.kv_heads);
  CHECK(file.get_int("llama.context_length") == spec.context);
  CHECK(file.get_int("llama.vocab_size") == spec.vocab);
  CHECK(file.get_float("llama.rope.freq_base") == spec.rope_base);
  CHECK(file.get_float("llama.attention.layer_norm_rms_epsilon") == spec.eps);
  CHECK(file.get_string("tokenizer.ggml.model") == "gpt2");
  CHECK(file.get_string("tokenizer.ggml.pre") == "smollm");
  CHECK(file.get_int("tokenizer.ggml.bos_token_id") == 1);
  CHECK(file.get_int("tokenizer.ggml.eos_token_id") == 2);

  const std::vector<std::string> tokens = file.get_string_array("tokenizer.ggml.tokens");
  const std::vector<int64_t> types = file.get_int_array("tokenizer.ggml.token_type");
  const std::vector<std::string> merges = file.get_string_array("tokenizer.ggml.merges");
  REQUIRE(tokens.size() == static_cast<size_t>(spec.vocab));
  REQUIRE(types.size() == tokens.size());
  CHECK(tokens[0] == "<|endoftext|>");
  CHECK(tokens[1] == "<|im_start|>");
  CHECK(tokens[2] == "<|im_end|>");
  CHECK(types[1] == 3);
  CHECK(tokens[3] == "!"); // bytes in bytes_to_unicode order, as in the real vocabulary
  CHECK(tokens[3 + 255] == smcgraph::test::gpt2_byte_symbol(0xad));
  CHECK(smcgraph::test::gpt2_byte_symbol(' ') == "\xc4\xa0");  // U+0120 'Ġ'
  CHECK(smcgraph::test::gpt2_byte_symbol('\n') == "\xc4\x8a"); // U+010A 'Ċ'
  const std::set<std::string> byte_symbols(tokens.begin() + 3, tokens.begin() + 259);
  CHECK(byte_symbols.size() == 256);
  const std::set<std::string> all(tokens.begin(), tokens.end());
  CHECK(all.size() == tokens.size());
  REQUIRE(!merges.empty());
  for (const std::string& merge : merges) {
    const size_t space = merge.find(' ');
    REQUIRE(space != std::string::npos);
    CHECK(all.count(merge.substr(0, space)) == 1);
    CHECK(all.count(merge.substr(space + 1)) == 1);
    CHECK(all.count(merge.substr(0, space) + merge.substr(space + 1)) == 1);
  }
  CHECK(types.back() == 5); // fillers are 'unused'

  const int64_t h = spec.hidden, f = spec.ffn, hd = spec.hidden / spec.heads, kv = hd * spec.kv_heads;
  CHECK(file.tensors().size() == static_cast<size_t>(2 + 9 * spec.layers));
  CHECK(file.find_tensor("output.weight") == nullptr);
  CHECK(file.tensor("token_embd.weight").type == GgufType::kQ8_0);
  const std::vector<float> embedding = file.tensor_f32("token_embd.weight", {h, spec.vocab});
  for (int layer = 0; layer < spec.layers; ++layer) {
    const std::string b = "blk." + std::to_string(layer) + ".";
    const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
        {"attn_q.weight", {h, h}},      {"attn_k.weight", {h, kv}},  {"attn_v.weight", {h, kv}},
        {"attn_output.weight", {h, h}}, {"ffn_gate.weight", {h, f}}, {"ffn_up.weight", {h, f}},
        {"ffn_down.weight", {f, h}}};
    for (const auto& [name, dims] : shapes) {
      CAPTURE(b + name);
      CHECK(file.tensor(b + name).type == GgufType::kQ4_1);
      const std::vector<float> w = file.tensor_f32(b + name, dims);
      double sum_squares = 0.0;
      for (float v : w)
        sum_squares += static_cast<double>(v) * v;
      const double rms = std::sqrt(sum_squares / static_cast<double>(w.size()));
      const double target = 1.0 / std::sqrt(static_cast<double>(dims[0]));
      CHECK(rms > 0.8 * target);
      CHECK(rms < 1.25 * target);
    }
    for (const char* norm : {"attn_norm.weight", "ffn_norm.weight"}) {
      CHECK(file.tensor(b + norm).type == GgufType::kF32);
      for (float v : file.tensor_f32(b + norm, {h}))
        CHECK((v >= 0.9f && v <= 1.1f));
    }
  }
  CHECK(file.tensor("output_norm.weight").dims == std::vector<int64_t>{h});

  // Untied, other types, other seed.
  smcgraph::test::TinyLlamaSpec other = spec;
  other.tied = false;
  other.weight_type = GgufType::kQ8_0;
  other.seed = 7;
  const GgufFile untied = GgufFile::from_bytes(smcgraph::test::make_tiny_llama_gguf(other));
  REQUIRE(untied.find_tensor("output.weight") != nullptr);
  CHECK(untied.tensor("output.weight").dims == std::vector<int64_t>{h, spec.vocab});
  CHECK(untied.tensor("blk.0.attn_q.weight").type == GgufType::kQ8_0);
  CHECK(untied.tensor_f32("token_embd.weight", {h, spec.vocab}) != embedding);
}

TEST_CASE("a bad header names the magic, the version or the count") {
  const std::vector<uint8_t> good = small_writer().bytes();
  REQUIRE_NOTHROW(GgufFile::from_bytes(good));
  std::vector<uint8_t> bytes = good;
  bytes[0] = 'X';
  CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes, "bad.gguf"),
                       doctest::Contains("GGUF 'bad.gguf': bad magic 'XGUF'"), Error);
  for (uint32_t version : {0u, 1u, 4u, 0x03000000u}) {
    bytes = good;
    poke<uint32_t>(bytes, 4, version);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         contains("unsupported version " + std::to_string(version)), Error);
  }
  bytes = good;
  poke<uint64_t>(bytes, 8, 1ull << 60);
  CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                       doctest::Contains("tensor count 1152921504606846976 is absurd"), Error);
  bytes = good;
  poke<uint64_t>(bytes, 16, 1ull << 60);
  CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                       doctest::Contains("kv count 1152921504606846976 is absurd"), Error);
  bytes = good;
  poke<uint64_t>(bytes, 16, ~0ull);
  CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("kv count"), Error);
  CHECK_THROWS_WITH_AS(GgufFile::from_bytes({}), doctest::Contains("truncated: magic at offset 0"), Error);
}

TEST_CASE("truncation at every byte offset throws smcgraph::Error saying so") {
  const std::vector<uint8_t> good = small_writer().bytes();
  REQUIRE_NOTHROW(GgufFile::from_bytes(good));
  size_t failures = 0;
  for (size_t size = 0; size < good.size(); ++size) {
    const std::vector<uint8_t> prefix(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(size));
    try {
      GgufFile::from_bytes(prefix, "cut.gguf");
      ++failures;
      MESSAGE("no error at size " << size);
    } catch (const Error& e) {
      if (std::string(e.what()).find("truncated") == std::string::npos) {
        ++failures;
        MESSAGE("size " << size << ": " << e.what());
      }
    }
  }
  CHECK(failures == 0);
  MESSAGE("checked " << good.size() << " truncations");
}

TEST_CASE("bad metadata names the key, the field and the offset") {
  GgufLayout layout;
  const std::vector<uint8_t> good = small_writer().bytes(&layout);
  auto kv = [&](const std::string& key) {
    for (const auto& entry : layout.kvs)
      if (entry.key == key)
        return entry;
    FAIL("no key " << key);
    return layout.kvs.front();
  };
  std::vector<uint8_t> bytes = good;

  SUBCASE("unknown value type") {
    poke<uint32_t>(bytes, kv("v.i16").type_offset, 13);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("key 'v.i16': unknown value type 13"),
                         Error);
    CHECK(message_of(bytes).find("offset " + std::to_string(kv("v.i16").type_offset)) != std::string::npos);
  }
  SUBCASE("unknown array element type") {
    poke<uint32_t>(bytes, kv("a.i32").value_offset, 99);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         doctest::Contains("key 'a.i32': unknown array element type 99"), Error);
  }
  SUBCASE("absurd array length") {
    poke<uint64_t>(bytes, kv("a.string").value_offset + 4, 1ull << 60);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         doctest::Contains("key 'a.string': array length 1152921504606846976 of string"),
                         Error);
    bytes = good;
    poke<uint64_t>(bytes, kv("a.u64").value_offset + 4, ~0ull);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("key 'a.u64': array length"), Error);
  }
  SUBCASE("absurd string length") {
    poke<uint64_t>(bytes, kv("v.string").value_offset, 1ull << 60);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         doctest::Contains("key 'v.string': string length 1152921504606846976 exceeds"),
                         Error);
    bytes = good;
    poke<uint64_t>(bytes, kv("v.f32").key_offset, ~0ull);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("key length 18446744073709551615"),
                         Error);
    bytes = good;
    // The second string of an array.
    poke<uint64_t>(bytes, kv("a.string").value_offset + 12 + 8, 1ull << 40);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("key 'a.string': string length [1]"),
                         Error);
  }
  SUBCASE("bool neither 0 nor 1") {
    bytes[kv("v.bool").value_offset] = 2;
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("key 'v.bool': bool value 2"), Error);
    bytes = good;
    bytes[kv("a.bool").value_offset + 12 + 1] = 0xff;
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("key 'a.bool': bool value 255"),
                         Error);
  }
  SUBCASE("duplicate key") {
    GgufWriter writer = metadata_writer();
    writer.add_u32("v.u16", 1);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(writer.bytes()), doctest::Contains("duplicate key 'v.u16'"),
                         Error);
  }
  SUBCASE("empty key") {
    GgufWriter writer;
    writer.add_u32("", 1);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(writer.bytes()), doctest::Contains("kv 0: empty key"), Error);
  }
  SUBCASE("arrays nested too deep") {
    GgufMetaValue value = GgufMetaValue::integer_array(GgufValueType::kInt32, {1});
    for (int level = 0; level < 8; ++level)
      value = GgufMetaValue::array(GgufValueType::kArray, {value});
    GgufWriter writer;
    writer.add("deep", value);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(writer.bytes()),
                         doctest::Contains("key 'deep': arrays nested deeper than 8 levels"), Error);
    GgufWriter shallower;
    shallower.add("deep", value.items.front());
    CHECK(GgufFile::from_bytes(shallower.bytes()).array_type_of("deep") == GgufValueType::kArray);
  }
  SUBCASE("general.alignment of the wrong type or not a power of two") {
    GgufWriter writer;
    writer.add_string("general.alignment", "64");
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(writer.bytes()),
                         doctest::Contains("key 'general.alignment' has type string, expected uint32"),
                         Error);
    for (uint32_t alignment : {0u, 48u}) {
      GgufWriter odd;
      odd.add_u32("general.alignment", alignment);
      CHECK_THROWS_WITH_AS(
          GgufFile::from_bytes(odd.bytes()),
          contains("'general.alignment' = " + std::to_string(alignment) + " is not a power of two"), Error);
    }
  }
}

TEST_CASE("a bad tensor table names the tensor and the field") {
  GgufLayout layout;
  const std::vector<uint8_t> good = small_writer().bytes(&layout);
  const GgufLayout::TensorInfo q4 = layout.tensors[4]; // "t.Q4_1", dims {32, 2}
  REQUIRE(q4.name == "t.Q4_1");
  std::vector<uint8_t> bytes = good;

  SUBCASE("unknown and unsupported tensor types") {
    poke<uint32_t>(bytes, q4.type_offset, 99);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         doctest::Contains("tensor 't.Q4_1': tensor type 99 (unknown) is not supported"),
                         Error);
    poke<uint32_t>(bytes, q4.type_offset, 12);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         doctest::Contains("tensor 't.Q4_1': tensor type 12 (Q4_K) is not supported"), Error);
  }
  SUBCASE("n_dims outside 1..4") {
    poke<uint32_t>(bytes, q4.n_dims_offset, 5);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         doctest::Contains("tensor 't.Q4_1': n_dims = 5 must be 1..4"), Error);
    poke<uint32_t>(bytes, q4.n_dims_offset, 0);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("tensor 't.Q4_1': n_dims = 0"),
                         Error);
  }
  SUBCASE("dimensions <= 0 and element count overflow") {
    poke<uint64_t>(bytes, q4.dims_offset + 8, 0);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         doctest::Contains("tensor 't.Q4_1': dimension ne[1] = 0 must be > 0"), Error);
    poke<uint64_t>(bytes, q4.dims_offset + 8, ~0ull);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         doctest::Contains("tensor 't.Q4_1': dimension ne[1] = -1 must be > 0"), Error);
    GgufWriter writer;
    writer.add_tensor_raw("huge", {1ll << 32, 1ll << 32}, 0, {});
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(writer.bytes()),
                         doctest::Contains("tensor 'huge': element count overflows int64 at dimension ne[1]"),
                         Error);
    GgufWriter big;
    big.add_tensor_raw("big", {1ll << 40}, 0, std::vector<uint8_t>(64));
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(big.bytes()), doctest::Contains("tensor 'big': needs"), Error);
  }
  SUBCASE("ne[0] not a whole number of blocks") {
    GgufWriter writer;
    writer.add_tensor_raw("odd", {48, 2}, static_cast<uint32_t>(GgufType::kQ4_1), std::vector<uint8_t>(60));
    CHECK_THROWS_WITH_AS(
        GgufFile::from_bytes(writer.bytes()),
        doctest::Contains("tensor 'odd': ne[0] = 48 is not a multiple of the Q4_1 block size 32"), Error);
  }
  SUBCASE("offset misaligned or out of bounds") {
    poke<uint64_t>(bytes, q4.offset_offset, 1 + layout.tensor_data_offsets[4] - layout.data_start);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         contains("tensor 't.Q4_1': offset " +
                                  std::to_string(1 + layout.tensor_data_offsets[4] - layout.data_start) +
                                  " is misaligned"),
                         Error);
    poke<uint64_t>(bytes, q4.offset_offset, 1ull << 40);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes),
                         doctest::Contains("tensor 't.Q4_1': bytes [1099511627776, "), Error);
    CHECK(message_of(bytes).find("out of bounds") != std::string::npos);
    poke<uint64_t>(bytes, q4.offset_offset, ~0ull << 5); // offset + bytes wraps around 2^64
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("out of bounds"), Error);
    // The last tensor moved one alignment further: its end leaves the file.
    bytes = good;
    const GgufLayout::TensorInfo last = layout.tensors.back();
    poke<uint64_t>(bytes, last.offset_offset, layout.tensor_data_offsets.back() - layout.data_start + 32);
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(bytes), doctest::Contains("tensor 't.Q8_0': bytes ["), Error);
  }
  SUBCASE("duplicate or empty tensor name") {
    GgufWriter writer;
    writer.add_tensor("w", {32}, GgufType::kF32, std::vector<float>(32, 1.0f));
    writer.add_tensor("w", {32}, GgufType::kF32, std::vector<float>(32, 2.0f));
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(writer.bytes()),
                         doctest::Contains("tensor 1: duplicate tensor name 'w'"), Error);
    GgufWriter empty;
    empty.add_tensor("", {32}, GgufType::kF32, std::vector<float>(32, 1.0f));
    CHECK_THROWS_WITH_AS(GgufFile::from_bytes(empty.bytes()),
                         doctest::Contains("tensor 0: empty tensor name"), Error);
  }
}

TEST_CASE("lookups name the missing key or tensor, the wrong type and both shapes") {
  GgufWriter writer = small_writer();
  const GgufFile file = GgufFile::from_bytes(writer.bytes(), "f.gguf");
  CHECK_THROWS_WITH_AS(file.get_int("llama.block_count"),
                       doctest::Contains("GGUF 'f.gguf': missing key 'llama.block_count'"), Error);
  CHECK_THROWS_WITH_AS(file.type_of("nope"), doctest::Contains("missing key 'nope'"), Error);
  CHECK_THROWS_WITH_AS(file.get_string("v.u32"),
                       doctest::Contains("key 'v.u32' has type uint32, expected string"), Error);
  CHECK_THROWS_WITH_AS(file.get_int("v.string"),
                       doctest::Contains("key 'v.string' has type string, expected an integer"), Error);
  CHECK_THROWS_WITH_AS(file.get_int("v.f32"),
                       doctest::Contains("key 'v.f32' has type float32, expected an integer"), Error);
  CHECK_THROWS_WITH_AS(file.get_int("v.string", 3), doctest::Contains("key 'v.string' has type string"),
                       Error);
  CHECK_THROWS_WITH_AS(file.get_float("a.f32"), doctest::Contains("key 'a.f32' has type array of float32"),
                       Error);
  CHECK_THROWS_WITH_AS(file.get_string_array("a.i32"),
                       doctest::Contains("key 'a.i32' has type array of int32, expected array of string"),
                       Error);
  CHECK_THROWS_WITH_AS(file.get_int_array("a.string"),
                       doctest::Contains("key 'a.string' has type array of string"), Error);
  CHECK_THROWS_WITH_AS(file.get_int_array("a.f32"),
                       doctest::Contains("key 'a.f32' has type array of float32"), Error);
  CHECK_THROWS_WITH_AS(file.get_float_array("a.nested"),
                       doctest::Contains("key 'a.nested' has type array of array"), Error);
  CHECK_THROWS_WITH_AS(file.array_type_of("v.u8"),
                       doctest::Contains("key 'v.u8' has type uint8, expected an array"), Error);
  CHECK_THROWS_WITH_AS(file.get_int("v.u64_huge"),
                       doctest::Contains("key 'v.u64_huge': uint64 value 9223372036854775813"), Error);
  CHECK(file.find_tensor("nope") == nullptr);
  CHECK_THROWS_WITH_AS(file.tensor("nope"), doctest::Contains("GGUF 'f.gguf': missing tensor 'nope'"), Error);
  CHECK_THROWS_WITH_AS(file.tensor_f32("nope", {32}), doctest::Contains("missing tensor 'nope'"), Error);
  CHECK_THROWS_WITH_AS(file.tensor_f32("t.Q4_1", {2, 32}),
                       doctest::Contains("tensor 't.Q4_1' has shape [32, 2], expected [2, 32]"), Error);
  CHECK_THROWS_WITH_AS(file.tensor_bf16("t.F16", {64}),
                       doctest::Contains("tensor 't.F16' has shape [32, 2], expected [64]"), Error);
  // An info that does not belong to this file.
  smcgraph::GgufTensorInfo foreign = file.tensor("t.F32");
  foreign.offset = 1ull << 40;
  CHECK_THROWS_WITH_AS(file.tensor_data(foreign), doctest::Contains("outside this file's data section"),
                       Error);
}

TEST_CASE("seed corpus for the GGUF fuzzer (written when SMCGRAPH_FUZZ_CORPUS_DIR is set)") {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> seeds;
  smcgraph::test::TinyLlamaSpec spec;
  spec.layers = 1;
  spec.hidden = 32;
  spec.ffn = 32;
  spec.heads = 2;
  spec.kv_heads = 1;
  spec.vocab = 259;
  seeds.emplace_back("tiny_llama", smcgraph::test::make_tiny_llama_gguf(spec));
  seeds.emplace_back("metadata", metadata_writer().bytes());
  seeds.emplace_back("every_type", small_writer().bytes());
  GgufWriter v2 = metadata_writer();
  v2.set_version(2);
  seeds.emplace_back("metadata_v2", v2.bytes());
  for (GgufType type : kAllTypes) {
    GgufWriter writer;
    writer.set_alignment(64);
    writer.add_tensor("w", {32, 2}, type, normal_values(64, 1.0, 5));
    writer.add_tensor("v", {32}, type, normal_values(32, 1.0, 6));
    seeds.emplace_back(std::string("tensor_") + smcgraph::gguf_type_name(type), writer.bytes());
  }
  for (const auto& [name, bytes] : seeds) {
    CAPTURE(name);
    CHECK_NOTHROW(GgufFile::from_bytes(bytes));
  }
  const char* dir = std::getenv("SMCGRAPH_FUZZ_CORPUS_DIR");
  if (dir == nullptr || *dir == '\0') {
    MESSAGE("SMCGRAPH_FUZZ_CORPUS_DIR not set: seeds checked, not written");
    return;
  }
  std::filesystem::create_directories(dir);
  for (const auto& [name, bytes] : seeds) {
    const auto path = std::filesystem::path(dir) / ("gguf_seed_" + name + ".gguf");
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(out.good());
  }
  MESSAGE("wrote " << seeds.size() << " seeds to " << std::string(dir));
}

TEST_CASE("the real SmolLM2-135M file matches the facts of DESIGN.md 6.1 and python gguf's dequantisation") {
  const std::optional<std::filesystem::path> path = real_model_path();
  if (!path) {
    MESSAGE("skipped: real model file not found (run ./run fetch-model)");
    return;
  }
  const GgufFile file = GgufFile::open(path->string());
  CHECK(file.version() == 3);
  CHECK(file.tensors().size() == 272);
  CHECK(file.keys().size() == 33);
  CHECK(file.alignment() == 32);
  CHECK(file.get_string("general.architecture") == "llama");
  CHECK(file.get_int("llama.block_count") == 30);
  CHECK(file.get_int("llama.embedding_length") == 576);
  CHECK(file.get_int("llama.feed_forward_length") == 1536);
  CHECK(file.get_int("llama.attention.head_count") == 9);
  CHECK(file.get_int("llama.attention.head_count_kv") == 3);
  CHECK(file.get_int("llama.rope.dimension_count") == 64);
  CHECK(file.get_float("llama.rope.freq_base") == 100000.0);
  CHECK(file.get_float("llama.attention.layer_norm_rms_epsilon") == static_cast<double>(1e-5f));
  CHECK(file.get_int("llama.context_length") == 8192);
  CHECK(file.get_int("llama.vocab_size") == 49152);
  CHECK(file.get_string("tokenizer.ggml.model") == "gpt2");
  CHECK(file.get_string("tokenizer.ggml.pre") == "smollm");
  const std::vector<std::string> tokens = file.get_string_array("tokenizer.ggml.tokens");
  CHECK(tokens.size() == 49152);
  CHECK(tokens[1] == "<|im_start|>");
  CHECK(tokens[2] == "<|im_end|>");
  CHECK(file.get_int_array("tokenizer.ggml.token_type").size() == 49152);
  CHECK(file.get_string_array("tokenizer.ggml.merges").size() == 48900);
  CHECK(file.get_int("tokenizer.ggml.bos_token_id") == 1);
  CHECK(file.get_int("tokenizer.ggml.eos_token_id") == 2);
  CHECK(file.get_string("tokenizer.chat_template").find("<|im_start|>") != std::string::npos);

  CHECK(file.find_tensor("output.weight") == nullptr);
  int f32 = 0, q4_1 = 0, q8_0 = 0;
  for (const auto& info : file.tensors()) {
    CAPTURE(info.name);
    const bool norm = info.name.find("norm") != std::string::npos;
    if (norm) {
      CHECK(info.type == GgufType::kF32);
      CHECK(info.dims == std::vector<int64_t>{576});
    } else if (info.name == "token_embd.weight") {
      CHECK(info.type == GgufType::kQ8_0);
    } else {
      CHECK(info.type == GgufType::kQ4_1);
    }
    f32 += info.type == GgufType::kF32;
    q4_1 += info.type == GgufType::kQ4_1;
    q8_0 += info.type == GgufType::kQ8_0;
  }
  CHECK(f32 == 61);
  CHECK(q4_1 == 210);
  CHECK(q8_0 == 1);
  CHECK(file.tensor("blk.0.attn_k.weight").dims == std::vector<int64_t>{576, 192});
  CHECK(file.tensor("blk.29.ffn_down.weight").dims == std::vector<int64_t>{1536, 576});

  // Values from python gguf (gguf.quants.dequantize) on the same file.
  const std::vector<float> q = file.tensor_f32("blk.0.attn_q.weight", {576, 576});
  const std::vector<std::pair<size_t, double>> q_expected = {
      {0, -0.0963134765625},   {1, 0.1573486328125},   {15, 0.537841796875},
      {16, -0.22314453125},    {31, -0.0963134765625}, {32, -0.34619140625},
      {1000, -0.138427734375}, {165905, 0.51171875},   {331775, -0.255859375}};
  for (const auto& [index, value] : q_expected) {
    CAPTURE(index);
    CHECK(q[index] == value);
  }
  const std::vector<float> down = file.tensor_f32("blk.29.ffn_down.weight", {1536, 576});
  CHECK(down[0] == -0.2733154296875);
  CHECK(down[16] == 0.32415771484375);
  CHECK(down[884735] == 0.056640625);
  const std::vector<float> embd = file.tensor_f32("token_embd.weight", {576, 49152});
  const std::vector<std::pair<size_t, double>> e_expected = {
      {0, -0.10654449462890625},    {1, 0.032978057861328125},       {15, 0.020294189453125},
      {16, -0.007610321044921875},  {31, -0.20040512084960938},      {32, -0.09348678588867188},
      {1000, 0.007411956787109375}, {14155793, 0.07286643981933594}, {28311551, -0.0417022705078125}};
  for (const auto& [index, value] : e_expected) {
    CAPTURE(index);
    CHECK(embd[index] == value);
  }
  const std::vector<float> norm = file.tensor_f32("output_norm.weight", {576});
  CHECK(norm[0] == 1.7578125);
  CHECK(norm[1] == 1.8203125);
  CHECK(norm[575] == 1.984375);
  const std::vector<uint16_t> norm_bf16 = file.tensor_bf16("output_norm.weight", {576});
  CHECK(norm_bf16[0] == smcgraph::gguf_float_to_bf16(1.7578125f));
}
