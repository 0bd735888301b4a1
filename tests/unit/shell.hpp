// Test helpers: run a shell command and capture its exit code and combined output (and, for the tests
// that define PIPER_MPIEXEC, the mpirun prefix they start ranks with); read and write a whole file.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace piper::test {

struct Result {
  int code = -1;
  std::string output;
};

inline Result sh(const std::string& cmd) {
  Result r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) r.output += buf;
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_file(const std::filesystem::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

#ifdef PIPER_MPIEXEC
// As root mpirun refuses to start without --allow-run-as-root; --oversubscribe lets ranks share 2 cores.
inline std::string mpirun(int ranks) {
  return std::string("timeout 120 ") + PIPER_MPIEXEC + " --allow-run-as-root --oversubscribe -np " + std::to_string(ranks) + " ";
}
#endif

}  // namespace piper::test
