// Seeds for the fuzz targets (tests/fuzz/): a CPU suite that builds interesting inputs anyway (valid files,
// every rejected field) also writes them as seed files when tests/fuzz/run_fuzz.sh asks for them by setting
// SMCGRAPH_FUZZ_CORPUS_DIR. Header-only, so suites that link only the host library can use it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace smcgraph::test {

/// Where seeds go: $SMCGRAPH_FUZZ_CORPUS_DIR, or empty when the variable is unset (no seeds wanted).
inline std::filesystem::path fuzz_seed_dir() {
  const char* root = std::getenv("SMCGRAPH_FUZZ_CORPUS_DIR");
  if (root == nullptr || root[0] == '\0')
    return {};
  return std::filesystem::path(root);
}

/// Writes `bytes` as seed file "<target>_seed_<name>" (target "engine", "gguf", "tokenizer") when seeds are
/// wanted. Returns false only when a wanted seed could not be written (callers CHECK it).
inline bool write_fuzz_seed(const std::string& target, const std::string& name, const void* bytes,
                            size_t size) {
  const std::filesystem::path dir = fuzz_seed_dir();
  if (dir.empty())
    return true;
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  std::ofstream out(dir / (target + "_seed_" + name), std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(size));
  return static_cast<bool>(out);
}

inline bool write_fuzz_seed(const std::string& target, const std::string& name,
                            const std::vector<uint8_t>& bytes) {
  return write_fuzz_seed(target, name, bytes.data(), bytes.size());
}

inline bool write_fuzz_seed(const std::string& target, const std::string& name, const std::string& text) {
  return write_fuzz_seed(target, name, text.data(), text.size());
}

} // namespace smcgraph::test
