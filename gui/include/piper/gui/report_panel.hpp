// The report panel: headline figures of one scenario, or two side by side (compare), and per-device
// bubble fraction and peak memory.
#pragma once

#include <string>
#include <vector>

#include <QTextBrowser>

#include "piper/sim/report.hpp"

namespace piper::gui {

struct NamedReport {
  std::string name;  // "A", "B", or a title
  sim::Report report;
};

// HTML of the panel (also used by tests): one column per report.
std::string report_html(const std::vector<NamedReport>& reports, int max_device_rows = 32);

class ReportPanel : public QTextBrowser {
  Q_OBJECT

 public:
  explicit ReportPanel(QWidget* parent = nullptr);
  void set_reports(const std::vector<NamedReport>& reports);
};

}  // namespace piper::gui
