// Painting and interaction of the timeline view. Painting is proportional to what is visible: rows by
// binary search over the row layout, spans by binary search over each lane, sub-pixel spans merged.
#include "piper/gui/timeline_view.hpp"

#include <algorithm>
#include <cmath>

#include <QHelpEvent>
#include <QKeyEvent>
#include <QMouseEvent>
#include <QPainter>
#include <QPainterPath>
#include <QRegularExpression>
#include <QToolTip>
#include <QWheelEvent>

namespace piper::gui {

namespace {

const QColor kKindColours[kSpanKindCount] = {
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
const QColor kIncoming(0xE6, 0x55, 0x0D), kOutgoing(0x6A, 0x3D, 0x9A), kPartner(0x00, 0x8B, 0x8B);
const QColor kCritical(0xD6, 0x27, 0x28);

bool dark(const QColor& c) { return 0.299 * c.red() + 0.587 * c.green() + 0.114 * c.blue() < 140; }

// Time formatting with units: picks s, ms, us or ns so the number stays readable.
QString format_time(double t_s, double resolution_s) {
  struct Unit { double s; const char* name; };
  static const Unit units[] = {{1, "s"}, {1e-3, "ms"}, {1e-6, "µs"}, {1e-9, "ns"}};
  const Unit* u = &units[3];
  for (const Unit& cand : units)
    if (resolution_s >= cand.s * 0.999 || std::abs(t_s) >= cand.s * 10 * 0.999) { u = &cand; break; }
  const double step = resolution_s / u->s;
  const int decimals = step >= 1 ? 0 : std::min(6, static_cast<int>(std::ceil(-std::log10(step) - 1e-9)));
  return QString::number(t_s / u->s, 'f', decimals) + " " + QString::fromUtf8(u->name);
}

QString format_duration(double s) { return format_time(s, s > 0 ? std::pow(10.0, std::floor(std::log10(s)) - 2) : 1e-9); }

QString format_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::abs(b) >= 1024 && u < 4) { b /= 1024; ++u; }
  return QString::number(b, 'f', u == 0 ? 0 : (b < 10 ? 2 : 1)) + " " + units[u];
}

double nice_step(double raw) {
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

}  // namespace

QColor kind_colour(SpanKind k) { return kKindColours[static_cast<int>(k)]; }

TimelineView::TimelineView(QWidget* parent) : QWidget(parent) {
  setMouseTracking(true);
  setFocusPolicy(Qt::StrongFocus);
  setMinimumSize(480, 320);
  setAttribute(Qt::WA_OpaquePaintEvent);
  scrollbar_ = new QScrollBar(Qt::Vertical, this);
  connect(scrollbar_, &QScrollBar::valueChanged, this, [this](int v) {
    scroll_y_ = v;
    update();
  });
}

int TimelineView::plot_right() const { return width() - kScrollbarPx - 4; }

int TimelineView::memory_height() const {
  for (const auto& t : tracks_)
    if (t->timeline && !t->timeline->devices.empty() && !t->timeline->devices[0].memory.empty())
      return std::min(kMemoryPx, height() / 4);
  return 0;
}

int TimelineView::device_rows(int track) const {
  return track < static_cast<int>(tracks_.size()) ? static_cast<int>(tracks_[static_cast<std::size_t>(track)]->rows.size()) : 0;
}

double TimelineView::total_time_s() const {
  double t = 0;
  for (const auto& tr : tracks_) t = std::max(t, tr->step_time_s);
  return t > 0 ? t : 1e-3;
}

void TimelineView::set_tracks(std::vector<std::shared_ptr<const Track>> tracks, bool keep_view) {
  tracks_ = std::move(tracks);
  kinds_present_.assign(kSpanKindCount, false);
  for (const auto& t : tracks_)
    for (const DeviceRow& r : t->rows)
      for (const Lane& l : r.lanes)
        for (std::uint8_t k : l.kind) kinds_present_[k] = true;
  deps_index_.clear();
  for (const auto& t : tracks_) deps_index_.push_back(t->timeline ? std::make_unique<DependencyIndex>(t->timeline) : nullptr);
  selection_ = Hit{};
  selected_deps_ = Dependencies{};
  critical_.clear();
  relayout();
  if (show_critical_) set_show_critical_path(true);
  if (!keep_view) {
    scroll_y_ = 0;
    fit_to_window();
  }
  update_scrollbar();
  update();
}

void TimelineView::relayout() {
  layouts_.assign(tracks_.size(), TrackLayout{});
  int y = 0;
  for (std::size_t t = 0; t < tracks_.size(); ++t) {
    TrackLayout& l = layouts_[t];
    l.header_y = y;
    y += kHeaderPx;
    const Track& track = *tracks_[t];
    for (const DeviceRow& row : track.rows) {
      const int h = std::max<int>(1, static_cast<int>(row.lanes.size())) * lane_step() + kDeviceGapPx;
      l.rows.push_back({y, h});
      y += h;
      if (row.device >= static_cast<int>(l.row_of_device.size())) l.row_of_device.resize(static_cast<std::size_t>(row.device) + 1, -1);
      l.row_of_device[static_cast<std::size_t>(row.device)] = static_cast<int>(l.rows.size()) - 1;
    }
    y += 6;
  }
  content_height_ = y;
}

void TimelineView::update_scrollbar() {
  const int visible = std::max(0, body_bottom() - body_top());
  scrollbar_->setGeometry(width() - kScrollbarPx, body_top(), kScrollbarPx, visible);
  scrollbar_->setRange(0, std::max(0, content_height_ - visible));
  scrollbar_->setPageStep(visible);
  scrollbar_->setSingleStep(lane_step() * 2);
  scroll_y_ = std::clamp(scroll_y_, 0, scrollbar_->maximum());
  scrollbar_->setValue(scroll_y_);
}

void TimelineView::resizeEvent(QResizeEvent*) {
  update_scrollbar();
}

void TimelineView::set_time_range(double t0_s, double t1_s) {
  if (!(t1_s > t0_s)) return;
  const double width_px = std::max(1, plot_right() - plot_left());
  pixels_per_s_ = std::clamp(width_px / (t1_s - t0_s), width_px / (total_time_s() * 4), 1e13);
  view_start_s_ = t0_s;
  update();
  emit view_changed();
}

void TimelineView::fit_to_window() {
  // Few devices: grow the lanes to use the height (labels get room); many: keep them compact.
  int lanes = 0, rows = 0;
  for (const auto& t : tracks_) {
    rows += static_cast<int>(t->rows.size());
    for (const DeviceRow& r : t->rows) lanes += std::max<int>(1, static_cast<int>(r.lanes.size()));
  }
  const int spare = body_bottom() - body_top() - static_cast<int>(tracks_.size()) * (kHeaderPx + 6) - rows * kDeviceGapPx;
  const int lane_height = lanes > 0 ? std::clamp(spare / lanes - 1, 12, 26) : 16;
  if (lane_height != lane_height_) set_lane_height(lane_height);
  const double total = total_time_s();
  const double margin = total * 0.01;
  set_time_range(-margin, total + margin);
}

void TimelineView::zoom_at(double x, double factor) {
  const double t = time_at(x);
  const double width_px = std::max(1, plot_right() - plot_left());
  pixels_per_s_ = std::clamp(pixels_per_s_ * factor, width_px / (total_time_s() * 4), 1e13);
  view_start_s_ = t - (x - plot_left()) / pixels_per_s_;
  update();
  emit view_changed();
}

void TimelineView::scroll_rows_to(int content_y) { scrollbar_->setValue(content_y); }

void TimelineView::set_lane_height(int px) {
  lane_height_ = std::clamp(px, 3, 48);
  relayout();
  update_scrollbar();
  update();
}

// ---- painting --------------------------------------------------------------------------------------

void TimelineView::paintEvent(QPaintEvent*) {
  QPainter p(this);
  paint_view(p);
}

void TimelineView::paint_view(QPainter& p) {
  const int w = width(), h = height();
  p.fillRect(0, 0, w, h, Qt::white);
  if (tracks_.empty()) {
    p.setPen(QColor(0x80, 0x80, 0x80));
    p.drawText(QRect(0, 0, w, h), Qt::AlignCenter, "Open a scenario (File ▸ Open) or pick a preset to simulate.");
    return;
  }
  // Vertical grid lines of the time axis under the lanes.
  const double step_s = nice_step(110.0 / pixels_per_s_);
  p.save();
  p.setClipRect(QRect(plot_left(), body_top(), plot_right() - plot_left(), h - body_top()));
  p.setPen(QColor(0xEE, 0xEE, 0xEE));
  for (double t = std::ceil(view_start_s_ / step_s) * step_s; t < view_end_s(); t += step_s) {
    const int x = static_cast<int>(std::lround(x_at(t)));
    p.drawLine(x, body_top(), x, body_bottom());
  }
  p.restore();

  p.save();
  p.setClipRect(QRect(0, body_top(), w - kScrollbarPx, body_bottom() - body_top()));
  for (std::size_t t = 0; t < tracks_.size(); ++t) paint_lanes(p, *tracks_[t], layouts_[t], w);
  paint_highlights(p);
  if (drag_ == Drag::Box) {
    const double x0 = std::min(press_pos_.x(), last_pos_.x()), x1 = std::max(press_pos_.x(), last_pos_.x());
    p.fillRect(QRectF(x0, body_top(), x1 - x0, body_bottom() - body_top()), QColor(0x33, 0x66, 0xCC, 40));
    p.setPen(QColor(0x33, 0x66, 0xCC));
    p.drawLine(QPointF(x0, body_top()), QPointF(x0, body_bottom()));
    p.drawLine(QPointF(x1, body_top()), QPointF(x1, body_bottom()));
  }
  p.restore();
  paint_legend(p, w);
  paint_axis(p, w);
  if (memory_height() > 0) paint_memory(p, w, h);
}

void TimelineView::paint_legend(QPainter& p, int w) {
  p.fillRect(0, 0, w, kLegendPx, QColor(0xFA, 0xFA, 0xFA));
  QFont f = font();
  f.setPointSizeF(8);
  p.setFont(f);
  QFontMetrics fm(f);
  int x = 8;
  for (int k = 0; k < kSpanKindCount; ++k) {
    if (!kinds_present_[static_cast<std::size_t>(k)]) continue;
    p.fillRect(x, 5, 11, 10, kKindColours[k]);
    x += 14;
    p.setPen(QColor(0x44, 0x44, 0x44));
    const QString name = span_kind_name(static_cast<SpanKind>(k));
    p.drawText(x, 14, name);
    x += fm.horizontalAdvance(name) + 12;
  }
  const QString hint = "wheel: zoom · drag: pan · shift+drag: box zoom · double-click: fit · click: dependencies";
  if (fm.horizontalAdvance(hint) < w - x - 16) {   // only when it does not crowd the legend
    p.setPen(QColor(0x88, 0x88, 0x88));
    p.drawText(QRect(x, 0, w - x - 8, kLegendPx), Qt::AlignRight | Qt::AlignVCenter, hint);
  }
}

void TimelineView::paint_axis(QPainter& p, int w) {
  const int top = kLegendPx;
  p.fillRect(0, top, w, kAxisPx, QColor(0xF3, 0xF3, 0xF3));
  p.setPen(QColor(0xC8, 0xC8, 0xC8));
  p.drawLine(0, top + kAxisPx - 1, w, top + kAxisPx - 1);
  QFont f = font();
  f.setPointSizeF(8);
  p.setFont(f);
  const double step_s = nice_step(110.0 / pixels_per_s_);
  p.save();
  p.setClipRect(QRect(plot_left(), top, plot_right() - plot_left() + 2, kAxisPx));
  for (double t = std::floor(view_start_s_ / step_s) * step_s; t < view_end_s() + step_s; t += step_s) {
    const double x = x_at(t);
    p.setPen(QColor(0x70, 0x70, 0x70));
    p.drawLine(QPointF(x, top + kAxisPx - 6), QPointF(x, top + kAxisPx - 1));
    p.setPen(QColor(0x30, 0x30, 0x30));
    p.drawText(QPointF(x + 3, top + 14), format_time(std::abs(t) < step_s * 1e-6 ? 0.0 : t, step_s));
  }
  p.restore();
  p.setPen(QColor(0x55, 0x55, 0x55));
  p.drawText(QRect(6, top, plot_left() - 10, kAxisPx), Qt::AlignVCenter | Qt::AlignLeft, "time →");
}

void TimelineView::paint_lanes(QPainter& p, const Track& track, const TrackLayout& layout, int w) {
  const int top = body_top() - scroll_y_;
  const int right = plot_right();
  QFont label_font = font();
  label_font.setPointSizeF(std::clamp(lane_height_ * 0.5, 6.0, 9.0));
  QFont gutter_font = font();
  gutter_font.setPointSizeF(8);
  // Track header.
  const int hy = top + layout.header_y;
  if (hy + kHeaderPx >= body_top() && hy <= body_bottom()) {
    p.fillRect(0, hy, w, kHeaderPx, QColor(0xE4, 0xEA, 0xF2));
    QFont hf = font();
    hf.setBold(true);
    hf.setPointSizeF(9);
    p.setFont(hf);
    p.setPen(QColor(0x22, 0x2A, 0x35));
    p.drawText(QRect(6, hy, w - 12, kHeaderPx), Qt::AlignVCenter | Qt::AlignLeft, QString::fromStdString(track.title));
  }
  // Visible rows: binary search on the (sorted) row offsets.
  const int y0 = body_top() - top, y1 = body_bottom() - top;
  auto first = std::upper_bound(layout.rows.begin(), layout.rows.end(), y0, [](int y, const RowLayout& r) { return y < r.y + r.height; });
  for (auto it = first; it != layout.rows.end() && it->y < y1; ++it) {
    const std::size_t r = static_cast<std::size_t>(it - layout.rows.begin());
    const DeviceRow& row = track.rows[r];
    const int ry = top + it->y;
    const int lanes_h = it->height - kDeviceGapPx;
    p.fillRect(0, ry, w, lanes_h, (r % 2) ? QColor(0xF7, 0xF8, 0xFA) : QColor(0xFF, 0xFF, 0xFF));
    p.setFont(gutter_font);
    p.setPen(QColor(0x22, 0x22, 0x22));
    p.drawText(QRect(6, ry, 60, std::max(lane_step(), 12)), Qt::AlignLeft | Qt::AlignVCenter, QString("dev %1").arg(row.device));
    for (std::size_t l = 0; l < row.lanes.size(); ++l) {
      const Lane& lane = row.lanes[l];
      const int ly = ry + static_cast<int>(l) * lane_step();
      if (lane_height_ >= 9) {
        p.setFont(gutter_font);
        p.setPen(lane.measured ? QColor(0x8A, 0x5A, 0x00) : QColor(0x77, 0x77, 0x77));
        p.drawText(QRect(64, ly, plot_left() - 68, lane_height_), Qt::AlignRight | Qt::AlignVCenter,
                   QString::fromStdString(lane.name));
      }
      paint_lane(p, lane, ly, lane_height_, right, label_font);
    }
    p.fillRect(0, ry + lanes_h + kDeviceGapPx / 2, w, 1, QColor(0xE2, 0xE2, 0xE2));
  }
}

// One lane: spans intersecting the view, pixel-snapped; runs of sub-pixel spans are merged into one
// rectangle and skipped over by binary search, so a lane costs O(min(spans, pixels)) to paint.
void TimelineView::paint_lane(QPainter& p, const Lane& lane, int y, int h, int right, const QFont& label_font) {
  const double t0 = view_start_s_, t1 = view_end_s();
  auto [i, last] = lane.visible(t0, t1);
  const int left = plot_left();
  int run_x0 = 0, run_x1 = -1;
  std::uint8_t run_kind = 0;
  auto flush = [&] {
    if (run_x1 > run_x0) p.fillRect(run_x0, y, run_x1 - run_x0, h, kKindColours[run_kind]);
    run_x1 = -1;
  };
  auto px = [&](double t) { return std::clamp(left + (t - t0) * pixels_per_s_, double(left - 2), double(right + 2)); };
  bool font_set = false;
  const QColor measured_edge(0x40, 0x30, 0x10);
  while (i < last) {
    const double fx0 = px(lane.start_s[i]), fx1 = px(lane.end_s[i]);
    const int x0 = static_cast<int>(std::floor(fx0));
    int x1 = static_cast<int>(std::floor(fx1));
    if (fx1 - fx0 < 2.0) {
      // Sub-pixel (or nearly): merge into the current run; jump past every span starting in this pixel.
      x1 = std::max(x0 + 1, x1 + 1);
      if (run_x1 >= x0 && run_x1 >= 0) run_x1 = std::max(run_x1, x1);
      else { flush(); run_x0 = x0; run_x1 = x1; run_kind = lane.kind[i]; }
      const double next_t = t0 + (x0 + 1 - left) / pixels_per_s_;
      std::size_t j = static_cast<std::size_t>(std::lower_bound(lane.start_s.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                                                                lane.start_s.begin() + static_cast<std::ptrdiff_t>(last), next_t) -
                                               lane.start_s.begin());
      if (j > i + 1) run_x1 = std::max(run_x1, static_cast<int>(std::floor(px(lane.max_end_s[j - 1]))) + 1);
      i = std::max(j, i + 1);
      continue;
    }
    flush();
    const QColor c = kKindColours[lane.kind[i]];
    const int wpx = x1 - x0;
    if (lane.measured) {
      p.fillRect(x0, y + 2, wpx, h - 2, c.lighter(125));
      p.fillRect(x0, y, wpx, 2, measured_edge);
    } else {
      p.fillRect(x0, y, wpx, h, c);
    }
    if (wpx >= 5) p.fillRect(x1 - 1, y, 1, h, c.darker(135));   // separates back-to-back ops
    if (wpx >= 14 && h >= 9) {
      if (!font_set) { p.setFont(label_font); font_set = true; }
      const CachedLabel& text = label(lane.kind[i], lane.microbatch[i], label_font);
      if (text.width + 4 <= wpx) {
        p.setPen(dark(c) ? Qt::white : QColor(0x1A, 0x1A, 0x1A));
        const int cx0 = std::max(x0, left), cx1 = std::min(x1, right);
        const int tx = cx1 - cx0 >= text.width + 4 ? (cx0 + cx1 - text.width) / 2 : x0 + (wpx - text.width) / 2;
        p.drawStaticText(tx, y + (h - static_cast<int>(text.text.size().height())) / 2, text.text);
      }
    }
    ++i;
  }
  flush();
}

const TimelineView::CachedLabel& TimelineView::label(std::uint8_t kind, int microbatch, const QFont& font) {
  if (font.pointSizeF() != label_cache_point_size_) {
    label_cache_.clear();
    label_cache_point_size_ = font.pointSizeF();
  }
  const int key = kind * 65536 + (microbatch + 1);
  auto it = label_cache_.find(key);
  if (it == label_cache_.end()) {
    CachedLabel c;
    const QString s = QString::fromStdString(span_label(static_cast<SpanKind>(kind), microbatch));
    c.text.setText(s);
    c.text.setTextFormat(Qt::PlainText);
    c.text.prepare(QTransform(), font);
    c.width = QFontMetrics(font).horizontalAdvance(s);
    it = label_cache_.emplace(key, std::move(c)).first;
  }
  return it->second;
}

std::optional<QRectF> TimelineView::span_rect(int track, int row, int lane, std::size_t pos) const {
  const TrackLayout& layout = layouts_.at(static_cast<std::size_t>(track));
  const Lane& l = tracks_[static_cast<std::size_t>(track)]->rows.at(static_cast<std::size_t>(row)).lanes.at(static_cast<std::size_t>(lane));
  const int y = body_top() - scroll_y_ + layout.rows.at(static_cast<std::size_t>(row)).y + lane * lane_step();
  const double x0 = x_at(l.start_s[pos]), x1 = std::max(x_at(l.end_s[pos]), x0 + 2);
  return QRectF(x0, y, x1 - x0, lane_height_);
}

std::optional<QRectF> TimelineView::op_rect(int track, const OpKey& key) const {
  const TrackLayout& layout = layouts_.at(static_cast<std::size_t>(track));
  if (key.device < 0 || key.device >= static_cast<int>(layout.row_of_device.size())) return std::nullopt;
  const int row = layout.row_of_device[static_cast<std::size_t>(key.device)];
  if (row < 0) return std::nullopt;
  const DeviceRow& r = tracks_[static_cast<std::size_t>(track)]->rows[static_cast<std::size_t>(row)];
  if (key.stream < 0 || key.stream >= static_cast<int>(r.lane_of_stream.size())) return std::nullopt;
  const int lane = r.lane_of_stream[static_cast<std::size_t>(key.stream)];
  if (lane < 0) return std::nullopt;
  const std::int32_t pos = r.lanes[static_cast<std::size_t>(lane)].pos_of_op.at(static_cast<std::size_t>(key.index));
  if (pos < 0) return std::nullopt;
  return span_rect(track, row, lane, static_cast<std::size_t>(pos));
}

std::optional<QPointF> TimelineView::op_centre(int track, const OpKey& key) const {
  auto r = op_rect(track, key);
  if (!r) return std::nullopt;
  return r->center();
}

void TimelineView::paint_highlights(QPainter& p) {
  p.setRenderHint(QPainter::Antialiasing, true);
  p.setBrush(Qt::NoBrush);
  if (show_critical_ && !critical_.empty()) {
    // One outline per run of path ops on the same lane; connectors only for hops between lanes
    // (waits, transfers, other devices).
    const QRectF visible(plot_left(), body_top(), plot_right() - plot_left(), body_bottom() - body_top());
    std::optional<QRectF> run, prev;
    auto flush = [&] {
      if (run && run->intersects(visible)) {
        p.setPen(QPen(kCritical, 2));
        p.drawRect(run->adjusted(-1, -1, 1, 1));
      }
      run.reset();
    };
    for (const OpKey& k : critical_) {
      auto r = op_rect(0, k);
      if (!r) { flush(); prev.reset(); continue; }
      if (prev && std::abs(prev->center().y() - r->center().y()) > 1) {
        flush();
        p.setPen(QPen(QColor(kCritical.red(), kCritical.green(), kCritical.blue(), 190), 1.3));
        p.drawLine(QPointF(prev->right(), prev->center().y()), QPointF(r->left(), r->center().y()));
      }
      run = run ? run->united(*r) : *r;
      prev = r;
    }
    flush();
  }
  if (selection_.valid() && selection_.track >= 0) {
    auto sel = span_rect(selection_.track, selection_.row, selection_.lane, static_cast<std::size_t>(selection_.pos));
    auto draw_group = [&](const std::vector<OpKey>& keys, const QColor& c) {
      QPen pen(c, 2);
      p.setPen(pen);
      for (const OpKey& k : keys) {
        auto r = op_rect(selection_.track, k);
        if (!r) continue;
        p.drawRect(r->adjusted(-1, -1, 1, 1));
        if (sel) {
          QPen line(c, 1.2, Qt::DashLine);
          p.setPen(line);
          p.drawLine(sel->center(), r->center());
          p.setPen(pen);
        }
      }
    };
    draw_group(selected_deps_.incoming, kIncoming);
    draw_group(selected_deps_.outgoing, kOutgoing);
    draw_group(selected_deps_.partners, kPartner);
    if (sel) {
      p.setPen(QPen(Qt::black, 2.5));
      p.drawRect(sel->adjusted(-2, -2, 2, 2));
    }
  }
  p.setRenderHint(QPainter::Antialiasing, false);
}

void TimelineView::paint_memory(QPainter& p, int w, int h) {
  const int mh = memory_height();
  const int top = h - mh;
  p.fillRect(0, top, w, mh, QColor(0xFB, 0xFB, 0xFB));
  p.setPen(QColor(0xC0, 0xC0, 0xC0));
  p.drawLine(0, top, w, top);
  const int plot_top = top + 18, plot_bottom = h - 8;
  // Scale: the largest peak, and the HBM line when it is in the same range (else noted off scale).
  double peak = 1;
  std::int64_t hbm = 0;
  for (const auto& t : tracks_) {
    hbm = std::max(hbm, t->hbm_bytes);
    if (t->timeline)
      for (const auto& d : t->timeline->devices) peak = std::max(peak, static_cast<double>(d.peak_memory_bytes));
  }
  const bool hbm_on_scale = hbm > 0 && peak > 0.25 * static_cast<double>(hbm);
  const double y_max = hbm_on_scale ? std::max(peak, static_cast<double>(hbm)) * 1.08 : peak * 1.15;
  auto y_of = [&](double bytes) { return plot_bottom - (plot_bottom - plot_top) * bytes / y_max; };
  QFont f = font();
  f.setPointSizeF(8);
  p.setFont(f);
  p.setPen(QColor(0x22, 0x22, 0x22));
  p.drawText(QRect(6, top + 2, plot_left() - 10, 16), Qt::AlignLeft | Qt::AlignVCenter, "memory / device");
  if (tracks_.size() > 1) {
    // Which curve is which scenario.
    const char* names[] = {"A", "B", "C"};
    const QColor hues[] = {QColor(0x2F, 0x5D, 0x8A), QColor(0xC4, 0x6A, 0x10), QColor(0x55, 0x55, 0x55)};
    int x = plot_left() + 6;
    for (std::size_t t = 0; t < std::min<std::size_t>(tracks_.size(), 3); ++t) {
      p.fillRect(x, top + 9, 14, 3, hues[t]);
      p.setPen(QColor(0x22, 0x22, 0x22));
      p.drawText(QPointF(x + 18, top + 14), names[t]);
      x += 40;
    }
  }
  // Y ticks.
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double step = y_max >= gib ? nice_step(y_max / gib / 4) * gib : nice_step(y_max / 4);
  p.setPen(QColor(0x66, 0x66, 0x66));
  for (double b = 0; b <= y_max; b += step) {
    const double y = y_of(b);
    p.setPen(QColor(0xE6, 0xE6, 0xE6));
    p.drawLine(QPointF(plot_left(), y), QPointF(plot_right(), y));
    p.setPen(QColor(0x66, 0x66, 0x66));
    QString label = format_bytes(b);
    label.replace(QRegularExpression("\\.0+ "), " ");
    p.drawText(QRectF(6, y - 8, plot_left() - 12, 16), Qt::AlignRight | Qt::AlignVCenter, label);
  }
  p.save();
  p.setClipRect(QRect(plot_left(), top + 1, plot_right() - plot_left(), mh - 1));
  const double t0 = view_start_s_;
  // Curves of the devices whose rows are on screen (at most 64 per track), one hue per track.
  const QColor track_hue[] = {QColor(0x2F, 0x5D, 0x8A), QColor(0xC4, 0x6A, 0x10), QColor(0x55, 0x55, 0x55)};
  const int selected_device = selection_.valid() ? tracks_[static_cast<std::size_t>(selection_.track)]->rows[static_cast<std::size_t>(selection_.row)].device : -1;
  std::int64_t peak_marker_bytes = -1;
  QPointF peak_marker;
  int peak_marker_device = -1;
  for (std::size_t ti = 0; ti < tracks_.size(); ++ti) {
    const Track& track = *tracks_[ti];
    if (!track.timeline) continue;
    const TrackLayout& layout = layouts_[ti];
    const int ctop = body_top() - scroll_y_;
    std::vector<int> devices;
    for (std::size_t r = 0; r < layout.rows.size() && devices.size() < 64; ++r) {
      const int ry = ctop + layout.rows[r].y;
      if (ry + layout.rows[r].height >= body_top() && ry <= body_bottom()) devices.push_back(track.rows[r].device);
    }
    if (devices.empty() && !track.rows.empty()) devices.push_back(track.rows.front().device);
    if (selected_device >= 0 && static_cast<int>(ti) == selection_.track) {
      std::erase(devices, selected_device);
      devices.push_back(selected_device);   // drawn last, on top
    }
    for (int d : devices) {
      if (d >= static_cast<int>(track.timeline->devices.size())) continue;
      const auto& mem = track.timeline->devices[static_cast<std::size_t>(d)].memory;
      if (mem.empty()) continue;
      const bool oom = track.hbm_bytes > 0 && track.timeline->devices[static_cast<std::size_t>(d)].peak_memory_bytes > track.hbm_bytes;
      const bool highlighted = d == selected_device && static_cast<int>(ti) == selection_.track;
      QColor c = oom ? QColor(0xD0, 0x20, 0x20) : track_hue[std::min<std::size_t>(ti, 2)];
      if (!highlighted && selected_device >= 0) c.setAlpha(90);
      p.setPen(QPen(c, highlighted ? 2.0 : 1.0));
      // Step function decimated per pixel column: entry value, column min/max, exit value.
      auto it = std::upper_bound(mem.begin(), mem.end(), t0, [](double t, const core::MemorySample& m) { return t < m.time_s; });
      if (it != mem.begin()) --it;
      QPolygon line;
      double value = static_cast<double>(it->bytes);
      int column = static_cast<int>(std::floor(std::max(x_at(it->time_s), double(plot_left() - 1))));
      auto yi = [&](double v) { return static_cast<int>(std::lround(y_of(v))); };
      line << QPoint(column, yi(value));
      for (++it; it != mem.end(); ++it) {
        const double x = x_at(it->time_s);
        if (x > plot_right() + 1) break;
        const int c2 = static_cast<int>(std::floor(x));
        const int y_before = yi(value);
        value = static_cast<double>(it->bytes);
        const int y_after = yi(value);
        if (y_after == y_before) continue;   // changes below a pixel draw nothing
        if (c2 != column) {
          line << QPoint(c2, y_before);
          column = c2;
        }
        line << QPoint(c2, y_after);
      }
      line << QPoint(plot_right() + 1, yi(value));
      p.drawPolyline(line);
      const auto& dt = track.timeline->devices[static_cast<std::size_t>(d)];
      if (dt.peak_memory_bytes > peak_marker_bytes) {
        peak_marker_bytes = dt.peak_memory_bytes;
        peak_marker = QPointF(x_at(dt.peak_memory_time_s), y_of(static_cast<double>(dt.peak_memory_bytes)));
        peak_marker_device = d;
      }
    }
  }
  if (peak_marker_device >= 0) {
    p.setRenderHint(QPainter::Antialiasing, true);
    p.setBrush(QColor(0x22, 0x22, 0x22));
    p.setPen(Qt::NoPen);
    p.drawEllipse(peak_marker, 3, 3);
    p.setRenderHint(QPainter::Antialiasing, false);
    p.setPen(QColor(0x22, 0x22, 0x22));
    const QString text = QString("peak %1 (dev %2)").arg(format_bytes(static_cast<double>(peak_marker_bytes))).arg(peak_marker_device);
    const double tx = std::min(peak_marker.x() + 6, plot_right() - 150.0);
    p.drawText(QPointF(tx, std::max(peak_marker.y() - 5, double(plot_top) + 2)), text);
  }
  if (hbm > 0) {
    p.setPen(QPen(QColor(0xD0, 0x20, 0x20), 1.2, Qt::DashLine));
    const double y = hbm_on_scale ? y_of(static_cast<double>(hbm)) : plot_top - 4;
    if (hbm_on_scale) {
      p.drawLine(QPointF(plot_left(), y), QPointF(plot_right(), y));
      if (peak > static_cast<double>(hbm))
        p.fillRect(QRectF(plot_left(), plot_top - 10, plot_right() - plot_left(), y - plot_top + 10), QColor(0xD0, 0x20, 0x20, 28));
    }
  }
  p.restore();
  if (hbm > 0) {
    p.setPen(QColor(0xD0, 0x20, 0x20));
    const QString text = hbm_on_scale ? QString("HBM limit %1").arg(format_bytes(static_cast<double>(hbm)))
                                      : QString("HBM limit %1 (above scale)").arg(format_bytes(static_cast<double>(hbm)));
    const double y = hbm_on_scale ? y_of(static_cast<double>(hbm)) - 16 : top + 2;
    p.drawText(QRectF(plot_right() - 320, y, 316, 16), Qt::AlignRight | Qt::AlignVCenter,
               text + (peak > static_cast<double>(hbm) ? "  — OUT OF MEMORY" : ""));
  }
}

// ---- interaction -----------------------------------------------------------------------------------

TimelineView::Hit TimelineView::hit_at(QPointF pos) const {
  Hit hit;
  if (pos.x() < plot_left() || pos.x() > plot_right() || pos.y() < body_top() || pos.y() > body_bottom()) return hit;
  const int cy = static_cast<int>(pos.y()) - body_top() + scroll_y_;
  for (std::size_t t = 0; t < tracks_.size(); ++t) {
    const auto& rows = layouts_[t].rows;
    auto it = std::upper_bound(rows.begin(), rows.end(), cy, [](int y, const RowLayout& r) { return y < r.y; });
    if (it == rows.begin()) continue;
    --it;
    if (cy >= it->y + it->height - kDeviceGapPx) continue;
    const int row = static_cast<int>(it - rows.begin());
    const int lane = (cy - it->y) / lane_step();
    const DeviceRow& r = tracks_[t]->rows[static_cast<std::size_t>(row)];
    if (lane >= static_cast<int>(r.lanes.size()) || (cy - it->y) % lane_step() >= lane_height_) continue;
    const double tolerance_s = 3.0 / pixels_per_s_;
    const std::int64_t pos_in_lane = r.lanes[static_cast<std::size_t>(lane)].hit(time_at(pos.x()), tolerance_s);
    if (pos_in_lane < 0) continue;
    return Hit{static_cast<int>(t), row, lane, pos_in_lane};
  }
  return hit;
}

OpKey TimelineView::selected_op() const {
  if (!selection_.valid()) return {};
  const Track& t = *tracks_[static_cast<std::size_t>(selection_.track)];
  const DeviceRow& r = t.rows[static_cast<std::size_t>(selection_.row)];
  const Lane& l = r.lanes[static_cast<std::size_t>(selection_.lane)];
  if (l.measured) return {};
  return OpKey{r.device, l.stream, l.op_index[static_cast<std::size_t>(selection_.pos)]};
}

void TimelineView::select(const Hit& hit) {
  selection_ = hit;
  selected_deps_ = Dependencies{};
  const OpKey key = selected_op();
  if (key.valid() && deps_index_[static_cast<std::size_t>(hit.track)]) selected_deps_ = deps_index_[static_cast<std::size_t>(hit.track)]->of(key);
  update();
  emit selection_changed(hit.valid() ? describe(hit) : QString());
}

void TimelineView::set_show_critical_path(bool on) {
  show_critical_ = on;
  critical_.clear();
  if (on && !deps_index_.empty() && deps_index_[0]) critical_ = deps_index_[0]->critical_path();
  update();
}

QString TimelineView::describe(const Hit& hit) const {
  if (!hit.valid()) return {};
  const Track& t = *tracks_[static_cast<std::size_t>(hit.track)];
  const DeviceRow& r = t.rows[static_cast<std::size_t>(hit.row)];
  const Lane& l = r.lanes[static_cast<std::size_t>(hit.lane)];
  const auto pos = static_cast<std::size_t>(hit.pos);
  const double start = l.start_s[pos], dur = l.end_s[pos] - l.start_s[pos];
  QString html;
  if (l.measured) {
    const MeasuredEvent& ev = t.measured.at(static_cast<std::size_t>(l.op_index[pos]));
    html = QString("<b>%1</b> (measured)<br>device %2 · %3").arg(QString::fromStdString(ev.name).toHtmlEscaped()).arg(r.device).arg(QString::fromStdString(ev.thread).toHtmlEscaped());
  } else {
    const core::Op* op = t.op(hit.row, hit.lane, pos);
    html = QString("<b>%1</b><br>device %2 · stream %3 · op %4").arg(QString::fromStdString(op->label).toHtmlEscaped()).arg(r.device).arg(QString::fromStdString(l.name).toHtmlEscaped()).arg(l.op_index[pos]);
    html += QString("<br>DAG node %1 (%2)").arg(op->node).arg(span_kind_name(static_cast<SpanKind>(l.kind[pos])));
    QStringList tags;
    for (const auto& [k, v] : op->tags) tags << QString("%1=%2").arg(QString::fromStdString(k)).arg(v);
    if (!tags.isEmpty()) html += "<br>tags " + tags.join(", ");
    if (l.microbatch[pos] >= 0) html += QString("<br>microbatch %1").arg(l.microbatch[pos]);
    if (op->flops > 0) html += QString("<br>%1 GFLOP").arg(op->flops / 1e9, 0, 'f', 2);
    if (op->recompute_flops > 0) html += QString(" (%1 recomputed)").arg(op->recompute_flops / 1e9, 0, 'f', 2);
    if (op->tp_collectives > 0)
      html += QString("<br>%1 TP collective%2 inside, %3").arg(op->tp_collectives).arg(op->tp_collectives > 1 ? "s" : "").arg(format_bytes(static_cast<double>(op->tp_bytes)));
    if (op->bytes > 0) html += "<br>" + format_bytes(static_cast<double>(op->bytes));
    if ((op->kind == core::OpKind::Send || op->kind == core::OpKind::Recv) && t.timeline)
      html += QString("<br>peer device %1").arg(t.timeline->program->peer_of(*op, r.device));
  }
  html += QString("<br>start %1 · duration %2").arg(format_duration(start)).arg(format_duration(dur));
  return html;
}

void TimelineView::wheelEvent(QWheelEvent* e) {
  const double steps = e->angleDelta().y() / 120.0;
  if (e->modifiers() & Qt::ControlModifier) {
    set_lane_height(lane_height_ + static_cast<int>(std::round(steps * 2)));
  } else if (e->modifiers() & Qt::ShiftModifier) {
    scroll_rows_to(scroll_y_ - static_cast<int>(steps * lane_step() * 6));
  } else {
    zoom_at(e->position().x(), std::pow(1.25, steps));
  }
  e->accept();
}

void TimelineView::mousePressEvent(QMouseEvent* e) {
  press_pos_ = last_pos_ = e->position();
  drag_travel_px_ = 0;
  if (e->button() == Qt::RightButton || (e->button() == Qt::LeftButton && (e->modifiers() & Qt::ShiftModifier))) drag_ = Drag::Box;
  else if (e->button() == Qt::LeftButton) drag_ = Drag::Pan;
}

void TimelineView::mouseMoveEvent(QMouseEvent* e) {
  const QPointF d = e->position() - last_pos_;
  drag_travel_px_ += std::abs(d.x()) + std::abs(d.y());
  last_pos_ = e->position();
  if (drag_ == Drag::Pan && drag_travel_px_ > 3) {
    view_start_s_ -= d.x() / pixels_per_s_;
    scroll_rows_to(scroll_y_ - static_cast<int>(d.y()));
    update();
    emit view_changed();
  } else if (drag_ == Drag::Box) {
    update();
  }
}

void TimelineView::mouseReleaseEvent(QMouseEvent* e) {
  const Drag was = drag_;
  drag_ = Drag::None;
  if (was == Drag::Box && std::abs(e->position().x() - press_pos_.x()) > 4) {
    const double a = time_at(std::min(press_pos_.x(), e->position().x())), b = time_at(std::max(press_pos_.x(), e->position().x()));
    set_time_range(a, b);
  } else if (was == Drag::Pan && drag_travel_px_ <= 3) {
    select(hit_at(e->position()));
  }
  update();
}

void TimelineView::mouseDoubleClickEvent(QMouseEvent*) { fit_to_window(); }

void TimelineView::keyPressEvent(QKeyEvent* e) {
  const double cx = (plot_left() + plot_right()) / 2.0;
  switch (e->key()) {
    case Qt::Key_F: fit_to_window(); break;
    case Qt::Key_Plus: case Qt::Key_Equal: zoom_at(cx, 1.5); break;
    case Qt::Key_Minus: zoom_at(cx, 1 / 1.5); break;
    case Qt::Key_C: set_show_critical_path(!show_critical_); break;
    case Qt::Key_Escape: select(Hit{}); break;
    default: QWidget::keyPressEvent(e);
  }
}

bool TimelineView::event(QEvent* e) {
  if (e->type() == QEvent::ToolTip) {
    auto* help = static_cast<QHelpEvent*>(e);
    const Hit hit = hit_at(help->pos());
    if (hit.valid()) QToolTip::showText(help->globalPos(), describe(hit), this);
    else QToolTip::hideText();
    return true;
  }
  return QWidget::event(e);
}

}  // namespace piper::gui
