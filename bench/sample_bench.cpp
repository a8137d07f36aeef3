// sample_bench: smcgraph::sample() on realistic logits, validated against the host reference's two-level
// Gumbel-max (tests/reference/sample_ref.cpp, compiled in), then timed as graph replays over rotating logits
// buffers (more bytes than 3x L2, so it measures HBM, not L2).
//
//   build-bench/bench/sample_bench [--csv results/sample_bench.csv] [--quick] [--shapes 1x49152:bf16,...]
//                                  [--peers] [--python python3]
//
// The graph column is a chain of launches, where programmatic dependent launch lets each one start while
// the one before finishes. A cycle runs each pass after a different kernel, so three more columns time the
// pass after a predecessor that does not let it start early (alone_us: an empty kernel; cold_us: a kernel
// that runs 256 KiB of other code, leaving the SM's instruction caches cold; coldL2_us: that kernel after
// reading 3x L2, so the pass's code and its small inputs also come from HBM), each as the time of a graph of
// (predecessor, pass) pairs minus the predecessors' own, per pair.
//
// Floors: bytes of logits read / copy bandwidth, where the copy bandwidth counts bytes read + written by a
// 1 GiB device-to-device copy (a read-only kernel at full DRAM throughput reaches fraction 1.0), and the
// per-node time of a chain of empty kernels (the floor of a launch that moves almost nothing).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "bench_util.hpp"
#include "cli.hpp"
#include "reference/sample_ref.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/philox.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/sample.hpp"
#include "smcgraph/types.hpp"

namespace {

using smcgraph::DType;
using smcgraph::bench::format;

constexpr float kTemperature = 0.7f;
constexpr int kMaxRows = 256;
constexpr int kMaxVocab = 151936;
constexpr int kMinLaunchesPerGraph = 20;
constexpr int kMaxLaunchesPerGraph = 4096;
constexpr int kValidatedRowsPerShape = 4;
constexpr int kPairedLaunches = 32; // (predecessor, pass) pairs in a graph of the alone / cold columns
constexpr int kPairedRepetitions = 20;
constexpr size_t kBufferAlignment = 256;
const uint32_t kStreamWord = smcgraph::philox_stream(smcgraph::Salt::kUser, 0);

struct Options {
  std::string csv_path = "results/sample_bench.csv";
  std::string python = "python3";
  std::string peer_script; // empty: look for bench/peers/sample_peer.py
  bool quick = false;
  bool peers = false;
  std::string shapes; // --shapes: replaces the sweep's list
};

struct Shape {
  int rows;
  int vocab;
  DType dtype;
  float alpha;
};

/// --shapes ROWSxVOCAB[:DTYPE[:ALPHA]],...: DTYPE fp32 or bf16 (default), ALPHA > 0 (default 1); the numbers
/// through examples/cli.hpp's parsers. Returns the shapes, or an empty list after printing what is wrong (an
/// empty item included).
std::vector<Shape> parse_shapes(const std::string& text) {
  using smcgraph::cli::UsageError;
  std::vector<Shape> shapes;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    try {
      std::stringstream fields(item);
      std::string size, dtype = "bf16", alpha = "1";
      std::getline(fields, size, ':');
      if (!fields.eof())
        std::getline(fields, dtype, ':');
      if (!fields.eof())
        std::getline(fields, alpha, ':');
      if (!fields.eof())
        throw UsageError{"more than three fields"};
      const size_t x = size.find('x');
      if (x == std::string::npos)
        throw UsageError{"no 'x' between ROWS and VOCAB"};
      if (dtype != "fp32" && dtype != "bf16")
        throw UsageError{"dtype '" + dtype + "'"};
      shapes.push_back(
          {smcgraph::cli::parse_integer("ROWS", size.substr(0, x), 1, kMaxRows),
           smcgraph::cli::parse_integer("VOCAB", size.substr(x + 1), 1, kMaxVocab),
           dtype == "fp32" ? DType::kFloat32 : DType::kBFloat16,
           smcgraph::cli::parse_float("ALPHA", alpha, 0.0f, true, std::numeric_limits<float>::max())});
    } catch (const UsageError& error) {
      std::fprintf(
          stderr,
          "sample_bench: --shapes item '%s' must be ROWSxVOCAB[:fp32|bf16[:ALPHA]] with 1 <= ROWS <= %d, "
          "1 <= VOCAB <= %d and ALPHA > 0 (%s)\n",
          item.c_str(), kMaxRows, kMaxVocab, error.message.c_str());
      return {};
    }
  }
  if (shapes.empty())
    std::fprintf(stderr, "sample_bench: --shapes names no shape\n");
  return shapes;
}

int64_t logits_bytes(const Shape& shape) {
  return static_cast<int64_t>(shape.rows) * shape.vocab * smcgraph::dtype_bytes(shape.dtype);
}
int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

/// Shapes of the sweep; the peer script (bench/peers/sample_peer.py) uses the same lists.
std::vector<Shape> make_shapes(bool quick) {
  const std::vector<int> rows_list = quick ? std::vector<int>{1, 64} : std::vector<int>{1, 8, 64, 256};
  const std::vector<int> vocab_list =
      quick ? std::vector<int>{128256} : std::vector<int>{32000, 128256, 151936};
  std::vector<Shape> shapes;
  for (const int vocab : vocab_list)
    for (const int rows : rows_list)
      for (const DType dtype : {DType::kFloat32, DType::kBFloat16})
        shapes.push_back({rows, vocab, dtype, 1.0f});
  shapes.push_back({64, 128256, DType::kBFloat16, 2.0f}); // the power-target path (alpha != 1)
  return shapes;
}

/// Rows rotate buffers so that the bytes between two reads of one buffer exceed `rotation_bytes`.
struct Rotation {
  int64_t pitch_bytes;
  int buffers;
  int launches_per_graph;
};
Rotation make_rotation(const Shape& shape, int64_t rotation_bytes) {
  const int64_t bytes = logits_bytes(shape);
  const int64_t wanted = std::max<int64_t>(2, (rotation_bytes + bytes - 1) / bytes);
  const int buffers = static_cast<int>(std::min<int64_t>(wanted, kMaxLaunchesPerGraph));
  return Rotation{round_up(bytes, kBufferAlignment), buffers, std::max(buffers, kMinLaunchesPerGraph)};
}

// ---------------------------------------------------------------------------------------------------------
// Host logits: per row, normal(0, sigma) with sigma in [2, 3] plus a few large positive outliers (the
// tokens a language model actually favours). Deterministic per (rows, vocab).

struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; } // (0, 1)
};

std::vector<float> make_host_logits(int rows, int vocab) {
  constexpr int kOutliers = 6;
  constexpr double kTwoPi = 6.283185307179586;
  std::vector<float> logits(static_cast<size_t>(rows) * vocab);
  SplitMix64 rng{0x5A3B1E0000000000ull ^ (static_cast<uint64_t>(rows) << 32) ^ static_cast<uint64_t>(vocab)};
  for (int r = 0; r < rows; ++r) {
    float* row = logits.data() + static_cast<size_t>(r) * vocab;
    const double sigma = 2.0 + rng.uniform();
    const double mean = -1.0 + 2.0 * rng.uniform();
    for (int v = 0; v < vocab; v += 2) { // Box-Muller: two normals per pair of uniforms
      const double radius = sigma * std::sqrt(-2.0 * std::log(rng.uniform()));
      const double angle = kTwoPi * rng.uniform();
      row[v] = static_cast<float>(mean + radius * std::cos(angle));
      if (v + 1 < vocab)
        row[v + 1] = static_cast<float>(mean + radius * std::sin(angle));
    }
    for (int k = 0; k < kOutliers; ++k) {
      const int v = static_cast<int>(rng.next() % static_cast<uint64_t>(vocab));
      row[v] = static_cast<float>(mean + 8.0 + 8.0 * rng.uniform()); // 8..16 above the mean
    }
  }
  return logits;
}

// ---------------------------------------------------------------------------------------------------------
// Validation

struct Outputs {
  smcgraph::DeviceBuffer<int32_t> tokens{kMaxRows};
  smcgraph::DeviceBuffer<float> logprobs{kMaxRows};
  smcgraph::DeviceBuffer<float> logz{kMaxRows};
  smcgraph::DeviceBuffer<uint32_t> row_flags{kMaxRows};
  smcgraph::DeviceBuffer<uint32_t> status{1};
  smcgraph::SampleOutputs view() {
    return {tokens.data(), logprobs.data(), logz.data(), row_flags.data(), status.data()};
  }
};

struct HostOutputs {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs, logz;
  std::vector<uint32_t> row_flags;
  uint32_t status = 0;
};

HostOutputs read_outputs(Outputs& outputs, int rows, cudaStream_t stream) {
  HostOutputs host;
  host.tokens.resize(rows);
  host.logprobs.resize(rows);
  host.logz.resize(rows);
  host.row_flags.resize(rows);
  outputs.tokens.copy_to_host(host.tokens.data(), rows, stream);
  outputs.logprobs.copy_to_host(host.logprobs.data(), rows, stream);
  outputs.logz.copy_to_host(host.logz.data(), rows, stream);
  outputs.row_flags.copy_to_host(host.row_flags.data(), rows, stream);
  outputs.status.copy_to_host(&host.status, 1, stream);
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

struct RowSetup {
  int particles_per_request;
  std::vector<uint64_t> seeds;         // [requests]
  std::vector<uint32_t> draw_counters; // [requests]
};

RowSetup make_row_setup(int rows) {
  RowSetup setup;
  setup.particles_per_request = rows % 4 == 0 ? 4 : 1; // exercise the particle field of the counter
  const int requests = rows / setup.particles_per_request;
  for (int i = 0; i < requests; ++i) {
    setup.seeds.push_back(0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1) + 0x1234567ull);
    setup.draw_counters.push_back(static_cast<uint32_t>(3 + 5 * i)); // non-zero: the counter word is used
  }
  return setup;
}

struct Validation {
  bool ok = true;
  int checked_rows = 0;
  int near_ties = 0;
  std::string message;
  void fail(const std::string& text) {
    if (ok)
      message = text;
    ok = false;
  }
};

/// The device's row against the host reference (tests/reference/sample_ref.hpp: the same two-level Gumbel-max
/// with the same Philox words, in double): the token, its log-prob under softmax(alpha l / T) and log Z.
void check_row_against_host(const float* row_logits, const Shape& shape, int row, const RowSetup& setup,
                            const HostOutputs& device, Validation& validation) {
  const int request = row / setup.particles_per_request;
  const uint32_t particle = static_cast<uint32_t>(row % setup.particles_per_request);
  const int token = device.tokens[row];
  const auto expected = smcgraph::reference::sample(
      row_logits, shape.vocab, smcgraph::sample_tile_length(shape.dtype), kTemperature, shape.alpha,
      setup.seeds[request], setup.draw_counters[request], particle, kStreamWord);
  ++validation.checked_rows;
  if (token != expected.token) {
    // The device works in fp32 with approximate exp2/log2: a gap this small between the reference's two best
    // scores, at the level where the device's token differs (its sub-tile, else its token), is a tie.
    const bool other_sub_tile = smcgraph::sample_subtile(token, shape.dtype) != expected.sub_tile;
    const double best = other_sub_tile ? expected.sub_tile_best_score : expected.best_score;
    const double gap = best - (other_sub_tile ? expected.sub_tile_runner_up_score : expected.runner_up_score);
    if (expected.near_tie() || gap <= 1e-3 + 1e-5 * std::abs(best)) {
      ++validation.near_ties;
    } else {
      validation.fail("row " + std::to_string(row) + ": token " + std::to_string(token) +
                      " but host two-level argmax " + std::to_string(expected.token) + " (score gap " +
                      format(gap, 6) + ")");
      return;
    }
  }
  // log softmax(alpha l / T) of the device's token: T / alpha as the reference's temperature.
  uint32_t flags = 0;
  const double logprob_ref =
      smcgraph::reference::token_logprob(row_logits, shape.vocab, kTemperature / shape.alpha, token, &flags);
  if (flags != 0 || std::abs(device.logprobs[row] - logprob_ref) > 2e-3 + 1e-4 * std::abs(logprob_ref)) {
    validation.fail("row " + std::to_string(row) + ": logprob " + format(device.logprobs[row], 6) +
                    " vs host " + format(logprob_ref, 6));
  }
  if (std::abs(device.logz[row] - expected.logz) > 2e-3 + 1e-4 * std::abs(expected.logz)) {
    validation.fail("row " + std::to_string(row) + ": logz " + format(device.logz[row], 6) + " vs host " +
                    format(expected.logz, 6));
  }
}

Validation validate(const Shape& shape, const HostOutputs& device, const std::vector<float>& host_logits,
                    const RowSetup& setup) {
  Validation validation;
  if (device.status != 0)
    validation.fail("status word " + smcgraph::describe_flags(device.status));
  for (int r = 0; r < shape.rows; ++r) {
    const std::string where = "row " + std::to_string(r) + ": ";
    if (device.row_flags[r] != 0)
      validation.fail(where + "flags " + smcgraph::describe_flags(device.row_flags[r]));
    if (device.tokens[r] < 0 || device.tokens[r] >= shape.vocab)
      validation.fail(where + "token " + std::to_string(device.tokens[r]) + " out of range");
    if (!std::isfinite(device.logprobs[r]) || device.logprobs[r] > 0.0f)
      validation.fail(where + "logprob " + format(device.logprobs[r], 6) + " not finite and <= 0");
    // log Z = log sum_v p_v^alpha: 0 at alpha 1, <= 0 above it, >= 0 below it (p^alpha vs p for p <= 1).
    const float logz = device.logz[r];
    const bool logz_ok = shape.alpha == 1.0f    ? logz == 0.0f
                         : !std::isfinite(logz) ? false
                         : shape.alpha > 1.0f   ? logz <= 1e-5f
                                                : logz >= -1e-5f;
    if (!logz_ok)
      validation.fail(where + "logz " + format(logz, 6) + " (want 0 at alpha 1, <= 0 above it, >= 0 below)");
  }
  if (!validation.ok)
    return validation;
  std::vector<int> rows = {0, shape.rows / 3, shape.rows / 2, shape.rows - 1};
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  if (static_cast<int>(rows.size()) > kValidatedRowsPerShape)
    rows.resize(kValidatedRowsPerShape);
  for (const int r : rows) {
    check_row_against_host(host_logits.data() + static_cast<size_t>(r) * shape.vocab, shape, r, setup, device,
                           validation);
    if (!validation.ok)
      break;
  }
  return validation;
}

/// A graph replay must reproduce the eager outputs bit for bit (DESIGN.md §5): same logits, same counters.
void compare_with_eager(const HostOutputs& eager, const HostOutputs& graph, int rows,
                        Validation& validation) {
  if (graph.status != 0)
    validation.fail("graph replay: status word " + smcgraph::describe_flags(graph.status));
  for (int r = 0; r < rows && validation.ok; ++r) {
    if (graph.tokens[r] != eager.tokens[r] ||
        std::memcmp(&graph.logprobs[r], &eager.logprobs[r], sizeof(float)) != 0 ||
        std::memcmp(&graph.logz[r], &eager.logz[r], sizeof(float)) != 0) {
      validation.fail("graph replay differs from eager at row " + std::to_string(r) + ": token " +
                      std::to_string(graph.tokens[r]) + " vs " + std::to_string(eager.tokens[r]) +
                      ", logprob " + format(graph.logprobs[r], 7) + " vs " + format(eager.logprobs[r], 7));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Peers

struct Result {
  Shape shape;
  bool valid;
  double graph_median_us;
};

/// (rows, vocab, dtype) -> [(method, median_us)] from the peer CSV (columns
/// method,rows,vocab,dtype,median_us,gbs).
using PeerTable = std::map<std::tuple<int, int, std::string>, std::vector<std::pair<std::string, double>>>;

PeerTable read_peer_csv(const std::string& path) {
  PeerTable table;
  std::ifstream in(path);
  if (!in)
    return table;
  std::string line;
  std::vector<std::string> header;
  const auto split = [](const std::string& text) {
    std::vector<std::string> cells;
    std::stringstream stream(text);
    std::string cell;
    while (std::getline(stream, cell, ','))
      cells.push_back(cell);
    return cells;
  };
  if (!std::getline(in, line))
    return table;
  header = split(line);
  const auto column = [&](const char* name) {
    const auto it = std::find(header.begin(), header.end(), name);
    return it == header.end() ? -1 : static_cast<int>(it - header.begin());
  };
  const int method = column("method"), rows = column("rows"), vocab = column("vocab"),
            dtype = column("dtype"), median = column("median_us");
  if (method < 0 || rows < 0 || vocab < 0 || dtype < 0 || median < 0)
    return table;
  const int needed = std::max({method, rows, vocab, dtype, median}) + 1;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    const std::vector<std::string> cells = split(line);
    if (static_cast<int>(cells.size()) < needed)
      continue;
    try {
      table[{std::stoi(cells[rows]), std::stoi(cells[vocab]), cells[dtype]}].emplace_back(
          cells[method], std::stod(cells[median]));
    } catch (const std::exception&) {
      continue; // a malformed line; skip it
    }
  }
  return table;
}

void run_peers(const Options& options, const char* argv0, const std::vector<Result>& results) {
  const std::string script = smcgraph::bench::find_peer_script(options.peer_script, "sample_peer.py", argv0);
  if (script.empty()) {
    std::printf(
        "\npeers: skipped (bench/peers/sample_peer.py not found; run from the repository root or pass "
        "--peer-script)\n");
    return;
  }
  const std::string probe =
      options.python + " -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'";
  if (smcgraph::bench::run_command(probe + " >/dev/null 2>&1") != 0) {
    std::printf("\npeers: skipped (%s with a CUDA-enabled torch is not available)\n", options.python.c_str());
    return;
  }
  const std::filesystem::path csv_dir = std::filesystem::path(options.csv_path).parent_path();
  const std::string peer_csv = (csv_dir / "sample_peer.csv").string();
  std::printf("\npeers: %s %s --csv %s%s\n", options.python.c_str(), script.c_str(), peer_csv.c_str(),
              options.quick ? " --quick" : "");
  const int status = smcgraph::bench::run_command(
      options.python + " " + smcgraph::bench::shell_quote(script) + " --csv " +
      smcgraph::bench::shell_quote(peer_csv) + (options.quick ? " --quick" : ""));
  if (status != 0)
    std::printf("peers: the peer script exited with status %d; comparing what it wrote\n", status);
  const PeerTable peers = read_peer_csv(peer_csv);
  if (peers.empty()) {
    std::printf("peers: no rows in %s\n", peer_csv.c_str());
    return;
  }
  std::printf(
      "\nsmcgraph (graph replay, per launch) vs peers measured in this run; ratio = peer time / smcgraph "
      "time (> 1: smcgraph faster)\n");
  std::printf("%5s %7s %5s %11s  %-34s %11s %8s\n", "rows", "vocab", "dtype", "smcgraph_us", "peer",
              "peer_us", "ratio");
  for (const Result& result : results) {
    if (result.shape.alpha != 1.0f || !result.valid)
      continue; // the peers sample at alpha = 1 only
    const auto it =
        peers.find({result.shape.rows, result.shape.vocab, smcgraph::dtype_name(result.shape.dtype)});
    if (it == peers.end())
      continue;
    for (const auto& [method, peer_us] : it->second) {
      std::printf("%5d %7d %5s %11s  %-34s %11s %7sx\n", result.shape.rows, result.shape.vocab,
                  smcgraph::dtype_name(result.shape.dtype), format(result.graph_median_us, 2).c_str(),
                  method.c_str(), format(peer_us, 2).c_str(),
                  format(peer_us / result.graph_median_us, 2).c_str());
    }
  }
}

// ---------------------------------------------------------------------------------------------------------

void print_usage() {
  std::printf(
      "usage: sample_bench [--csv PATH] [--quick] [--shapes LIST] [--peers] [--python PYTHON] [--peer-script "
      "PATH]\n"
      "                    [--help]\n"
      "  --csv PATH          CSV output (default results/sample_bench.csv; parent directories are created)\n"
      "  --quick             rows {1, 64} x vocab {128256} x {fp32, bf16} (+ the alpha = 2 shape)\n"
      "  --shapes LIST       only these shapes: ROWSxVOCAB[:fp32|bf16[:ALPHA]], comma-separated\n"
      "                      (e.g. 1x49152:bf16,8x49152:bf16; rows <= 256, vocab <= 151936; not with "
      "--peers)\n"
      "  --peers             afterwards run bench/peers/sample_peer.py (PyTorch / torch.compile / "
      "FlashInfer)\n"
      "                      into <csv dir>/sample_peer.csv and print smcgraph's ratio to each peer\n"
      "  --python PYTHON     interpreter for --peers (default python3)\n"
      "  --peer-script PATH  peer script for --peers (default: found from the cwd or the executable)\n");
}

/// Returns -1 to go on, else the exit status.
int parse_options(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "sample_bench: %s needs a value\n", flag);
        return nullptr;
      }
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      print_usage();
      return 0;
    } else if (arg == "--quick") {
      options.quick = true;
    } else if (arg == "--peers") {
      options.peers = true;
    } else if (arg == "--csv" || arg == "--python" || arg == "--peer-script" || arg == "--shapes") {
      const char* text = value(arg.c_str());
      if (!text)
        return 2;
      (arg == "--csv"      ? options.csv_path
       : arg == "--python" ? options.python
       : arg == "--shapes" ? options.shapes
                           : options.peer_script) = text;
    } else {
      std::fprintf(stderr, "sample_bench: unknown argument '%s'\n", arg.c_str());
      print_usage();
      return 2;
    }
  }
  if (!options.shapes.empty()) {
    if (options.quick || options.peers) {
      std::fprintf(stderr, "sample_bench: --shapes replaces the sweep's shapes: not with --%s\n",
                   options.quick ? "quick" : "peers");
      return 2;
    }
    if (parse_shapes(options.shapes).empty())
      return 2;
  }
  return -1;
}

int run(const Options& options, const char* argv0) {
  if (!smcgraph::bench::have_cuda_device("sample_bench"))
    return 2;
  smcgraph::Stream stream;
  const int l2_bytes = smcgraph::bench::l2_cache_bytes();
  const int64_t rotation_bytes = smcgraph::bench::l2_rotation_bytes();

  const double copy_gbs = smcgraph::bench::measure_copy_bandwidth_gbs(stream);
  double node_us = NAN; // the launch floor is informative; a bench without it still measures bandwidth
  try {
    node_us = smcgraph::bench::node_floor_us(stream);
  } catch (const smcgraph::Error& error) {
    std::printf("node floor unavailable: %s\n", error.what());
  }
  const std::string device_name = smcgraph::bench::device_name();
  std::printf("smcgraph sample_bench on %s: copy %s GB/s (read + write), node floor %s us, L2 %s MB, "
              "rotating > %s MB of logits per shape, T = %.2f\n",
              device_name.c_str(), format(copy_gbs, 0).c_str(), format(node_us, 2).c_str(),
              format(l2_bytes / 1e6, 1).c_str(), format(rotation_bytes / 1e6, 0).c_str(), kTemperature);
  std::printf("GB/s = logits bytes read / graph time; of_copy = that / copy GB/s; floor = max(bytes / copy "
              "bandwidth, node floor)\n\n");

  const std::vector<Shape> shapes =
      options.shapes.empty() ? make_shapes(options.quick) : parse_shapes(options.shapes);
  int64_t arena_bytes = 0;
  for (const Shape& shape : shapes) {
    const Rotation rotation = make_rotation(shape, rotation_bytes);
    arena_bytes = std::max(arena_bytes, rotation.pitch_bytes * rotation.buffers);
  }

  smcgraph::bench::Csv csv(options.csv_path);
  csv.row({"device",
           "rows",
           "vocab",
           "dtype",
           "alpha",
           "temperature",
           "logits_bytes",
           "buffers",
           "launches_per_graph",
           "graph_median_us",
           "graph_min_us",
           "graph_p90_us",
           "eager_median_us",
           "alone_median_us",
           "cold_median_us",
           "cold_l2_median_us",
           "gbs",
           "copy_gbs",
           "fraction_of_copy",
           "node_floor_us",
           "floor_us",
           "fraction_of_floor",
           "valid",
           "near_ties"});
  std::printf("%5s %7s %5s %5s %6s %9s %9s %9s %9s %9s %9s %8s %8s %9s %8s  %s\n", "rows", "vocab", "dtype",
              "alpha", "launch", "graph_us", "p90_us", "eager_us", "alone_us", "cold_us", "coldL2_us", "GB/s",
              "of_copy", "floor_us", "of_floor", "check");

  std::vector<Result> results;
  bool all_valid = true;
  {
    smcgraph::DeviceBuffer<unsigned char> d_arena(static_cast<size_t>(arena_bytes));
    smcgraph::SampleWorkspace workspace(kMaxRows, kMaxVocab);
    Outputs outputs;
    smcgraph::DeviceBuffer<float> d_temperature(kMaxRows), d_alpha(kMaxRows);
    smcgraph::DeviceBuffer<uint64_t> d_seeds(kMaxRows);
    smcgraph::DeviceBuffer<uint32_t> d_draw_counters(kMaxRows);
    // The workspace zeroes its tickets with cudaMemset on the legacy default stream, which a non-blocking
    // stream does not wait for: finish it before the first launch.
    SMCGRAPH_CUDA_CHECK(cudaDeviceSynchronize());
    // The predecessors of the alone / cold columns, launched once outside any capture (lazy loading).
    smcgraph::bench::launch_empty_kernel(stream);
    smcgraph::bench::launch_cold_kernel(stream, true);
    SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));

    std::vector<float> host_logits; // fp32 as generated; reused across the dtypes of one (rows, vocab)
    int host_rows = 0, host_vocab = 0;
    for (const Shape& shape : shapes) {
      smcgraph::NvtxRange range("sample_bench shape");
      const Rotation rotation = make_rotation(shape, rotation_bytes);
      const int64_t bytes = logits_bytes(shape);
      if (host_rows != shape.rows || host_vocab != shape.vocab) {
        host_logits = make_host_logits(shape.rows, shape.vocab);
        host_rows = shape.rows;
        host_vocab = shape.vocab;
      }
      // What the device sees (bf16-rounded where the dtype is bf16), for the host reference.
      std::vector<float> seen_logits = host_logits;
      if (shape.dtype == DType::kBFloat16) {
        std::vector<uint16_t> bf16(host_logits.size());
        for (size_t i = 0; i < bf16.size(); ++i) {
          bf16[i] = smcgraph::bench::float_to_bf16(host_logits[i]);
          seen_logits[i] = smcgraph::bench::bf16_to_float(bf16[i]);
        }
        SMCGRAPH_CUDA_CHECK(
            cudaMemcpyAsync(d_arena.data(), bf16.data(), bytes, cudaMemcpyHostToDevice, stream));
        SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream)); // the host vector must outlive the copy
      } else {
        SMCGRAPH_CUDA_CHECK(
            cudaMemcpyAsync(d_arena.data(), host_logits.data(), bytes, cudaMemcpyHostToDevice, stream));
        SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream)); // the host vector must outlive the copy
      }
      for (int b = 1; b < rotation.buffers; ++b) { // every buffer holds the same logits, so outputs agree
        SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(d_arena.data() + b * rotation.pitch_bytes, d_arena.data(), bytes,
                                            cudaMemcpyDeviceToDevice, stream));
      }

      const RowSetup setup = make_row_setup(shape.rows);
      const std::vector<float> temperature(shape.rows, kTemperature), alpha(shape.rows, shape.alpha);
      d_temperature.copy_from_host(temperature.data(), shape.rows, stream);
      d_alpha.copy_from_host(alpha.data(), shape.rows, stream);
      d_seeds.copy_from_host(setup.seeds.data(), setup.seeds.size(), stream);
      d_draw_counters.copy_from_host(setup.draw_counters.data(), setup.draw_counters.size(), stream);

      smcgraph::LogitsView logits{d_arena.data(), shape.dtype, shape.rows, 1,
                                  shape.vocab,    shape.vocab, shape.vocab};
      const smcgraph::RowParams params{d_temperature.data(), d_alpha.data()};
      const smcgraph::RowRandom random{d_seeds.data(), d_draw_counters.data(), setup.particles_per_request};
      const smcgraph::SampleOutputs out = outputs.view();

      // Validate: poisoned outputs (tokens -1, logprob / logz NaN), cleared flags and status, one eager
      // launch.
      outputs.tokens.fill_bytes(0xff, stream);
      outputs.logprobs.fill_bytes(0xff, stream);
      outputs.logz.fill_bytes(0xff, stream);
      outputs.row_flags.fill_bytes(0, stream);
      outputs.status.fill_bytes(0, stream);
      smcgraph::sample(logits, params, random, kStreamWord, out, workspace, stream);
      const HostOutputs eager = read_outputs(outputs, shape.rows, stream);
      Validation validation = validate(shape, eager, seen_logits, setup);

      smcgraph::bench::Timing graph{NAN, NAN, NAN}, eager_timing{NAN, NAN, NAN};
      double alone_us = NAN, cold_us = NAN, cold_l2_us = NAN;
      if (validation.ok) {
        int next_buffer = 0;
        const auto work = [&](cudaStream_t s) {
          logits.data = d_arena.data() + (next_buffer++ % rotation.buffers) * rotation.pitch_bytes;
          smcgraph::sample(logits, params, random, kStreamWord, out, workspace, s);
        };
        graph = smcgraph::bench::time_graph(work, stream, rotation.launches_per_graph);
        compare_with_eager(eager, read_outputs(outputs, shape.rows, stream), shape.rows, validation);
        eager_timing = smcgraph::bench::time_eager(work, stream);
        // A pass after `before`, which does not let it start early: pairs minus the predecessors alone.
        const auto after = [&](const std::function<void(cudaStream_t)>& before) {
          const int pairs = std::min(rotation.launches_per_graph, kPairedLaunches);
          const auto pair = [&](cudaStream_t s) {
            before(s);
            work(s);
          };
          return smcgraph::bench::time_graph(pair, stream, pairs, kPairedRepetitions).median_us -
                 smcgraph::bench::time_graph(before, stream, pairs, kPairedRepetitions).median_us;
        };
        alone_us = after([](cudaStream_t s) { smcgraph::bench::launch_empty_kernel(s); });
        cold_us = after([](cudaStream_t s) { smcgraph::bench::launch_cold_kernel(s, false); });
        cold_l2_us = after([](cudaStream_t s) { smcgraph::bench::launch_cold_kernel(s, true); });
      }
      all_valid = all_valid && validation.ok;

      const double gbs = static_cast<double>(bytes) / (graph.median_us * 1e3);
      const double bandwidth_floor_us = static_cast<double>(bytes) / (copy_gbs * 1e3);
      const double floor_us =
          std::isnan(node_us) ? bandwidth_floor_us : std::max(bandwidth_floor_us, node_us);
      const std::string check =
          validation.ok
              ? "ok" + (validation.near_ties ? " (" + std::to_string(validation.near_ties) + " near-tie)"
                                             : std::string())
              : "FAIL: " + validation.message;
      std::printf("%5d %7d %5s %5s %6d %9s %9s %9s %9s %9s %9s %8s %8s %9s %8s  %s\n", shape.rows,
                  shape.vocab, smcgraph::dtype_name(shape.dtype), format(shape.alpha, 1).c_str(),
                  rotation.launches_per_graph, format(graph.median_us, 2).c_str(),
                  format(graph.p90_us, 2).c_str(), format(eager_timing.median_us, 2).c_str(),
                  format(alone_us, 2).c_str(), format(cold_us, 2).c_str(), format(cold_l2_us, 2).c_str(),
                  format(gbs, 0).c_str(), format(gbs / copy_gbs, 3).c_str(), format(floor_us, 2).c_str(),
                  format(floor_us / graph.median_us, 3).c_str(), check.c_str());
      std::fflush(stdout);
      csv.row({device_name,
               std::to_string(shape.rows),
               std::to_string(shape.vocab),
               smcgraph::dtype_name(shape.dtype),
               format(shape.alpha, 2),
               format(kTemperature, 2),
               std::to_string(bytes),
               std::to_string(rotation.buffers),
               std::to_string(rotation.launches_per_graph),
               format(graph.median_us, 3),
               format(graph.min_us, 3),
               format(graph.p90_us, 3),
               format(eager_timing.median_us, 3),
               format(alone_us, 3),
               format(cold_us, 3),
               format(cold_l2_us, 3),
               format(gbs, 1),
               format(copy_gbs, 1),
               format(gbs / copy_gbs, 4),
               format(node_us, 3),
               format(floor_us, 3),
               format(floor_us / graph.median_us, 4),
               validation.ok ? "1" : "0",
               std::to_string(validation.near_ties)});
      results.push_back({shape, validation.ok, graph.median_us});
    }
  } // device buffers freed before the peers run in their own process

  std::printf("\nCSV: %s\n", options.csv_path.c_str());
  if (options.peers)
    run_peers(options, argv0, results);
  if (!all_valid) {
    std::printf("\nVALIDATION FAILED for at least one shape (see the check column; a shape that fails before "
                "timing is not timed)\n");
    return 1;
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  Options options;
  const int parsed = parse_options(argc, argv, options);
  if (parsed >= 0)
    return parsed;
  try {
    return run(options, argv[0]);
  } catch (const std::exception& error) {
    std::fflush(stdout);
    std::fprintf(stderr, "sample_bench: %s\n", error.what());
    return 2;
  }
}
