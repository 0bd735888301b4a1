// Paint cost of the studio timeline on a million-op step: qwen3-9b, 1F1B, PP=8 x DP=128 (1,024
// devices), 64 microbatches, simulated by the analytic engine; frames painted offscreen into a QImage.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <QApplication>
#include <QImage>
#include <QPainter>

#include "piper/gui/session.hpp"
#include "piper/gui/timeline_view.hpp"

using namespace piper;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Median and max of `frames` paints of the view into an image of its size.
void measure(const char* what, piper::gui::TimelineView& view, int frames) {
  QImage image(view.size(), QImage::Format_ARGB32_Premultiplied);
  std::vector<double> ms;
  for (int i = 0; i < frames; ++i) {
    const auto t0 = Clock::now();
    QPainter p(&image);
    view.paint_view(p);
    p.end();
    ms.push_back(ms_since(t0));
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%-58s median %6.2f ms  max %6.2f ms  (%d frames %dx%d)\n", what, ms[ms.size() / 2], ms.back(), frames,
              view.width(), view.height());
}

}  // namespace

int main(int argc, char** argv) {
  if (qEnvironmentVariableIsEmpty("QT_QPA_PLATFORM")) qputenv("QT_QPA_PLATFORM", "offscreen");
  QApplication app(argc, argv);
  core::Scenario s;
  s.model = "qwen3-9b";
  s.strategy.pp = 8;
  s.strategy.dp = 128;
  s.strategy.microbatches = 64;
  s.strategy.schedule = "1f1b";
  s.engine = "analytic";
  auto t0 = Clock::now();
  gui::ScenarioRun run = gui::run_scenario(s);
  const double run_ms = ms_since(t0);
  std::printf("scenario: qwen3-9b 1f1b pp8 dp128 M64: %d devices, %lld ops, step %.3f s\n", run.report.devices,
              static_cast<long long>(run.track->span_count), run.report.step_time_s);
  std::printf("compile %.0f ms + simulate %.0f ms; compile+simulate+index %.0f ms\n", run.report.compile_time_s * 1e3,
              run.report.simulate_time_s * 1e3, run_ms);
  t0 = Clock::now();
  auto track = gui::make_track(run.timeline, "bench", 0);
  std::printf("view index (make_track) %.0f ms\n", ms_since(t0));

  gui::TimelineView view;
  view.resize(1920, 1080);
  view.set_fold_mode(gui::FoldMode::Off);  // one row per device: the worst case (1,024 rows), not 8 folded ones
  view.set_tracks({track});
  view.fit_to_window();
  measure("fit-to-window, lanes 16 px (default)", view, 30);
  view.set_lane_height(3);
  measure("fit-to-window, lanes 3 px (more rows on screen)", view, 30);
  view.set_lane_height(16);
  view.zoom_at(view.plot_left() + 800, 40);
  measure("zoomed 40x around the middle", view, 30);
  view.resize(1920, 8640);
  view.set_lane_height(3);
  view.fit_to_window();
  measure("fit-to-window, 3 px lanes, 8x taller frame (~480 devices)", view, 10);
  return 0;
}
