// Interaction with the timeline view: hit-testing, selection with the op's cross-device
// dependencies, the critical path switch, tooltips (ops and gutter), wheel zoom, drag to pan, box
// zoom, double-click fit and keys.
#include "piper/gui/timeline_view.hpp"

#include <algorithm>
#include <cmath>

#include <QHelpEvent>
#include <QKeyEvent>
#include <QMouseEvent>
#include <QToolTip>
#include <QWheelEvent>

#include "timeline_view_detail.hpp"

namespace piper::gui {

namespace {

using timeline_detail::format_duration;
using timeline_detail::members_text;
using timeline_detail::qbytes;

}  // namespace

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
