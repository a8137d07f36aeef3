// smcgraph::Error and the one CUDA-check macro. The library never exits: every failure throws.
#pragma once

#include <stdexcept>
#include <string>
#include <sstream>

#include <cuda_runtime_api.h>

namespace smcgraph {

/// Every failure smcgraph reports: bad input (names the parameter and the value) or a CUDA error
/// (names the call, file, line and the CUDA error string).
///
///   try { smcgraph::sample(...); } catch (const smcgraph::Error& e) { log(e.what()); }
class Error : public std::runtime_error {
public:
  explicit Error(const std::string& what, cudaError_t cuda_error = cudaSuccess)
      : std::runtime_error(what), cuda_error_(cuda_error) {}
  /// The CUDA error behind this exception, or cudaSuccess for validation errors.
  cudaError_t cuda_error() const noexcept { return cuda_error_; }

private:
  cudaError_t cuda_error_;
};

namespace detail {
[[noreturn]] void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line);

template <class T> std::string to_text(const T& value) {
  std::ostringstream out;
  out << value;
  return out.str();
}
} // namespace detail

/// Throws Error("<where>: <parameter> = <value>: <requirement>") unless `ok`.
template <class T>
inline void require(bool ok, const char* where, const char* parameter, const T& value,
                    const char* requirement) {
  if (!ok) {
    throw Error(std::string(where) + ": " + parameter + " = " + detail::to_text(value) + ": " + requirement);
  }
}

} // namespace smcgraph

/// Checks a CUDA runtime call; on failure throws smcgraph::Error with the call text, file, line and
/// the CUDA error string.
#define SMCGRAPH_CUDA_CHECK(call)                                                                            \
  do {                                                                                                       \
    const cudaError_t smcgraph_cuda_status_ = (call);                                                        \
    if (smcgraph_cuda_status_ != cudaSuccess)                                                                \
      ::smcgraph::detail::throw_cuda_error(smcgraph_cuda_status_, #call, __FILE__, __LINE__);                \
  } while (0)

/// Checks the launch that was just issued (configuration errors are reported here, asynchronous faults
/// by a later call).
#define SMCGRAPH_CHECK_LAUNCH() SMCGRAPH_CUDA_CHECK(cudaGetLastError())
