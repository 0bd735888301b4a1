// What lets the studio read at 256+ devices, as plain functions with no display: folding devices by
// symmetry class or pipeline stage, eliding labels in the middle, and number formatting that scales
// its unit (KiB..TiB, significant digits for small percentages).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "piper/core/timeline.hpp"

namespace piper::gui {

// ---- folding -----------------------------------------------------------------------------------

// Off: one row per device. Class: one row per symmetry class, devices that run the same plan (the
// same op sequence up to renaming of peers: DP replicas, TP ranks). Stage: one row per pipeline stage
// (the set of PP tags a device's compute ops carry; DualPipeV devices hold two).
enum class FoldMode { Off, Class, Stage };
const char* fold_mode_name(FoldMode m);  // "off", "class", "stage"

struct DeviceGroup {
  std::vector<int> devices;  // ascending; devices.front() is the representative drawn for the group
  std::vector<int> stages;   // PP tags of the representative's compute ops (ascending; empty: none)
  int plan = -1;             // Program::plans index (Class mode; -1 in Stage mode when plans differ)
  int classes = 1;           // distinct plans among the members
  double spread_s = 0;       // max |start difference| of any op between a member and the representative
  // "stage 3 ×32", "stages 0,15 ×16", "dev 5"; in Class mode "class 2 · stage 3 ×32" when several
  // classes share a stage (TP ranks with different plans, EP), else the stage alone.
  std::string label;
  int representative() const { return devices.front(); }
  int size() const { return static_cast<int>(devices.size()); }
};

// Groups of `timeline`'s devices in the order of their representatives. Off: one group per device.
// O(ops) (each member's spans are compared with its representative's once, for spread_s).
std::vector<DeviceGroup> fold_devices(const core::Timeline& timeline, FoldMode mode);
// The PP tags of a plan's compute ops, ascending.
std::vector<int> plan_stages(const core::Plan& plan);
// "stage 3", "stages 0,15", "stages 0-7" (a run), "" (no PP tags).
std::string stages_label(const std::vector<int>& stages);
// What the view folds to by default: Off up to `max_unfolded` devices, else Class when it gives at
// most `max_rows` rows, else Stage.
FoldMode default_fold_mode(const core::Timeline& timeline, int max_unfolded = 16, int max_rows = 32);

// ---- elision -----------------------------------------------------------------------------------

// `text` shortened to at most `max_width` by replacing its middle with "…", keeping as much of both
// ends as fits (the head gets the extra character); `width` measures a UTF-8 string (pixels, or code
// points by default). Code points are never split. Returns `text` when it fits, "…" when nothing does.
std::string elide_middle(const std::string& text, int max_width,
                         const std::function<int(std::string_view)>& width = {});
int utf8_length(std::string_view s);  // code points

// ---- units -------------------------------------------------------------------------------------

std::string format_bytes(
    double bytes);  // "512 B", "3.40 KiB", "12.5 MiB", "7.49 GiB", "1.20 TiB" (3 significant digits)
std::string format_percent(
    double fraction);  // "37.5 %", "4.21 %", "0.0123 %", "0 %": 3 significant digits, at most 1 decimal above 10 %
std::string format_seconds(double s);                // "1.234 s", "12.35 ms", "4.20 µs", "310 ns"
std::string format_flops(double flops);              // "12.3 GFLOP", "45.6 MFLOP", "1.20 TFLOP"
std::string format_signed_percent(double fraction);  // "+9.6 %", "-0.42 %"

// ---- memory breakdown ----------------------------------------------------------------------------

// Readable name of a BufferKind name as the report writes it ("parameters" -> "weights",
// "optimizer_states" -> "optimizer state", ...); unknown names are returned as they are.
std::string memory_kind_title(const std::string& kind);
// "weights 1.20 GiB, gradients 1.20 GiB, optimizer state 4.80 GiB, activations 312 MiB": the per-kind
// peaks, in BufferKind order, zero kinds left out.
std::string memory_breakdown(const std::map<std::string, std::int64_t>& peak_bytes_by_kind);

}  // namespace piper::gui
