#include "smcgraph/error.hpp"

namespace smcgraph {

bool is_sticky(cudaError_t error) noexcept {
  // The errors the CUDA runtime documents as leaving "the process in an inconsistent state" (any further
  // CUDA work returns the same error; the process must be terminated and relaunched), and an uncorrectable
  // ECC error, after which nothing the context holds can be trusted.
  switch (error) {
  case cudaErrorIllegalAddress:
  case cudaErrorLaunchTimeout:
  case cudaErrorAssert:
  case cudaErrorHardwareStackError:
  case cudaErrorIllegalInstruction:
  case cudaErrorMisalignedAddress:
  case cudaErrorInvalidAddressSpace:
  case cudaErrorInvalidPc:
  case cudaErrorLaunchFailure:
  case cudaErrorECCUncorrectable:
  case cudaErrorMpsClientTerminated:
  case cudaErrorExternalDevice:
    return true;
  default:
    break;
  }
  // Newer than the oldest supported toolkit (12.4): compared by value so older headers still compile.
  constexpr int kContained = 226;        // cudaErrorContained
  constexpr int kTensorMemoryLeak = 721; // cudaErrorTensorMemoryLeak
  const int code = static_cast<int>(error);
  return code == kContained || code == kTensorMemoryLeak;
}

namespace detail {

std::string describe_cuda_error(cudaError_t error) {
  const char* name = cudaGetErrorName(error);
  const char* text = cudaGetErrorString(error);
  std::string description =
      std::string(name ? name : "unknown CUDA error") + " (" + (text ? text : "?") + ")";
  if (is_sticky(error))
    description += std::string("; ") + kStickyErrorNote;
  return description;
}

std::string cuda_error_message(cudaError_t error, const char* call, const char* file, int line) {
  return std::string("CUDA error in ") + call + " at " + file + ":" + std::to_string(line) + ": " +
         describe_cuda_error(error);
}

void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line) {
  // Clear a non-sticky error so the next call does not report it again; sticky ones persist regardless.
  cudaGetLastError();
  throw Error(cuda_error_message(error, call, file, line), error);
}

} // namespace detail
} // namespace smcgraph
