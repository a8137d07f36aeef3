// The files bucket_sweep (bench/bucket_sweep.cpp) writes for its PyTorch peers: the toy weights (safetensors)
// and the manifest (bench/peers/toy_weights_io.md), and the small JSON helpers they are written with.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "smcgraph/error.hpp"
#include "smcgraph/toy_model.hpp"
#include "sweep/sweep_common.hpp"

namespace smcgraph::sweep {

// ---------------------------------------------------------------------------------------------------------
// Small helpers: list and JSON text

std::string join_ints(const std::vector<int>& values, const char* separator) {
  std::string text;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i)
      text += separator;
    text += std::to_string(values[i]);
  }
  return text;
}

/// Shortest text that reads back as the same float (JSON and safetensors metadata).
std::vector<int> smc_steps(const std::vector<int>& steps) {
  std::vector<int> kept;
  std::copy_if(steps.begin(), steps.end(), std::back_inserter(kept), [](int k) { return k >= 1; });
  return kept;
}

std::string float_text(float value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", static_cast<double>(value));
  return text;
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof(escape), "\\u%04x", c);
      out += escape;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string json_int_array(const std::vector<int32_t>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i)
      text += ',';
    text += std::to_string(values[i]);
  }
  return text + "]";
}

// ---------------------------------------------------------------------------------------------------------
// Peer files: the toy weights (safetensors layout) and the manifest

/// Writes the draft and target weights of `toy` (draft head perturbed by `draft_perturbation`, as
/// ToyModel::pair) and the engine config as a safetensors file (bench/peers/toy_weights_io.md).
void write_toy_weights(const std::string& path, const ToyModelConfig& toy, float draft_perturbation,
                       const EngineConfig& engine_config) {
  static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");
  ToyModelConfig target_config = toy;
  target_config.head_perturbation = 0.0f;
  ToyModelConfig draft_config = toy;
  draft_config.head_perturbation = draft_perturbation;
  const ToyModelWeights target = make_toy_model_weights(target_config);
  const ToyModelWeights draft = make_toy_model_weights(draft_config);

  struct Tensor {
    std::string name;
    const std::vector<float>* data;
    std::vector<int64_t> shape;
  };
  const int64_t V = toy.vocab, H = toy.hidden;
  std::vector<Tensor> tensors;
  for (const auto& [prefix, weights] : {std::pair<std::string, const ToyModelWeights*>{"target", &target},
                                        std::pair<std::string, const ToyModelWeights*>{"draft", &draft}}) {
    tensors.push_back({prefix + ".embedding", &weights->embedding, {V, H}});
    tensors.push_back({prefix + ".position", &weights->position, {kToyPositionPeriod, H}});
    tensors.push_back({prefix + ".head", &weights->head, {V, H}});
    tensors.push_back({prefix + ".bias", &weights->bias, {V}});
  }

  const std::vector<std::pair<std::string, std::string>> metadata = {
      {"format", "smcgraph-toy-weights-1"},
      {"vocab", std::to_string(toy.vocab)},
      {"hidden", std::to_string(toy.hidden)},
      {"window", std::to_string(toy.window)},
      {"position_period", std::to_string(kToyPositionPeriod)},
      {"pool_size", std::to_string(toy.pool_size)},
      {"max_seq_len", std::to_string(toy.max_seq_len)},
      {"weight_seed", std::to_string(toy.weight_seed)},
      {"draft_perturbation", float_text(draft_perturbation)},
      {"engine.vocab", std::to_string(engine_config.vocab)},
      {"engine.max_seq_len", std::to_string(engine_config.max_seq_len)},
      {"engine.slot_pool_size", std::to_string(engine_config.slot_pool_size)},
      {"engine.max_requests", std::to_string(engine_config.max_requests)},
      {"engine.draft_temperature", float_text(engine_config.draft_temperature)},
      {"engine.target_temperature", float_text(engine_config.target_temperature)},
      {"engine.alpha", float_text(engine_config.alpha)},
      {"engine.tau", float_text(engine_config.tau)},
      {"engine.eos_id", std::to_string(engine_config.eos_id)},
  };
  std::string header = "{\"__metadata__\":{";
  for (size_t i = 0; i < metadata.size(); ++i) {
    if (i)
      header += ',';
    header += json_string(metadata[i].first);
    header += ':';
    header += json_string(metadata[i].second);
  }
  header += "}";
  size_t offset = 0;
  for (const Tensor& tensor : tensors) {
    const size_t bytes = tensor.data->size() * sizeof(float);
    int64_t elements = 1;
    for (const int64_t extent : tensor.shape)
      elements *= extent;
    require(static_cast<size_t>(elements) == tensor.data->size(), "write_toy_weights", "tensor elements",
            tensor.data->size(), "do not match the shape");
    header += ',';
    header += json_string(tensor.name);
    header += ":{\"dtype\":\"F32\",\"shape\":[";
    for (size_t i = 0; i < tensor.shape.size(); ++i) {
      if (i)
        header += ',';
      header += std::to_string(tensor.shape[i]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  while (header.size() % 8 != 0)
    header += ' '; // the data section starts 8-byte aligned

  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty())
    std::filesystem::create_directories(parent);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    throw Error("bucket_sweep: cannot open " + path + " for writing");
  const uint64_t header_bytes = header.size();
  out.write(reinterpret_cast<const char*>(&header_bytes), sizeof(header_bytes));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const Tensor& tensor : tensors)
    out.write(reinterpret_cast<const char*>(tensor.data->data()),
              static_cast<std::streamsize>(tensor.data->size() * sizeof(float)));
  if (!out)
    throw Error("bucket_sweep: writing " + path + " failed");
}

namespace {

/// The validation entries of one kind as a JSON array (`indent` before each entry).
std::string json_validation(const std::vector<ValidationRecord>& validation, const SweepConstants& k,
                            const char* indent) {
  std::ostringstream j;
  j << "[";
  for (size_t v = 0; v < validation.size(); ++v) {
    const ValidationRecord& r = validation[v];
    j << (v ? ",\n" : "\n") << indent << "{\"vocab\": " << r.vocab
      << ", \"dtype\": " << json_string(dtype_name(r.dtype)) << ", \"particles\": " << r.particles
      << ", \"steps\": " << r.steps << ", \"cycles\": " << r.cycles
      << ", \"draft_temperature\": " << float_text(r.draft_temperature)
      << ", \"target_temperature\": 0, \"alpha\": 1, \"tau\": " << float_text(k.engine_defaults.tau)
      << ", \"engine_ok\": " << (r.ok ? "true" : "false") << ",\n"
      << indent << " \"prompts\": [";
    for (size_t p = 0; p < r.prompts.size(); ++p)
      j << (p ? ", " : "") << json_int_array(r.prompts[p]);
    j << "],\n" << indent << " \"tokens\": [";
    for (size_t p = 0; p < r.tokens.size(); ++p)
      j << (p ? ", " : "") << json_int_array(r.tokens[p]);
    j << "]}";
  }
  return j.str();
}

} // namespace

/// `validation`: the smc entries; `spec_validation`: the spec entries (the `spec` section is written when
/// `with_spec`).
void write_manifest(const std::string& path, const Options& o, const Environment& env,
                    const SweepConstants& k, const std::map<int, std::string>& weight_files,
                    const std::vector<ValidationRecord>& validation, bool with_smc, bool with_spec,
                    const std::vector<ValidationRecord>& spec_validation) {
  std::ostringstream j;
  j << "{\n  \"format\": \"smcgraph-bucket-sweep-peer-1\",\n";
  j << "  \"device\": " << json_string(env.device) << ",\n";
  j << "  \"kinds\": [" << (with_smc ? "\"smc\"" : "") << (with_smc && with_spec ? ", " : "")
    << (with_spec ? "\"spec\"" : "") << "],\n";
  j << "  \"vocabs\": [" << join_ints(o.vocabs, ", ") << "],\n";
  j << "  \"dtypes\": [";
  for (size_t i = 0; i < o.dtypes.size(); ++i)
    j << (i ? ", " : "") << json_string(dtype_name(o.dtypes[i]));
  j << "],\n";
  j << "  \"particles\": [" << join_ints(o.particles, ", ") << "],\n";
  j << "  \"steps\": [" << join_ints(smc_steps(o.steps), ", ") << "],\n"; // the SMC cycle's (spec: below)
  j << "  \"requests\": [" << join_ints(o.requests, ", ") << "],\n";
  j << "  \"cycles\": " << o.cycles << ",\n";
  j << "  \"warmup_cycles\": " << kWarmupCycles << ",\n";
  j << "  \"prompt_length\": " << kPromptLength << ",\n";
  j << "  \"timing_prompt\": \"token i of request slot q: ((q + 1) * 7919 + i * 104729) % vocab\",\n";
  j << "  \"max_seq_len\": " << k.max_seq_len << ",\n";
  j << "  \"slot_pool_size\": " << k.pool_size << ",\n";
  j << "  \"draft_temperature\": " << float_text(k.engine_defaults.draft_temperature) << ",\n";
  j << "  \"target_temperature\": " << float_text(k.engine_defaults.target_temperature) << ",\n";
  j << "  \"alpha\": " << float_text(k.engine_defaults.alpha) << ",\n";
  j << "  \"tau\": " << float_text(k.engine_defaults.tau) << ",\n";
  j << "  \"eos_id\": " << k.engine_defaults.eos_id << ",\n";
  j << "  \"toy\": {\"hidden\": " << kToyHidden << ", \"window\": " << kToyWindow
    << ", \"position_period\": " << kToyPositionPeriod << ", \"weight_seed\": " << kWeightSeed
    << ", \"draft_perturbation\": " << float_text(o.draft_perturbation) << "},\n";
  j << "  \"weights\": {";
  bool first = true;
  for (const auto& [vocab, file] : weight_files) {
    j << (first ? "" : ", ") << json_string(std::to_string(vocab)) << ": " << json_string(file);
    first = false;
  }
  j << "},\n";
  j << "  \"validation\": " << json_validation(validation, k, "    ") << "\n  ]";
  if (with_spec) {
    j << ",\n  \"spec\": {\"particles\": 1, \"steps\": [" << join_ints(o.steps, ", ") << "], \"requests\": ["
      << join_ints(o.requests, ", ") << "], \"draft_temperature\": " << float_text(kSpecDraftTemperature)
      << ", \"target_temperature\": " << float_text(kSpecTargetTemperature)
      << ",\n    \"validation\": " << json_validation(spec_validation, k, "      ") << "\n    ]}";
  }
  j << "\n}\n";
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty())
    std::filesystem::create_directories(parent);
  std::ofstream out(path, std::ios::trunc);
  out << j.str();
  if (!out)
    throw Error("bucket_sweep: writing " + path + " failed");
}

} // namespace smcgraph::sweep
