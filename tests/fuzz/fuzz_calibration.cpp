// Fuzzes calibration files as `simulate --calibration FILE` reads them: text -> Calibration.
#include "fuzz_common.hpp"
#include "piper/sim/cost_model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  piper::fuzz::small_limits();
  piper::fuzz::rejects_cleanly([&] {
    const piper::sim::Calibration c = piper::sim::Calibration::parse(piper::fuzz::text_of(data, size), "fuzz.json");
    (void)c.to_json();
  });
  return 0;
}
