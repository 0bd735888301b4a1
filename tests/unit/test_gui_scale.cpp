// piper-studio at scale (issue #27) under the offscreen platform: folding, elision, units, directive
// view, memory legend, measured error. Pure functions first, then the widgets at 256 and 1,024
// devices.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <QApplication>
#include <QImage>
#include <QTextBlock>
#include <QTextLayout>
#include <QTest>

#include "gui_support.hpp"
#include "piper/gui/chrome_trace.hpp"
#include "piper/gui/directive_editor.hpp"
#include "piper/gui/report_panel.hpp"
#include "piper/gui/scale.hpp"
#include "piper/gui/session.hpp"
#include "piper/gui/studio_window.hpp"

using namespace piper;
using namespace piper::gui;
using gui_test::app;
using gui_test::AppFirst;
using gui_test::small_scenario;
using gui_test::Studio;

namespace {

// qwen3-1b, 1F1B over PP=8 with `dp` data-parallel replicas: 8 x dp devices, 8 plans (one per stage).
core::Scenario scale_scenario(int dp) {
  core::Scenario s;
  s.model = "qwen3-1b";
  s.strategy.pp = 8;
  s.strategy.dp = dp;
  s.strategy.microbatches = 16;
  s.strategy.schedule = "1f1b";
  s.engine = "analytic";
  return s;
}

std::filesystem::path screenshot_dir() {
  const auto dir = std::filesystem::path(PIPER_TEST_BINARY_DIR) / "gui-screenshots";
  std::filesystem::create_directories(dir);
  return dir;
}

// Runs of `colour` down the pixel column x between y0 and y1 (how many separate bands it forms).
int colour_runs(const QImage& image, int x, int y0, int y1, QRgb colour) {
  int runs = 0;
  bool in = false;
  for (int y = y0; y < y1; ++y) {
    const bool hit = (image.pixel(x, y) & 0xFFFFFF) == (colour & 0xFFFFFF);
    runs += hit && !in;
    in = hit;
  }
  return runs;
}

}  // namespace

TEST(GuiScale, LabelsAreElidedInTheMiddleKeepingBothEnds) {
  // Code points as the width: the two labels, cut from the left before.
  const std::string pp = "pp>[8,9,10,11,12,13,14,15,… 32 devices]";
  const std::string e = elide_middle(pp, 20);
  EXPECT_LE(utf8_length(e), 20);
  EXPECT_EQ(e.rfind("pp>[8,", 0), 0u) << e;
  EXPECT_EQ(e.substr(e.size() - std::string("devices]").size()), "devices]") << e;
  EXPECT_EQ(std::count(e.begin(), e.end(), '\xA6'), 1) << e;  // one ellipsis (U+2026 ends in 0xA6), not two
  const std::string m = elide_middle("measured compute", 12);
  EXPECT_EQ(m, "measur…mpute");  // the head gets the odd character
  EXPECT_NE(m, "ed compute");
  EXPECT_EQ(elide_middle("compute", 7), "compute");  // fits: unchanged
  EXPECT_EQ(elide_middle("compute", 0), "…");
  // Never splits a code point; a measuring function (pixels) is honoured.
  EXPECT_EQ(utf8_length(elide_middle("ééééééééé", 5)), 5);
  const auto wide = [](std::string_view s) { return 10 * utf8_length(s); };
  EXPECT_LE(wide(elide_middle("pipeline stage seven", 95, wide)), 95);
}

TEST(GuiScale, UnitsScaleWithTheValue) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(3.4 * 1024), "3.40 KiB");
  EXPECT_EQ(format_bytes(212.0 * 1024 * 1024), "212 MiB");
  EXPECT_EQ(format_bytes(62.5 * 1024 * 1024), "62.5 MiB");
  EXPECT_EQ(format_bytes(7.49 * 1024 * 1024 * 1024), "7.49 GiB");
  EXPECT_EQ(format_bytes(1023.999 * 1024), "1.00 MiB");  // never "1024 KiB"
  EXPECT_EQ(format_percent(0.106), "10.6 %");
  EXPECT_EQ(format_percent(0.0421), "4.21 %");
  EXPECT_EQ(format_percent(0.000213), "0.0213 %");  // a tiny model's MFU is not "0.0 %"
  EXPECT_EQ(format_percent(0), "0 %");
  EXPECT_EQ(format_signed_percent(0.1), "+10.0 %");
  EXPECT_EQ(format_signed_percent(-0.0042), "-0.420 %");
  EXPECT_EQ(format_seconds(0.32614), "326.14 ms");
  EXPECT_EQ(format_seconds(3.1e-7), "310 ns");
  EXPECT_EQ(format_flops(1.234e9), "1.23 GFLOP");
  EXPECT_EQ(format_flops(4.56e7), "45.6 MFLOP");
  EXPECT_EQ(memory_breakdown({{"activations", 3 << 20}, {"parameters", 1 << 30}, {"optimizer_states", 0}}),
            "weights 1.00 GiB, activations 3.00 MiB");
}

// The report of a 5M-parameter model reads in MiB and with significant digits, not "0.00 GiB" and
// "0.0 %".
TEST(GuiReport, TinyModelsReadInSmallUnits) {
  app();
  const ScenarioRun run = run_scenario(small_scenario());
  ASSERT_LT(run.report.mfu, 0.01);
  ASSERT_LT(run.report.peak_memory_bytes, std::int64_t{1} << 30);
  const std::string html = QString::fromStdString(report_html({{"", run.report}})).replace("&nbsp;", " ").toStdString();
  EXPECT_EQ(html.find("0.00 GiB"), std::string::npos) << html;
  EXPECT_EQ(html.find(">0.0 %"), std::string::npos) << html;
  EXPECT_NE(html.find(format_percent(run.report.mfu)), std::string::npos);
  EXPECT_NE(html.find(" MiB"), std::string::npos);
}

// Devices fold into one group per symmetry class (same plan) and per pipeline stage: PP 8 x DP 32
// and x DP 128 give 8 groups, each the DP replicas of one stage, with identical timings.
TEST(GuiScale, FoldsDevicesBySymmetryClassAndStageAt256And1024) {
  for (int dp : {32, 128}) {
    const ScenarioRun run = run_scenario(scale_scenario(dp));
    const core::Timeline& tl = *run.timeline;
    ASSERT_EQ(static_cast<int>(tl.devices.size()), 8 * dp);
    EXPECT_EQ(default_fold_mode(tl), FoldMode::Class);
    for (FoldMode mode : {FoldMode::Class, FoldMode::Stage}) {
      const auto groups = fold_devices(tl, mode);
      ASSERT_EQ(groups.size(), 8u) << fold_mode_name(mode);
      for (int s = 0; s < 8; ++s) {
        const DeviceGroup& g = groups[static_cast<std::size_t>(s)];
        ASSERT_EQ(g.size(), dp);
        for (int k = 0; k < dp; ++k) EXPECT_EQ(g.devices[static_cast<std::size_t>(k)], s + 8 * k);
        EXPECT_EQ(g.stages, std::vector<int>{s});
        EXPECT_EQ(g.classes, 1);
        EXPECT_EQ(g.spread_s, 0.0);
        EXPECT_EQ(g.label, "stage " + std::to_string(s) + " ×" + std::to_string(dp));
      }
    }
    EXPECT_EQ(fold_devices(tl, FoldMode::Off).size(), tl.devices.size());
  }
  // DualPipeV: each device holds two stages (d and 2P-1-d).
  core::Scenario v = scale_scenario(8);
  v.strategy.pp = 4;
  v.strategy.schedule = "dualpipev";
  const ScenarioRun run = run_scenario(v);
  const auto stages = fold_devices(*run.timeline, FoldMode::Stage);
  ASSERT_EQ(stages.size(), 4u);
  EXPECT_EQ(stages[0].stages, (std::vector<int>{0, 7}));
  EXPECT_EQ(stages[0].label, "stages 0,7 ×8");
  EXPECT_EQ(stages_label({2, 3, 4, 5}), "stages 2-5");
}

namespace {

// The studio at 8 x dp devices in a 1600x1000 window, folded by default.
struct ScaleStudio : AppFirst {
  StudioWindow window;
  explicit ScaleStudio(int dp) {
    window.resize(1600, 1000);
    window.show();
    window.load_scenario(scale_scenario(dp), /*synchronous=*/true);
    QApplication::processEvents();
    window.view()->fit_to_window();
    QApplication::processEvents();
  }
};

void check_folded_view(int dp) {
  ScaleStudio s(dp);
  ASSERT_TRUE(s.window.run_a()) << s.window.error_text().toStdString();
  TimelineView* view = s.window.view();
  ASSERT_EQ(view->device_rows(), 8 * dp);
  EXPECT_EQ(view->fold_mode(), FoldMode::Class);
  // Every stage on screen without scrolling.
  ASSERT_EQ(view->visible_rows(), 8);
  EXPECT_LE(view->content_height(), view->rows_viewport_height());
  QFont gutter = view->font();
  gutter.setPointSizeF(8);
  const QFontMetrics fm(gutter);
  int pp_lanes = 0;
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(view->row_label(0, r).toStdString(), "stage " + std::to_string(r) + " ×" + std::to_string(dp));
    EXPECT_EQ(view->row_device(0, r), r);
    const auto& lanes = view->tracks()[0]->rows[static_cast<std::size_t>(r)].lanes;
    for (int l = 0; l < static_cast<int>(lanes.size()); ++l) {
      const QString text = view->lane_text(0, r, l);
      EXPECT_LE(fm.horizontalAdvance(text), view->lane_text_width()) << text.toStdString();
      if (lanes[static_cast<std::size_t>(l)].name.rfind("pp", 0) == 0) {
        ++pp_lanes;
        // "pp>[1,9,…32 devices]": both ends kept, so the direction and the group size stay readable.
        EXPECT_TRUE(text.startsWith("pp>[") || text.startsWith("pp<[")) << text.toStdString();
        EXPECT_TRUE(text.endsWith(QString("%1 devices]").arg(dp))) << text.toStdString();
      }
    }
  }
  EXPECT_GT(pp_lanes, 8);
  // Screenshot: not blank, op colours present, and exactly 8 folded-row bands in the gutter.
  const QImage shot = view->grab().toImage();
  ASSERT_TRUE(shot.save(
      QString::fromStdString((screenshot_dir() / ("studio-" + std::to_string(8 * dp) + "-folded.png")).string())));
  std::set<QRgb> colours;
  for (int y = 0; y < shot.height(); y += 3)
    for (int x = 0; x < shot.width(); x += 3) colours.insert(shot.pixel(x, y) & 0xFFFFFF);
  EXPECT_GT(colours.size(), 30u);
  EXPECT_TRUE(colours.count(kind_colour(SpanKind::F).rgb() & 0xFFFFFF));
  EXPECT_TRUE(colours.count(kind_colour(SpanKind::B).rgb() & 0xFFFFFF));
  const QRgb folded_band = qRgb(0xF1, 0xF5, 0xFB);
  const int body_top = view->row_top(0, 0);
  EXPECT_EQ(colour_runs(shot, 2, body_top, view->height() - 160, folded_band), 8);

  // Clicking stage 3's label expands it into its dp devices; clicking a member folds it back.
  const QPoint label3(20, view->row_top(0, 3) + 5);
  QTest::mouseClick(view, Qt::LeftButton, Qt::NoModifier, label3);
  EXPECT_EQ(view->visible_rows(), 8 - 1 + dp);
  EXPECT_TRUE(view->group_expanded(0, 3));
  EXPECT_EQ(view->row_label(0, 4), "dev 11");
  const QImage expanded = view->grab().toImage();
  EXPECT_EQ(colour_runs(expanded, 2, body_top, view->height() - 160, folded_band),
            3);  // stages 0-2 (the rest scrolled below)
  QTest::mouseClick(view, Qt::LeftButton, Qt::NoModifier, QPoint(20, view->row_top(0, 5) + 5));
  EXPECT_EQ(view->visible_rows(), 8);
  view->set_fold_mode(FoldMode::Off);
  EXPECT_EQ(view->visible_rows(), 8 * dp);
  view->set_fold_mode(FoldMode::Stage);
  EXPECT_EQ(view->visible_rows(), 8);

  // Memory pane: one curve per row with its own colour and a legend label; the tooltip of a curve
  // has the peak and its breakdown by kind.
  const auto curves = view->memory_curves();
  ASSERT_EQ(curves.size(), 8u);
  std::set<QRgb> curve_colours;
  for (const auto& c : curves) {
    curve_colours.insert(c.colour.rgb());
    EXPECT_EQ(c.label, view->row_label(0, c.row));
  }
  EXPECT_EQ(curve_colours.size(), 8u);
  // The legend shows all 8 in the screenshot: each curve's colour appears in the gutter column of
  // swatches under the memory pane's header.
  std::set<QRgb> swatches;
  const int memory_top = view->height() - std::min(150, view->height() / 4);
  for (int y = memory_top; y < view->height(); ++y) swatches.insert(shot.pixel(12, y) & 0xFFFFFF);
  for (QRgb c : curve_colours) EXPECT_TRUE(swatches.count(c & 0xFFFFFF)) << std::hex << c;
  const QString tip =
      view->describe_memory(QPointF((view->plot_left() + view->plot_right()) / 2.0, view->height() - 40));
  for (const char* word :
       {"peak by kind:", "weights", "gradients", "optimizer state", "activations", "curve of device"})
    EXPECT_TRUE(tip.contains(word)) << word << " in " << tip.toStdString();
  EXPECT_TRUE(view->describe_memory(QPointF(300, 100)).isEmpty());  // not in the memory pane
}

}  // namespace

TEST(GuiStudio, FoldedTimelineShowsEveryStageAt256Devices) { check_folded_view(32); }
TEST(GuiStudio, FoldedTimelineShowsEveryStageAt1024Devices) { check_folded_view(128); }

// The directive pane: one directive per line, readable JSON (spaces, "op" first), wrapped at the
// pane's edge instead of cut.
TEST(GuiEditor, DirectiveViewHasOneReadableDirectivePerLine) {
  ScaleStudio s(32);
  const std::string text = s.window.editor()->toPlainText().toStdString();
  std::istringstream lines(text);
  std::string line;
  std::vector<std::string> all;
  while (std::getline(lines, line)) all.push_back(line);
  const nlohmann::json program = s.window.run_a()->program_json;
  ASSERT_EQ(all.size(), program.size() + 2);
  EXPECT_EQ(all.front(), "[");
  EXPECT_EQ(all.back(), "]");
  for (std::size_t i = 0; i < program.size(); ++i) {
    std::string d = all[i + 1];
    if (d.back() == ',') d.pop_back();
    EXPECT_EQ(nlohmann::json::parse(d), program[i]) << d;
    EXPECT_EQ(d.rfind("  {\"op\": ", 0), 0u) << d;
  }
  EXPECT_NE(text.find("\"devices\": [0, 8, 16,"), std::string::npos);
  EXPECT_EQ(s.window.editor()->lineWrapMode(), QPlainTextEdit::WidgetWidth);
  // A long directive takes several screen lines (wrapped), all of it visible.
  QTextBlock block = s.window.editor()->document()->findBlockByNumber(1);
  EXPECT_GT(block.layout()->lineCount(), 1);
}

// A measured trace 10 % slower on every compute op: each op's tooltip and the lane summary give the
// error against the prediction.
TEST(GuiStudio, MeasuredOverlayShowsTheErrorPerOpAndPerLane) {
  Studio s;
  const core::Timeline& tl = *s.window.run_a()->timeline;
  std::ostringstream out;
  core::write_chrome_trace(tl, out);
  nlohmann::json trace = nlohmann::json::parse(out.str());
  std::set<std::pair<long long, long long>> compute_threads;
  for (const auto& e : trace["traceEvents"])
    if (e.value("ph", "") == "M" && e.value("name", "") == "thread_name" && e["args"].value("name", "") == "compute")
      compute_threads.insert({e["pid"].get<long long>(), e["tid"].get<long long>()});
  for (auto& e : trace["traceEvents"])
    if (e.value("ph", "") == "X" && compute_threads.count({e["pid"].get<long long>(), e["tid"].get<long long>()}))
      e["dur"] = e["dur"].get<double>() * 1.1;
  const auto path = (screenshot_dir() / "slow-compute-trace.json").string();
  std::ofstream(path) << trace.dump();
  ASSERT_TRUE(s.window.overlay_trace(QString::fromStdString(path)));
  TimelineView* view = s.window.view();
  const DeviceRow& row = view->tracks().at(0)->rows.at(0);
  int lane = -1;
  for (std::size_t l = 0; l < row.lanes.size(); ++l)
    if (row.lanes[l].measured && row.lanes[l].name == "measured compute") lane = static_cast<int>(l);
  ASSERT_GE(lane, 0);
  const Lane& m = row.lanes[static_cast<std::size_t>(lane)];
  EXPECT_EQ(m.error.matched, static_cast<int>(m.size()));
  EXPECT_EQ(m.error.unmatched, 0);
  EXPECT_NEAR(m.error.total_error(), 0.10, 1e-3);
  EXPECT_NEAR(m.error.mean_abs_error, 0.10, 1e-3);
  const QString text = view->lane_text(0, 0, lane);
  EXPECT_TRUE(text.endsWith("+10.0 %")) << text.toStdString();
  EXPECT_TRUE(text.startsWith("meas")) << text.toStdString();
  const QString tip = view->describe(TimelineView::Hit{0, 0, lane, 0});
  EXPECT_TRUE(tip.contains("error +10.0 %")) << tip.toStdString();
  EXPECT_TRUE(tip.contains("predicted")) << tip.toStdString();
  // The predicted op's tooltip gives its measured twin too.
  ASSERT_GE(m.predicted_lane, 0);
  EXPECT_EQ(row.lanes[static_cast<std::size_t>(m.predicted_lane)].name, "compute");
  const QString predicted_tip = view->describe(TimelineView::Hit{0, 0, m.predicted_lane, m.predicted_pos[0]});
  EXPECT_TRUE(predicted_tip.contains("measured ")) << predicted_tip.toStdString();
  EXPECT_TRUE(predicted_tip.contains("error +10.0 %")) << predicted_tip.toStdString();
  // The lane's label in the gutter: its tooltip sums the lane up.
  QString gutter;
  for (int y = view->row_top(0, 0); y < view->row_top(0, 1) && !gutter.contains("measured compute"); ++y)
    gutter = view->describe_gutter(QPointF(60, y));
  EXPECT_TRUE(gutter.contains("vs predicted: " + QString::number(m.size()) + " of " + QString::number(m.size()) +
                              " ops matched"))
      << gutter.toStdString();
  EXPECT_TRUE(gutter.contains("(+10.0 %)")) << gutter.toStdString();
  // A lane not of the same stream has no error to give.
  Track copy = *view->tracks().at(0);
  copy.rows[0].lanes[static_cast<std::size_t>(lane)].name = "measured other";
  match_measured_lane(copy, 0, lane, "no such stream");
  EXPECT_EQ(copy.rows[0].lanes[static_cast<std::size_t>(lane)].error.matched, 0);
  EXPECT_EQ(copy.rows[0].lanes[static_cast<std::size_t>(lane)].predicted_lane, -1);
}

// The report's per-device table at 256 devices: one row per set of devices with equal figures (the
// DP replicas of a stage), every device accounted for, none "not listed".
TEST(GuiReport, PerDeviceTableFoldsEqualDevicesAt256) {
  app();
  const ScenarioRun run = run_scenario(scale_scenario(32));
  const std::string html = report_html({{"", run.report}});
  EXPECT_EQ(html.find("not listed"), std::string::npos);
  for (int s = 0; s < 8; ++s)
    EXPECT_NE(html.find("<td>" + std::to_string(s) + "," + std::to_string(s + 8) + ",…," + std::to_string(s + 248) +
                        "&nbsp;×32</td>"),
              std::string::npos)
        << s;
  // Up to max_device_rows devices: one row each, as before.
  const std::string small = report_html({{"", run_scenario(small_scenario()).report}});
  EXPECT_NE(small.find("<td>7</td>"), std::string::npos);
  EXPECT_EQ(small.find("×"), std::string::npos);
}

// --fold picks the rows of a --screenshot; an unknown mode is one line and a non-zero exit.
TEST(GuiStudio, FoldOptionOfTheCommandLine) {
  const auto dir = screenshot_dir();
  const auto scenario = (dir / "pp8-dp32.json").string();
  std::ofstream(scenario) << scale_scenario(32).to_json().dump();
  const auto png = (dir / "studio-256-fold-stage.png").string();
  std::filesystem::remove(png);
  const std::string base =
      std::string("QT_QPA_PLATFORM=offscreen '") + PIPER_STUDIO + "' --screenshot '" + png + "' '" + scenario + "'";
  ASSERT_EQ(std::system((base + " --fold stage > /dev/null 2>&1").c_str()), 0);
  EXPECT_FALSE(QImage(png.c_str()).isNull());
  const auto err = (dir / "fold-error.txt").string();
  EXPECT_NE(std::system((base + " --fold stages > /dev/null 2> '" + err + "'").c_str()), 0);
  std::ifstream in(err);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find("--fold 'stages': expected off, class or stage"), std::string::npos) << text;
}
