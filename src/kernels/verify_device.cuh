// Device pieces of the verifiers shared by verify.cu and pack.cu: the warp-ballot first rejection and the
// verdict write. Internal: compiled by nvcc only.
#pragma once

#include <cstdint>

#include "smcgraph/verify.hpp"

namespace smcgraph::device {

/// No rejection in a ballot window (larger than any encoded rejection).
inline constexpr uint32_t kNoRejection = 0xffffffffu;

// Device pieces shared by verify.cu and pack.cu (compiled only by nvcc).

/// A token id outside [0, vocab): a draft position holding one rejects with kFlagTokenOutOfRange, a next
/// token is replaced by kInvalidToken and flagged.
__device__ __forceinline__ bool out_of_range(int32_t token, int vocab) {
  return token < 0 || token >= vocab;
}

/// One ballot round of a verification scan. Lane l of the calling warp
/// reports whether position base + l rejects and why (RowFlag bits < 256); every lane gets the first
/// rejection of the window encoded as position << 8 | reason, or kNoRejection. The minimum over windows is
/// the row's first rejection. All 32 lanes must call it.
__device__ __forceinline__ uint32_t first_rejection(bool reject, uint32_t reason, int base) {
  const unsigned rejecting = __ballot_sync(0xffffffffu, reject);
  const int lane = __ffs(rejecting) - 1;
  const uint32_t first_reason = __shfl_sync(0xffffffffu, reason, lane < 0 ? 0 : lane);
  return rejecting == 0 ? kNoRejection : (static_cast<uint32_t>(base + lane) << 8) | (first_reason & 0xffu);
}

/// Writes one row's verdict (its only writer) and ORs its flags into row_flags and status.
__device__ __forceinline__ void write_verdict(const VerifyOutputs& out, int row, int accepted,
                                              int draft_steps, int32_t next_token, uint32_t flags) {
  out.accepted[row] = accepted;
  out.next_tokens[row] = next_token;
  if (out.mismatch)
    out.mismatch[row] = accepted < draft_steps ? 1 : 0;
  if (flags) {
    if (out.row_flags)
      atomicOr(&out.row_flags[row], flags);
    if (out.status)
      atomicOr(out.status, flags);
  }
}

} // namespace smcgraph::device
