// The library's environment switches, read the same way everywhere (host code, no CUDA call).
#pragma once

#include <cstddef>
#include <initializer_list>
#include <optional>
#include <utility>
#include <vector>

namespace smcgraph::detail {

/// Whether the environment variable `name` is exactly "1" (the SMCGRAPH_DISABLE_* style switches).
bool env_flag(const char* name);

/// The whole number in the environment variable `name` (base 10, or `base` 0 for decimal, 0x hex and 0 octal
/// too), or nullopt when it is unset or empty. A value that is not such a number in [low, high] throws Error
/// naming the variable and its value, then `expected` (e.g. "must be a byte value, 0-255").
std::optional<long> env_integer(const char* name, long low, long high, const char* expected, int base = 10);

/// Which of `words` (count of them) the environment variable `name` names: 0 when it is unset or empty. Any
/// other value throws Error "<owner>: <name> = '<value>' must be one of <words>".
size_t env_choice_index(const char* owner, const char* name, const char* const* words, size_t count);

/// A choice from an environment variable, for tests and A/B runs: unset or empty gives the first of
/// `choices`; an unknown word throws (env_choice_index).
template <class Choice>
Choice env_choice(const char* owner, const char* name,
                  std::initializer_list<std::pair<const char*, Choice>> choices) {
  std::vector<const char*> words;
  for (const auto& choice : choices)
    words.push_back(choice.first);
  return (choices.begin() + env_choice_index(owner, name, words.data(), words.size()))->second;
}

} // namespace smcgraph::detail
