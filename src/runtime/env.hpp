// The library's environment switches, read the same way everywhere (host code, no CUDA call).
#pragma once

#include <optional>

namespace smcgraph::detail {

/// Whether the environment variable `name` is exactly "1" (the SMCGRAPH_DISABLE_* style switches).
bool env_flag(const char* name);

/// The whole number in the environment variable `name` (base 10, or `base` 0 for decimal, 0x hex and 0 octal
/// too), or nullopt when it is unset or empty. A value that is not such a number in [low, high] throws Error
/// naming the variable and its value, then `expected` (e.g. "must be a byte value, 0-255").
std::optional<long> env_integer(const char* name, long low, long high, const char* expected, int base = 10);

} // namespace smcgraph::detail
