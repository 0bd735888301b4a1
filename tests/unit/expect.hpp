// Small assertion helpers shared by the unit tests.
#pragma once

#include <cmath>
#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "piper/core/error.hpp"

namespace piper::test {

// The message of the core::Error `f` throws, "" when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const core::Error& e) {
    return e.what();
  }
  return "";
}

// actual within tol (relative) of expected.
inline void expect_rel(double actual, double expected, double tol = 1e-9) {
  EXPECT_NEAR(actual, expected, tol * std::abs(expected)) << "expected " << expected;
}

}  // namespace piper::test
