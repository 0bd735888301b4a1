// Painting of the timeline view: legend, time axis, lanes and their span labels, and the highlights
// of a selection and of the critical path. Painting is proportional to what is visible: rows by
// binary search over the row layout, spans by binary search over each lane, sub-pixel spans merged.
#include "piper/gui/timeline_view.hpp"

#include <algorithm>
#include <cmath>

#include <QPainter>

#include "timeline_view_detail.hpp"

namespace piper::gui {

namespace {

using timeline_detail::format_time;
using timeline_detail::kKindColours;
using timeline_detail::kRowLabelX;
using timeline_detail::nice_step;

const QColor kIncoming(0xE6, 0x55, 0x0D), kOutgoing(0x6A, 0x3D, 0x9A), kPartner(0x00, 0x8B, 0x8B);
const QColor kCritical(0xD6, 0x27, 0x28);

bool dark(const QColor& c) { return 0.299 * c.red() + 0.587 * c.green() + 0.114 * c.blue() < 140; }

}  // namespace

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

}  // namespace piper::gui
