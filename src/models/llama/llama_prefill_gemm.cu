// The layer GEMMs of a long prefill through cuBLASLt (llama_kernels.hpp, PrefillGemms): forwards of at least
// LlamaModelOptions::prefill_gemm_tokens tokens a row run Y = A W^T with one algorithm pinned per shape at
// construction (split-K off, no reduction scheme), so a row's outputs do not depend on how many rows the
// launch has; the residual-add projections (O, down) add into the fp32 residual stream in the matmul itself
// (beta = 1), the others write fp32 rows that gemm_epilogue_fp32() turns into RoPE'd q / KV or the SwiGLU
// product with the GEMM kernels' own per-element steps. Token chunks of at most kPrefillChunkTokens bound the
// fp32 scratch.
//
// H200, llama_gemm_bench (cold, us, the four layer GEMMs of SmolLM2 at 344 / 803 / 3,215 tokens): pipelined
// tiles 43.7 / 64.8 / 195.5, cuBLASLt 18.2 / 22.9 / 54.3 (forty-first session). In a whole prefill the
// separate norm and epilogue kernels and cuBLASLt's host time per call take much of that back. Admission
// (`generate --steps 0`, ms, own GEMMs -> these; forty-second session): 2.31 -> 3.60-3.64 at 344 tokens,
// 3.89-3.90 -> 4.22-4.24 at 803, 5.54-5.55 -> 5.78-5.79 at 1,607, 6.71-6.74 -> 6.68-6.77 at 2,101, 7.94 ->
// 7.37-7.40 at 2,501, 10.85 -> 9.29-9.65 at 3,215; hence the default threshold of 2,048 tokens
// (kPrefillGemmTokens). Chunks of 1,024 tokens (one wave of the gate/up
// tiles) lost even at 3,215 (11.27-11.45 ms), so a launch takes up to 4,096.
#include <algorithm>
#include <memory>
#include <string>

#include <cublasLt.h>

#include "models/llama/llama_kernels.hpp"
#include "models/llama/lt_matmul.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"

namespace smcgraph::llama {
namespace {

constexpr size_t kPrefillWorkspaceBytes = size_t{4} << 20; // split-K is off: little workspace

constexpr const char* kPrefill = "llama::PrefillGemms";

} // namespace

struct PrefillGemms::Impl {
  LtMatmul lt{kPrefill};
  DeviceBuffer<uint8_t> workspace;
  struct Shape {
    int n = 0, k = 0;
    cublasLtMatrixLayoutOpaque_t w{};
    cublasLtMatmulAlgo_t algo{};
    bool usable = false;
  };
  Shape shapes[4];
  int max_tokens = 0;

  void layouts(const Shape& s, int tokens, cublasLtMatrixLayoutOpaque_t& a,
               cublasLtMatrixLayoutOpaque_t& y) const {
    lt_check(cublasLtMatrixLayoutInit(&a, CUDA_R_16BF, s.k, tokens, s.k), kPrefill, "layout A");
    lt_check(cublasLtMatrixLayoutInit(&y, CUDA_R_32F, s.n, tokens, s.n), kPrefill, "layout Y");
  }

  /// cuBLASLt's first heuristic for a kPrefillChunkTokens-row launch, split-K and its reduction off, checked
  /// for every row count a chunk may have.
  bool pin(Shape& s) {
    cublasLtMatrixLayoutOpaque_t a{}, y{};
    layouts(s, std::min(kPrefillChunkTokens, max_tokens), a, y);
    if (!lt.pin(s.w, a, y, kPrefillWorkspaceBytes, s.algo))
      return false;
    for (int tokens :
         {1, 16, 63, 64, 65, 100, 256, 344, 803, 1000, 1024, 1607, 2048, 3215, kPrefillChunkTokens}) {
      if (tokens > std::min(kPrefillChunkTokens, max_tokens))
        continue;
      layouts(s, tokens, a, y);
      if (!lt.serves(s.algo, s.w, a, y, kPrefillWorkspaceBytes))
        return false;
    }
    return true;
  }

  /// Runs every pinned algorithm once on zeros, outside any capture: a cuBLASLt kernel's first launch in a
  /// process loads its module (CUDA's lazy loading), which would otherwise land in the first prefill.
  void warm_up() {
    constexpr int kTokens = 16; // one of the row counts pin() checks
    size_t most_w = 0, most_y = 0, most_k = 0;
    for (const Shape& s : shapes)
      if (s.usable) {
        most_w = std::max(most_w, static_cast<size_t>(s.n) * s.k);
        most_y = std::max(most_y, static_cast<size_t>(s.n) * kTokens);
        most_k = std::max(most_k, static_cast<size_t>(s.k));
      }
    if (most_w == 0 || max_tokens < kTokens)
      return;
    Stream stream;
    DeviceBuffer<uint16_t> w(most_w), a(most_k * kTokens);
    DeviceBuffer<float> y(most_y);
    w.fill_bytes(0, stream);
    a.fill_bytes(0, stream);
    const float alpha = 1.0f, beta = 0.0f;
    for (Shape& s : shapes) {
      if (!s.usable)
        continue;
      cublasLtMatrixLayoutOpaque_t la{}, ly{};
      layouts(s, kTokens, la, ly);
      lt_check(cublasLtMatmul(lt.handle(), lt.op(), &alpha, w.data(), &s.w, a.data(), &la, &beta, y.data(),
                              &ly, y.data(), &ly, &s.algo, workspace.data(), kPrefillWorkspaceBytes, stream),
               kPrefill, "warm-up matmul");
    }
    stream.synchronize();
  }

  Shape* find(int n, int k) {
    for (Shape& s : shapes)
      if (s.n == n && s.k == k && s.usable)
        return &s;
    return nullptr;
  }
};

PrefillGemms::PrefillGemms(int hidden, int q_dim, int kv_dim, int ffn, int max_tokens)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.max_tokens = max_tokens;
  m.workspace = DeviceBuffer<uint8_t>(kPrefillWorkspaceBytes);
  const int dims[4][2] = {{q_dim + 2 * kv_dim, hidden}, {hidden, q_dim}, {2 * ffn, hidden}, {hidden, ffn}};
  for (int i = 0; i < 4; ++i) {
    Impl::Shape& s = m.shapes[i];
    s.n = dims[i][0];
    s.k = dims[i][1];
    lt_check(cublasLtMatrixLayoutInit(&s.w, CUDA_R_16BF, s.k, s.n, s.k), kPrefill, "layout W");
    s.usable = m.pin(s);
  }
  m.warm_up();
}

PrefillGemms::~PrefillGemms() = default;

bool PrefillGemms::serves(int n, int k) const {
  return impl_->find(n, k) != nullptr;
}

bool PrefillGemms::run(GemmEpilogue epilogue, const GemmArgs& a, float* scratch, cudaStream_t stream) {
  Impl& m = *impl_;
  Impl::Shape* s = m.find(a.n, a.k);
  if (s == nullptr || a.tokens < 1 || a.a_bf16 == nullptr || epilogue == GemmEpilogue::kLogits)
    return false;
  const bool residual = epilogue == GemmEpilogue::kResidualAdd;
  require(residual ? a.residual != nullptr : scratch != nullptr, "llama::PrefillGemms::run",
          residual ? "residual" : "scratch", "null", "must be a device buffer");
  const float alpha = 1.0f, beta = residual ? 1.0f : 0.0f;
  for (int first = 0; first < a.tokens; first += kPrefillChunkTokens) {
    const int tokens = std::min(kPrefillChunkTokens, a.tokens - first);
    cublasLtMatrixLayoutOpaque_t la{}, ly{};
    m.layouts(*s, tokens, la, ly);
    const uint16_t* rows = a.a_bf16 + static_cast<size_t>(first) * a.k;
    float* y = residual ? a.residual + static_cast<size_t>(first) * a.n : scratch;
    lt_check(cublasLtMatmul(m.lt.handle(), m.lt.op(), &alpha, a.weight, &s->w, rows, &la, &beta, y, &ly, y,
                            &ly, &s->algo, m.workspace.data(), kPrefillWorkspaceBytes, stream),
             kPrefill, "matmul");
    if (!residual)
      gemm_epilogue_fp32(epilogue, a, first, tokens, scratch, stream);
  }
  return true;
}

} // namespace smcgraph::llama
