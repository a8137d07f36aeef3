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

/// True for the CUDA errors that poison the context for the rest of the process (a device fault:
/// cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
/// cudaErrorHardwareStackError, cudaErrorAssert, cudaErrorInvalidPc, ...): every later CUDA call in this
/// process returns the same error. Nothing in the process can recover: destroy every smcgraph object and
/// exit (or restart) the process; only a fresh process can use (or reset) the device again.
///
///   catch (const smcgraph::Error& e) { if (smcgraph::is_sticky(e.cuda_error())) shut_down_and_restart(); }
bool is_sticky(cudaError_t error) noexcept;

/// What smcgraph appends to the message of every error whose CUDA error is sticky (is_sticky()).
inline constexpr const char* kStickyErrorNote =
    "the CUDA context is unusable after this error: destroy the engine and restart the process";

namespace detail {
[[noreturn]] void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line);
/// The message throw_cuda_error() throws: "CUDA error in <call> at <file>:<line>: <name> (<text>)", plus
/// "; " + kStickyErrorNote when the error is sticky.
std::string cuda_error_message(cudaError_t error, const char* call, const char* file, int line);
/// "<name> (<text>)" of a CUDA error, plus "; " + kStickyErrorNote when it is sticky.
std::string describe_cuda_error(cudaError_t error);

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
