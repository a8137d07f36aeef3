#include "smcgraph/error.hpp"

namespace smcgraph::detail {

void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line) {
  // Clear a non-sticky error so the next call does not report it again; sticky ones persist regardless.
  cudaGetLastError();
  throw Error(std::string("CUDA error in ") + call + " at " + file + ":" + std::to_string(line) + ": " +
                  cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")",
              error);
}

} // namespace smcgraph::detail
