// Regression tests for the input-handling bugs found while fuzzing the parsers (docs/reliability.md):
// each input used to crash, hit undefined behaviour, escape as an undocumented exception or be
// silently misread; now each is refused with a one-line error naming the file and field.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "piper/core/directives.hpp"
#include "piper/core/model.hpp"
#include "piper/core/pytorch_csv.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"

using nlohmann::json;
namespace core = piper::core;
namespace sim = piper::sim;

namespace {

// The message of the exception of type E that `fn` throws ("" if none), checked to be one line.
template <class E, class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    return m;
  }
  ADD_FAILURE() << "no error";
  return "";
}

// A shard degree of 2^32 was narrowed to int 0 and then divided the device count: SIGFPE.
TEST(FuzzRegressions, HugeShardDegreeIsRejectedNotDividedBy) {
  const json program =
      json::parse(R"([{"op": "shard", "filter": {"EP": "*"}, "devices": [0, 1], "degree": 4294967296}])");
  const std::string m = error_of<core::DirectiveError>([&] { core::parse_directives(program); });
  EXPECT_NE(m.find("directive 0 field 'degree'"), std::string::npos) << m;
}

// A filter index of 2^32 + 1 was narrowed to 1 and silently selected region 1.
TEST(FuzzRegressions, HugeFilterIndexIsRejectedNotWrapped) {
  const json program = json::parse(R"([{"op": "place", "filter": {"PP": 4294967297}, "devices": [0]}])");
  const std::string m = error_of<core::DirectiveError>([&] { core::parse_directives(program); });
  EXPECT_NE(m.find("directive 0 field 'filter.PP'"), std::string::npos) << m;
}

// bucket_size 1e308 MB became an infinite byte count converted to int64 (undefined behaviour).
TEST(FuzzRegressions, HugeBucketSizeIsRejected) {
  const json program = json::parse(R"([{"op": "replicate", "filter": {}, "devices": [0, 1], "bucket_size": 1e308}])");
  const std::string m = error_of<core::DirectiveError>([&] { core::parse_directives(program); });
  EXPECT_NE(m.find("directive 0 field 'bucket_size'"), std::string::npos) << m;
}

// Calibration integers given as huge floats were converted to int (undefined behaviour); a string
// key or flops escaped as nlohmann::json::type_error without naming the field.
TEST(FuzzRegressions, CalibrationNumbersAreTypeChecked) {
  const std::string head = R"({"format": "piper-calibration", "entries": [{"kind": "ALL_REDUCE", "seconds": 1, )";
  for (const auto& [field, value] : {std::pair{"group_size", "1e300"},
                                     {"bytes", "-5"},
                                     {"memory_bytes", "\"x\""},
                                     {"key", "3"},
                                     {"flops", "\"many\""}}) {
    const std::string text = head + "\"" + field + "\": " + value + "}]}";
    const std::string m = error_of<sim::ClusterError>([&] { sim::Calibration::parse(text, "cal.json"); });
    EXPECT_NE(m.find(std::string("cal.json: field 'entries[0].") + field + "'"), std::string::npos) << m;
  }
}

// Cluster overrides with "first"/"count" of 1e12 were converted to int (undefined behaviour) and
// looped over 10^12 node indices.
TEST(FuzzRegressions, ClusterOverrideRangesAreBounded) {
  for (const char* range :
       {R"("first": 1e12)", R"("first": 0, "count": 1e12)", R"("first": 0.5)", R"("first": 1, "count": 4)"}) {
    const std::string text =
        std::string(R"({"preset": "dgx-h200", "nodes": 2, "overrides": [{)") + range + R"(, "gpus_per_node": 4}]})";
    const std::string m = error_of<sim::ClusterError>([&] { sim::cluster_from_text(text, "c.json"); });
    EXPECT_NE(m.find("c.json: field 'overrides[0]."), std::string::npos) << m;
  }
}

// A stage number past int escaped from std::stoi as std::out_of_range: "internal error", exit 3.
TEST(FuzzRegressions, CsvNumbersPastIntAreOneLineErrors) {
  for (const char* csv : {"99999999999F0,0B0\n", "0F99999999999999999999,0B0\n"}) {
    const std::string m = error_of<std::invalid_argument>([&] { core::schedule_from_pytorch_csv(csv, "s.csv"); });
    EXPECT_NE(m.find("s.csv: row 1 (rank 0), column 1"), std::string::npos) << m;
  }
}

// A number too large for a double (1e400) makes nlohmann::json::parse throw out_of_range, not
// parse_error; readers caught only parse_error, so the exception escaped without the file name
// (found by fuzz_model in seconds).
TEST(FuzzRegressions, NumberOverflowInJsonNamesTheFile) {
  const std::string text = R"({"name": "m", "vocab": 1e400, "hidden": 64, "layers": 2, "heads": 4, "ffn": 128})";
  std::string m = error_of<core::ModelError>([&] { core::config_from_text(text, "m.json"); });
  EXPECT_NE(m.find("m.json: not JSON"), std::string::npos) << m;
  m = error_of<sim::ClusterError>([&] { sim::cluster_from_text(R"({"nodes": 1e400})", "c.json"); });
  EXPECT_NE(m.find("c.json"), std::string::npos) << m;
}

// A directive that is not an object (here a number) reached d.value("op", ...) in the PP balancing
// before parse_directives could name it: json::type_error escaped (found by fuzz_directives).
TEST(FuzzRegressions, NonObjectDirectiveIsNamedNotTypeError) {
  core::Scenario s;
  s.model = "qwen3-9m";
  s.directives = json::parse(R"([{"op": "place", "filter": {"PP": 0}, "devices": [0]}, 5])");
  s.directives_source = "p.json";
  std::string m = error_of<core::DirectiveError>([&] { core::compile_scenario(s); });
  EXPECT_NE(m.find("p.json: directive 1"), std::string::npos) << m;
  s.directives = json::parse(R"([{"op": 7, "filter": {"PP": 0}, "devices": [0]}])");  // "op" not a string
  m = error_of<core::DirectiveError>([&] { core::compile_scenario(s); });
  EXPECT_NE(m.find("p.json: directive 0 field 'op'"), std::string::npos) << m;
}

// The per-device balancing of regions that share a device (V placements) read the raw program
// before parse_directives: a negative device id indexed its load table at -3 (undefined behaviour),
// and a huge one sized it to 2^31 entries (found by fuzz_directives in CI). The largest int64 id
// then overflowed in parse_directives' message (id + 1 devices).
TEST(FuzzRegressions, OutOfRangeDeviceInSharedPlacementIsNamedNotIndexed) {
  core::Scenario s;
  s.model = "qwen3-9m";
  s.directives_source = "p.json";
  for (const char* bad : {"-3", "2147483647", "1e3", "9223372036854775807"}) {
    s.directives = json::parse(std::string(R"([{"op": "place", "filter": {"PP": 0}, "devices": [0, 2]},
                                                {"op": "place", "filter": {"PP": 1}, "devices": [2, )") +
                               bad + "]}]");
    const std::string m = error_of<core::DirectiveError>([&] { core::compile_scenario(s); });
    EXPECT_NE(m.find("p.json: directive 1 field 'devices[1]'"), std::string::npos) << bad << ": " << m;
  }
}

}  // namespace
