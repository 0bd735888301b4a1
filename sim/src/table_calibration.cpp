// Calibrated kernel tables: see table_calibration.hpp and docs/cost-model.md.
#include "piper/sim/table_calibration.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "piper/core/error.hpp"
#include "piper/core/kernels.hpp"
#include "piper/core/limits.hpp"

namespace piper::sim {

using core::KernelKind;
using core::OpKind;
using nlohmann::json;

namespace {

constexpr std::size_t ix(int i) { return static_cast<std::size_t>(i); }
constexpr double kMinMultiplier = TableCalibration::kMinMultiplier;

KernelClass class_of(KernelKind k) {
  if (k == KernelKind::Gemm) return KernelClass::Gemm;
  if (k == KernelKind::AttentionForward || k == KernelKind::AttentionBackward) return KernelClass::Attention;
  return KernelClass::Memory;
}

double total(const ClassSeconds& s) { return s[0] + s[1] + s[2] + s[3]; }

// Solves A x = b (n x n, n <= kKernelClasses) by Gaussian elimination with partial pivoting; false
// when A is singular.
bool solve(std::vector<std::vector<double>> a, std::vector<double> b, std::vector<double>& x) {
  const std::size_t n = b.size();
  for (std::size_t c = 0; c < n; ++c) {
    std::size_t p = c;
    for (std::size_t r = c + 1; r < n; ++r)
      if (std::abs(a[r][c]) > std::abs(a[p][c])) p = r;
    if (std::abs(a[p][c]) < 1e-300) return false;
    std::swap(a[p], a[c]);
    std::swap(b[p], b[c]);
    for (std::size_t r = c + 1; r < n; ++r) {
      const double f = a[r][c] / a[c][c];
      for (std::size_t k = c; k < n; ++k) a[r][k] -= f * a[c][k];
      b[r] -= f * b[c];
    }
  }
  x.assign(n, 0);
  for (std::size_t c = n; c-- > 0;) {
    double s = b[c];
    for (std::size_t k = c + 1; k < n; ++k) s -= a[c][k] * x[k];
    x[c] = s / a[c][c];
  }
  return true;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

}  // namespace

std::string to_string(KernelClass c) {
  switch (c) {
    case KernelClass::Gemm:
      return "gemm";
    case KernelClass::Attention:
      return "attention";
    case KernelClass::Memory:
      return "memory";
    case KernelClass::Adamw:
      return "adamw";
  }
  return "?";
}

ClassSeconds class_seconds(const core::Program& program, const CostModel& cost, int device, const core::Op& op,
                           double* launch_s) {
  ClassSeconds out{};
  const std::optional<double> modelled = cost.kernel_seconds(program, device, op);
  if (!modelled) return out;
  const KernelTiming t = cost.timing(device);
  double launches = 0;
  if (op.kind == OpKind::Update) {
    // One launch of the fused multi-tensor AdamW (CostModel::update_seconds).
    launches = std::min(*modelled, t.launch_floor());
    out[ix(static_cast<int>(KernelClass::Adamw))] = *modelled - launches;
  } else {
    const core::PassKernels& pk = program.segments[static_cast<std::size_t>(op.segment)].kernels;
    const auto [first, last] = core::pass_kernel_lists(op.pass);
    for (std::size_t l = first; l <= last; ++l)
      for (const auto& k : pk[l]) {
        const double floor = k.count * t.launch_seconds(k);
        out[ix(static_cast<int>(class_of(k.kind)))] += k.count * t.seconds(k) - floor;
        launches += floor;
      }
    // What kernel_seconds adds beyond the listed kernels (element-wise traffic of the op) is one
    // memory-bound kernel: a launch and its bytes.
    const double rest = *modelled - total(out) - launches;
    if (rest > 0) {
      const double floor = std::min(rest, t.launch_floor());
      out[ix(static_cast<int>(KernelClass::Memory))] += rest - floor;
      launches += floor;
    }
  }
  if (launch_s) *launch_s += launches;
  return out;
}

namespace {

// The objective of fit_multipliers and its minimiser with the classes in `pinned` held at the lower
// bound: the normal equations of the free classes. nullopt when they are singular or a free
// multiplier falls below the bound.
struct Fit {
  std::vector<double> x;  // per observed class
  double objective = 0;
};

std::optional<Fit> fit_with_pinned(const TableCalibration& c, const std::vector<int>& cls, unsigned pinned,
                                   double lambda) {
  const std::size_t n = cls.size();
  std::vector<std::size_t> free;
  for (std::size_t r = 0; r < n; ++r)
    if (!(pinned >> r & 1u)) free.push_back(r);
  Fit f;
  f.x.assign(n, kMinMultiplier);
  if (!free.empty()) {
    // Gradient of sum_i w_i (a_i . x - m_i)^2 + lambda sum_{r < q} (x_r - x_q)^2 in the free x.
    const std::size_t k = free.size();
    std::vector<std::vector<double>> a(k, std::vector<double>(k, 0));
    std::vector<double> b(k, 0);
    for (const auto& o : c.observations) {
      if (o.measured_s <= 0) continue;
      const double w = 1 / (o.measured_s * o.measured_s);
      double fixed = o.fixed_s;  // the launch floors and the pinned classes' share of the prediction
      for (std::size_t r = 0; r < n; ++r)
        if (pinned >> r & 1u) fixed += o.predicted[ix(cls[r])] * kMinMultiplier;
      for (std::size_t r = 0; r < k; ++r) {
        for (std::size_t q = 0; q < k; ++q)
          a[r][q] += w * o.predicted[ix(cls[free[r]])] * o.predicted[ix(cls[free[q]])];
        b[r] += w * o.predicted[ix(cls[free[r]])] * (o.measured_s - fixed);
      }
    }
    for (std::size_t r = 0; r < k; ++r) {
      a[r][r] += lambda * static_cast<double>(n - 1);
      for (std::size_t q = 0; q < k; ++q)
        if (q != r) a[r][q] -= lambda;
      b[r] += lambda * kMinMultiplier * static_cast<double>(n - k);  // ties to the pinned classes
    }
    std::vector<double> x;
    if (!solve(a, b, x)) return std::nullopt;
    for (std::size_t r = 0; r < k; ++r) {
      if (!std::isfinite(x[r]) || x[r] < kMinMultiplier) return std::nullopt;
      f.x[free[r]] = x[r];
    }
  }
  for (const auto& o : c.observations) {
    if (o.measured_s <= 0) continue;
    double p = o.fixed_s;
    for (std::size_t r = 0; r < n; ++r) p += o.predicted[ix(cls[r])] * f.x[r];
    f.objective += (p - o.measured_s) * (p - o.measured_s) / (o.measured_s * o.measured_s);
  }
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t q = r + 1; q < n; ++q) f.objective += lambda * (f.x[r] - f.x[q]) * (f.x[r] - f.x[q]);
  return f;
}

}  // namespace

void fit_multipliers(TableCalibration& c, const std::string& where) {
  std::vector<int> cls;  // observed classes: the unknowns
  for (int k = 0; k < kKernelClasses; ++k) {
    c.observed[ix(k)] = std::any_of(c.observations.begin(), c.observations.end(), [&](const CalibrationObservation& o) {
      return o.predicted[ix(k)] > 0 && o.measured_s > 0;
    });
    if (c.observed[ix(k)]) cls.push_back(k);
  }
  if (cls.empty())
    throw core::Error("calibrate: no measured time matches work the per-kernel model costs (nothing to fit)");
  const std::size_t n = cls.size();
  // The pull towards a common multiplier is weak (1e-6 of the data's mean curvature), so it decides
  // only what the observations leave open.
  double curvature = 0;
  for (const auto& o : c.observations)
    if (o.measured_s > 0)
      for (int k : cls) curvature += o.predicted[ix(k)] * o.predicted[ix(k)] / (o.measured_s * o.measured_s);
  const double lambda = 1e-6 * curvature / static_cast<double>(n);
  // Bounded least squares by its active sets: every choice of classes held at the bound (at most
  // 2^4), the feasible minimiser with the least objective.
  std::optional<Fit> best;
  unsigned best_pinned = 0;
  for (unsigned pinned = 0; pinned < (1u << n); ++pinned) {
    const std::optional<Fit> f = fit_with_pinned(c, cls, pinned, lambda);
    if (f && (!best || f->objective < best->objective - 1e-15)) best = f, best_pinned = pinned;
  }
  if (!best) throw core::Error("calibrate: the observations do not determine the multipliers (singular fit)");
  c.at_bound = {};
  for (std::size_t r = 0; r < n; ++r) {
    c.multiplier[ix(cls[r])] = best->x[r];
    c.at_bound[ix(cls[r])] = (best_pinned >> r & 1u) != 0;
    // The table it writes scales by 1 / multiplier, which a table accepts down to kMinTableScale.
    if (best->x[r] > 1 / kMinTableScale)
      throw core::Error(fmt::format(
          "{}: the measured times make {} kernels {:.3g} times slower than the table's, beyond the {:g} a "
          "calibrated table may scale: not this table's GPU and runtime, or a unit slipped (seconds, not us?)",
          where, to_string(static_cast<KernelClass>(cls[r])), best->x[r], 1 / kMinTableScale));
  }
}

namespace {

// An observation measured far FASTER than the table predicts (below kMinTableScale of its time: op
// times of 1 ns, a trace divided by --trace-steps 1e9) was fitted with every multiplier at its lower
// bound, 0.5, and the table written; the slower side is refused in fit_multipliers. `predicted_s`
// is the base table's whole time of what was measured.
void check_not_far_faster(const std::string& where, const std::string& what, double measured_s, double predicted_s) {
  if (!(predicted_s > 0) || measured_s >= kMinTableScale * predicted_s) return;
  const std::string how_far = measured_s > 0 ? fmt::format("{:.3g} times faster than", predicted_s / measured_s)
                                             : std::string("no time at all against");
  throw core::Error(fmt::format(
      "{}: {}: measured {:.3g} ms, {} the table's {:.3g} ms, beyond the {:g} a calibrated table may scale: not "
      "this table's GPU and runtime, or a unit slipped",
      where, what, measured_s * 1e3, how_far, predicted_s * 1e3, 1 / kMinTableScale));
}

}  // namespace

json TableCalibration::table_json(const std::string& name, const std::string& source) const {
  json obs = json::array();
  for (const auto& o : observations) {
    double fitted = o.fixed_s;
    json split = json::object();
    for (int k = 0; k < kKernelClasses; ++k) {
      fitted += o.predicted[ix(k)] * multiplier[ix(k)];
      if (o.predicted[ix(k)] > 0) split[to_string(static_cast<KernelClass>(k))] = o.predicted[ix(k)];
    }
    obs.push_back({{"what", o.what},
                   {"measured_s", o.measured_s},
                   {"base_predicted_s", split},
                   {"launch_floors_s", o.fixed_s},
                   {"fitted_s", fitted}});
  }
  json mult = json::object(), bound = json::array();
  for (int k = 0; k < kKernelClasses; ++k) {
    mult[to_string(static_cast<KernelClass>(k))] = observed[ix(k)] ? json(multiplier[ix(k)]) : json(nullptr);
    if (at_bound[ix(k)]) bound.push_back(to_string(static_cast<KernelClass>(k)));
  }
  return {{"name", name},
          {"base", base},
          {"gemm_scale", 1 / multiplier[0]},
          {"attention_scale", 1 / multiplier[1]},
          {"memory_scale", 1 / multiplier[2]},
          {"adamw_scale", 1 / multiplier[3]},
          {"calibration",
           {{"source", source},
            {"note",
             "scale = 1 / multiplier; multiplier = measured / base-table time per kernel class (null: not "
             "observed, base table kept)"},
            {"multipliers", mult},
            {"at_lower_bound", bound},
            {"observations", obs}}}};
}

TableCalibration calibrate_from_ops(const core::Program& program, const CostModel& cost, const Calibration& measured,
                                    const std::string& where) {
  // A COMPUTE or UPD op measured at 0 s is no measurement: the fit skipped it without a word.
  for (std::size_t i = 0; i < measured.entries.size(); ++i) {
    const CalibrationEntry& e = measured.entries[i];
    if ((e.kind == OpKind::Compute || e.kind == OpKind::Update) && !(e.seconds > 0))
      throw core::Error(fmt::format("{}: field 'entries[{}].seconds': a measured op time must be > 0 s, got {:g}",
                                    where, i, e.seconds));
  }
  TableCalibration c;
  std::map<std::tuple<int, int, double, std::int64_t>, bool> seen;  // one observation per distinct op class
  for (int d = 0; d < program.num_devices; ++d) {
    const core::Plan& plan = program.plan_for(d);
    for (const auto& stream : plan.streams)
      for (const auto& op : stream.ops) {
        if (op.kind != OpKind::Compute && op.kind != OpKind::Update) continue;
        const std::optional<double> m = measured.lookup(op, 1);
        if (!m) continue;
        if (!seen.emplace(std::tuple{static_cast<int>(op.kind), static_cast<int>(op.pass), op.flops, op.memory_bytes},
                          true)
                 .second)
          continue;
        CalibrationObservation o;
        o.what = fmt::format("{} {} (flops {:.4g}, memory bytes {})", core::to_string(op.kind),
                             core::to_string(op.pass), op.flops, op.memory_bytes);
        o.predicted = class_seconds(program, cost, d, op, &o.fixed_s);
        o.measured_s = *m;
        if (total(o.predicted) > 0) {
          check_not_far_faster(where, o.what, o.measured_s, o.fixed_s + total(o.predicted));
          c.observations.push_back(std::move(o));
        }
      }
  }
  fit_multipliers(c, where);
  return c;
}

bool classify_kernel(const std::string& name, KernelClass& out) {
  const std::string s = lower(name);
  auto has = [&](const char* w) { return s.find(w) != std::string::npos; };
  if (has("nccl")) return false;
  if (has("sdpa") || has("flash") || has("fmha") || has("attention") || has("attn"))
    out = KernelClass::Attention;
  else if (has("gemm") || has("nvjet") || has("cutlass") || has("xmma") || has("cublas") || has("s16816") ||
           has("wgmma"))
    out = KernelClass::Gemm;
  else if (has("multi_tensor_apply") || has("adam"))
    out = KernelClass::Adamw;
  else
    out = KernelClass::Memory;
  return true;
}

TableCalibration calibrate_from_trace(const core::Program& program, const CostModel& cost, const json& trace, int steps,
                                      int device, const std::string& where) {
  if (steps < 1) throw core::Error(fmt::format("{}: --trace-steps must be >= 1, got {}", where, steps));
  if (device < 0 || device >= program.num_devices)
    throw core::Error(
        fmt::format("{}: --device {} is not a device of the plan (0..{})", where, device, program.num_devices - 1));
  const json* events = &trace;
  if (trace.is_object()) {
    if (!trace.contains("traceEvents") || !trace.at("traceEvents").is_array())
      throw core::Error(where +
                        ": expected a Chrome trace (an object with a \"traceEvents\" array, or an array of events)");
    events = &trace.at("traceEvents");
  } else if (!trace.is_array()) {
    throw core::Error(where +
                      ": expected a Chrome trace (an object with a \"traceEvents\" array, or an array of events)");
  }
  ClassSeconds measured{};
  std::array<std::size_t, kKernelClasses> kernels_of{};  // kernel events per class
  std::size_t kernels = 0;
  // The GPU of each kernel event (the PyTorch profiler's "args": {"device": N}, else its "pid"): the
  // trace must be one GPU's, whose kernels add up to one device's step.
  std::set<std::string> gpus;
  for (std::size_t i = 0; i < events->size(); ++i) {
    const json& e = (*events)[i];
    if (!e.is_object()) continue;
    // value() of a non-string "ph" or "cat" threw json's type_error, which named neither file nor event.
    for (const char* key : {"ph", "cat"})
      if (e.contains(key) && !e.at(key).is_string())
        throw core::Error(fmt::format("{}: traceEvents[{}].{}: expected a string, got {}", where, i, key,
                                      core::printable(e.at(key).dump(), 40)));
    if (e.value("ph", "") != "X" || lower(e.value("cat", "")) != "kernel") continue;
    if (!e.contains("name") || !e.at("name").is_string() || !e.contains("dur") || !e.at("dur").is_number())
      throw core::Error(
          fmt::format("{}: traceEvents[{}]: a kernel event needs a string \"name\" and a number \"dur\"", where, i));
    const double dur = e.at("dur").get<double>();
    // At most 1e6 s, as a calibration file's "seconds": a sum of 1e300 µs made the fit's squares
    // overflow and the multiplier land on its lower bound, 0.5.
    if (!std::isfinite(dur) || dur < 0 || dur > 1e12)
      throw core::Error(
          fmt::format("{}: traceEvents[{}].dur: expected a duration in [0, 1e12] microseconds, got {}", where, i, dur));
    const auto args = e.find("args");
    if (args != e.end() && args->is_object() && args->contains("device"))
      gpus.insert(core::printable(args->at("device").dump(), 20));
    else if (e.contains("pid"))
      gpus.insert(core::printable(e.at("pid").dump(), 20));
    KernelClass k;
    if (!classify_kernel(e.at("name").get<std::string>(), k)) continue;
    measured[ix(static_cast<int>(k))] += dur * 1e-6 / steps;
    ++kernels_of[ix(static_cast<int>(k))];
    ++kernels;
  }
  if (kernels == 0)
    throw core::Error(where + ": no GPU kernel events (\"ph\": \"X\", \"cat\": \"kernel\") in the trace");
  if (gpus.size() > 1)
    throw core::Error(
        fmt::format("{}: kernel events of {} GPUs ({}, {}, ...: their \"args.device\" or \"pid\"): calibrate fits one "
                    "device's step; "
                    "give the trace of the GPU that ran --device {}",
                    where, gpus.size(), *gpus.begin(), *std::next(gpus.begin()), device));
  // Each step runs a kernel at least: more steps than kernels divided the trace's times by a count it
  // does not hold (--trace-steps 1e9 made every kernel a nanosecond's).
  if (static_cast<std::size_t>(steps) > kernels)
    throw core::Error(fmt::format(
        "{}: --trace-steps {}: more steps than the trace has GPU kernels ({}); give the steps the trace covers", where,
        steps, kernels));
  ClassSeconds predicted{};
  const core::Plan& plan = program.plan_for(device);
  for (const auto& stream : plan.streams)
    for (const auto& op : stream.ops) {
      if (op.kind != OpKind::Compute && op.kind != OpKind::Update) continue;
      const ClassSeconds s = class_seconds(program, cost, device, op);
      for (int k = 0; k < kKernelClasses; ++k) predicted[ix(k)] += s[ix(k)];
    }
  TableCalibration c;
  for (int k = 0; k < kKernelClasses; ++k) {
    const std::string what = to_string(static_cast<KernelClass>(k)) + " kernels of one step";
    // A class whose kernels took no time at all is as far from the table as 1 ns.
    if (kernels_of[ix(k)] > 0) check_not_far_faster(where, what, measured[ix(k)], predicted[ix(k)]);
    if (measured[ix(k)] <= 0 || predicted[ix(k)] <= 0) continue;
    CalibrationObservation o;
    o.what = what;
    o.predicted[ix(k)] = predicted[ix(k)];
    o.measured_s = measured[ix(k)];
    c.observations.push_back(std::move(o));
  }
  fit_multipliers(c, where);
  return c;
}

}  // namespace piper::sim
