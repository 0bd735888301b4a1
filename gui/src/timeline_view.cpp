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

QString format_duration(double s) {
  return format_time(s, s > 0 ? std::pow(10.0, std::floor(std::log10(s)) - 2) : 1e-9);
}

QString qbytes(double b) { return QString::fromStdString(gui::format_bytes(b)); }

// Colours of memory curves, one per visible row (cycled).
const QColor kCurveColours[] = {
    QColor(0x1F, 0x77, 0xB4), QColor(0xFF, 0x7F, 0x0E), QColor(0x2C, 0xA0, 0x2C), QColor(0x94, 0x67, 0xBD),
    QColor(0x8C, 0x56, 0x4B), QColor(0xE3, 0x77, 0xC2), QColor(0x7F, 0x7F, 0x7F), QColor(0xBC, 0xBD, 0x22),
    QColor(0x17, 0xBE, 0xCF), QColor(0x39, 0x3B, 0x79),
};
const QColor kTrackHue[] = {QColor(0x2F, 0x5D, 0x8A), QColor(0xC4, 0x6A, 0x10), QColor(0x55, 0x55, 0x55)};
constexpr int kRowLabelX = 6;

// "devices 0,8,16,…,248 (32)": a group's members, shortened.
QString members_text(const std::vector<int>& devices) {
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
  return track < static_cast<int>(tracks_.size())
             ? static_cast<int>(tracks_[static_cast<std::size_t>(track)]->rows.size())
             : 0;
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
  const bool same_shape = keep_view && groups_.size() == tracks_.size();
  if (!fold_mode_chosen_)
    fold_mode_ = !tracks_.empty() && tracks_[0]->timeline ? default_fold_mode(*tracks_[0]->timeline) : FoldMode::Off;
  std::vector<std::vector<DeviceGroup>> groups;
  for (const auto& t : tracks_)
    groups.push_back(t->timeline && fold_mode_ != FoldMode::Off ? fold_devices(*t->timeline, fold_mode_)
                                                                : std::vector<DeviceGroup>{});
  std::vector<std::vector<bool>> expanded;
  for (std::size_t t = 0; t < groups.size(); ++t) {
    const bool keep = same_shape && groups_[t].size() == groups[t].size() && expanded_[t].size() == groups[t].size();
    expanded.push_back(keep ? expanded_[t] : std::vector<bool>(groups[t].size(), false));
  }
  groups_ = std::move(groups);
  expanded_ = std::move(expanded);
  deps_index_.clear();
  for (const auto& t : tracks_)
    deps_index_.push_back(t->timeline ? std::make_unique<DependencyIndex>(t->timeline) : nullptr);
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
    for (std::size_t r = 0; r < track.rows.size(); ++r) {
      const int device = track.rows[r].device;
      if (device >= static_cast<int>(l.row_of_device.size()))
        l.row_of_device.resize(static_cast<std::size_t>(device) + 1, -1);
      l.row_of_device[static_cast<std::size_t>(device)] = static_cast<int>(r);
    }
    l.display_of_row.assign(track.rows.size(), -1);
    auto add_row = [&](int track_row, int group, bool folded, bool member) {
      const DeviceRow& row = track.rows[static_cast<std::size_t>(track_row)];
      const int h = std::max<int>(1, static_cast<int>(row.lanes.size())) * lane_step() + kDeviceGapPx;
      l.display_of_row[static_cast<std::size_t>(track_row)] = static_cast<int>(l.rows.size());
      l.rows.push_back({y, h, track_row, group, folded, member});
      y += h;
    };
    auto row_of = [&](int device) {
      return device < static_cast<int>(l.row_of_device.size()) ? l.row_of_device[static_cast<std::size_t>(device)] : -1;
    };
    static const std::vector<DeviceGroup> kNoGroups;
    const std::vector<DeviceGroup>& groups = t < groups_.size() ? groups_[t] : kNoGroups;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const DeviceGroup& group = groups[g];
      if (group.size() == 1 || expanded_[t][g]) {
        for (int d : group.devices)
          if (row_of(d) >= 0) add_row(row_of(d), static_cast<int>(g), false, group.size() > 1);
      } else if (row_of(group.representative()) >= 0) {
        add_row(row_of(group.representative()), static_cast<int>(g), true, false);
        const int shown = static_cast<int>(l.rows.size()) - 1;
        for (int d : group.devices)
          if (row_of(d) >= 0) l.display_of_row[static_cast<std::size_t>(row_of(d))] = shown;
      }
    }
    // Rows outside every group (no folding; devices only a measured trace has).
    for (std::size_t r = 0; r < track.rows.size(); ++r)
      if (l.display_of_row[r] < 0) add_row(static_cast<int>(r), -1, false, false);
    y += 6;
  }
  content_height_ = y;
}

void TimelineView::set_fold_mode(FoldMode mode) {
  fold_mode_ = mode;
  fold_mode_chosen_ = true;
  auto tracks = tracks_;
  groups_.clear();
  set_tracks(std::move(tracks), false);
}

void TimelineView::set_group_expanded(int track, int group, bool expanded) {
  auto& e = expanded_.at(static_cast<std::size_t>(track));
  if (group < 0 || group >= static_cast<int>(e.size()) || e[static_cast<std::size_t>(group)] == expanded) return;
  e[static_cast<std::size_t>(group)] = expanded;
  relayout();
  update_scrollbar();
  update();
}

bool TimelineView::group_expanded(int track, int group) const {
  const auto& e = expanded_.at(static_cast<std::size_t>(track));
  return group >= 0 && group < static_cast<int>(e.size()) && e[static_cast<std::size_t>(group)];
}

int TimelineView::visible_rows(int track) const {
  return track < static_cast<int>(layouts_.size())
             ? static_cast<int>(layouts_[static_cast<std::size_t>(track)].rows.size())
             : 0;
}

int TimelineView::visible_lanes(int track) const {
  int lanes = 0;
  if (track >= static_cast<int>(layouts_.size())) return 0;
  for (const RowLayout& r : layouts_[static_cast<std::size_t>(track)].rows)
    lanes += static_cast<int>(
        tracks_[static_cast<std::size_t>(track)]->rows[static_cast<std::size_t>(r.track_row)].lanes.size());
  return lanes;
}

int TimelineView::row_device(int track, int row) const {
  const RowLayout& r = layouts_.at(static_cast<std::size_t>(track)).rows.at(static_cast<std::size_t>(row));
  return tracks_[static_cast<std::size_t>(track)]->rows[static_cast<std::size_t>(r.track_row)].device;
}

int TimelineView::row_group(int track, int row) const {
  return layouts_.at(static_cast<std::size_t>(track)).rows.at(static_cast<std::size_t>(row)).group;
}

QString TimelineView::row_label(int track, int row) const {
  const RowLayout& r = layouts_.at(static_cast<std::size_t>(track)).rows.at(static_cast<std::size_t>(row));
  if (r.folded)
    return QString::fromStdString(groups_[static_cast<std::size_t>(track)][static_cast<std::size_t>(r.group)].label);
  return QString("dev %1").arg(row_device(track, row));
}

int TimelineView::lane_text_width() const { return plot_left() - kRowLabelX - 20; }

QString TimelineView::lane_text(int track, int row, int lane) const {
  const RowLayout& r = layouts_.at(static_cast<std::size_t>(track)).rows.at(static_cast<std::size_t>(row));
  const Lane& l = tracks_[static_cast<std::size_t>(track)]->rows[static_cast<std::size_t>(r.track_row)].lanes.at(
      static_cast<std::size_t>(lane));
  std::string name = l.name;
  if (l.measured && l.error.matched > 0) {
    name += ' ';
    name += format_signed_percent(l.error.total_error());
  }
  QFont f = font();
  f.setPointSizeF(8);
  const QFontMetrics fm(f);
  // Lane 0 shares its line with the row label.
  int width = lane_text_width();
  if (lane == 0) {
    QFont bold = f;
    bold.setBold(true);
    width -= QFontMetrics(bold).horizontalAdvance(QStringLiteral("▸ ") + row_label(track, row)) + 12;
  }
  const std::string key = name + '\x1f' + std::to_string(width);
  auto it = elide_cache_.find(key);
  if (it != elide_cache_.end()) return it->second;
  if (elide_cache_.size() > 4096) elide_cache_.clear();
  const QString text = QString::fromStdString(elide_middle(name, width, [&](std::string_view s) {
    return fm.horizontalAdvance(QString::fromUtf8(s.data(), static_cast<qsizetype>(s.size())));
  }));
  elide_cache_.emplace(key, text);
  return text;
}

std::optional<int> TimelineView::row_at_y(int track, int y) const {
  if (track >= static_cast<int>(layouts_.size()) || y < body_top() || y > body_bottom()) return std::nullopt;
  const int cy = y - body_top() + scroll_y_;
  const auto& rows = layouts_[static_cast<std::size_t>(track)].rows;
  auto it = std::upper_bound(rows.begin(), rows.end(), cy, [](int v, const RowLayout& r) { return v < r.y; });
  if (it == rows.begin()) return std::nullopt;
  --it;
  if (cy >= it->y + it->height) return std::nullopt;
  return static_cast<int>(it - rows.begin());
}

int TimelineView::row_top(int track, int row) const {
  return body_top() - scroll_y_ + layouts_.at(static_cast<std::size_t>(track)).rows.at(static_cast<std::size_t>(row)).y;
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

void TimelineView::resizeEvent(QResizeEvent*) { update_scrollbar(); }

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
  for (std::size_t t = 0; t < tracks_.size(); ++t) {
    rows += visible_rows(static_cast<int>(t));
    for (const RowLayout& r : layouts_[t].rows)
      lanes += std::max<int>(1, static_cast<int>(tracks_[t]->rows[static_cast<std::size_t>(r.track_row)].lanes.size()));
  }
  const int spare =
      body_bottom() - body_top() - static_cast<int>(tracks_.size()) * (kHeaderPx + 6) - rows * kDeviceGapPx;
  // 12 px by default; down to 9 px (lane names still drawn) when that fits every row without scrolling.
  const int fitting = lanes > 0 ? spare / lanes - 1 : 16;
  const int lane_height = lanes > 0 ? (fitting >= 9 ? std::min(fitting, 26) : 12) : 16;
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
  if (fm.horizontalAdvance(hint) < w - x - 16) {  // only when it does not crowd the legend
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
  auto first = std::upper_bound(layout.rows.begin(), layout.rows.end(), y0,
                                [](int y, const RowLayout& r) { return y < r.y + r.height; });
  const int ti = static_cast<int>(&layout - layouts_.data());
  for (auto it = first; it != layout.rows.end() && it->y < y1; ++it) {
    const std::size_t r = static_cast<std::size_t>(it - layout.rows.begin());
    const DeviceRow& row = track.rows[static_cast<std::size_t>(it->track_row)];
    const int ry = top + it->y;
    const int lanes_h = it->height - kDeviceGapPx;
    p.fillRect(0, ry, w, lanes_h,
               it->folded ? QColor(0xF1, 0xF5, 0xFB) : ((r % 2) ? QColor(0xF7, 0xF8, 0xFA) : QColor(0xFF, 0xFF, 0xFF)));
    // Row label: a folded group ("▸ stage 3 ×32", click to expand) or a device ("▾ dev 8" when it
    // belongs to an expanded group, click to fold).
    QFont row_font = gutter_font;
    row_font.setBold(it->folded);
    p.setFont(row_font);
    p.setPen(it->folded ? QColor(0x1F, 0x3A, 0x5F) : QColor(0x22, 0x22, 0x22));
    const QString marker = it->folded ? QStringLiteral("▸ ") : (it->expanded_member ? QStringLiteral("▾ ") : QString());
    p.drawText(QRect(kRowLabelX, ry, plot_left() - kRowLabelX - 4, std::max(lane_step(), 12)),
               Qt::AlignLeft | Qt::AlignVCenter, marker + row_label(ti, static_cast<int>(r)));
    for (std::size_t l = 0; l < row.lanes.size(); ++l) {
      const Lane& lane = row.lanes[l];
      const int ly = ry + static_cast<int>(l) * lane_step();
      if (lane_height_ >= 9) {
        p.setFont(gutter_font);
        p.setPen(lane.measured ? QColor(0x8A, 0x5A, 0x00) : QColor(0x77, 0x77, 0x77));
        p.drawText(QRect(kRowLabelX, ly, plot_left() - kRowLabelX - 4, lane_height_), Qt::AlignRight | Qt::AlignVCenter,
                   lane_text(ti, static_cast<int>(r), static_cast<int>(l)));
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
      if (run_x1 >= x0 && run_x1 >= 0)
        run_x1 = std::max(run_x1, x1);
      else {
        flush();
        run_x0 = x0;
        run_x1 = x1;
        run_kind = lane.kind[i];
      }
      const double next_t = t0 + (x0 + 1 - left) / pixels_per_s_;
      std::size_t j =
          static_cast<std::size_t>(std::lower_bound(lane.start_s.begin() + static_cast<std::ptrdiff_t>(i) + 1,
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
    if (wpx >= 5) p.fillRect(x1 - 1, y, 1, h, c.darker(135));  // separates back-to-back ops
    if (wpx >= 14 && h >= 9) {
      if (!font_set) {
        p.setFont(label_font);
        font_set = true;
      }
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
  const Lane& l = tracks_[static_cast<std::size_t>(track)]
                      ->rows.at(static_cast<std::size_t>(row))
                      .lanes.at(static_cast<std::size_t>(lane));
  const int display = layout.display_of_row.at(static_cast<std::size_t>(row));
  if (display < 0) return std::nullopt;
  const int y = body_top() - scroll_y_ + layout.rows.at(static_cast<std::size_t>(display)).y + lane * lane_step();
  const double x0 = x_at(l.start_s[pos]), x1 = std::max(x_at(l.end_s[pos]), x0 + 2);
  return QRectF(x0, y, x1 - x0, lane_height_);
}

std::optional<QRectF> TimelineView::op_rect(int track, const OpKey& key) const {
  const TrackLayout& layout = layouts_.at(static_cast<std::size_t>(track));
  if (key.device < 0 || key.device >= static_cast<int>(layout.row_of_device.size())) return std::nullopt;
  int row = layout.row_of_device[static_cast<std::size_t>(key.device)];
  if (row < 0) return std::nullopt;
  // A device folded into a group is drawn by its representative: the same op there (same plan).
  const int display = layout.display_of_row[static_cast<std::size_t>(row)];
  if (display < 0) return std::nullopt;
  row = layout.rows[static_cast<std::size_t>(display)].track_row;
  const DeviceRow& r = tracks_[static_cast<std::size_t>(track)]->rows[static_cast<std::size_t>(row)];
  if (key.stream < 0 || key.stream >= static_cast<int>(r.lane_of_stream.size())) return std::nullopt;
  const int lane = r.lane_of_stream[static_cast<std::size_t>(key.stream)];
  if (lane < 0) return std::nullopt;
  const auto& pos_of_op = r.lanes[static_cast<std::size_t>(lane)].pos_of_op;
  if (key.index < 0 || key.index >= static_cast<int>(pos_of_op.size())) return std::nullopt;
  const std::int32_t pos = pos_of_op[static_cast<std::size_t>(key.index)];
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
      if (!r) {
        flush();
        prev.reset();
        continue;
      }
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

QString TimelineView::describe_gutter(QPointF pos) const {
  if (pos.x() >= plot_left() || pos.y() < body_top() || pos.y() > body_bottom()) return {};
  for (std::size_t t = 0; t < tracks_.size(); ++t) {
    const auto row = row_at_y(static_cast<int>(t), static_cast<int>(pos.y()));
    if (!row) continue;
    const RowLayout& r = layouts_[t].rows[static_cast<std::size_t>(*row)];
    const DeviceRow& dr = tracks_[t]->rows[static_cast<std::size_t>(r.track_row)];
    QString html = QString("<b>%1</b>").arg(row_label(static_cast<int>(t), *row).toHtmlEscaped());
    if (r.group >= 0) {
      const DeviceGroup& g = groups_[t][static_cast<std::size_t>(r.group)];
      if (g.size() > 1) {
        html += "<br>" + members_text(g.devices);
        if (!g.stages.empty()) html += " · " + QString::fromStdString(stages_label(g.stages));
        html += QString("<br>%1 plan%2")
                    .arg(g.classes)
                    .arg(g.classes > 1 ? "s (symmetry classes)" : " (one symmetry class)");
        if (g.plan >= 0)
          html += g.spread_s > 0 ? QString(", start times differ by up to %1").arg(format_duration(g.spread_s))
                                 : QString(", identical timings");
        html += r.folded ? QString("<br>drawn: device %1 · click to expand").arg(g.representative())
                         : QString("<br>click to fold");
      }
    }
    const int lane = (static_cast<int>(pos.y()) - row_top(static_cast<int>(t), *row)) / lane_step();
    if (lane >= 0 && lane < static_cast<int>(dr.lanes.size())) {
      const Lane& l = dr.lanes[static_cast<std::size_t>(lane)];
      html += QString("<br>lane: %1").arg(QString::fromStdString(l.name).toHtmlEscaped());
      if (l.measured) {
        const LaneError& e = l.error;
        if (e.matched > 0)
          html += QString(
                      "<br>vs predicted: %1 of %2 ops matched; busy %3 measured vs %4 predicted (%5); mean |error| per "
                      "op %6")
                      .arg(e.matched)
                      .arg(e.matched + e.unmatched)
                      .arg(format_duration(e.measured_s), format_duration(e.predicted_s),
                           QString::fromStdString(format_signed_percent(e.total_error())),
                           QString::fromStdString(format_percent(e.mean_abs_error)));
        else
          html += "<br>no op matched a predicted one (no predicted lane of that stream, or other op names)";
      }
    }
    return html;
  }
  return {};
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
    const int row = it->track_row;
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
  if (key.valid() && deps_index_[static_cast<std::size_t>(hit.track)])
    selected_deps_ = deps_index_[static_cast<std::size_t>(hit.track)]->of(key);
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
    html = QString("<b>%1</b> (measured)<br>device %2 · %3")
               .arg(QString::fromStdString(ev.name).toHtmlEscaped())
               .arg(r.device)
               .arg(QString::fromStdString(ev.thread).toHtmlEscaped());
    // Error against the predicted op it matched (same stream, same label, same occurrence).
    const std::int32_t ppos = pos < l.predicted_pos.size() ? l.predicted_pos[pos] : -1;
    if (ppos >= 0 && l.predicted_lane >= 0) {
      const Lane& pl = r.lanes[static_cast<std::size_t>(l.predicted_lane)];
      const double pd = pl.end_s[static_cast<std::size_t>(ppos)] - pl.start_s[static_cast<std::size_t>(ppos)];
      html += QString("<br>predicted %1 · measured %2 · error %3")
                  .arg(format_duration(pd), format_duration(dur),
                       pd > 0 ? QString::fromStdString(format_signed_percent(dur / pd - 1)) : QString("n/a"));
      html += QString("<br>start: predicted %1, measured %2")
                  .arg(format_duration(pl.start_s[static_cast<std::size_t>(ppos)]), format_duration(start));
    } else {
      html += "<br>no predicted op of this name on this stream";
    }
    if (l.error.matched > 0)
      html += QString("<br>lane: busy %1 (%2 vs predicted), mean |error| per op %3")
                  .arg(format_duration(l.error.measured_s),
                       QString::fromStdString(format_signed_percent(l.error.total_error())),
                       QString::fromStdString(format_percent(l.error.mean_abs_error)));
  } else {
    const core::Op* op = t.op(hit.row, hit.lane, pos);
    html = QString("<b>%1</b><br>device %2 · stream %3 · op %4")
               .arg(QString::fromStdString(op->label).toHtmlEscaped())
               .arg(r.device)
               .arg(QString::fromStdString(l.name).toHtmlEscaped())
               .arg(l.op_index[pos]);
    html += QString("<br>DAG node %1 (%2)").arg(op->node).arg(span_kind_name(static_cast<SpanKind>(l.kind[pos])));
    QStringList tags;
    for (const auto& [k, v] : op->tags) tags << QString("%1=%2").arg(QString::fromStdString(k)).arg(v);
    if (!tags.isEmpty()) html += "<br>tags " + tags.join(", ");
    if (l.microbatch[pos] >= 0) html += QString("<br>microbatch %1").arg(l.microbatch[pos]);
    if (op->flops > 0) html += "<br>" + QString::fromStdString(format_flops(op->flops));
    if (op->recompute_flops > 0)
      html += QString(" (%1 recomputed)").arg(QString::fromStdString(format_flops(op->recompute_flops)));
    if (op->tp_collectives > 0)
      html += QString("<br>%1 TP collective%2 inside, %3")
                  .arg(op->tp_collectives)
                  .arg(op->tp_collectives > 1 ? "s" : "")
                  .arg(qbytes(static_cast<double>(op->tp_bytes)));
    if (op->bytes > 0) html += "<br>" + qbytes(static_cast<double>(op->bytes));
    if ((op->kind == core::OpKind::Send || op->kind == core::OpKind::Recv) && t.timeline)
      html += QString("<br>peer device %1").arg(t.timeline->program->peer_of(*op, r.device));
  }
  html += QString("<br>start %1 · duration %2").arg(format_duration(start)).arg(format_duration(dur));
  if (!l.measured) {
    // With a measured overlay: the measured span this op was matched with, and the error.
    for (const Lane& m : r.lanes) {
      if (!m.measured || m.predicted_lane != hit.lane) continue;
      auto it = std::find(m.predicted_pos.begin(), m.predicted_pos.end(), static_cast<std::int32_t>(pos));
      if (it == m.predicted_pos.end()) continue;
      const auto k = static_cast<std::size_t>(it - m.predicted_pos.begin());
      const double md = m.end_s[k] - m.start_s[k];
      html += QString("<br>measured %1 · error %2")
                  .arg(format_duration(md),
                       dur > 0 ? QString::fromStdString(format_signed_percent(md / dur - 1)) : QString("n/a"));
    }
  }
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
  if (e->button() == Qt::RightButton || (e->button() == Qt::LeftButton && (e->modifiers() & Qt::ShiftModifier)))
    drag_ = Drag::Box;
  else if (e->button() == Qt::LeftButton)
    drag_ = Drag::Pan;
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
    const double a = time_at(std::min(press_pos_.x(), e->position().x())),
                 b = time_at(std::max(press_pos_.x(), e->position().x()));
    set_time_range(a, b);
  } else if (was == Drag::Pan && drag_travel_px_ <= 3 && e->position().x() < plot_left()) {
    // A click on a row label expands a folded group, or folds the group of an expanded member.
    for (std::size_t t = 0; t < tracks_.size(); ++t) {
      const auto row = row_at_y(static_cast<int>(t), static_cast<int>(e->position().y()));
      if (!row) continue;
      const RowLayout& r = layouts_[t].rows[static_cast<std::size_t>(*row)];
      if (r.folded || r.expanded_member) set_group_expanded(static_cast<int>(t), r.group, r.folded);
      break;
    }
  } else if (was == Drag::Pan && drag_travel_px_ <= 3) {
    select(hit_at(e->position()));
  }
  update();
}

void TimelineView::mouseDoubleClickEvent(QMouseEvent*) { fit_to_window(); }

void TimelineView::keyPressEvent(QKeyEvent* e) {
  const double cx = (plot_left() + plot_right()) / 2.0;
  switch (e->key()) {
    case Qt::Key_F:
      fit_to_window();
      break;
    case Qt::Key_Plus:
    case Qt::Key_Equal:
      zoom_at(cx, 1.5);
      break;
    case Qt::Key_Minus:
      zoom_at(cx, 1 / 1.5);
      break;
    case Qt::Key_C:
      set_show_critical_path(!show_critical_);
      break;
    case Qt::Key_Escape:
      select(Hit{});
      break;
    default:
      QWidget::keyPressEvent(e);
  }
}

bool TimelineView::event(QEvent* e) {
  if (e->type() == QEvent::ToolTip) {
    auto* help = static_cast<QHelpEvent*>(e);
    QString text = describe_memory(help->pos());
    if (text.isEmpty()) text = describe_gutter(help->pos());
    if (text.isEmpty()) text = describe(hit_at(help->pos()));
    if (!text.isEmpty())
      QToolTip::showText(help->globalPos(), text, this);
    else
      QToolTip::hideText();
    return true;
  }
  return QWidget::event(e);
}

}  // namespace piper::gui
