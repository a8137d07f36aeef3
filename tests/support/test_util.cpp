#include "support/test_util.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace smcgraph::test {

static uint64_t fresh_seed() {
  if (const char* fixed = std::getenv("SMCGRAPH_TEST_SEED"))
    return std::strtoull(fixed, nullptr, 0);
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

Rng::Rng() : seed_(fresh_seed()), engine_(seed_) {}

SanitizerTool sanitizer_tool() {
  const char* tool = std::getenv("SMCGRAPH_SANITIZER_TOOL");
  if (tool == nullptr || tool[0] == '\0') {
    const char* flag = std::getenv("SMCGRAPH_UNDER_SANITIZER");
    return flag != nullptr && std::strcmp(flag, "1") == 0 ? SanitizerTool::kOther : SanitizerTool::kNone;
  }
  const std::pair<const char*, SanitizerTool> names[] = {{"memcheck", SanitizerTool::kMemcheck},
                                                         {"racecheck", SanitizerTool::kRacecheck},
                                                         {"synccheck", SanitizerTool::kSynccheck},
                                                         {"initcheck", SanitizerTool::kInitcheck}};
  for (const auto& [name, value] : names)
    if (std::strcmp(tool, name) == 0)
      return value;
  return SanitizerTool::kOther;
}

bool under_sanitizer() {
  return sanitizer_tool() != SanitizerTool::kNone;
}

uint16_t float_to_bf16(float value) {
  const __nv_bfloat16 converted = __float2bfloat16_rn(value);
  uint16_t bits;
  std::memcpy(&bits, &converted, sizeof(bits));
  return bits;
}
float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}
uint16_t float_to_fp16(float value) {
  const __half converted = __float2half_rn(value);
  uint16_t bits;
  std::memcpy(&bits, &converted, sizeof(bits));
  return bits;
}
float fp16_to_float(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
float round_to(DType dtype, float value) {
  switch (dtype) {
  case DType::kFloat32:
    return value;
  case DType::kBFloat16:
    return bf16_to_float(float_to_bf16(value));
  case DType::kFloat16:
    return fp16_to_float(float_to_fp16(value));
  }
  return value;
}

HostLogits encode_logits(DType dtype, const std::vector<float>& values) {
  HostLogits out;
  out.dtype = dtype;
  out.values.resize(values.size());
  out.bytes.resize(values.size() * dtype_bytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    out.values[i] = round_to(dtype, values[i]);
    if (dtype == DType::kFloat32) {
      std::memcpy(out.bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t bits = dtype == DType::kBFloat16 ? float_to_bf16(values[i]) : float_to_fp16(values[i]);
      std::memcpy(out.bytes.data() + 2 * i, &bits, 2);
    }
  }
  return out;
}

CapturedGraph capture_graph(cudaStream_t stream, const std::function<void(cudaStream_t)>& work) {
  cudaGraph_t graph = nullptr;
  SMCGRAPH_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    work(stream);
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph)
      cudaGraphDestroy(graph);
    throw;
  }
  SMCGRAPH_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  return CapturedGraph(graph, &cudaGraphDestroy);
}

GraphExec instantiate_graph(cudaStream_t stream, const std::function<void(cudaStream_t)>& work) {
  const CapturedGraph graph = capture_graph(stream, work);
  cudaGraphExec_t exec = nullptr;
  SMCGRAPH_CUDA_CHECK(cudaGraphInstantiate(&exec, graph.get(), 0));
  return GraphExec(exec, &cudaGraphExecDestroy);
}

void launch(const GraphExec& exec, cudaStream_t stream) {
  SMCGRAPH_CUDA_CHECK(cudaGraphLaunch(exec.get(), stream));
}

void run_on_stream(bool captured, cudaStream_t stream, const std::function<void(cudaStream_t)>& work) {
  if (!captured) {
    work(stream);
    SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  const GraphExec exec = instantiate_graph(stream, work);
  launch(exec, stream);
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// Regularized upper incomplete gamma Q(a, x) via series / continued fraction (Numerical Recipes 6.2).
static double upper_regularized_gamma(double a, double x) {
  if (x <= 0.0)
    return 1.0;
  const double log_prefactor = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1.0) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 100000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::abs(term) < std::abs(sum) * 1e-15)
        break;
    }
    return 1.0 - sum * std::exp(log_prefactor);
  }
  double b = x + 1.0 - a, c = 1.0 / 1e-300, d = 1.0 / b, h = d;
  for (int i = 1; i < 100000; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::abs(d) < 1e-300)
      d = 1e-300;
    c = b + an / c;
    if (std::abs(c) < 1e-300)
      c = 1e-300;
    d = 1.0 / d;
    const double delta = d * c;
    h *= delta;
    if (std::abs(delta - 1.0) < 1e-15)
      break;
  }
  return std::exp(log_prefactor) * h;
}

double chi_square_p_value(double statistic, double dof) {
  return upper_regularized_gamma(dof / 2.0, statistic / 2.0);
}

ChiSquare chi_square_fit(const std::vector<double>& counts, const std::vector<double>& weights) {
  double draws = 0.0, norm = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    draws += counts[i];
    norm += weights[i];
  }
  ChiSquare fit;
  double pooled_expected = 0.0, pooled_count = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (weights[i] == 0.0) {
      if (counts[i] > 0.0)
        return fit; // an impossible outcome was drawn
      continue;
    }
    const double expected = draws * weights[i] / norm;
    if (expected < 5.0) {
      pooled_expected += expected;
      pooled_count += counts[i];
      continue;
    }
    fit.statistic += (counts[i] - expected) * (counts[i] - expected) / expected;
    ++fit.bins;
  }
  if (pooled_expected > 0.0) {
    fit.statistic +=
        (pooled_count - pooled_expected) * (pooled_count - pooled_expected) / std::max(pooled_expected, 1.0);
    ++fit.bins;
  }
  fit.p_value = fit.bins > 1 ? chi_square_p_value(fit.statistic, fit.bins - 1) : 1.0;
  return fit;
}

} // namespace smcgraph::test
