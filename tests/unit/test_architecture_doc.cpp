// ARCHITECTURE.md is kept true: its list of directive passes is the pass manager's table (names, in
// order, each with its file), every file path it names exists, and the libraries' include graph keeps
// the floors it describes (no cycle, no arrow up or sideways).
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
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

// The floors of the include graph, lowest first (ARCHITECTURE.md, "Floors"): a file includes headers
// of its own library and of libraries on lower floors only. Keyed by folder; `piper/<name>/` headers
// belong to the library of that name (`piper/runtime/` is gpu_runtime's).
struct Library {
  std::string folder, include_name;
  int floor;
};
const std::vector<Library> kLibraries = {
    {"core", "core", 0},     {"plot", "plot", 1},     {"sim", "sim", 1}, {"gpu_runtime", "runtime", 1},
    {"chakra", "chakra", 1}, {"search", "search", 2}, {"gui", "gui", 3}, {"cli", "cli", 3},
    {"python", "python", 3}};

bool is_source(const fs::path& p) {
  static const std::set<std::string> exts = {".cpp", ".hpp", ".h", ".cu", ".cuh"};
  return exts.count(p.extension().string()) > 0;
}

// Every source and header file of the libraries, relative to the root, with its library.
std::map<std::string, const Library*> library_files() {
  std::map<std::string, const Library*> files;
  for (const auto& lib : kLibraries)
    for (const auto& e : fs::recursive_directory_iterator(kRoot / lib.folder))
      if (e.is_regular_file() && is_source(e.path())) files[fs::relative(e.path(), kRoot).generic_string()] = &lib;
  return files;
}

// The project files `file` includes (quoted includes that resolve to a file of the libraries).
std::vector<std::string> includes_of(const std::string& file, const std::map<std::string, const Library*>& files) {
  std::ifstream in(kRoot / file);
  const std::regex include(R"re(^\s*#\s*include\s*"([^"]+)")re");
  std::vector<std::string> out;
  std::smatch m;
  for (std::string line; std::getline(in, line);) {
    if (!std::regex_search(line, m, include)) continue;
    const std::string name = m[1];
    std::vector<std::string> candidates = {(fs::path(file).parent_path() / name).lexically_normal().generic_string(),
                                           name};
    for (const auto& lib : kLibraries) {
      candidates.push_back(lib.folder + "/include/" + name);
      candidates.push_back(lib.folder + "/cuda/include/" + name);
    }
    for (const auto& c : candidates)
      if (files.count(c)) {
        out.push_back(c);
        break;
      }
  }
  return out;
}

TEST(Layering, IncludeGraphHasNoCyclesAndNoUpwardArrows) {
  const auto files = library_files();
  ASSERT_GT(files.size(), 100u);
  std::map<std::string, std::vector<std::string>> graph;
  int arrows = 0;
  for (const auto& [file, lib] : files) {
    graph[file] = includes_of(file, files);
    for (const auto& target : graph[file]) {
      const Library* to = files.at(target);
      arrows += to != lib;
      EXPECT_TRUE(to == lib || to->floor < lib->floor)
          << file << " (" << lib->folder << ", floor " << lib->floor << ") includes " << target << " (" << to->folder
          << ", floor " << to->floor << ")";
    }
  }
  EXPECT_GT(arrows, 50);  // the resolver still finds the libraries' includes of each other
  // No file reaches itself through its includes (depth-first search; the path of the first cycle).
  std::map<std::string, int> state;  // 1: on the current path, 2: done
  std::vector<std::string> path;
  std::function<bool(const std::string&)> cyclic = [&](const std::string& f) {
    state[f] = 1;
    path.push_back(f);
    for (const auto& g : graph[f]) {
      if (state[g] == 1) {
        path.push_back(g);
        return true;
      }
      if (state[g] == 0 && cyclic(g)) return true;
    }
    path.pop_back();
    state[f] = 2;
    return false;
  };
  for (const auto& [file, lib] : files)
    if (state[file] == 0 && cyclic(file)) {
      std::string cycle;
      for (const auto& f : path) cycle += (cycle.empty() ? "" : " -> ") + f;
      ADD_FAILURE() << "include cycle: " << cycle;
      break;
    }
}

// search/ is a floor above sim/: nothing in sim/ names piper_search, and search/ links piper_sim.
TEST(Layering, SearchSitsAboveTheSimulator) {
  for (const auto& e : fs::recursive_directory_iterator(kRoot / "sim")) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path());
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_EQ(ss.str().find("piper_search"), std::string::npos) << e.path();
    EXPECT_EQ(ss.str().find("piper/search/"), std::string::npos) << e.path();
  }
  std::ifstream in(kRoot / "search/CMakeLists.txt");
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find("target_link_libraries(piper_search PUBLIC piper_sim)"), std::string::npos);
}
