#include "runtime/env.hpp"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "smcgraph/error.hpp"

namespace smcgraph::detail {

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "1") == 0;
}

std::optional<long> env_integer(const char* name, long low, long high, const char* expected, int base) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0')
    return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long parsed = std::strtol(value, &end, base);
  if (*end != '\0' || errno != 0 || parsed < low || parsed > high)
    throw Error("smcgraph: " + std::string(name) + " = \"" + std::string(value) + "\": " + expected);
  return parsed;
}

size_t env_choice_index(const char* owner, const char* name, const char* const* words, size_t count) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0')
    return 0;
  std::string listed;
  for (size_t i = 0; i < count; ++i) {
    if (std::strcmp(value, words[i]) == 0)
      return i;
    listed += (i == 0 ? "" : ", ") + std::string(words[i]);
  }
  throw Error(std::string(owner) + ": " + name + " = '" + value + "' must be one of " + listed);
}

} // namespace smcgraph::detail
