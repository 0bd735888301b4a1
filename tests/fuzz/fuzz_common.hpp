// Shared by the libFuzzer harnesses: which exceptions count as a proper rejection of bad input.
// A harness passes its input to the same library entry point the CLI uses. The documented errors
// (core::Error and its subclasses, and std::invalid_argument from the strategy generator and the
// PyTorch CSV reader) are the expected outcome for bad input, and their message must be one line
// naming where the fault is. Any other exception escapes to libFuzzer and is reported as a crash,
// as are sanitizer reports, leaks and timeouts.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"

namespace piper::fuzz {

// A newline inside a quoted user string (a JSON key "a\nb" echoed in "unknown field") is allowed:
// the CLI flattens every message with one_line() before printing (cli/common.cpp). Piper's own
// text must not break the line, so a newline is accepted only inside single quotes.
inline void require_one_line(const char* what) {
  const std::string m = what;
  bool quoted = false, broken = false;
  for (char c : m) {
    if (c == '\'') quoted = !quoted;
    if (c == '\n' && !quoted) broken = true;
  }
  if (m.empty() || broken) {
    std::fprintf(stderr, "error message is empty or spans lines: '%s'\n", what);
    std::abort();
  }
}

template <class F>
void rejects_cleanly(F&& run) {
  try {
    run();
  } catch (const piper::core::Error& e) {
    require_one_line(e.what());
  } catch (const std::invalid_argument& e) {
    require_one_line(e.what());
  }
}

// Smaller resource limits than the defaults, so one execution takes milliseconds: the fuzzer
// explores parsers and validators, not how long a legitimately huge compile takes (the default
// limits are tested through the CLI in test_limits).
inline void small_limits() {
  using piper::core::set_limit;
  set_limit("microbatches", 16);
  set_limit("devices", 64);
  set_limit("dag-nodes", 20'000);
  set_limit("simulated-ops", 200'000);
  set_limit("sweep-runs", 1'000);
  set_limit("layers", 64);
}

inline std::string text_of(const std::uint8_t* data, std::size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

}  // namespace piper::fuzz
