// A kernel's name as tools/kernel_trace.cpp reports it: demangled, without its parameter list. Header-only
// (the standard library and the C++ ABI's demangler), so a CPU test checks it
// (tests/test_kernel_name_cpu.cpp).
#pragma once

#include <cstdlib>
#include <cxxabi.h>
#include <string>

namespace smcgraph::tools {

/// `raw` demangled where it is a mangled name, then its trailing balanced "(...)" group cut off. Any other
/// parentheses stay ("(anonymous namespace)", however a demangler spells it; a function-pointer parameter
/// sits inside the cut group), and a name that does not end in ')' stays whole, so a name is never cut inside
/// its scope. (Cutting at the first top-level '(' that did not begin "(anonymous namespace)" pooled 73,645 of
/// an SMC trace's 151,994 records under names like "void smcgraph::llama::".)
inline std::string kernel_short_name(const char* raw) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(raw, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled ? demangled : raw;
  std::free(demangled);
  if (name.empty() || name.back() != ')')
    return name;
  int depth = 0;
  for (size_t i = name.size(); i-- > 0;) {
    if (name[i] == ')')
      ++depth;
    else if (name[i] == '(' && --depth == 0)
      return i > 0 ? name.substr(0, i) : name;
  }
  return name;
}

} // namespace smcgraph::tools
