// Fuzzes directive programs as `piper compile --directives FILE [--schedule 1f1b --microbatches 2]`
// reads them: JSON text -> Scenario -> compile_scenario (parse, passes, lowering, verifier).
#include <nlohmann/json.hpp>

#include "fuzz_common.hpp"
#include "piper/core/scenario.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  piper::fuzz::small_limits();
  // The input's length picks the mode (so seeds stay plain JSON files): a complete program, or a
  // placement-only one with the 1F1B schedule appended.
  const bool append = size % 2 == 1;
  const std::string text = piper::fuzz::text_of(data, size);
  nlohmann::json program;
  try {
    piper::core::check_json_depth(text, "fuzz.json");  // as the CLI's reader does, before parsing
    program = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return 0;  // the CLI reports "not valid JSON" before any library code runs
  } catch (const piper::core::LimitError& e) {
    piper::fuzz::require_one_line(e.what());
    return 0;
  }
  piper::fuzz::rejects_cleanly([&] {
    piper::core::Scenario s;
    s.model = "qwen3-9m";
    s.directives = program;
    s.directives_source = "fuzz.json";
    if (append) {
      s.append_schedule = true;
      s.strategy.schedule = "1f1b";
      s.strategy.microbatches = 2;
    }
    piper::core::compile_scenario(s);
  });
  return 0;
}
