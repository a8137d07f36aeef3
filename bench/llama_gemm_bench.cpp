// llama_gemm_bench: the Llama forward's own GEMM (src/models/llama/llama_gemm.cu, the residual-add epilogue:
// the plain product plus a read-modify-write of the output; its narrow / wide tiles and its pipelined tiles,
// each forced) against cuBLASLt on the same shapes, bf16
// operands and fp32 accumulation, so the choice between them stands on a measurement (issue 12: "cuBLASLt or
// your own kernels where a bench shows they win").
//
//   build/bench/llama_gemm_bench [--tokens 1,5,8,40,64,512] [--csv results/llama_gemm_bench.csv]
//
// Shapes: SmolLM2-135M's projections (hidden 576, 9 + 2 x 3 heads of 64, ffn 1536, vocabulary 49152):
// qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536, head 49152 x 576; T tokens each.
// Y[T, N] = A[T, K] W[N, K]^T. Both are validated against each other first (max relative difference), then
// each is timed twice in CUDA graphs (median per launch, CUDA events): "hot", 20 launches on one weight
// matrix (after the first it sits in L2: the latency of the kernel alone), and "cold", one launch per copy of
// the weights over copies that together exceed 4x the L2 (every launch reads W from HBM, as each layer of a
// real forward does). The floor is the bytes a launch must move (W, A, Y read and written) over the copy
// bandwidth of the same run, plus one graph node; ours/flr compares the cold time with it.
//
// Then the LM head as the forward runs it (llama::LtHead, head 49152 x 576, fp32 logits from fp32 rows, on
// Q8_0 weights and their bf16 dequantisation, as SmolLM2's file gives them): the int8 head and the
// bf16 small head (up to 16 tokens each; both one kernel that normalises the rows itself) against the
// norm kernel plus cuBLASLt's pinned matmul, cold, after checking that they give the same bits (CSV rows with
// shape "lm_head": smcgraph_cold_us the int8 head, pipelined_cold_us the bf16 small head, cublaslt_cold_us
// the norm and cuBLASLt, floor_us the int8 head's bytes). Exit status: 0; 1 when any pair disagrees; 2 when
// it cannot run (no GPU, bad flags).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "bench_util.hpp"
#include "cli.hpp"
#include "models/llama/llama_kernels.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"

namespace {

using namespace smcgraph;

#define LT_CHECK(call)                                                                                       \
  do {                                                                                                       \
    const cublasStatus_t status_ = (call);                                                                   \
    if (status_ != CUBLAS_STATUS_SUCCESS)                                                                    \
      throw smcgraph::Error(std::string("cuBLASLt: ") + #call + " returned status " +                        \
                            std::to_string(static_cast<int>(status_)));                                      \
  } while (0)

struct Shape {
  const char* name;
  int n, k;
};
constexpr Shape kShapes[] = {
    {"qkv", 960, 576}, {"o", 576, 576}, {"gate_up", 3072, 576}, {"down", 576, 1536}, {"head", 49152, 576}};
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

DeviceBuffer<uint16_t> random_bf16(size_t count, float scale, std::mt19937_64& rng, cudaStream_t stream) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<uint16_t> host(count);
  for (uint16_t& value : host)
    value = bench::float_to_bf16(normal(rng));
  DeviceBuffer<uint16_t> device(count);
  device.copy_from_host(host.data(), count, stream);
  return device;
}

/// cuBLASLt's Y^T[N, T] = W[N, K] A^T (column-major view of the row-major Y[T, N]), fp32 out.
class LtGemm {
public:
  LtGemm(int tokens, int n, int k) {
    LT_CHECK(cublasLtCreate(&handle_));
    LT_CHECK(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)));
    LT_CHECK(cublasLtMatrixLayoutCreate(&w_, CUDA_R_16BF, k, n, k));      // W^T column-major = W row-major
    LT_CHECK(cublasLtMatrixLayoutCreate(&a_, CUDA_R_16BF, k, tokens, k)); // A^T column-major = A row-major
    LT_CHECK(cublasLtMatrixLayoutCreate(&y_, CUDA_R_32F, n, tokens, n));  // Y^T column-major = Y row-major
    LT_CHECK(cublasLtMatmulPreferenceCreate(&preference_));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &kLtWorkspaceBytes, sizeof(kLtWorkspaceBytes)));
    int returned = 0;
    LT_CHECK(
        cublasLtMatmulAlgoGetHeuristic(handle_, op_, w_, a_, y_, y_, preference_, 1, &heuristic_, &returned));
    require(returned >= 1, "LtGemm", "heuristics", returned, "cuBLASLt offered no algorithm");
    workspace_ = DeviceBuffer<uint8_t>(kLtWorkspaceBytes);
  }
  ~LtGemm() {
    cublasLtMatmulPreferenceDestroy(preference_);
    cublasLtMatrixLayoutDestroy(y_);
    cublasLtMatrixLayoutDestroy(a_);
    cublasLtMatrixLayoutDestroy(w_);
    cublasLtMatmulDescDestroy(op_);
    cublasLtDestroy(handle_);
  }
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void run(const uint16_t* w, const uint16_t* a, float* y, cudaStream_t stream) {
    const float alpha = 1.0f, beta = 0.0f;
    LT_CHECK(cublasLtMatmul(handle_, op_, &alpha, w, w_, a, a_, &beta, y, y_, y, y_, &heuristic_.algo,
                            workspace_.data(), kLtWorkspaceBytes, stream));
  }

private:
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t w_ = nullptr, a_ = nullptr, y_ = nullptr;
  cublasLtMatmulPreference_t preference_ = nullptr;
  cublasLtMatmulHeuristicResult_t heuristic_{};
  DeviceBuffer<uint8_t> workspace_;
};

/// A comma-separated list of token counts in [1, 4096].
std::vector<int> parse_tokens(const std::string& flag, const std::string& text) {
  std::vector<int> counts;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ','))
    counts.push_back(cli::parse_integer(flag, item, 1, 4096));
  if (counts.empty())
    throw cli::bad_value(flag, text, "expected comma-separated token counts");
  return counts;
}

/// Copies of `w` ([count] bf16) that together exceed `cold_bytes` (at least 2): one launch per copy reads its
/// weights from HBM, as each layer of a real forward does.
std::vector<DeviceBuffer<uint16_t>> cold_copies(const DeviceBuffer<uint16_t>& w, size_t count,
                                                size_t cold_bytes, cudaStream_t stream) {
  const size_t copies = std::max<size_t>(2, (cold_bytes + 2 * count - 1) / (2 * count));
  std::vector<DeviceBuffer<uint16_t>> cold;
  for (size_t c = 0; c < copies; ++c) {
    cold.emplace_back(count);
    SMCGRAPH_CUDA_CHECK(
        cudaMemcpyAsync(cold.back().data(), w.data(), 2 * count, cudaMemcpyDeviceToDevice, stream));
  }
  return cold;
}

/// The LM head's paths: the int8 head (LtHead by size with Q8_0 weights: up to kQ8HeadMaxTokens tokens), the
/// bf16 small head (up to kSmallHeadMaxTokens) and the norm kernel plus cuBLASLt's matmul, on weights that
/// are Q8_0 values and the bf16 of their dequantisation (as a Q8_0 file's head loads), checked for equal
/// bits, then timed cold. False when any two differ.
bool time_lm_head(const std::vector<int>& token_counts, double copy_gbs, double node_us, size_t cold_bytes,
                  std::mt19937_64& rng, cudaStream_t stream, bench::Csv& csv) {
  constexpr int kVocab = 49152, kHidden = 576;
  const size_t w_count = static_cast<size_t>(kVocab) * kHidden;
  // Q8_0 blocks: int8 values and fp16 scales of 1.2e-4 to 4.9e-4 (weights up to about 0.06, like SmolLM2's).
  std::vector<int8_t> q8_rows(w_count);
  std::vector<float> q8_row_scales(w_count / 32);
  std::vector<uint16_t> host_w(w_count);
  std::uniform_int_distribution<int> value(-127, 127), significand(1024, 2047), exponent(-23, -22);
  for (float& scale : q8_row_scales) // m 2^e with an 11-bit m: exact in fp16, as the file stores scales
    scale = std::ldexp(static_cast<float>(significand(rng)), exponent(rng));
  for (size_t i = 0; i < w_count; ++i) {
    q8_rows[i] = static_cast<int8_t>(value(rng));
    host_w[i] = gguf_float_to_bf16(static_cast<float>(q8_rows[i]) * q8_row_scales[i / 32]);
  }
  std::vector<int8_t> q8_host;
  std::vector<float> q8_scales_host;
  llama::q8_head_layout(q8_rows.data(), q8_row_scales.data(), kVocab, kVocab, kHidden, q8_host,
                        q8_scales_host);
  DeviceBuffer<uint16_t> w(w_count);
  w.copy_from_host(host_w.data(), w_count, stream);
  const std::vector<DeviceBuffer<uint16_t>> cold_w = cold_copies(w, w_count, cold_bytes, stream);
  const int copies = static_cast<int>(cold_w.size());
  // The int8 weights' cold copies: as many as the bf16 ones (each 56% of their bytes, so they exceed 2x L2).
  std::vector<DeviceBuffer<int8_t>> cold_q8;
  std::vector<DeviceBuffer<float>> cold_scales;
  for (int c = 0; c < copies; ++c) {
    cold_q8.emplace_back(q8_host.size());
    cold_q8.back().copy_from_host(q8_host.data(), q8_host.size(), stream);
    cold_scales.emplace_back(q8_scales_host.size());
    cold_scales.back().copy_from_host(q8_scales_host.data(), q8_scales_host.size(), stream);
  }
  const int max_tokens = *std::max_element(token_counts.begin(), token_counts.end());
  llama::LtHead q8_head(kVocab, kHidden, max_tokens, DType::kFloat32, llama::HeadKernels::kBySize);
  llama::LtHead small_head(kVocab, kHidden, max_tokens, DType::kFloat32, llama::HeadKernels::kSmallBf16);
  llama::LtHead lt_only(kVocab, kHidden, max_tokens, DType::kFloat32, llama::HeadKernels::kCublasLt);
  if (!lt_only.usable()) {
    std::printf("lm_head: cuBLASLt offers no pinned algorithm here; not timed\n");
    return true;
  }
  std::printf("\nLM head (llama::LtHead, %d x %d, fp32 logits; us a launch cold, CUDA graph median): small "
              "head %s; int8 head (Q8_0 values, 1.125 bytes a weight) ",
              kVocab, kHidden, small_head.small_head_serves(1) ? "on" : "OFF (its probe found other bits)");
  q8_head.use_q8_weights(cold_q8[0].data(), cold_scales[0].data());
  std::printf("up to %d tokens\n", q8_head.q8_max_tokens());
  std::printf("%-8s %5s %9s %10s %9s %8s %8s %8s %8s\n", "lm_head", "T", "q8_cold", "small_cold", "lt_cold",
              "lt/q8", "lt/small", "flr_q8", "flr_bf16");
  bool valid = true;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int tokens : token_counts) {
    const bool q8_serves = tokens <= q8_head.q8_max_tokens(),
               small_serves = small_head.small_head_serves(tokens);
    if (!q8_serves && !small_serves)
      continue;
    std::vector<float> host_x(static_cast<size_t>(tokens) * kHidden), host_gamma(kHidden);
    for (float& v : host_x)
      v = normal(rng);
    for (float& v : host_gamma)
      v = 1.0f + 0.1f * normal(rng);
    DeviceBuffer<float> x(host_x.size()), gamma(kHidden), logits(static_cast<size_t>(tokens) * kVocab);
    DeviceBuffer<uint16_t> normed(static_cast<size_t>(tokens) * kHidden);
    x.copy_from_host(host_x.data(), host_x.size(), stream);
    gamma.copy_from_host(host_gamma.data(), kHidden, stream);
    llama::GemmArgs args;
    args.tokens = tokens;
    args.n = kVocab;
    args.k = kHidden;
    args.io_row_stride = 1;
    args.x = x.data();
    args.norm_weight = gamma.data();
    args.logits_cols = kVocab;
    args.logits_dtype = DType::kFloat32;
    args.logits = logits.data();
    // Copy c of the weights (the int8 head takes copy c of its own weights).
    const auto launch = [&](llama::LtHead& head, int c, cudaStream_t s) {
      llama::GemmArgs a = args;
      a.weight = cold_w[c].data();
      if (&head == &q8_head)
        head.use_q8_weights(cold_q8[c].data(), cold_scales[c].data());
      require(head.run(a, normed.data(), s), "llama_gemm_bench", "lm_head tokens", tokens, "not served");
    };
    const auto logits_of = [&](llama::LtHead& head) {
      logits.fill_bytes(0xff, stream);
      launch(head, 0, stream);
      std::vector<float> out(static_cast<size_t>(tokens) * kVocab);
      logits.copy_to_host(out.data(), out.size(), stream);
      SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
      return out;
    };
    const std::vector<float> theirs = logits_of(lt_only);
    bool same = true;
    if (q8_serves) {
      const std::vector<float> q8 = logits_of(q8_head);
      same = same && std::memcmp(q8.data(), theirs.data(), q8.size() * sizeof(float)) == 0;
    }
    if (small_serves) {
      const std::vector<float> small = logits_of(small_head);
      same = same && std::memcmp(small.data(), theirs.data(), small.size() * sizeof(float)) == 0;
    }
    valid = valid && same;
    // use_q8_weights is host state: record each copy's launch with its own weights (outside capture, the
    // recorded kernel parameters carry the pointers).
    const auto time_cold = [&](llama::LtHead& head) {
      int next = 0;
      return bench::time_graph([&](cudaStream_t s) { launch(head, next++ % copies, s); }, stream, copies);
    };
    const double nan = std::nan("");
    const double q8_us = q8_serves ? time_cold(q8_head).median_us : nan;
    const double small_us = small_serves ? time_cold(small_head).median_us : nan;
    const double lt_us = time_cold(lt_only).median_us;
    const double io_bytes = 4.0 * tokens * kHidden + 4.0 * tokens * kVocab;
    const double floor_q8 = (1.125 * w_count + io_bytes) / (copy_gbs * 1e3) + node_us;
    const double floor_bf16 = (2.0 * w_count + io_bytes) / (copy_gbs * 1e3) + node_us;
    std::printf("%-8s %5d %9.2f %10.2f %9.2f %8.2f %8.2f %8.2f %8.2f%s\n", "lm_head", tokens, q8_us, small_us,
                lt_us, lt_us / q8_us, lt_us / small_us, floor_q8, floor_bf16,
                same ? "" : "  INVALID (the paths differ in bits)");
    csv.row({bench::device_name(), "lm_head", std::to_string(kVocab), std::to_string(kHidden),
             std::to_string(tokens), "", "", "", bench::format(q8_us, 3), bench::format(small_us, 3),
             bench::format(lt_us, 3), bench::format(floor_q8, 3), same ? "0" : "nan", "", ""});
  }
  q8_head.use_q8_weights(nullptr, nullptr);
  return valid;
}

int run(const std::vector<int>& token_counts, const std::string& csv_path) {
  Stream stream;
  const double copy_gbs = bench::measure_copy_bandwidth_gbs(stream);
  const double node_us = bench::node_floor_us(stream);
  std::printf("llama_gemm_bench on %s: copy %.0f GB/s (read + write), node floor %.3f us\n",
              bench::device_name().c_str(), copy_gbs, node_us);
  std::printf(
      "Y[T, N] = A[T, K] W[N, K]^T, bf16 in, fp32 accumulate; ours = llama::gemm (residual add) on "
      "narrow / wide tiles, pipe = on pipelined tiles, cuBLASLt = its first heuristic (fp32 out); per "
      "launch in a CUDA graph, median\n");
  std::printf(
      "(norm_us: rms_norm_rows over the T rows, which the pipelined tiles of the RMSNorm epilogues, QKV "
      "and gate/up, launch first; not in pipe_*)\n");
  std::printf("%-8s %6s %6s %5s %8s %8s %8s %9s %9s %9s %8s %8s %8s %8s %12s\n", "shape", "N", "K", "T",
              "ours_hot", "pipe_hot", "lt_hot", "ours_cold", "pipe_cold", "lt_cold", "norm_us", "lt/best",
              "floor_us", "best/flr", "max_rel_diff");
  bench::Csv csv(csv_path);
  csv.row({"device", "shape", "n", "k", "tokens", "smcgraph_hot_us", "pipelined_hot_us", "cublaslt_hot_us",
           "smcgraph_cold_us", "pipelined_cold_us", "cublaslt_cold_us", "floor_us", "max_rel_diff",
           "pipelined_max_rel_diff", "norm_us"});
  cudaDeviceProp properties{};
  SMCGRAPH_CUDA_CHECK(cudaGetDeviceProperties(&properties, current_device_info().device));
  const size_t cold_bytes = 4 * static_cast<size_t>(std::max(properties.l2CacheSize, 1 << 20));
  int max_k = 16;
  for (const Shape& shape : kShapes)
    max_k = std::max(max_k, shape.k);
  llama::prepare_gemm(max_k);
  std::mt19937_64 rng(2026);
  bool all_valid = true;
  for (const Shape& shape : kShapes) {
    const size_t w_count = static_cast<size_t>(shape.n) * shape.k;
    const DeviceBuffer<uint16_t> w = random_bf16(w_count, 0.05f, rng, stream);
    // Copies of W for the cold timing: one launch per copy, together over 4x the L2.
    const std::vector<DeviceBuffer<uint16_t>> cold_w = cold_copies(w, w_count, cold_bytes, stream);
    const int copies = static_cast<int>(cold_w.size());
    for (const int tokens : token_counts) {
      const size_t outputs = static_cast<size_t>(tokens) * shape.n;
      const DeviceBuffer<uint16_t> a = random_bf16(static_cast<size_t>(tokens) * shape.k, 1.0f, rng, stream);
      DeviceBuffer<float> ours(outputs), piped(outputs), theirs(outputs);
      LtGemm lt(tokens, shape.n, shape.k);
      llama::GemmArgs args;
      args.tokens = tokens;
      args.n = shape.n;
      args.k = shape.k;
      args.weight = w.data();
      args.a_bf16 = a.data();
      args.residual = ours.data();
      args.tiles = llama::GemmTiles::kNarrowWide;
      llama::GemmArgs pipe_args = args;
      pipe_args.residual = piped.data();
      pipe_args.tiles = llama::GemmTiles::kPipelined;
      // Validation: residual 0 + Y against cuBLASLt's Y; the two own tilings must give the same bits.
      ours.fill_bytes(0, stream);
      piped.fill_bytes(0, stream);
      llama::gemm(llama::GemmEpilogue::kResidualAdd, args, stream);
      llama::gemm(llama::GemmEpilogue::kResidualAdd, pipe_args, stream);
      lt.run(w.data(), a.data(), theirs.data(), stream);
      std::vector<float> y_ours(outputs), y_piped(outputs), y_lt(outputs);
      ours.copy_to_host(y_ours.data(), outputs, stream);
      piped.copy_to_host(y_piped.data(), outputs, stream);
      theirs.copy_to_host(y_lt.data(), outputs, stream);
      stream.synchronize();
      double max_rel = 0.0, pipe_rel = 0.0;
      for (size_t i = 0; i < outputs; ++i) {
        const double scale = std::max(1.0, std::abs(static_cast<double>(y_lt[i])));
        max_rel = std::max(max_rel, std::abs(static_cast<double>(y_ours[i]) - y_lt[i]) / scale);
        pipe_rel = std::max(pipe_rel, std::abs(static_cast<double>(y_piped[i]) - y_lt[i]) / scale);
      }
      const bool same_bits = std::memcmp(y_ours.data(), y_piped.data(), outputs * sizeof(float)) == 0;
      const bool valid = std::isfinite(max_rel) && max_rel <= 1e-3 && std::isfinite(pipe_rel) &&
                         pipe_rel <= 1e-3 && same_bits;
      all_valid = all_valid && valid;
      // Timing: the residual keeps accumulating across replays, which changes no cost.
      // The own GEMM hot (one weight matrix) and cold (one launch per copy of the weights).
      const auto time_own = [&](const llama::GemmArgs& base, bool cold) {
        int next = 0;
        const auto work = [&](cudaStream_t s) {
          llama::GemmArgs launch = base;
          if (cold)
            launch.weight = cold_w[next++ % copies].data();
          llama::gemm(llama::GemmEpilogue::kResidualAdd, launch, s);
        };
        return cold ? bench::time_graph(work, stream, copies) : bench::time_graph(work, stream);
      };
      const bench::Timing t_ours = time_own(args, false), t_pipe = time_own(pipe_args, false);
      const bench::Timing t_lt =
          bench::time_graph([&](cudaStream_t s) { lt.run(w.data(), a.data(), theirs.data(), s); }, stream);
      const bench::Timing cold_ours = time_own(args, true), cold_pipe = time_own(pipe_args, true);
      int next_lt = 0;
      const bench::Timing cold_lt = bench::time_graph(
          [&](cudaStream_t s) { lt.run(cold_w[next_lt++ % copies].data(), a.data(), theirs.data(), s); },
          stream, copies);
      const double bytes = 2.0 * shape.n * shape.k + 2.0 * tokens * shape.k + 8.0 * outputs;
      const double floor_us = bytes / (copy_gbs * 1e3) + node_us;
      double norm_us = 0.0; // the RMSNorm kernel alone on T rows of K (hot), where K fits its rows
      if (shape.k <= kLlamaMaxHidden) {
        DeviceBuffer<float> x(static_cast<size_t>(tokens) * shape.k), gamma(shape.k);
        DeviceBuffer<uint16_t> normed(static_cast<size_t>(tokens) * shape.k);
        x.fill_bytes(0, stream);
        gamma.fill_bytes(0, stream);
        norm_us =
            bench::time_graph(
                [&](cudaStream_t s) {
                  llama::rms_norm_rows(tokens, shape.k, x.data(), 0, gamma.data(), 1e-5f, normed.data(), s);
                },
                stream)
                .median_us;
      }
      const double best_cold = std::min(cold_ours.median_us, cold_pipe.median_us);
      std::printf("%-8s %6d %6d %5d %8.2f %8.2f %8.2f %9.2f %9.2f %9.2f %8.2f %8.2f %8.2f %8.2f %12.2e%s\n",
                  shape.name, shape.n, shape.k, tokens, t_ours.median_us, t_pipe.median_us, t_lt.median_us,
                  cold_ours.median_us, cold_pipe.median_us, cold_lt.median_us, norm_us,
                  cold_lt.median_us / best_cold, floor_us, best_cold / floor_us, std::max(max_rel, pipe_rel),
                  valid ? "" : (same_bits ? "  INVALID" : "  INVALID (the two tilings differ in bits)"));
      csv.row({bench::device_name(), shape.name, std::to_string(shape.n), std::to_string(shape.k),
               std::to_string(tokens), bench::format(t_ours.median_us, 3), bench::format(t_pipe.median_us, 3),
               bench::format(t_lt.median_us, 3), bench::format(cold_ours.median_us, 3),
               bench::format(cold_pipe.median_us, 3), bench::format(cold_lt.median_us, 3),
               bench::format(floor_us, 3), bench::format(max_rel, 9), bench::format(pipe_rel, 9),
               bench::format(norm_us, 3)});
    }
  }
  all_valid = time_lm_head(token_counts, copy_gbs, node_us, cold_bytes, rng, stream, csv) && all_valid;
  std::printf("validation: %s; CSV: %s\n", all_valid ? "ok" : "FAILED (smcgraph and cuBLASLt disagree)",
              csv_path.c_str());
  return all_valid ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  std::vector<int> token_counts = {1, 5, 8, 40, 64, 512};
  std::string csv = "results/llama_gemm_bench.csv";
  try {
    cli::Flags flags(argc, argv);
    while (flags.next()) {
      if (flags.flag() == "--tokens") {
        token_counts = parse_tokens(flags.flag(), flags.value());
      } else if (flags.flag() == "--csv") {
        csv = flags.value();
      } else if (flags.flag() == "--help" || flags.flag() == "-h") {
        std::printf(
            "usage: llama_gemm_bench [--tokens 1,5,8,40,64,512] [--csv results/llama_gemm_bench.csv]\n");
        return 0;
      } else {
        throw cli::UsageError{"unknown flag '" + flags.raw() + "' (see --help)"};
      }
    }
  } catch (const cli::UsageError& e) {
    std::fprintf(stderr, "llama_gemm_bench: %s\n", e.message.c_str());
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "llama_gemm_bench: no CUDA device\n");
    return 2;
  }
  try {
    return run(token_counts, csv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_gemm_bench: %s\n", e.what());
    return 2;
  }
}
