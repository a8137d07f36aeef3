// bucket_sweep's command line (bench/bucket_sweep.cpp): --help and the parsing of the options.
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "sweep/sweep_common.hpp"

namespace smcgraph::sweep {

// ---------------------------------------------------------------------------------------------------------
// Command line

namespace {

void print_usage() {
  std::printf(
      "usage: bucket_sweep [options]\n"
      "  --quick               a small subset: requests {1, 8, 64} x N {4} x K {4} x V {32000} x {fp32, "
      "bf16},\n"
      "                        20 cycles per phase\n"
      "  --requests LIST       request-slot buckets, e.g. 1,2,4,8,16,32,64 (the largest is max_requests)\n"
      "  --particles LIST      N values (default 4,8)\n"
      "  --steps LIST          K values (default 4,8); 0 (spec only): no draft, the target alone\n"
      "  --vocabs LIST         V values (default 32000,128256)\n"
      "  --dtypes LIST         logits dtypes, fp32 and/or bf16 (default fp32,bf16)\n"
      "  --kinds LIST          cycle kinds, smc and/or spec (default both; spec runs with N = 1 and is "
      "reported as\n"
      "                        pending when the engine rejects kSpeculative)\n"
      "  --stages              after each row, the GPU time of every cycle stage (Engine::profile_step(): "
      "each\n"
      "                        stage alone on the GPU, eager, median of 5 cycles) and the non-model stages' "
      "sum\n"
      "  --adaptive            spec engines choose each request's K on the device (EngineConfig::adaptive,\n"
      "                        K in {1, ceil(K/2), K}); every spec row prints its mean K and acceptance EMA\n"
      "  --draft-cost C        with --adaptive: the cost-aware rule's draft cost "
      "(AdaptiveDraftSteps::draft_cost);\n"
      "                        default: measured (a draft forward over the target verify forward, timed "
      "alone\n"
      "                        at the smallest bucket); 0: the seed's thresholds\n"
      "  --min-steps M         with --adaptive: AdaptiveDraftSteps::min_steps (default 1); 0 (--model "
      "smollm2,\n"
      "                        a layer-prefix draft sharing the target's KV) lets a request draft nothing\n"
      "  --cycles C            timed cycles per phase (default 30)\n"
      "  --context N           tokens of every timed prompt, 32-32768 (default 32; the real model: "
      "multi-turn\n"
      "                        chats of the built-in questions, their last N tokens); not with --peers\n"
      "  --perturbation P      draft head perturbation of the toy pair (default 0.3)\n"
      "  --csv PATH            CSV output (default results/bucket_sweep.csv); the peer files go beside it\n"
      "  --peers               run the PyTorch peers afterwards (same grid, same weights): "
      "bench/peers/smc_peer.py\n"
      "                        for smc, bench/peers/spec_peer.py for spec; print the ratios and add "
      "per-method peer\n"
      "                        columns to the CSV\n"
      "  --peer-methods LIST   methods for the peers (default: all of "
      "torch_eager,torch_graph_draft,torch_graph_cycle\n"
      "                        for smc and spec_torch_eager,spec_torch_graph_draft for spec; spec_* names go "
      "to the\n"
      "                        spec peer, the others to the smc peer)\n"
      "  --plots               run bench/peers/plot_sweep.py afterwards (PNGs in <csv dir>/plots)\n"
      "  --python PYTHON       interpreter for --peers / --plots (default python3)\n"
      "  --peer-script PATH    default: bench/peers/smc_peer.py found from the cwd or the executable\n"
      "  --spec-peer-script PATH  default: bench/peers/spec_peer.py found likewise\n"
      "  --plot-script PATH    default: bench/peers/plot_sweep.py found likewise\n"
      "  --no-progress         no progress line on stderr\n"
      "  --model toy|smollm2   the embedded toy pair (default) or the real pair SmolLM2-135M-Instruct from "
      "its\n"
      "                        GGUF file (./run fetch-model); smollm2 has one vocabulary (49152), adds the "
      "HBM\n"
      "                        roofline columns and runs bench/peers/llama_peer.py with --peers\n"
      "  --model-path PATH     the GGUF file (default $SMCGRAPH_MODEL_PATH or .cache/models/ found from the "
      "cwd)\n"
      "  --draft-layers LIST   layers of the real model's draft for both kinds, e.g. 0-23 or 0-11,18-29;\n"
      "                        ngram: the n-gram draft (NgramDraft: prompt lookup, no weights); default:\n"
      "                        0-27 for spec, 0-29 (every layer) for smc (picked by bench/draft_study)\n"
      "exit status: 0; 1 a validation failed; 2 could not run; 3 a peer failed or reported invalid "
      "results\n");
}

/// A whole-text float in [lo, hi] (finite).
bool parse_float(const char* text, float lo, float hi, float& out) {
  char* end = nullptr;
  out = std::strtof(text, &end);
  return end != text && *end == '\0' && std::isfinite(out) && out >= lo && out <= hi;
}

bool parse_int_list(const std::string& text, std::vector<int>& out, long min_value) {
  out.clear();
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (item.empty())
      continue;
    char* end = nullptr;
    const long value = std::strtol(item.c_str(), &end, 10);
    if (*end != '\0' || value < min_value || value > 1 << 20)
      return false;
    out.push_back(static_cast<int>(value));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return !out.empty();
}

} // namespace

/// Returns -1 to go on, else the exit status.
int parse_options(int argc, char** argv, Options& o) {
  bool explicit_lists[6] = {false, false, false, false, false, false};
  bool explicit_cycles = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bucket_sweep: %s needs a value\n", arg.c_str());
        return nullptr;
      }
      return argv[++i];
    };
    const auto bad = [&](const char* text) {
      std::fprintf(stderr, "bucket_sweep: bad value for %s: '%s'\n", arg.c_str(), text);
      return 2;
    };
    if (arg == "--help" || arg == "-h") {
      print_usage();
      return 0;
    } else if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--peers") {
      o.peers = true;
    } else if (arg == "--plots") {
      o.plots = true;
    } else if (arg == "--no-progress") {
      o.progress = false;
    } else if (arg == "--stages") {
      o.stages = true;
    } else if (arg == "--adaptive") {
      o.adaptive = true;
    } else if (arg == "--requests" || arg == "--particles" || arg == "--steps" || arg == "--vocabs") {
      const char* text = value();
      if (!text)
        return 2;
      const int which = arg == "--requests" ? 0 : arg == "--particles" ? 1 : arg == "--steps" ? 2 : 3;
      std::vector<int>& list = which == 0   ? o.requests
                               : which == 1 ? o.particles
                               : which == 2 ? o.steps
                                            : o.vocabs;
      if (!parse_int_list(text, list, which == 2 ? 0 : 1)) // K = 0: the speculative cycle without a draft
        return bad(text);
      explicit_lists[which] = true;
    } else if (arg == "--dtypes") {
      const char* text = value();
      if (!text)
        return 2;
      o.dtypes.clear();
      for (const std::string& name : split_list(text)) {
        if (name == "fp32")
          o.dtypes.push_back(DType::kFloat32);
        else if (name == "bf16")
          o.dtypes.push_back(DType::kBFloat16);
        else
          return bad(text);
      }
      if (o.dtypes.empty())
        return bad(text);
      explicit_lists[4] = true;
    } else if (arg == "--kinds") {
      const char* text = value();
      if (!text)
        return 2;
      o.kinds = split_list(text);
      for (const std::string& kind : o.kinds)
        if (kind != "smc" && kind != "spec")
          return bad(text);
      if (o.kinds.empty())
        return bad(text);
      explicit_lists[5] = true;
    } else if (arg == "--cycles") {
      const char* text = value();
      if (!text)
        return 2;
      o.cycles = std::atoi(text);
      if (o.cycles < 1 || o.cycles > 10000)
        return bad(text);
      explicit_cycles = true;
    } else if (arg == "--context" || arg == "--min-steps") {
      const char* text = value();
      if (!text)
        return 2;
      const bool context = arg == "--context";
      char* end = nullptr;
      const long number = std::strtol(text, &end, 10);
      if (end == text || *end != '\0' || number < (context ? kPromptLength : 0) ||
          number > (context ? 32768 : 64))
        return bad(text);
      (context ? o.context : o.min_steps) = static_cast<int>(number);
    } else if (arg == "--perturbation" || arg == "--draft-cost") {
      const char* text = value();
      if (!text)
        return 2;
      const bool perturbation = arg == "--perturbation";
      if (!parse_float(text, 0.0f, perturbation ? std::numeric_limits<float>::max() : 64.0f,
                       perturbation ? o.draft_perturbation : o.draft_cost))
        return bad(text);
    } else if (arg == "--model") {
      const char* text = value();
      if (!text)
        return 2;
      o.model = text;
      if (o.model != "toy" && o.model != "smollm2")
        return bad(text);
    } else if (arg == "--model-path" || arg == "--draft-layers") {
      const char* text = value();
      if (!text)
        return 2;
      (arg == "--model-path" ? o.model_path : o.draft_layers) = text;
    } else if (arg == "--csv" || arg == "--python" || arg == "--peer-script" || arg == "--spec-peer-script" ||
               arg == "--plot-script" || arg == "--peer-methods") {
      const char* text = value();
      if (!text)
        return 2;
      (arg == "--csv"                ? o.csv
       : arg == "--python"           ? o.python
       : arg == "--peer-script"      ? o.peer_script
       : arg == "--spec-peer-script" ? o.spec_peer_script
       : arg == "--plot-script"      ? o.plot_script
                                     : o.peer_methods) = text;
    } else {
      std::fprintf(stderr, "bucket_sweep: unknown argument '%s' (see --help)\n", arg.c_str());
      return 2;
    }
  }
  if (o.peers && o.context != kPromptLength) {
    std::fprintf(stderr,
                 "bucket_sweep: --context %d runs without --peers (the peers time %d-token prompts)\n",
                 o.context, kPromptLength);
    return 2;
  }
  if (o.quick) { // explicit lists win over --quick
    if (!explicit_lists[0])
      o.requests = {1, 8, 64};
    if (!explicit_lists[1])
      o.particles = {4};
    if (!explicit_lists[2])
      o.steps = {4};
    if (!explicit_lists[3])
      o.vocabs = {32000};
    if (!explicit_cycles)
      o.cycles = 20;
  }
  return -1;
}

} // namespace smcgraph::sweep
