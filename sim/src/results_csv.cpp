// Resumable CSV results files and the worker pool shared by sweeps and the tuner.
#include "piper/sim/results_csv.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "piper/core/limits.hpp"

namespace piper::sim {

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
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') out.back() += '"', ++i;
      else if (c == '"') quoted = false;
      else out.back() += c;
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

namespace {

// The columns an older version's file lacks, when `header` is one; empty otherwise.
std::vector<std::string> missing_in_older_version(const std::string& header, const std::vector<std::string>& columns,
                                                  const std::vector<std::vector<std::string>>& added) {
  for (std::size_t since = 0; since < added.size(); ++since) {
    std::vector<std::string> missing;
    for (std::size_t k = since; k < added.size(); ++k) missing.insert(missing.end(), added[k].begin(), added[k].end());
    std::vector<std::string> older = columns;
    std::erase_if(older, [&](const std::string& c) { return std::find(missing.begin(), missing.end(), c) != missing.end(); });
    if (header == csv_header(older)) return missing;
  }
  return {};
}

}  // namespace

std::vector<std::vector<std::string>> read_results(const std::string& path, const std::vector<std::string>& columns,
                                                   const std::string& kind, const std::vector<std::vector<std::string>>& added) {
  std::vector<std::vector<std::string>> rows;
  std::error_code ec;
  if (!fs::exists(path, ec)) return rows;
  std::string text;
  try {
    // Bounded (Limit::InputBytes, sized before reading): `-o /dev/zero` is refused, not read whole.
    text = core::read_input_file(path);
  } catch (const core::Error& e) {
    throw ResultsFileError(e.what());
  }
  // Rows are written whole and newline-terminated, so everything after the last newline is a row cut
  // by a kill: drop it (its item simply reruns).
  const std::size_t complete = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
  if (complete < text.size()) {
    fs::resize_file(path, complete, ec);
    if (ec) throw ResultsFileError(path + ": cannot cut the partial last line: " + ec.message());
    text.resize(complete);
  }
  if (text.empty()) return rows;
  const std::string header = csv_header(columns);
  std::size_t pos = 0;
  int line_no = 0;
  while (pos < text.size()) {
    const std::size_t end = text.find('\n', pos);
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    line_no += 1;
    if (line_no == 1) {
      if (line == header) continue;
      const std::vector<std::string> missing = missing_in_older_version(line, columns, added);
      if (missing.empty())
        throw ResultsFileError(fmt::format("{}: line 1: not a piper {} results file (header differs); choose another -o", path, kind));
      std::string names = missing.back();
      if (missing.size() > 1) names = fmt::format("{} and {}", fmt::join(missing.begin(), missing.end() - 1, ", "), missing.back());
      throw ResultsFileError(fmt::format("{}: line 1: written by an older piper {} (no {} column{}); choose another -o", path, kind,
                                         names, missing.size() > 1 ? "s" : ""));
    }
    auto fields = csv_split(line);
    if (fields.size() != columns.size())
      throw ResultsFileError(fmt::format("{}: line {}: {} fields, expected {}", path, line_no, fields.size(), columns.size()));
    rows.push_back(std::move(fields));
  }
  return rows;
}

ResultsAppender::ResultsAppender(const std::string& csv_path, const std::vector<std::string>& columns)
    : path_(csv_path), file_(nullptr, &std::fclose) {
  std::error_code ec;
  const bool fresh = !fs::exists(csv_path, ec) || fs::file_size(csv_path, ec) == 0;
  file_.reset(std::fopen(csv_path.c_str(), "ab"));
  if (!file_) throw ResultsFileError(csv_path + ": cannot open for appending");
  if (fresh) append(csv_header(columns));
}

void ResultsAppender::append(const std::string& row) {
  // One fputs + fflush per row: a kill can only cut the row being written, which read_results drops.
  const std::string line = row + "\n";
  std::lock_guard lock(mutex_);
  if (std::fputs(line.c_str(), file_.get()) < 0 || std::fflush(file_.get()) != 0)
    throw ResultsFileError(path_ + ": write failed");
}

std::size_t run_pool(std::size_t count, int jobs, const std::function<void(std::size_t)>& work,
                     const std::function<bool()>& stop) {
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> started{0};
  std::mutex mutex;
  std::exception_ptr failure;
  auto worker = [&] {
    try {
      while (true) {
        if (stop && stop()) {
          next = count;
          return;
        }
        const std::size_t i = next++;
        if (i >= count) return;
        started += 1;
        work(i);
      }
    } catch (...) {
      std::lock_guard lock(mutex);
      if (!failure) failure = std::current_exception();
      next = count;
    }
  };
  const int threads_wanted = std::max(1, std::min<int>(jobs, static_cast<int>(count)));
  std::vector<std::thread> threads;
  for (int t = 1; t < threads_wanted; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
  return std::min(started.load(), count);
}

}  // namespace piper::sim
