// `piper plot`: draw columns of a CSV (a sweep's or tune's results, or any CSV with a header) as a
// PNG scatter or line chart, one series per value of an optional grouping column.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>

#include "cli/common.hpp"
#include "piper/search/results_csv.hpp"
#ifdef PIPER_HAVE_PLOT
#include "piper/plot/plot.hpp"
#endif

namespace piper::cli {

namespace {

struct PlotArgs {
  std::string csv_path, x, y, series, where, title, x_label, y_label, output_path;
  bool line = false, log_x = false, log_y = false;
};

#ifdef PIPER_HAVE_PLOT
// A CSV cell as a finite decimal number (common.hpp's decimal_number, as the flags take numbers);
// false for anything else (std::stod alone would also read "0x10" as 16). A denormal (1e-320) or a
// value that rounds to 0 (1e-400) is a number: std::stod threw out_of_range for them (strtod's ERANGE
// on underflow), and the row was counted "without numbers".
bool csv_number(const std::string& s, double* out) {
  if (!decimal_number(s, false)) return false;
  char* end = nullptr;
  *out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(*out);  // overflow is HUGE_VAL: not finite
}

plot::Series sorted_by_x(const plot::Series& s) {
  std::vector<std::size_t> idx(s.x.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [&](std::size_t l, std::size_t r) { return s.x[l] < s.x[r]; });
  plot::Series sorted = s;
  for (std::size_t i = 0; i < idx.size(); ++i) sorted.x[i] = s.x[idx[i]], sorted.y[i] = s.y[idx[i]];
  return sorted;
}

// Why nothing is drawn, in one line: no row passed --where (said as such: "no row has numbers in both
// 'x' and 'y'" sent the user looking at the wrong columns), none has values > 0 for a logarithmic axis,
// or none has numbers in both columns.
[[noreturn]] void refuse_no_points(const PlotArgs& a, const std::string& where_column, int matched, int not_positive) {
  if (!where_column.empty() && matched == 0)
    throw CliError(a.csv_path, fmt::format("--where '{}': no row has '{}' in column '{}'", a.where,
                                           a.where.substr(a.where.find('=') + 1), where_column));
  if (not_positive > 0)
    throw CliError(a.csv_path,
                   fmt::format("no row has values > 0 in '{}' and '{}' for the logarithmic axis", a.x, a.y));
  throw CliError(a.csv_path, fmt::format("no row has numbers in both '{}' and '{}'", a.x, a.y));
}

// One line's fields; malformed quoting is refused at its line, not read as something else (`1,"2"3`
// was 23).
std::vector<std::string> csv_fields(const std::string& path, const std::string& line, int line_no) {
  if (const std::string problem = search::csv_quoting_problem(line); !problem.empty())
    throw CliError(path, fmt::format("line {}: {}", line_no, problem));
  return search::csv_split(line);
}
#endif

int run_plot(const PlotArgs& a) {
#ifdef PIPER_HAVE_PLOT
  // Bounded read (Limit::InputBytes): a line-by-line getline on /dev/zero would never end.
  std::string text = read_text_file(a.csv_path);
  // A UTF-8 byte-order mark (spreadsheets write one) is not part of the first column's name.
  if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);
  std::istringstream in(text);
  std::string header;
  if (!std::getline(in, header)) throw CliError(a.csv_path, "empty file (expected a header line)");
  // RFC 4180 (and spreadsheets' exports) end lines with CRLF: the '\r' is not part of the last field
  // (it made the last column 'y\r', "no such column" for --y y).
  auto drop_cr = [](std::string& line) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
  };
  drop_cr(header);
  const auto columns = csv_fields(a.csv_path, header, 1);
  auto column = [&](const std::string& name, const char* flag) -> int {
    for (std::size_t i = 0; i < columns.size(); ++i)
      if (columns[i] == name) {
        // A header naming it twice: the first was plotted, silently.
        for (std::size_t j = i + 1; j < columns.size(); ++j)
          if (columns[j] == name)
            throw CliError(a.csv_path, fmt::format("{} '{}': columns {} and {} of the header both have this name", flag,
                                                   name, i + 1, j + 1));
        return static_cast<int>(i);
      }
    std::string list;
    for (const auto& c : columns) list += (list.empty() ? "" : ", ") + c;
    throw CliError(a.csv_path, fmt::format("{} '{}': no such column (columns: {})", flag, name, list));
  };
  const int xi = column(a.x, "--x"), yi = column(a.y, "--y");
  const int si = a.series.empty() ? -1 : column(a.series, "--series");
  int wi = -1;
  std::string wanted;
  if (!a.where.empty()) {
    const auto eq = a.where.find('=');
    if (eq == std::string::npos) throw CliError("", fmt::format("--where '{}': expected COLUMN=VALUE", a.where));
    wi = column(a.where.substr(0, eq), "--where");
    wanted = a.where.substr(eq + 1);
  }
  std::map<std::string, plot::Series> groups;
  std::vector<std::string> order;
  int line_no = 1, skipped = 0, not_positive = 0, matched = 0;
  for (std::string line; std::getline(in, line);) {
    line_no += 1;
    drop_cr(line);
    if (line.empty()) continue;
    const auto f = csv_fields(a.csv_path, line, line_no);
    if (f.size() != columns.size())
      throw CliError(a.csv_path,
                     fmt::format("line {}: {} fields, the header has {}", line_no, f.size(), columns.size()));
    if (wi >= 0 && f[static_cast<std::size_t>(wi)] != wanted) continue;
    matched += 1;
    double x = 0, y = 0;
    if (!csv_number(f[static_cast<std::size_t>(xi)], &x) || !csv_number(f[static_cast<std::size_t>(yi)], &y)) {
      skipped += 1;  // e.g. invalid or pruned rows with empty figures
      continue;
    }
    if ((a.log_x && x <= 0) || (a.log_y && y <= 0)) {
      not_positive += 1;  // a logarithmic axis has no place for it; counted, not drawn as if it were
      continue;
    }
    const std::string name = si >= 0 ? f[static_cast<std::size_t>(si)] : std::string();
    if (!groups.count(name)) {
      order.push_back(name);
      groups[name].name = si >= 0 ? fmt::format("{} = {}", a.series, name) : std::string();
    }
    groups[name].x.push_back(x);
    groups[name].y.push_back(y);
  }
  plot::Chart chart;
  chart.title = a.title;
  chart.x = {a.x_label.empty() ? a.x : a.x_label, a.log_x, {}, {}};
  chart.y = {a.y_label.empty() ? a.y : a.y_label, a.log_y, {}, {}};
  std::size_t points = 0;
  for (const auto& name : order) {
    plot::Series s = a.line ? sorted_by_x(groups[name]) : groups[name];  // a line joins points by increasing x
    points += s.x.size();
    chart.series.push_back(std::move(s));
  }
  if (points == 0) refuse_no_points(a, wi >= 0 ? columns[static_cast<std::size_t>(wi)] : "", matched, not_positive);
  try {
    if (a.line)
      plot::write_line_png(chart, a.output_path);
    else
      plot::write_scatter_png(chart, a.output_path);
  } catch (const plot::PlotError& e) {
    throw CliError("", e.what());
  }
  fmt::print("{} points in {} series ({} rows without numbers skipped{}) -> {}\n", points, chart.series.size(), skipped,
             not_positive > 0 ? fmt::format(", {} with values <= 0 left off the logarithmic axis", not_positive) : "",
             a.output_path);
  return 0;
#else
  throw CliError(a.output_path, "this piper was built without Qt 6 Gui, so it cannot draw plots");
#endif
}

}  // namespace

Command add_plot_command(CLI::App& app) {
  auto a = std::make_shared<PlotArgs>();
  CLI::App* cmd = app.add_subcommand("plot", "draw two columns of a CSV as a PNG scatter or line chart");
  cmd->add_option("csv", a->csv_path, "CSV file with a header line (e.g. sweep or tune results)")->required();
  cmd->add_option("--x", a->x, "column for the x axis")->required();
  cmd->add_option("--y", a->y, "column for the y axis")->required();
  cmd->add_option("--series", a->series, "column whose values split the rows into series");
  cmd->add_option("--where", a->where, "keep only rows with COLUMN=VALUE");
  cmd->add_flag("--line", a->line, "join each series' points by increasing x");
  cmd->add_flag("--log-x", a->log_x, "logarithmic x axis");
  cmd->add_flag("--log-y", a->log_y, "logarithmic y axis");
  cmd->add_option("--title", a->title, "chart title");
  cmd->add_option("--x-label", a->x_label, "x axis label with its unit (default: the column name)");
  cmd->add_option("--y-label", a->y_label, "y axis label with its unit (default: the column name)");
  cmd->add_option("-o,--output", a->output_path, "PNG file to write")->required()->check(kOutputPath)->check(kPngPath);
  return {cmd, [a] { return run_plot(*a); }};
}

}  // namespace piper::cli
