// piper-studio's main window and its command line (including the offscreen --screenshot mode).
#include "piper/gui/studio_window.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>

#include <QAction>
#include <QActionGroup>
#include <QApplication>
#include <QCheckBox>
#include <QComboBox>
#include <QDockWidget>
#include <QCommandLineParser>
#include <QDoubleSpinBox>
#include <QFileDialog>
#include <QFormLayout>
#include <QScrollArea>
#include <QScrollBar>
#include <QLabel>
#include <QMenuBar>
#include <QMessageBox>
#include <QPainter>
#include <QPushButton>
#include <QRegularExpression>
#include <QSaveFile>
#include <QSignalBlocker>
#include <QScrollBar>
#include <QSpinBox>
#include <QSplitter>
#include <QStatusBar>
#include <QSvgGenerator>
#include <QVBoxLayout>
#include <QtConcurrent/QtConcurrentRun>

#include "piper/core/scenario.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/strategy.hpp"
#include "piper/gui/chrome_trace.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/engine.hpp"
#include "piper/sim/kernel_table.hpp"
#include "piper/sim/simulate.hpp"

namespace piper::gui {

namespace {

RunOutcome run_guarded(const core::Scenario& s, const std::string& editor_text) {
  RunOutcome out;
  out.editor_text = editor_text;
  try {
    out.run = run_scenario(s);
  } catch (const RunError& e) {
    out.error = e;
  } catch (const std::exception& e) {
    out.error = RunError{e.what(), -1, ""};
  }
  return out;
}

core::Scenario default_scenario() {
  core::Scenario s;
  s.model = "qwen3-1b";
  s.strategy.pp = 4;
  s.strategy.microbatches = 8;
  bool has_dualpipev = false;
  for (const auto& f : core::schedule_registry()) has_dualpipev = has_dualpipev || f.name == "dualpipev";
  s.strategy.schedule = has_dualpipev ? "dualpipev" : "1f1b";
  return s;
}

}  // namespace

StudioWindow::StudioWindow(QWidget* parent) : QMainWindow(parent) {
  setWindowTitle("piper-studio");
  view_ = new TimelineView;
  report_ = new ReportPanel;
  editor_ = new DirectiveEditor;
  error_label_ = new QLabel;
  error_label_->setWordWrap(true);
  error_label_->setStyleSheet("QLabel { color: #b00000; }");
  error_label_->setTextInteractionFlags(Qt::TextSelectableByMouse);

  auto* left = new QWidget;
  auto* left_layout = new QVBoxLayout(left);
  left_layout->setContentsMargins(4, 4, 4, 4);
  left_layout->addWidget(build_preset_panel());
  auto* editor_title = new QLabel("<b>Directive program</b> <span style='color:#777'>(edits re-simulate)</span>");
  left_layout->addWidget(editor_title);
  left_layout->addWidget(editor_, 1);
  left_layout->addWidget(error_label_);

  auto* split = new QSplitter(Qt::Horizontal);
  split->addWidget(left);
  split->addWidget(view_);
  split->addWidget(report_);
  split->setStretchFactor(0, 0);
  split->setStretchFactor(1, 1);
  split->setStretchFactor(2, 0);
  split->setSizes({380, 1000, 300});
  setCentralWidget(split);

  status_label_ = new QLabel;
  statusBar()->addWidget(status_label_, 1);
  build_menus();

  debounce_.setSingleShot(true);
  debounce_.setInterval(600);
  connect(&debounce_, &QTimer::timeout, this, [this] { simulate_editor_text(false); });
  connect(editor_, &QPlainTextEdit::textChanged, this, [this] {
    if (!updating_editor_) debounce_.start();
  });
  connect(view_, &TimelineView::selection_changed, this, [this](const QString& d) {
    QString plain = d;
    plain.replace("<br>", " · ");
    plain.remove(QRegularExpression("<[^>]*>"));
    statusBar()->showMessage(plain);
  });
}

StudioWindow::~StudioWindow() = default;

void StudioWindow::build_menus() {
  QMenu* file = menuBar()->addMenu("&File");
  file->addAction("&Open scenario…", QKeySequence::Open, this, [this] {
    const QString p = QFileDialog::getOpenFileName(this, "Open scenario", {}, "Scenario JSON (*.json)");
    if (!p.isEmpty()) open_scenario_file(p);
  });
  file->addAction("&Save scenario…", QKeySequence::Save, this, [this] {
    const QString p = QFileDialog::getSaveFileName(this, "Save scenario", "scenario.json", "Scenario JSON (*.json)");
    if (p.isEmpty()) return;
    core::Scenario s = scenario_a_;
    const JsonCheck c = check_json(editor_->toPlainText().toStdString());
    if (c.ok) s.directives = c.value;
    core::write_file_atomically(p.toStdString(), s.to_json().dump(2) + "\n");
  });
  file->addAction("Open &tune results…", this, [this] {
    const QString p = QFileDialog::getOpenFileName(this, "Open tune results", {}, "piper tune CSV (*.csv)");
    if (!p.isEmpty()) open_tune_results(p);
  });
  file->addSeparator();
  file->addAction("&Compare with scenario…", this, [this] {
    const QString p = QFileDialog::getOpenFileName(this, "Compare with scenario", {}, "Scenario JSON (*.json)");
    if (!p.isEmpty()) compare_with_file(p);
  });
  file->addAction("Compare with &preset", this, [this] { compare_with(preset_scenario()); });
  file->addAction("Close compare", this, [this] { close_compare(); });
  file->addAction("&Overlay Chrome trace…", this, [this] {
    const QString p = QFileDialog::getOpenFileName(this, "Overlay a Chrome trace", {}, "Chrome trace (*.json)");
    if (!p.isEmpty()) overlay_trace(p);
  });
  file->addSeparator();
  file->addAction("Export view as P&NG…", this, [this] {
    const QString p = QFileDialog::getSaveFileName(this, "Export PNG", "timeline.png", "PNG (*.png)");
    if (!p.isEmpty()) export_png(p);
  });
  file->addAction("Export view as S&VG…", this, [this] {
    const QString p = QFileDialog::getSaveFileName(this, "Export SVG", "timeline.svg", "SVG (*.svg)");
    if (!p.isEmpty()) export_svg(p);
  });
  file->addAction("Export timeline as Chrome &trace…", this, [this] {
    const QString p = QFileDialog::getSaveFileName(this, "Export Chrome trace", "trace.json", "Chrome trace (*.json)");
    if (!p.isEmpty()) export_chrome_trace(p);
  });
  file->addSeparator();
  file->addAction("&Quit", QKeySequence::Quit, this, &QWidget::close);
  QMenu* view = menuBar()->addMenu("&View");
  view->addAction("&Fit to window", QKeySequence(Qt::Key_F), this, [this] { view_->fit_to_window(); });
  critical_action_ = view->addAction("&Critical path", QKeySequence(Qt::Key_C), this,
                                     [this](bool on) { view_->set_show_critical_path(on); });
  critical_action_->setCheckable(true);
  // Folding: one row per symmetry class or pipeline stage (default above 16 devices), or per device.
  QMenu* fold = view->addMenu("Fold &devices");
  auto* fold_group = new QActionGroup(this);
  for (auto [title, mode] : {std::pair{"&Off (one row per device)", FoldMode::Off},
                             {"By symmetry &class", FoldMode::Class},
                             {"By pipeline &stage", FoldMode::Stage}}) {
    QAction* a = fold->addAction(title, this, [this, m = mode] { view_->set_fold_mode(m); });
    a->setCheckable(true);
    a->setData(static_cast<int>(mode));
    fold_group->addAction(a);
  }
  connect(fold, &QMenu::aboutToShow, this, [this, fold_group] {
    for (QAction* a : fold_group->actions()) a->setChecked(a->data().toInt() == static_cast<int>(view_->fold_mode()));
  });
  view->addAction("Taller lanes", QKeySequence(Qt::CTRL | Qt::Key_Plus), this, [this] { view_->set_lane_height(20); });
  view->addAction("Shorter lanes", QKeySequence(Qt::CTRL | Qt::Key_Minus), this, [this] { view_->set_lane_height(8); });
}

void StudioWindow::set_editor_program(const nlohmann::json& program) {
  updating_editor_ = true;
  const int scroll = editor_->verticalScrollBar()->value();
  editor_->setPlainText(QString::fromStdString(format_program(program)));
  editor_->verticalScrollBar()->setValue(scroll);
  updating_editor_ = false;
}

void StudioWindow::load_scenario(const core::Scenario& scenario, bool synchronous) {
  scenario_a_ = scenario;
  fill_preset_panel(scenario);
  view_fitted_ = false;
  start(scenario, 0, synchronous, "");
}

bool StudioWindow::open_scenario_file(const QString& path, bool synchronous) {
  try {
    load_scenario(load_scenario_file(path.toStdString()), synchronous);
    return true;
  } catch (const RunError& e) {
    show_error(e, "");
    emit simulation_finished(false);
    return false;
  }
}

void StudioWindow::compare_with(const core::Scenario& scenario, bool synchronous) {
  start(scenario, 1, synchronous, "");
}

bool StudioWindow::compare_with_file(const QString& path, bool synchronous) {
  try {
    compare_with(load_scenario_file(path.toStdString()), synchronous);
    return true;
  } catch (const RunError& e) {
    show_error(e, "");
    emit simulation_finished(false);
    return false;
  }
}

void StudioWindow::close_compare() {
  run_b_.reset();
  ++generation_[1];
  refresh_view(true);
}

bool StudioWindow::overlay_trace(const QString& path) {
  try {
    measured_ = read_chrome_trace(path.toStdString(), "measured");
  } catch (const std::exception& e) {
    show_error(RunError{e.what(), -1, ""}, "");
    return false;
  }
  refresh_view(true);
  return true;
}

void StudioWindow::simulate_editor_text(bool synchronous) {
  const std::string text = editor_->toPlainText().toStdString();
  const JsonCheck check = check_json(text);
  if (!check.ok) {
    // Nothing to simulate: the last good timeline stays.
    show_error(RunError{check.message, -1, ""}, "");
    editor_->set_error(check.line, QString::fromStdString(check.message));
    error_label_->setText(QString("line %1: %2").arg(check.line + 1).arg(QString::fromStdString(check.message)));
    emit simulation_finished(false);
    return;
  }
  core::Scenario s = scenario_a_;
  s.directives = check.value;
  s.directives_source = "editor";
  s.append_schedule = false;
  s.stages = 0;
  start(s, 0, synchronous, text);
}

void StudioWindow::start(const core::Scenario& scenario, int slot, bool synchronous, const std::string& editor_text) {
  const int generation = ++generation_[slot];
  const bool from_editor = !editor_text.empty();
  status_label_->setText(slot == 0 ? "simulating…" : "simulating comparison…");
  if (synchronous) {
    finish(run_guarded(scenario, editor_text), slot, from_editor);
    return;
  }
  ++running_;
  auto* watcher = new QFutureWatcher<RunOutcome>(this);
  connect(watcher, &QFutureWatcher<RunOutcome>::finished, this, [this, watcher, slot, generation, from_editor] {
    --running_;
    const RunOutcome outcome = watcher->result();
    watcher->deleteLater();
    if (generation != generation_[slot]) return;  // superseded by a later edit
    finish(outcome, slot, from_editor);
  });
  watcher->setFuture(QtConcurrent::run(run_guarded, scenario, editor_text));
}

void StudioWindow::finish(const RunOutcome& outcome, int slot, bool from_editor) {
  if (!outcome.run) {
    show_error(outcome.error, outcome.editor_text);
    status_label_->setText("last simulation failed: showing the last good timeline");
    emit simulation_finished(false);
    return;
  }
  editor_->clear_error();
  error_label_->clear();
  if (slot == 0) {
    run_a_ = outcome.run;
    if (from_editor)
      scenario_a_ = outcome.run->scenario;
    else
      set_editor_program(outcome.run->program_json);
  } else {
    run_b_ = outcome.run;
  }
  refresh_view(from_editor || view_fitted_);
  view_fitted_ = true;
  const sim::Report& r = outcome.run->report;
  status_label_->setText(QString("%1 ops · simulated in %2 ms · compiled in %3 ms")
                             .arg(r.total_ops)
                             .arg(r.simulate_time_s * 1e3, 0, 'f', 1)
                             .arg(r.compile_time_s * 1e3, 0, 'f', 1));
  emit simulation_finished(true);
}

void StudioWindow::refresh_view(bool keep_view) {
  std::vector<std::shared_ptr<const Track>> tracks;
  std::vector<NamedReport> reports;
  if (run_a_) {
    std::shared_ptr<const Track> a = run_a_->track;
    if (measured_) {
      auto overlaid = std::make_shared<Track>(*a);
      overlay_measured(*overlaid, *measured_);
      a = overlaid;
    }
    if (run_b_) {
      auto titled = std::make_shared<Track>(*a);
      titled->title = "A · " + titled->title;
      a = titled;
    }
    tracks.push_back(a);
    reports.push_back({run_b_ ? "A" : "", run_a_->report});
  }
  if (run_b_) {
    auto b = std::make_shared<Track>(*run_b_->track);
    b->title = "B · " + b->title;
    tracks.push_back(b);
    reports.push_back({"B", run_b_->report});
  }
  view_->set_tracks(std::move(tracks), keep_view);
  report_->set_reports(reports);
  if (critical_action_) view_->set_show_critical_path(critical_action_->isChecked());
}

void StudioWindow::show_error(const RunError& error, const std::string& editor_text) {
  QString where;
  if (!editor_text.empty() && error.directive_index >= 0) {
    const int line = directive_line(editor_text, error.directive_index, error.field);
    editor_->set_error(line, QString::fromStdString(error.message));
    if (line >= 0) where = QString("line %1: ").arg(line + 1);
  } else if (!editor_text.empty()) {
    editor_->set_error(-1, QString::fromStdString(error.message));
  }
  error_label_->setText(where + QString::fromStdString(error.message));
}

QString StudioWindow::error_text() const { return error_label_->text(); }

bool StudioWindow::export_png(const QString& path) { return view_->grab().save(path, "PNG"); }

bool StudioWindow::export_svg(const QString& path) {
  QSvgGenerator svg;
  svg.setFileName(path);
  svg.setSize(view_->size());
  svg.setViewBox(QRect(QPoint(0, 0), view_->size()));
  svg.setTitle("piper-studio timeline");
  QPainter p(&svg);
  view_->paint_view(p);
  return p.end();
}

bool StudioWindow::export_chrome_trace(const QString& path) {
  if (!run_a_) return false;
  std::ostringstream out;
  core::write_chrome_trace(*run_a_->timeline, out);
  core::write_file_atomically(path.toStdString(), out.str());
  return true;
}

bool StudioWindow::open_tune_results(const QString& path) {
  if (!tune_browser_) {
    tune_browser_ = new TuneBrowser;
    tune_dock_ = new QDockWidget("Tune results", this);
    tune_dock_->setWidget(tune_browser_);
    addDockWidget(Qt::BottomDockWidgetArea, tune_dock_);
    connect(tune_browser_, &TuneBrowser::candidate_activated, this,
            [this](const core::Scenario& s) { load_scenario(s); });
  }
  QString error;
  if (!tune_browser_->open(path, &error)) {
    show_error(RunError{error.toStdString(), -1, {}}, {});
    return false;
  }
  tune_dock_->show();
  return true;
}

int studio_main(int argc, char** argv) {
  bool screenshot = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    screenshot = screenshot || a == "--screenshot";
    if (a == "--help" || a == "-h") {  // before QApplication: works without a display
      std::cout
          << "usage: piper-studio [scenario.json] [--compare other.json] [--overlay trace.json]\n"
             "                    [--screenshot out.png [--size 1600x1000]] [--critical-path] [--fold MODE]\n"
             "  scenario.json      a scenario (model, cluster, strategy or directive program); default: a preset\n"
             "  --compare FILE     stack a second scenario under the first, reports side by side\n"
             "  --overlay FILE     overlay a Chrome trace (e.g. measured) on the first scenario\n"
             "  --screenshot FILE  render the window offscreen to a PNG and exit\n"
             "  --size WxH         window size for --screenshot\n"
             "  --critical-path    highlight the critical path\n"
             "  --fold MODE        rows: off (one per device), class (per symmetry class), stage (per\n"
             "                     pipeline stage); default: class above 16 devices\n";
      return 0;
    }
  }
  if (screenshot && qEnvironmentVariableIsEmpty("QT_QPA_PLATFORM")) qputenv("QT_QPA_PLATFORM", "offscreen");
  QApplication app(argc, argv);
  QApplication::setApplicationName("piper-studio");
  QCommandLineParser parser;
  parser.setApplicationDescription("Piper studio: explore simulated training schedules.");
  parser.addHelpOption();
  parser.addPositionalArgument("scenario", "scenario JSON (as written by `piper` users); default: a preset");
  QCommandLineOption shot("screenshot", "render the window offscreen to <png> and exit", "png");
  QCommandLineOption compare("compare", "stack a second scenario under the first", "scenario");
  QCommandLineOption overlay("overlay", "overlay a Chrome trace (measured) on the first scenario", "trace");
  QCommandLineOption size("size", "window size for --screenshot (default 1600x1000)", "WxH", "1600x1000");
  QCommandLineOption critical("critical-path", "highlight the critical path");
  QCommandLineOption fold("fold", "rows: off, class or stage (default: class above 16 devices)", "mode");
  parser.addOptions({shot, compare, overlay, size, critical, fold});
  // Errors as the CLI's, one line and exit 2 (QCommandLineParser::process printed "Unknown option"
  // and exited 1); a second scenario, or an option given twice, was silently dropped.
  if (!parser.parse(QApplication::arguments())) {
    std::cerr << "piper-studio: error: " << parser.errorText().toStdString() << " (see piper-studio --help)\n";
    return 2;
  }
  if (parser.positionalArguments().size() > 1) {
    std::cerr << "piper-studio: error: one scenario at a time, got " << parser.positionalArguments().size()
              << " (--compare FILE stacks a second)\n";
    return 2;
  }
  for (const QCommandLineOption* o : {&shot, &compare, &overlay, &size, &fold})
    if (parser.values(*o).size() > 1) {
      std::cerr << "piper-studio: error: --" << o->names().first().toStdString() << " given "
                << parser.values(*o).size() << " times (once at most)\n";
      return 2;
    }

  StudioWindow window;
  if (parser.isSet(fold)) {
    const QString m = parser.value(fold);
    if (m == "off")
      window.view()->set_fold_mode(FoldMode::Off);
    else if (m == "class")
      window.view()->set_fold_mode(FoldMode::Class);
    else if (m == "stage")
      window.view()->set_fold_mode(FoldMode::Stage);
    else {
      std::cerr << "piper-studio: error: --fold '" << m.toStdString() << "': expected off, class or stage\n";
      return 2;
    }
  }
  const QStringList dims = parser.value(size).split('x');
  if (dims.size() != 2 || dims[0].toInt() < 320 || dims[1].toInt() < 240) {
    std::cerr << "piper-studio: error: --size '" << parser.value(size).toStdString()
              << "': expected WxH of at least 320x240, e.g. 1600x1000\n";
    return 2;
  }
  // 100000x100000 (40 GB of pixels) printed a dozen Qt warnings, then "cannot write".
  constexpr int kMaxSide = 16384;
  if (dims[0].toInt() > kMaxSide || dims[1].toInt() > kMaxSide) {
    std::cerr << "piper-studio: error: --size " << parser.value(size).toStdString() << ": at most " << kMaxSide
              << " pixels a side\n";
    return 2;
  }
  window.resize(dims[0].toInt(), dims[1].toInt());
  const bool sync = parser.isSet(shot);
  auto fail = [&](const QString& what) {
    std::cerr << "piper-studio: error: " << what.toStdString() << "\n";
    return 2;
  };
  // The screenshot's path, checked before anything is loaded or drawn: a PNG under another
  // extension (shot.svg held PNG bytes, exit 0), a folder, or a missing folder (both failed only
  // after rendering, as "cannot write").
  if (sync) {
    namespace fs = std::filesystem;
    const std::string out = parser.value(shot).toStdString();
    std::error_code ec;
    std::string ext = fs::path(out).extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
    const bool special = fs::exists(out, ec) && !fs::is_regular_file(out, ec) && !fs::is_directory(out, ec);
    if (out.empty()) return fail("--screenshot: must name a file, got an empty path");
    if (!special && !ext.empty() && ext != ".png")
      return fail(QString::fromStdString("--screenshot: writes a PNG image: name a .png file, got '" + out + "'"));
    if (fs::is_directory(out, ec))
      return fail(QString::fromStdString(out + ": --screenshot: is a folder, not a regular file: name a file"));
    const fs::path folder = fs::path(out).parent_path();
    if (!folder.empty() && !fs::is_directory(folder, ec))
      return fail(QString::fromStdString(out + ": --screenshot: no such folder '" + folder.string() + "'"));
  }
  bool ok = true;
  const QString first = parser.positionalArguments().isEmpty() ? QString() : parser.positionalArguments().first();
  if (first.endsWith(".csv", Qt::CaseInsensitive)) {
    // A tune result: list its candidates and show the best one's timeline.
    ok = window.open_tune_results(first);
    if (ok) window.load_scenario(window.tune_browser()->scenario_of(0), sync);
  } else if (!first.isEmpty()) {
    ok = window.open_scenario_file(first, sync);
  } else {
    window.load_scenario(default_scenario(), sync);
  }
  if (sync && (!ok || !window.run_a())) return fail(window.error_text());
  if (parser.isSet(compare) && !window.compare_with_file(parser.value(compare), sync) && sync)
    return fail(window.error_text());
  if (sync && parser.isSet(compare) && !window.run_b()) return fail(window.error_text());
  if (parser.isSet(overlay) && !window.overlay_trace(parser.value(overlay)) && sync) return fail(window.error_text());
  if (parser.isSet(critical)) window.view()->set_show_critical_path(true);
  window.show();
  if (!sync) return app.exec();
  QApplication::processEvents();
  window.view()->fit_to_window();
  QApplication::processEvents();
  // Whole or not at all (temporary file, then rename; written into a device or FIFO): a failed write
  // no longer leaves a cut PNG in place of an earlier one.
  QSaveFile file(parser.value(shot));
  file.setDirectWriteFallback(true);
  if (!file.open(QIODevice::WriteOnly) || !window.grab().save(&file, "PNG") || !file.commit())
    return fail(parser.value(shot) + ": cannot write the screenshot: " + file.errorString());
  return 0;
}

}  // namespace piper::gui
