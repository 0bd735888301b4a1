// The studio's tune-results table: best plans first, a double-click opens the candidate's timeline.
#include "piper/gui/tune_browser.hpp"

#include <algorithm>
#include <map>

#include <QHeaderView>
#include <QLabel>
#include <QTableWidget>
#include <QVBoxLayout>

#include <fmt/format.h>

namespace piper::gui {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// A numeric cell that sorts by its value, not its text.
class NumberItem : public QTableWidgetItem {
 public:
  NumberItem(double value, const QString& text) : QTableWidgetItem(text) {
    setData(Qt::UserRole, value);
    setTextAlignment(Qt::AlignRight | Qt::AlignVCenter);
  }
  bool operator<(const QTableWidgetItem& other) const override {
    return data(Qt::UserRole).toDouble() < other.data(Qt::UserRole).toDouble();
  }
};

}  // namespace

TuneBrowser::TuneBrowser(QWidget* parent) : QWidget(parent) {
  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(4, 4, 4, 4);
  summary_ = new QLabel("<b>Tune results</b>: none open (File ▸ Open tune results…)");
  summary_->setWordWrap(true);
  table_ = new QTableWidget(0, 9);
  table_->setHorizontalHeaderLabels(
      {"#", "engine", "status", "step ms", "tokens/s", "MFU %", "peak GiB", "bound GiB", "strategy"});
  table_->setSelectionBehavior(QAbstractItemView::SelectRows);
  table_->setSelectionMode(QAbstractItemView::SingleSelection);
  table_->setEditTriggers(QAbstractItemView::NoEditTriggers);
  table_->verticalHeader()->setVisible(false);
  table_->horizontalHeader()->setStretchLastSection(true);
  layout->addWidget(summary_);
  layout->addWidget(table_, 1);
  connect(table_, &QTableWidget::cellActivated, this, [this](int row, int) {
    // Sorting may reorder the view: the "#" cell holds the index into rows_.
    activate(table_->item(row, 0)->data(Qt::UserRole).toInt() - 1);
  });
}

bool TuneBrowser::open(const QString& path, QString* error) {
  search::TuneSpec spec;
  std::vector<search::TuneRow> all;
  try {
    all = search::read_tune_results(path.toStdString(), &spec);
  } catch (const std::exception& e) {
    // The reader's advice to `piper tune` ("choose another -o") is no advice here.
    std::string message = e.what();
    if (const std::string tail = "; choose another -o";
        message.size() >= tail.size() && message.compare(message.size() - tail.size(), tail.size(), tail) == 0)
      message.erase(message.size() - tail.size());
    if (error) *error = QString::fromStdString(message);
    return false;
  }
  path_ = path.toStdString();
  if (all.empty()) {
    if (error) *error = path + ": no results";
    return false;
  }
  // One row per candidate: the SimGrid row replaces the analytic one when the tune re-simulated it.
  std::map<std::string, search::TuneRow> by_key;
  for (const auto& r : all) {
    auto [it, fresh] = by_key.try_emplace(r.candidate.key(), r);
    if (!fresh && r.engine == "simgrid") it->second = r;
  }
  // Fitting plans (within the search's HBM: OOM is the simulator's verdict) by step time, then the rest.
  auto rank = [](const search::TuneRow& r) {
    return r.status == "ok" && !r.oom                      ? 0
           : r.status == "ok"                              ? 1
           : r.status == "pruned" || r.status == "bounded" ? 3
                                                           : 2;
  };
  rows_.clear();
  for (auto& [k, r] : by_key) rows_.push_back(r);
  std::stable_sort(rows_.begin(), rows_.end(), [&](const search::TuneRow& a, const search::TuneRow& b) {
    if (rank(a) != rank(b)) return rank(a) < rank(b);
    if (rank(a) <= 1 && a.step_time_s != b.step_time_s) return a.step_time_s < b.step_time_s;
    return a.candidate.key() < b.candidate.key();
  });
  spec_ = spec;
  table_->setSortingEnabled(false);
  table_->setRowCount(static_cast<int>(rows_.size()));
  for (int i = 0; i < static_cast<int>(rows_.size()); ++i) {
    const search::TuneRow& r = rows_[static_cast<std::size_t>(i)];
    const bool ok = r.status == "ok";
    auto number = [&](double v, const char* format) {
      return new NumberItem(ok ? v : 1e300,
                            ok ? QString::fromStdString(fmt::format(fmt::runtime(format), v)) : QString());
    };
    table_->setItem(i, 0, new NumberItem(i + 1, QString::number(i + 1)));
    table_->setItem(i, 1, new QTableWidgetItem(QString::fromStdString(r.engine)));
    auto* status = new QTableWidgetItem(QString::fromStdString(r.oom ? "oom" : r.status));
    status->setToolTip(QString::fromStdString(r.reason));
    table_->setItem(i, 2, status);
    table_->setItem(i, 3, number(r.step_time_s * 1e3, "{:.3f}"));
    table_->setItem(i, 4, number(r.tokens_per_s, "{:.0f}"));
    table_->setItem(i, 5, number(r.mfu * 100, "{:.1f}"));
    table_->setItem(i, 6, number(static_cast<double>(r.peak_memory_bytes) / kGiB, "{:.2f}"));
    // An unknown bound (blank in the CSV, read as 0) stays blank rather than reading "0.00".
    const bool bound = r.estimated_memory_bytes > 0;
    table_->setItem(i, 7,
                    new NumberItem(bound ? static_cast<double>(r.estimated_memory_bytes) / kGiB : 1e300,
                                   bound ? QString::number(static_cast<double>(r.estimated_memory_bytes) / kGiB, 'f', 2)
                                         : QString()));
    auto* what = new QTableWidgetItem(QString::fromStdString(r.candidate.describe()));
    what->setToolTip(QString::fromStdString(r.reason.empty() ? r.candidate.key() : r.reason));
    table_->setItem(i, 8, what);
  }
  table_->setSortingEnabled(true);
  table_->sortByColumn(0, Qt::AscendingOrder);  // best first until the user sorts otherwise
  table_->resizeColumnsToContents();
  summary_->setText(
      QString::fromStdString(fmt::format("<b>Tune results</b>: {} on {} x {}, global batch {}; {} candidates "
                                         "(double-click one to simulate it)",
                                         spec.model, spec.devices, spec.cluster, spec.global_batch, rows_.size())));
  return true;
}

core::Scenario TuneBrowser::scenario_of(int row) const {
  const search::TuneRow& r = rows_.at(static_cast<std::size_t>(row));
  core::Scenario s = search::tune_scenario(spec_, r.candidate, r.engine.empty() ? "analytic" : r.engine);
  // Its errors name the file and candidate (a bad cluster field read "scenario: field 'cluster'").
  s.source = fmt::format("{}, candidate {}", path_, row + 1);
  return s;
}

void TuneBrowser::activate(int row) {
  if (row < 0 || row >= static_cast<int>(rows_.size())) return;
  emit candidate_activated(scenario_of(row));
}

}  // namespace piper::gui
