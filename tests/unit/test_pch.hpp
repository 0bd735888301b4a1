// The precompiled header of the test programs (tests/CMakeLists.txt, piper_test_pch): what most of
// them include. Each test file still includes what it uses; this only saves parsing GoogleTest,
// nlohmann_json and the core headers once per program (about 1.5 CPU-s a program).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
