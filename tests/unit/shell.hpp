// Test helpers: run a shell command and capture its exit code and combined output (and, for the tests
// that define PIPER_MPIEXEC, the mpirun prefix they start ranks with); read and write a whole file.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
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

inline void write_file(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

// A CLI run's exit code and its stdout and stderr apart.
struct CliResult {
  int exit_code = -1;
  std::string out, err;
};

// Runs `prefix 'cli' args` in folder `dir` (prefix: environment assignments, `timeout N`, ...),
// capturing stdout and stderr in files there that are removed afterwards.
inline CliResult run_cli_in(const std::filesystem::path& dir, const std::string& cli, const std::string& args,
                            const std::string& prefix = "") {
  const std::filesystem::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd = "cd '" + dir.string() + "' && " + prefix + " '" + cli + "' " + args + " >'" + out.string() +
                          "' 2>'" + err.string() + "'";
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_file(out);
  r.err = read_file(err);
  std::filesystem::remove(out);
  std::filesystem::remove(err);
  return r;
}

#ifdef PIPER_MPIEXEC
// The session-directory base of this test process's mpiruns, removed when the process ends: two mpiruns
// of different tests starting at once (ctest -j) can race creating OpenMPI's shared
// /tmp/ompi.<host>.<uid> and fail in orte_init ("mkdir ... File exists", seen once with two suites
// running side by side).
class MpiSessionBase {
 public:
  MpiSessionBase() : dir_(std::filesystem::temp_directory_path() / ("piper-ompi-" + std::to_string(getpid()))) {
    std::filesystem::create_directories(dir_);
  }
  ~MpiSessionBase() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  MpiSessionBase(const MpiSessionBase&) = delete;
  MpiSessionBase& operator=(const MpiSessionBase&) = delete;
  std::string path() const { return dir_.string(); }

 private:
  std::filesystem::path dir_;
};

// As root mpirun refuses to start without --allow-run-as-root; --oversubscribe lets ranks share 2 cores.
inline std::string mpirun(int ranks) {
  static const MpiSessionBase base;
  return std::string("timeout 120 ") + PIPER_MPIEXEC + " --allow-run-as-root --oversubscribe --mca orte_tmpdir_base " +
         base.path() + " -np " + std::to_string(ranks) + " ";
}
#endif

}  // namespace piper::test
