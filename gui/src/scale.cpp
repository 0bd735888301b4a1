// Folding, middle elision and unit formatting for the studio (no Qt: tested without a display).
#include "piper/gui/scale.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>

namespace piper::gui {

// ---- folding -----------------------------------------------------------------------------------

const char* fold_mode_name(FoldMode m) {
  switch (m) {
    case FoldMode::Off:
      return "off";
    case FoldMode::Class:
      return "class";
    case FoldMode::Stage:
      return "stage";
  }
  return "off";
}

std::vector<int> plan_stages(const core::Plan& plan) {
  std::set<int> stages;
  for (const core::Stream& s : plan.streams)
    for (const core::Op& op : s.ops) {
      if (op.kind != core::OpKind::Compute) continue;
      auto it = op.tags.find("PP");
      if (it != op.tags.end()) stages.insert(it->second);
    }
  return {stages.begin(), stages.end()};
}

std::string stages_label(const std::vector<int>& stages) {
  if (stages.empty()) return "";
  if (stages.size() == 1) return "stage " + std::to_string(stages.front());
  const bool run = stages.back() - stages.front() + 1 == static_cast<int>(stages.size()) && stages.size() > 2;
  if (run) return fmt::format("stages {}-{}", stages.front(), stages.back());
  std::string out = "stages ";
  for (std::size_t i = 0; i < stages.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(stages[i]);
  }
  return out;
}

namespace {

// Max |start difference| between two devices running the same plan (spans sorted alike); -1 when
// the plans differ.
double spread_between(const core::Timeline& t, int a, int b) {
  const auto& sa = t.devices[static_cast<std::size_t>(a)].spans;
  const auto& sb = t.devices[static_cast<std::size_t>(b)].spans;
  if (sa.shares_storage_with(sb)) return 0;
  if (t.program->plan_of_device[static_cast<std::size_t>(a)] !=
          t.program->plan_of_device[static_cast<std::size_t>(b)] ||
      sa.size() != sb.size())
    return -1;
  double spread = 0;
  for (std::size_t i = 0; i < sa.size(); ++i) spread = std::max(spread, std::abs(sa[i].start_s - sb[i].start_s));
  return spread;
}

}  // namespace

std::vector<DeviceGroup> fold_devices(const core::Timeline& timeline, FoldMode mode) {
  const core::Program& program = *timeline.program;
  const int n = static_cast<int>(timeline.devices.size());
  std::vector<std::vector<int>> stages_of_plan(program.plans.size());
  std::vector<bool> stages_known(program.plans.size(), false);
  auto stages = [&](int device) -> const std::vector<int>& {
    const auto p = static_cast<std::size_t>(program.plan_of_device.at(static_cast<std::size_t>(device)));
    if (!stages_known[p]) {
      stages_of_plan[p] = plan_stages(program.plans[p]);
      stages_known[p] = true;
    }
    return stages_of_plan[p];
  };
  std::vector<DeviceGroup> groups;
  std::map<int, std::size_t> by_plan;
  std::map<std::vector<int>, std::size_t> by_stages;
  for (int d = 0; d < n; ++d) {
    const int plan = program.plan_of_device.at(static_cast<std::size_t>(d));
    std::size_t g = groups.size();
    if (mode == FoldMode::Class)
      g = by_plan.try_emplace(plan, groups.size()).first->second;
    else if (mode == FoldMode::Stage)
      g = by_stages.try_emplace(stages(d), groups.size()).first->second;
    if (g == groups.size()) {
      DeviceGroup group;
      group.stages = stages(d);
      group.plan = plan;
      groups.push_back(std::move(group));
    }
    DeviceGroup& group = groups[g];
    if (!group.devices.empty()) {
      const double s = spread_between(timeline, group.representative(), d);
      if (s < 0)
        group.plan = -1;
      else
        group.spread_s = std::max(group.spread_s, s);
    }
    group.devices.push_back(d);
  }
  std::map<std::vector<int>, int> classes_of_stages;  // Class mode: name the class only when stages do not
  for (const DeviceGroup& group : groups) ++classes_of_stages[group.stages];
  for (DeviceGroup& group : groups) {
    std::set<int> plans;
    for (int d : group.devices) plans.insert(program.plan_of_device[static_cast<std::size_t>(d)]);
    group.classes = static_cast<int>(plans.size());
    const std::string st = stages_label(group.stages);
    if (group.size() == 1) {
      group.label = "dev " + std::to_string(group.representative());
    } else if (mode == FoldMode::Class && (st.empty() || classes_of_stages[group.stages] > 1)) {
      group.label = st.empty() ? fmt::format("class {} ×{}", group.plan, group.size())
                               : fmt::format("class {} · {} ×{}", group.plan, st, group.size());
    } else {
      group.label = fmt::format("{} ×{}", st.empty() ? "devices" : st, group.size());
    }
  }
  return groups;
}

FoldMode default_fold_mode(const core::Timeline& timeline, int max_unfolded, int max_rows) {
  if (static_cast<int>(timeline.devices.size()) <= max_unfolded || !timeline.program) return FoldMode::Off;
  std::set<int> plans(timeline.program->plan_of_device.begin(), timeline.program->plan_of_device.end());
  return static_cast<int>(plans.size()) <= max_rows ? FoldMode::Class : FoldMode::Stage;
}

// ---- elision -----------------------------------------------------------------------------------

namespace {
std::vector<std::size_t> code_point_starts(std::string_view s) {
  std::vector<std::size_t> starts;
  for (std::size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) starts.push_back(i);
  return starts;
}
}  // namespace

int utf8_length(std::string_view s) { return static_cast<int>(code_point_starts(s).size()); }

std::string elide_middle(const std::string& text, int max_width, const std::function<int(std::string_view)>& width_fn) {
  const std::function<int(std::string_view)> width =
      width_fn ? width_fn : [](std::string_view s) { return utf8_length(s); };
  if (width(text) <= max_width) return text;
  const std::vector<std::size_t> starts = code_point_starts(text);
  const int n = static_cast<int>(starts.size());
  auto candidate = [&](int keep) {
    const int head = (keep + 1) / 2, tail = keep / 2;
    const std::size_t head_end = head < n ? starts[static_cast<std::size_t>(head)] : text.size();
    const std::size_t tail_begin = tail > 0 ? starts[static_cast<std::size_t>(n - tail)] : text.size();
    // An ellipsis already at the cut is not doubled ("…[25,33,…" -> one "…").
    std::string head_part = text.substr(0, head_end), tail_part = text.substr(tail_begin);
    const std::string dots = "…";
    if (head_part.size() >= dots.size() && head_part.compare(head_part.size() - dots.size(), dots.size(), dots) == 0)
      head_part.resize(head_part.size() - dots.size());
    if (tail_part.rfind(dots, 0) == 0) tail_part.erase(0, dots.size());
    return head_part + dots + tail_part;
  };
  // Widths grow with the kept code points: binary search the most that fit.
  int lo = 0, hi = n - 1;
  if (width(candidate(0)) > max_width) return "…";
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (width(candidate(mid)) <= max_width)
      lo = mid;
    else
      hi = mid - 1;
  }
  return candidate(lo);
}

// ---- units -------------------------------------------------------------------------------------

namespace {
// value in [1, 1000) (or [1, 1024)) to 3 significant digits.
std::string three_digits(double v) {
  const double a = std::abs(v);
  const int decimals = a >= 99.95 ? 0 : (a >= 9.995 ? 1 : 2);
  return fmt::format("{:.{}f}", v, decimals);
}
}  // namespace

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = bytes;
  while (std::abs(v) >= 1023.995 && u < 5) {  // 1023.999 KiB would print as "1024 KiB"
    v /= 1024;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} B", v);
  return three_digits(v) + " " + units[u];
}

std::string format_percent(double fraction) {
  const double p = fraction * 100;
  const double a = std::abs(p);
  if (a == 0 || !std::isfinite(p)) return a == 0 ? "0 %" : fmt::format("{} %", p);
  int decimals;
  if (a >= 9.995)
    decimals = 1;
  else if (a >= 0.9995)
    decimals = 2;
  else
    decimals = std::min(9, 2 - static_cast<int>(std::floor(std::log10(a))));
  return fmt::format("{:.{}f} %", p, decimals);
}

std::string format_signed_percent(double fraction) {
  const std::string s = format_percent(fraction);
  return fraction > 0 ? "+" + s : s;
}

std::string format_seconds(double s) {
  const double a = std::abs(s);
  if (a == 0) return "0 s";
  if (a >= 1) return fmt::format("{:.3f} s", s);
  if (a >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  if (a >= 1e-6) return fmt::format("{:.2f} µs", s * 1e6);
  return fmt::format("{:.0f} ns", s * 1e9);
}

std::string format_flops(double flops) {
  static const char* units[] = {"FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP"};
  int u = 0;
  double v = flops;
  while (std::abs(v) >= 999.95 && u < 6) {
    v /= 1000;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} FLOP", v);
  return three_digits(v) + " " + units[u];
}

// ---- memory breakdown ----------------------------------------------------------------------------

namespace {
const std::pair<const char*, const char*> kKindTitles[] = {
    {"parameters", "weights"},      {"gradients", "gradients"},           {"optimizer_states", "optimizer state"},
    {"activations", "activations"}, {"received", "received activations"}, {"gathered_parameters", "gathered weights"},
};
}  // namespace

std::string memory_kind_title(const std::string& kind) {
  for (const auto& [name, title] : kKindTitles)
    if (kind == name) return title;
  return kind;
}

std::string memory_breakdown(const std::map<std::string, std::int64_t>& by_kind) {
  std::string out;
  auto add = [&](const std::string& kind, std::int64_t bytes) {
    if (bytes <= 0) return;
    out += (out.empty() ? "" : ", ") + memory_kind_title(kind) + " " + format_bytes(static_cast<double>(bytes));
  };
  for (const auto& [name, title] : kKindTitles) {
    auto it = by_kind.find(name);
    if (it != by_kind.end()) add(it->first, it->second);
  }
  for (const auto& [kind, bytes] : by_kind) {
    bool known = false;
    for (const auto& [name, title] : kKindTitles) known = known || kind == name;
    if (!known) add(kind, bytes);
  }
  return out;
}

}  // namespace piper::gui
