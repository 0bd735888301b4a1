// Machinery shared by the result-producing drivers (`piper sweep`, `piper tune`): CSV fields and a
// resumable append-only results file (complete rows survive a kill, a cut last row is dropped). The
// worker pool they run on is worker_pool.hpp.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "piper/core/error.hpp"

namespace piper::search {

// A results file that cannot be read, resumed or written: one line naming the file (and line).
class ResultsFileError : public core::Error {
 public:
  using core::Error::Error;
};

// One CSV field: quoted (with doubled quotes) only when it holds a comma, a quote or a newline.
std::string csv_field(const std::string& s);
// Splits one CSV line (no newline) into fields, honouring double quotes.
std::vector<std::string> csv_split(const std::string& line);
// What is wrong with one CSV line's quoting (RFC 4180: a quote opens a field, is doubled inside one,
// and closes it just before a comma or the line's end), "" when nothing is: csv_split reads `1,"2"3`
// as 23 and an unterminated `"2` as 2.
std::string csv_quoting_problem(const std::string& line);
// Newlines and carriage returns become spaces (reasons and messages are kept to one CSV line).
std::string one_line(std::string s);
// The header line for `columns` (no newline).
std::string csv_header(const std::vector<std::string>& columns);
// Every status a results row may hold: a sweep writes ok, invalid and error; the tuner also pruned
// (over the memory bound) and bounded (over the step time bound).
const std::vector<std::string>& every_result_status();

// Reads a results file for resuming: checks line 1 first (a file whose first line is not the header,
// or a non-regular file, is refused untouched), then cuts a trailing partial line (a run killed
// mid-write) off the file and returns the fields of every complete data row. `kind` names the file type in errors
// ("sweep", "tune"). Throws ResultsFileError if the header differs from `columns` or a row has the
// wrong field count. A missing or empty file yields no rows (and is not created). A header that is
// `columns` less some of them, in the same order, is refused as an older piper's file, naming what it
// lacks (its rows could be read, but new rows could not be appended under its header): columns come
// from the settings table, so a new setting adds one without a list of versions to keep.
// A resumed row stands for its item, so every row must be one a driver could have written (a
// hand-edited status "bogus" or step time "nan" was kept as done and never rerun): its `status` one of
// `statuses`; the figures an Outcome fills (step_time_s ... tp_comm_s, those among `columns`) finite
// numbers >= 0 in an ok row (oom 0 or 1) and blank in any other; an ok row names its devices; an
// `estimated_memory_bytes` blank or a number >= 0. Else ResultsFileError naming the line and column.
// What a reader does with a last line (or header) cut by a kill: a driver resuming the file
// (`Repair::CutPartialLine`, it appends next) cuts it off once every whole row passed the checks above;
// a reader that only looks (`tune --show`, piper-studio) leaves the file as it is and skips it, since
// the line may be a row a running search is writing.
enum class Repair { CutPartialLine, LeaveFile };
std::vector<std::vector<std::string>> read_results(const std::string& csv_path, const std::vector<std::string>& columns,
                                                   const std::string& kind, const std::vector<std::string>& statuses,
                                                   Repair repair);

// Appends rows to a results file (O_APPEND, one write + fdatasync per row), writing the header first
// when the file is new or empty; refuses a path that is not a regular file. A failed write (a full
// disk) is cut off the file, so only whole rows remain, and throws ResultsFileError naming the
// system's reason; a file this appender created and that got no row is then removed.
class ResultsAppender {
 public:
  ResultsAppender(const std::string& csv_path, const std::vector<std::string>& columns);
  ~ResultsAppender();
  ResultsAppender(const ResultsAppender&) = delete;
  ResultsAppender& operator=(const ResultsAppender&) = delete;
  void append(const std::string& row);  // without its newline; thread-safe
  const std::string& path() const { return path_; }

 private:
  void write_line(const std::string& line);
  void cut_partial_row();
  void abandon();
  std::string path_;
  int fd_ = -1;
  bool created_ = false, failed_ = false;
  std::int64_t size_ = 0, rows_ = 0;
  std::mutex mutex_;
};

}  // namespace piper::search
