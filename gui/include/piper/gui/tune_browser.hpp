// A table of a `piper tune` results file: one row per simulated or pruned candidate, best first;
// activating a row asks the studio to compile and simulate that candidate's scenario.
#pragma once

#include <string>
#include <vector>

#include <QWidget>

#include "piper/core/scenario.hpp"
#include "piper/search/tune.hpp"

class QTableWidget;
class QLabel;

namespace piper::gui {

class TuneBrowser : public QWidget {
  Q_OBJECT

 public:
  explicit TuneBrowser(QWidget* parent = nullptr);

  // Reads a tune CSV (search::read_tune_results); on error keeps the previous table and returns false
  // with the one-line message in *error.
  bool open(const QString& path, QString* error = nullptr);
  // Rows in table order: fitting simulated candidates by step time, then the rest (over the cap,
  // invalid, pruned). One row per candidate: its SimGrid result when it has one.
  const std::vector<search::TuneRow>& rows() const { return rows_; }
  QTableWidget* table() const { return table_; }
  // The scenario of row i (the tune's model, cluster, shape; the row's strategy and engine).
  core::Scenario scenario_of(int row) const;
  // Activates row i as a double-click does.
  void activate(int row);

 signals:
  void candidate_activated(const piper::core::Scenario& scenario);

 private:
  QTableWidget* table_ = nullptr;
  QLabel* summary_ = nullptr;
  search::TuneSpec spec_;
  std::vector<search::TuneRow> rows_;
  std::string path_;  // the results file, naming a candidate's scenario in errors
};

}  // namespace piper::gui
