// piper-studio under the offscreen platform: rows per device, click-to-select with cross-device
// dependencies, zoom around the cursor, editor errors that keep the last timeline, trace round trip,
// export and the --screenshot mode. The studio at scale (folding, elision, units) is in
// test_gui_scale.cpp.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>

#include <QApplication>
#include <QComboBox>
#include <QImage>
#include <QPushButton>
#include <QTextBlock>
#include <QTextLayout>
#include <QSignalSpy>
#include <QSpinBox>
#include <QTableWidget>
#include <QTest>
#include <QWheelEvent>

#include "piper/gui/chrome_trace.hpp"
#include "piper/gui/directive_editor.hpp"
#include "piper/gui/report_panel.hpp"
#include "piper/gui/scale.hpp"
#include "piper/gui/session.hpp"
#include "piper/gui/studio_window.hpp"
#include "piper/gui/tune_browser.hpp"
#include "piper/search/tune.hpp"
#include "piper/sim/cluster.hpp"
#include "gui_support.hpp"

using namespace piper;
using namespace piper::gui;
using gui_test::app;
using gui_test::AppFirst;
using gui_test::small_scenario;
using gui_test::Studio;

// Clicks "Simulate preset" and waits for the run, which must succeed.
void simulate_preset(StudioWindow& window) {
  QPushButton* apply = nullptr;
  for (auto* b : window.findChildren<QPushButton*>())
    if (b->text() == "Simulate preset") apply = b;
  ASSERT_NE(apply, nullptr);
  QSignalSpy spy(&window, &StudioWindow::simulation_finished);
  apply->click();
  ASSERT_TRUE(spy.wait(20000));
  ASSERT_TRUE(spy.takeFirst().at(0).toBool()) << window.error_text().toStdString();
}

TEST(GuiData, LaneVisibleRangeAndHitUseBinarySearchOverSortedSpans) {
  // Hand-made lane: [0,1) [1,2) [5,6) and a long overlapping measured-style span [1.5, 10).
  Lane lane;
  lane.start_s = {0, 1, 1.5, 5};
  lane.end_s = {1, 2, 10, 6};
  lane.max_end_s = {1, 2, 10, 10};
  auto [first, last] = lane.visible(2.5, 4.0);  // only the long span intersects
  EXPECT_EQ(first, 2u);
  EXPECT_EQ(last, 3u);
  EXPECT_EQ(lane.visible(0.5, 1.2), (std::pair<std::size_t, std::size_t>{0, 2}));
  EXPECT_EQ(lane.hit(5.5, 0.01), 2);  // the first span (by start) containing t
  EXPECT_EQ(lane.hit(0.5, 0.01), 0);
  EXPECT_EQ(lane.hit(-0.5, 0.1), -1);  // nothing within the tolerance
}

// The report panel shows the critical path's TP collectives (inside compute ops) only when a report
// has some.
TEST(GuiReport, TpRowOnlyWhenAReportHasTpCollectives) {
  sim::Report plain, tp;
  plain.critical_path.compute_s = tp.critical_path.compute_s = 0.010;
  tp.critical_path.tp_s = 0.002;
  EXPECT_EQ(report_html({{"a", plain}}).find("of which TP"), std::string::npos);
  const std::string both = report_html({{"a", plain}, {"b", tp}});
  EXPECT_NE(both.find("of which TP"), std::string::npos) << both;
}

TEST(GuiEditor, DirectiveIndexAndFieldMapToTheirLine) {
  const std::string text =
      "[\n"
      "  {\"op\": \"place\", \"devices\": [0]},\n"
      "  {\"op\": \"split\",\n"
      "   \"num_microbatches\": \"x\"},\n"
      "  {\"op\": \"order\", \"filters\": [\"[,]{\"]}\n"
      "]\n";
  EXPECT_EQ(top_level_elements(text).size(), 3u);
  EXPECT_EQ(directive_line(text, 0, ""), 1);
  EXPECT_EQ(directive_line(text, 1, ""), 2);
  EXPECT_EQ(directive_line(text, 1, "num_microbatches"), 3);
  EXPECT_EQ(directive_line(text, 2, "filters"), 4);
  EXPECT_EQ(directive_line(text, 3, ""), -1);
  const JsonCheck bad = check_json("[\n  {\"op\": \"place\"},\n  {\"op\" \"split\"}\n]");
  EXPECT_FALSE(bad.ok);
  EXPECT_EQ(bad.line, 2);
  nlohmann::json program = nlohmann::json::array({{{"op", "place"}}, {{"op", "split"}}});
  EXPECT_EQ(format_program(program), "[\n  {\"op\": \"place\"},\n  {\"op\": \"split\"}\n]\n");
  EXPECT_EQ(format_directive({{"filter", {{"PP", 0}}}, {"op", "place"}, {"devices", {0, 8}}}),
            "{\"op\": \"place\", \"devices\": [0, 8], \"filter\": {\"PP\": 0}}");
}

TEST(GuiStudio, LoadingAScenarioFillsOneRowPerDevice) {
  Studio s;
  ASSERT_TRUE(s.window.run_a()) << s.window.error_text().toStdString();
  EXPECT_EQ(s.window.view()->device_rows(), 4 * 2);
  // Every op of the program is in exactly one lane.
  const auto& track = *s.window.view()->tracks().at(0);
  EXPECT_EQ(track.span_count, s.window.run_a()->timeline->program->total_ops());
  EXPECT_FALSE(s.window.editor()->toPlainText().isEmpty());
  EXPECT_NE(s.window.report_panel()->toPlainText().indexOf("step time"), -1);
}

// The preset panel carries every strategy knob a scenario file may set: loading one with TP, SP,
// recomputation and an HSDP group fills the panel, and "Simulate preset" runs those same knobs.
TEST(GuiStudio, PresetPanelCarriesTensorParallelAndHybridShardingKnobs) {
  Studio s;
  core::Scenario sc = small_scenario();
  sc.strategy.pp = 1, sc.strategy.dp = 4, sc.strategy.zero = 3, sc.strategy.dp_shard = 2;
  sc.strategy.tp = 2, sc.strategy.sequence_parallel = true, sc.strategy.recompute = "selective";
  s.window.load_scenario(sc, /*synchronous=*/true);
  ASSERT_TRUE(s.window.run_a()) << s.window.error_text().toStdString();
  EXPECT_EQ(s.window.view()->device_rows(), 2 * 4);
  ASSERT_NO_FATAL_FAILURE(simulate_preset(s.window));
  const auto& st = s.window.run_a()->scenario.strategy;
  EXPECT_EQ(st.tp, 2);
  EXPECT_TRUE(st.sequence_parallel);
  EXPECT_EQ(st.recompute, "selective");
  EXPECT_EQ(st.dp_shard, 2);
  EXPECT_EQ(st.zero, 3);
  int hybrid = 0;
  for (const auto& seg : s.window.run_a()->timeline->program->segments)
    hybrid += seg.zero_shards == 2 && seg.replicas == 4;
  EXPECT_GT(hybrid, 0);
}

// Settings without a hand-laid field get one generated from the settings table (named after the
// setting, its help as tool tip), and "Simulate preset" keeps their values.
TEST(GuiStudio, PresetPanelHasAFieldForEverySetting) {
  Studio s;
  core::Scenario sc = small_scenario();
  sc.strategy.pp = 1, sc.strategy.dp = 2, sc.strategy.zero = 3;
  sc.strategy.reduce_every = "step", sc.strategy.gather_prefetch = 0, sc.strategy.bucket_mb = 25;
  s.window.load_scenario(sc, /*synchronous=*/true);
  for (const char* name :
       {"bucket_mb", "fp8_all_gather", "reduce_every", "gather_prefetch", "tp_comm_overlap", "comm_sms"}) {
    QWidget* field = s.window.findChild<QWidget*>(name);
    ASSERT_NE(field, nullptr) << name;
    EXPECT_TRUE(field->toolTip().startsWith("--")) << name;
  }
  ASSERT_NO_FATAL_FAILURE(simulate_preset(s.window));
  const auto& st = s.window.run_a()->scenario.strategy;
  EXPECT_FALSE(st.fp8_all_gather);
  EXPECT_EQ(st.reduce_every, "step");
  EXPECT_EQ(st.gather_prefetch, 0);
  EXPECT_EQ(st.bucket_mb, 25);
  EXPECT_FALSE(st.tp_comm_overlap);
}

// A scenario with a global batch shows the microbatches it resolves to (512 sequences / (1 x DP 2) =
// 256), not the unused microbatches field, and "Simulate preset" keeps the global batch.
TEST(GuiStudio, PresetPanelShowsTheMicrobatchesOfAGlobalBatch) {
  Studio s;
  core::Scenario sc = small_scenario();
  sc.strategy.microbatches = 1;
  sc.strategy.global_batch = 512;
  sc.micro_batch_size = 1;
  s.window.load_scenario(sc, /*synchronous=*/true);
  ASSERT_TRUE(s.window.run_a()) << s.window.error_text().toStdString();
  auto* microbatches = s.window.findChild<QSpinBox*>("microbatches");
  auto* global_batch = s.window.findChild<QSpinBox*>("global_batch");
  ASSERT_NE(microbatches, nullptr);
  ASSERT_NE(global_batch, nullptr);
  EXPECT_EQ(microbatches->value(), 256);
  EXPECT_FALSE(microbatches->isEnabled());
  EXPECT_EQ(global_batch->value(), 512);
  EXPECT_EQ(s.window.run_a()->report.microbatches, 256);
  ASSERT_NO_FATAL_FAILURE(simulate_preset(s.window));
  EXPECT_EQ(s.window.run_a()->scenario.strategy.global_batch, 512);
  EXPECT_EQ(s.window.run_a()->report.microbatches, 256);
  // Without a global batch, M is the scenario's own and editable again.
  s.window.load_scenario(small_scenario(), /*synchronous=*/true);
  EXPECT_EQ(microbatches->value(), 4);
  EXPECT_TRUE(microbatches->isEnabled());
  EXPECT_EQ(global_batch->value(), 0);
}

// A scenario file with a misspelt strategy key is refused with the nearest key, not run with the
// key ignored (it would run 1 microbatch).
TEST(GuiStudio, ScenarioFileWithAMisspeltKeyIsRefused) {
  Studio s;
  const auto path = std::filesystem::temp_directory_path() / ("piper_gui_typo_" + std::to_string(::getpid()) + ".json");
  std::ofstream(path) << R"({"model": "qwen3-9m", "strategy": {"pp": 2, "microbatchs": 4}})";
  EXPECT_FALSE(s.window.open_scenario_file(QString::fromStdString(path.string()), /*synchronous=*/true));
  EXPECT_NE(s.window.error_text().indexOf("unknown field (did you mean 'microbatches'?)"), -1)
      << s.window.error_text().toStdString();
  std::filesystem::remove(path);
}

// The cluster a scenario names stays the panel's cluster: a file shows as itself (a non-preset was
// not selectable, and "Simulate preset" ran the previous preset), a derived spec as its cluster with
// its runtime and attention kernel, and the runtime and attention fields compose that spec again.
TEST(GuiStudio, PresetPanelKeepsTheClusterAndItsRuntimeSettings) {
  Studio s;
  auto* runtime = s.window.findChild<QComboBox*>("runtime");
  auto* attention = s.window.findChild<QComboBox*>("attention_kernel");
  ASSERT_NE(runtime, nullptr);
  ASSERT_NE(attention, nullptr);
  const auto path =
      std::filesystem::temp_directory_path() / ("piper_gui_cluster_" + std::to_string(::getpid()) + ".json");
  // A GPU without a kernel table (the efficiency curve): no attention implementation to choose.
  std::ofstream(path) << R"({"name": "two-node h100", "preset": "dgx-h100", "nodes": 2,
                             "node": {"gpu": {"kernel_table": ""}}})";
  core::Scenario sc = small_scenario();
  sc.cluster = path.string();
  s.window.load_scenario(sc, /*synchronous=*/true);
  ASSERT_NO_FATAL_FAILURE(simulate_preset(s.window));
  EXPECT_EQ(s.window.run_a()->scenario.cluster, path.string());
  EXPECT_EQ(s.window.run_a()->report.cluster, "two-node h100");
  EXPECT_EQ(attention->count(), 1);

  sc.cluster = sim::derived_cluster_spec("dgx-h100", "eager", "fa2");
  s.window.load_scenario(sc, /*synchronous=*/true);
  ASSERT_TRUE(s.window.run_a()) << s.window.error_text().toStdString();
  const double derived_step = s.window.run_a()->report.step_time_s;
  EXPECT_NE(s.window.run_a()->title.find("dgx-h100, runtime eager, attention fa2 (analytic)"), std::string::npos)
      << s.window.run_a()->title;
  EXPECT_EQ(runtime->currentData().toString(), "eager");
  EXPECT_EQ(attention->currentData().toString(), "fa2");
  ASSERT_NO_FATAL_FAILURE(simulate_preset(s.window));
  EXPECT_EQ(s.window.run_a()->scenario.cluster, sc.cluster);
  EXPECT_DOUBLE_EQ(s.window.run_a()->report.step_time_s, derived_step);

  // The cluster's own settings again: the plain preset, which costs the fused runtime and cuDNN.
  runtime->setCurrentIndex(0);
  attention->setCurrentIndex(0);
  ASSERT_NO_FATAL_FAILURE(simulate_preset(s.window));
  EXPECT_EQ(s.window.run_a()->scenario.cluster, "dgx-h100");
  EXPECT_LT(s.window.run_a()->report.step_time_s, derived_step);
  // The attention implementations the H100 table holds.
  EXPECT_NE(attention->findData("fa1"), -1);
  EXPECT_NE(attention->findData("fa2"), -1);
  std::filesystem::remove(path);
}

// An op's tooltip says how many TP collectives it runs inside itself, and what it recomputes.
TEST(GuiStudio, TooltipOfATensorParallelOpNamesItsCollectives) {
  Studio s;
  core::Scenario sc = small_scenario();
  sc.strategy.pp = 1, sc.strategy.dp = 1, sc.strategy.tp = 2, sc.strategy.recompute = "selective";
  s.window.load_scenario(sc, /*synchronous=*/true);
  ASSERT_TRUE(s.window.run_a()) << s.window.error_text().toStdString();
  TimelineView* view = s.window.view();
  const core::Timeline& tl = *s.window.run_a()->timeline;
  const core::Plan& plan = tl.program->plan_for(0);
  OpKey backward;
  for (int st = 0; st < static_cast<int>(plan.streams.size()) && !backward.valid(); ++st)
    for (int i = 0; i < static_cast<int>(plan.streams[static_cast<std::size_t>(st)].ops.size()); ++i) {
      const core::Op& op = plan.streams[static_cast<std::size_t>(st)].ops[static_cast<std::size_t>(i)];
      if (op.kind == core::OpKind::Compute && op.pass == core::Pass::B && op.tp_collectives > 0 &&
          op.recompute_flops > 0) {
        backward = {0, st, i};
        break;
      }
    }
  ASSERT_TRUE(backward.valid());
  const core::Op& op = tl.op(0, core::OpSpan{backward.stream, backward.index, 0, 0});
  for (const auto& sp : tl.devices[0].spans)
    if (sp.stream == backward.stream && sp.index == backward.index)
      view->set_time_range(sp.start_s - (sp.end_s - sp.start_s), sp.end_s + (sp.end_s - sp.start_s));
  auto centre = view->op_centre(0, backward);
  ASSERT_TRUE(centre);
  const QString text = view->describe(view->hit_at(*centre));
  EXPECT_NE(text.indexOf(QString("%1 TP collective").arg(op.tp_collectives)), -1) << text.toStdString();
  EXPECT_NE(text.indexOf("recomputed"), -1) << text.toStdString();
}

TEST(GuiStudio, ClickSelectsTheOpUnderTheCursorAndItsCrossDeviceDependencies) {
  Studio s;
  TimelineView* view = s.window.view();
  const core::Timeline& tl = *s.window.run_a()->timeline;
  // The first RECV on device 1 receives microbatch 0's activations from device 0 (pipeline rank 0).
  const core::Plan& plan = tl.program->plan_for(1);
  OpKey recv;
  for (int st = 0; st < static_cast<int>(plan.streams.size()) && !recv.valid(); ++st)
    for (int i = 0; i < static_cast<int>(plan.streams[static_cast<std::size_t>(st)].ops.size()); ++i)
      if (plan.streams[static_cast<std::size_t>(st)].ops[static_cast<std::size_t>(i)].kind == core::OpKind::Recv) {
        recv = {1, st, i};
        break;
      }
  ASSERT_TRUE(recv.valid());
  // Zoom so the op is a few pixels wide at least, then click its centre.
  const auto& span_list = tl.devices[1].spans;
  double start = 0, end = 0;
  for (const auto& sp : span_list)
    if (sp.stream == recv.stream && sp.index == recv.index) start = sp.start_s, end = sp.end_s;
  view->set_time_range(start - (end - start) * 20, end + (end - start) * 20);
  auto centre = view->op_centre(0, recv);
  ASSERT_TRUE(centre);
  QTest::mouseClick(view, Qt::LeftButton, Qt::NoModifier, centre->toPoint());
  EXPECT_EQ(view->selected_op(), recv);
  const core::Op& recv_op = tl.op(1, core::OpSpan{recv.stream, recv.index, 0, 0});
  bool has_send_partner = false;
  for (const OpKey& k : view->selected_dependencies().incoming)
    if (k.device == 0) {
      const core::Op& o = tl.op(0, core::OpSpan{k.stream, k.index, 0, 0});
      has_send_partner = has_send_partner || (o.kind == core::OpKind::Send && o.node == recv_op.node);
    }
  EXPECT_TRUE(has_send_partner);
  // Clicking empty space (left of time 0) clears the selection.
  QTest::mouseClick(view, Qt::LeftButton, Qt::NoModifier, QPoint(view->plot_left() + 1, centre->toPoint().y()));
  EXPECT_FALSE(view->selected_op().valid());
}

// The arrows of a click (the cross-device dependencies) are the meeting of the op's pairing id
// (Op::pair): a RECV's incoming SEND and a SEND's outgoing RECV are the op with the same id on its
// peer, a collective's partners are the other members of its group, each with the same id.
TEST(GuiStudio, CrossDeviceArrowsFollowThePairingIds) {
  Studio s;
  const auto timeline = s.window.run_a()->timeline;
  const core::Program& p = *timeline->program;
  DependencyIndex index(timeline);
  int transfers = 0, collectives = 0;
  for (int d = 0; d < p.num_devices; ++d) {
    const core::Plan& plan = p.plan_for(d);
    for (int st = 0; st < static_cast<int>(plan.streams.size()); ++st)
      for (int i = 0; i < static_cast<int>(plan.streams[static_cast<std::size_t>(st)].ops.size()); ++i) {
        const core::Op& op = plan.streams[static_cast<std::size_t>(st)].ops[static_cast<std::size_t>(i)];
        if (op.kind == core::OpKind::Compute || op.kind == core::OpKind::Update) continue;
        const Dependencies deps = index.of({d, st, i});
        std::vector<OpKey> cross;
        for (const auto* list : {&deps.incoming, &deps.outgoing, &deps.partners})
          for (const OpKey& k : *list)
            if (k.device != d) cross.push_back(k);
        std::set<int> devices;
        for (const OpKey& k : cross) {
          EXPECT_EQ(index.op(k).pair, op.pair) << "device " << d << " " << op.label;
          devices.insert(k.device);
        }
        if (op.kind == core::OpKind::Send || op.kind == core::OpKind::Recv) {
          ASSERT_EQ(cross.size(), 1u) << "device " << d << " " << op.label;
          EXPECT_EQ(cross[0].device, p.peer_of(op, d));
          const auto& list = op.kind == core::OpKind::Recv ? deps.incoming : deps.outgoing;
          EXPECT_NE(std::find(list.begin(), list.end(), cross[0]), list.end());
          ++transfers;
        } else {
          std::set<int> group;
          for (int m : p.group_of(op.family, d))
            if (m != d) group.insert(m);
          EXPECT_EQ(devices, group) << "device " << d << " " << op.label;
          EXPECT_EQ(cross.size(), group.size());
          ++collectives;
        }
      }
  }
  EXPECT_GT(transfers, 0);
  EXPECT_GT(collectives, 0);
}

TEST(GuiStudio, WheelZoomKeepsTheTimeUnderTheCursorFixed) {
  Studio s;
  TimelineView* view = s.window.view();
  const QPointF at(view->plot_left() + 377.0, 200.0);
  const double t_before = view->time_at(at.x());
  const double scale_before = view->pixels_per_s();
  QWheelEvent wheel(at, view->mapToGlobal(at), QPoint(), QPoint(0, 240), Qt::NoButton, Qt::NoModifier,
                    Qt::NoScrollPhase, false);
  QApplication::sendEvent(view, &wheel);
  // Two notches: 1.25^2 zoom; the time under the cursor moves by less than 1e-9 of the view width.
  EXPECT_NEAR(view->pixels_per_s() / scale_before, 1.5625, 1e-12);
  EXPECT_NEAR(view->time_at(at.x()), t_before, 1e-9 * (view->view_end_s() - view->view_start_s()));
}

TEST(GuiStudio, InvalidDirectiveEditShowsTheErrorAtItsLineAndKeepsTheLastTimeline) {
  Studio s;
  s.window.set_debounce_ms(10);
  auto before = s.window.view()->tracks().at(0);
  nlohmann::json program = s.window.run_a()->program_json;
  ASSERT_TRUE(program.is_array());
  // Directive 1 is a `place`: give it a device list that is not a list.
  int place = -1;
  for (std::size_t i = 0; i < program.size() && place < 0; ++i)
    if (program[i]["op"] == "place") place = static_cast<int>(i);
  ASSERT_GE(place, 0);
  program[static_cast<std::size_t>(place)]["devices"] = "not a list";
  QSignalSpy spy(&s.window, &StudioWindow::simulation_finished);
  s.window.editor()->setPlainText(
      QString::fromStdString(format_program(program)));  // a user edit: debounced, background
  ASSERT_TRUE(spy.wait(20000));
  EXPECT_FALSE(spy.takeFirst().at(0).toBool());
  EXPECT_NE(s.window.error_text().indexOf("directive " + QString::number(place)), -1)
      << s.window.error_text().toStdString();
  EXPECT_EQ(s.window.editor()->error_line(), place + 1);  // line 0 is "["
  EXPECT_EQ(s.window.view()->tracks().at(0), before);

  // A JSON syntax error is marked at its line without simulating.
  s.window.editor()->setPlainText("[\n  {\"op\": \"split\"},\n  {\"op\" \"place\"}\n]\n");
  ASSERT_TRUE(spy.wait(20000));
  EXPECT_EQ(s.window.editor()->error_line(), 2);
  EXPECT_EQ(s.window.view()->tracks().at(0), before);
}

TEST(GuiStudio, ChromeTraceRoundTripOverlaysMeasuredLanes) {
  Studio s;
  const core::Timeline& tl = *s.window.run_a()->timeline;
  std::ostringstream out;
  core::write_chrome_trace(tl, out);
  auto measured = parse_chrome_trace(out.str(), "trace.json", "measured");
  ASSERT_EQ(measured->rows.size(), tl.devices.size());
  EXPECT_EQ(measured->span_count, tl.program->total_ops());
  // The writer keeps microseconds with 3 decimals: times round-trip to 1 ns.
  EXPECT_NEAR(measured->step_time_s, tl.step_time_s, 1e-9);
  const auto dir = std::filesystem::temp_directory_path() / "piper_test_gui";
  std::filesystem::create_directories(dir);
  const auto path = (dir / "trace.json").string();
  std::ofstream(path) << out.str();
  ASSERT_TRUE(s.window.overlay_trace(QString::fromStdString(path)));
  const auto& row0 = s.window.view()->tracks().at(0)->rows.at(0);
  int measured_lanes = 0;
  for (const Lane& l : row0.lanes) measured_lanes += l.measured;
  EXPECT_EQ(measured_lanes, static_cast<int>(tl.program->plan_for(0).streams.size()));
  EXPECT_THROW(parse_chrome_trace("{\"traceEvents\": 3}", "bad.json"), core::Error);
}

// A Chrome trace to overlay (piper-studio --overlay, File > Overlay) with a field of the wrong type
// said "[json.exception.type_error.302] type must be string, but is number" (no file, no event); a
// device or microbatch number past int said "stoi"; a pid past int wrapped onto device 0; a negative
// "dur" was drawn as 0, and times of 1e300 us as infinities: all with nothing named. Each is now one
// line naming the file, the event and its field (docs/reliability.md, thirteenth probe).
TEST(GuiChromeTrace, HostileEventFieldsNameTheEventAndField) {
  auto refused = [](const std::string& event, const std::string& fragment) {
    const std::string text = R"({"traceEvents": [)" + event + "]}";
    try {
      parse_chrome_trace(text, "t.json");
      ADD_FAILURE() << "accepted: " << event;
    } catch (const core::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("t.json: traceEvents[0]" + fragment), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      EXPECT_EQ(m.find("json.exception"), std::string::npos) << m;
    }
  };
  refused(R"({"ph": "X", "pid": 0, "tid": 0, "name": 5, "ts": 0, "dur": 5})", ".name: expected a string, got 5");
  refused(R"({"ph": "X", "pid": 0, "tid": 0, "name": "F", "ts": 0, "dur": "5"})", ".dur: expected a time in");
  refused(R"({"ph": "X", "pid": 0, "tid": 0, "name": "F", "ts": 0, "dur": -5})", ".dur: expected a time in [0, 1e+12]");
  refused(R"({"ph": "X", "pid": 0, "tid": 0, "name": "F", "ts": 1e300, "dur": 5})", ".ts: expected a time in");
  refused(R"({"ph": "X", "pid": 4294967296, "tid": 0, "name": "F", "ts": 0, "dur": 5})",
          ".pid: expected an integer in");
  refused(R"({"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "device 99999999999"}},
             {"ph": "X", "pid": 0, "tid": 0, "name": "F", "ts": 0, "dur": 5})",
          ".args.name: the number 99999999999 in 'device 99999999999' is out of range");
  // A microbatch number past int only labels the span: read as none, not "stoi".
  const auto track = parse_chrome_trace(
      R"({"traceEvents": [{"ph": "X", "pid": 0, "tid": 0, "name": "F mb99999999999 PP0", "ts": 0, "dur": 5},
                          {"ph": "X", "pid": 0, "tid": 0, "name": "F mb40000 PP0", "ts": 5, "dur": 5},
                          {"ph": "X", "pid": 0, "tid": 0, "name": "F mb3 PP0", "ts": 10, "dur": 5}]})",
      "t.json");
  ASSERT_EQ(track->rows.size(), 1u);
  const Lane& lane = track->rows.at(0).lanes.at(0);
  ASSERT_EQ(lane.size(), 3u);
  EXPECT_EQ(lane.microbatch[0], -1);
  EXPECT_EQ(lane.microbatch[1], -1);  // past int16: none, not wrapped to -25536
  EXPECT_EQ(lane.microbatch[2], 3);
  EXPECT_NEAR(track->step_time_s, 15e-6, 1e-12);
}

TEST(GuiStudio, CriticalPathIsAChainEndingAtTheStepTime) {
  Studio s;
  TimelineView* view = s.window.view();
  view->set_show_critical_path(true);
  const auto& path = view->critical_path();
  ASSERT_FALSE(path.empty());
  DependencyIndex index(s.window.run_a()->timeline);
  EXPECT_DOUBLE_EQ(index.span(path.back()).end_s, s.window.run_a()->timeline->step_time_s);
  for (std::size_t i = 1; i < path.size(); ++i)
    EXPECT_LE(index.span(path[i - 1]).end_s, index.span(path[i]).start_s + 1e-12);
}

TEST(GuiStudio, ExportsPngSvgAndChromeTrace) {
  Studio s;
  const auto dir = std::filesystem::temp_directory_path() / "piper_test_gui";
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(s.window.export_png(QString::fromStdString((dir / "v.png").string())));
  ASSERT_TRUE(s.window.export_svg(QString::fromStdString((dir / "v.svg").string())));
  ASSERT_TRUE(s.window.export_chrome_trace(QString::fromStdString((dir / "t.json").string())));
  QImage png((dir / "v.png").string().c_str());
  EXPECT_EQ(png.size(), s.window.view()->size());
  std::ifstream svg(dir / "v.svg");
  std::string text((std::istreambuf_iterator<char>(svg)), {});
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_GT(text.size(), 10000u);
  auto back = read_chrome_trace((dir / "t.json").string());
  EXPECT_EQ(back->span_count, s.window.run_a()->timeline->program->total_ops());
}

TEST(GuiStudio, ScreenshotModeWritesANonBlankImageOfTheRequestedSize) {
  const auto dir = std::filesystem::temp_directory_path() / "piper_test_gui";
  std::filesystem::create_directories(dir);
  const auto scenario = (dir / "scenario.json").string();
  std::ofstream(scenario) << small_scenario().to_json().dump();
  const auto png = (dir / "shot.png").string();
  std::filesystem::remove(png);
  const std::string cmd = std::string("QT_QPA_PLATFORM=offscreen '") + PIPER_STUDIO + "' --screenshot '" + png +
                          "' --size 1100x700 '" + scenario + "' > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  QImage image(png.c_str());
  ASSERT_FALSE(image.isNull());
  EXPECT_EQ(image.size(), QSize(1100, 700));
  std::set<QRgb> colours;
  std::int64_t non_white = 0;
  for (int y = 0; y < image.height(); y += 2)
    for (int x = 0; x < image.width(); x += 2) {
      const QRgb c = image.pixel(x, y);
      colours.insert(c);
      non_white += c != qRgb(255, 255, 255);
    }
  EXPECT_GT(colours.size(), 30u);  // the op colours, text, axes: not a flat fill
  EXPECT_GT(non_white, static_cast<std::int64_t>(image.width() * image.height() / 4 / 5));
  // A bad scenario file fails with one line and a non-zero status.
  std::ofstream(dir / "bad.json") << "{\"model\": 3}";
  const std::string bad = std::string("QT_QPA_PLATFORM=offscreen '") + PIPER_STUDIO + "' --screenshot '" + png + "' '" +
                          (dir / "bad.json").string() + "' > /dev/null 2>&1";
  EXPECT_NE(std::system(bad.c_str()), 0);
}

// Hostile screenshot paths and sizes (probe 5): shot.svg got PNG bytes (exit 0); a folder, or a
// size of 100000x100000 (a dozen Qt warnings), failed only after rendering, as "cannot write". Each is
// one line and exit 2 now, with nothing written.
TEST(GuiStudio, ScreenshotPathsAndSizesCheckedBeforeRendering) {
  const auto dir = std::filesystem::temp_directory_path() / ("piper_test_gui_paths_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "folder");
  const auto scenario = (dir / "scenario.json").string();
  std::ofstream(scenario) << small_scenario().to_json().dump();
  auto studio = [&](const std::string& args) {
    const std::string err = (dir / "err.txt").string();
    const std::string cmd = std::string("QT_QPA_PLATFORM=offscreen '") + PIPER_STUDIO + "' " + args + " '" + scenario +
                            "' > /dev/null 2> '" + err + "'";
    const int status = std::system(cmd.c_str());
    std::ifstream in(err);
    std::string line, errors;
    while (std::getline(in, line))
      if (line.rfind("piper-studio: ", 0) == 0) errors += line + "\n";
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1, errors);
  };
  const std::string shot = (dir / "shot.svg").string();
  auto [code, errors] = studio("--screenshot '" + shot + "'");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(errors, "piper-studio: error: --screenshot: writes a PNG image: name a .png file, got '" + shot + "'\n");
  EXPECT_FALSE(std::filesystem::exists(shot));
  std::tie(code, errors) = studio("--screenshot '" + (dir / "folder").string() + "'");
  EXPECT_EQ(code, 2);
  EXPECT_NE(errors.find("--screenshot: is a folder"), std::string::npos) << errors;
  std::tie(code, errors) = studio("--screenshot '" + (dir / "big.png").string() + "' --size 100000x100000");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(errors, "piper-studio: error: --size 100000x100000: at most 16384 pixels a side\n");
  EXPECT_FALSE(std::filesystem::exists(dir / "big.png"));
  // Fifteenth probe: a second scenario and a repeated option were dropped silently, an unknown option
  // exited 1 without "error:", and --size did not say its minimum.
  const std::string one = (dir / "one.png").string();
  std::tie(code, errors) = studio("'" + scenario + "' --screenshot '" + one + "'");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(errors, "piper-studio: error: one scenario at a time, got 2 (--compare FILE stacks a second)\n");
  std::tie(code, errors) = studio("--screenshot '" + one + "' --screenshot '" + one + "'");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(errors, "piper-studio: error: --screenshot given 2 times (once at most)\n");
  std::tie(code, errors) = studio("--bogus --screenshot '" + one + "'");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(errors, "piper-studio: error: Unknown option 'bogus'. (see piper-studio --help)\n");
  std::tie(code, errors) = studio("--screenshot '" + one + "' --size 100x100");
  EXPECT_EQ(code, 2);
  EXPECT_NE(errors.find("--size '100x100': expected WxH of at least 320x240"), std::string::npos) << errors;
  EXPECT_FALSE(std::filesystem::exists(one));
  // An upper-case .PNG is a PNG name.
  std::tie(code, errors) = studio("--screenshot '" + (dir / "shot.PNG").string() + "' --size 1100x700");
  EXPECT_EQ(code, 0) << errors;
  EXPECT_EQ(QImage(QString::fromStdString((dir / "shot.PNG").string())).size(), QSize(1100, 700));
  std::filesystem::remove_all(dir);
}

// A `piper tune` result opens as a table of candidates, best first; activating one compiles and
// simulates its scenario, whose report is the one the tune recorded (same program, same engine).
TEST(GuiStudio, TuneResultsListCandidatesAndOpenTheirTimelines) {
  app();
  search::TuneSpec spec;
  spec.model = "qwen3-9m";
  spec.devices = 4;
  spec.global_batch = 8;
  spec.micro_batch_sizes = {1};
  spec.zero_levels = {0, 1};
  spec.schedules = {"1f1b", "gpipe"};
  spec.tp_degrees = {1, 2};  // TP candidates open their timelines too
  spec.recompute_modes = {"none"};
  spec.top_k = 0;
  spec.placement_search = false;
  const std::string csv =
      (std::filesystem::temp_directory_path() / ("piper_test_gui_tune_" + std::to_string(::getpid()) + ".csv"))
          .string();
  std::filesystem::remove(csv);
  const search::TuneSummary summary = search::run_tune(spec, csv);
  ASSERT_FALSE(summary.ranked.empty());

  StudioWindow window;
  window.resize(1400, 900);
  window.show();
  ASSERT_TRUE(window.open_tune_results(QString::fromStdString(csv)));
  TuneBrowser* browser = window.tune_browser();
  ASSERT_NE(browser, nullptr);
  EXPECT_EQ(browser->table()->rowCount(), static_cast<int>(summary.candidates));
  // Best first: the table's first row is the search's winner.
  EXPECT_EQ(browser->rows().front().candidate, summary.ranked.front().candidate);
  for (std::size_t i = 1; i < summary.ranked.size(); ++i)
    EXPECT_LE(browser->rows()[i - 1].step_time_s, browser->rows()[i].step_time_s);

  QSignalSpy spy(&window, &StudioWindow::simulation_finished);
  const int pick = 1;  // not the first row, to see the row's own scenario open
  browser->table()->setCurrentCell(pick, 0);
  emit browser->table()->cellActivated(pick, 0);
  ASSERT_TRUE(spy.wait(30000));
  EXPECT_TRUE(spy.takeFirst().at(0).toBool()) << window.error_text().toStdString();
  ASSERT_TRUE(window.run_a().has_value());
  EXPECT_EQ(browser->table()->item(pick, 0)->text().toInt(), pick + 1) << "best first";
  const search::TuneRow& row = browser->rows()[pick];
  EXPECT_EQ(window.run_a()->report.step_time_s, row.step_time_s);
  EXPECT_EQ(window.run_a()->report.peak_memory_bytes, row.peak_memory_bytes);
  EXPECT_EQ(window.run_a()->report.devices, 4);

  // A file that is not a tune result is refused with one line naming it.
  const std::string bad = csv + ".bad.csv";
  { std::ofstream(bad) << "a,b\n1,2\n"; }
  EXPECT_FALSE(window.open_tune_results(QString::fromStdString(bad)));
  EXPECT_NE(window.error_text().toStdString().find("not a piper tune results file"), std::string::npos)
      << window.error_text().toStdString();
  // Without `piper tune`'s advice ("choose another -o": the studio has no -o), and a candidate's
  // scenario names the file and candidate in its errors (it read "scenario: field 'cluster'").
  EXPECT_EQ(window.error_text().indexOf("choose another -o"), -1) << window.error_text().toStdString();
  ASSERT_TRUE(window.open_tune_results(QString::fromStdString(csv)));
  EXPECT_EQ(browser->scenario_of(1).source, csv + ", candidate 2");
  std::filesystem::remove(csv);
  std::filesystem::remove(bad);
}
