// ARCHITECTURE.md is kept true: its list of directive passes is the pass manager's table (names, in
// order, each with its file), and every file path it names exists.
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "piper/core/directives.hpp"

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = PIPER_SOURCE_DIR;

std::string architecture() {
  std::ifstream in(kRoot / "ARCHITECTURE.md");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A path as ARCHITECTURE.md writes it: from the repository root, or as included
// (`core/kernels.hpp` is core/include/piper/core/kernels.hpp).
bool exists_in_repo(const std::string& path) {
  if (fs::exists(kRoot / path)) return true;
  const std::string lib = path.substr(0, path.find('/'));
  return fs::exists(kRoot / lib / "include/piper" / path);
}

}  // namespace

TEST(ArchitectureDoc, PassOrderIsThePassManagersTable) {
  const std::string text = architecture();
  const auto begin = text.find("**Directive passes, in a fixed order**");
  const auto end = text.find("**Lowering", begin);
  ASSERT_NE(begin, std::string::npos) << "ARCHITECTURE.md has no pass-order section";
  ASSERT_NE(end, std::string::npos);
  const std::string section = text.substr(begin, end - begin);
  // "1. `split` (`core/src/passes/split.cpp`; each): ..."
  const std::regex item(R"(\n(\d+)\. `([a-z-]+)` \(`([^`]+)`)");
  std::vector<std::string> names;
  for (std::sregex_iterator it(section.begin(), section.end(), item), stop; it != stop; ++it) {
    EXPECT_EQ(std::stoi((*it)[1]), static_cast<int>(names.size()) + 1) << "numbering of `" << (*it)[2] << "`";
    names.push_back((*it)[2]);
    const std::string file = (*it)[3];
    EXPECT_EQ(file.rfind("core/src/passes/", 0), 0u) << file;
    EXPECT_TRUE(fs::exists(kRoot / file)) << "`" << (*it)[2] << "` names " << file << ", which does not exist";
  }
  EXPECT_EQ(names, piper::core::pass_names());
}

TEST(ArchitectureDoc, EveryFilePathItNamesExists) {
  const std::string text = architecture();
  const std::regex path(
      R"((?:^|[\s(`\[])((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\.(?:cpp|hpp|h|cu|md|json|py|sh|txt|csv|cmake)))");
  int checked = 0;
  for (std::sregex_iterator it(text.begin(), text.end(), path), stop; it != stop; ++it, ++checked)
    EXPECT_TRUE(exists_in_repo((*it)[1])) << "ARCHITECTURE.md names " << (*it)[1] << ", which does not exist";
  EXPECT_GT(checked, 30);  // the pattern still finds the document's paths
}
