// Reliability of what Piper writes (issue #28, outputs): results files are never destroyed, lost
// output is an error, writers replace only regular files, checkpoints prove their integrity, and a
// diverging run stops. Each case is a command of the reliability probe; each failed before its fix.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../unit/shell.hpp"
#include "piper/core/error.hpp"
#include "piper/core/program.hpp"
#include "piper/runtime/checkpoint.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using piper::test::mpirun;
using piper::test::read_file;
using piper::test::Result;
using piper::test::sh;
using piper::test::write_file;

namespace {

const std::string kCli = PIPER_CLI;
const std::string kSource = PIPER_SOURCE_DIR;
const std::string kDense = kSource + "/tests/data/runtime-tiny-dense.json";
const std::string kQuickSweep = kSource + "/examples/sweeps/qwen3-9m-quick.json";

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The lines that are errors ("piper: ..." on stderr; the command's stdout is sent to /dev/null).
std::vector<std::string> error_lines(const Result& r) {
  std::vector<std::string> out;
  for (const auto& l : lines_of(r.output))
    if (l.rfind("piper: ", 0) == 0) out.push_back(l);
  return out;
}

// `cmd` with its standard output discarded and its standard error kept (sh() adds 2>&1 after it).
std::string quiet(const std::string& cmd) { return "{ " + cmd + " > /dev/null; }"; }

bool is_root() { return ::geteuid() == 0; }

// Each test works in its own scratch folder, removed afterwards.
class Outputs : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("piper_outputs_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!mounted_.empty()) ::umount2(mounted_.c_str(), MNT_DETACH);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // A compiled 2-stage plan of the tiny dense model (microbatches 4, 1F1B).
  std::string plan() {
    const std::string p = path("a.json");
    Result r = sh(quiet(kCli + " compile --model " + kDense + " --pp 2 --microbatches 4 --schedule 1f1b -o " + p));
    EXPECT_EQ(r.code, 0) << r.output;
    return p;
  }
  // A full file system of 64 KiB at dir/full (root only; false when it cannot be made).
  bool full_disk() {
    const fs::path m = dir_ / "full";
    fs::create_directories(m);
    if (!is_root() || ::mount("tmpfs", m.c_str(), "tmpfs", 0, "size=64k") != 0) return false;
    mounted_ = m.string();
    sh("dd if=/dev/zero of=" + (m / "filler").string() + " bs=4k 2>/dev/null");
    return true;
  }
  fs::path dir_;
  std::string mounted_;
};

// ---------------------------------------------------------------------------------------------
// 4. Results files are never destroyed
// ---------------------------------------------------------------------------------------------

TEST_F(Outputs, SweepRefusesAFileThatIsNotAResultsFileAndLeavesItUntouched) {
  const std::string keep = path("keep.json");
  write_file(keep, "{\"a\":1}");  // no newline: the old repair cut it to nothing
  Result r = sh(quiet(kCli + " sweep " + kQuickSweep + " -o " + keep));
  EXPECT_NE(r.code, 0) << r.output;
  ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("not a piper sweep results file"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(keep), "{\"a\":1}");
  // Several lines and a cut last one: refused before any repair.
  write_file(keep, "name,value\nx,1\ny,");
  r = sh(quiet(kCli + " sweep " + kQuickSweep + " -o " + keep));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_EQ(read_file(keep), "name,value\nx,1\ny,");
}

TEST_F(Outputs, TuneRefusesAFileThatIsNotAResultsFileAndLeavesItUntouched) {
  const std::string keep = path("keep.json");
  write_file(keep, "{\"a\":1}");
  Result r = sh(quiet(kCli + " tune --model qwen3-9m --devices 2 --top 0 -o " + keep));
  EXPECT_NE(r.code, 0) << r.output;
  ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("not a piper tune results file"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(keep), "{\"a\":1}");
}

TEST_F(Outputs, MpiSweepRefusesAFileThatIsNotAResultsFileAndLeavesItUntouched) {
  const std::string keep = path("keep.json");
  write_file(keep, "{\"a\":1}");
  Result r = sh(quiet(mpirun(2) + kCli + " sweep " + kQuickSweep + " -o " + keep));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("not a piper sweep results file"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(keep), "{\"a\":1}");
}

TEST_F(Outputs, ResultsFileMustBeARegularFile) {
  const std::string folder = path("folder");
  fs::create_directories(folder);
  Result r = sh(quiet(kCli + " sweep " + kQuickSweep + " -o " + folder));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("not a regular file"), std::string::npos) << r.output;
}

// A header cut by a kill (a prefix of it, no newline) starts the file over; the sweep completes.
TEST_F(Outputs, CutHeaderStartsTheFileOver) {
  const std::string out = path("out.csv");
  Result full = sh(quiet(kCli + " sweep " + kQuickSweep + " -o " + out));
  ASSERT_EQ(full.code, 0) << full.output;
  const std::string whole = read_file(out);
  const std::string header = whole.substr(0, whole.find('\n'));
  write_file(out, header.substr(0, 10));
  Result again = sh(quiet(kCli + " sweep " + kQuickSweep + " -o " + out));
  ASSERT_EQ(again.code, 0) << again.output;
  EXPECT_EQ(lines_of(read_file(out)).size(), lines_of(whole).size());
  EXPECT_EQ(lines_of(read_file(out)).front(), header);
}

// A write that fails (a file size limit: EFBIG) leaves only whole rows, says why, and resumes.
TEST_F(Outputs, FailedAppendLeavesOnlyWholeRowsAndResumes) {
  const std::string out = path("out.csv");
  Result cut = sh(quiet("trap '' XFSZ; ulimit -f 2; " + kCli + " sweep " + kQuickSweep + " -j 1 -o " + out));
  EXPECT_NE(cut.code, 0) << cut.output;
  ASSERT_EQ(error_lines(cut).size(), 1u) << cut.output;
  EXPECT_NE(cut.output.find("File too large"), std::string::npos) << cut.output;
  const std::string text = read_file(out);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');  // no partial row
  const auto header_fields = std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(text.find('\n')), ',');
  for (const auto& line : lines_of(text)) EXPECT_EQ(std::count(line.begin(), line.end(), ','), header_fields) << line;
  Result rest = sh(kCli + " sweep " + kQuickSweep + " -o " + out);
  ASSERT_EQ(rest.code, 0) << rest.output;
  EXPECT_EQ(lines_of(read_file(out)).size(), 97u);  // header + 3 x 2 x 2 x 2 x 2 x 2 combinations
}

// 12. A full disk leaves no header-only CSV and no empty trace folder.
TEST_F(Outputs, FullDiskLeavesNoHeaderOnlyCsvAndNoTraceFolder) {
  const std::string a = plan();
  if (!full_disk()) GTEST_SKIP() << "needs root to mount a 64 KiB tmpfs";
  const std::string out = mounted_ + "/out.csv";
  Result r = sh(quiet(kCli + " sweep " + kQuickSweep + " -o " + out));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("No space left on device"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
  const std::string traces = mounted_ + "/traces/deep";
  Result e = sh(quiet(kCli + " export-chakra " + a + " -o " + traces));
  EXPECT_NE(e.code, 0) << e.output;
  EXPECT_EQ(error_lines(e).size(), 1u) << e.output;
  EXPECT_FALSE(fs::exists(mounted_ + "/traces"));
}

// ---------------------------------------------------------------------------------------------
// 5. Lost standard output is an error
// ---------------------------------------------------------------------------------------------

TEST_F(Outputs, OutputToAFullDeviceIsAnError) {
  const std::string a = plan();
  const std::string csv = kSource + "/tests/fixtures/pytorch-schedules/dualpipev_4rank_10mb.csv";
  const std::vector<std::string> commands = {
      "models",
      "directives --pp 2 --dp 2 --schedule 1f1b --microbatches 4",
      "schedule export-csv dualpipev --ranks 4 --microbatches 10",
      "schedule import-csv " + csv,
      "verify " + a,
      "simulate --plan " + a,
      "limits",
  };
  for (const auto& c : commands) {
    Result r = sh("{ " + kCli + " " + c + " > /dev/full; }");
    // Output that fits the stdio buffer fails at the final flush; longer output (import-csv) in a
    // write fmt::print checks itself. Either way: exit 1 and one line with the reason.
    EXPECT_EQ(r.code, 1) << c << "\n" << r.output;
    const auto errors = error_lines(r);
    ASSERT_EQ(errors.size(), 1u) << c << "\n" << r.output;
    EXPECT_EQ(errors[0], "piper: error writing standard output: No space left on device") << c;
  }
  // The same commands to a working stdout still succeed.
  EXPECT_EQ(sh(kCli + " models > /dev/null").code, 0);
}

// A report or trace that cannot be written at the end of an mpirun run (probe 5): rank 0 called it
// `piper: internal error: ... (please report this: it is a bug in piper)` and the job exited 3;
// without mpirun the same write fails with exit 2. Now exit 2 and one line under mpirun too.
TEST_F(Outputs, DistributedRunOutputWriteFailureIsBadOutputNotInternal) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const std::string a = plan();
  for (const char* flag : {"--report", "--trace"}) {
    Result r = sh(quiet(mpirun(2) + kCli + " run --plan " + a + " --steps 1 " + flag + " /dev/full"));
    EXPECT_EQ(r.code, 2) << flag << "\n" << r.output;
    const auto errors = error_lines(r);
    ASSERT_EQ(errors.size(), 1u) << flag << "\n" << r.output;
    EXPECT_EQ(errors[0], "piper: error: rank 0: cannot write /dev/full: No space left on device") << flag;
  }
  // Without mpirun: the same reason, exit 2.
  Result r = sh(quiet(kCli + " run --reference --plan " + a + " --steps 1 --report /dev/full"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("cannot write /dev/full: No space left on device"), std::string::npos) << r.output;
}

// A flag error under mpirun (probe 5): every rank printed the same line (`mpirun -np 2 piper run
// --steps 0`: two lines). Every rank parses the same command line; rank 0 says it, all exit 2.
TEST_F(Outputs, FlagErrorUnderMpirunIsOneLine) {
  const std::string a = plan();
  for (const char* flags : {"--steps 0", "--steps 2 --save-every 0 --save ck", "--stall-timeout 0", "--stepz 2"}) {
    Result r = sh(quiet(mpirun(2) + kCli + " run --plan " + a + " " + flags));
    EXPECT_EQ(r.code, 2) << flags << "\n" << r.output;
    EXPECT_EQ(error_lines(r).size(), 1u) << flags << "\n" << r.output;
  }
  EXPECT_FALSE(fs::exists(path("ck")));
}

// ---------------------------------------------------------------------------------------------
// 6. Writers write into what is not a regular file, and replace only regular files
// ---------------------------------------------------------------------------------------------

TEST_F(Outputs, DeviceNodesStayDeviceNodes) {
  if (!is_root()) GTEST_SKIP() << "mknod needs root";
  const std::string a = plan();
  const std::string node = path("n");
  ASSERT_EQ(::mknod(node.c_str(), S_IFCHR | 0666, makedev(1, 3)), 0) << std::strerror(errno);  // as /dev/null
  const std::vector<std::string> commands = {
      "compile --model qwen3-9m --pp 2 -o " + node,
      "simulate --plan " + a + " --report " + node,
      "simulate --plan " + a + " --trace " + node,
      "run --reference --plan " + a + " --steps 1 --report " + node,
      "run --reference --plan " + a + " --steps 1 --save " + node,
      "schedule export-csv 1f1b -o " + node,
  };
  for (const auto& c : commands) {
    Result r = sh(quiet(kCli + " " + c));
    EXPECT_EQ(r.code, 0) << c << "\n" << r.output;
    struct stat st {};
    ASSERT_EQ(::stat(node.c_str(), &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode)) << c << ": the device node was replaced";
  }
  // run --trace writes through the distributed path (rank 0).
  Result r = sh(quiet(mpirun(2) + kCli + " run --plan " + a + " --steps 1 --trace " + node));
  EXPECT_EQ(r.code, 0) << r.output;
  struct stat st {};
  ASSERT_EQ(::stat(node.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

// A FIFO (no root needed) is written into: its reader receives the plan, and it stays a FIFO.
TEST_F(Outputs, FifoIsWrittenIntoNotReplaced) {
  const std::string fifo = path("plan.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string got = path("got.json");
  Result r = sh("timeout 20 cat " + fifo + " > " + got + " & " + kCli + " compile --model qwen3-9m --pp 2 -o " + fifo +
                " > /dev/null; c=$?; wait; exit $c");
  EXPECT_EQ(r.code, 0) << r.output;
  struct stat st {};
  ASSERT_EQ(::stat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_TRUE(json::parse(read_file(got)).is_object());
}

// A symbolic link to a file stays a link; its target gets the new contents.
TEST_F(Outputs, SymlinkStaysALink) {
  write_file(path("target.json"), "old");
  fs::create_symlink("target.json", path("link.json"));
  Result r = sh(quiet(kCli + " compile --model qwen3-9m --pp 2 -o " + path("link.json")));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::is_symlink(path("link.json")));
  EXPECT_TRUE(json::parse(read_file(path("target.json"))).is_object());
}

TEST_F(Outputs, EmptyOutputPathIsAnError) {
  const std::vector<std::string> commands = {
      "compile --model qwen3-9m --pp 2 -o ''",
      "simulate --model qwen3-9m --pp 2 --report ''",
      "run --reference --model " + kDense + " --steps 1 --save ''",
      "sweep " + kQuickSweep + " -o ''",
  };
  for (const auto& c : commands) {
    Result r = sh(quiet(kCli + " " + c));
    EXPECT_EQ(r.code, 2) << c << "\n" << r.output;
    ASSERT_EQ(error_lines(r).size(), 1u) << c << "\n" << r.output;
    EXPECT_NE(r.output.find("must name a file, got an empty path"), std::string::npos) << c << "\n" << r.output;
  }
  EXPECT_THROW(piper::core::write_file_atomically("", "x"), piper::core::Error);
}

// ---------------------------------------------------------------------------------------------
// 7. Checkpoints prove their integrity
// ---------------------------------------------------------------------------------------------

// The checksum is the standard CRC-32 (zlib's): its published check value.
TEST(CheckpointCrc, IsTheStandardCrc32) {
  const std::string check = "123456789";
  EXPECT_EQ(piper::runtime::crc32(check.data(), check.size()), 0xCBF43926u);
  EXPECT_EQ(piper::runtime::crc32(check.data() + 4, 5, piper::runtime::crc32(check.data(), 4)),
            0xCBF43926u);  // continues
  EXPECT_EQ(piper::runtime::crc32(nullptr, 0), 0u);
}

class Checkpoints : public Outputs {
 protected:
  // A 3-step reference run of the tiny dense model saved to ck; returns the plan.
  std::string saved(int steps = 3) {
    const std::string a = plan();
    Result r = sh(
        quiet(kCli + " run --reference --plan " + a + " --steps " + std::to_string(steps) + " --save " + path("ck")));
    EXPECT_EQ(r.code, 0) << r.output;
    return a;
  }
  Result resume(const std::string& a, const std::string& ck, int steps = 5) {
    return sh(quiet(kCli + " run --reference --plan " + a + " --steps " + std::to_string(steps) + " --resume " + ck));
  }
  static std::size_t body_start(const std::string& bytes) { return bytes.find('\n') + 1; }
};

TEST_F(Checkpoints, AFlippedTensorByteIsRefused) {
  const std::string a = saved();
  std::string bytes = read_file(path("ck"));
  // The sign/exponent byte of the 10th float of the first tensor (little-endian: byte 3).
  bytes[body_start(bytes) + 4 * 10 + 3] ^= 0x01;
  write_file(path("bad"), bytes);
  Result r = resume(a, path("bad"));
  EXPECT_EQ(r.code, 2) << r.output;
  ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("checksum mismatch"), std::string::npos) << r.output;
  EXPECT_EQ(resume(a, path("ck")).code, 0);  // the intact file resumes
}

TEST_F(Checkpoints, AnEditedStepIsRefused) {
  const std::string a = saved();
  std::string bytes = read_file(path("ck"));
  json h = json::parse(bytes.substr(0, bytes.find('\n')));
  const std::int64_t per_step = h.at("sequences_per_step").get<std::int64_t>();
  // Step 3 -> 1 with a matching data position, same header length class: only the checksum knows.
  h["step"] = 1;
  h["data_position"] = per_step;
  write_file(path("bad"), h.dump() + bytes.substr(bytes.find('\n')));
  Result r = resume(a, path("bad"));
  EXPECT_EQ(r.code, 2) << r.output;
  ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("header's checksum does not match"), std::string::npos) << r.output;
}

// Values are checked even where the checksums match (a run that saved NaN, a negative step).
TEST_F(Checkpoints, NanTensorAndNegativeStepAreRefusedWithValidChecksums) {
  const std::string a = saved();
  const std::string bytes = read_file(path("ck"));
  piper::runtime::Checkpoint c = piper::runtime::parse_checkpoint(path("ck"), bytes);
  piper::runtime::Checkpoint nan = c;
  nan.state.layers.begin()->second[0][5] = std::numeric_limits<float>::quiet_NaN();
  piper::runtime::write_checkpoint(path("nan"), nan.info, nan.state);
  Result r = resume(a, path("nan"));
  EXPECT_EQ(r.code, 2) << r.output;
  ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("parameters element 5 is nan"), std::string::npos) << r.output;

  piper::runtime::Checkpoint negative = c;
  negative.info.step = -3;
  negative.info.data_position = -3 * c.info.sequences_per_step;
  piper::runtime::write_checkpoint(path("negative"), negative.info, negative.state);
  r = resume(a, path("negative"));
  EXPECT_EQ(r.code, 2) << r.output;
  ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("checkpoint step -3 is negative"), std::string::npos) << r.output;
}

// Version 2 (no checksums, earlier pipers) still resumes; a version-2 header carrying version-3
// checksums (the version digit flipped) does not.
TEST_F(Checkpoints, VersionTwoStillResumes) {
  const std::string a = saved();
  const std::string bytes = read_file(path("ck"));
  json h = json::parse(bytes.substr(0, bytes.find('\n')));
  json old = h;
  old["version"] = 2;
  old.erase("header_crc32");
  for (auto& l : old["layers"]) l.erase("crc32");
  write_file(path("v2"), old.dump() + bytes.substr(bytes.find('\n')));
  Result r = resume(a, path("v2"));
  EXPECT_EQ(r.code, 0) << r.output;
  h["version"] = 2;
  write_file(path("flipped"), h.dump() + bytes.substr(bytes.find('\n')));
  r = resume(a, path("flipped"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("damaged checkpoint"), std::string::npos) << r.output;
}

TEST_F(Checkpoints, StepsBelowTheCheckpointStepIsAnError) {
  const std::string a = saved(3);
  Result r = resume(a, path("ck"), 2);
  EXPECT_EQ(r.code, 2) << r.output;
  ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("--steps 2 is below the step of the checkpoint"), std::string::npos) << r.output;
  // Under mpirun the same check stops every rank with one line.
  r = sh(quiet(mpirun(2) + kCli + " run --plan " + a + " --steps 2 --resume " + path("ck")));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(error_lines(r).size(), 1u) << r.output;
}

TEST_F(Checkpoints, ASecondWriterToTheSameSavePathIsRefused) {
  const std::string a = plan();
  const std::string ck = path("ck");
  // This process holds the lock a running save would hold.
  const int fd = ::open((ck + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  Result r = sh(quiet(kCli + " run --reference --plan " + a + " --steps 1 --save " + ck));
  EXPECT_EQ(r.code, 2) << r.output;
  ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("another run is saving to this checkpoint"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(ck));
  r = sh(quiet(mpirun(2) + kCli + " run --plan " + a + " --steps 1 --save " + ck));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(error_lines(r).size(), 1u) << r.output;
  ::close(fd);  // released: the save goes through
  r = sh(quiet(kCli + " run --reference --plan " + a + " --steps 1 --save " + ck));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(ck));
}

TEST_F(Checkpoints, StaleTemporaryFilesOfDeadWritersAreRemovedOnSave) {
  const std::string a = plan();
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ::waitpid(child, nullptr, 0);  // reaped: its pid names no process
  const std::string stale = path("ck.tmp." + std::to_string(child));
  const std::string live = path("ck.tmp." + std::to_string(::getpid()));  // this test process is alive
  write_file(stale, "half a checkpoint");
  write_file(live, "someone's save in progress");
  Result r = sh(quiet(kCli + " run --reference --plan " + a + " --steps 1 --save " + path("ck")));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
}

// ---------------------------------------------------------------------------------------------
// 10. Divergence stops the run (or skips the step when asked)
// ---------------------------------------------------------------------------------------------

TEST_F(Outputs, ReferenceRunStopsOnNonFiniteSteps) {
  for (const std::string flags : {" --adam-eps 0", " --lr 1e30"}) {
    Result r = sh(quiet(kCli + " run --reference --model " + kDense + " --steps 3" + flags + " --save-every 1 --save " +
                        path("ck")));
    EXPECT_EQ(r.code, 2) << flags << "\n" << r.output;
    ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
    EXPECT_NE(r.output.find("(training diverged)"), std::string::npos) << r.output;
    // Whatever was saved before the bad step is finite and loads.
    if (fs::exists(path("ck"))) {
      EXPECT_NO_THROW(piper::runtime::parse_checkpoint(path("ck"), read_file(path("ck"))));
    }
    fs::remove(path("ck"));
  }
}

TEST_F(Outputs, ReferenceRunCanSkipNonFiniteSteps) {
  const std::string report = path("run.json");
  Result r = sh(kCli + " run --reference --model " + kDense + " --steps 3 --adam-eps 0 --on-nonfinite skip --report " +
                report + " --save " + path("ck"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("skipped: "), std::string::npos) << r.output;
  const json j = json::parse(read_file(report));
  ASSERT_TRUE(j.contains("skipped_steps")) << j.dump();
  EXPECT_FALSE(j["skipped_steps"].empty());
  // Every recorded loss is finite: skipped updates never reach the state.
  for (const auto& l : j["losses"]) EXPECT_TRUE(l.is_number() && std::isfinite(l.get<double>())) << j.dump();
  EXPECT_NO_THROW(piper::runtime::parse_checkpoint(path("ck"), read_file(path("ck"))));
}

TEST_F(Outputs, DistributedRunStopsOnNonFiniteStepsWithOneLine) {
  const std::string a = plan();
  Result r = sh(quiet(mpirun(2) + kCli + " run --plan " + a + " --steps 3 --adam-eps 0"));
  EXPECT_EQ(r.code, 2) << r.output;
  ASSERT_EQ(error_lines(r).size(), 1u) << r.output;
  EXPECT_NE(r.output.find("(training diverged)"), std::string::npos) << r.output;
  r = sh(mpirun(2) + kCli + " run --plan " + a + " --steps 3 --adam-eps 0 --on-nonfinite skip");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("skipped: "), std::string::npos) << r.output;
}

}  // namespace
