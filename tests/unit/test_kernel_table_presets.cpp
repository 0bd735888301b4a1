// The built-in kernel-efficiency tables of the A100 SXM4 40/80 GB and the H100 SXM5, written from
// published microbenchmarks (sim/data/published_tables.py, sim/data/README.md). Expected values are read
// from the cited entries of the JSON files themselves and derived here by hand (FLOPs / rate + launch
// floor), not taken from the code under test.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/kernels.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/kernel_table.hpp"
#include "expect.hpp"

using namespace piper;
using namespace piper::sim;
using nlohmann::json;

using piper::test::error_of;
using piper::test::expect_rel;

namespace {

const char* const kPublished[] = {"kernels-a100-40gb-sxm.json", "kernels-a100-80gb-sxm.json", "kernels-h100-sxm.json"};
const char* const kSections[] = {"gemm", "attention", "memory_bound", "adamw", "attention_standard"};

json raw(const std::string& file) {
  std::ifstream in(std::string(PIPER_SOURCE_DIR) + "/sim/data/" + file);
  EXPECT_TRUE(in.good()) << file;
  return json::parse(in);
}

// The one cited entry of `section` whose source is `ref` (the test fails if there is not exactly one).
json cited_entry(const json& t, const std::string& section, const std::string& ref, const std::string& kernel = "") {
  json found;
  int n = 0;
  for (const auto& e : t[section])
    if (e.contains("source") && e["source"]["ref"] == ref && (kernel.empty() || e["kernel"] == kernel)) found = e, ++n;
  EXPECT_EQ(n, 1) << section << " " << ref << " " << kernel;
  return found;
}

// Every number printed in `text`.
std::vector<double> numbers_in(const std::string& text) {
  std::vector<double> v;
  static const std::regex num(R"([0-9]+(\.[0-9]+)?)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), num); it != std::sregex_iterator(); ++it)
    v.push_back(std::stod(it->str()));
  return v;
}

}  // namespace

TEST(KernelTablePresets, EveryBuiltInTableLoads) {
  const auto names = kernel_table_names();
  for (const char* n : {"a100-40gb-sxm", "a100-80gb-sxm", "h100-sxm", "h200-sxm"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
    const auto t = load_kernel_table(n);
    EXPECT_EQ(t->name, n);
    EXPECT_FALSE(t->gemm.empty()) << n;
    EXPECT_FALSE(t->attention.empty()) << n;
    EXPECT_FALSE(t->memory.empty()) << n;
    EXPECT_GT(t->adamw_bytes_per_s, 0) << n;
    EXPECT_GT(t->adamw_fp32_bytes_per_s, 0) << n;
  }
  // The GPU presets name them.
  EXPECT_EQ(load_cluster("dgx-a100-80g").gpu(0).kernel_table, "a100-80gb-sxm");
  EXPECT_EQ(load_cluster("dgx-h100").gpu(0).kernel_table, "h100-sxm");
  EXPECT_EQ(load_cluster("hgx-h800").gpu(0).kernel_table, "h100-sxm");
}

TEST(KernelTablePresets, EveryEntryIsCitedWithItsNumberOrDerivedByANamedRule) {
  for (const char* file : kPublished) {
    const json t = raw(file);
    EXPECT_EQ(t.value("cited", false), true) << file;
    int cited = 0, derived = 0;
    for (const char* section : kSections)
      for (const auto& e : t.value(section, json::array())) {
        ASSERT_NE(e.contains("source"), e.contains("derived")) << file << " " << section << " " << e.dump();
        if (e.contains("derived")) {
          EXPECT_TRUE(t["rules"].contains(e["derived"].get<std::string>())) << e.dump();
          ++derived;
          continue;
        }
        ++cited;
        const json& s = e["source"];
        const std::string quote = s["quote"];
        EXPECT_FALSE(quote.empty()) << e.dump();
        const json& src = t["sources"][s["ref"].get<std::string>()];
        EXPECT_EQ(src["url"].get<std::string>().rfind("https://", 0), 0u) << e.dump();
        // The entry's numbers are printed in its quote (standard attention: both passes' times).
        std::vector<double> values;
        for (const char* key : {"tflops", "gbps", "fwd_ms", "bwd_ms"})
          if (e.contains(key)) values.push_back(e[key].get<double>());
        EXPECT_FALSE(values.empty()) << e.dump();
        const auto nums = numbers_in(quote);
        for (double value : values)
          EXPECT_TRUE(std::any_of(nums.begin(), nums.end(), [&](double x) { return std::abs(x - value) < 1e-9; }))
              << file << ": " << value << " not in '" << quote << "'";
        if (std::string(section) == "attention_standard") {
          // "Table F: <row> / Table B: <row>", each row's columns sequence lengths 128, 256, ...: the
          // forward time is the first row's column of the entry's s, the backward the second's.
          const auto slash = quote.find(" / ");
          ASSERT_NE(slash, std::string::npos) << quote;
          const std::int64_t s_len = e["s"];
          std::size_t col = 0;
          while ((std::int64_t{128} << col) < s_len) ++col;
          for (const auto& [row, key] :
               {std::pair{quote.substr(0, slash), "fwd_ms"}, {quote.substr(slash + 3), "bwd_ms"}}) {
            std::vector<std::string> words;
            std::istringstream in(row);
            for (std::string w; in >> w;) words.push_back(w);
            ASSERT_GE(words.size(), 10u) << row;
            EXPECT_EQ(std::stod(words[words.size() - 10 + col]), e[key].get<double>()) << row << " s " << s_len;
          }
        }
      }
    EXPECT_GT(cited, 0) << file;
    EXPECT_GT(derived, 0) << file;
  }
}

TEST(KernelTablePresets, A100GemmAtTheCitedShapeTakesTheCitedRate) {
  // The published A100 SXM figure (Maximum Achievable Matmul FLOPS table): M x N x K at its TFLOP/s.
  const json e = cited_entry(raw("kernels-a100-80gb-sxm.json"), "gemm", "mamf");
  const std::int64_t m = e["m"], k = e["k"], n = e["n"];
  const double rate = e["tflops"].get<double>() * 1e12;
  const KernelTiming kt = CostModel(load_cluster("dgx-a100-80g")).timing(0);
  core::Kernel g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  // Compute-bound: its three bf16 matrices cross HBM (2,039 GB/s) in far less than the compute takes.
  const double memory = 2.0 * static_cast<double>(m * k + k * n + m * n) / 2039e9;
  ASSERT_LT(memory, g.flops / rate);
  expect_rel(kt.seconds(g), g.flops / rate + 2e-6);
}

TEST(KernelTablePresets, A100CopyAtTheCitedSizeTakesTheCitedBandwidth) {
  // The A100 40 GB stream 'scale' bandwidth, cited as the copy class at the bytes one launch moved.
  const json e = cited_entry(raw("kernels-a100-40gb-sxm.json"), "memory_bound", "rrze-stream-a100-40", "copy");
  const double bytes = e["bytes"], rate = e["gbps"].get<double>() * 1e9;
  const Cluster c =
      cluster_from_text(R"({"preset": "dgx-a100-80g", "node": {"gpu": {"kernel_table": "a100-40gb-sxm"}}})", "c.json");
  const KernelTiming kt = CostModel(c).timing(0);
  // A permute reads and writes its bf16 tensor once: 4 bytes per element, one launch (copy class).
  core::Kernel p;
  p.kind = core::KernelKind::Permute;
  p.elems = static_cast<std::int64_t>(bytes / 4);
  ASSERT_EQ(static_cast<double>(p.elems) * 4, bytes);
  expect_rel(kt.seconds(p), bytes / rate + 2e-6);
}

TEST(KernelTablePresets, DerivedEntriesFollowTheirRule) {
  // a100-compute: the H200 measurement x the ratio of the two cited MAMF figures (A100 SXM / H100 SXM).
  const json a100 = raw("kernels-a100-80gb-sxm.json"), h100 = raw("kernels-h100-sxm.json"),
             h200 = raw("kernels-h200-sxm.json");
  const double ratio = cited_entry(a100, "gemm", "mamf")["tflops"].get<double>() / [&] {
    for (const auto& e : h100["gemm"])
      if (e.contains("source") && e["source"]["ref"] == "mamf" && e["dtype"] == "bf16")
        return e["tflops"].get<double>();
    return 0.0;
  }();
  const auto h200t = load_kernel_table("h200-sxm"), a100t = load_kernel_table("a100-80gb-sxm");
  double h200_rate = 0, a100_rate = 0;
  for (const auto& g : h200["gemm"])
    if (g["dtype"] == "bf16" && g["m"] == 8192 && g["k"] == 4096 && g["n"] == 14336)
      h200_rate = g["tflops"].get<double>() * 1e12;
  for (const auto& g : a100["gemm"])
    if (g["dtype"] == "bf16" && g["m"] == 8192 && g["k"] == 4096 && g["n"] == 14336)
      a100_rate = g["tflops"].get<double>() * 1e12;
  ASSERT_GT(h200_rate, 0);
  // The file's derived entry is the H200's single-launch timing with its GPU part (the time less the
  // H200's dispatch latency, a host cost) over the ratio and the latency kept; the A100 table says
  // that latency, and the loader takes it off again: the loaded GPU time is the H200's over the ratio,
  // at most the A100 table's best cited bf16 rate (its MAMF figure, the best of a shape search).
  const double work = 2.0 * 8192 * 4096 * 14336, latency = h200t->gemm_dispatch_latency_s;
  const double h200_s = work / h200_rate, gpu_s = h200_s - latency;
  expect_rel(a100_rate, work / (gpu_s / ratio + latency), 1e-9);
  expect_rel(a100t->gemm_dispatch_latency_s, latency, 1e-5);
  double a100_best = 0;
  for (const auto& g : a100["gemm"])
    if (g["dtype"] == "bf16" && g.contains("source")) a100_best = std::max(a100_best, g["tflops"].get<double>() * 1e12);
  expect_rel(a100t->gemm_rate("bf16", 8192, 14336, 4096), std::min(work / (gpu_s / ratio), a100_best), 1e-5);
}

TEST(KernelTablePresets, CitationsAreCheckedOnLoad) {
  const std::string dir = ::testing::TempDir() + "/ktp-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  auto error_for = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return error_of([&] { load_kernel_table(dir + "/" + name); });
  };
  const std::string head =
      R"("cited": true, "sources": {"s": {"url": "https://example.org"}}, "rules": {"r": "x 0.5"})";
  const std::string entry = R"("dtype": "bf16", "m": 512, "k": 1024, "n": 1024, "tflops": 10)";
  // Sound: one cited and one derived entry.
  std::ofstream(dir + "/ok.json") << "{" << head << R"(, "gemm": [{)" << entry
                                  << R"(, "source": {"ref": "s", "quote": "10"}}, {)" << entry
                                  << R"(, "derived": "r"}]})";
  EXPECT_EQ(load_kernel_table(dir + "/ok.json")->gemm.size(), 2u);
  std::string e = error_for("none.json", "{" + head + R"(, "gemm": [{)" + entry + "}]}");
  EXPECT_NE(e.find("gemm[0]"), std::string::npos) << e;
  EXPECT_NE(e.find("\"source\""), std::string::npos) << e;
  e = error_for("noquote.json", "{" + head + R"(, "gemm": [{)" + entry + R"(, "source": {"ref": "s"}}]})");
  EXPECT_NE(e.find("gemm[0].source.quote"), std::string::npos) << e;
  e = error_for("badref.json",
                "{" + head + R"(, "gemm": [{)" + entry + R"(, "source": {"ref": "t", "quote": "10"}}]})");
  EXPECT_NE(e.find("gemm[0].source.ref"), std::string::npos) << e;
  e = error_for("badrule.json", "{" + head + R"(, "gemm": [{)" + entry + R"(, "derived": "q"}]})");
  EXPECT_NE(e.find("gemm[0].derived"), std::string::npos) << e;
  e = error_for("both.json", "{" + head + R"(, "gemm": [{)" + entry +
                                 R"(, "derived": "r", "source": {"url": "https://x", "quote": "10"}}]})");
  EXPECT_NE(e.find("both"), std::string::npos) << e;
  e = error_for("nourl.json", R"({"sources": {"s": {"title": "t"}}})");
  EXPECT_NE(e.find("sources.s.url"), std::string::npos) << e;
  e = error_for("mem.json", R"({"memory_bound": [{"kernel": "add", "gbps": 100, "bytes": 1e6, "s": 1e-5}]})");
  EXPECT_NE(e.find("memory_bound[0]"), std::string::npos) << e;
  // Without "cited", entries need no provenance (kernels.py's measured files have none).
  EXPECT_EQ(error_for("plain.json", R"({"gemm": [{)" + entry + "}]}"), "");
}

// The FlashAttention-2 paper's Figure 4(c) (A100, causal, head dim 64, forward + backward) sets every table's
// FlashAttention 1.x multipliers and the A100 tables' head-dim-64 attention (sim/data/README.md, 'fa2-paper').
TEST(KernelTablePresets, FlashAttentionFigureSetsFa1AndTheA100HeadDim64) {
  // FlashAttention 1.x: FlashAttention-2's rates times the geometric mean of FlashAttention / FlashAttention-2
  // in the FlashAttention-2 paper's Figure 4(c) (A100, causal, head dim 64; fwd + bwd TFLOP/s at 512 ... 16k),
  // forward and backward alike. By hand: ratios 58/88, 70/119, 77/140, 87/156, 92/165, 97/171.
  const double fa1_fa2[6][2] = {{58, 88}, {70, 119}, {77, 140}, {87, 156}, {92, 165}, {97, 171}};
  double log_sum = 0;
  for (const auto& p : fa1_fa2) log_sum += std::log(p[0] / p[1]);
  const double ratio = std::exp(log_sum / 6);
  EXPECT_NEAR(ratio, 0.5788, 1e-4);
  EXPECT_NE(raw("kernels-h100-sxm.json")["attention_kernels"]["fa1"]["source"]["quote"].get<std::string>().find(
                "FlashAttention 58 70 77 87 92 97; FlashAttention-2 88 119 140 156 165 171"),
            std::string::npos);
  for (const char* name : {"h100-sxm", "a100-80gb-sxm", "a100-40gb-sxm"}) {
    const auto& ak = load_kernel_table(name)->attention_kernels;
    expect_rel(ak.at("fa1").fwd_scale, ak.at("fa2").fwd_scale * ratio, 1e-5);
    expect_rel(ak.at("fa1").bwd_scale, ak.at("fa2").bwd_scale * ratio, 1e-5);
  }
  // The A100s' head-dim-64 attention at the figure's own shapes (16k tokens: batch 16384/s x 32 heads, causal)
  // runs FlashAttention-2's forward + backward rate of the figure (the pairs' second), the backward doing 2.5
  // times the work.
  for (const char* name : {"a100-80gb-sxm", "a100-40gb-sxm"}) {
    const auto a100 = load_kernel_table(name);
    for (int i = 0; i < 6; ++i) {
      const std::int64_t s = std::int64_t{512} << i;
      const double f = a100->attention_rate(false, 16384 / s, s, 32, 64),
                   b = a100->attention_rate(true, 16384 / s, s, 32, 64);
      expect_rel(3.5 / (1 / f + 2.5 / b), fa1_fa2[i][1] * 1e12, 1e-9);
    }
  }
}
