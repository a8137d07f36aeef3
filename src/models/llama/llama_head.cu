// The LM head through cuBLASLt: RMSNorm of each output row into bf16 (one warp a row), then logits = A W^T by
// one cuBLASLt matmul with an algorithm chosen once at construction and pinned (no split-K, no reduction
// scheme), so a row's logits are the same bits whatever the token count: greedy speculative decoding (a
// K + 1-token verify) reproduces greedy decoding (1-token forwards). Own-kernel LM head (llama_gemm.cu,
// kLogits) against cuBLASLt, weights cold (bench/llama_gemm_bench, H100): 55 / 24 us at 8 tokens, 114 / 29 at
// 64, 877 / 68 at 512, 4,206 / 307 at 2,560.
#include <cublasLt.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_bf16.h>

#include "kernels/launch_checks.hpp"
#include "models/forward_layout.cuh"
#include "models/llama/bf16_rows.cuh"
#include "models/llama/llama_kernels.hpp"
#include "models/llama/pdl.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/runtime.hpp"

namespace smcgraph::llama {
namespace {

namespace cg = cooperative_groups;

constexpr int kNormThreads = 128; // 4 warps, a row each
constexpr int kMaxVectorsPerLane = kLlamaMaxHidden / 4 / 32;
constexpr size_t kWorkspaceBytes = size_t{4} << 20;

void lt_check(cublasStatus_t status, const char* what) {
  require(status == CUBLAS_STATUS_SUCCESS, "llama::LtHead", what, static_cast<int>(status),
          "cuBLASLt call failed");
}

/// Output row i of `normed` is slot i % S of row first_row + i / S: token (first_row + i / S) * P + i % S
/// when i % S < P, its x row at x + token * x_row_stride, normalised as bf16(x * rsqrt(mean(x^2) + eps) *
/// gamma); zeros for the slots past P (their logits land in entries nothing reads). Row by row:
/// batch-invariant.
__global__ void __launch_bounds__(kNormThreads)
    LlamaHeadNormKernel(int out_rows, int slots_per_row, int tokens_per_row, int first_row, int k,
                        const float* x, int64_t x_row_stride, const float* gamma, float eps, uint16_t* out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k4 = k / 4;
  // The norm weights before waiting (PDL): the x row is the only load left after it.
  const float4* g4 = reinterpret_cast<const float4*>(gamma);
  float4 g[kMaxVectorsPerLane];
#pragma unroll
  for (int q = 0; q < kMaxVectorsPerLane; ++q)
    g[q] = lane + 32 * q < k4 ? g4[lane + 32 * q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  pdl_wait();
  pdl_trigger();
  const int i = blockIdx.x * (kNormThreads / 32) + warp;
  if (i >= out_rows)
    return;
  uint2* dst = reinterpret_cast<uint2*>(out + static_cast<int64_t>(i) * k);
  const int slot = i % slots_per_row;
  if (slot >= tokens_per_row) {
    for (int q = lane; q < k4; q += 32)
      dst[q] = make_uint2(0u, 0u);
    return;
  }
  const int64_t token = static_cast<int64_t>(first_row + i / slots_per_row) * tokens_per_row + slot;
  const float4* x4 = reinterpret_cast<const float4*>(x + token * x_row_stride);
  float4 v[kMaxVectorsPerLane];
  float sum_squares = 0.0f;
#pragma unroll
  for (int q = 0; q < kMaxVectorsPerLane; ++q) {
    v[q] = lane + 32 * q < k4 ? x4[lane + 32 * q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    sum_squares += sum_of_squares(v[q]);
  }
  sum_squares = cg::reduce(cg::tiled_partition<32>(cg::this_thread_block()), sum_squares, cg::plus<float>());
  const float inv_rms = rsqrtf(sum_squares / static_cast<float>(k) + eps);
#pragma unroll
  for (int q = 0; q < kMaxVectorsPerLane; ++q)
    if (lane + 32 * q < k4)
      dst[lane + 32 * q] = rms_scaled_bf16x4(v[q], inv_rms, g[q]);
}

cudaDataType_t cuda_type(DType dtype) {
  return dtype == DType::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
}

} // namespace

struct LtHead::Impl {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatmulAlgo_t algo{};
  DeviceBuffer<uint8_t> workspace;
  int vocab = 0, hidden = 0, max_tokens = 0;
  DType dtype = DType::kFloat32;
  bool usable = false;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() { // here, not in ~LtHead: a constructor that throws after cublasLtCreate still frees the handle
    if (op)
      cublasLtMatmulDescDestroy(op);
    if (handle)
      cublasLtDestroy(handle);
  }

  /// W's layout (column-major [hidden, vocab]: W row-major), set once at construction.
  cublasLtMatrixLayoutOpaque_t w{};
  /// Layouts of A ([hidden, tokens]) and Y ([vocab, tokens], leading dimension ldy elements), initialised in
  /// place (cublasLtMatrixLayoutInit): a forward allocates nothing for them.
  struct Layouts {
    cublasLtMatrixLayoutOpaque_t a{}, y{};
  };
  void make_layouts(Layouts& l, int tokens, int64_t ldy) const {
    lt_check(cublasLtMatrixLayoutInit(&l.a, CUDA_R_16BF, hidden, tokens, hidden), "layout A");
    lt_check(cublasLtMatrixLayoutInit(&l.y, cuda_type(dtype), vocab, tokens, ldy), "layout Y");
  }
};

void rms_norm_rows(int rows, int k, const float* x, int64_t x_row_stride, const float* gamma, float eps,
                   uint16_t* out, cudaStream_t stream) {
  constexpr const char* kWhere = "llama::rms_norm_rows";
  require(k >= 4 && k % 4 == 0 && k <= kLlamaMaxHidden, kWhere, "k", k,
          "must be a multiple of 4 in [4, kLlamaMaxHidden]");
  require(x_row_stride == 0 || (x_row_stride >= k && x_row_stride % 4 == 0), kWhere, "x_row_stride",
          x_row_stride, "must be 0 (dense) or a multiple of 4 that is >= k");
  if (rows <= 0)
    return;
  launch_pdl(LlamaHeadNormKernel, dim3(static_cast<unsigned>(detail::ceil_div(rows, kNormThreads / 32))),
             dim3(kNormThreads), 0, stream, rows, 1, 1, 0, k, x, x_row_stride > 0 ? x_row_stride : k, gamma,
             eps, out);
}

LtHead::LtHead(int vocab, int hidden, int max_tokens, DType logits_dtype) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.vocab = vocab;
  m.hidden = hidden;
  m.max_tokens = max_tokens;
  m.dtype = logits_dtype;
  const char* off = std::getenv("SMCGRAPH_DISABLE_CUBLASLT_HEAD");
  if (off != nullptr && std::strcmp(off, "1") == 0) // off: run() declines, the own GEMM serves
    return;
  if (hidden % 4 != 0 || hidden > kLlamaMaxHidden ||
      (logits_dtype != DType::kFloat32 && logits_dtype != DType::kBFloat16)) // not served
    return;
  lt_check(cublasLtCreate(&m.handle), "cublasLtCreate");
  lt_check(cublasLtMatmulDescCreate(&m.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  lt_check(cublasLtMatmulDescSetAttribute(m.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
           "TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(m.op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)), "TRANSB");
  lt_check(cublasLtMatrixLayoutInit(&m.w, CUDA_R_16BF, hidden, vocab, hidden), "layout W");
  m.workspace = DeviceBuffer<uint8_t>(kWorkspaceBytes);
  // The algorithm: cuBLASLt's first heuristic for a 64-token head, then split-K and its reduction switched
  // off, and checked for every token count the model may run (it is used for all of them).
  cublasLtMatmulPreference_t raw_preference = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&raw_preference), "preference");
  const std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)>
      preference(raw_preference, &cublasLtMatmulPreferenceDestroy); // freed on every path, a throw included
  lt_check(cublasLtMatmulPreferenceSetAttribute(preference.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &kWorkspaceBytes, sizeof(kWorkspaceBytes)),
           "preference workspace");
  const int reference_tokens = std::min(64, max_tokens);
  cublasLtMatmulHeuristicResult_t heuristic{};
  int returned = 0;
  {
    Impl::Layouts l;
    m.make_layouts(l, reference_tokens, vocab);
    lt_check(cublasLtMatmulAlgoGetHeuristic(m.handle, m.op, &m.w, &l.a, &l.y, &l.y, preference.get(), 1,
                                            &heuristic, &returned),
             "heuristic");
  }
  if (returned < 1) // cuBLASLt offered no algorithm
    return;
  m.algo = heuristic.algo;
  const int one = 1;
  const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  lt_check(cublasLtMatmulAlgoConfigSetAttribute(&m.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)),
           "split-K 1");
  lt_check(cublasLtMatmulAlgoConfigSetAttribute(&m.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &no_reduction,
                                                sizeof(no_reduction)),
           "no reduction scheme");
  for (int tokens : {1, 2, 3, 5, 8, 16, 17, 40, 64, 128, 320, 512, 1024, 2560, max_tokens}) {
    if (tokens > max_tokens)
      continue;
    for (int64_t stride : {int64_t{1}, int64_t{5}}) {
      Impl::Layouts l;
      m.make_layouts(l, tokens, stride * vocab);
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(m.handle, m.op, &m.w, &l.a, &l.y, &l.y, &m.algo, &check) !=
              CUBLAS_STATUS_SUCCESS ||
          check.workspaceSize > kWorkspaceBytes)
        return; // the pinned algorithm does not serve this token count
    }
  }
  m.usable = true;
}

LtHead::~LtHead() = default;

bool LtHead::usable() const {
  return impl_->usable;
}

bool LtHead::run(const GemmArgs& a, uint16_t* normed, cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.usable || a.tokens < 1 || a.k != m.hidden || a.logits_cols != m.vocab || a.logits_dtype != m.dtype)
    return false;
  const int P = a.tokens_per_row, rows = a.tokens / P;
  const int64_t io = a.io_row_stride;
  const int64_t x_stride = a.x_row_stride > 0 ? a.x_row_stride : a.k;
  const float alpha = 1.0f, beta = 0.0f;
  // One matmul over `out_rows` rows of `normed` into logits + offset with leading dimension ldy.
  auto norm_and_matmul = [&](int out_rows, int slots_per_row, int first_row, int64_t ldy, size_t offset) {
    launch_pdl(LlamaHeadNormKernel,
               dim3(static_cast<unsigned>(detail::ceil_div(out_rows, kNormThreads / 32))), dim3(kNormThreads),
               0, stream, out_rows, slots_per_row, P, first_row, a.k, a.x, x_stride, a.norm_weight, a.eps,
               normed);
    Impl::Layouts l;
    m.make_layouts(l, out_rows, ldy);
    void* y = static_cast<uint8_t*>(a.logits) + offset * dtype_bytes(m.dtype);
    lt_check(cublasLtMatmul(m.handle, m.op, &alpha, a.weight, &m.w, normed, &l.a, &beta, y, &l.y, y, &l.y,
                            &m.algo, m.workspace.data(), kWorkspaceBytes, stream),
             "cublasLtMatmul");
  };
  if (P == io || P == 1) { // dense rows, or one token a row io tokens apart: one leading dimension
    if (a.tokens > m.max_tokens)
      return false;
    norm_and_matmul(a.tokens, P, 0, P == io ? m.vocab : io * m.vocab, 0);
    return true;
  }
  // P < io tokens a row: every row's io slots, the ones past P from zero rows (their logits land in entries
  // past tokens_per_row, which nothing reads), in chunks of rows that fit the workspace; the same matmul
  // algorithm throughout, so a token's logits are the same bits as in a dense forward.
  const int chunk_rows = static_cast<int>(m.max_tokens / io);
  if (chunk_rows < 1)
    return false;
  for (int first = 0; first < rows; first += chunk_rows) {
    const int count = std::min(chunk_rows, rows - first);
    norm_and_matmul(count * static_cast<int>(io), static_cast<int>(io), first, m.vocab,
                    static_cast<size_t>(first) * io * m.vocab);
  }
  return true;
}

} // namespace smcgraph::llama
