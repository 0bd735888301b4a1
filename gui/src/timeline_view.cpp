// The timeline view's tracks and layout: rows and lanes per device, folding of device groups, the
// scrollbar, the time range and zoom. Painting is in timeline_view_paint.cpp, the memory pane in
// timeline_view_memory.cpp, hit-testing, selection, tooltips and input in timeline_view_interaction.cpp.
#include "piper/gui/timeline_view.hpp"

#include <algorithm>
#include <cmath>

#include <QFontMetrics>

#include "timeline_view_detail.hpp"

namespace piper::gui {

namespace {

using timeline_detail::kKindColours;
using timeline_detail::kRowLabelX;

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

}  // namespace piper::gui
