// Command-line parsing the example and bench programs share (examples/host_engine, bench/soak): a flag takes
// its value as the next argument or after '=' (--vocab=512), integers and numbers are checked against their
// range, and a bad flag or value is a UsageError naming both (main() prints it and exits 2).
//
//   smcgraph::cli::Flags flags(argc, argv);
//   while (flags.next()) {
//     if (flags.flag() == "--vocab") vocab = smcgraph::cli::parse_integer(flags.flag(), flags.value(), 2, 1
//     << 24); else if (flags.flag() == "--quiet") { flags.no_value(); quiet = true; } else throw
//     smcgraph::cli::UsageError{"unknown flag '" + flags.raw() + "' (see --help)"};
//   }
#pragma once

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace smcgraph::cli {

/// A bad command line; the message names the flag and the value.
struct UsageError {
  std::string message;
};

inline UsageError bad_value(const std::string& flag, const std::string& value,
                            const std::string& requirement) {
  return UsageError{flag + " = '" + value + "': " + requirement};
}

/// An integer in [lo, hi].
template <class T> T parse_integer(const std::string& flag, const std::string& text, T lo, T hi) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error == std::errc::invalid_argument || stop != end)
    throw bad_value(flag, text, "expected an integer");
  if (error == std::errc::result_out_of_range || value < lo || value > hi)
    throw bad_value(flag, text, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return value;
}

/// A number in (0, 1e9], or [0, 1e9] when `zero_allowed`.
inline double parse_positive(const std::string& flag, const std::string& text, bool zero_allowed) {
  char* stop = nullptr;
  const double value = std::strtod(text.c_str(), &stop);
  if (text.empty() || stop != text.c_str() + text.size())
    throw bad_value(flag, text, "expected a number");
  if (!(value > 0.0 || (zero_allowed && value == 0.0)) || value > 1e9)
    throw bad_value(flag, text, zero_allowed ? "must be in [0, 1e9]" : "must be in (0, 1e9]");
  return value;
}

/// A finite float > lo (`strictly_above_lo`) or >= lo, and <= hi.
inline float parse_float(const std::string& flag, const std::string& text, float lo, bool strictly_above_lo,
                         float hi) {
  char* stop = nullptr;
  errno = 0;
  const float value = std::strtof(text.c_str(), &stop);
  if (text.empty() || stop != text.c_str() + text.size())
    throw bad_value(flag, text, "expected a number");
  const bool low_ok = strictly_above_lo ? value > lo : value >= lo;
  if (errno == ERANGE || !std::isfinite(value) || !low_ok || value > hi) {
    std::ostringstream requirement;
    requirement << "must be finite and " << (strictly_above_lo ? "> " : ">= ") << lo;
    if (hi < std::numeric_limits<float>::max())
      requirement << " and <= " << hi;
    throw bad_value(flag, text, requirement.str());
  }
  return value;
}

/// Walks argv[1..]: flag() is the current flag without its "=value", value() its value (after '=' or the next
/// argument), no_value() rejects "=value" on a switch.
class Flags {
public:
  Flags(int argc, char** argv) : argc_(argc), argv_(argv) {}

  /// Moves to the next flag; false when none is left.
  bool next() {
    if (++i_ >= argc_)
      return false;
    raw_ = argv_[i_];
    flag_ = raw_;
    has_inline_value_ = false;
    if (flag_.rfind("--", 0) == 0 && flag_.find('=') != std::string::npos) {
      inline_value_ = flag_.substr(flag_.find('=') + 1);
      flag_ = flag_.substr(0, flag_.find('='));
      has_inline_value_ = true;
    }
    return true;
  }
  const std::string& flag() const { return flag_; }
  const std::string& raw() const { return raw_; }
  std::string value() {
    if (has_inline_value_)
      return inline_value_;
    if (i_ + 1 >= argc_)
      throw UsageError{flag_ + " needs a value (see --help)"};
    return argv_[++i_];
  }
  void no_value() const {
    if (has_inline_value_)
      throw UsageError{flag_ + " takes no value (got '" + inline_value_ + "')"};
  }

private:
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string raw_, flag_, inline_value_;
  bool has_inline_value_ = false;
};

/// The comma-separated items of `text`, empty ones dropped ("1,8,64", "0-27,0-21").
inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ','))
    if (!item.empty())
      items.push_back(item);
  return items;
}

/// A program's main(): runs `body` (which parses and runs, returning the exit status) and turns what it
/// throws into a message on stderr, "<program>: <what>", and an exit status: 2 for a UsageError (a bad flag
/// or value), 1 for any other exception.
///
///   int main(int argc, char** argv) { return smcgraph::cli::run_main("generate", [&] { return
///   run(parse(argc, argv)); }); }
template <class Body> int run_main(const char* program, Body&& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.message.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
}

} // namespace smcgraph::cli
