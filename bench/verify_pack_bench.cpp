// verify_pack_bench: smcgraph::verify_and_pack() on seed 000's configurations (fp16 payload), validated
// against the host reference, then timed as graph replays (and eagerly) over rotating payload buffers (more
// bytes than 3x L2 where memory allows, so large configurations measure HBM, not L2).
//
// Methods: smcgraph_fused_graph marks the payload ready before the launch's PDL wait
// (PayloadView::ready_before_wait: in a speculative cycle the draft's KV is written by the draft forward,
// kernels before the verify), so small launches preload it (pack_preloads; "pre" in the grid column);
// "src" there marks a launch that copies in source order (pack_source_order);
// smcgraph_fused_graph_late leaves it unmarked (as if the previous kernel wrote the payload). Every launch
// passes the configuration's acceptance alpha as PayloadView::expected_packed_fraction (what an engine knows
// from its running acceptance rate), so large marked launches of alpha >= 0.7 copy in source order
// (SMCGRAPH_PACK_ORDER=packed turns that off for A/B runs);
// smcgraph_fused_eager is the marked launch outside a graph; cuda_memcpy_same_bytes is one cudaMemcpyAsync of
// the packed bytes in the same graph chain (no verify, no scan): what a copy of that size reaches.
//
//   build/bench/verify_pack_bench [results/verify_pack.csv] [--peer-csv results/verify_pack_peer.csv]
//                                 [--only 32:128:0.9:2048]
//
// --only rows:draft_steps:alpha:kv_dim runs that configuration alone (repeatable), e.g. under ncu. A value
// that is malformed or names none of the configurations, a flag without its value and an unknown flag are
// refused with exit status 2 before any CUDA call (tests/tools/test_verify_pack_bench_options.sh).
//
// Floors: bytes moved (payload read + written, tokens read, per-row outputs written) / the device-to-device
// copy bandwidth (read + written), and the per-node time of a chain of empty kernels for the small ones.
// The peer (bench/peers/verify_pack_peer.py: seed 000's two-step PyTorch pipeline) writes rows in the same
// CSV format; with --peer-csv the ratio peer time / smcgraph time is printed per configuration.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "bench_util.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/types.hpp"
#include "smcgraph/verify.hpp"

// The bench links no test library: it compiles the host reference in to validate before timing.
#include "../tests/reference/verify_ref.cpp"

namespace {

using smcgraph::DType;
using smcgraph::bench::format;

constexpr int kVocab = 4096;        // seed 000's vocabulary
constexpr uint64_t kOracleSeed = 7; // seed 000's global seed
constexpr int kMaxRotation = 512;   // payload sets a graph rotates over
constexpr int kMinLaunchesPerGraph = 20;
constexpr DType kPayloadDType = DType::kFloat16;

struct Config {
  int rows, draft_steps;
  double alpha;
  int kv_dim;
};

/// Seed 000's table (section 5.5) plus its stress grid and a large batch.
std::vector<Config> make_configs() {
  std::vector<Config> configs = {{4, 8, 0.3, 128}, {4, 8, 0.9, 2048}, {32, 8, 0.3, 128}, {32, 8, 0.9, 2048}};
  for (double alpha : {0.3, 0.9})
    for (int kv_dim : {128, 512, 1024, 2048})
      configs.push_back({32, 128, alpha, kv_dim});
  configs.push_back({256, 8, 0.6, 1024});
  return configs;
}

/// "rows:draft_steps:alpha:kv_dim" with alpha at two decimals (--only's match).
std::string config_key(const Config& config) {
  return std::to_string(config.rows) + ":" + std::to_string(config.draft_steps) + ":" +
         format(config.alpha, 2) + ":" + std::to_string(config.kv_dim);
}

/// Payload, packed output and packed tokens of one rotation slot.
struct Slot {
  smcgraph::DeviceBuffer<uint8_t> payload, packed;
  smcgraph::DeviceBuffer<int32_t> tokens;
};

struct Row {
  std::string method;
  Config config;
  int packed_rows;
  smcgraph::bench::Timing timing;
  double bytes;
};

std::vector<std::string> csv_cells(const Row& row, double copy_gbs, const std::string& device) {
  const double gbs = row.bytes / (row.timing.median_us * 1e3);
  return {row.method,
          std::to_string(row.config.rows),
          std::to_string(row.config.draft_steps),
          format(row.config.alpha, 2),
          std::to_string(row.config.kv_dim),
          smcgraph::dtype_name(kPayloadDType),
          std::to_string(row.packed_rows),
          format(row.timing.median_us, 3),
          format(row.timing.min_us, 3),
          format(row.timing.p90_us, 3),
          format(gbs, 1),
          format(gbs / copy_gbs, 3),
          device};
}

/// (rows, draft_steps, alpha, kv_dim) -> [(method, median_us)] from a peer CSV in this bench's format.
using PeerTable =
    std::map<std::tuple<int, int, std::string, int>, std::vector<std::pair<std::string, double>>>;

PeerTable read_peer_csv(const std::string& path) {
  PeerTable table;
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line))
    return table;
  const auto split = [](const std::string& text) {
    std::vector<std::string> cells;
    std::stringstream stream(text);
    std::string cell;
    while (std::getline(stream, cell, ','))
      cells.push_back(cell);
    return cells;
  };
  const std::vector<std::string> header = split(line);
  const auto column = [&](const char* name) {
    const auto it = std::find(header.begin(), header.end(), name);
    return it == header.end() ? -1 : static_cast<int>(it - header.begin());
  };
  const int method = column("method"), rows = column("rows"), draft_steps = column("draft_steps"),
            alpha = column("alpha"), kv_dim = column("kv_dim"), median = column("median_us");
  if (std::min({method, rows, draft_steps, alpha, kv_dim, median}) < 0)
    return table;
  while (std::getline(in, line)) {
    const std::vector<std::string> cells = split(line);
    if (static_cast<int>(cells.size()) < static_cast<int>(header.size()))
      continue;
    const auto key = std::make_tuple(std::stoi(cells[rows]), std::stoi(cells[draft_steps]),
                                     format(std::stod(cells[alpha]), 2), std::stoi(cells[kv_dim]));
    table[key].emplace_back(cells[method], std::stod(cells[median]));
  }
  return table;
}

/// Runs one configuration: validation against the reference, then graph and eager timings.
std::vector<Row> run_config(const Config& config, smcgraph::Stream& stream,
                            smcgraph::PackWorkspace& workspace, int64_t rotation_bytes,
                            std::string* failure) {
  const int rows = config.rows, draft_steps = config.draft_steps;
  std::mt19937_64 engine(kOracleSeed);
  const auto batch = smcgraph::reference::make_oracle_batch(engine, rows, draft_steps, kVocab, config.alpha);
  const int64_t position_bytes = int64_t{config.kv_dim} * smcgraph::dtype_bytes(kPayloadDType);
  const int64_t payload_bytes = int64_t{rows} * draft_steps * position_bytes;
  std::vector<uint8_t> payload(payload_bytes);
  for (size_t i = 0; i < payload.size(); i += 8) {
    const uint64_t bits = engine();
    std::memcpy(payload.data() + i, &bits, std::min<size_t>(8, payload.size() - i));
  }

  smcgraph::DeviceBuffer<int32_t> draft(batch.draft.size()), target(batch.target.size());
  draft.copy_from_host(batch.draft.data(), batch.draft.size(), stream);
  target.copy_from_host(batch.target.data(), batch.target.size(), stream);
  smcgraph::DeviceBuffer<int32_t> accepted(rows), next_tokens(rows), offsets(rows), total(1);
  smcgraph::DeviceBuffer<uint8_t> mismatch(rows);
  const int slots = static_cast<int>(
      std::clamp<int64_t>((rotation_bytes + 2 * payload_bytes - 1) / (2 * payload_bytes), 1, kMaxRotation));
  std::vector<Slot> rotation(slots);
  for (Slot& slot : rotation) {
    slot.payload = smcgraph::DeviceBuffer<uint8_t>(payload_bytes);
    slot.payload.copy_from_host(payload.data(), payload.size(), stream);
    slot.packed = smcgraph::DeviceBuffer<uint8_t>(payload_bytes);
    slot.tokens = smcgraph::DeviceBuffer<int32_t>(static_cast<size_t>(rows) * draft_steps);
  }
  int next_slot = 0;
  bool ready = true; // PayloadView::ready_before_wait of the launches
  const smcgraph::TokenVerifyInputs inputs{draft.data(), draft_steps, target.data(), draft_steps + 1,
                                           rows,         draft_steps, kVocab};
  const smcgraph::VerifyOutputs verdict{accepted.data(), next_tokens.data(), mismatch.data()};
  const auto launch = [&](cudaStream_t s) {
    Slot& slot = rotation[next_slot++ % slots];
    smcgraph::verify_and_pack(
        inputs,
        {slot.payload.data(), kPayloadDType, config.kv_dim, int64_t{draft_steps} * config.kv_dim, ready,
         static_cast<float>(config.alpha)},
        false, verdict,
        {slot.packed.data(), int64_t{rows} * draft_steps, offsets.data(), total.data(), slot.tokens.data()},
        workspace, s);
  };

  // Validate (eagerly, slot 0, with the payload marked ready and not) before timing.
  const auto expected_verdict = smcgraph::reference::verify_greedy(
      batch.draft.data(), draft_steps, batch.target.data(), draft_steps + 1, rows, draft_steps, kVocab);
  const auto expected = smcgraph::reference::pack(
      expected_verdict.accepted.data(), expected_verdict.next_tokens.data(), batch.draft.data(), draft_steps,
      payload.data(), int64_t{draft_steps} * config.kv_dim, rows, draft_steps, config.kv_dim,
      smcgraph::dtype_bytes(kPayloadDType), false);
  if (expected_verdict.accepted != batch.accepted) {
    *failure = "the reference disagrees with the oracle";
    return {};
  }
  int32_t h_total = -1;
  for (const bool marked : {false, true}) {
    ready = marked;
    rotation[0].packed.fill_bytes(0xff, stream);
    rotation[0].tokens.fill_bytes(0xff, stream);
    for (auto* buffer : {&accepted, &next_tokens, &offsets, &total})
      buffer->fill_bytes(0xff, stream);
    mismatch.fill_bytes(0xff, stream);
    next_slot = 0;
    launch(stream);
    std::vector<int32_t> h_accepted(rows), h_next(rows), h_offsets(rows),
        h_tokens(static_cast<size_t>(rows) * draft_steps);
    std::vector<uint8_t> h_mismatch(rows), h_packed(payload_bytes);
    accepted.copy_to_host(h_accepted.data(), rows, stream);
    next_tokens.copy_to_host(h_next.data(), rows, stream);
    mismatch.copy_to_host(h_mismatch.data(), rows, stream);
    offsets.copy_to_host(h_offsets.data(), rows, stream);
    total.copy_to_host(&h_total, 1, stream);
    rotation[0].packed.copy_to_host(h_packed.data(), h_packed.size(), stream);
    rotation[0].tokens.copy_to_host(h_tokens.data(), h_tokens.size(), stream);
    stream.synchronize();
    if (h_accepted != expected_verdict.accepted)
      *failure = "accepted lengths differ from the reference";
    else if (h_next != expected_verdict.next_tokens)
      *failure = "next tokens differ from the reference";
    else if (h_mismatch != expected_verdict.mismatch)
      *failure = "mismatch flags differ from the reference";
    else if (h_offsets != expected.offsets)
      *failure = "offsets differ from the reference";
    else if (h_total != expected.total)
      *failure = "total differs from the reference";
    else if (std::memcmp(h_packed.data(), expected.bytes.data(), expected.bytes.size()) != 0)
      *failure = "packed payload differs from the reference";
    else if (!std::equal(expected.tokens.begin(), expected.tokens.end(), h_tokens.begin()))
      *failure = "packed tokens differ from the reference";
    if (!failure->empty()) {
      *failure += marked ? " (payload marked ready before the wait)" : " (payload not marked)";
      return {};
    }
  }

  // Bytes a launch must move: the packed payload read and written, the tokens read, the outputs written.
  const double bytes = 2.0 * h_total * position_bytes + 4.0 * rows * (2 * draft_steps + 1) + 4.0 * h_total +
                       rows * (4.0 + 4.0 + 1.0 + 4.0) + 4.0;
  std::vector<Row> results;
  const int launches_per_graph = std::max(slots, kMinLaunchesPerGraph);
  ready = true;
  results.push_back({"smcgraph_fused_graph", config, h_total,
                     smcgraph::bench::time_graph(launch, stream, launches_per_graph), bytes});
  ready = false;
  results.push_back({"smcgraph_fused_graph_late", config, h_total,
                     smcgraph::bench::time_graph(launch, stream, launches_per_graph), bytes});
  ready = true;
  results.push_back(
      {"smcgraph_fused_eager", config, h_total, smcgraph::bench::time_eager(launch, stream, 200, 20), bytes});
  // What the size itself allows: one cudaMemcpyAsync of the packed bytes (payload to packed, the same
  // rotation), with the same bytes counted; no verify, no scan.
  const auto copy_same_bytes = [&](cudaStream_t s) {
    Slot& slot = rotation[next_slot++ % slots];
    SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(slot.packed.data(), slot.payload.data(),
                                        static_cast<size_t>(h_total) * position_bytes,
                                        cudaMemcpyDeviceToDevice, s));
  };
  results.push_back({"cuda_memcpy_same_bytes", config, h_total,
                     smcgraph::bench::time_graph(copy_same_bytes, stream, launches_per_graph), bytes});
  return results;
}

} // namespace

int main(int argc, char** argv) {
  std::string csv_path = "results/verify_pack.csv", peer_csv;
  std::vector<std::string> only; // "rows:draft_steps:alpha:kv_dim", alpha with two decimals
  const auto refuse = [](const std::string& message) {
    std::fprintf(stderr, "verify_pack_bench: %s\n", message.c_str());
    return 2;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("usage: %s [csv_path (default results/verify_pack.csv)] [--peer-csv peer.csv] "
                  "[--only rows:draft_steps:alpha:kv_dim ...]\n",
                  argv[0]);
      return 0;
    }
    if ((arg == "--peer-csv" || arg == "--only") && i + 1 >= argc)
      return refuse(arg + " needs a value");
    if (arg == "--peer-csv") {
      peer_csv = argv[++i];
    } else if (arg == "--only") {
      const std::string value = argv[++i];
      int rows = 0, steps = 0, kv_dim = 0;
      double alpha = 0.0;
      char end = 0;
      if (std::sscanf(value.c_str(), "%d:%d:%lf:%d%c", &rows, &steps, &alpha, &kv_dim, &end) != 4)
        return refuse("--only " + value + ": expected rows:draft_steps:alpha:kv_dim");
      const std::string key = config_key(Config{rows, steps, alpha, kv_dim});
      std::string known;
      bool found = false;
      for (const Config& config : make_configs()) {
        found = found || config_key(config) == key;
        known += (known.empty() ? "" : ", ") + config_key(config);
      }
      if (!found)
        return refuse("--only " + value + " is not one of the configurations: " + known);
      only.push_back(key);
    } else if (arg.rfind("-", 0) == 0) {
      return refuse("unknown option " + arg + " (--help lists them)");
    } else {
      csv_path = arg;
    }
  }
  try {
    if (!smcgraph::bench::have_cuda_device("verify_pack_bench"))
      return 2;
    smcgraph::Stream stream;
    const int l2_bytes = smcgraph::bench::l2_cache_bytes();
    const int64_t rotation_bytes = smcgraph::bench::l2_rotation_bytes();
    const double copy_gbs = smcgraph::bench::measure_copy_bandwidth_gbs(stream);
    const double floor_us = smcgraph::bench::node_floor_us(stream);
    const std::string device_name = smcgraph::bench::device_name();
    std::printf(
        "verify_pack_bench on %s: copy %s GB/s (read + write), node floor %s us, L2 %s MB; fp16 payload, "
        "vocab %d, oracle seed %llu\n",
        device_name.c_str(), format(copy_gbs, 0).c_str(), format(floor_us, 2).c_str(),
        format(l2_bytes / 1e6, 1).c_str(), kVocab, static_cast<unsigned long long>(kOracleSeed));

    smcgraph::bench::Csv csv(csv_path);
    csv.row({"method", "rows", "draft_steps", "alpha", "kv_dim", "dtype", "packed_rows", "median_us",
             "min_us", "p90_us", "gbs", "fraction_of_copy", "device"});
    const PeerTable peers = peer_csv.empty() ? PeerTable{} : read_peer_csv(peer_csv);
    smcgraph::PackWorkspace workspace(256);
    std::printf("%-26s %5s %11s %5s %6s %7s %-9s %10s %10s %9s %8s %6s  %s\n", "method", "rows",
                "draft_steps", "alpha", "kv_dim", "packed", "grid", "median_us", "p90_us", "GB/s", "of_copy",
                "floor", "vs peers");
    bool all_valid = true;
    for (const Config& config : make_configs()) {
      if (!only.empty() && std::find(only.begin(), only.end(), config_key(config)) == only.end())
        continue;
      std::string failure;
      const auto results = run_config(config, stream, workspace, rotation_bytes, &failure);
      if (!failure.empty()) {
        all_valid = false;
        std::printf("INVALID rows %d draft_steps %d alpha %.2f kv_dim %d: %s (not timed)\n", config.rows,
                    config.draft_steps, config.alpha, config.kv_dim, failure.c_str());
        continue;
      }
      const smcgraph::PackLaunchShape shape = smcgraph::pack_launch_shape(
          config.rows, config.draft_steps, config.kv_dim, kPayloadDType, false, false);
      // The bench's fp16 rows are 16-byte aligned: 16-byte copies whenever a position is a multiple of 16
      // bytes.
      const int64_t position_bytes = int64_t{config.kv_dim} * smcgraph::dtype_bytes(kPayloadDType);
      const bool preloads =
          smcgraph::pack_preloads(config.rows, config.draft_steps, config.kv_dim, kPayloadDType, false, false,
                                  position_bytes % 16 == 0 ? 16 : 2);
      for (const Row& row : results) {
        csv.row(csv_cells(row, copy_gbs, device_name));
        const double gbs = row.bytes / (row.timing.median_us * 1e3);
        std::string versus;
        const auto it = peers.find(
            std::make_tuple(config.rows, config.draft_steps, format(config.alpha, 2), config.kv_dim));
        if (it != peers.end())
          for (const auto& [method, median_us] : it->second)
            versus += method + " " + format(median_us / row.timing.median_us, 2) + "x  ";
        const bool ours = row.method.rfind("smcgraph_", 0) == 0;
        const bool marked = row.method != "smcgraph_fused_graph_late"; // the payload marked ready
        const bool source = smcgraph::pack_source_order(
            config.rows, config.draft_steps,
            {nullptr, kPayloadDType, config.kv_dim, 0, marked, static_cast<float>(config.alpha)}, false,
            false, 16);
        const std::string grid = !ours ? "-"
                                       : std::to_string(shape.tiles) + "x" + std::to_string(shape.splits) +
                                             (preloads && marked ? " pre" : "") + (source ? " src" : "");
        std::printf("%-26s %5d %11d %5.2f %6d %7d %-9s %10s %10s %9s %8s %6s  %s\n", row.method.c_str(),
                    config.rows, config.draft_steps, config.alpha, config.kv_dim, row.packed_rows,
                    grid.c_str(), format(row.timing.median_us, 2).c_str(),
                    format(row.timing.p90_us, 2).c_str(), format(gbs, 1).c_str(),
                    format(gbs / copy_gbs, 3).c_str(), format(floor_us / row.timing.median_us, 2).c_str(),
                    versus.c_str());
      }
      std::fflush(stdout);
    }
    std::printf(
        "of_copy: bytes moved / time / copy bandwidth; floor: node floor / time (1.00 = launch-bound); "
        "vs peers: peer median / smcgraph median (> 1: smcgraph faster). CSV: %s\n",
        csv_path.c_str());
    return all_valid ? 0 : 1;
  } catch (const smcgraph::Error& error) {
    std::fprintf(stderr, "verify_pack_bench: %s\n", error.what());
    return 1;
  }
}
