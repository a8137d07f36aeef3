// llama_logits: the Llama model's forward alone, for checks against an independent implementation
// (tests/hf_compare.py) and for choosing a draft by measurement.
//
//   build/examples/llama_logits --model M.gguf --tokens 1,9690,42 --logits-out l.f32 --greedy 32 --greedy-out
//   g.txt
//       prefill of the tokens at positions 0..T-1 (one forward), raw little-endian fp32 logits [T, vocab] to
//       --logits-out; then N greedy tokens by one-token forwards, comma-separated to --greedy-out.
//   build/examples/llama_logits --model M.gguf --tokens ... --greedy 64 --agreement "0-27;0-11,18-29"
//       teacher-forced agreement of each layer-subset draft with the full model's greedy token at every
//       position of the greedy continuation, and each draft's forward time relative to the target's.
//
// Exit status: 0 ok, 1 a CUDA or model error, 2 a bad flag, 77 no CUDA device.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/runtime.hpp"

namespace {

using smcgraph::cli::parse_integer;
using smcgraph::cli::UsageError;

/// Comma-separated token ids, each in [0, 2^31).
std::vector<int> parse_ints(const std::string& text, const char* flag) {
  std::vector<int> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ','))
    values.push_back(parse_integer(flag, item, 0, std::numeric_limits<int>::max()));
  return values;
}

/// Runs forwards of one row whose slot of position p is p + 1.
class Runner {
public:
  Runner(smcgraph::LlamaModel& model, int max_len, int max_tokens) : model_(model), max_len_(max_len) {
    std::vector<int32_t> slots(max_len), positions(max_len);
    for (int p = 0; p < max_len; ++p) {
      slots[p] = p + 1;
      positions[p] = p;
    }
    slot_table_ = upload(slots);
    positions_ = upload(positions);
    tokens_ = smcgraph::DeviceBuffer<int32_t>(max_len);
    seq_len_ = smcgraph::DeviceBuffer<int32_t>(1);
    live_ = smcgraph::DeviceBuffer<uint8_t>(1);
    const uint8_t one = 1;
    SMCGRAPH_CUDA_CHECK(cudaMemcpy(live_.data(), &one, 1, cudaMemcpyHostToDevice));
    logits_ = smcgraph::DeviceBuffer<float>(static_cast<size_t>(max_tokens) * model.vocab());
  }

  /// Forward of tokens at positions begin .. begin + n - 1; returns their logits [n, vocab].
  std::vector<float> forward(const std::vector<int32_t>& tokens, int begin, float* elapsed_ms = nullptr) {
    const int n = static_cast<int>(tokens.size());
    smcgraph::require(begin + n <= max_len_, "llama_logits", "sequence length", begin + n,
                      "exceeds --max-len");
    SMCGRAPH_CUDA_CHECK(
        cudaMemcpy(tokens_.data(), tokens.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice));
    const int32_t seq_len = begin + n;
    SMCGRAPH_CUDA_CHECK(cudaMemcpy(seq_len_.data(), &seq_len, sizeof(int32_t), cudaMemcpyHostToDevice));
    smcgraph::ForwardArgs args{1,
                               n,
                               tokens_.data(),
                               positions_.data() + begin,
                               slot_table_.data(),
                               seq_len_.data(),
                               slot_table_.data() + begin,
                               live_.data(),
                               logits_.data()};
    smcgraph::Event start(true), stop(true);
    start.record(stream_);
    model_.forward(args, stream_);
    stop.record(stream_);
    stream_.synchronize();
    if (elapsed_ms)
      *elapsed_ms = stop.elapsed_ms_since(start);
    std::vector<float> host(static_cast<size_t>(n) * model_.vocab());
    SMCGRAPH_CUDA_CHECK(
        cudaMemcpy(host.data(), logits_.data(), host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return host;
  }

private:
  template <class T> smcgraph::DeviceBuffer<T> upload(const std::vector<T>& host) {
    smcgraph::DeviceBuffer<T> buffer(host.size());
    SMCGRAPH_CUDA_CHECK(
        cudaMemcpy(buffer.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return buffer;
  }
  smcgraph::LlamaModel& model_;
  int max_len_;
  smcgraph::Stream stream_;
  smcgraph::DeviceBuffer<int32_t> slot_table_, positions_, tokens_, seq_len_;
  smcgraph::DeviceBuffer<uint8_t> live_;
  smcgraph::DeviceBuffer<float> logits_;
};

int argmax(const float* row, int vocab) {
  return static_cast<int>(std::max_element(row, row + vocab) - row);
}

int run(int argc, char** argv) {
  std::string model_path, tokens_text, logits_out, greedy_out, agreement;
  int greedy = 0, max_len = 2048;
  smcgraph::cli::Flags flags(argc, argv);
  while (flags.next()) {
    const std::string& flag = flags.flag();
    if (flag == "--model")
      model_path = flags.value();
    else if (flag == "--tokens")
      tokens_text = flags.value();
    else if (flag == "--logits-out")
      logits_out = flags.value();
    else if (flag == "--greedy")
      greedy = parse_integer(flag, flags.value(), 0, 1 << 20);
    else if (flag == "--greedy-out")
      greedy_out = flags.value();
    else if (flag == "--agreement")
      agreement = flags.value();
    else if (flag == "--max-len")
      max_len = parse_integer(flag, flags.value(), 1, 1 << 24);
    else
      throw UsageError{"unknown flag '" + flags.raw() + "'"};
  }
  if (model_path.empty() || tokens_text.empty())
    throw UsageError{"--model and --tokens are required"};
  const std::vector<int> prompt = parse_ints(tokens_text, "--tokens");
  if (prompt.empty())
    throw UsageError{"--tokens must name at least one token"};
  if (smcgraph::cuda_device_count() == 0) {
    std::fprintf(stderr, "llama_logits: no CUDA device\n");
    return 77;
  }
  const smcgraph::GgufFile file = smcgraph::GgufFile::open(model_path);
  auto weights = smcgraph::load_llama_weights(file);
  smcgraph::LlamaModelOptions options;
  options.pool_size = max_len + 1;
  options.max_seq_len = max_len;
  options.max_tokens_per_forward = std::max<int>(static_cast<int>(prompt.size()), 1);
  smcgraph::LlamaModel target(weights, options);
  const int vocab = target.vocab();
  Runner runner(target, max_len, options.max_tokens_per_forward);

  const std::vector<float> logits = runner.forward(std::vector<int32_t>(prompt.begin(), prompt.end()), 0);
  if (!logits_out.empty()) {
    std::ofstream out(logits_out, std::ios::binary);
    out.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * 4));
    smcgraph::require(static_cast<bool>(out), "llama_logits", "--logits-out", logits_out,
                      "could not be written");
  }
  std::vector<int32_t> sequence(prompt.begin(), prompt.end());
  std::vector<int32_t> continuation;
  int next = argmax(logits.data() + (prompt.size() - 1) * vocab, vocab);
  float target_ms_sum = 0.0f;
  for (int i = 0; i < greedy; ++i) {
    continuation.push_back(next);
    sequence.push_back(next);
    if (i + 1 == greedy)
      break;
    float ms = 0.0f;
    const std::vector<float> step = runner.forward({next}, static_cast<int>(sequence.size()) - 1, &ms);
    target_ms_sum += ms;
    next = argmax(step.data(), vocab);
  }
  if (!greedy_out.empty()) {
    std::ofstream out(greedy_out);
    for (size_t i = 0; i < continuation.size(); ++i)
      out << (i ? "," : "") << continuation[i];
    out << "\n";
  }
  std::printf("prompt %zu tokens, greedy %d tokens; target one-token forward (eager) %.1f us mean\n",
              prompt.size(), greedy, greedy > 1 ? 1000.0 * target_ms_sum / (greedy - 1) : 0.0);

  // Teacher-forced agreement of layer-subset drafts with the target's greedy tokens.
  std::stringstream subsets(agreement);
  std::string subset;
  while (!agreement.empty() && std::getline(subsets, subset, ';')) {
    smcgraph::LlamaModelOptions draft_options = options;
    draft_options.layers = smcgraph::parse_llama_layers(subset);
    smcgraph::LlamaModel draft(weights, draft_options);
    Runner draft_runner(draft, max_len, options.max_tokens_per_forward);
    // Prefill the prompt, then feed the target's tokens one at a time.
    std::vector<float> draft_logits =
        draft_runner.forward(std::vector<int32_t>(prompt.begin(), prompt.end()), 0);
    int agree = 0;
    float draft_ms_sum = 0.0f;
    int draft_next = argmax(draft_logits.data() + (prompt.size() - 1) * vocab, vocab);
    for (size_t i = 0; i < continuation.size(); ++i) {
      agree += draft_next == continuation[i];
      if (i + 1 == continuation.size())
        break;
      float ms = 0.0f;
      draft_logits = draft_runner.forward({continuation[i]}, static_cast<int>(prompt.size() + i), &ms);
      draft_ms_sum += ms;
      draft_next = argmax(draft_logits.data(), vocab);
    }
    std::printf("draft layers %s (%zu of %d): agreement %d / %zu = %.3f, forward time %.2fx the target's\n",
                subset.c_str(), draft_options.layers.size(), target.config().layers, agree,
                continuation.size(),
                continuation.empty() ? 0.0 : static_cast<double>(agree) / continuation.size(),
                target_ms_sum > 0 ? draft_ms_sum / target_ms_sum : 0.0);
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return smcgraph::cli::run_main("llama_logits", [&] { return run(argc, argv); });
}
