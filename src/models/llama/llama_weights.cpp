// Host side of the Llama model: the architecture from the GGUF metadata, the weights dequantised to bf16 on
// the host, and the option checks. No CUDA call here (the CPU suites and the fuzz builds link this file
// alone).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "smcgraph/error.hpp"
#include "smcgraph/llama_model.hpp"

namespace smcgraph {
namespace {

constexpr const char* kConfigWhere = "llama_config_from_gguf";

int config_int(const GgufFile& file, const std::string& key, int64_t low, int64_t high) {
  require(file.has(key), kConfigWhere, "key", key, "is missing");
  const int64_t value = file.get_int(key);
  require(value >= low && value <= high, kConfigWhere, key.c_str(), value,
          ("must be in [" + std::to_string(low) + ", " + std::to_string(high) + "]").c_str());
  return static_cast<int>(value);
}

std::string layer_key(int layer, const char* name) {
  return "blk." + std::to_string(layer) + "." + name + ".weight";
}

} // namespace

LlamaConfig llama_config_from_gguf(const GgufFile& file) {
  require(file.has("general.architecture"), kConfigWhere, "key", "general.architecture", "is missing");
  const std::string architecture = file.get_string("general.architecture");
  require(architecture == "llama", kConfigWhere, "general.architecture", architecture, "must be \"llama\"");
  LlamaConfig c;
  c.layers = config_int(file, "llama.block_count", 1, 1024);
  c.hidden = config_int(file, "llama.embedding_length", 1, 1 << 16);
  c.ffn = config_int(file, "llama.feed_forward_length", 1, 1 << 18);
  c.heads = config_int(file, "llama.attention.head_count", 1, 1024);
  c.kv_heads = file.has("llama.attention.head_count_kv")
                   ? config_int(file, "llama.attention.head_count_kv", 1, 1024)
                   : c.heads;
  c.context = config_int(file, "llama.context_length", 1, 1 << 24);
  require(c.hidden % 16 == 0 && c.hidden <= kLlamaMaxHidden, kConfigWhere, "llama.embedding_length", c.hidden,
          "must be a multiple of 16 and <= kLlamaMaxHidden (1024)");
  require(c.hidden % c.heads == 0, kConfigWhere, "llama.embedding_length", c.hidden,
          "must be a multiple of llama.attention.head_count");
  c.head_dim = c.hidden / c.heads;
  if (file.has("llama.rope.dimension_count")) {
    const int64_t rope_dims = file.get_int("llama.rope.dimension_count");
    require(rope_dims == c.head_dim, kConfigWhere, "llama.rope.dimension_count", rope_dims,
            "must equal the head dimension (partial RoPE is not supported)");
  }
  require(c.head_dim % 16 == 0 && c.head_dim <= kLlamaMaxHeadDim, kConfigWhere, "head_dim", c.head_dim,
          "must be a multiple of 16 and <= kLlamaMaxHeadDim (128)");
  require(c.heads % c.kv_heads == 0, kConfigWhere, "llama.attention.head_count_kv", c.kv_heads,
          "must divide llama.attention.head_count");
  require(c.ffn % 16 == 0, kConfigWhere, "llama.feed_forward_length", c.ffn, "must be a multiple of 16");
  c.rope_base = static_cast<float>(file.get_float("llama.rope.freq_base", 10000.0));
  require(std::isfinite(c.rope_base) && c.rope_base > 1.0f, kConfigWhere, "llama.rope.freq_base", c.rope_base,
          "must be finite and > 1");
  c.rms_eps = static_cast<float>(file.get_float("llama.attention.layer_norm_rms_epsilon", 1e-5));
  require(std::isfinite(c.rms_eps) && c.rms_eps > 0.0f && c.rms_eps < 1.0f, kConfigWhere,
          "llama.attention.layer_norm_rms_epsilon", c.rms_eps, "must be in (0, 1)");
  const GgufTensorInfo& embd = file.tensor("token_embd.weight");
  require(embd.dims.size() == 2 && embd.dims[0] == c.hidden, kConfigWhere, "token_embd.weight dims[0]",
          embd.dims.empty() ? -1 : embd.dims[0], "must equal llama.embedding_length");
  require(embd.dims[1] >= 1 && embd.dims[1] <= (int64_t{1} << 24), kConfigWhere, "token_embd.weight dims[1]",
          embd.dims[1], "(vocabulary) must be in [1, 2^24]");
  c.vocab = static_cast<int>(embd.dims[1]);
  if (file.has("llama.vocab_size")) {
    const int64_t vocab = file.get_int("llama.vocab_size");
    require(vocab == c.vocab, kConfigWhere, "llama.vocab_size", vocab,
            "must equal the rows of token_embd.weight");
  }
  c.tied_head = file.find_tensor("output.weight") == nullptr;
  return c;
}

LlamaHostWeights load_llama_host_weights(const GgufFile& file) {
  LlamaHostWeights w;
  w.config = llama_config_from_gguf(file);
  const LlamaConfig& c = w.config;
  const int64_t H = c.hidden, F = c.ffn, qd = int64_t{c.heads} * c.head_dim,
                kvd = int64_t{c.kv_heads} * c.head_dim;
  w.token_embd = file.tensor_bf16("token_embd.weight", {H, c.vocab});
  if (!c.tied_head)
    w.output = file.tensor_bf16("output.weight", {H, c.vocab});
  w.output_norm = file.tensor_f32("output_norm.weight", {H});
  w.layers.resize(c.layers);
  for (int l = 0; l < c.layers; ++l) {
    LlamaHostWeights::Layer& layer = w.layers[l];
    layer.attn_norm = file.tensor_f32(layer_key(l, "attn_norm"), {H});
    layer.ffn_norm = file.tensor_f32(layer_key(l, "ffn_norm"), {H});
    layer.q = file.tensor_bf16(layer_key(l, "attn_q"), {H, qd});
    layer.k = file.tensor_bf16(layer_key(l, "attn_k"), {H, kvd});
    layer.v = file.tensor_bf16(layer_key(l, "attn_v"), {H, kvd});
    layer.o = file.tensor_bf16(layer_key(l, "attn_output"), {qd, H});
    layer.gate = file.tensor_bf16(layer_key(l, "ffn_gate"), {H, F});
    layer.up = file.tensor_bf16(layer_key(l, "ffn_up"), {H, F});
    layer.down = file.tensor_bf16(layer_key(l, "ffn_down"), {F, H});
  }
  // The head's Q8_0 blocks as they are (the int8 head dequantises them itself, to the same bf16 values).
  const GgufTensorInfo& head = c.tied_head ? file.tensor("token_embd.weight") : file.tensor("output.weight");
  if (head.type == GgufType::kQ8_0 && H % 32 == 0) {
    std::vector<int8_t> values(static_cast<size_t>(head.elements));
    std::vector<float> scales(values.size() / 32);
    split_q8_0(file.tensor_data(head), head.elements, values.data(), scales.data());
    if (std::all_of(scales.begin(), scales.end(), [](float scale) { return std::isfinite(scale); })) {
      w.head_q8 = std::move(values);
      w.head_q8_scales = std::move(scales);
    }
  }
  return w;
}

std::vector<int> llama_layer_range(int first, int last) {
  require(first >= 0 && first <= last, "llama_layer_range", "first", first, "must be in [0, last]");
  std::vector<int> layers;
  for (int l = first; l < last; ++l)
    layers.push_back(l);
  return layers;
}

std::vector<int> parse_llama_layers(const std::string& text) {
  std::vector<int> layers;
  std::stringstream stream(text);
  std::string item;
  const auto number = [&](const std::string& digits) {
    require(
        !digits.empty() && digits.size() <= 6 && digits.find_first_not_of("0123456789") == std::string::npos,
        "parse_llama_layers", "layers", text, "must be layers or ranges a-b separated by commas, e.g. 0-27");
    return std::stoi(digits);
  };
  while (std::getline(stream, item, ',')) {
    const size_t dash = item.find('-');
    const int first = number(item.substr(0, dash));
    const int last = dash == std::string::npos ? first : number(item.substr(dash + 1));
    require(first <= last, "parse_llama_layers", "layers", text, "has a range a-b with a > b");
    for (int l = first; l <= last; ++l)
      layers.push_back(l);
  }
  require(!layers.empty(), "parse_llama_layers", "layers", text, "names no layer");
  return layers;
}

std::string default_llama_model_path() {
  if (const char* path = std::getenv("SMCGRAPH_MODEL_PATH"); path != nullptr && *path != '\0')
    return path;
  const std::filesystem::path relative = std::filesystem::path(".cache") / "models" / kSmolLM2FileName;
  if (const char* root = std::getenv("SMCGRAPH_SOURCE_ROOT"); root != nullptr && *root != '\0')
    return (std::filesystem::path(root) / relative).string();
  std::error_code error;
  for (std::filesystem::path dir = std::filesystem::current_path(error); !error && !dir.empty();
       dir = dir.parent_path()) {
    if (std::filesystem::exists(dir / relative, error))
      return (dir / relative).string();
    if (dir == dir.parent_path())
      break;
  }
  return relative.string();
}

void validate_llama_options(const LlamaConfig& config, const LlamaModelOptions& options) {
  constexpr const char* kWhere = "LlamaModelOptions";
  require(options.pool_size >= 2, kWhere, "pool_size", options.pool_size,
          "must be >= 2 (slot 0 is the dummy)");
  require(options.max_seq_len >= 1 && options.max_seq_len <= config.context, kWhere, "max_seq_len",
          options.max_seq_len, "must be in [1, the model's context length]");
  require(options.max_tokens_per_forward >= 1 && options.max_tokens_per_forward <= (1 << 20), kWhere,
          "max_tokens_per_forward", options.max_tokens_per_forward, "must be in [1, 2^20]");
  require(options.tensor_core_attention_tokens >= 0, kWhere, "tensor_core_attention_tokens",
          options.tensor_core_attention_tokens, "must be >= 0 (0: never)");
  require(options.prefill_gemm_tokens >= 0, kWhere, "prefill_gemm_tokens", options.prefill_gemm_tokens,
          "must be >= 0 (0: never)");
  require(options.logits_dtype == DType::kFloat32 || options.logits_dtype == DType::kBFloat16, kWhere,
          "logits_dtype", dtype_name(options.logits_dtype), "must be fp32 or bf16");
  for (size_t i = 0; i < options.layers.size(); ++i) {
    const int layer = options.layers[i];
    require(layer >= 0 && layer < config.layers, kWhere, "layers[i]", layer,
            "must be a layer index of the model");
    require(i == 0 || layer > options.layers[i - 1], kWhere, "layers[i]", layer,
            "must be strictly increasing");
  }
}

} // namespace smcgraph
