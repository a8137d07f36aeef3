// What the Llama forward's two cuBLASLt users share (the LM head, llama_head.cu; a long prefill's layer
// GEMMs, llama_prefill_gemm.cu): a handle with the descriptor of Y = A W^T, and one algorithm pinned so that
// a token's row of Y does not depend on how many tokens a launch has.
#pragma once

#include <cstddef>
#include <memory>

#include <cublasLt.h>

namespace smcgraph::llama {

/// Throws smcgraph::Error naming `who`, the failed call `what` and its status, unless `status` is success.
void lt_check(cublasStatus_t status, const char* who, const char* what);

/// A cuBLASLt handle and the matmul descriptor of Y = A W^T for row-major W [N, K], A [tokens, K] and Y
/// [tokens, N]: column-major, cuBLASLt computes Y^T = W A^T and sees W as the K x N matrix W^T, hence
/// TRANSA = T, TRANSB = N; fp32 compute and scale. Both are destroyed with the object, also when its
/// constructor throws.
class LtMatmul {
public:
  explicit LtMatmul(const char* who);
  cublasLtHandle_t handle() const { return handle_.get(); }
  cublasLtMatmulDesc_t op() const { return op_.get(); }
  /// cuBLASLt's first heuristic for these layouts within `workspace_bytes`, with split-K 1 and no reduction
  /// scheme, so every output element is one K sum in one kernel whatever the token count. False where
  /// cuBLASLt offers none.
  bool pin(cublasLtMatrixLayoutOpaque_t& w, cublasLtMatrixLayoutOpaque_t& a, cublasLtMatrixLayoutOpaque_t& y,
           size_t workspace_bytes, cublasLtMatmulAlgo_t& algo) const;
  /// Whether `algo` runs these layouts within `workspace_bytes` (cublasLtMatmulAlgoCheck). The layouts are
  /// taken as cuBLASLt takes them (non-const), and not changed.
  bool serves(const cublasLtMatmulAlgo_t& algo, cublasLtMatrixLayoutOpaque_t& w,
              cublasLtMatrixLayoutOpaque_t& a, cublasLtMatrixLayoutOpaque_t& y, size_t workspace_bytes) const;

private:
  const char* who_;
  std::unique_ptr<cublasLtContext, decltype(&cublasLtDestroy)> handle_{nullptr, &cublasLtDestroy};
  std::unique_ptr<cublasLtMatmulDescOpaque_t, decltype(&cublasLtMatmulDescDestroy)> op_{
      nullptr, &cublasLtMatmulDescDestroy};
};

} // namespace smcgraph::llama
