// The timeline widget: device rows with per-stream lanes, a time axis, a memory pane on the same axis;
// wheel zoom around the cursor, drag to pan, box zoom, fit; hover tooltips, click-to-select with the
// op's cross-device dependencies highlighted, and the critical path on demand.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include <QPolygon>
#include <QScrollBar>
#include <QStaticText>
#include <unordered_map>
#include <QWidget>

#include "piper/gui/dependencies.hpp"
#include "piper/gui/scale.hpp"
#include "piper/gui/timeline_data.hpp"

namespace piper::gui {

QColor kind_colour(SpanKind k);

class TimelineView : public QWidget {
  Q_OBJECT

 public:
  explicit TimelineView(QWidget* parent = nullptr);

  // Tracks are stacked top to bottom on one time axis (one for a scenario, two for compare).
  // keep_view: keep the zoom and scroll (re-simulation after an edit), else fit to the window.
  void set_tracks(std::vector<std::shared_ptr<const Track>> tracks, bool keep_view = false);
  const std::vector<std::shared_ptr<const Track>>& tracks() const { return tracks_; }
  int device_rows(int track = 0) const;

  // Folding (scale.hpp): a folded group is one row drawing its representative (lowest) device.
  // Clicking a group's gutter expands it into one row per device; clicking an expanded member's
  // gutter folds it back. set_tracks picks default_fold_mode unless a mode was chosen (set_fold_mode).
  void set_fold_mode(FoldMode mode);
  FoldMode fold_mode() const { return fold_mode_; }
  const std::vector<DeviceGroup>& groups(int track = 0) const { return groups_.at(static_cast<std::size_t>(track)); }
  void set_group_expanded(int track, int group, bool expanded);
  bool group_expanded(int track, int group) const;
  int visible_rows(int track = 0) const;                  // rows drawn (folded groups count one)
  int visible_lanes(int track = 0) const;                 // lanes over those rows
  int row_device(int track, int row) const;               // device drawn on a row (a group's representative)
  int row_group(int track, int row) const;                // group index of a row (-1: unfolded track)
  QString row_label(int track, int row) const;            // "dev 5", "stage 3 ×32", ...
  QString lane_text(int track, int row, int lane) const;  // the lane name as drawn (elided in the middle)
  int lane_text_width() const;                            // pixels a lane name may take in the gutter
  int content_height() const { return content_height_; }
  int rows_viewport_height() const { return std::max(0, body_bottom() - body_top()); }
  std::optional<int> row_at_y(int track, int y) const;  // display row under widget y (body only)
  int row_top(int track, int row) const;                // widget y of a row's first lane
  // Memory pane: the curves drawn (one per visible row, at most 64 per track) with their colour and
  // legend label; the tooltip of the curve nearest to `p` (in-use bytes there, peak and its breakdown
  // by kind), empty when `p` is not in the memory pane.
  struct MemoryCurve {
    int track = 0, row = 0, device = 0;
    QColor colour;
    QString label;
  };
  std::vector<MemoryCurve> memory_curves() const;
  QString describe_memory(QPointF p) const;
  QString describe_gutter(QPointF p) const;  // tooltip of a row label or lane name

  // Time axis: x = plot_left + (t - view_start) * pixels_per_second.
  double x_at(double t_s) const { return plot_left() + (t_s - view_start_s_) * pixels_per_s_; }
  double time_at(double x) const { return view_start_s_ + (x - plot_left()) / pixels_per_s_; }
  double view_start_s() const { return view_start_s_; }
  double view_end_s() const { return time_at(plot_right()); }
  double pixels_per_s() const { return pixels_per_s_; }
  void set_time_range(double t0_s, double t1_s);
  void fit_to_window();
  void zoom_at(double x, double factor);  // factor > 1 zooms in; the time under x stays under x
  void scroll_rows_to(int content_y);
  void set_lane_height(int px);
  int plot_left() const { return kGutterPx; }
  int plot_right() const;

  struct Hit {
    int track = -1, row = -1, lane = -1;
    std::int64_t pos = -1;
    bool valid() const { return pos >= 0; }
  };
  Hit hit_at(QPointF p) const;
  // Selects the op at `hit` (an invalid hit clears the selection) and highlights its dependencies.
  void select(const Hit& hit);
  const Hit& selection() const { return selection_; }
  OpKey selected_op() const;
  const Dependencies& selected_dependencies() const { return selected_deps_; }
  void set_show_critical_path(bool on);
  bool show_critical_path() const { return show_critical_; }
  const std::vector<OpKey>& critical_path() const { return critical_; }
  QString describe(const Hit& hit) const;  // tooltip text (HTML)
  // Centre of a predicted op on screen, if its row is visible (tests, overlays).
  std::optional<QPointF> op_centre(int track, const OpKey& key) const;

  // Paints the whole view at the widget's size into `painter` (paint events, PNG/SVG export, benchmark).
  void paint_view(QPainter& painter);

 signals:
  void selection_changed(const QString& description);
  void view_changed();

 protected:
  void paintEvent(QPaintEvent*) override;
  void resizeEvent(QResizeEvent*) override;
  void wheelEvent(QWheelEvent*) override;
  void mousePressEvent(QMouseEvent*) override;
  void mouseMoveEvent(QMouseEvent*) override;
  void mouseReleaseEvent(QMouseEvent*) override;
  void mouseDoubleClickEvent(QMouseEvent*) override;
  void keyPressEvent(QKeyEvent*) override;
  bool event(QEvent*) override;

 private:
  static constexpr int kGutterPx = 196, kLegendPx = 20, kAxisPx = 24, kHeaderPx = 20, kDeviceGapPx = 5;
  static constexpr int kScrollbarPx = 12, kMemoryPx = 150;
  // A display row: content coordinates (before scrolling), the track row it draws and its group.
  struct RowLayout {
    int y = 0, height = 0;
    int track_row = 0;    // index into Track::rows (a folded group's representative)
    int group = -1;       // groups_ index, -1 without folding
    bool folded = false;  // a group of several devices drawn as one row
    bool expanded_member = false;
  };
  struct TrackLayout {
    int header_y = 0;
    std::vector<RowLayout> rows;
    std::vector<int> row_of_device;   // device -> track row (-1: none)
    std::vector<int> display_of_row;  // track row -> display row (folded members: their group's row)
  };

  int body_top() const { return kLegendPx + kAxisPx; }
  int body_bottom() const { return height() - memory_height(); }
  int memory_height() const;
  int lane_step() const { return lane_height_ + 1; }
  void relayout();
  void update_scrollbar();
  double total_time_s() const;
  void paint_lanes(QPainter& p, const Track& track, const TrackLayout& layout, int width);
  void paint_lane(QPainter& p, const Lane& lane, int y, int h, int right, const QFont& label_font);
  void paint_axis(QPainter& p, int width);
  void paint_legend(QPainter& p, int width);
  void paint_memory(QPainter& p, int width, int height);
  struct MemoryScale {
    double y_max = 1, peak = 1;
    std::int64_t hbm = 0;
    bool hbm_on_scale = false;
    int top = 0, plot_top = 0, plot_bottom = 0;
  };
  MemoryScale memory_scale() const;
  void paint_memory_legend(QPainter& p, const std::vector<MemoryCurve>& curves, const MemoryScale& m, int height,
                           const QFontMetrics& fm) const;
  void paint_memory_ticks(QPainter& p, const MemoryScale& m) const;
  QPolygon memory_polyline(const core::DeviceTimeline& dt, const MemoryScale& m) const;
  double memory_y(const MemoryScale& m, double bytes) const {
    return m.plot_bottom - (m.plot_bottom - m.plot_top) * bytes / m.y_max;
  }
  void paint_highlights(QPainter& p);
  std::optional<QRectF> span_rect(int track, int row, int lane, std::size_t pos) const;
  std::optional<QRectF> op_rect(int track, const OpKey& key) const;

  // Span labels ("F3") are laid out once per font size: drawing cached glyph runs is several times
  // cheaper than drawText, and fit-to-window frames of big steps show thousands of labels.
  struct CachedLabel {
    QStaticText text;
    int width = 0;
  };
  const CachedLabel& label(std::uint8_t kind, int microbatch, const QFont& font);
  std::unordered_map<int, CachedLabel> label_cache_;
  qreal label_cache_point_size_ = 0;

  std::vector<std::shared_ptr<const Track>> tracks_;
  FoldMode fold_mode_ = FoldMode::Off;
  bool fold_mode_chosen_ = false;
  std::vector<std::vector<DeviceGroup>> groups_;                  // per track (empty for a measured-only track)
  std::vector<std::vector<bool>> expanded_;                       // per track, per group
  mutable std::unordered_map<std::string, QString> elide_cache_;  // (lane name, width) -> elided text
  int memory_pane_top() const { return height() - memory_height(); }
  std::vector<bool> kinds_present_;  // legend entries, computed once per set_tracks
  std::vector<TrackLayout> layouts_;
  std::vector<std::unique_ptr<DependencyIndex>> deps_index_;
  int content_height_ = 0;
  int scroll_y_ = 0;
  int lane_height_ = 16;
  double view_start_s_ = 0;
  double pixels_per_s_ = 1;
  QScrollBar* scrollbar_ = nullptr;

  Hit selection_;
  Dependencies selected_deps_;
  bool show_critical_ = false;
  std::vector<OpKey> critical_;

  enum class Drag { None, Pan, Box } drag_ = Drag::None;
  QPointF press_pos_, last_pos_;
  double drag_travel_px_ = 0;
};

}  // namespace piper::gui
