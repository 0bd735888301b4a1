// Colours, units and text helpers shared by the timeline view's sources (timeline_view.cpp: layout,
// folding, scrolling and zoom; timeline_view_paint.cpp: lanes, axis, legend, highlights;
// timeline_view_memory.cpp: the memory pane; timeline_view_interaction.cpp: hit-testing, selection,
// tooltips, mouse and keys). Private to piper_gui.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include <QColor>
#include <QString>
#include <QStringList>

#include "piper/gui/scale.hpp"
#include "piper/gui/timeline_data.hpp"

namespace piper::gui::timeline_detail {

inline const QColor kKindColours[kSpanKindCount] = {
    QColor(0x4E, 0x79, 0xA7),  // F
    QColor(0x59, 0xA1, 0x4F),  // B
    QColor(0x8C, 0xD1, 0x7D),  // BI
    QColor(0xB0, 0x7A, 0xA1),  // BW
    QColor(0x9C, 0x75, 0x5F),  // UPD
    QColor(0xF2, 0x8E, 0x2B),  // SEND
    QColor(0xFF, 0xBE, 0x7D),  // RECV
    QColor(0xE1, 0x57, 0x59),  // ALL_REDUCE
    QColor(0xFF, 0x9D, 0x9A),  // REDUCE_SCATTER
    QColor(0xD3, 0x72, 0x95),  // ALL_GATHER
    QColor(0xED, 0xC9, 0x48),  // ALL_TO_ALL
    QColor(0xBA, 0xB0, 0xAC),  // other
};
inline constexpr int kRowLabelX = 6;

// Time formatting with units: picks s, ms, us or ns so the number stays readable.
inline QString format_time(double t_s, double resolution_s) {
  struct Unit {
    double s;
    const char* name;
  };
  static const Unit units[] = {{1, "s"}, {1e-3, "ms"}, {1e-6, "µs"}, {1e-9, "ns"}};
  const Unit* u = &units[3];
  for (const Unit& cand : units)
    if (resolution_s >= cand.s * 0.999 || std::abs(t_s) >= cand.s * 10 * 0.999) {
      u = &cand;
      break;
    }
  const double step = resolution_s / u->s;
  const int decimals = step >= 1 ? 0 : std::min(6, static_cast<int>(std::ceil(-std::log10(step) - 1e-9)));
  return QString::number(t_s / u->s, 'f', decimals) + " " + QString::fromUtf8(u->name);
}

inline QString format_duration(double s) {
  return format_time(s, s > 0 ? std::pow(10.0, std::floor(std::log10(s)) - 2) : 1e-9);
}

inline QString qbytes(double b) { return QString::fromStdString(gui::format_bytes(b)); }

// "devices 0,8,16,…,248 (32)": a group's members, shortened.
inline QString members_text(const std::vector<int>& devices) {
  QStringList parts;
  for (std::size_t i = 0; i < devices.size(); ++i) {
    if (devices.size() > 8 && i == 4) {
      parts << "…" << QString::number(devices.back());
      break;
    }
    parts << QString::number(devices[i]);
  }
  return QString("devices %1 (%2)").arg(parts.join(",")).arg(devices.size());
}

inline double nice_step(double raw) {
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

}  // namespace piper::gui::timeline_detail
