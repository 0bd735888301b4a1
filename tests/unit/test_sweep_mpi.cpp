// `piper sweep` under mpirun -np 2: the combinations are split over the ranks and gathered into one
// CSV whose rows equal a local sweep's; a rerun resumes; a bad spec ends every rank with one line.
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "shell.hpp"

namespace fs = std::filesystem;

namespace {

using piper::test::mpirun;
using piper::test::Result;
using piper::test::sh;

const std::string kSpec = std::string(PIPER_SOURCE_DIR) + "/examples/sweeps/qwen3-9m-quick.json";

std::vector<std::string> lines_of(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// key -> row without the two wall-time columns (compile_time_s, simulate_time_s, adjacent; found by
// name in the header; only the last field, reason, may hold a quoted comma).
std::map<std::string, std::string> rows_by_key(const fs::path& p) {
  std::map<std::string, std::string> out;
  const auto lines = lines_of(p);
  if (lines.empty()) return out;
  std::size_t compile_field = 0, fields = 1;
  {
    std::stringstream header(lines[0]);
    std::size_t i = 0;
    for (std::string name; std::getline(header, name, ','); ++i) {
      if (name == "compile_time_s") compile_field = i;
      fields = i + 1;
    }
  }
  EXPECT_GT(compile_field, 0u) << "no compile_time_s column: " << lines[0];
  const std::size_t needed = fields - 1;
  for (std::size_t i = 1; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    std::vector<std::size_t> commas;
    for (std::size_t c = 0; c < line.size() && commas.size() < needed; ++c)
      if (line[c] == ',') commas.push_back(c);
    EXPECT_EQ(commas.size(), needed) << line;
    if (commas.size() < needed) continue;
    // Drop fields compile_field and compile_field + 1 (with the comma before the first).
    const std::string row = line.substr(0, commas[compile_field - 1]) + line.substr(commas[compile_field + 1]);
    const std::string key = row.substr(0, row.find(','));
    EXPECT_TRUE(out.emplace(key, row).second) << "key twice: " << key;
  }
  return out;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("piper-sweep-mpi-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Sweeps `spec` locally and under mpirun -np 2 (dir/local.csv, dir/mpi.csv) and checks that the MPI run
// split `combinations` over the two ranks and wrote one header and the local run's rows.
void expect_mpi_rows_equal_local(const std::string& spec, const fs::path& dir, std::size_t combinations) {
  const Result local = sh(std::string(PIPER_CLI) + " sweep " + spec + " -o " + (dir / "local.csv").string() + " -j 1");
  ASSERT_EQ(local.code, 0) << local.output;
  const Result mpi = sh(mpirun(2) + PIPER_CLI + " sweep " + spec + " -o " + (dir / "mpi.csv").string() + " -j 1");
  ASSERT_EQ(mpi.code, 0) << mpi.output;
  EXPECT_NE(mpi.output.find(std::to_string(combinations) + " combinations: 0 already in"), std::string::npos)
      << mpi.output;
  EXPECT_NE(mpi.output.find("on 2 MPI ranks"), std::string::npos) << mpi.output;
  EXPECT_EQ(lines_of(dir / "mpi.csv").front(), lines_of(dir / "local.csv").front());  // one header
  const auto a = rows_by_key(dir / "mpi.csv");
  EXPECT_EQ(a.size(), combinations);
  EXPECT_EQ(a, rows_by_key(dir / "local.csv"));
}

// The quick spec has 2*3*2*2*2*2 = 96 combinations (pp, dp, ep, zero, schedule, microbatches).
TEST(SweepMpi, TwoRanksWriteTheSameRowsAsALocalSweep) {
  const fs::path dir = fresh_dir("same");
  expect_mpi_rows_equal_local(kSpec, dir, 96);
  fs::remove_all(dir);
}

// The same over a sweep of 6 combinations (the ep 3 ones invalid, recorded as such): the case
// MpiLeakCheck.Sweep runs with leak checking in every rank, where the quick spec's 96 took most of a
// minute under the slow unwinder.
TEST(SweepMpi, TwoRanksShareASmallSweep) {
  const fs::path dir = fresh_dir("small");
  {
    std::ofstream(dir / "small.json") << R"({"model": "qwen3-9m", "cluster": "dgx-h200", "engine": "analytic",
      "pp": [1, 2, 4], "ep": [1, 3], "schedule": ["1f1b"], "microbatches": [4]})";
  }
  expect_mpi_rows_equal_local((dir / "small.json").string(), dir, 6);
  fs::remove_all(dir);
}

TEST(SweepMpi, ResumesAKilledRun) {
  const fs::path dir = fresh_dir("resume");
  const fs::path csv = dir / "mpi.csv";
  ASSERT_EQ(sh(mpirun(2) + PIPER_CLI + " sweep " + kSpec + " -o " + csv.string() + " -j 1").code, 0);
  const auto full = rows_by_key(csv);
  // Keep the header and 10 rows, then a row cut mid-write (as a kill leaves it).
  const auto lines = lines_of(csv);
  {
    std::ofstream out(csv, std::ios::trunc);
    for (std::size_t i = 0; i <= 10; ++i) out << lines[i] << "\n";
    out << lines[11].substr(0, 12);
  }
  const Result again = sh(mpirun(2) + PIPER_CLI + " sweep " + kSpec + " -o " + csv.string() + " -j 1");
  ASSERT_EQ(again.code, 0) << again.output;
  EXPECT_NE(again.output.find("96 combinations: 10 already in"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("86 run"), std::string::npos) << again.output;
  EXPECT_EQ(rows_by_key(csv), full);
  fs::remove_all(dir);
}

TEST(SweepMpi, BadSpecEndsEveryRankWithOneLine) {
  const fs::path dir = fresh_dir("bad");
  { std::ofstream(dir / "bad.json") << R"({"model": "qwen3-9m", "pp": "four"})"; }
  const Result r =
      sh(mpirun(2) + PIPER_CLI + " sweep " + (dir / "bad.json").string() + " -o " + (dir / "out.csv").string());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("pp"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "out.csv"));
  fs::remove_all(dir);
}

}  // namespace
