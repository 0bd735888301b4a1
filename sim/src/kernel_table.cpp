// Kernel efficiency tables: reading, the built-in tables and interpolation (the per-kernel timing is
// kernel_timing.cpp).
#include "piper/sim/kernel_table.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "piper/core/limits.hpp"
#include "piper/sim/cluster.hpp"

namespace piper::sim {

using nlohmann::json;

// kernel_tables_data.cpp (generated from sim/data/)
extern const char* const kKernelTableH200;
extern const char* const kKernelTableH100;
extern const char* const kKernelTableA100_40;
extern const char* const kKernelTableA100_80;

namespace {

double lg(double x) { return std::log2(std::max(1.0, x)); }

// Piecewise linear in log2(x) through sorted (x, y) points; constant outside their range.
double interp_log(const std::vector<std::pair<double, double>>& pts, double x) {
  if (pts.empty()) return 0;
  if (x <= pts.front().first) return pts.front().second;
  if (x >= pts.back().first) return pts.back().second;
  for (std::size_t i = 1; i < pts.size(); ++i)
    if (x <= pts[i].first) {
      const double a = lg(pts[i - 1].first), b = lg(pts[i].first);
      const double t = b > a ? (lg(x) - a) / (b - a) : 0;
      return pts[i - 1].second + t * (pts[i].second - pts[i - 1].second);
    }
  return pts.back().second;
}

// Inverse-distance weighting (power 2) over the `nearest` closest of `pts` in a log2 space: an exact
// hit returns its value.
double idw(const std::vector<std::pair<std::vector<double>, double>>& pts, const std::vector<double>& q,
           std::size_t nearest) {
  std::vector<std::pair<double, double>> d;  // (squared distance, value)
  d.reserve(pts.size());
  for (const auto& [x, v] : pts) {
    double s = 0;
    for (std::size_t i = 0; i < q.size(); ++i) s += (x[i] - q[i]) * (x[i] - q[i]);
    d.emplace_back(s, v);
  }
  std::sort(d.begin(), d.end());
  if (d.empty()) return 0;
  if (d.front().first < 1e-12) return d.front().second;
  double w = 0, sum = 0;
  for (std::size_t i = 0; i < std::min(nearest, d.size()); ++i) {
    w += 1 / d[i].first;
    sum += d[i].second / d[i].first;
  }
  return sum / w;
}

}  // namespace

// GEMMs: each measured (k, n) shape gives a curve over m (piecewise linear in log m, constant past
// the ends); the query's (k, n) mixes the 3 nearest shapes' curves by inverse distance in
// (log k, log n). Sizes below the table's smallest m or n leave the GPU's SMs idle: the kernel takes
// as long as at the smallest measured size, so the rate scales down with m and n. A dtype measured at
// fewer sizes of m than bf16 (tf32, fp32, fp8 at m = 8192 only) takes bf16's rate times the measured
// ratio of the two at its sizes.
double KernelTable::gemm_rate(const std::string& dtype_in, std::int64_t m, std::int64_t n, std::int64_t k,
                              std::int64_t batch) const {
  const std::string dtype = dtype_in == "fp16" ? "bf16" : dtype_in;
  // `below`: scale the rate down for an output smaller than the smallest measured one (false: the
  // rate at the clamped shape, as a ratio between dtypes needs).
  auto rate_of = [&](const std::string& dt, double mm, double nn, double kk, bool below = true) -> double {
    std::map<std::pair<std::int64_t, std::int64_t>, std::vector<std::pair<double, double>>> curves;
    double m_min = 0, n_min = 0;
    for (const auto& g : gemm)
      if (g.dtype == dt) {
        curves[{g.k, g.n}].emplace_back(static_cast<double>(g.m), g.flops_per_s);
        m_min = m_min == 0 ? g.m : std::min<double>(m_min, g.m);
        n_min = n_min == 0 ? g.n : std::min<double>(n_min, g.n);
      }
    if (curves.empty()) return 0;
    std::vector<std::pair<std::vector<double>, double>> pts;
    for (auto& [kn, c] : curves) {
      std::sort(c.begin(), c.end());
      pts.push_back({{lg(static_cast<double>(kn.first)), lg(static_cast<double>(kn.second))},
                     interp_log(c, std::max(mm, m_min))});
    }
    double r = idw(pts, {lg(kk), lg(std::max(nn, n_min))}, 3);
    // Below the table: a GEMM whose output is smaller than the smallest measured one (m_min x n_min)
    // leaves SMs idle, its rate scaled by the output's size; a thin one with a large output (a
    // batched P·V with N = head_dim) still fills the GPU, at the clamped shape's rate.
    const double out = mm * nn, out_min = m_min * n_min;
    if (below && out < out_min) r *= out / out_min;
    return r;
  };
  // A batched GEMM fills the GPU like one with batch times the rows.
  const double mm = static_cast<double>(m) * static_cast<double>(std::max<std::int64_t>(1, batch));
  const double nn = static_cast<double>(n), kk = static_cast<double>(k);
  if (dtype == "bf16") return rate_of("bf16", mm, nn, kk);
  std::vector<double> ms;
  for (const auto& g : gemm)
    if (g.dtype == dtype && std::find(ms.begin(), ms.end(), static_cast<double>(g.m)) == ms.end()) ms.push_back(g.m);
  if (ms.empty()) return 0;
  if (ms.size() >= 2) return rate_of(dtype, mm, nn, kk);
  // The dtype's ratio to bf16 at its one measured M and the query's (K, N), then bf16's curve.
  const double at = ms.front(), base = rate_of("bf16", at, nn, kk, false);
  return base > 0 ? rate_of("bf16", mm, nn, kk) * rate_of(dtype, at, nn, kk, false) / base : rate_of(dtype, mm, nn, kk);
}

// Attention: each measured head dimension is its own surface over (log s, log batch·heads), inverse
// distance among its 4 nearest measurements with the query clamped into that head dimension's measured
// box (a flash kernel's tiles fill the GPU at every measured size, so nothing is extrapolated); a head
// dimension between two measured ones is linear in log head_dim between their two surfaces, one outside
// them takes the nearest's. Kernels of different head dimensions are different tilings, so a measured
// head dimension is never mixed with another's points.
double KernelTable::attention_rate(bool backward, std::int64_t batch, std::int64_t s, std::int64_t heads,
                                   std::int64_t head_dim) const {
  if (attention.empty()) return 0;
  std::vector<std::int64_t> dims;  // the measured head dimensions, ascending
  for (const auto& a : attention)
    if (std::find(dims.begin(), dims.end(), a.head_dim) == dims.end()) dims.push_back(a.head_dim);
  std::sort(dims.begin(), dims.end());
  const auto surface = [&](std::int64_t dim) {
    double lo[2] = {1e300, 1e300}, hi[2] = {0, 0};
    std::vector<std::pair<std::vector<double>, double>> pts;
    for (const auto& a : attention) {
      if (a.head_dim != dim) continue;
      const double x[2] = {lg(a.s), lg(static_cast<double>(a.batch * a.heads))};
      for (int i = 0; i < 2; ++i) lo[i] = std::min(lo[i], x[i]), hi[i] = std::max(hi[i], x[i]);
      pts.push_back({{x[0], x[1]}, backward ? a.bwd_flops_per_s : a.fwd_flops_per_s});
    }
    std::vector<double> q = {lg(s), lg(static_cast<double>(batch * heads))};
    for (std::size_t i = 0; i < 2; ++i) q[i] = std::clamp(q[i], lo[i], hi[i]);
    return idw(pts, q, 4);
  };
  const auto above = std::lower_bound(dims.begin(), dims.end(), head_dim);
  if (above == dims.begin()) return surface(*above);
  if (above == dims.end()) return surface(dims.back());
  if (*above == head_dim) return surface(head_dim);
  const std::int64_t below = *std::prev(above);
  const double t = (lg(head_dim) - lg(below)) / (lg(*above) - lg(below));
  return surface(below) + t * (surface(*above) - surface(below));
}

double KernelTable::memory_rate(const std::string& kernel, double bytes) const {
  std::vector<std::pair<double, double>> c;
  for (const auto& m : memory)
    if (m.kernel == kernel) c.emplace_back(m.bytes, m.bytes_per_s);
  if (c.empty())
    for (const auto& m : memory)
      if (m.kernel == "add") c.emplace_back(m.bytes, m.bytes_per_s);
  std::sort(c.begin(), c.end());
  return interp_log(c, bytes);
}

double KernelTable::standard_attention_seconds_per_score(bool backward, bool dropout, const std::string& implementation,
                                                         double scores) const {
  const auto pick = [&](bool by_impl, bool by_dropout) {
    std::vector<std::pair<double, double>> c;
    for (const auto& a : standard_attention)
      if ((!by_impl || a.implementation == implementation) && (!by_dropout || a.dropout == dropout))
        c.emplace_back(a.scores, backward ? a.bwd_s_per_score : a.fwd_s_per_score);
    std::sort(c.begin(), c.end());
    return c;
  };
  for (const auto& [by_impl, by_dropout] : {std::pair{true, true}, {false, true}, {true, false}, {false, false}})
    if (auto c = pick(by_impl, by_dropout); !c.empty()) return interp_log(c, scores);
  return 0;
}

namespace {

struct TableReader {
  std::string where;
  [[noreturn]] void fail(const std::string& field, const std::string& m) const {
    throw ClusterError(fmt::format("{}: field '{}': {}", where, field, m));
  }
  double positive(const json& o, const char* key, const std::string& at) const {
    if (!o.is_object() || !o.contains(key) || !o.at(key).is_number()) fail(at + "." + key, "expected a number");
    const double v = o.at(key).get<double>();
    if (!std::isfinite(v) || v <= 0 || v > 1e18) fail(at + "." + key, fmt::format("must be in (0, 1e18], got {}", v));
    return v;
  }
  // A rate or a measured time: at least `floor` (`what` says it in units). Only (0, 1e18] was checked,
  // and a GEMM rate of 1e-300 TFLOP/s predicted a step of 300 digits (a time of 1e-300 ms, none).
  double at_least(const json& o, const char* key, const std::string& at, double floor, const char* what) const {
    const double v = positive(o, key, at);
    if (v < floor) fail(at + "." + key, fmt::format("must be >= {:g} ({}), got {:g}", floor, what, v));
    return v;
  }
  double tflops(const json& o, const char* key, const std::string& at) const {
    return at_least(o, key, at, 1e-3, "1 GFLOP/s");
  }
  // A shape (m, n, k, batch, heads, ...): a whole number in [1, 1e9] (0.5 truncated to 0, and products
  // of 1e18 overflowed int64).
  std::int64_t whole(const json& o, const char* key, const std::string& at) const {
    const double v = positive(o, key, at);
    if (v != std::floor(v) || v < 1 || v > 1e9)
      fail(at + "." + key, fmt::format("must be a whole number in [1, 1e9], got {}", v));
    return static_cast<std::int64_t>(v);
  }
  // Where a number came from (docs/cost-model.md, "Citations"): "source" {"url" or "ref" (a key of the
  // table's "sources"), "quote"} for a published figure, "derived" (a key of the table's "rules") for one
  // computed from another table by a stated rule. A table with "cited": true needs one on every entry.
  void provenance(const json& e, const std::string& at, const json& top, bool cited) const {
    if (!e.is_object()) return;
    const bool has_source = e.contains("source"), has_derived = e.contains("derived");
    if (has_source && has_derived) fail(at, "has both 'source' and 'derived' (a number is either cited or derived)");
    if (has_source) {
      const json& s = e.at("source");
      if (!s.is_object()) fail(at + ".source", "expected an object with \"url\" or \"ref\", and \"quote\"");
      if (!s.contains("quote") || !s.at("quote").is_string() || s.at("quote").get<std::string>().empty())
        fail(at + ".source.quote", "expected the quoted text the number is read from");
      if (s.contains("ref")) {
        if (!s.at("ref").is_string()) fail(at + ".source.ref", "expected a key of \"sources\"");
        const std::string ref = s.at("ref").get<std::string>();
        if (!top.contains("sources") || !top.at("sources").contains(ref))
          fail(at + ".source.ref", "'" + ref + "' is not a key of the table's \"sources\"");
      } else if (!s.contains("url") || !s.at("url").is_string() || s.at("url").get<std::string>().empty()) {
        fail(at + ".source", "expected \"url\" or \"ref\"");
      }
    } else if (has_derived) {
      if (!e.at("derived").is_string()) fail(at + ".derived", "expected the name of a rule in \"rules\"");
      const std::string rule = e.at("derived").get<std::string>();
      if (!top.contains("rules") || !top.at("rules").contains(rule))
        fail(at + ".derived", "'" + rule + "' is not a key of the table's \"rules\"");
    } else if (cited) {
      fail(at, "the table is \"cited\": every entry needs a \"source\" (url and quote) or \"derived\" (a rule)");
    }
  }
  // The table's "sources" ({key: {"url": ..., ...}}), "rules" ({key: "text"}) and "cited" (bool).
  bool provenance_lists(const json& j) const {
    if (j.contains("sources")) {
      if (!j.at("sources").is_object()) fail("sources", "expected an object of {\"url\": ...} by key");
      for (const auto& [key, s] : j.at("sources").items())
        if (!s.is_object() || !s.contains("url") || !s.at("url").is_string() || s.at("url").get<std::string>().empty())
          fail("sources." + key + ".url", "expected a non-empty string");
    }
    if (j.contains("rules")) {
      if (!j.at("rules").is_object()) fail("rules", "expected an object of rule texts by key");
      for (const auto& [key, t] : j.at("rules").items())
        if (!t.is_string() || t.get<std::string>().empty()) fail("rules." + key, "expected the rule's text");
    }
    if (j.contains("cited") && !j.at("cited").is_boolean()) fail("cited", "expected true or false");
    return j.contains("cited") && j.at("cited").get<bool>();
  }
  const json& list(const json& j, const char* key) const {
    static const json empty = json::array();
    if (!j.contains(key)) return empty;
    if (!j.at(key).is_array()) fail(key, "expected an array");
    return j.at(key);
  }
  // Calls f(entry, "key[i]") for each entry of the list `key` (none where absent), its provenance checked.
  template <class F>
  void entries(const json& j, const char* key, bool cited, F&& f) const {
    const json& l = list(j, key);
    for (std::size_t i = 0; i < l.size(); ++i) {
      const std::string at = fmt::format("{}[{}]", key, i);
      provenance(l[i], at, j, cited);
      f(l[i], at);
    }
  }
};

}  // namespace

// KernelTable::gemm_dispatch_latency_s: the estimate (or the given value) taken off every GEMM entry
// that is not cited.
void remove_dispatch_latency(const TableReader& r, const json& v, KernelTable& t) {
  double latency = 0;
  if (v.is_number()) {
    latency = v.get<double>() * 1e-6;
    if (!std::isfinite(latency) || latency < 0 || latency > 1)
      r.fail("gemm_dispatch_latency", "expected \"estimate\" or µs in [0, 1e6]");
  } else if (v == "estimate") {
    std::map<std::tuple<std::string, std::int64_t, std::int64_t>, std::vector<std::pair<double, double>>>
        curves;  // M, seconds
    for (const auto& g : t.gemm)
      if (!g.cited) curves[{g.dtype, g.k, g.n}].emplace_back(g.m, 2.0 * g.m * g.n * g.k / g.flops_per_s);
    std::vector<double> at_zero;
    for (auto& [key, c] : curves) {
      if (c.size() < 2) continue;
      std::sort(c.begin(), c.end());
      const auto [m1, t1] = c[0];
      const auto [m2, t2] = c[1];
      at_zero.push_back(t1 - (t2 - t1) / (m2 - m1) * m1);
    }
    if (at_zero.size() < 3)
      r.fail("gemm_dispatch_latency", "\"estimate\" needs 3 or more GEMM curves measured at 2 or more M");
    std::sort(at_zero.begin(), at_zero.end());
    const std::size_t n = at_zero.size();
    latency = std::max(0.0, n % 2 ? at_zero[n / 2] : (at_zero[n / 2 - 1] + at_zero[n / 2]) / 2);
  } else {
    r.fail("gemm_dispatch_latency", "expected \"estimate\" or a number of µs");
  }
  t.gemm_dispatch_latency_s = latency;
  // No shape outruns the GPU: a corrected rate stays at most the best rate of its dtype that a cited
  // figure gives (a published shape search's best), or without one the table's best before the
  // correction. The intercept estimate also takes in the small-M inefficiency of each curve, so
  // uncapped it lifts mid-size GEMMs past the best of a shape search.
  std::map<std::string, double> best, best_cited;
  for (const auto& g : t.gemm) {
    best[g.dtype] = std::max(best[g.dtype], g.flops_per_s);
    if (g.cited) best_cited[g.dtype] = std::max(best_cited[g.dtype], g.flops_per_s);
  }
  for (const auto& [dtype, rate] : best_cited) best[dtype] = rate;
  for (auto& g : t.gemm) {
    if (g.cited) continue;
    const double work = 2.0 * g.m * g.n * g.k, s = work / g.flops_per_s;
    g.flops_per_s = std::min(work / std::max(s - latency, s / 4), best[g.dtype]);
  }
}

// The table reader: one block per list of the file (GEMM, attention, memory-bound, AdamW), each checked
// where it is read, then the scales applied together; kept whole so that one format's rules sit together.
KernelTable KernelTable::from_json(const json& j, const std::string& where) {  // NOLINT(readability-function-size)
  const TableReader r{where};
  if (!j.is_object()) r.fail("(top level)", "expected an object");
  // kernels.py also records the GPU ("device", "sms", "torch", "cudnn") and its copy rates ("copy");
  // `piper calibrate` its fit ("calibration").
  static constexpr std::string_view kKnown[] = {"name",
                                                "comment",
                                                "device",
                                                "sms",
                                                "torch",
                                                "cudnn",
                                                "copy",
                                                "calibration",
                                                "base",
                                                "compute_scale",
                                                "memory_scale",
                                                "gemm_scale",
                                                "attention_scale",
                                                "adamw_scale",
                                                "launch_floor_us",
                                                "gemm_dispatch_latency",
                                                "gemm",
                                                "attention",
                                                "attention_kernels",
                                                "memory_bound",
                                                "attention_standard",
                                                "adamw",
                                                "sources",
                                                "rules",
                                                "cited"};
  if (auto u = core::unknown_field(j, kKnown)) r.fail(u->key, u->message);
  KernelTable t;
  double compute_scale = 1, memory_scale = 1, gemm_scale = 1, attention_scale = 1, adamw_scale = 1;  // rate multipliers
  if (j.contains("base")) {
    // A built-in table only: a file naming itself (or another file) recursed without end (SIGSEGV).
    const auto names = kernel_table_names();
    if (!j.at("base").is_string() ||
        std::find(names.begin(), names.end(), j.at("base").get<std::string>()) == names.end())
      r.fail("base", fmt::format("expected a built-in table name ({}), got {}", fmt::join(names, ", "),
                                 core::printable(j.at("base").dump(), 80)));
    t = *load_kernel_table(j.at("base").get<std::string>());
    // A scale is a rate multiplier of the base table, at most 1000 times either way: beyond that it
    // describes another machine, or a unit slipped (what `piper calibrate` refuses to fit, too).
    const auto scale = [&](const char* key) {
      const double v = r.positive(j, key, "");
      if (v < kMinTableScale || v > 1 / kMinTableScale)
        r.fail(key, fmt::format("must be in [{}, {}] (a rate multiplier of the base table), got {}", kMinTableScale,
                                1 / kMinTableScale, v));
      return v;
    };
    if (j.contains("compute_scale")) compute_scale = scale("compute_scale");
    if (j.contains("memory_scale")) memory_scale = scale("memory_scale");
    // Per-class scales (`piper calibrate` writes them): GEMM, attention and AdamW rates apart.
    if (j.contains("gemm_scale")) gemm_scale = scale("gemm_scale");
    if (j.contains("attention_scale")) attention_scale = scale("attention_scale");
    if (j.contains("adamw_scale")) adamw_scale = scale("adamw_scale");
  } else {
    // Without a base they scaled nothing, silently.
    for (const char* key : {"compute_scale", "memory_scale", "gemm_scale", "attention_scale", "adamw_scale"})
      if (j.contains(key)) r.fail(key, "scales a built-in table: give \"base\" too");
  }
  t.name = j.contains("name") && j.at("name").is_string() ? j.at("name").get<std::string>() : where;
  if (j.contains("launch_floor_us")) {
    if (!j.at("launch_floor_us").is_number() || !(j.at("launch_floor_us").get<double>() >= 0) ||
        j.at("launch_floor_us").get<double>() > 1e6)
      r.fail("launch_floor_us", "expected a number in [0, 1e6]");
    t.launch_floor_s = j.at("launch_floor_us").get<double>() * 1e-6;
  }
  const bool cited = r.provenance_lists(j);
  const json& gemm = r.list(j, "gemm");
  for (std::size_t i = 0; i < gemm.size(); ++i) {
    const json& g = gemm[i];
    const std::string at = fmt::format("gemm[{}]", i);
    if (g.is_object() && g.contains("error")) continue;  // kernels.py records shapes that failed
    r.provenance(g, at, j, cited);
    Gemm e;
    if (!g.is_object() || !g.contains("dtype") || !g.at("dtype").is_string())
      r.fail(at + ".dtype", "expected a string");
    e.dtype = g.at("dtype").get<std::string>();
    static const char* kDtypes[] = {"bf16", "fp16", "fp32", "tf32", "fp8"};
    if (std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const char* d) { return e.dtype == d; }) ==
        std::end(kDtypes))
      r.fail(at + ".dtype", "unknown dtype '" + e.dtype + "' (expected bf16, fp16, fp32, tf32 or fp8)");
    e.m = r.whole(g, "m", at);
    e.n = r.whole(g, "n", at);
    e.k = r.whole(g, "k", at);
    e.flops_per_s = r.tflops(g, "tflops", at) * 1e12;
    e.cited = g.contains("source");
    t.gemm.push_back(e);
  }
  if (j.contains("gemm_dispatch_latency")) remove_dispatch_latency(r, j.at("gemm_dispatch_latency"), t);
  r.entries(j, "attention", cited, [&](const json& a, const std::string& at) {
    Attention e;
    e.batch = r.whole(a, "b", at);
    e.s = r.whole(a, "s", at);
    e.heads = r.whole(a, "heads", at);
    e.kv_heads = a.contains("kv_heads") ? r.whole(a, "kv_heads", at) : e.heads;
    e.head_dim = r.whole(a, "head_dim", at);
    e.fwd_flops_per_s = r.tflops(a, "fwd_tflops", at) * 1e12;
    e.bwd_flops_per_s = r.tflops(a, "bwd_tflops", at) * 1e12;
    t.attention.push_back(e);
  });
  if (j.contains("attention_kernels")) {
    const json& ak = j.at("attention_kernels");
    if (!ak.is_object())
      r.fail("attention_kernels", "expected an object of {\"fwd_scale\", \"bwd_scale\"} by implementation name");
    for (const auto& [name, v] : ak.items()) {
      const std::string at = "attention_kernels." + name;
      r.provenance(v, at, j, cited);
      // Rate multipliers of the table's attention, bounded as the table's own scales.
      const json& entry = v;  // a structured binding is not captured by a lambda before C++20's clang 16
      const auto scale = [&](const char* key) {
        const double x = r.positive(entry, key, at);
        if (x < kMinTableScale || x > 1 / kMinTableScale)
          r.fail(at + "." + key, fmt::format("must be in [{}, {}] (a rate multiplier of the table's attention), got {}",
                                             kMinTableScale, 1 / kMinTableScale, x));
        return x;
      };
      t.attention_kernels[name] = {scale("fwd_scale"), scale("bwd_scale")};
    }
  }
  const json& mem = r.list(j, "memory_bound");
  for (std::size_t i = 0; i < mem.size(); ++i) {
    const json& m = mem[i];
    const std::string at = fmt::format("memory_bound[{}]", i);
    Memory e;
    if (!m.is_object() || !m.contains("kernel") || !m.at("kernel").is_string())
      r.fail(at + ".kernel", "expected a string");
    r.provenance(m, at, j, cited);
    e.kernel = m.at("kernel").get<std::string>();
    e.bytes_per_s = r.at_least(m, "gbps", at, 1e-3, "1 MB/s") * 1e9;
    // What one launch moved: given ("bytes"), or the measured time ("s", as kernels.py writes) at that rate.
    if (m.contains("bytes") == m.contains("s")) r.fail(at, "expected one of \"bytes\" (moved per launch) and \"s\"");
    e.bytes = m.contains("bytes") ? r.positive(m, "bytes", at) : e.bytes_per_s * r.at_least(m, "s", at, 1e-9, "1 ns");
    if (e.kernel == "cross_entropy_fwd_fp32") {
      // kernels.py counts this op (F.cross_entropy(logits.float(), target)) at 6 bytes a logit; it
      // moves 14 (the cast reads 2 and writes 4, log_softmax reads 4 and writes 4), the bytes the
      // cost model counts for the loss (elementwise_cost): the entry's rate and size are in bytes moved.
      constexpr double kBytesMovedPerCounted = 14.0 / 6.0;
      e.bytes_per_s *= kBytesMovedPerCounted;
      e.bytes *= kBytesMovedPerCounted;
    }
    t.memory.push_back(e);
  }
  r.entries(j, "attention_standard", cited, [&](const json& a, const std::string& at) {
    StandardAttention e;
    // The implementations the runtime profiles name (standard_attention_implementation).
    if (!a.is_object() || !a.contains("implementation") || !a.at("implementation").is_string() ||
        (a.at("implementation").get<std::string>() != "megatron" &&
         a.at("implementation").get<std::string>() != "pytorch"))
      r.fail(at + ".implementation", "expected \"megatron\" or \"pytorch\"");
    e.implementation = a.at("implementation").get<std::string>();
    if (!a.contains("dropout") || !a.at("dropout").is_boolean()) r.fail(at + ".dropout", "expected true or false");
    e.dropout = a.at("dropout").get<bool>();
    // Timed in a 2-byte dtype: the core is memory-bound on its scores, whose bytes the dtype sets.
    if (!a.contains("dtype") || !a.at("dtype").is_string() ||
        (a.at("dtype").get<std::string>() != "fp16" && a.at("dtype").get<std::string>() != "bf16"))
      r.fail(at + ".dtype", "expected \"fp16\" or \"bf16\" (the core is timed in a 2-byte dtype)");
    const auto s = static_cast<double>(r.whole(a, "s", at));
    e.scores = static_cast<double>(r.whole(a, "b", at)) * static_cast<double>(r.whole(a, "heads", at)) * s * s;
    r.whole(a, "head_dim", at);  // checked, not used: the time is per score (docs/cost-model.md)
    e.fwd_s_per_score = r.at_least(a, "fwd_ms", at, 1e-6, "1 ns") * 1e-3 / e.scores;
    e.bwd_s_per_score = r.at_least(a, "bwd_ms", at, 1e-6, "1 ns") * 1e-3 / e.scores;
    t.standard_attention.push_back(e);
  });
  // Fused AdamW, bf16 parameters with fp32 moments (kernels.py): per parameter it reads the
  // parameter, gradient and both moments and writes the parameter and moments: 2+2+4+4 + 2+4+4 = 22
  // bytes; fp32 parameters: 28. The largest measured run of each gives its bandwidth.
  double best = 0, best32 = 0;
  r.entries(j, "adamw", cited, [&](const json& a, const std::string& at) {
    const double params = r.positive(a, "params", at), s = r.at_least(a, "s", at, 1e-9, "1 ns");
    const std::string dt = a.is_object() && a.contains("param_dtype") && a.at("param_dtype").is_string()
                               ? a.at("param_dtype").get<std::string>()
                               : "torch.bfloat16";
    if (dt.find("float32") != std::string::npos) {
      if (params >= best32) best32 = params, t.adamw_fp32_bytes_per_s = params * 28 / s;
    } else if (params >= best) {
      best = params, t.adamw_bytes_per_s = params * 22 / s;
    }
  });
  for (auto& g : t.gemm) g.flops_per_s *= compute_scale * gemm_scale;
  for (auto& a : t.attention)
    a.fwd_flops_per_s *= compute_scale * attention_scale, a.bwd_flops_per_s *= compute_scale * attention_scale;
  for (auto& m : t.memory) m.bytes_per_s *= memory_scale;
  for (auto& a : t.standard_attention) a.fwd_s_per_score /= memory_scale, a.bwd_s_per_score /= memory_scale;
  // AdamW is memory-bound: memory_scale applies to it unless adamw_scale is given.
  const double adamw = j.contains("adamw_scale") ? adamw_scale : memory_scale;
  t.adamw_bytes_per_s *= adamw;
  t.adamw_fp32_bytes_per_s *= adamw;
  return t;
}

std::vector<std::string> kernel_table_names() { return {"a100-40gb-sxm", "a100-80gb-sxm", "h100-sxm", "h200-sxm"}; }

const KernelTable::AttentionKernel& KernelTable::attention_kernel(const std::string& kernel) const {
  if (const auto it = attention_kernels.find(kernel); it != attention_kernels.end()) return it->second;
  std::string known;
  for (const auto& [k, v] : attention_kernels) known += (known.empty() ? "" : ", ") + k;
  throw std::invalid_argument(fmt::format("kernel table '{}' has no attention kernel '{}' (it has: {})", name, kernel,
                                          known.empty() ? "none" : known));
}

namespace {
// The table whose "attention_standard" entries the others derive theirs from, and the copy size compared.
constexpr const char* kStandardAttentionTable = "a100-40gb-sxm";
constexpr double kStandardAttentionCopyBytes = 1073741824.0;
}  // namespace

std::shared_ptr<const KernelTable> load_kernel_table(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const KernelTable>> cache;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(name); it != cache.end()) return it->second;
  }
  KernelTable t;
  auto parse = [&](const std::string& text, const std::string& where) {
    json j;
    try {
      j = core::parse_json(text, where);
    } catch (const json::exception& e) {
      std::string m = e.what();
      std::replace(m.begin(), m.end(), '\n', ' ');
      throw ClusterError(where + ": " + m);
    }
    return KernelTable::from_json(j, where);
  };
  // Built in (sim/data/, compiled in): the H200's measured table, and the published-microbenchmark tables
  // of the A100 SXM4 40/80 GB and the H100 SXM5 written by sim/data/published_tables.py (every entry cited
  // or derived from the H200's by a stated rule; sim/data/README.md).
  static const std::map<std::string, const char*> kBuiltIn = {{"h200-sxm", kKernelTableH200},
                                                              {"h100-sxm", kKernelTableH100},
                                                              {"a100-40gb-sxm", kKernelTableA100_40},
                                                              {"a100-80gb-sxm", kKernelTableA100_80}};
  if (const auto it = kBuiltIn.find(name); it != kBuiltIn.end()) {
    std::string text = it->second;
    // The H200 file is kernels.py's output as measured, its GEMMs timed one launch at a time
    // (KernelTable::gemm_dispatch_latency_s); the published tables say so themselves.
    if (name == "h200-sxm") text.insert(text.find('{') + 1, R"("gemm_dispatch_latency": "estimate",)");
    t = parse(text, name);
    t.name = name;
    // Other attention implementations: the H100's (published_tables.py, cited), the same GH100 die.
    if (name == "h200-sxm") t.attention_kernels = load_kernel_table("h100-sxm")->attention_kernels;
  } else {
    t = parse(core::read_input_file(name), name);
  }
  // Standard attention measured on one GPU only (the A100-40GB's cited entries): elsewhere the same
  // core, memory-bound on its scores, at the ratio of the two tables' copy bandwidth (1 GiB moved).
  if (t.standard_attention.empty() && name != kStandardAttentionTable) {
    const auto a100 = load_kernel_table(kStandardAttentionTable);
    const double here = t.memory_rate("copy", kStandardAttentionCopyBytes),
                 there = a100->memory_rate("copy", kStandardAttentionCopyBytes);
    if (here > 0 && there > 0) {
      t.standard_attention = a100->standard_attention;
      for (auto& a : t.standard_attention) a.fwd_s_per_score *= there / here, a.bwd_s_per_score *= there / here;
    }
  }
  auto shared = std::make_shared<const KernelTable>(std::move(t));
  std::lock_guard<std::mutex> lock(mu);
  return cache.emplace(name, std::move(shared)).first->second;
}

}  // namespace piper::sim
