// Fuzzes sweep specs as `piper sweep SPEC` reads them: text -> SweepSpec -> its combinations.
#include "fuzz_common.hpp"
#include "piper/search/sweep.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  piper::fuzz::small_limits();
  piper::fuzz::rejects_cleanly([&] {
    const piper::search::SweepSpec spec =
        piper::search::SweepSpec::parse(piper::fuzz::text_of(data, size), "fuzz.json");
    for (const auto& point : piper::search::expand(spec)) (void)point.key();
  });
  return 0;
}
