// Fuzzes Program (plan) JSON as `piper verify PLAN` and `piper simulate --plan PLAN` read it:
// text -> Program -> verifier; a plan that verifies clean is then simulated (analytic engine).
#include <memory>

#include <nlohmann/json.hpp>

#include "fuzz_common.hpp"
#include "piper/core/program.hpp"
#include "piper/core/verifier.hpp"
#include "piper/sim/simulate.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  piper::fuzz::small_limits();
  nlohmann::json j;
  try {
    const std::string text = piper::fuzz::text_of(data, size);
    piper::core::check_json_depth(text, "fuzz.json");  // as the CLI's reader does, before parsing
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return 0;  // the CLI reports "not valid JSON" before any library code runs
  } catch (const piper::core::LimitError& e) {
    piper::fuzz::require_one_line(e.what());
    return 0;
  }
  piper::fuzz::rejects_cleanly([&] {
    piper::core::Program program = piper::core::Program::from_json(j);
    for (const auto& issue : piper::core::verify(program)) piper::fuzz::require_one_line(issue.message.c_str());
    piper::core::verify_or_throw(program);
    piper::sim::SimulateOptions options;
    options.engine = "analytic";
    options.cluster = "dgx-h200";
    piper::sim::simulate_program(std::make_shared<const piper::core::Program>(std::move(program)), options);
  });
  return 0;
}
