// The consistency checks Program::from_json applies to a plan read from JSON, beyond each field's own
// reading: the training shape, the microbatches its compute runs, and a model_spec, training block and
// GEMM kernels that still match what was compiled. Each throws PlanError naming the field
// ("plan: field 'P': ...").
#pragma once

#include <cstddef>
#include <string>

#include "piper/core/model.hpp"
#include "piper/core/program.hpp"

namespace piper::core::plan_checks {

[[noreturn]] void fail(const std::string& path, const std::string& message);
std::string at_index(const std::string& path, std::size_t i);

void check_training_shape(const Program& p);
void check_microbatches_run(const Program& p);
void check_spec_training(const Program& p);
void check_kernel_precision(const Program& p);
void check_spec_matches_segments(const Program& p, const Model& model);

}  // namespace piper::core::plan_checks
