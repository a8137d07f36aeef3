// Fuzz target of the GGUF reader. Any input must either parse or throw smcgraph::Error; every other
// exception, crash, sanitizer report or out-of-memory is a bug. On success it reads every key through the
// getter of its type and dequantises every tensor (up to kMaxElements values each), so the values the loader
// would use are exercised too.
//
// libFuzzer (clang):  clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude -Isrc \
//                       -I<cuda>/include tests/fuzz/fuzz_gguf.cpp src/models/llama/gguf.cpp
//                       src/runtime/error.cpp \ -L<cuda>/lib64 -lcudart -o fuzz_gguf
//                     ./fuzz_gguf -max_len=65536 -rss_limit_mb=2048 corpus/
// The seed corpus (tiny Llama file, every metadata type, every tensor type) is written by the GGUF CPU suite:
//   SMCGRAPH_FUZZ_CORPUS_DIR=corpus build/tests/test_gguf_cpu
// Without libFuzzer (g++ -fsanitize=address,undefined) link this file with a driver that calls
// LLVMFuzzerTestOneInput on files or mutated buffers; it uses no libFuzzer-only API.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "smcgraph/error.hpp"
#include "smcgraph/gguf.hpp"

namespace {

constexpr int64_t kMaxElements = int64_t{1}
                                 << 22; // per tensor, so a large valid tensor cannot exhaust memory

void walk(const smcgraph::GgufFile& file) {
  using smcgraph::GgufValueType;
  volatile double sink = 0.0;
  for (const std::string& key : file.keys()) {
    const GgufValueType type = file.type_of(key);
    switch (type) {
    case GgufValueType::kString:
      sink = sink + static_cast<double>(file.get_string(key).size());
      break;
    case GgufValueType::kFloat32:
    case GgufValueType::kFloat64:
      sink = sink + file.get_float(key);
      break;
    case GgufValueType::kUint64: // may exceed int64: get_int throws smcgraph::Error then, get_float never
                                 // does
      sink = sink + file.get_float(key);
      try {
        sink = sink + static_cast<double>(file.get_int(key));
      } catch (const smcgraph::Error&) {
      }
      break;
    case GgufValueType::kArray: {
      const GgufValueType element = file.array_type_of(key);
      if (element == GgufValueType::kString) {
        sink = sink + static_cast<double>(file.get_string_array(key).size());
      } else if (element == GgufValueType::kFloat32 || element == GgufValueType::kFloat64) {
        for (double value : file.get_float_array(key))
          sink = sink + value;
      } else if (element != GgufValueType::kArray) {
        for (double value : file.get_float_array(key))
          sink = sink + value;
        try {
          for (int64_t value : file.get_int_array(key))
            sink = sink + static_cast<double>(value);
        } catch (const smcgraph::Error&) { // a uint64 element above INT64_MAX
        }
      }
      break;
    }
    default:
      sink = sink + static_cast<double>(file.get_int(key));
      break;
    }
  }
  (void)file.get_int("general.alignment", 32);
  for (const smcgraph::GgufTensorInfo& info : file.tensors()) {
    if (file.find_tensor(info.name) != &info)
      __builtin_trap(); // the index must map every name to its own entry
    if (info.elements > kMaxElements)
      continue;
    const std::vector<float> values = file.tensor_f32(info.name, info.dims);
    const std::vector<uint16_t> bf16 = file.tensor_bf16(info.name, info.dims);
    if (values.size() != static_cast<size_t>(info.elements) || bf16.size() != values.size())
      __builtin_trap();
    if (!values.empty())
      sink = sink + static_cast<double>(values.front()) + bf16.back();
  }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const smcgraph::GgufFile file =
        smcgraph::GgufFile::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz");
    walk(file);
  } catch (const smcgraph::Error&) {
    // Malformed input, reported as it must be.
  }
  return 0;
}
