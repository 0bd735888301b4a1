// Shared by the piper-studio tests (test_gui.cpp, test_gui_scale.cpp): the one QApplication of the
// test process (offscreen platform), the small scenario and the studio window that loads it.
#pragma once

#include <QApplication>

#include "piper/core/scenario.hpp"
#include "piper/gui/studio_window.hpp"

namespace gui_test {

using namespace piper;
using namespace piper::gui;

inline QApplication& app() {
  if (qEnvironmentVariableIsEmpty("QT_QPA_PLATFORM")) qputenv("QT_QPA_PLATFORM", "offscreen");
  static int argc = 1;
  static char name[] = "test_gui";
  static char* argv[] = {name, nullptr};
  // Never destroyed: a static QApplication would be torn down after Qt's own globals at exit.
  static QApplication* a = new QApplication(argc, argv);
  return *a;
}

// qwen3-9m, 1F1B over PP=4 with DP=2 and 4 microbatches: devices = PP * DP = 8.
inline core::Scenario small_scenario() {
  core::Scenario s;
  s.model = "qwen3-9m";
  s.strategy.pp = 4;
  s.strategy.dp = 2;
  s.strategy.microbatches = 4;
  s.strategy.schedule = "1f1b";
  s.engine = "analytic";
  return s;
}

struct AppFirst {
  AppFirst() { app(); }  // the QApplication must exist before any widget
};

struct Studio : AppFirst {
  StudioWindow window;
  Studio() {
    window.resize(1400, 900);
    window.show();
    window.load_scenario(small_scenario(), /*synchronous=*/true);
    QApplication::processEvents();
  }
};

}  // namespace gui_test
