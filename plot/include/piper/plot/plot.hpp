// Charts as PNG files: scatter and line plots with linear or log axes, "nice" ticks, units, a legend
// and optional reference lines, drawn offscreen with QImage + QPainter (no display needed).
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

class QImage;

namespace piper::plot {

// A chart that cannot be drawn or written: one line naming the file or the field at fault.
class PlotError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Style { Points, Line, LinePoints };

struct Series {
  std::string name;          // legend entry (empty: not in the legend)
  std::vector<double> x, y;  // equal lengths; lines join points in the given order
  Style style = Style::Points;
  std::string color;     // "#rrggbb" or an SVG colour name; empty: the palette's next colour
  double marker_px = 5;  // marker radius
};

// A vertical or horizontal reference line (e.g. a memory cap), dashed, with a label.
struct ReferenceLine {
  bool vertical = true;
  double value = 0;
  std::string label;
  std::string color = "#c0392b";
};

struct Axis {
  std::string label;               // with its unit, e.g. "peak memory (GiB)"
  bool log = false;                // base 10; non-positive values are left out
  std::optional<double> min, max;  // fixed range; default: the data's, padded
};

struct Chart {
  std::string title;
  Axis x, y;
  std::vector<Series> series;
  std::vector<ReferenceLine> references;
  int width = 1100, height = 720;  // pixels
};

// Renders the chart; every series keeps its own style.
QImage render(const Chart& chart);
// Writes the chart as a PNG with core::write_file_atomically (a temporary beside the file, fsync,
// rename; through a symbolic link, which stays a link). Throws PlotError("cannot write PATH: ...").
void write_png(const Chart& chart, const std::string& path);
// The same with every series drawn as points / as lines with markers.
void write_scatter_png(Chart chart, const std::string& path);
void write_line_png(Chart chart, const std::string& path);

// Tick positions for [lo, hi]: multiples of 1, 2 or 5 x 10^k (linear, about `target` of them) or the
// powers of ten (log, with 2 and 5 between them when there are few decades).
std::vector<double> nice_ticks(double lo, double hi, bool log, int target = 6);
// A tick label: compact, with k/M/G/T suffixes for large magnitudes ("1.5k", "20M", "0.25").
std::string tick_label(double v);

// Makes sure a QGuiApplication exists (offscreen platform unless QT_QPA_PLATFORM is set), as text
// rendering needs one. Call from the main thread; a no-op when an application already exists.
void ensure_gui_application();

}  // namespace piper::plot
