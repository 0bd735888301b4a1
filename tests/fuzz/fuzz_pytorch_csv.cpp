// Fuzzes PyTorch schedule CSVs as `piper schedule import-csv FILE` reads them: text -> schedule
// table -> directive program, then compiles that program as `compile --directives` would.
#include "fuzz_common.hpp"
#include "piper/core/pytorch_csv.hpp"
#include "piper/core/scenario.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  piper::fuzz::small_limits();
  piper::fuzz::rejects_cleanly([&] {
    const piper::core::ScheduleTable table =
        piper::core::schedule_from_pytorch_csv(piper::fuzz::text_of(data, size), "fuzz.csv");
    piper::core::Scenario s;
    s.model = "qwen3-9m";
    s.directives = piper::core::program_from_schedule_table(table, piper::core::StrategyOptions{}).to_json();
    s.directives_source = "fuzz.csv";
    piper::core::compile_scenario(s);
  });
  return 0;
}
