// Shared vocabulary: logits dtypes, per-row fault flags, the status word.
#pragma once

#include <cstdint>
#include <string>

namespace smcgraph {

enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
  case DType::kFloat32:
    return "fp32";
  case DType::kBFloat16:
    return "bf16";
  case DType::kFloat16:
    return "fp16";
  }
  return "unknown";
}
inline int dtype_bytes(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : 2;
}

/// Token id written where a row failed (its flags say why).
inline constexpr int32_t kInvalidToken = -1;

/// Per-row fault flags set by device code. A stage writes its row's flags; the status word is the OR of
/// every flag any row raised since the caller last cleared it.
enum RowFlag : uint32_t {
  kFlagNone = 0,
  kFlagNanLogit = 1u << 0,        ///< a NaN or +inf logit in the row
  kFlagAllMasked = 1u << 1,       ///< every logit of the row is -inf
  kFlagBadParameter = 1u << 2,    ///< temperature < 0 or not finite, alpha <= 0 or not finite
  kFlagTokenOutOfRange = 1u << 3, ///< a token id outside [0, vocab)
  kFlagSlotsExhausted = 1u << 4,  ///< the slot pool could not supply this row's slots
  kFlagMaxLength = 1u << 5,       ///< the row reached max_seq_len
};

/// Faults in a row's data (raised by the samplers and verifiers): the commit stops such a row.
inline constexpr uint32_t kRowDataFaults =
    kFlagNanLogit | kFlagAllMasked | kFlagBadParameter | kFlagTokenOutOfRange;
/// Flags that fail a request when any of its rows raised one: data faults and slot exhaustion.
inline constexpr uint32_t kRequestFailureFlags = kRowDataFaults | kFlagSlotsExhausted;

/// Human-readable reasons for a flags word ("nan logit, all masked").
inline std::string describe_flags(uint32_t flags) {
  static const char* const names[] = {"nan or +inf logit",  "all logits -inf",     "bad temperature or alpha",
                                      "token out of range", "slot pool exhausted", "max sequence length"};
  std::string text;
  for (int bit = 0; bit < 6; ++bit) {
    if (flags & (1u << bit)) {
      if (!text.empty())
        text += ", ";
      text += names[bit];
    }
  }
  return text.empty() ? "ok" : text;
}

} // namespace smcgraph
