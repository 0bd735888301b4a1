// Each backend declares what it can run (runtime::Capabilities); a plan that needs anything else is
// refused in one line naming the feature, before step 1. The check is a pure function of the compiled
// Program and the capabilities, so the CUDA backend's refusals are tested here without a GPU.
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "piper/core/scenario.hpp"
#include "piper/runtime/cp_layout.hpp"
#include "piper/runtime/dataflow.hpp"
#include "piper/runtime/kernels.hpp"

namespace core = piper::core;
using piper::runtime::check_capabilities;
using piper::runtime::cuda_capabilities;
using piper::runtime::host_capabilities;
using piper::runtime::unsupported_feature;

namespace {

const std::string kMoe = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";
const std::string kDense = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-dense.json";
const std::string kGpt = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-gpt.json";
const std::string kGptUntied = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-gpt-untied.json";

core::StrategyOptions strategy(int pp, int dp, int ep, int zero, int microbatches) {
  core::StrategyOptions o;
  o.pp = pp, o.dp = dp, o.ep = ep, o.zero = zero, o.microbatches = microbatches, o.schedule = "1f1b";
  if (zero >= 2) o.reduce_every = "step";  // what the CUDA backend runs (ZeRO-0/1 always reduce once)
  return o;
}

core::Program compile(const core::StrategyOptions& o, const std::string& model) {
  core::Scenario s;
  s.model = model;
  s.strategy = o;
  return core::compile_scenario(s).result.program;
}

// Whether `text` contains `part` (the message shown on failure).
::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << '"' << text << "\" lacks \"" << part << '"';
}

const std::string kCudaTail = "; the host backend (--backend host) runs it";

}  // namespace

// What the CUDA backend runs today (the cases scripts/gpu-check.sh checks) passes the CUDA check.
TEST(RuntimeCapabilities, CudaAcceptsPipelineDataExpertAndZero) {
  for (const auto& o : {strategy(2, 2, 1, 0, 4), strategy(2, 2, 2, 3, 4), strategy(2, 2, 2, 2, 4)})
    EXPECT_EQ(unsupported_feature(compile(o, kMoe), cuda_capabilities()), "");
}

// Tensor and sequence parallelism are accepted (column/row-parallel GEMMs, vocab-parallel embedding and
// head, SP's gathers and reduce-scatters of token rows, the TP collectives through the transport inside
// the compute ops); the refusals stay for a backend without them.
TEST(RuntimeCapabilities, CudaAcceptsTensorAndSequenceParallelism) {
  core::StrategyOptions tp = strategy(2, 2, 1, 0, 4), sp = tp;
  tp.tp = 2, sp.tp = 2, sp.sequence_parallel = true;
  EXPECT_EQ(unsupported_feature(compile(tp, kDense), cuda_capabilities()), "");
  EXPECT_EQ(unsupported_feature(compile(sp, kDense), cuda_capabilities()), "");
  piper::runtime::Capabilities none = cuda_capabilities();
  none.tensor_parallel = none.sequence_parallel = false;
  EXPECT_EQ(
      unsupported_feature(compile(tp, kDense), none),
      "plan: segment 0 is tensor-parallel (tp_degree 2); the CUDA backend does not run tensor parallelism" + kCudaTail);
  EXPECT_EQ(unsupported_feature(compile(sp, kDense), none),
            "plan: segment 0 is sequence-parallel (tp_degree 2 with SP); the CUDA backend does not run sequence "
            "parallelism" +
                kCudaTail);
}

// Context parallelism is accepted (each rank's load-balanced chunks, K/V gathered over the CP group and
// dK/dV returned, through the transport inside the attention ops; the reference attention kernels mask
// by global position); the refusal stays for a backend without it.
TEST(RuntimeCapabilities, CudaAcceptsContextParallelism) {
  core::StrategyOptions o = strategy(1, 1, 1, 0, 2), tp_cp = strategy(1, 1, 1, 0, 2);
  o.cp = 2;
  tp_cp.cp = 2, tp_cp.tp = 2, tp_cp.sequence_parallel = true;
  EXPECT_EQ(unsupported_feature(compile(o, kDense), cuda_capabilities()), "");
  EXPECT_EQ(unsupported_feature(compile(tp_cp, kDense), cuda_capabilities()), "");
  piper::runtime::Capabilities none = cuda_capabilities();
  none.context_parallel = false;
  EXPECT_EQ(unsupported_feature(compile(o, kDense), none),
            "plan: segment 0 is context-parallel (cp_degree 2); the CUDA backend does not run context parallelism" +
                kCudaTail);
}

// The CUDA attention kernels' context-parallel arithmetic (cp_layout.hpp, which kernels.cu compiles),
// checked here without a GPU against the host backend's layout: a rank's local rows sit at
// host::AttentionCp's positions, each position of a sequence held once; key j of the gathered K/V
// (rank blocks of T rows) is a row of the query's own sequence, the keys cover the sequence once; and
// the mask lets local query i see exactly the keys at or before its position, position + 1 of them.
TEST(RuntimeCapabilities, CudaContextParallelIndexingIsTheHostLayout) {
  namespace cpl = piper::runtime::cp_layout;
  for (int cp : {1, 2, 3, 4})
    for (int L : {2, 4, 6}) {
      const int seqs = 3, T = seqs * L;
      piper::runtime::host::AttentionCp host;
      host.cp = cp;
      std::vector<int> held(static_cast<std::size_t>(cp * L), 0);
      for (int r = 0; r < cp; ++r)
        for (int i = 0; i < L; ++i) {
          const int p = cpl::position(cp, r, i, L);
          EXPECT_EQ(p, cp > 1 ? host.position(r, i, L) : i) << "cp " << cp << " rank " << r << " row " << i;
          ++held.at(static_cast<std::size_t>(p));
        }
      for (int n : held) EXPECT_EQ(n, 1) << "cp " << cp << " L " << L;
      for (int b = 0; b < seqs; ++b) {
        std::vector<int> key_at(static_cast<std::size_t>(cp * L), -1), covered(static_cast<std::size_t>(cp * L), 0);
        for (int j = 0; j < cp * L; ++j) {
          const std::int64_t row = cpl::key_row(T, L, b, j);
          ASSERT_GE(row, 0);
          ASSERT_LT(row, static_cast<std::int64_t>(cp) * T);
          const int rank = static_cast<int>(row / T), local = static_cast<int>(row % T);
          EXPECT_EQ(local / L, b) << "key " << j << " of sequence " << b << " is a row of another sequence";
          const int p = cp > 1 ? host.position(rank, local % L, L) : local % L;
          key_at[static_cast<std::size_t>(j)] = p;
          ++covered.at(static_cast<std::size_t>(p));
        }
        for (int n : covered) EXPECT_EQ(n, 1);
        for (int r = 0; r < cp; ++r)
          for (int i = 0; i < L; ++i) {
            const int q = cp > 1 ? host.position(r, i, L) : i;
            int visible = 0;
            for (int j = 0; j < cp * L; ++j) {
              const bool v = cpl::key_visible(cp, r, L, i, j);
              EXPECT_EQ(v, key_at[static_cast<std::size_t>(j)] <= q);
              visible += v ? 1 : 0;
            }
            EXPECT_EQ(visible, q + 1);
          }
      }
    }
}

// Expert tensor parallelism is accepted (each ETP rank's slice of every local expert's FFN, the routed
// rows gathered over the ETP group before fc1 and the partial sums reduce-scattered after fc2, as the
// host's etp_gather / etp_scatter); the refusal stays for a backend without it.
TEST(RuntimeCapabilities, CudaAcceptsExpertTensorParallelism) {
  core::StrategyOptions o = strategy(1, 2, 1, 0, 2);
  o.etp = 2;
  EXPECT_EQ(unsupported_feature(compile(o, kMoe), cuda_capabilities()), "");
  piper::runtime::Capabilities none = cuda_capabilities();
  none.expert_tensor_parallel = false;
  const std::string why = unsupported_feature(compile(o, kMoe), none);
  EXPECT_TRUE(contains(why,
                       "expert-tensor-parallel ranks; the CUDA backend does not run expert tensor parallelism "
                       "(compile with --etp 1)"));
  EXPECT_EQ(why.rfind("plan: segment ", 0), 0u) << why;
}

// HSDP and ZeRO-2/3 reduction after every microbatch are the shared dataflow's (reduce-scatter inside
// the shard group, all-reduce across groups, accumulating writes of the chunk), which the CUDA kernels
// implement like the host's: accepted (RuntimeDataflow runs both on the CUDA code path).
TEST(RuntimeCapabilities, CudaAcceptsHsdpAndPerMicrobatchReduction) {
  core::StrategyOptions hsdp = strategy(1, 4, 1, 3, 2), every = strategy(2, 2, 1, 2, 4);
  hsdp.dp_shard = 2, every.reduce_every = "microbatch";
  EXPECT_EQ(unsupported_feature(compile(hsdp, kDense), cuda_capabilities()), "");
  EXPECT_EQ(unsupported_feature(compile(every, kDense), cuda_capabilities()), "");
  // The refusal text stays for a backend without them.
  piper::runtime::Capabilities none = cuda_capabilities();
  none.hsdp = none.reduce_every_microbatch = false;
  EXPECT_EQ(unsupported_feature(compile(hsdp, kDense), none),
            "plan: segment 0 uses HSDP (ZeRO shards over groups of 2 of its 4 replicas); the CUDA backend does not "
            "run HSDP" +
                kCudaTail);
  EXPECT_TRUE(contains(unsupported_feature(compile(every, kDense), none),
                       "reduces its ZeRO-2/3 gradients after every microbatch; the CUDA backend does not run "
                       "per-microbatch reduction (compile with --reduce-every step)"));
}

// GPT-style layers (LayerNorm, GELU, biases, learned positions, tied embeddings) run on the CUDA
// backend too; a backend without them refuses the model in one line naming the first such layer.
TEST(RuntimeCapabilities, CudaAcceptsGptStyleLayers) {
  piper::runtime::Capabilities none = cuda_capabilities();
  none.gpt_layers = false;
  for (const auto& model : {kGpt, kGptUntied}) {
    EXPECT_EQ(unsupported_feature(compile(strategy(2, 2, 1, 0, 4), model), cuda_capabilities()), "");
    const std::string why = unsupported_feature(compile(strategy(1, 1, 1, 0, 2), model), none);
    EXPECT_EQ(why.rfind("plan: model '", 0), 0u) << why;
    EXPECT_TRUE(
        contains(why, "; the CUDA backend runs RMSNorm/SwiGLU/RoPE models only (no GPT-style layers)" + kCudaTail));
  }
}

// The host and CUDA backends run every one of them; a backend without one refuses in one line, which
// check_capabilities throws.
TEST(RuntimeCapabilities, BothBackendsRunThemAndRefusalsAreOneLine) {
  core::StrategyOptions cp = strategy(1, 1, 1, 0, 2), etp = strategy(1, 2, 1, 0, 2), etp_sp = strategy(1, 2, 1, 0, 2);
  cp.cp = 2;
  etp.etp = 2;
  etp_sp.etp = 2, etp_sp.tp = 2, etp_sp.sequence_parallel = true;
  const core::Program plans[] = {compile(cp, kDense), compile(etp, kMoe), compile(etp_sp, kMoe)};
  piper::runtime::Capabilities none = cuda_capabilities();
  none.context_parallel = none.expert_tensor_parallel = false;
  for (const auto& p : plans) {
    EXPECT_EQ(unsupported_feature(p, host_capabilities()), "");
    EXPECT_EQ(unsupported_feature(p, cuda_capabilities()), "");
    EXPECT_NO_THROW(check_capabilities(p, host_capabilities()));
    EXPECT_NO_THROW(check_capabilities(p, cuda_capabilities()));
    const std::string why = unsupported_feature(p, none);
    EXPECT_FALSE(why.empty());
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
    try {
      check_capabilities(p, none);
      ADD_FAILURE() << "check_capabilities accepted a plan the backend cannot run";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), why);
    }
  }
}
