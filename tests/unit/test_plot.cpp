// piper_plot and `piper plot`: nice ticks and labels by hand, series drawn in their colour, PNGs of
// the requested size written atomically, and one-line errors for bad input.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include <gtest/gtest.h>

#include <QColor>
#include <QImage>

#include "piper/plot/plot.hpp"

using namespace piper::plot;
namespace fs = std::filesystem;

#if defined(__SANITIZE_ADDRESS__)
#define PIPER_TEST_PLOT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PIPER_TEST_PLOT_ASAN 1
#endif
#endif

namespace {

fs::path temp(const std::string& name) {
  return fs::temp_directory_path() / ("piper_test_plot_" + std::to_string(::getpid()) + "_" + name);
}

// Pixels close to `c` (antialiasing blends edges, so a tolerance per channel).
int pixels_like(const QImage& image, QColor c) {
  int n = 0;
  for (int y = 0; y < image.height(); ++y)
    for (int x = 0; x < image.width(); ++x) {
      const QColor p = image.pixelColor(x, y);
      if (std::abs(p.red() - c.red()) < 12 && std::abs(p.green() - c.green()) < 12 &&
          std::abs(p.blue() - c.blue()) < 12)
        ++n;
    }
  return n;
}

struct CliRun {
  int status;
  std::string output;
};

CliRun run(const std::string& args) {
  const fs::path out = temp("cli.txt");
  // Bounded (a timeout; 4 GB of address space but under AddressSanitizer, whose shadow memory needs
  // far more): a regression that loops fails the test instead of hanging it or filling the memory.
#if defined(PIPER_TEST_PLOT_ASAN)
  const std::string bound = "timeout 60 ";
#else
  const std::string bound = "ulimit -v 4000000; timeout 60 ";
#endif
  const std::string cmd = bound + std::string(PIPER_CLI) + " " + args + " > " + out.string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  fs::remove(out);
  return {WEXITSTATUS(rc), text};
}

}  // namespace

TEST(Plot, NiceTicksAreMultiplesOfOneTwoOrFive) {
  // (9.7 - 0.3) / 6 = 1.57 -> step 2.
  EXPECT_EQ(nice_ticks(0.3, 9.7, false), (std::vector<double>{2, 4, 6, 8}));
  // 1000 / 6 = 167 -> step 200.
  EXPECT_EQ(nice_ticks(0, 1000, false), (std::vector<double>{0, 200, 400, 600, 800, 1000}));
  // Log: the decades; with fewer than three, 2 and 5 between them.
  EXPECT_EQ(nice_ticks(1, 1000, true), (std::vector<double>{1, 10, 100, 1000}));
  EXPECT_EQ(nice_ticks(1, 20, true), (std::vector<double>{1, 2, 5, 10, 20}));
  EXPECT_TRUE(nice_ticks(5, 5, false).empty());
}

TEST(Plot, TickLabelsAreCompact) {
  EXPECT_EQ(tick_label(1.5e6), "1.5M");
  EXPECT_EQ(tick_label(20000), "20k");
  EXPECT_EQ(tick_label(2.5e9), "2.5G");
  EXPECT_EQ(tick_label(0.25), "0.25");
  EXPECT_EQ(tick_label(1000), "1e+03");
}

TEST(Plot, SeriesAreDrawnInTheirColourAndTheFileHasTheRequestedSize) {
  Chart chart;
  chart.title = "test";
  chart.x = {"memory (GiB)", false, 0.0, 10.0};
  chart.y = {"throughput (tokens/s)", false, 0.0, 10.0};
  chart.width = 640;
  chart.height = 480;
  const QColor green("#00aa00");
  // Markers are filled with the series colour at alpha 170/255 over the white background.
  const QColor fill((0x00 * 170 + 255 * 85) / 255, (0xaa * 170 + 255 * 85) / 255, (0x00 * 170 + 255 * 85) / 255);
  const QImage empty = render(chart);
  EXPECT_EQ(pixels_like(empty, fill), 0);
  chart.series.push_back({"points", {2, 5, 8}, {2, 5, 8}, Style::Points, "#00aa00", 6});
  const QImage drawn = render(chart);
  // Three discs of radius 6 (about 113 px each, minus antialiased rims) plus the legend marker.
  EXPECT_GT(pixels_like(drawn, fill), 150);
  const fs::path png = temp("chart.png");
  write_line_png(chart, png.string());
  QImage back(QString::fromStdString(png.string()));
  EXPECT_EQ(back.width(), 640);
  EXPECT_EQ(back.height(), 480);
  EXPECT_FALSE(fs::exists(png.string() + ".tmp"));
  fs::remove(png);
  EXPECT_THROW(write_png(chart, "/nonexistent-dir/x.png"), PlotError);
  chart.series.push_back({"bad", {1, 2}, {1}, Style::Points, "", 3});
  EXPECT_THROW(render(chart), PlotError);
}

TEST(PlotCli, PlotsColumnsOfACsvBySeries) {
  const fs::path csv = temp("data.csv"), png = temp("cli.png");
  {
    std::ofstream out(csv);
    out << "name,x,y,status\n"
        << "a,1,2,ok\n"
        << "a,2,4,ok\n"
        << "b,1,3,ok\n"
        << "b,2,,invalid\n";
  }
  CliRun r = run("plot " + csv.string() + " --x x --y y --series name --line -o " + png.string());
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("3 points in 2 series (1 rows without numbers skipped)"), std::string::npos) << r.output;
  EXPECT_TRUE(QImage(QString::fromStdString(png.string())).width() > 0);
  r = run("plot " + csv.string() + " --x nope --y y -o " + png.string());
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("--x 'nope': no such column (columns: name, x, y, status)"), std::string::npos) << r.output;
  fs::remove(csv);
  fs::remove(png);
}

// Hostile CSVs: non-positive values on a logarithmic axis were counted as plotted and left undrawn;
// values near the largest double overflowed the axis span (Qt printed NaN warnings, exit 0); "0x10"
// was read as 16; -o naming the CSV replaced it with the PNG.
TEST(PlotCli, HostileValuesAndPathsAreRefusedOrCounted) {
  const fs::path csv = temp("hostile.csv"), png = temp("hostile.png");
  auto write = [&](const std::string& text) { std::ofstream(csv) << text; };
  write("a,b\n1,-2\n2,0\n3,5\n");
  CliRun r = run("plot " + csv.string() + " --x a --y b --log-y -o " + png.string());
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("1 points in 1 series (0 rows without numbers skipped, 2 with values <= 0 left off the "
                          "logarithmic axis)"),
            std::string::npos)
      << r.output;
  write("a,b\n1,-2\n2,0\n");
  r = run("plot " + csv.string() + " --x a --y b --log-y -o " + png.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("values > 0"), std::string::npos) << r.output;
  fs::remove(png);
  write("a,b\n1,1e308\n2,-1e308\n");
  r = run("plot " + csv.string() + " --x a --y b -o " + png.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_EQ(r.output.find("QPainter"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("y axis 'b'"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(png));
  write("a,b\n0x10,2\n1,2\n");
  r = run("plot " + csv.string() + " --x a --y b -o " + png.string());
  EXPECT_NE(r.output.find("1 points in 1 series (1 rows without numbers skipped)"), std::string::npos) << r.output;
  const std::string before = "a,b\n1,2\n";
  write(before);
  r = run("plot " + csv.string() + " --x a --y b -o " + csv.string());
  EXPECT_EQ(r.status, 2) << r.output;
  // -o x.csv is refused for its extension first (a PNG under another image or file type's name).
  EXPECT_NE(r.output.find("--output: writes a PNG image: name a .png file"), std::string::npos) << r.output;
  {
    std::ifstream in(csv);
    EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()), before);
  }
  // A CSV without an extension passes that rule and meets the output-over-input one.
  const fs::path bare = temp("hostile-data");
  std::ofstream(bare) << before;
  r = run("plot " + bare.string() + " --x a --y b -o " + bare.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--output is also the input csv"), std::string::npos) << r.output;
  std::ifstream in(bare);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()), before);
  fs::remove(bare);
  // A header naming a column twice: the first one was plotted, silently.
  fs::remove(png);
  write("a,b,a\n1,2,3\n");
  r = run("plot " + csv.string() + " --x b --y a -o " + png.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--y 'a': columns 1 and 3 of the header both have this name"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(png));
  // CRLF line ends (RFC 4180, spreadsheets' exports; probe 5): the last column was 'b\r', so
  // `--y b` was "no such column (columns: a, b )" and a last-column cell "2\r" no number.
  write("a,b\r\n1,2\r\n2,3\r\n");
  r = run("plot " + csv.string() + " --x a --y b -o " + png.string());
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("2 points in 1 series (0 rows without numbers skipped)"), std::string::npos) << r.output;
  fs::remove(csv);
  fs::remove(png);
}

// Degenerate axis ranges. Values 1 ulp apart (1 and 1.0000000000000002) gave a tick step that, added
// to 1, left it unchanged: the tick loop never ended and grew memory without bound. The commands run
// under `timeout` and an address-space cap so that the bug fails the test instead of hanging it.
TEST(PlotCli, AxesSpanningOneUlpOrHugeOrDenormalValuesPlot) {
  const fs::path csv = temp("degenerate.csv"), png = temp("degenerate.png");
  auto write = [&](const std::string& text) { std::ofstream(csv) << text; };
  auto plot = [&](const std::string& extra = "") {
    fs::remove(png);
    return run("plot " + csv.string() + " --x x --y y -o " + png.string() + extra);
  };
  for (const char* text :
       {"x,y\n1,1\n1.0000000000000002,2\n", "x,y\n1,1\n2,1.0000000000000002\n", "x,y\n1e300,1\n-1e300,2\n"}) {
    write(text);
    const CliRun r = run("plot " + csv.string() + " --x x --y y -o " + png.string());
    ASSERT_EQ(r.status, 0) << text << r.output;  // not the in-process checks below if the CLI hung
    EXPECT_NE(r.output.find("2 points in 1 series (0 rows without numbers skipped)"), std::string::npos) << r.output;
    EXPECT_EQ(QImage(QString::fromStdString(png.string())).width(), 1100) << text;
  }
  // Ticks of a range within rounding of its values: few, ordered, inside the range.
  for (const auto& [lo, hi] : {std::pair{1.0, std::nextafter(1.0, 2.0)}, std::pair{1e20, std::nextafter(1e20, 2e20)},
                               std::pair{5e-324, 1e-323}, std::pair{-1e300, 1e300}}) {
    const auto ticks = nice_ticks(lo, hi, false);
    EXPECT_LE(ticks.size(), 8u) << lo << " " << hi;
    for (std::size_t i = 0; i < ticks.size(); ++i) {
      EXPECT_GE(ticks[i], lo) << lo << " " << hi;
      EXPECT_LE(ticks[i], hi) << lo << " " << hi;
      if (i > 0) {
        EXPECT_LT(ticks[i - 1], ticks[i]);
      }
    }
  }
  // Charts whose data or fixed range is within rounding of its values, or denormal, draw.
  Chart chart;
  chart.x = {"x", false, 1e20, 1e20};
  chart.y = {"y", false, 1.0, std::nextafter(1.0, 2.0)};
  chart.series.push_back({"", {1e20}, {1}, Style::Points, "", 5});
  EXPECT_EQ(render(chart).width(), 1100);
  chart.x = {"x", false, {}, {}};
  chart.y = {"y", false, {}, {}};
  chart.series = {{"", {1e20, std::nextafter(1e20, 2e20)}, {1e-320, 2e-320}, Style::Points, "", 5}};
  EXPECT_EQ(render(chart).width(), 1100);
  // Denormal cells are numbers (std::stod called them out of range: "rows without numbers").
  write("x,y\n1e-320,1\n1,2\n");
  CliRun r = plot();
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("2 points in 1 series (0 rows without numbers skipped)"), std::string::npos) << r.output;
  // --where matching no row says so (it said "no row has numbers in both 'x' and 'y'").
  write("x,y,s\n1,2,a\n2,3,b\n");
  r = plot(" --where s=zzz");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--where 's=zzz': no row has 'zzz' in column 's'"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(png));
  fs::remove(csv);
  fs::remove(png);
}

// Fifteenth probe (docs/reliability.md): malformed quoting was read as something else, `1,"2"3` as 23
// (`--where y=23` matched it) and an unterminated `"2` as 2; it is refused at its line, as a row with
// the wrong number of fields is. A UTF-8 byte-order mark became part of the first column's name.
TEST(PlotCli, MalformedQuotingIsRefusedAndAByteOrderMarkDropped) {
  const fs::path csv = temp("quoting.csv"), png = temp("quoting.png");
  auto plot = [&](const std::string& text, const std::string& flags) {
    std::ofstream(csv) << text;
    return run("plot " + csv.string() + " " + flags + " -o " + png.string());
  };
  CliRun r = plot("x,y\n1,\"2\"3\n5,6\n", "--x x --y y --where y=23");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("line 2: field 2: text after its closing quote"), std::string::npos) << r.output;
  r = plot("x,y\n3,4\n1,\"2\n", "--x x --y y");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("line 3: field 2: a quote that is never closed"), std::string::npos) << r.output;
  r = plot("x,y\n1,2\"\n", "--x x --y y");
  EXPECT_NE(r.output.find("line 2: field 2: a quote inside an unquoted field"), std::string::npos) << r.output;
  r = plot("x,\"y\nz\"\n1,2\n", "--x x --y y");
  EXPECT_NE(r.output.find("line 1: field 2: a quote that is never closed"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(png));
  // Well-formed quoting, a doubled quote and an empty quoted field included, is still read.
  r = plot("x,y,name\n\"1\",\"2\",\"a \"\"b\"\", c\"\n3,4,\"\"\n", "--x x --y y");
  EXPECT_EQ(r.status, 0) << r.output;
  // A leading byte-order mark is dropped (with CRLF lines); one later in the file is text.
  r = plot("\xEF\xBB\xBFx,y\r\n1,2\r\n3,4\r\n", "--x x --y y");
  EXPECT_EQ(r.status, 0) << r.output;
  r = plot(
      "x,y\n\xEF\xBB\xBF"
      "1,2\n",
      "--x x --y y");
  EXPECT_NE(r.status, 0) << r.output;
  fs::remove(csv);
  fs::remove(png);
}
