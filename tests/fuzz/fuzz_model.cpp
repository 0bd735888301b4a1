// Fuzzes model files as `--model FILE` reads them (a Piper model spec or a Hugging Face config.json,
// told apart by "model_type"/"architectures"): text -> ModelConfig -> layers -> costs and PP balance.
#include "fuzz_common.hpp"
#include "piper/core/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  piper::fuzz::small_limits();
  piper::fuzz::rejects_cleanly([&] {
    const piper::core::ModelConfig config =
        piper::core::config_from_text(piper::fuzz::text_of(data, size), "fuzz.json");
    piper::core::Model model = piper::core::build_model(config);
    (void)model.parameter_count();
    piper::core::balance_pipeline(model, 2);
  });
  return 0;
}
