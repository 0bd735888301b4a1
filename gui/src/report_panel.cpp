// Report panel HTML: summary figures per scenario and a per-device bubble / peak-memory table.
#include "piper/gui/report_panel.hpp"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "piper/gui/scale.hpp"

namespace piper::gui {

namespace {

// Units scale with the value (scale.hpp): a 9M-parameter model reads "MFU 0.0213 %" and "peak 212 MiB".
// Non-breaking spaces: a narrow panel never wraps "10.5 GiB" into two lines.
std::string nb(std::string s) {
  std::string out;
  for (char c : s) out += c == ' ' ? std::string("&nbsp;") : std::string(1, c);
  return out;
}
std::string seconds(double s) { return nb(format_seconds(s)); }
std::string bytes(std::int64_t b) { return nb(format_bytes(static_cast<double>(b))); }
std::string percent(double f) { return nb(format_percent(f)); }
std::string count(double v) {
  if (v >= 1e6) return fmt::format("{:.2f} M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f} k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

}  // namespace

std::string report_html(const std::vector<NamedReport>& reports, int max_device_rows) {
  if (reports.empty()) return "<p style='color:#888'>No simulation yet.</p>";
  std::string h =
      "<style>td,th{padding:1px 4px;} th{text-align:left;color:#333;white-space:nowrap;} "
      "td.v{text-align:right;white-space:nowrap;} "
      "tr.oom td{color:#c00;font-weight:bold;} .n{color:#777;}</style>";
  h += "<table cellspacing='0' width='100%'><tr><th></th>";
  for (const auto& r : reports) h += "<th style='text-align:right'>" + r.name + "</th>";
  h += "</tr>";
  auto row = [&](const std::string& label, auto&& value, bool red = false) {
    h += std::string(red ? "<tr class='oom'>" : "<tr>") + "<td>" + label + "</td>";
    for (const auto& r : reports) h += "<td class='v'>" + value(r.report) + "</td>";
    h += "</tr>";
  };
  const bool any_oom = std::any_of(reports.begin(), reports.end(), [](const NamedReport& r) { return r.report.oom; });
  row("step time", [](const sim::Report& r) { return "<b>" + seconds(r.step_time_s) + "</b>"; });
  row("tokens/s", [](const sim::Report& r) { return count(r.tokens_per_s); });
  row("MFU", [](const sim::Report& r) { return percent(r.mfu); });
  row("bubble (mean)", [](const sim::Report& r) { return percent(r.bubble_fraction); });
  row(
      "peak memory", [](const sim::Report& r) { return bytes(r.peak_memory_bytes); }, any_oom);
  row(
      "out of memory",
      [](const sim::Report& r) {
        return r.oom ? fmt::format("YES: dev {} at {}", r.oom_details.device, seconds(r.oom_details.time_s))
                     : std::string("no");
      },
      any_oom);
  row("devices", [](const sim::Report& r) { return std::to_string(r.devices); });
  row("microbatches", [](const sim::Report& r) { return std::to_string(r.microbatches); });
  row("ops", [](const sim::Report& r) { return count(static_cast<double>(r.total_ops)); });
  row("crit. path compute", [](const sim::Report& r) { return seconds(r.critical_path.compute_s); });
  // TP collectives run inside compute ops; their share is shown when any plan has them.
  if (std::any_of(reports.begin(), reports.end(), [](const NamedReport& r) { return r.report.critical_path.tp_s > 0; }))
    row("&nbsp;&nbsp;of which TP", [](const sim::Report& r) { return seconds(r.critical_path.tp_s); });
  row("crit. path comm", [](const sim::Report& r) { return seconds(r.critical_path.comm_s); });
  row("compile time", [](const sim::Report& r) { return seconds(r.compile_time_s); });
  row("simulate time", [](const sim::Report& r) { return seconds(r.simulate_time_s); });
  row("engine", [](const sim::Report& r) { return r.engine; });
  h += "</table><p style='margin-top:8px'><b>Per device</b> <span class='n'>(bubble = idle / step)</span></p>";
  h += "<table cellspacing='0' width='100%'><tr><th>dev</th>";
  for (const auto& r : reports)
    h += "<th style='text-align:right'>bubble" + (r.name.empty() ? "" : " " + r.name) +
         "</th><th style='text-align:right'>peak" + (r.name.empty() ? "" : " " + r.name) + "</th>";
  h += "</tr>";
  std::size_t devices = 0;
  for (const auto& r : reports) devices = std::max(devices, r.report.per_device.size());
  // Devices whose figures are equal in every report (DP replicas of one stage) share a row once there
  // are more devices than rows: "0,8,16,…,248 ×32".
  std::vector<std::vector<std::size_t>> rows;
  if (devices > static_cast<std::size_t>(max_device_rows)) {
    std::map<std::vector<std::pair<double, std::int64_t>>, std::size_t> by_figures;
    for (std::size_t d = 0; d < devices; ++d) {
      std::vector<std::pair<double, std::int64_t>> key;
      for (const auto& r : reports)
        key.emplace_back(d < r.report.per_device.size() ? r.report.per_device[d].bubble_fraction : -1.0,
                         d < r.report.per_device.size() ? r.report.per_device[d].peak_memory_bytes : -1);
      auto [it, added] = by_figures.try_emplace(std::move(key), rows.size());
      if (added) rows.emplace_back();
      rows[it->second].push_back(d);
    }
  } else {
    for (std::size_t d = 0; d < devices; ++d) rows.push_back({d});
  }
  const std::size_t shown = std::min<std::size_t>(rows.size(), static_cast<std::size_t>(max_device_rows));
  std::size_t listed = 0;
  for (std::size_t k = 0; k < shown; ++k) {
    const std::size_t d = rows[k].front();
    bool oom = false;
    std::string cells;
    for (const auto& r : reports) {
      if (d < r.report.per_device.size()) {
        const sim::DeviceReport& dr = r.report.per_device[d];
        oom = oom || dr.oom;
        cells += "<td class='v'>" + percent(dr.bubble_fraction) + "</td><td class='v'>" + bytes(dr.peak_memory_bytes) +
                 "</td>";
      } else {
        cells += "<td></td><td></td>";
      }
    }
    std::string name;
    for (std::size_t i = 0; i < rows[k].size(); ++i) {
      if (rows[k].size() > 4 && i == 2) {
        name += ",…," + std::to_string(rows[k].back());
        break;
      }
      name += (i ? "," : "") + std::to_string(rows[k][i]);
    }
    if (rows[k].size() > 1) name += "&nbsp;×" + std::to_string(rows[k].size());
    listed += rows[k].size();
    h += std::string(oom ? "<tr class='oom'>" : "<tr>") + "<td>" + name + "</td>" + cells + "</tr>";
  }
  h += "</table>";
  if (listed < devices) h += fmt::format("<p class='n'>{} more devices not listed.</p>", devices - listed);
  return h;
}

ReportPanel::ReportPanel(QWidget* parent) : QTextBrowser(parent) {
  QFont f = font();
  f.setPointSizeF(9);
  setFont(f);
  setHtml(QString::fromStdString(report_html({})));
}

void ReportPanel::set_reports(const std::vector<NamedReport>& reports) {
  setHtml(QString::fromStdString(report_html(reports)));
}

}  // namespace piper::gui
