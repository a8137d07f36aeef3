// Helpers shared by the test suites: fresh random inputs (seed printed so a failure reproduces), low
// precision conversions, poisoning, and running the same work eagerly and inside a captured graph.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>

#include "smcgraph/model.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/types.hpp"

namespace smcgraph::test {

/// A generator seeded freshly per run unless SMCGRAPH_TEST_SEED is set; the seed is printed via MESSAGE
/// by callers through `seed()`.
class Rng {
public:
  Rng();
  explicit Rng(uint64_t seed) : seed_(seed), engine_(seed) {}
  uint64_t seed() const { return seed_; }
  std::mt19937_64& engine() { return engine_; }
  double uniform(double lo = 0.0, double hi = 1.0) {
    return std::uniform_real_distribution<double>(lo, hi)(engine_);
  }
  double normal(double mean = 0.0, double stddev = 1.0) {
    return std::normal_distribution<double>(mean, stddev)(engine_);
  }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(engine_); }
  uint64_t bits() { return engine_(); }

private:
  uint64_t seed_;
  std::mt19937_64 engine_;
};

/// An environment variable (SMCGRAPH_ATTENTION_GROUPING, SMCGRAPH_LM_HEAD, SMCGRAPH_DISABLE_PREFIX_RESUME,
/// ...) set for a scope and restored on every way out, a throw included: no later test in the process
/// inherits it, and a value the harness set (gpu_main.cpp: SMCGRAPH_LM_HEAD=own_gemm under initcheck) comes
/// back.
class ScopedEnv {
public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name))
      old_ = old;
    if (setenv(name, value, 1) != 0)
      throw std::runtime_error(std::string("ScopedEnv: setenv ") + name + " failed");
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

private:
  const char* name_;
  std::optional<std::string> old_;
};

/// float -> bf16 / fp16 (round to nearest even) and back; `round_to` returns the float the device will see.
uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);
uint16_t float_to_fp16(float value);
float fp16_to_float(uint16_t bits);
float round_to(DType dtype, float value);

/// Host logits stored in `dtype` (bytes ready to copy to the device) plus the floats they represent.
struct HostLogits {
  DType dtype = DType::kFloat32;
  std::vector<uint8_t> bytes;
  std::vector<float> values;
};
HostLogits encode_logits(DType dtype, const std::vector<float>& values);

/// A captured graph, destroyed with the object.
using CapturedGraph = std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, decltype(&cudaGraphDestroy)>;

/// `work` on `stream` captured into a graph (thread-local capture mode), not run; a throw from `work` ends
/// the capture and discards the graph before it propagates.
CapturedGraph capture_graph(cudaStream_t stream, const std::function<void(cudaStream_t)>& work);

/// An instantiated graph, destroyed with the object.
using GraphExec = std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, decltype(&cudaGraphExecDestroy)>;

/// `work` on `stream` captured (capture_graph) and instantiated, ready to replay with launch(); the graph
/// itself is discarded once instantiated.
GraphExec instantiate_graph(cudaStream_t stream, const std::function<void(cudaStream_t)>& work);

/// One replay of `exec` on `stream` (not synchronized).
void launch(const GraphExec& exec, cudaStream_t stream);

/// Runs `work` on `stream` eagerly (captured = false) or captured into a graph and replayed once.
void run_on_stream(bool captured, cudaStream_t stream, const std::function<void(cudaStream_t)>& work);

/// Copies a device array to a host vector (synchronizing the stream).
template <class T> std::vector<T> to_host(const T* d_data, size_t count, cudaStream_t stream) {
  std::vector<T> host(count);
  if (count > 0) {
    SMCGRAPH_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), d_data, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
  }
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}
template <class T> DeviceBuffer<T> to_device(const std::vector<T>& host, cudaStream_t stream) {
  DeviceBuffer<T> buffer(host.size());
  if (!host.empty())
    buffer.copy_from_host(host.data(), host.size(), stream);
  return buffer;
}

/// The compute-sanitizer tool a test runs under: the meson setups (tests/meson.build) set
/// SMCGRAPH_UNDER_SANITIZER=1 and SMCGRAPH_SANITIZER_TOOL=memcheck / racecheck / synccheck / initcheck.
enum class SanitizerTool { kNone, kMemcheck, kRacecheck, kSynccheck, kInitcheck, kOther };
SanitizerTool sanitizer_tool();

/// True under any compute-sanitizer setup. The tools slow kernels down 10-1000x (racecheck most, on kernels
/// that use shared memory), so long loops, statistical draws and large shapes shrink there: the same kernels,
/// code paths and assertions, fewer repetitions and smaller sizes (statistical thresholds stay valid for the
/// smaller counts).
bool under_sanitizer();

/// `full` normally, `reduced` under a sanitizer.
/// Dense [rows, per_row] tokens placed at column 1 .. per_row of rows `stride` apart, `fill` around them: a
/// strided token input (ForwardArgs::token_row_stride) that reads `fill` wherever it strays.
inline std::vector<int32_t> widen_rows(const std::vector<int32_t>& dense, int rows, int per_row,
                                       int64_t stride, int32_t fill) {
  std::vector<int32_t> wide(static_cast<size_t>(rows) * stride, fill);
  for (int r = 0; r < rows; ++r)
    std::copy_n(dense.begin() + static_cast<size_t>(r) * per_row, per_row, wide.begin() + r * stride + 1);
  return wide;
}

/// Columns 0 .. per_row - 1 of every row of a [rows, stride] block of `row_bytes`-byte entries (logits
/// written with ForwardArgs::io_row_stride = stride), packed densely; `rest_untouched` says whether every
/// other column still holds `poison` bytes only.
inline std::vector<uint8_t> narrow_rows(const std::vector<uint8_t>& wide, int rows, int per_row,
                                        int64_t stride, size_t row_bytes, uint8_t poison,
                                        bool& rest_untouched) {
  std::vector<uint8_t> dense;
  dense.reserve(static_cast<size_t>(rows) * per_row * row_bytes);
  rest_untouched = true;
  for (int r = 0; r < rows; ++r) {
    const auto row = wide.begin() + static_cast<size_t>(r) * stride * row_bytes;
    dense.insert(dense.end(), row, row + per_row * row_bytes);
    rest_untouched = rest_untouched && std::all_of(row + per_row * row_bytes, row + stride * row_bytes,
                                                   [poison](uint8_t b) { return b == poison; });
  }
  return dense;
}

/// A forward's per-token inputs laid out with a row stride, as the engine passes them: tokens at columns
/// 1 .. per_row of rows `stride` apart (ForwardArgs::token_row_stride) and, for an io-strided forward, the
/// positions and out slots likewise and a [rows, stride] block of `row_bytes`-byte logits rows
/// (ForwardArgs::io_row_stride). Entries outside a row's columns hold values that break the forward if read
/// (token -7, position -5, slot -1) or poison (logits).
struct StridedForward {
  int rows = 0, per_row = 0;
  int64_t stride = 0;
  size_t row_bytes = 0;
  DeviceBuffer<int32_t> tokens, positions, out_slots;
  DeviceBuffer<uint8_t> logits;

  StridedForward(const std::vector<int32_t>& dense_tokens, const std::vector<int32_t>& dense_positions,
                 const std::vector<int32_t>& dense_out_slots, int row_count, int tokens_per_row,
                 int64_t row_stride, size_t logits_row_bytes, cudaStream_t stream)
      : rows(row_count), per_row(tokens_per_row), stride(row_stride), row_bytes(logits_row_bytes),
        tokens(to_device(widen_rows(dense_tokens, rows, per_row, stride, -7), stream)),
        positions(to_device(widen_rows(dense_positions, rows, per_row, stride, -5), stream)),
        out_slots(to_device(widen_rows(dense_out_slots, rows, per_row, stride, -1), stream)),
        logits(static_cast<size_t>(rows) * stride * row_bytes) {}

  /// `dense` reading its tokens with the stride and, when `io_strided`, its positions, out slots and logits
  /// too (the logits block poisoned first).
  ForwardArgs args(ForwardArgs dense, bool io_strided, uint8_t poison, cudaStream_t stream) {
    dense.tokens = tokens.data() + 1;
    dense.token_row_stride = stride;
    if (io_strided) {
      logits.fill_bytes(poison, stream);
      dense.positions = positions.data() + 1;
      dense.out_slots = out_slots.data() + 1;
      dense.logits = logits.data();
      dense.io_row_stride = stride;
    }
    return dense;
  }

  /// The io-strided forward's logits packed densely ([rows, per_row]); `rest_untouched` says whether every
  /// other column still holds the poison.
  std::vector<uint8_t> dense_logits(uint8_t poison, bool& rest_untouched, cudaStream_t stream) const {
    return narrow_rows(to_host(logits.data(), logits.size(), stream), rows, per_row, stride, row_bytes,
                       poison, rest_untouched);
  }
};

inline int sanitizer_scaled(int full, int reduced) {
  return under_sanitizer() ? reduced : full;
}
/// `full` normally, `racecheck` under racecheck (the slowest tool), `reduced` under the other tools.
inline int sanitizer_scaled(int full, int reduced, int racecheck) {
  return sanitizer_tool() == SanitizerTool::kRacecheck ? racecheck : sanitizer_scaled(full, reduced);
}

/// True where the conditional-node draft loop is not run (gpu_main.cpp says why): under any compute-sanitizer
/// tool. Tests that switch SMCGRAPH_DISABLE_CONDITIONAL themselves keep it at 1 there.
inline bool sanitizer_blocks_conditional_nodes() {
  return under_sanitizer();
}

/// A chi-square check that tolerates its own false alarms: `fit()` draws a fresh, independent sample and fits
/// it (its result has a `p_value`); a p-value at or below `alpha` is tested once more on a new sample, and
/// the second fit is returned. A correct sampler fails one fit in 1 / alpha, two in a row once in 1 /
/// alpha^2, while a biased one fails both.
template <class Fit> Fit confirmed_fit(const std::function<Fit()>& fit, double alpha = 1e-4) {
  const Fit first = fit();
  if (first.p_value > alpha)
    return first;
  std::fprintf(stderr, "chi-square p = %g <= %g: drawn again to confirm\n", first.p_value, alpha);
  return fit();
}

/// Relative closeness with an absolute floor: |a - b| <= tol * max(1, |b|).
inline bool close_to(double a, double b, double tol) {
  if (a == b)
    return true; // also equal infinities
  const double scale = std::max(1.0, std::abs(b));
  return std::abs(a - b) <= tol * scale;
}

/// Upper tail probability of a chi-square variable with `dof` degrees of freedom.
double chi_square_p_value(double statistic, double dof);

/// Goodness of fit of `counts` (draws per outcome) to `weights` (unnormalised probabilities, same length):
/// Pearson's chi-square with the bins of expected count < 5 pooled into one, so the approximation holds at
/// any draw count. A draw in a zero-weight bin gives p = 0.
struct ChiSquare {
  double statistic = 0.0, p_value = 0.0;
  int bins = 0;
};
ChiSquare chi_square_fit(const std::vector<double>& counts, const std::vector<double>& weights);

} // namespace smcgraph::test
