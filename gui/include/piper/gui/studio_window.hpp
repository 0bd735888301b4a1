// The piper-studio main window: preset picker and directive editor (left), timeline and memory
// (centre), report (right); background re-simulation after edits; compare, trace overlay, export.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <QFutureWatcher>
#include <QMainWindow>
#include <QTimer>

#include "piper/gui/directive_editor.hpp"
#include "piper/gui/report_panel.hpp"
#include "piper/gui/session.hpp"
#include "piper/gui/timeline_view.hpp"
#include "piper/gui/tune_browser.hpp"

class QCheckBox;
class QComboBox;
class QSpinBox;
class QLabel;
class QAction;
class QDockWidget;

namespace piper::gui {

// Result of a background run: the run, or the error that replaced it.
struct RunOutcome {
  std::optional<ScenarioRun> run;
  RunError error;
  std::string editor_text;  // the editor text the run was started from (error location)
};

class StudioWindow : public QMainWindow {
  Q_OBJECT

 public:
  explicit StudioWindow(QWidget* parent = nullptr);
  ~StudioWindow() override;

  // Simulates `scenario` as the primary (A) scenario. synchronous: on this thread (screenshots, tests).
  void load_scenario(const core::Scenario& scenario, bool synchronous = false);
  bool open_scenario_file(const QString& path, bool synchronous = false);
  // Compare mode: B stacked under A on the same time axis, reports side by side.
  void compare_with(const core::Scenario& scenario, bool synchronous = false);
  bool compare_with_file(const QString& path, bool synchronous = false);
  void close_compare();
  bool overlay_trace(const QString& path);
  // Shows a `piper tune` results file in a dock; activating a candidate simulates its scenario.
  bool open_tune_results(const QString& path);
  TuneBrowser* tune_browser() const { return tune_browser_; }
  // Re-simulates from the editor text now (the debounce timer calls this after edits).
  void simulate_editor_text(bool synchronous = false);

  bool export_png(const QString& path);
  bool export_svg(const QString& path);
  bool export_chrome_trace(const QString& path);

  TimelineView* view() const { return view_; }
  DirectiveEditor* editor() const { return editor_; }
  ReportPanel* report_panel() const { return report_; }
  QString error_text() const;
  const std::optional<ScenarioRun>& run_a() const { return run_a_; }
  const std::optional<ScenarioRun>& run_b() const { return run_b_; }
  bool busy() const { return running_ > 0; }
  void set_debounce_ms(int ms) { debounce_.setInterval(ms); }

 signals:
  // Emitted after every attempt (background or not): ok = a new timeline is shown.
  void simulation_finished(bool ok);

 private:
  void build_menus();
  QWidget* build_preset_panel();
  void fill_preset_panel(const core::Scenario& s);
  core::Scenario preset_scenario() const;
  // The attention implementations of the cluster the panel names, keeping the chosen one if it has it.
  void fill_attention_kernels();
  void start(const core::Scenario& scenario, int slot, bool synchronous, const std::string& editor_text);
  void finish(const RunOutcome& outcome, int slot, bool from_editor);
  void refresh_view(bool keep_view);
  void show_error(const RunError& error, const std::string& editor_text);
  void set_editor_program(const nlohmann::json& program);

  TimelineView* view_ = nullptr;
  DirectiveEditor* editor_ = nullptr;
  ReportPanel* report_ = nullptr;
  QLabel* error_label_ = nullptr;
  QLabel* status_label_ = nullptr;
  QComboBox *model_ = nullptr, *cluster_ = nullptr, *engine_ = nullptr, *schedule_ = nullptr;
  QSpinBox *pp_ = nullptr, *microbatches_ = nullptr, *virtual_ = nullptr, *dp_ = nullptr, *ep_ = nullptr,
           *zero_ = nullptr;
  QSpinBox *dp_shard_ = nullptr, *tp_ = nullptr, *global_batch_ = nullptr;
  QCheckBox* sequence_parallel_ = nullptr;
  QComboBox* recompute_ = nullptr;
  // The training runtime's settings over the cluster's (a derived cluster spec, sim/cluster.hpp): an
  // item's data is the setting's value, "" (the first item) for the cluster's own.
  QComboBox *runtime_ = nullptr, *attention_ = nullptr;
  // Fields generated from the settings table (core/settings.hpp) for the settings without one above.
  std::vector<std::pair<std::string, QWidget*>> setting_fields_;
  QAction* critical_action_ = nullptr;
  TuneBrowser* tune_browser_ = nullptr;
  QDockWidget* tune_dock_ = nullptr;

  core::Scenario scenario_a_;
  std::optional<ScenarioRun> run_a_, run_b_;
  std::shared_ptr<const Track> measured_;
  QTimer debounce_;
  int generation_[2] = {0, 0};
  int running_ = 0;  // background runs in flight
  bool updating_editor_ = false;
  bool view_fitted_ = false;
};

// piper-studio's main(): `piper-studio [scenario.json | tune-results.csv] [--compare other.json] [--overlay trace.json]
// [--screenshot out.png [--size 1600x1000] [--critical-path]]`.
int studio_main(int argc, char** argv);

}  // namespace piper::gui
