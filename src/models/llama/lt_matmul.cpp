#include "models/llama/lt_matmul.hpp"

#include "smcgraph/error.hpp"

namespace smcgraph::llama {

void lt_check(cublasStatus_t status, const char* who, const char* what) {
  require(status == CUBLAS_STATUS_SUCCESS, who, what, static_cast<int>(status), "cuBLASLt call failed");
}

LtMatmul::LtMatmul(const char* who) : who_(who) {
  cublasLtHandle_t handle = nullptr;
  lt_check(cublasLtCreate(&handle), who_, "cublasLtCreate");
  handle_.reset(handle);
  cublasLtMatmulDesc_t op = nullptr;
  lt_check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), who_, "matmul desc");
  op_.reset(op);
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
           who_, "TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)), who_,
           "TRANSB");
}

bool LtMatmul::pin(cublasLtMatrixLayoutOpaque_t& w, cublasLtMatrixLayoutOpaque_t& a,
                   cublasLtMatrixLayoutOpaque_t& y, size_t workspace_bytes,
                   cublasLtMatmulAlgo_t& algo) const {
  cublasLtMatmulPreference_t raw = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&raw), who_, "preference");
  const std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)>
      preference(raw, &cublasLtMatmulPreferenceDestroy); // freed on every path, a throw included
  lt_check(cublasLtMatmulPreferenceSetAttribute(preference.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &workspace_bytes, sizeof(workspace_bytes)),
           who_, "preference workspace");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int returned = 0;
  lt_check(cublasLtMatmulAlgoGetHeuristic(handle(), op(), &w, &a, &y, &y, preference.get(), 1, &heuristic,
                                          &returned),
           who_, "heuristic");
  if (returned < 1)
    return false;
  algo = heuristic.algo;
  const int one = 1;
  const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  lt_check(cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)),
           who_, "split-K 1");
  lt_check(cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &no_reduction,
                                                sizeof(no_reduction)),
           who_, "no reduction scheme");
  return true;
}

bool LtMatmul::serves(const cublasLtMatmulAlgo_t& algo, cublasLtMatrixLayoutOpaque_t& w,
                      cublasLtMatrixLayoutOpaque_t& a, cublasLtMatrixLayoutOpaque_t& y,
                      size_t workspace_bytes) const {
  cublasLtMatmulHeuristicResult_t check{};
  return cublasLtMatmulAlgoCheck(handle(), op(), &w, &a, &y, &y, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
         check.workspaceSize <= workspace_bytes;
}

} // namespace smcgraph::llama
