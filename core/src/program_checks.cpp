// Program::from_json's consistency checks (program_checks.hpp): what a hand-edited plan can get wrong
// that no single field's reading sees.
#include "program_checks.hpp"

#include <algorithm>
#include <cstdint>
#include <fmt/format.h>
#include <vector>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"

namespace piper::core::plan_checks {

void fail(const std::string& path, const std::string& message) {
  throw PlanError("plan: field '" + path + "': " + message);
}

std::string at_index(const std::string& path, std::size_t i) { return path + "[" + std::to_string(i) + "]"; }

// A plan's training shape, with the rules a compile applies (model validation and limits.hpp), checked
// before anything is sized by it: seq_len 0 divided by zero in the runtime, 0 microbatches trained to
// NaN, a negative micro-batch size trained with loss -0 and a 10^7-token sequence ended in bad_alloc.
void check_training_shape(const Program& p) {
  const auto& t = p.training;
  if (t.seq_len < 1) fail("training.seq_len", "must be >= 1, got " + std::to_string(t.seq_len));
  if (t.micro_batch_size < 1)
    fail("training.micro_batch_size", "must be >= 1, got " + std::to_string(t.micro_batch_size));
  if (p.microbatches < 1) fail("microbatches", "must be >= 1, got " + std::to_string(p.microbatches));
  check_limit(Limit::TokensPerMicrobatch, t.seq_len, "plan: field 'training.seq_len'", "tokens");
  check_limit(Limit::TokensPerMicrobatch, t.micro_batch_size, "plan: field 'training.micro_batch_size'", "sequences");
  // Saturated: both factors are within the limit, which an override may set near INT64_MAX.
  const std::int64_t tokens = t.seq_len > INT64_MAX / t.micro_batch_size ? INT64_MAX : t.seq_len * t.micro_batch_size;
  check_limit(Limit::TokensPerMicrobatch, tokens, "plan: field 'training'", "tokens per microbatch");
}

// "microbatches" sizes the step (the runtime's batch and loss normalisation, tokens per step), and every
// device that computes runs each of its microbatches: a plan edited from 2 to 4 trained on 2 with the loss
// divided by 4 (half the reference's), and one whose ops ran microbatch 0 twice and 1 never trained on
// another batch; both verified ok. Op indices past it are refused op by op.
void check_microbatches_run(const Program& p) {
  // seen[m] = 1 + the last plan that ran m: one pass over the ops, whatever the plan count.
  std::vector<std::size_t> seen(static_cast<std::size_t>(p.microbatches), 0);
  for (std::size_t i = 0; i < p.plans.size(); ++i) {
    std::int64_t distinct = 0;
    for (const Stream& s : p.plans[i].streams)
      for (const Op& op : s.ops)
        if (op.kind == OpKind::Compute && op.microbatch >= 0 &&
            seen[static_cast<std::size_t>(op.microbatch)] != i + 1) {
          seen[static_cast<std::size_t>(op.microbatch)] = i + 1;
          ++distinct;
        }
    if (distinct == 0 || distinct == p.microbatches) continue;
    const auto missing = std::find_if(seen.begin(), seen.end(), [&](std::size_t v) { return v != i + 1; });
    fail("microbatches", fmt::format("{}, but the compute ops of plans[{}] run no microbatch {} (a device that "
                                     "computes runs microbatches 0 to microbatches - 1)",
                                     p.microbatches, i, missing - seen.begin()));
  }
}

// A plan whose "model_spec" was edited after compiling (say "vocab" 64 to 128, or another "layers")
// simulated and ran with the ops compiled from the old spec, while `run` built its model from the new
// one. The spec must still give each segment the layers and parameter count the plan records (its ops
// were costed from them): every segment's layers lie within the spec's, the last ends at the spec's
// last layer, and each segment holds the sum of its layers' parameters. Edits that keep every
// segment's parameter count (the attention kernel, a routing top_k) are not seen here.
// The compiler writes the plan's "training" into its "model_spec" too (compiler.cpp), so the two
// agree in every plan it wrote. One edited alone (a plan's "precision" bf16 to fp32 changed its step
// time but not its buffers or kernels; "seq_len" changed what `run` trains but no op) is refused.
void check_spec_training(const Program& p) {
  const TrainingShape spec = config_from_spec_json(p.model_spec, "plan: field 'model_spec'").training;
  const TrainingShape& t = p.training;
  auto differ = [&](const char* field, const std::string& plan, const std::string& in_spec) {
    fail(std::string("training.") + field,
         fmt::format("{}, but model_spec.training.{} is {}: the compiler writes both alike, so one was edited after "
                     "compiling (compile the plan again)",
                     plan, field, in_spec));
  };
  if (t.seq_len != spec.seq_len) differ("seq_len", std::to_string(t.seq_len), std::to_string(spec.seq_len));
  if (t.micro_batch_size != spec.micro_batch_size)
    differ("micro_batch_size", std::to_string(t.micro_batch_size), std::to_string(spec.micro_batch_size));
  if (t.precision != spec.precision) differ("precision", to_string(t.precision), to_string(spec.precision));
  if (t.fp32_main_grads != spec.fp32_main_grads)
    differ("fp32_main_grads", t.fp32_main_grads ? "true" : "false", spec.fp32_main_grads ? "true" : "false");
  if (t.grad_accumulation != spec.grad_accumulation)
    differ("main_grad_accumulation", to_string(t.grad_accumulation), to_string(spec.grad_accumulation));
}

// The GEMMs a segment lists run in the plan's precision (fp8: bf16 too, for the GEMMs Transformer
// Engine's recipe keeps there: kernels.cpp). A plan whose "precision" was edited with its model_spec's
// (bf16 to fp32 in both) kept the bf16 kernels and buffers, and its step time changed by the little
// the precision's other uses add.
void check_kernel_precision(const Program& p) {
  static const char* kPass[] = {"F", "BI", "BW"};
  const Precision t = p.training.precision;
  for (std::size_t i = 0; i < p.segments.size(); ++i) {
    if (p.segments[i].fp8_dispatch && t != Precision::FP8)
      fail(fmt::format("segments[{}].fp8_dispatch", i),
           fmt::format("fp8 all-to-alls need fp8 training, but the plan trains in {} (training.precision)",
                       to_string(t)));
    for (std::size_t pass = 0; pass < 3; ++pass) {
      const auto& list = p.segments[i].kernels[pass];
      for (std::size_t k = 0; k < list.size(); ++k) {
        const Kernel& kernel = list[k];
        // GEMMs and the standard-attention core run in the training precision (bf16 under fp8).
        const bool core = is_standard_attention(kernel.kind);
        if ((kernel.kind != KernelKind::Gemm && !core) || kernel.dtype == t ||
            (t == Precision::FP8 && kernel.dtype == Precision::BF16))
          continue;
        fail(fmt::format("segments[{}].kernels.{}[{}].dtype", i, kPass[pass], k),
             fmt::format("a {} {}, but the plan trains in {} (training.precision): the precision was edited "
                         "after compiling (compile the plan again)",
                         to_string(kernel.dtype), core ? "standard-attention core" : "GEMM", to_string(t)));
      }
    }
  }
}

void check_spec_matches_segments(const Program& p, const Model& model) {
  const auto layers = static_cast<int>(model.layers().size());
  int end = 0;
  for (std::size_t i = 0; i < p.segments.size(); ++i) {
    const ProgramSegment& sg = p.segments[i];
    const std::string where = at_index("segments", i);
    if (sg.first_layer < 0 || sg.last_layer < sg.first_layer || sg.last_layer > layers)
      fail("model_spec",
           fmt::format("has {} layers, but {} was compiled for layers [{}, {}]: the spec was edited after "
                       "compiling (compile the plan again from it)",
                       layers, where, sg.first_layer, sg.last_layer));
    std::int64_t params = 0;
    for (int l = sg.first_layer; l < sg.last_layer; ++l) params += model.layer_cost(static_cast<std::size_t>(l)).params;
    if (params != sg.params)
      fail("model_spec", fmt::format("gives layers [{}, {}] {} parameters, but {} was compiled with {}: the spec was "
                                     "edited after compiling (compile the plan again from it)",
                                     sg.first_layer, sg.last_layer, params, where, sg.params));
    end = std::max(end, sg.last_layer);
  }
  if (!p.segments.empty() && end != layers)
    fail("model_spec", fmt::format("has {} layers, but the plan's segments cover layers [0, {}]: the spec was edited "
                                   "after compiling (compile the plan again from it)",
                                   layers, end));
}

}  // namespace piper::core::plan_checks
