// The fuzz driver used where clang's libFuzzer is not available (tests/fuzz/run_fuzz.sh builds each target
// with g++ -fsanitize=address,undefined and this file instead of -fsanitize=fuzzer). It calls the same
// LLVMFuzzerTestOneInput and takes the libFuzzer flags run_fuzz.sh passes:
//
//   fuzz_x [-seed=N] [-max_total_time=S] [-runs=N] [-max_len=N] [-timeout=S] [-artifact_prefix=P]
//          [-dict=FILE] [-print_final_stats=1] CORPUS_DIR... | INPUT_FILE...
//
// Directories: the corpus (new inputs are written to the first one); files: run each once and exit
// (reproducing a crash). Coverage-guided like libFuzzer, in small: the targets are compiled with
// -fsanitize-coverage=trace-pc,trace-cmp, every executed edge (previous block, block) sets a bit in a 64 Ki
// map, and an input that sets a new bit joins the corpus; constants the code compares against (and memcmp /
// strcmp operands) become a dictionary the mutations insert. Seeded and single-threaded: the same seed,
// corpus and binary replay the same inputs in the same order.
//
// A crash (ASan / UBSan report, abort, an exception escaping the target) or an input running longer than
// -timeout writes the input to <artifact_prefix>crash-<hash> (or timeout-<hash>) and exits nonzero.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);
extern "C" void __sanitizer_set_death_callback(void (*callback)(void));

// Reports a huge allocation (a size read from the input and trusted) as a crash, as libFuzzer's
// -malloc_limit_mb does; ASAN_OPTIONS in the environment still override.
extern "C" const char* __asan_default_options() {
  return "max_allocation_size_mb=4096:allocator_may_return_null=0:detect_leaks=1";
}
extern "C" const char* __ubsan_default_options() {
  return "print_stacktrace=1:halt_on_error=1:abort_on_error=1"; // abort: on_signal writes the input
}

namespace {

// ---- coverage
// ----------------------------------------------------------------------------------------------

constexpr size_t kMapSize = 1 << 16;
uint8_t g_edges[kMapSize];    // edges hit by the current input ...
uint32_t g_touched[kMapSize]; // ... and their indices, so a run resets and scans only those
size_t g_touched_count = 0;
uint8_t g_seen[kMapSize];       // edges any input has hit
uintptr_t g_previous_block = 0; // for the (previous, current) edge hash

// Constants seen in comparisons: the dictionary grows as the target reveals what it looks for.
constexpr size_t kMaxCompareWords = 1024;
std::vector<std::vector<uint8_t>> g_compare_words;
bool g_collecting = false; // only while a target runs

void add_compare_word(const void* bytes, size_t size) {
  if (!g_collecting || size == 0 || size > 64 || g_compare_words.size() >= kMaxCompareWords)
    return;
  g_collecting = false; // the search below calls memcmp: its hook must not come back here
  std::vector<uint8_t> word(static_cast<const uint8_t*>(bytes), static_cast<const uint8_t*>(bytes) + size);
  if (std::find(g_compare_words.begin(), g_compare_words.end(), word) == g_compare_words.end())
    g_compare_words.push_back(std::move(word));
  g_collecting = true;
}

} // namespace

extern "C" {
void __sanitizer_cov_trace_pc() {
  const uintptr_t block = reinterpret_cast<uintptr_t>(__builtin_return_address(0));
  const uintptr_t hashed = (block ^ (block >> 15)) * 0x9E3779B97F4A7C15ull;
  const size_t edge = (hashed ^ g_previous_block) % kMapSize;
  if (!g_edges[edge]) {
    g_edges[edge] = 1;
    g_touched[g_touched_count++] = static_cast<uint32_t>(edge);
  }
  g_previous_block = hashed >> 1;
}
void __sanitizer_cov_trace_const_cmp1(uint8_t, uint8_t) {}
void __sanitizer_cov_trace_const_cmp2(uint16_t constant, uint16_t) {
  add_compare_word(&constant, sizeof(constant));
}
void __sanitizer_cov_trace_const_cmp4(uint32_t constant, uint32_t) {
  if (constant > 0xff)
    add_compare_word(&constant, sizeof(constant));
}
void __sanitizer_cov_trace_const_cmp8(uint64_t constant, uint64_t) {
  if (constant > 0xff)
    add_compare_word(&constant, sizeof(constant));
}
void __sanitizer_cov_trace_cmp1(uint8_t, uint8_t) {}
void __sanitizer_cov_trace_cmp2(uint16_t, uint16_t) {}
void __sanitizer_cov_trace_cmp4(uint32_t, uint32_t) {}
void __sanitizer_cov_trace_cmp8(uint64_t, uint64_t) {}
void __sanitizer_cov_trace_cmpf(float, float) {}
void __sanitizer_cov_trace_cmpd(double, double) {}
void __sanitizer_cov_trace_switch(uint64_t, uint64_t*) {}
void __sanitizer_cov_trace_div4(uint32_t) {}
void __sanitizer_cov_trace_div8(uint64_t) {}
void __sanitizer_cov_trace_gep(uintptr_t) {}
// Called by the sanitizer runtime's interceptors.
void __sanitizer_weak_hook_memcmp(void*, const void* s1, const void* s2, size_t n, int result) {
  if (result != 0 && n <= 64) {
    add_compare_word(s1, n);
    add_compare_word(s2, n);
  }
}
void __sanitizer_weak_hook_strcmp(void*, const char* s1, const char* s2, int result) {
  if (result != 0) {
    add_compare_word(s1, std::strlen(s1));
    add_compare_word(s2, std::strlen(s2));
  }
}
void __sanitizer_weak_hook_strncmp(void*, const char* s1, const char* s2, size_t n, int result) {
  if (result != 0) {
    add_compare_word(s1, strnlen(s1, n));
    add_compare_word(s2, strnlen(s2, n));
  }
}
}

namespace {

// ---- options
// -----------------------------------------------------------------------------------------------

struct Options {
  uint64_t seed = 1;
  double max_total_time = 0.0; ///< seconds; 0 with runs = 0: 10 s
  long runs = 0;
  size_t max_len = 4096;
  double timeout = 10.0;
  std::string artifact_prefix = "./";
  std::string dict;
  bool print_final_stats = false;
  std::vector<std::string> inputs; ///< corpus directories or files to reproduce
};

bool flag_value(const char* argument, const char* name, std::string* value) {
  const size_t length = std::strlen(name);
  if (std::strncmp(argument, name, length) != 0 || argument[length] != '=')
    return false;
  *value = argument + length + 1;
  return true;
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string value;
    const char* a = argv[i];
    if (flag_value(a, "-seed", &value))
      options.seed = std::strtoull(value.c_str(), nullptr, 0);
    else if (flag_value(a, "-max_total_time", &value))
      options.max_total_time = std::atof(value.c_str());
    else if (flag_value(a, "-runs", &value))
      options.runs = std::atol(value.c_str());
    else if (flag_value(a, "-max_len", &value))
      options.max_len = std::max<size_t>(1, std::strtoull(value.c_str(), nullptr, 0));
    else if (flag_value(a, "-timeout", &value))
      options.timeout = std::atof(value.c_str());
    else if (flag_value(a, "-artifact_prefix", &value))
      options.artifact_prefix = value;
    else if (flag_value(a, "-dict", &value))
      options.dict = value;
    else if (flag_value(a, "-print_final_stats", &value))
      options.print_final_stats = value == "1";
    else if (a[0] == '-')
      std::fprintf(stderr, "mutation driver: ignoring %s\n", a);
    else
      options.inputs.push_back(a);
  }
  if (options.max_total_time <= 0.0 && options.runs <= 0)
    options.max_total_time = 10.0;
  return options;
}

/// libFuzzer / AFL dictionary lines: name="value" or "value", with \\, \" and \xNN escapes.
std::vector<std::vector<uint8_t>> read_dictionary(const std::string& path) {
  std::vector<std::vector<uint8_t>> words;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t open = line.find('"');
    const size_t close = line.rfind('"');
    if (line.empty() || line[0] == '#' || open == std::string::npos || close <= open)
      continue;
    std::vector<uint8_t> word;
    for (size_t i = open + 1; i < close; ++i) {
      if (line[i] == '\\' && i + 1 < close) {
        if (line[i + 1] == 'x' && i + 3 < close) {
          word.push_back(static_cast<uint8_t>(std::strtoul(line.substr(i + 2, 2).c_str(), nullptr, 16)));
          i += 3;
        } else {
          word.push_back(static_cast<uint8_t>(line[++i]));
        }
      } else {
        word.push_back(static_cast<uint8_t>(line[i]));
      }
    }
    if (!word.empty())
      words.push_back(std::move(word));
  }
  return words;
}

std::vector<uint8_t> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

uint64_t fnv1a(const std::vector<uint8_t>& bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (uint8_t b : bytes)
    hash = (hash ^ b) * 0x100000001b3ull;
  return hash;
}

std::string hex(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

// ---- the input being run (for the crash and timeout reports)
// -----------------------------------------------

std::vector<uint8_t> g_current;
std::string g_artifact_prefix = "./";
std::atomic<int64_t> g_started_ns{0}; // 0: no input running

void write_artifact(const char* kind) {
  const std::string path = g_artifact_prefix + kind + "-" + hex(fnv1a(g_current));
  if (FILE* out = std::fopen(path.c_str(), "wb")) {
    if (!g_current.empty())
      std::fwrite(g_current.data(), 1, g_current.size(), out);
    std::fclose(out);
  }
  std::fprintf(stderr, "==%d== mutation driver: %s; input (%zu bytes) written to %s\n", getpid(), kind,
               g_current.size(), path.c_str());
}

void on_death() {
  write_artifact("crash");
}

void on_signal(int signal) { // abort() outside the sanitizers' reports (std::terminate, assert)
  write_artifact("crash");
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Runs one input; returns true when it reached an edge no earlier input did.
bool run_one(const std::vector<uint8_t>& input) {
  g_current = input;
  g_previous_block = 0;
  // A copy of exactly input.size() bytes, so ASan sees any read past the end.
  uint8_t* data = static_cast<uint8_t*>(std::malloc(std::max<size_t>(input.size(), 1)));
  if (!input.empty())
    std::memcpy(data, input.data(), input.size());
  g_collecting = true;
  g_started_ns.store(now_ns());
  try {
    LLVMFuzzerTestOneInput(data, input.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mutation driver: uncaught exception from the target: %s\n", e.what());
    write_artifact("crash");
    std::_Exit(1);
  } catch (...) {
    std::fprintf(stderr, "mutation driver: uncaught non-standard exception from the target\n");
    write_artifact("crash");
    std::_Exit(1);
  }
  g_started_ns.store(0);
  g_collecting = false;
  std::free(data);
  bool fresh = false;
  for (size_t i = 0; i < g_touched_count; ++i) {
    const uint32_t edge = g_touched[i];
    g_edges[edge] = 0;
    if (!g_seen[edge]) {
      g_seen[edge] = 1;
      fresh = true;
    }
  }
  g_touched_count = 0;
  return fresh;
}

// ---- mutations
// ---------------------------------------------------------------------------------------------

class Mutator {
public:
  Mutator(uint64_t seed, size_t max_len, std::vector<std::vector<uint8_t>> dictionary)
      : rng_(seed), max_len_(max_len), dictionary_(std::move(dictionary)) {}

  size_t below(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }

  std::vector<uint8_t> mutate(std::vector<uint8_t> data, const std::vector<std::vector<uint8_t>>& corpus) {
    const int count = 1 + static_cast<int>(below(4));
    for (int i = 0; i < count; ++i)
      mutate_once(data, corpus);
    if (data.size() > max_len_)
      data.resize(max_len_);
    return data;
  }

private:
  template <class T> void put(std::vector<uint8_t>& data, T value) {
    if (data.size() < sizeof(T))
      data.resize(sizeof(T));
    std::memcpy(data.data() + below(data.size() - sizeof(T) + 1), &value, sizeof(T));
  }

  void insert_word(std::vector<uint8_t>& data, const std::vector<uint8_t>& word) {
    const size_t at = below(data.size() + 1);
    if (below(2) == 0 || data.size() < word.size())
      data.insert(data.begin() + static_cast<std::ptrdiff_t>(at), word.begin(), word.end());
    else
      std::copy(word.begin(), word.end(),
                data.begin() + static_cast<std::ptrdiff_t>(below(data.size() - word.size() + 1)));
  }

  void mutate_once(std::vector<uint8_t>& data, const std::vector<std::vector<uint8_t>>& corpus) {
    static const int64_t kIntegers[] = {0,          1,
                                        -1,         2,
                                        3,          4,
                                        7,          8,
                                        16,         31,
                                        32,         33,
                                        63,         64,
                                        127,        128,
                                        255,        256,
                                        1024,       4096,
                                        32767,      32768,
                                        65535,      65536,
                                        0x7fffffff, -0x7fffffff - 1,
                                        0xffffffff, 0x100000000,
                                        INT64_MAX,  INT64_MIN};
    static const float kFloats[] = {0.0f,
                                    -0.0f,
                                    1.0f,
                                    -1.0f,
                                    0.5f,
                                    1e-45f,
                                    1e30f,
                                    -1e30f,
                                    3.4e38f,
                                    std::numeric_limits<float>::infinity(),
                                    -std::numeric_limits<float>::infinity(),
                                    std::numeric_limits<float>::quiet_NaN()};
    switch (below(12)) {
    case 0: // flip a bit
      if (!data.empty())
        data[below(data.size())] ^= static_cast<uint8_t>(1u << below(8));
      break;
    case 1: // a random byte
      if (!data.empty())
        data[below(data.size())] = static_cast<uint8_t>(below(256));
      break;
    case 2: // add or subtract a little
      if (!data.empty())
        data[below(data.size())] += static_cast<uint8_t>(below(35) - 17);
      break;
    case 3: { // an interesting integer, 1 / 2 / 4 / 8 bytes
      const int64_t value = kIntegers[below(std::size(kIntegers))];
      switch (below(4)) {
      case 0:
        put<uint8_t>(data, static_cast<uint8_t>(value));
        break;
      case 1:
        put<uint16_t>(data, static_cast<uint16_t>(value));
        break;
      case 2:
        put<uint32_t>(data, static_cast<uint32_t>(value));
        break;
      default:
        put<uint64_t>(data, static_cast<uint64_t>(value));
      }
      break;
    }
    case 4: // an interesting float
      put<float>(data, kFloats[below(std::size(kFloats))]);
      break;
    case 5: { // insert random bytes
      const size_t at = below(data.size() + 1), n = 1 + below(16);
      std::vector<uint8_t> bytes(n);
      for (uint8_t& b : bytes)
        b = static_cast<uint8_t>(below(256));
      data.insert(data.begin() + static_cast<std::ptrdiff_t>(at), bytes.begin(), bytes.end());
      break;
    }
    case 6: // erase a range
      if (data.size() > 1) {
        const size_t at = below(data.size()), n = 1 + below(std::min<size_t>(data.size() - at, 64));
        data.erase(data.begin() + static_cast<std::ptrdiff_t>(at),
                   data.begin() + static_cast<std::ptrdiff_t>(at + n));
      }
      break;
    case 7: // copy a chunk of the input over another place (or insert it)
      if (data.size() > 1) {
        const size_t from = below(data.size()), n = 1 + below(std::min<size_t>(data.size() - from, 64));
        const std::vector<uint8_t> chunk(data.begin() + static_cast<std::ptrdiff_t>(from),
                                         data.begin() + static_cast<std::ptrdiff_t>(from + n));
        insert_word(data, chunk);
      }
      break;
    case 8: // splice with another corpus entry
      if (!corpus.empty()) {
        const std::vector<uint8_t>& other = corpus[below(corpus.size())];
        const size_t keep = below(data.size() + 1), from = below(other.size() + 1);
        data.resize(keep);
        data.insert(data.end(), other.begin() + static_cast<std::ptrdiff_t>(from), other.end());
      }
      break;
    case 9: // a word of the dictionary file
      if (!dictionary_.empty())
        insert_word(data, dictionary_[below(dictionary_.size())]);
      break;
    case 10: // a constant the target compared against
      if (!g_compare_words.empty())
        insert_word(data, g_compare_words[below(g_compare_words.size())]);
      break;
    default: // shrink or truncate
      if (!data.empty())
        data.resize(below(data.size()));
      break;
    }
  }

  std::mt19937_64 rng_;
  size_t max_len_;
  std::vector<std::vector<uint8_t>> dictionary_;
};

} // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize)
    LLVMFuzzerInitialize(&argc, &argv);
  const Options options = parse(argc, argv);
  g_artifact_prefix = options.artifact_prefix;
  __sanitizer_set_death_callback(on_death);
  std::signal(SIGABRT, on_signal);

  // Watchdog: an input running past -timeout is reported as a hang.
  std::thread([timeout_ns = static_cast<int64_t>(options.timeout * 1e9)] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const int64_t started = g_started_ns.load();
      if (started != 0 && now_ns() - started > timeout_ns) {
        write_artifact("timeout");
        std::_Exit(70);
      }
    }
  }).detach();

  // Files: reproduce each once.
  std::vector<std::filesystem::path> directories;
  bool reproduced = false;
  for (const std::string& input : options.inputs) {
    if (std::filesystem::is_directory(input)) {
      directories.emplace_back(input);
    } else {
      std::fprintf(stderr, "mutation driver: running %s\n", input.c_str());
      run_one(read_file(input));
      reproduced = true;
    }
  }
  if (reproduced && directories.empty()) {
    std::fprintf(stderr, "mutation driver: every input ran without a crash\n");
    return 0;
  }

  // The corpus: every file of every directory, in a fixed order (sorted names) so runs are reproducible.
  std::vector<std::vector<uint8_t>> corpus;
  std::vector<std::filesystem::path> files;
  for (const auto& directory : directories)
    for (const auto& entry : std::filesystem::directory_iterator(directory))
      if (entry.is_regular_file())
        files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  const auto start = std::chrono::steady_clock::now();
  long executions = 0, added = 0;
  for (const auto& file : files) {
    std::vector<uint8_t> input = read_file(file);
    if (input.size() > options.max_len)
      input.resize(options.max_len);
    run_one(input);
    ++executions;
    corpus.push_back(std::move(input)); // every seed stays, new coverage or not
  }
  if (corpus.empty()) {
    run_one({});
    ++executions;
    corpus.emplace_back();
  }
  size_t covered = std::count(g_seen, g_seen + kMapSize, 1);
  std::fprintf(stderr, "#%ld INITED cov: %zu corp: %zu seed: %llu\n", executions, covered, corpus.size(),
               static_cast<unsigned long long>(options.seed));

  std::vector<std::vector<uint8_t>> dictionary;
  if (!options.dict.empty())
    dictionary = read_dictionary(options.dict);
  Mutator mutator(options.seed, options.max_len, std::move(dictionary));
  const double budget = options.max_total_time;
  double elapsed = 0.0;
  for (;;) {
    if (options.runs > 0 && executions >= options.runs)
      break;
    if (budget > 0.0 && (executions & 63) == 0) {
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (elapsed >= budget)
        break;
    }
    std::vector<uint8_t> input = mutator.mutate(corpus[mutator.below(corpus.size())], corpus);
    ++executions;
    if (run_one(input)) {
      ++added;
      if (!directories.empty()) { // like libFuzzer: new inputs go to the first corpus directory
        std::ofstream out(directories.front() / hex(fnv1a(input)), std::ios::binary);
        out.write(reinterpret_cast<const char*>(input.data()), static_cast<std::streamsize>(input.size()));
      }
      corpus.push_back(std::move(input));
    }
  }
  elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  covered = std::count(g_seen, g_seen + kMapSize, 1);
  std::fprintf(stderr, "#%ld DONE cov: %zu corp: %zu exec/s: %.0f\n", executions, covered, corpus.size(),
               executions / std::max(elapsed, 1e-9));
  std::fprintf(stderr, "Done %ld runs in %.0f second(s)\n", executions, elapsed);
  if (options.print_final_stats) {
    std::fprintf(stderr, "stat::number_of_executed_units: %ld\n", executions);
    std::fprintf(stderr, "stat::new_units_added: %ld\n", added);
    std::fprintf(stderr, "stat::edges_covered: %zu\n", covered);
  }
  return 0;
}
