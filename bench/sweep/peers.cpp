// bucket_sweep's PyTorch peers (bench/bucket_sweep.cpp): bench/peers/smc_peer.py and spec_peer.py on the toy
// pair's files, plot_sweep.py, and llama_peer.py on the real pair; smcgraph's ratios to them and the CSV
// with the peer columns.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "bench_util.hpp"
#include "smcgraph/engine.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/llama_model.hpp"
#include "sweep/sweep_common.hpp"

namespace smcgraph::sweep {

using smcgraph::bench::find_peer_script;
using smcgraph::bench::format;
using smcgraph::bench::run_command;
using smcgraph::bench::shell_quote;

// ---------------------------------------------------------------------------------------------------------
// Peers

namespace {

struct PeerResult {
  double cycle_us = NAN, model_us = NAN, tokens_per_s = NAN, tokens_per_cycle = NAN;
  bool valid = true;
};
/// (requests, particles, steps, vocab, dtype) -> method -> result.
using PeerKey = std::tuple<int, int, int, int, std::string>;
using PeerTable = std::map<PeerKey, std::map<std::string, PeerResult>>;

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> cells;
  std::stringstream stream(line);
  std::string cell;
  while (std::getline(stream, cell, ','))
    cells.push_back(cell);
  return cells;
}

PeerTable read_peer_csv(const std::string& path, std::vector<std::string>& methods) {
  PeerTable table;
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line))
    return table;
  if (!line.empty() && line.back() == '\r') // Python's csv module ends lines with \r\n
    line.pop_back();
  const std::vector<std::string> header = split_csv_line(line);
  const auto column = [&](const char* name) {
    const auto it = std::find(header.begin(), header.end(), name);
    return it == header.end() ? -1 : static_cast<int>(it - header.begin());
  };
  const int method = column("method"), requests = column("requests"), particles = column("particles"),
            steps = column("steps"), vocab = column("vocab"), dtype = column("dtype"),
            cycle = column("cycle_us"), model = column("model_us"), valid = column("valid"),
            tokens_per_s = column("tokens_per_s"), tokens_per_cycle = column("tokens_per_cycle");
  if (std::min({method, requests, particles, steps, vocab, dtype, cycle}) < 0)
    return table;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    const std::vector<std::string> cells = split_csv_line(line);
    if (static_cast<int>(cells.size()) < static_cast<int>(header.size()))
      continue;
    try {
      PeerResult result;
      result.cycle_us = std::stod(cells[cycle]);
      result.model_us = model >= 0 ? std::stod(cells[model]) : NAN;
      result.tokens_per_s = tokens_per_s >= 0 ? std::stod(cells[tokens_per_s]) : NAN;
      result.tokens_per_cycle = tokens_per_cycle >= 0 ? std::stod(cells[tokens_per_cycle]) : NAN;
      result.valid = valid < 0 || cells[valid] == "1";
      table[{std::stoi(cells[requests]), std::stoi(cells[particles]), std::stoi(cells[steps]),
             std::stoi(cells[vocab]), cells[dtype]}][cells[method]] = result;
      if (std::find(methods.begin(), methods.end(), cells[method]) == methods.end())
        methods.push_back(cells[method]);
    } catch (const std::exception&) {
      continue; // "nan" or a malformed line: skip it
    }
  }
  return table;
}

/// One cycle kind's PyTorch peer: its script, its CSV and what it reported.
struct PeerRun {
  std::string kind;   ///< "smc" or "spec": the sweep rows it compares with
  std::string script; ///< file name in bench/peers/
  std::string given;  ///< --peer-script / --spec-peer-script
  std::string csv_name;
  std::string csv;                  ///< path beside the sweep's CSV
  std::vector<std::string> methods; ///< in the peer CSV's order
  PeerTable table;
};

/// The --peer-methods names meant for `kind`'s peer (spec_* for spec, the others for smc); "" when none was
/// given (the peer's defaults).
std::string peer_methods_for(const Options& o, const std::string& kind, bool& none_left) {
  none_left = false;
  if (o.peer_methods.empty())
    return "";
  std::string methods;
  for (const std::string& method : split_list(o.peer_methods)) {
    if ((method.rfind("spec_", 0) == 0) != (kind == "spec"))
      continue;
    methods += (methods.empty() ? "" : ",") + method;
  }
  none_left = methods.empty();
  return methods;
}

} // namespace

/// Runs the peer of every measured kind, prints smcgraph's ratios to them and rewrites the CSV with the peer
/// columns added. Returns false when a peer could not run or reported a failure or an invalid result.
bool run_peers(const Options& o, const char* argv0, const Environment& env, const std::string& manifest,
               const std::vector<Row>& results, bool run_smc, bool run_spec) {
  const std::filesystem::path csv_dir = std::filesystem::path(o.csv).parent_path();
  std::vector<PeerRun> peers;
  if (run_smc)
    peers.push_back({"smc", "smc_peer.py", o.peer_script, kPeerCsvName, "", {}, {}});
  if (run_spec)
    peers.push_back({"spec", "spec_peer.py", o.spec_peer_script, kSpecPeerCsvName, "", {}, {}});
  const std::string probe =
      o.python + " -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'";
  if (run_command(probe + " >/dev/null 2>&1") != 0) {
    std::printf("\npeers: skipped (%s with a CUDA-enabled torch is not available)\n", o.python.c_str());
    return false;
  }
  bool all_ok = true, any_rows = false;
  for (PeerRun& peer : peers) {
    const std::string script = find_peer_script(peer.given, peer.script.c_str(), argv0);
    if (script.empty()) {
      std::printf("\npeers: %s skipped (bench/peers/%s not found; run from the repository root or pass "
                  "--%speer-script)\n",
                  peer.kind.c_str(), peer.script.c_str(), peer.kind == "spec" ? "spec-" : "");
      all_ok = false;
      continue;
    }
    bool none_left = false;
    const std::string methods = peer_methods_for(o, peer.kind, none_left);
    if (none_left) {
      std::printf("\npeers: %s skipped (--peer-methods names none of its methods)\n", peer.kind.c_str());
      continue;
    }
    peer.csv = (csv_dir / peer.csv_name).string();
    std::error_code ignored;
    std::filesystem::remove(peer.csv, ignored); // never compare with an earlier run's rows
    std::string command = o.python + " " + shell_quote(script) + " --manifest " + shell_quote(manifest) +
                          " --csv " + shell_quote(peer.csv);
    if (!methods.empty())
      command += " --methods " + shell_quote(methods);
    std::printf("\npeers: %s\n", command.c_str());
    const int status = run_command(command);
    if (status != 0) {
      std::printf("peers: the peer exited with status %d; comparing what it wrote\n", status);
      all_ok = false;
    }
    peer.table = read_peer_csv(peer.csv, peer.methods);
    if (peer.table.empty()) {
      std::printf("peers: no rows in %s\n", peer.csv.c_str());
      all_ok = false;
    }
    any_rows = any_rows || !peer.table.empty();
  }
  if (!any_rows)
    return false;

  const auto peer_of = [&](const std::string& kind) -> const PeerRun* {
    for (const PeerRun& peer : peers)
      if (peer.kind == kind && !peer.table.empty())
        return &peer;
    return nullptr;
  };
  const auto find_result = [&](const Row& row) -> const std::map<std::string, PeerResult>* {
    const PeerRun* peer = peer_of(row.kind);
    if (peer == nullptr)
      return nullptr;
    const auto it =
        peer->table.find({row.requests, row.particles, row.steps, row.vocab, dtype_name(row.dtype)});
    return it == peer->table.end() ? nullptr : &it->second;
  };

  // Every (row of `kind`, peer method) pair that has a peer result, with the peer's non-model time.
  const auto for_each_peer_result = [&](const char* kind, const auto& print) {
    for (const Row& row : results) {
      if (row.kind != kind)
        continue;
      if (const auto* found = find_result(row))
        for (const auto& [method, peer] : *found)
          print(row, method, peer, peer.cycle_us - peer.model_us);
    }
  };

  if (peer_of("smc") != nullptr) {
    std::printf(
        "\nsmcgraph (graph replay, GPU time per cycle) vs the PyTorch peer in this run; ratio = peer time / "
        "smcgraph time (> 1: smcgraph faster); nonmodel = cycle - the implementation's own model forwards\n");
    std::printf("%7s %5s %2s %2s %8s %10s %10s  %-20s %10s %7s %10s %7s\n", "vocab", "dtype", "N", "K",
                "requests", "smcg_us", "smcg_nm", "peer", "peer_us", "ratio", "peer_nm", "nm_rat");
    for_each_peer_result("smc", [&](const Row& row, const std::string& method, const auto& peer,
                                    double peer_nonmodel) {
      std::printf("%7d %5s %2d %2d %8d %10s %10s  %-20s %10s %6sx %10s %6sx%s\n", row.vocab,
                  dtype_name(row.dtype), row.particles, row.steps, row.requests,
                  format(row.graph.median_us, 1).c_str(), format(row.nonmodel_us, 1).c_str(), method.c_str(),
                  format(peer.cycle_us, 1).c_str(), format(peer.cycle_us / row.graph.median_us, 2).c_str(),
                  format(peer_nonmodel, 1).c_str(), format(peer_nonmodel / row.nonmodel_us, 2).c_str(),
                  peer.valid ? "" : "  (peer INVALID)");
    });
  }
  if (peer_of("spec") != nullptr) {
    std::printf("\nsmcgraph spec (greedy speculative decoding, graph replay) vs its PyTorch peer in this "
                "run; tps_rat = smcgraph tokens/s / peer tokens/s (> 1: smcgraph faster; tok/c = tokens "
                "per row and cycle, accepted + 1, each side's own); cyc_rat = peer time / smcgraph time "
                "per cycle; nonmodel as above\n");
    std::printf("%7s %5s %2s %8s %10s %6s %10s  %-24s %10s %6s %10s %7s %7s %10s %7s\n", "vocab", "dtype",
                "K", "requests", "smcg_us", "tok/c", "smcg_tok/s", "peer", "peer_us", "tok/c", "peer_tok/s",
                "tps_rat", "cyc_rat", "peer_nm", "nm_rat");
    for_each_peer_result("spec", [&](const Row& row, const std::string& method, const auto& peer,
                                     double peer_nonmodel) {
      std::printf("%7d %5s %2d %8d %10s %6s %10s  %-24s %10s %6s %10s %6sx %6sx %10s %6sx%s\n", row.vocab,
                  dtype_name(row.dtype), row.steps, row.requests, format(row.graph.median_us, 1).c_str(),
                  format(row.tokens_per_cycle, 2).c_str(), format(row.tokens_per_s, 0).c_str(),
                  method.c_str(), format(peer.cycle_us, 1).c_str(), format(peer.tokens_per_cycle, 2).c_str(),
                  format(peer.tokens_per_s, 0).c_str(),
                  format(row.tokens_per_s / peer.tokens_per_s, 2).c_str(),
                  format(peer.cycle_us / row.graph.median_us, 2).c_str(), format(peer_nonmodel, 1).c_str(),
                  format(peer_nonmodel / row.nonmodel_us, 2).c_str(), peer.valid ? "" : "  (peer INVALID)");
    });
  }

  // The CSV again, with per-method peer columns (smc methods first); a row has values only for its kind's
  // peer. Spec methods add their tokens/s and smcgraph's tokens/s over it (their tokens per cycle may
  // differ).
  std::vector<std::string> header = kCsvColumns;
  std::vector<std::pair<std::string, std::string>> columns; // (kind, method)
  for (const PeerRun& peer : peers) {
    for (const std::string& method : peer.methods) {
      columns.emplace_back(peer.kind, method);
      header.push_back(method + "_us");
      header.push_back(method + "_over_graph");
      header.push_back(method + "_nonmodel_us");
      header.push_back(method + "_nonmodel_over_smcgraph");
      if (peer.kind == "spec") {
        header.push_back(method + "_tokens_per_s");
        header.push_back(method + "_tokens_per_s_smcgraph_over_peer");
      }
    }
  }
  bench::Csv csv(o.csv);
  csv.row(header);
  bool peer_valid = true;
  for (const Row& row : results) {
    std::vector<std::string> cells = csv_cells(env, row);
    const auto* found = find_result(row);
    for (const auto& [kind, method] : columns) {
      PeerResult peer;
      if (kind == row.kind && found != nullptr && found->count(method))
        peer = found->at(method);
      peer_valid = peer_valid && peer.valid;
      const double peer_nonmodel = peer.cycle_us - peer.model_us;
      cells.push_back(format(peer.cycle_us, 2));
      cells.push_back(format(peer.cycle_us / row.graph.median_us, 3));
      cells.push_back(format(peer_nonmodel, 2));
      cells.push_back(format(peer_nonmodel / row.nonmodel_us, 3));
      if (kind == "spec") {
        cells.push_back(format(peer.tokens_per_s, 0));
        cells.push_back(format(row.tokens_per_s / peer.tokens_per_s, 3));
      }
    }
    csv.row(cells);
  }
  std::string peer_csvs;
  for (const PeerRun& peer : peers)
    if (!peer.csv.empty())
      peer_csvs += (peer_csvs.empty() ? "" : ", ") + peer.csv;
  std::printf("peers: columns added to %s (peer CSV%s: %s)\n", o.csv.c_str(), peers.size() > 1 ? "s" : "",
              peer_csvs.c_str());
  return all_ok && peer_valid;
}

void run_plots(const Options& o, const char* argv0, bool run_smc, bool run_spec) {
  const std::string script = find_peer_script(o.plot_script, "plot_sweep.py", argv0);
  if (script.empty()) {
    std::printf("\nplots: skipped (bench/peers/plot_sweep.py not found; pass --plot-script)\n");
    return;
  }
  const std::filesystem::path csv_dir = std::filesystem::path(o.csv).parent_path();
  const std::string out_dir = (csv_dir / "plots").string();
  std::string command = o.python + " " + shell_quote(script) + " --sweep " + shell_quote(o.csv) + " --out " +
                        shell_quote(out_dir);
  for (const auto& [measured, name] : {std::pair<bool, const char*>{run_smc, kPeerCsvName},
                                       std::pair<bool, const char*>{run_spec, kSpecPeerCsvName}}) {
    const std::string peer_csv = (csv_dir / name).string();
    if (o.peers && measured && std::filesystem::exists(peer_csv))
      command += " --peer " + shell_quote(peer_csv);
  }
  std::printf("\nplots: %s\n", command.c_str());
  const int status = run_command(command);
  if (status != 0)
    std::printf("plots: the plot script exited with status %d\n", status);
}

// ---------------------------------------------------------------------------------------------------------
// Peers of the real model (bench/peers/llama_peer.py)

/// smcgraph's greedy continuation of each prompt: the speculative cycle with T_d = T_t = 0, which equals
/// greedy target-only decoding; the peers reproduce it before they time anything.
std::vector<std::vector<int32_t>> real_greedy_tokens(const ModelPair& models, const SweepConstants& k,
                                                     int max_new_tokens, int steps) {
  EngineConfig config;
  config.kind = CycleKind::kSpeculative;
  config.vocab = kRealVocab;
  config.particles = 1;
  config.draft_steps = steps;
  config.max_requests = static_cast<int>(g_real_prompts.size());
  config.max_seq_len = k.max_seq_len;
  config.slot_pool_size = k.pool_size;
  config.draft_temperature = 0.0f;
  config.target_temperature = 0.0f;
  Engine engine(config, *models.draft, *models.target);
  std::vector<RequestId> ids;
  for (size_t q = 0; q < g_real_prompts.size(); ++q)
    ids.push_back(engine.admit(g_real_prompts[q], {.seed = q, .max_new_tokens = max_new_tokens}));
  std::set<RequestId> finished;
  for (int cycle = 0; finished.size() < ids.size(); ++cycle) {
    require(cycle < 100000, "bucket_sweep", "greedy validation cycles", cycle, "did not finish");
    engine.step();
    std::vector<RequestUpdate> updates;
    drain(engine, updates);
    for (const RequestUpdate& update : updates) {
      if (update.failed)
        throw Error("bucket_sweep: greedy validation request failed: " + update.reason);
      if (update.finished)
        finished.insert(update.id);
    }
  }
  std::vector<std::vector<int32_t>> tokens;
  for (const RequestId id : ids) {
    tokens.push_back(engine.result(id).tokens);
    engine.release(id);
  }
  return tokens;
}

/// Writes the peer manifest, runs bench/peers/llama_peer.py and prints smcgraph's tokens/s over each peer
/// method's at the same (kind, requests, N, K). Returns false when the peer could not run or was invalid.
bool run_real_peers(const Options& o, const char* argv0, const Environment& env,
                    const std::string& model_path, const std::vector<Row>& results,
                    const std::vector<std::vector<int32_t>>& greedy) {
  const std::filesystem::path csv_dir = std::filesystem::path(o.csv).parent_path();
  const std::string manifest = (csv_dir / "llama_peer.json").string();
  const std::string peer_csv = (csv_dir / "llama_peer.csv").string();
  {
    // The format bench/peers/llama_peer.py reads (its header documents it).
    std::ostringstream j;
    const EngineConfig defaults;
    j << "{\n  \"format\": \"smcgraph-llama-peer-1\",\n  \"device\": " << json_string(env.device) << ",\n";
    j << "  \"model\": " << json_string(std::filesystem::absolute(model_path).string()) << ",\n";
    // The speculative draft (hf_assisted, torch_spec_*) and the SMC draft (torch_smc_*). With the n-gram
    // draft
    // (--draft-layers ngram) the peer of smcgraph's draft is hf_prompt_lookup; the peer's layer-draft methods
    // then run each kind's default layer subset.
    const auto layers_of = [&](CycleKind kind) {
      const std::string layers = draft_layers_for(o, kind);
      return layers == "ngram" ? draft_layers_for(Options{}, kind) : layers;
    };
    j << "  \"draft_layers\": [" << join_ints(parse_llama_layers(layers_of(CycleKind::kSpeculative)), ", ")
      << "],\n";
    j << "  \"smc_draft_layers\": [" << join_ints(parse_llama_layers(layers_of(CycleKind::kSmc)), ", ")
      << "],\n";
    j << "  \"logits_dtype\": \"bf16\",\n  \"eos_id\": -1,\n";
    j << "  \"prompts\": [";
    for (size_t p = 0; p < g_real_prompts.size(); ++p)
      j << (p ? ", " : "") << json_int_array(g_real_prompts[p]);
    j << "],\n  \"greedy\": {\"new_tokens\": " << kRealGreedyTokens << ", \"tokens\": [";
    for (size_t p = 0; p < greedy.size(); ++p)
      j << (p ? ", " : "") << json_int_array(greedy[p]);
    j << "]},\n";
    j << "  \"generate\": {\"requests\": [" << join_ints(o.requests, ", ") << "], \"new_tokens\": 128},\n";
    const bool with_spec = std::find(o.kinds.begin(), o.kinds.end(), "spec") != o.kinds.end();
    const bool with_smc = std::find(o.kinds.begin(), o.kinds.end(), "smc") != o.kinds.end();
    if (with_spec)
      j << "  \"spec\": {\"steps\": [" << join_ints(o.steps, ", ") << "], \"requests\": ["
        << join_ints(o.requests, ", ") << "], \"cycles\": " << o.cycles
        << ", \"warmup_cycles\": " << kWarmupCycles << ", \"new_tokens\": 128},\n";
    if (with_smc)
      j << "  \"smc\": {\"particles\": [" << join_ints(o.particles, ", ") << "], \"steps\": ["
        << join_ints(smc_steps(o.steps), ", ") << "], \"requests\": [" << join_ints(o.requests, ", ")
        << "], \"cycles\": " << o.cycles << ", \"warmup_cycles\": " << kWarmupCycles
        << ", \"draft_temperature\": " << float_text(defaults.draft_temperature)
        << ", \"target_temperature\": " << float_text(defaults.target_temperature)
        << ", \"alpha\": " << float_text(defaults.alpha) << ", \"tau\": " << float_text(defaults.tau)
        << "},\n";
    j << "  \"requests\": [" << join_ints(o.requests, ", ") << "]\n}\n";
    std::ofstream out(manifest, std::ios::trunc);
    out << j.str();
    if (!out)
      throw Error("bucket_sweep: writing " + manifest + " failed");
  }
  const std::string script = find_peer_script("", "llama_peer.py", argv0);
  if (script.empty()) {
    std::printf("\npeers: skipped (bench/peers/llama_peer.py not found; run from the repository root)\n");
    return false;
  }
  std::error_code ignored;
  std::filesystem::remove(peer_csv, ignored);
  std::string command = o.python + " " + shell_quote(script) + " --manifest " + shell_quote(manifest) +
                        " --csv " + shell_quote(peer_csv);
  if (!o.peer_methods.empty())
    command += " --methods " + shell_quote(o.peer_methods);
  std::printf("\npeers: %s\n", command.c_str());
  std::fflush(stdout);
  bool ok = run_command(command) == 0;
  // The peer CSV: method,kind,requests,particles,steps,tokens_per_s,cycle_us,valid (one row per point).
  std::ifstream in(peer_csv);
  std::string line;
  std::vector<std::string> header;
  if (!std::getline(in, line)) {
    std::printf("peers: no rows in %s\n", peer_csv.c_str());
    return false;
  }
  header = split_csv_line(line);
  const auto column = [&](const char* name) {
    return static_cast<int>(std::find(header.begin(), header.end(), name) - header.begin());
  };
  const int c_method = column("method"), c_requests = column("requests"), c_particles = column("particles"),
            c_steps = column("steps"), c_tps = column("tokens_per_s"), c_valid = column("valid");
  std::printf(
      "\nsmcgraph (graph replay) vs the real-model peers in this run: ratio = smcgraph request tokens/s "
      "/ peer tokens/s at the same kind, requests, N, K (> 1: smcgraph faster)\n");
  std::printf("%-26s %5s %8s %2s %2s %12s %12s %8s\n", "peer", "kind", "requests", "N", "K", "peer_tok/s",
              "smcg_tok/s", "ratio");
  while (std::getline(in, line)) {
    const std::vector<std::string> cells = split_csv_line(line);
    if (cells.size() < header.size())
      continue;
    // The method names say the kind: hf_generate_greedy is plain greedy decoding, *smc* the SMC cycle, the
    // rest (hf_assisted, hf_prompt_lookup, torch_spec_*) greedy speculative decoding.
    const std::string& method = cells[c_method];
    const std::string kind = method.find("smc") != std::string::npos ? "smc"
                             : method.rfind("hf_generate", 0) == 0   ? "greedy"
                                                                     : "spec";
    const int requests = std::atoi(cells[c_requests].c_str());
    const int particles = std::atoi(cells[c_particles].c_str()), steps = std::atoi(cells[c_steps].c_str());
    const double peer_tps = std::atof(cells[c_tps].c_str());
    const bool valid = cells[c_valid] == "1" || cells[c_valid] == "True" || cells[c_valid] == "true";
    ok = ok && valid;
    // A greedy (non-speculative) peer compares with smcgraph's spec row (greedy) of the same requests.
    double smcgraph_tps = NAN;
    for (const Row& row : results) {
      const bool same_kind = row.kind == kind || (kind == "greedy" && row.kind == "spec");
      if (same_kind && row.requests == requests && (kind != "smc" || row.particles == particles) &&
          (steps == 0 || row.steps == steps) && row.dtype == DType::kBFloat16)
        smcgraph_tps = std::isnan(smcgraph_tps) ? row.tokens_per_s : std::max(smcgraph_tps, row.tokens_per_s);
    }
    std::printf("%-26s %5s %8d %2d %2d %12s %12s %7sx%s\n", cells[c_method].c_str(), kind.c_str(), requests,
                particles, steps, format(peer_tps, 1).c_str(), format(smcgraph_tps, 0).c_str(),
                format(smcgraph_tps / peer_tps, 1).c_str(), valid ? "" : "  (peer INVALID)");
  }
  std::fflush(stdout);
  return ok;
}

} // namespace smcgraph::sweep
