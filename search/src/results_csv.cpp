// Resumable CSV results files shared by sweeps and the tuner.
#include "piper/search/results_csv.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <system_error>

#include <fmt/format.h>

#include "piper/core/limits.hpp"

namespace piper::search {

namespace fs = std::filesystem;

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::vector<std::string> csv_split(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"')
        out.back() += '"', ++i;
      else if (c == '"')
        quoted = false;
      else
        out.back() += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}

std::string csv_quoting_problem(const std::string& line) {
  std::size_t field = 1;
  bool at_start = true, quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c != '"') continue;
      if (i + 1 < line.size() && line[i + 1] == '"') {
        ++i;
        continue;
      }
      quoted = false;
      if (i + 1 < line.size() && line[i + 1] != ',')
        return fmt::format("field {}: text after its closing quote", field);
    } else if (c == ',') {
      ++field;
      at_start = true;
    } else if (c == '"') {
      if (!at_start) return fmt::format("field {}: a quote inside an unquoted field", field);
      quoted = true;
      at_start = false;
    } else {
      at_start = false;
    }
  }
  return quoted ? fmt::format("field {}: a quote that is never closed", field) : "";
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  return s;
}

std::string csv_header(const std::vector<std::string>& columns) {
  std::string h;
  for (const auto& c : columns) h += (h.empty() ? "" : ",") + c;
  return h;
}

const std::vector<std::string>& every_result_status() {
  static const std::vector<std::string> statuses = {"ok", "invalid", "error", "pruned", "bounded"};
  return statuses;
}

namespace {

// `cell` as a finite number >= 0, or nullopt: the whole cell, in the form fmt writes (no blanks,
// no hex, no sign; "nan" and "inf" are not finite).
std::optional<double> non_negative_number(const std::string& cell) {
  double v = 0;
  const char* end = cell.data() + cell.size();
  const auto [ptr, ec] = std::from_chars(cell.data(), end, v, std::chars_format::general);
  if (cell.empty() || ec != std::errc() || ptr != end || !std::isfinite(v) || v < 0) return std::nullopt;
  return v;
}

// Refuses a row no driver could have written (see read_results): it would be resumed as done.
void check_row(const std::vector<std::string>& fields, const std::vector<std::string>& columns,
               const std::vector<std::string>& statuses, const std::string& path, int line_no) {
  auto column = [&](const std::string& name) -> const std::string* {
    const auto at = std::find(columns.begin(), columns.end(), name);
    return at == columns.end() ? nullptr : &fields[static_cast<std::size_t>(at - columns.begin())];
  };
  auto bad = [&](const std::string& name, const std::string& what) {
    return ResultsFileError(fmt::format("{}: line {}: column '{}': {}, got '{}'; remove the row to rerun it", path,
                                        line_no, name, what, core::printable(*column(name), 40)));
  };
  const std::string* status = column("status");
  if (status == nullptr) return;
  if (std::find(statuses.begin(), statuses.end(), *status) == statuses.end()) {
    std::string names = statuses.back();
    if (statuses.size() > 1)
      names = fmt::format("{} or {}", fmt::join(statuses.begin(), statuses.end() - 1, ", "), statuses.back());
    throw bad("status", "not " + names);
  }
  const bool ok = *status == "ok";
  for (const char* name : {"step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "peak_memory_bytes", "oom",
                           "compile_time_s", "simulate_time_s", "tp_comm_s"}) {
    const std::string* cell = column(name);
    if (cell == nullptr) continue;
    if (!ok) {
      if (!cell->empty()) throw bad(name, "a figure of a row that was not simulated (status " + *status + ") is blank");
      continue;
    }
    const std::optional<double> v = non_negative_number(*cell);
    if (!v) throw bad(name, "expected a finite number >= 0 in an ok row");
    if (std::string(name) == "oom" && *v != 0 && *v != 1) throw bad(name, "expected 0 or 1");
  }
  if (const std::string* devices = column("devices"); ok && devices != nullptr && devices->empty())
    throw bad("devices", "an ok row names its devices");
  if (const std::string* estimate = column("estimated_memory_bytes");
      estimate != nullptr && !estimate->empty() && !non_negative_number(*estimate))
    throw bad("estimated_memory_bytes", "expected a number of bytes >= 0, or blank");
}

// The columns an older version's file lacks, when `header` is `columns` less some of them (in order);
// empty otherwise.
std::vector<std::string> missing_in_older_version(const std::string& header, const std::vector<std::string>& columns) {
  const std::vector<std::string> given = csv_split(header);
  std::vector<std::string> missing;
  std::size_t k = 0;
  for (const auto& c : columns) {
    if (k < given.size() && given[k] == c)
      ++k;
    else
      missing.push_back(c);
  }
  if (k != given.size() || given.size() < 2 || given.front() != columns.front()) return {};
  return missing;
}

}  // namespace

std::vector<std::vector<std::string>> read_results(const std::string& path, const std::vector<std::string>& columns,
                                                   const std::string& kind, const std::vector<std::string>& statuses,
                                                   Repair repair) {
  std::vector<std::vector<std::string>> rows;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return rows;
  // Only a regular file can be resumed and appended to; anything else is refused untouched.
  if (!fs::is_regular_file(st))
    throw ResultsFileError(
        fmt::format("{}: not a regular file, so not a piper {} results file; choose another -o", path, kind));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ResultsFileError(path + ": cannot open for reading: " + std::strerror(errno));
  const std::string header = csv_header(columns);
  // The header is checked before anything else is read or repaired: a file that is not a results
  // file is refused as it is (never cut, never appended to). Line 1 is at most one header long.
  std::string text(header.size() + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  const std::size_t first_nl = text.find('\n');
  const bool whole_file = text.size() <= header.size();
  auto not_results = [&] {
    return ResultsFileError(
        fmt::format("{}: line 1: not a piper {} results file (header differs); choose another -o", path, kind));
  };
  if (first_nl == std::string::npos) {
    // No complete line: a header cut by a kill (a prefix of it) starts the file over; anything else
    // is someone else's file.
    if (!whole_file || header.compare(0, text.size(), text) != 0) throw not_results();
    if (!text.empty() && repair == Repair::CutPartialLine) {
      fs::resize_file(path, 0, ec);
      if (ec) throw ResultsFileError(path + ": cannot cut the partial header: " + ec.message());
    }
    return rows;
  }
  const std::string first = text.substr(0, first_nl);
  if (first != header) {
    const std::vector<std::string> missing = missing_in_older_version(first, columns);
    if (missing.empty()) throw not_results();
    std::string names = missing.back();
    if (missing.size() > 1)
      names = fmt::format("{} and {}", fmt::join(missing.begin(), missing.end() - 1, ", "), missing.back());
    throw ResultsFileError(fmt::format("{}: line 1: written by an older piper {} (no {} column{}); choose another -o",
                                       path, kind, names, missing.size() > 1 ? "s" : ""));
  }
  {
    // Bounded (Limit::InputBytes, sized before reading): a huge file is refused, not read whole.
    const auto size = fs::file_size(path, ec);
    if (!ec) {
      try {
        core::check_limit(core::Limit::InputBytes, static_cast<std::int64_t>(size), path, "bytes");
      } catch (const core::Error& e) {
        throw ResultsFileError(e.what());
      }
    }
    std::ostringstream rest;
    rest << in.rdbuf();
    text += rest.str();
  }
  // Rows are written whole and newline-terminated, so everything after the last newline is a row cut
  // by a kill (or one a running search is writing): left out of the rows, and cut off the file only
  // by a resuming driver once every whole row passed (a refused row leaves the file untouched).
  const std::size_t complete = text.rfind('\n') + 1;
  const std::size_t size = text.size();
  text.resize(complete);
  std::size_t pos = first_nl + 1;
  int line_no = 1;
  while (pos < text.size()) {
    const std::size_t end = text.find('\n', pos);
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    line_no += 1;
    auto fields = csv_split(line);
    if (fields.size() != columns.size())
      throw ResultsFileError(
          fmt::format("{}: line {}: {} fields, expected {}", path, line_no, fields.size(), columns.size()));
    check_row(fields, columns, statuses, path, line_no);
    rows.push_back(std::move(fields));
  }
  if (complete < size && repair == Repair::CutPartialLine) {
    fs::resize_file(path, complete, ec);
    if (ec) throw ResultsFileError(path + ": cannot cut the partial last line: " + ec.message());
  }
  return rows;
}

ResultsAppender::ResultsAppender(const std::string& csv_path, const std::vector<std::string>& columns)
    : path_(csv_path) {
  std::error_code ec;
  const fs::file_status st = fs::status(csv_path, ec);
  if (!ec && fs::exists(st) && !fs::is_regular_file(st))
    throw ResultsFileError(csv_path + ": not a regular file; choose another -o");
  // O_EXCL first: whether this run created the file decides whether a failure removes it.
  fd_ = ::open(csv_path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  created_ = fd_ >= 0;
  if (fd_ < 0 && errno == EEXIST) fd_ = ::open(csv_path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd_ < 0) throw ResultsFileError(fmt::format("{}: cannot open for appending: {}", csv_path, std::strerror(errno)));
  struct stat sb {};
  if (::fstat(fd_, &sb) != 0) {
    const int err = errno;
    ::close(fd_);
    throw ResultsFileError(fmt::format("{}: cannot open for appending: {}", csv_path, std::strerror(err)));
  }
  size_ = static_cast<std::int64_t>(sb.st_size);
  if (size_ == 0) {
    try {
      write_line(csv_header(columns) + "\n");
    } catch (...) {
      abandon();
      throw;
    }
  }
}

ResultsAppender::~ResultsAppender() {
  if (fd_ >= 0) ::close(fd_);
}

void ResultsAppender::write_line(const std::string& line) {
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      cut_partial_row();
      throw ResultsFileError(fmt::format("{}: write failed: {}", path_, std::strerror(err)));
    }
    done += static_cast<std::size_t>(n);
  }
  // On disk before the next row is computed: a power cut loses at most the row being written.
  if (::fdatasync(fd_) != 0) {
    const int err = errno;
    cut_partial_row();
    throw ResultsFileError(fmt::format("{}: write failed: {}", path_, std::strerror(err)));
  }
  size_ += static_cast<std::int64_t>(line.size());
}

void ResultsAppender::cut_partial_row() {
  // Best effort: if even this fails, read_results drops the partial row on the next run.
  if (::ftruncate(fd_, static_cast<off_t>(size_)) != 0) return;
}

void ResultsAppender::abandon() {
  // A file this run created and that holds no row (a header at most) is removed; an existing file
  // keeps its whole rows.
  if (created_ && rows_ == 0) {
    std::error_code ignored;
    fs::remove(path_, ignored);
  }
}

void ResultsAppender::append(const std::string& row) {
  // One write + fdatasync per row under the lock: a kill can only cut the row being written, which
  // read_results drops; a failed write is cut off here.
  std::lock_guard lock(mutex_);
  if (failed_) throw ResultsFileError(path_ + ": an earlier write failed");
  try {
    write_line(row + "\n");
  } catch (...) {
    failed_ = true;
    abandon();
    throw;
  }
  rows_ += 1;
}

}  // namespace piper::search
