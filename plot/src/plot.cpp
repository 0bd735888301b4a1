// Offscreen PNG charts with QPainter: axes with nice ticks, series as points or lines, a legend,
// reference lines; written atomically (core::write_file_atomically).
#include "piper/plot/plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include <unistd.h>

#include <QBuffer>
#include <QByteArray>
#include <QColor>
#include <QFont>
#include <QFontMetrics>
#include <QGuiApplication>
#include <QImage>
#include <QPainter>
#include <QPainterPath>
#include <QPen>
#include <QString>

#include "piper/core/error.hpp"
#include "piper/core/program.hpp"

namespace piper::plot {

namespace {

// Colour-blind-friendly palette (Okabe & Ito 2008).
const char* const kPalette[] = {"#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"};

struct Range {
  double lo = 0, hi = 1;
};

double forward(double v, bool log) { return log ? std::log10(v) : v; }

// [lo, hi] (on the axis' scale) is empty, inverted, or so narrow against its values' magnitude that
// nothing can be told apart in it: under a millionth of a millionth of the magnitude.
bool too_narrow(double lo, double hi, bool log) {
  const double a = forward(lo, log), b = forward(hi, log);
  return !(b - a > std::max(std::abs(a), std::abs(b)) * 1e-12);
}

Range data_range(const Chart& c, bool x_axis) {
  const Axis& axis = x_axis ? c.x : c.y;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& s : c.series)
    for (double v : x_axis ? s.x : s.y) {
      if (!std::isfinite(v) || (axis.log && v <= 0)) continue;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  for (const auto& r : c.references)
    if (r.vertical == x_axis && std::isfinite(r.value) && (!axis.log || r.value > 0)) {
      lo = std::min(lo, r.value);
      hi = std::max(hi, r.value);
    }
  if (!std::isfinite(lo)) lo = axis.log ? 1 : 0, hi = axis.log ? 10 : 1;
  if (axis.log) {
    lo = std::pow(10, std::floor(std::log10(lo) * 10) / 10 - 0.05);
    hi = std::pow(10, std::ceil(std::log10(hi) * 10) / 10 + 0.05);
  } else {
    // Pad 5 % so markers on the edge stay whole; a single value gets a unit-wide window (10 % of the
    // value's magnitude beyond 10). So does a span within rounding of its values (1 and
    // 1.0000000000000002): its ticks and positions would lie below the resolution of the doubles.
    const double pad =
        !too_narrow(lo, hi, false) ? 0.05 * (hi - lo) : std::max(1.0, std::max(std::abs(lo), std::abs(hi)) * 0.1);
    lo -= pad;
    hi += pad;
  }
  if (axis.min) lo = *axis.min;
  if (axis.max) hi = *axis.max;
  // A fixed range that is empty, inverted or within rounding of its values: a window above its low end.
  if (too_narrow(lo, hi, axis.log)) hi = axis.log ? lo * 10 : lo + std::max(1.0, std::abs(lo) * 0.1);
  // Values near the largest double (1e308 and -1e308) overflow the span: every position would be NaN.
  if (!std::isfinite(lo) || !std::isfinite(hi) || !std::isfinite(forward(hi, axis.log) - forward(lo, axis.log)))
    throw PlotError((x_axis ? "x" : "y") + std::string(" axis '") + axis.label +
                    "': its values span more than a chart can draw (overflow near the largest double)");
  return {lo, hi};
}

QColor color_of(const std::string& name, std::size_t index) {
  if (!name.empty()) {
    QColor c(QString::fromStdString(name));
    if (c.isValid()) return c;
  }
  return QColor(kPalette[index % (sizeof kPalette / sizeof *kPalette)]);
}

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, bool log, int target) {
  std::vector<double> out;
  if (!(hi > lo) || !std::isfinite(lo) || !std::isfinite(hi)) return out;
  if (log) {
    if (lo <= 0) return out;
    const int first = static_cast<int>(std::ceil(std::log10(lo) - 1e-9));
    const int last = static_cast<int>(std::floor(std::log10(hi) + 1e-9));
    const bool few = last - first < 3;
    for (int e = first - 1; e <= last; ++e)
      for (double m : few ? std::vector<double>{1, 2, 5} : std::vector<double>{1}) {
        const double v = m * std::pow(10.0, e);
        if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) out.push_back(v);
      }
    return out;
  }
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  // Ticks by index, k x step: a step below the resolution of the values (1 and 1.0000000000000002)
  // added to v left it unchanged, and the loop never ended. There are about `target` of them; never
  // more than a few times that, whatever the rounding.
  if (!(step > 0) || !std::isfinite(step)) return out;
  const double first = std::ceil(lo / step - 1e-9), last = std::floor(hi / step + 1e-9);
  if (!std::isfinite(first) || !std::isfinite(last) || !(last >= first)) return out;
  const int count = static_cast<int>(std::min(last - first, 4.0 * std::max(1, target) + 4)) + 1;
  for (int i = 0; i < count; ++i) {
    double v = (first + i) * step;
    if (std::abs(v) < step * 1e-9) v = 0.0;
    // Within rounding of lo and hi, and each tick a value of its own.
    if (v < lo - step * 1e-9 || v > hi + step * 1e-9 || (!out.empty() && v <= out.back())) continue;
    out.push_back(v);
  }
  return out;
}

std::string tick_label(double v) {
  const double a = std::abs(v);
  auto compact = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g", x);
    return std::string(buf);
  };
  if (a >= 1e12) return compact(v / 1e12) + "T";
  if (a >= 1e9) return compact(v / 1e9) + "G";
  if (a >= 1e6) return compact(v / 1e6) + "M";
  if (a >= 1e4) return compact(v / 1e3) + "k";
  return compact(v);
}

void ensure_gui_application() {
  if (QCoreApplication::instance()) return;
  // Text needs a QGuiApplication; the offscreen platform needs no display. It lives until exit.
  if (std::getenv("QT_QPA_PLATFORM") == nullptr) qputenv("QT_QPA_PLATFORM", "offscreen");
  // Qt warns on stderr when XDG_RUNTIME_DIR is unset (common in batch jobs); give it a private one.
  if (std::getenv("XDG_RUNTIME_DIR") == nullptr) {
    const auto dir = std::filesystem::temp_directory_path() / ("runtime-piper-" + std::to_string(::getuid()));
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
    if (!ec) qputenv("XDG_RUNTIME_DIR", QByteArray::fromStdString(dir.string()));
  }
  static int argc = 1;
  static char name[] = "piper";
  static char* argv[] = {name, nullptr};
  new QGuiApplication(argc, argv);
}

namespace {

// The plot area and the data-to-pixel maps of a chart being drawn.
struct Frame {
  const Chart& c;
  Range xr, yr;
  QRectF plot;
  double px(double v) const {
    return plot.left() + (forward(v, c.x.log) - forward(xr.lo, c.x.log)) /
                             (forward(xr.hi, c.x.log) - forward(xr.lo, c.x.log)) * plot.width();
  }
  double py(double v) const {
    return plot.bottom() - (forward(v, c.y.log) - forward(yr.lo, c.y.log)) /
                               (forward(yr.hi, c.y.log) - forward(yr.lo, c.y.log)) * plot.height();
  }
  bool visible(double x, double y) const {
    return std::isfinite(x) && std::isfinite(y) && (!c.x.log || x > 0) && (!c.y.log || y > 0);
  }
};

// Title, grid, ticks and axis labels.
void draw_axes(QPainter& p, const Frame& f, const QFont& font, const std::vector<double>& xticks,
               const std::vector<double>& yticks, int ytick_w) {
  const Chart& c = f.c;
  const QFontMetrics fm(font);
  if (!c.title.empty()) {
    QFont tf = font;
    tf.setPixelSize(18);
    tf.setBold(true);
    p.setFont(tf);
    p.drawText(QRectF(0, 10, c.width, 30), Qt::AlignHCenter | Qt::AlignVCenter, QString::fromStdString(c.title));
    p.setFont(font);
  }
  p.setPen(QPen(QColor("#e5e5e5"), 1));
  for (double t : xticks) p.drawLine(QPointF(f.px(t), f.plot.top()), QPointF(f.px(t), f.plot.bottom()));
  for (double t : yticks) p.drawLine(QPointF(f.plot.left(), f.py(t)), QPointF(f.plot.right(), f.py(t)));
  p.setPen(QPen(Qt::black, 1));
  p.drawRect(f.plot);
  for (double t : xticks) {
    const QString s = QString::fromStdString(tick_label(t));
    p.drawLine(QPointF(f.px(t), f.plot.bottom()), QPointF(f.px(t), f.plot.bottom() + 5));
    p.drawText(QRectF(f.px(t) - 60, f.plot.bottom() + 7, 120, fm.height()), Qt::AlignHCenter | Qt::AlignTop, s);
  }
  for (double t : yticks) {
    const QString s = QString::fromStdString(tick_label(t));
    p.drawLine(QPointF(f.plot.left() - 5, f.py(t)), QPointF(f.plot.left(), f.py(t)));
    p.drawText(QRectF(f.plot.left() - 8 - ytick_w, f.py(t) - fm.height() / 2.0, ytick_w, fm.height()),
               Qt::AlignRight | Qt::AlignVCenter, s);
  }
  p.drawText(QRectF(f.plot.left(), c.height - fm.height() - 8, f.plot.width(), fm.height()), Qt::AlignHCenter,
             QString::fromStdString(c.x.label));
  p.save();
  p.translate(12, f.plot.center().y());
  p.rotate(-90);
  p.drawText(QRectF(-f.plot.height() / 2, 0, f.plot.height(), fm.height()), Qt::AlignHCenter,
             QString::fromStdString(c.y.label));
  p.restore();
}

// Reference lines with their labels.
void draw_references(QPainter& p, const Frame& f, const QFontMetrics& fm) {
  for (const auto& r : f.c.references) {
    if (f.c.x.log && r.vertical && r.value <= 0) continue;
    if (f.c.y.log && !r.vertical && r.value <= 0) continue;
    p.setPen(QPen(color_of(r.color, 0), 1.5, Qt::DashLine));
    if (r.vertical)
      p.drawLine(QPointF(f.px(r.value), f.plot.top()), QPointF(f.px(r.value), f.plot.bottom()));
    else
      p.drawLine(QPointF(f.plot.left(), f.py(r.value)), QPointF(f.plot.right(), f.py(r.value)));
    const QString s = QString::fromStdString(r.label);
    // Labels sit at the bottom (the legend owns the top right), on the side with room.
    if (r.vertical) {
      const double w = fm.horizontalAdvance(s);
      const double x = f.px(r.value) + 4 + w > f.plot.right() ? f.px(r.value) - 4 - w : f.px(r.value) + 4;
      p.drawText(QPointF(x, f.plot.bottom() - 6), s);
    } else
      p.drawText(QPointF(f.plot.right() - fm.horizontalAdvance(s) - 4, f.py(r.value) - 4), s);
  }
}

// Each series as a line, points or both.
void draw_series(QPainter& p, const Frame& f) {
  const Chart& c = f.c;
  for (std::size_t i = 0; i < c.series.size(); ++i) {
    const Series& s = c.series[i];
    const QColor col = color_of(s.color, i);
    if (s.style != Style::Points) {
      QPainterPath path;
      bool open = false;
      for (std::size_t k = 0; k < s.x.size(); ++k) {
        if (!f.visible(s.x[k], s.y[k])) {
          open = false;
          continue;
        }
        const QPointF pt(f.px(s.x[k]), f.py(s.y[k]));
        if (open)
          path.lineTo(pt);
        else
          path.moveTo(pt), open = true;
      }
      p.setPen(QPen(col, 2));
      p.setBrush(Qt::NoBrush);
      p.drawPath(path);
    }
    if (s.style != Style::Line) {
      QColor fill = col;
      fill.setAlpha(170);
      p.setPen(QPen(col.darker(130), 1));
      p.setBrush(fill);
      for (std::size_t k = 0; k < s.x.size(); ++k)
        if (f.visible(s.x[k], s.y[k])) p.drawEllipse(QPointF(f.px(s.x[k]), f.py(s.y[k])), s.marker_px, s.marker_px);
    }
  }
}

// Legend, top right inside the plot.
void draw_legend(QPainter& p, const Frame& f, const QFontMetrics& fm) {
  const Chart& c = f.c;
  std::vector<std::size_t> named;
  for (std::size_t i = 0; i < c.series.size(); ++i)
    if (!c.series[i].name.empty() && !c.series[i].x.empty()) named.push_back(i);
  if (!named.empty()) {
    int w = 0;
    for (auto i : named) w = std::max(w, fm.horizontalAdvance(QString::fromStdString(c.series[i].name)));
    const double row = fm.height() + 4;
    const QRectF box(f.plot.right() - w - 50, f.plot.top() + 8, w + 42, row * static_cast<double>(named.size()) + 8);
    p.setPen(QPen(QColor("#999999"), 1));
    p.setBrush(QColor(255, 255, 255, 230));
    p.drawRect(box);
    for (std::size_t k = 0; k < named.size(); ++k) {
      const Series& s = c.series[named[k]];
      const QColor col = color_of(s.color, named[k]);
      const double y = box.top() + 4 + row * static_cast<double>(k) + row / 2;
      if (s.style != Style::Points) {
        p.setPen(QPen(col, 2));
        p.drawLine(QPointF(box.left() + 6, y), QPointF(box.left() + 26, y));
      }
      if (s.style != Style::Line) {
        p.setPen(QPen(col.darker(130), 1));
        p.setBrush(col);
        p.drawEllipse(QPointF(box.left() + 16, y), 4, 4);
      }
      p.setPen(Qt::black);
      p.drawText(QRectF(box.left() + 32, y - row / 2, w + 10, row), Qt::AlignVCenter | Qt::AlignLeft,
                 QString::fromStdString(s.name));
    }
  }
}

}  // namespace

QImage render(const Chart& c) {
  ensure_gui_application();
  for (const auto& s : c.series)
    if (s.x.size() != s.y.size())
      throw PlotError("series '" + s.name + "': " + std::to_string(s.x.size()) + " x values but " +
                      std::to_string(s.y.size()) + " y values");
  if (c.width < 200 || c.height < 150) throw PlotError("chart size must be at least 200 x 150 pixels");
  QImage image(c.width, c.height, QImage::Format_ARGB32_Premultiplied);
  image.fill(Qt::white);
  QPainter p(&image);
  p.setRenderHint(QPainter::Antialiasing);
  QFont font("DejaVu Sans");
  font.setPixelSize(14);
  p.setFont(font);
  const QFontMetrics fm(font);

  const Range xr = data_range(c, true), yr = data_range(c, false);
  const auto xticks = nice_ticks(xr.lo, xr.hi, c.x.log), yticks = nice_ticks(yr.lo, yr.hi, c.y.log);
  int ytick_w = 0;
  for (double t : yticks) ytick_w = std::max(ytick_w, fm.horizontalAdvance(QString::fromStdString(tick_label(t))));
  const int left = 30 + ytick_w + fm.height(), right = 30, top = c.title.empty() ? 20 : 50;
  const int bottom = 30 + 2 * fm.height();
  const Frame f{c, xr, yr, QRectF(left, top, c.width - left - right, c.height - top - bottom)};
  draw_axes(p, f, font, xticks, yticks, ytick_w);
  // Data, clipped to the plot area.
  p.save();
  p.setClipRect(f.plot);
  draw_references(p, f, fm);
  draw_series(p, f);
  p.restore();
  draw_legend(p, f, fm);
  p.end();
  return image;
}

void write_png(const Chart& chart, const std::string& path) {
  if (path.empty()) throw PlotError("cannot write a PNG with an empty file name");
  const QImage image = render(chart);
  // Encoded in memory, then written as every output is (core::write_file_atomically): through a
  // symbolic link, to a temporary beside the file, fsync'd, then renamed; a device or FIFO written
  // into. QImage::save to a path wrote its own temporary, replaced a link by a regular file and did
  // not fsync before the rename.
  QByteArray bytes;
  QBuffer buffer(&bytes);
  if (!buffer.open(QIODevice::WriteOnly) || !image.save(&buffer, "PNG"))
    throw PlotError(path + ": cannot encode the PNG");
  try {
    core::write_file_atomically(path, std::string(bytes.constData(), static_cast<std::size_t>(bytes.size())));
  } catch (const core::Error& e) {
    throw PlotError(e.what());
  }
}

void write_scatter_png(Chart chart, const std::string& path) {
  for (auto& s : chart.series) s.style = Style::Points;
  write_png(chart, path);
}

void write_line_png(Chart chart, const std::string& path) {
  for (auto& s : chart.series) s.style = Style::LinePoints;
  write_png(chart, path);
}

}  // namespace piper::plot
