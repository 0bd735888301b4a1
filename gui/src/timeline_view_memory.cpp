// The timeline view's memory pane: in-use bytes per visible row on the view's time axis, decimated
// per pixel column, with its scale, ticks, legend and tooltip.
#include "piper/gui/timeline_view.hpp"

#include <algorithm>
#include <cmath>

#include <QPainter>

#include "timeline_view_detail.hpp"

namespace piper::gui {

namespace {

using timeline_detail::format_duration;
using timeline_detail::members_text;
using timeline_detail::nice_step;
using timeline_detail::qbytes;

// Colours of memory curves, one per visible row (cycled).
const QColor kCurveColours[] = {
    QColor(0x1F, 0x77, 0xB4), QColor(0xFF, 0x7F, 0x0E), QColor(0x2C, 0xA0, 0x2C), QColor(0x94, 0x67, 0xBD),
    QColor(0x8C, 0x56, 0x4B), QColor(0xE3, 0x77, 0xC2), QColor(0x7F, 0x7F, 0x7F), QColor(0xBC, 0xBD, 0x22),
    QColor(0x17, 0xBE, 0xCF), QColor(0x39, 0x3B, 0x79),
};
const QColor kTrackHue[] = {QColor(0x2F, 0x5D, 0x8A), QColor(0xC4, 0x6A, 0x10), QColor(0x55, 0x55, 0x55)};

}  // namespace

TimelineView::MemoryScale TimelineView::memory_scale() const {
  MemoryScale m;
  const int mh = memory_height();
  m.top = height() - mh;
  m.plot_top = m.top + 22;
  m.plot_bottom = height() - 8;
  // Scale: the largest peak, and the HBM line when it is in the same range (else noted off scale).
  for (const auto& t : tracks_) {
    m.hbm = std::max(m.hbm, t->hbm_bytes);
    if (t->timeline)
      for (const auto& d : t->timeline->devices) m.peak = std::max(m.peak, static_cast<double>(d.peak_memory_bytes));
  }
  m.hbm_on_scale = m.hbm > 0 && m.peak > 0.25 * static_cast<double>(m.hbm);
  m.y_max = m.hbm_on_scale ? std::max(m.peak, static_cast<double>(m.hbm)) * 1.08 : m.peak * 1.15;
  return m;
}

std::vector<TimelineView::MemoryCurve> TimelineView::memory_curves() const {
  std::vector<MemoryCurve> curves;
  const int selected_device =
      selection_.valid()
          ? tracks_[static_cast<std::size_t>(selection_.track)]->rows[static_cast<std::size_t>(selection_.row)].device
          : -1;
  for (std::size_t ti = 0; ti < tracks_.size(); ++ti) {
    const Track& track = *tracks_[ti];
    if (!track.timeline) continue;
    const TrackLayout& layout = layouts_[ti];
    const int ctop = body_top() - scroll_y_;
    std::vector<int> rows;
    for (std::size_t r = 0; r < layout.rows.size() && rows.size() < 64; ++r) {
      const int ry = ctop + layout.rows[r].y;
      if (ry + layout.rows[r].height >= body_top() && ry <= body_bottom()) rows.push_back(static_cast<int>(r));
    }
    if (rows.empty() && !layout.rows.empty()) rows.push_back(0);
    std::vector<MemoryCurve> mine;
    for (std::size_t k = 0; k < rows.size(); ++k) {
      MemoryCurve c;
      c.track = static_cast<int>(ti);
      c.row = rows[k];
      c.device = row_device(c.track, c.row);
      if (c.device >= static_cast<int>(track.timeline->devices.size()) ||
          track.timeline->devices[static_cast<std::size_t>(c.device)].memory.empty())
        continue;
      // One colour per row with a single scenario; one hue per scenario when comparing.
      c.colour =
          tracks_.size() == 1 ? kCurveColours[k % std::size(kCurveColours)] : kTrackHue[std::min<std::size_t>(ti, 2)];
      c.label = (tracks_.size() > 1 ? QString(ti == 0 ? "A " : "B ") : QString()) + row_label(c.track, c.row);
      mine.push_back(c);
    }
    if (selected_device >= 0 && static_cast<int>(ti) == selection_.track) {  // drawn last, on top
      auto it = std::find_if(mine.begin(), mine.end(), [&](const MemoryCurve& c) {
        return layout.rows[static_cast<std::size_t>(c.row)].track_row == selection_.row;
      });
      if (it != mine.end()) std::rotate(it, it + 1, mine.end());
    }
    curves.insert(curves.end(), mine.begin(), mine.end());
  }
  return curves;
}

// Legend: which curve is which row (device or folded group): a column in the gutter, left of the
// axis labels, then the header line up to the HBM note; what does not fit is counted.
void TimelineView::paint_memory_legend(QPainter& p, const std::vector<MemoryCurve>& curves, const MemoryScale& m, int h,
                                       const QFontMetrics& fm) const {
  const int top = m.top;
  const std::int64_t hbm = m.hbm;
  const bool hbm_on_scale = m.hbm_on_scale;
  std::vector<MemoryCurve> entries = curves;
  if (tracks_.size() > 1) {
    // Comparing: one hue per scenario, so one entry per scenario.
    entries.clear();
    for (const MemoryCurve& c : curves)
      if (entries.empty() || entries.back().track != c.track) {
        MemoryCurve e = c;
        e.label = QString(c.track == 0 ? "A" : "B");
        entries.push_back(e);
      }
  }
  std::size_t shown = 0;
  const int column_width = plot_left() - 64 - 24;  // the axis labels take the gutter's right 60 px
  for (int y = top + 20; shown < entries.size() && y + 12 <= h - 2; y += 12, ++shown) {
    const MemoryCurve& c = entries[shown];
    p.fillRect(6, y + 5, 14, 3, c.colour);
    p.setPen(QColor(0x22, 0x22, 0x22));
    p.drawText(QPointF(24, y + 10), fm.elidedText(c.label, Qt::ElideMiddle, column_width));
  }
  int x = plot_left() + 6;
  int limit = plot_right() - 8;
  if (hbm > 0 && !hbm_on_scale)  // the HBM note sits on the header line
    limit -= fm.horizontalAdvance(
                 QString("HBM limit %1 (above scale)  — OUT OF MEMORY").arg(qbytes(static_cast<double>(hbm)))) +
             8;
  for (; shown < entries.size(); ++shown) {
    const MemoryCurve& c = entries[shown];
    const int need = 18 + fm.horizontalAdvance(c.label) + 12;
    if (x + need > limit - 60) break;
    p.fillRect(x, top + 8, 14, 3, c.colour);
    p.setPen(QColor(0x22, 0x22, 0x22));
    p.drawText(QPointF(x + 18, top + 13), c.label);
    x += need;
  }
  if (shown < entries.size()) {
    p.setPen(QColor(0x77, 0x77, 0x77));
    p.drawText(QPointF(x, top + 13), QString("+%1 more").arg(entries.size() - shown));
  }
}

// Y ticks in the unit of the scale (B, KiB, MiB, GiB, TiB), so small models read in MiB.
void TimelineView::paint_memory_ticks(QPainter& p, const MemoryScale& m) const {
  const double y_max = m.y_max;
  double unit = 1;
  const char* unit_names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (y_max / unit >= 1024 && u < 4) {
    unit *= 1024;
    ++u;
  }
  const double step = nice_step(y_max / unit / 4) * unit;
  for (double b = 0; b <= y_max; b += step) {
    const double y = memory_y(m, b);
    p.setPen(QColor(0xE6, 0xE6, 0xE6));
    p.drawLine(QPointF(plot_left(), y), QPointF(plot_right(), y));
    p.setPen(QColor(0x66, 0x66, 0x66));
    const QString label = QString::number(b / unit, 'g', 4) + " " + unit_names[u];
    p.drawText(QRectF(6, y - 8, plot_left() - 12, 16), Qt::AlignRight | Qt::AlignVCenter, label);
  }
}

// A device's memory step function from the view's start to the plot's right edge, decimated per
// pixel column: entry value, column min/max, exit value.
QPolygon TimelineView::memory_polyline(const core::DeviceTimeline& dt, const MemoryScale& m) const {
  const auto& mem = dt.memory;
  auto it = std::upper_bound(mem.begin(), mem.end(), view_start_s_,
                             [](double t, const core::MemorySample& s) { return t < s.time_s; });
  if (it != mem.begin()) --it;
  QPolygon line;
  double value = static_cast<double>(it->bytes);
  int column = static_cast<int>(std::floor(std::max(x_at(it->time_s), double(plot_left() - 1))));
  auto yi = [&](double v) { return static_cast<int>(std::lround(memory_y(m, v))); };
  line << QPoint(column, yi(value));
  for (++it; it != mem.end(); ++it) {
    const double x = x_at(it->time_s);
    if (x > plot_right() + 1) break;
    const int c2 = static_cast<int>(std::floor(x));
    const int y_before = yi(value);
    value = static_cast<double>(it->bytes);
    const int y_after = yi(value);
    if (y_after == y_before) continue;  // changes below a pixel draw nothing
    if (c2 != column) {
      line << QPoint(c2, y_before);
      column = c2;
    }
    line << QPoint(c2, y_after);
  }
  line << QPoint(plot_right() + 1, yi(value));
  return line;
}

void TimelineView::paint_memory(QPainter& p, int w, int h) {
  const MemoryScale m = memory_scale();
  const int mh = memory_height();
  const int top = m.top;
  p.fillRect(0, top, w, mh, QColor(0xFB, 0xFB, 0xFB));
  p.setPen(QColor(0xC0, 0xC0, 0xC0));
  p.drawLine(0, top, w, top);
  const int plot_top = m.plot_top;
  const double peak = m.peak;
  const std::int64_t hbm = m.hbm;
  const bool hbm_on_scale = m.hbm_on_scale;
  auto y_of = [&](double bytes) { return memory_y(m, bytes); };
  QFont f = font();
  f.setPointSizeF(8);
  p.setFont(f);
  const QFontMetrics fm(f);
  p.setPen(QColor(0x22, 0x22, 0x22));
  p.drawText(QRect(6, top + 2, plot_left() - 10, 16), Qt::AlignLeft | Qt::AlignVCenter,
             tracks_.size() > 1 ? "memory (A, B)" : "memory per row (hover: by kind)");
  const std::vector<MemoryCurve> curves = memory_curves();
  paint_memory_legend(p, curves, m, h, fm);
  paint_memory_ticks(p, m);
  p.save();
  p.setClipRect(QRect(plot_left(), plot_top - 6, plot_right() - plot_left(), h - plot_top + 6));
  const int selected_device =
      selection_.valid()
          ? tracks_[static_cast<std::size_t>(selection_.track)]->rows[static_cast<std::size_t>(selection_.row)].device
          : -1;
  std::int64_t peak_marker_bytes = -1;
  QPointF peak_marker;
  QString peak_marker_label;
  for (const MemoryCurve& curve : curves) {
    const Track& track = *tracks_[static_cast<std::size_t>(curve.track)];
    const int d = curve.device;
    const auto& dt = track.timeline->devices[static_cast<std::size_t>(d)];
    const bool oom = track.hbm_bytes > 0 && dt.peak_memory_bytes > track.hbm_bytes;
    const bool highlighted = d == selected_device && curve.track == selection_.track;
    QColor c = oom ? QColor(0xD0, 0x20, 0x20) : curve.colour;
    if (!highlighted && selected_device >= 0) c.setAlpha(90);
    p.setPen(QPen(c, highlighted ? 2.0 : 1.2));
    p.drawPolyline(memory_polyline(dt, m));
    if (dt.peak_memory_bytes > peak_marker_bytes) {
      peak_marker_bytes = dt.peak_memory_bytes;
      peak_marker = QPointF(x_at(dt.peak_memory_time_s), y_of(static_cast<double>(dt.peak_memory_bytes)));
      peak_marker_label = row_label(curve.track, curve.row);
    }
  }
  if (peak_marker_bytes >= 0) {
    p.setRenderHint(QPainter::Antialiasing, true);
    p.setBrush(QColor(0x22, 0x22, 0x22));
    p.setPen(Qt::NoPen);
    p.drawEllipse(peak_marker, 3, 3);
    p.setRenderHint(QPainter::Antialiasing, false);
    p.setPen(QColor(0x22, 0x22, 0x22));
    const QString text = QString("peak %1 (%2)").arg(qbytes(static_cast<double>(peak_marker_bytes)), peak_marker_label);
    const double tx = std::min(peak_marker.x() + 6, plot_right() - fm.horizontalAdvance(text) - 4.0);
    p.drawText(QPointF(tx, std::max(peak_marker.y() - 5, double(plot_top) + 2)), text);
  }
  if (hbm > 0) {
    p.setPen(QPen(QColor(0xD0, 0x20, 0x20), 1.2, Qt::DashLine));
    const double y = hbm_on_scale ? y_of(static_cast<double>(hbm)) : plot_top - 4;
    if (hbm_on_scale) {
      p.drawLine(QPointF(plot_left(), y), QPointF(plot_right(), y));
      if (peak > static_cast<double>(hbm))
        p.fillRect(QRectF(plot_left(), plot_top - 10, plot_right() - plot_left(), y - plot_top + 10),
                   QColor(0xD0, 0x20, 0x20, 28));
    }
  }
  p.restore();
  if (hbm > 0) {
    p.setPen(QColor(0xD0, 0x20, 0x20));
    const QString text = hbm_on_scale ? QString("HBM limit %1").arg(qbytes(static_cast<double>(hbm)))
                                      : QString("HBM limit %1 (above scale)").arg(qbytes(static_cast<double>(hbm)));
    const double y = hbm_on_scale ? y_of(static_cast<double>(hbm)) - 16 : top + 2;
    p.drawText(QRectF(plot_right() - 320, y, 316, 16), Qt::AlignRight | Qt::AlignVCenter,
               text + (peak > static_cast<double>(hbm) ? "  — OUT OF MEMORY" : ""));
  }
}

QString TimelineView::describe_memory(QPointF pos) const {
  if (memory_height() == 0 || pos.y() < memory_pane_top() || pos.x() < plot_left() || pos.x() > plot_right()) return {};
  const MemoryScale m = memory_scale();
  const double t = time_at(pos.x());
  const MemoryCurve* best = nullptr;
  double best_distance = 1e300;
  std::int64_t best_bytes = 0;
  const std::vector<MemoryCurve> curves = memory_curves();
  for (const MemoryCurve& c : curves) {
    const auto& mem =
        tracks_[static_cast<std::size_t>(c.track)]->timeline->devices[static_cast<std::size_t>(c.device)].memory.get();
    auto it =
        std::upper_bound(mem.begin(), mem.end(), t, [](double v, const core::MemorySample& s) { return v < s.time_s; });
    const std::int64_t bytes = it == mem.begin() ? 0 : std::prev(it)->bytes;
    const double d = std::abs(memory_y(m, static_cast<double>(bytes)) - pos.y());
    if (d < best_distance) {
      best_distance = d;
      best = &c;
      best_bytes = bytes;
    }
  }
  if (!best) return {};
  const Track& track = *tracks_[static_cast<std::size_t>(best->track)];
  const auto& dt = track.timeline->devices[static_cast<std::size_t>(best->device)];
  QString html = QString("<b>%1</b>").arg(best->label.toHtmlEscaped());
  const RowLayout& row = layouts_[static_cast<std::size_t>(best->track)].rows[static_cast<std::size_t>(best->row)];
  if (row.folded) {
    const DeviceGroup& g = groups_[static_cast<std::size_t>(best->track)][static_cast<std::size_t>(row.group)];
    html += QString("<br>curve of device %1, for %2").arg(best->device).arg(members_text(g.devices));
  }
  html += QString("<br>in use at %1: %2").arg(format_duration(t), qbytes(static_cast<double>(best_bytes)));
  html += QString("<br>peak %1 at %2")
              .arg(qbytes(static_cast<double>(dt.peak_memory_bytes)), format_duration(dt.peak_memory_time_s));
  if (static_cast<std::size_t>(best->device) < track.peak_bytes_by_kind.size()) {
    const std::string breakdown = memory_breakdown(track.peak_bytes_by_kind[static_cast<std::size_t>(best->device)]);
    if (!breakdown.empty()) html += "<br>peak by kind: " + QString::fromStdString(breakdown).toHtmlEscaped();
  }
  if (track.hbm_bytes > 0)
    html += QString("<br>HBM %1 (%2 used at peak)")
                .arg(qbytes(static_cast<double>(track.hbm_bytes)),
                     QString::fromStdString(format_percent(static_cast<double>(dt.peak_memory_bytes) /
                                                           static_cast<double>(track.hbm_bytes))));
  return html;
}

}  // namespace piper::gui
