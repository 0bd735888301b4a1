// Where the GPU tests and benchmarks find the repository's data (tests/data, examples/, sim/data),
// without depending on the path the build was configured in: the folder $PIPER_DATA_DIR names, else
// the tree two folders above the binary (build-gpu/bin/../.., as a build and ../shared/tools/
// gpu-bundle.sh's .gpu/root lay it out), else the source tree of the build (PIPER_SOURCE_DIR).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace piper::test {

inline std::string data_root() {
  namespace fs = std::filesystem;
  auto holds_data = [](const fs::path& p) {
    std::error_code ec;
    return fs::is_directory(p / "tests" / "data", ec);
  };
  if (const char* d = std::getenv("PIPER_DATA_DIR"); d != nullptr && *d != '\0') return d;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path up = (exe.parent_path() / ".." / "..").lexically_normal();
    if (holds_data(up)) return up.string();
  }
  return PIPER_SOURCE_DIR;
}

}  // namespace piper::test
