// Tests of tensor parallelism, sequence parallelism and activation recomputation: Korthikanti et
// al. 2022 Table 2 activation formulas derived by hand, TP collective counts and volumes per op,
// FLOP and parameter splits, directive validation, strategy flags, TP groups in the Program and
// the verifier, the simulator's TP cost, and composition with every schedule family, EP and ZeRO.
#include <unistd.h>

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/kernels.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/verifier.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/search/sweep.hpp"
#include "tp_support.hpp"

using namespace piper::core;
using namespace piper::test::tp;
using nlohmann::json;

namespace {

// Stored activation bytes of transformer block 0 (attn_norm, attn, mlp_norm, mlp) under a layout.
double block_activations(const Model& m, ParallelLayout layout) {
  double bytes = 0;
  for (const auto& layer : m.layers())
    if (layer.block == 0) bytes += static_cast<double>(layer_costs(layer, m.training(), layout).activation_bytes);
  return bytes;
}

}  // namespace

// Korthikanti et al. 2022, Table 2, each row derived from its formula (bytes, bf16).
TEST(TensorParallel, ActivationMemoryFollowsKorthikantiTable2) {
  const Model m = build_model(small_gpt());
  const double sbh = s * b * h;
  EXPECT_DOUBLE_EQ(block_activations(m, {1, false, 0}), sbh * (34 + 5 * a * s / h));
  for (int t : {2, 4}) {
    SCOPED_TRACE("t = " + std::to_string(t));
    EXPECT_DOUBLE_EQ(block_activations(m, {t, false, 0}), sbh * (10 + 24.0 / t + 5 * a * s / (h * t)));
    EXPECT_DOUBLE_EQ(block_activations(m, {t, true, 0}), sbh / t * (34 + 5 * a * s / h));
    EXPECT_DOUBLE_EQ(block_activations(m, {t, false, 1}), sbh * (10 + 24.0 / t));
    EXPECT_DOUBLE_EQ(block_activations(m, {t, true, 1}), 34 * sbh / t);
    // Full recomputation keeps the block input: 2sbh (the sequence slice with SP).
    EXPECT_DOUBLE_EQ(block_activations(m, {t, false, 2}), 2 * sbh);
    EXPECT_DOUBLE_EQ(block_activations(m, {t, true, 2}), 2 * sbh / t);
  }
  EXPECT_DOUBLE_EQ(block_activations(m, {1, false, 2}), 2 * sbh);
}

// FLOPs and parameters of a layer split by t (norms replicated; with SP their work is sliced).
TEST(TensorParallel, FlopsAndParametersSplit) {
  const Model m = build_model(small_gpt());
  for (const auto& layer : m.layers()) {
    SCOPED_TRACE(layer.name);
    const Costs base = layer_costs(layer, m.training());
    const Costs sp = layer_costs(layer, m.training(), {4, true, 0});
    const Costs tp = layer_costs(layer, m.training(), {4, false, 0});
    EXPECT_NEAR(sp.forward_flops * 4, base.forward_flops, 1e-9 * base.forward_flops);
    EXPECT_NEAR(sp.backward_flops() * 4, base.backward_flops(), 1e-9 * base.backward_flops());
    if (layer.kind == LayerKind::Norm) {
      EXPECT_EQ(tp.params, base.params);                // replicated weights
      EXPECT_EQ(tp.forward_flops, base.forward_flops);  // every rank normalises the whole sequence
    } else if (layer.kind == LayerKind::Embedding) {
      EXPECT_EQ(tp.params, 256 * 64 / 4 + 64 * 64);  // vocabulary rows split, positions replicated
    } else if (layer.kind != LayerKind::Head) {      // the head is tied: no parameters
      EXPECT_EQ(tp.params * 4, base.params);
    }
  }
}

// A vocabulary TP does not divide (250 over t = 4) is padded to 252: each rank holds ceil(250 / 4) = 63
// rows of the embedding, 63 columns of the head (its GEMM, logits and loss) and of a tied head's copy of
// the table. T = s·b = 128 tokens, h = 64; the head costs 2·T·h·V for its GEMM and 5·T·V for the loss.
TEST(TensorParallel, VocabularyThatTpDoesNotDivideIsPadded) {
  ModelConfig c = small_gpt(4);
  c.vocab = 250;
  c.tie_embeddings = false;
  const Model m = build_model(c);
  const double T = s * b, rows = 63;
  for (const auto& layer : m.layers()) {
    const Costs tp = layer_costs(layer, m.training(), {4, false, 0});
    if (layer.kind == LayerKind::Embedding) {
      EXPECT_EQ(tp.params, 63 * 64 + 64 * 64);  // padded vocabulary rows split, positions replicated
    } else if (layer.kind == LayerKind::Head) {
      EXPECT_EQ(tp.params, 63 * 64);
      EXPECT_DOUBLE_EQ(tp.forward_flops, 2 * T * h * rows + 5 * T * rows);
      EXPECT_DOUBLE_EQ(tp.backward_weight_flops, 2 * T * h * rows);
      const auto kernels = layer_kernels(layer, m.training(), {4, false, 0}, 0);
      ASSERT_FALSE(kernels.empty());
      EXPECT_EQ(kernels.front().kind, KernelKind::Gemm);
      EXPECT_EQ(kernels.front().n, 63);
      EXPECT_DOUBLE_EQ(kernel_flops(kernels), tp.forward_flops);
    }
  }
  // Tied, with the head on another stage: its copy of the table is 63 rows a rank too.
  StrategyOptions o;
  o.pp = 2;
  o.tp = 4;
  o.microbatches = 2;
  c.tie_embeddings = true;
  const Program p = compile_scenario(tp_scenario(write_spec(c), o)).result.program;
  std::int64_t copy = -1;
  for (const auto& buf : p.plan_for(4).buffers)
    if (buf.name.starts_with("params tied embedding copy")) copy = buf.bytes;
  EXPECT_EQ(copy, 63 * 64 * 2);  // bf16
}

// Collectives inside each op, per Megatron layout: N = s·b·h·2 bytes (one hidden tensor).
TEST(TensorParallel, CollectiveCountsAndVolumes) {
  const Model m = build_model(small_gpt(3));
  const std::int64_t N = 64 * 2 * 64 * 2, T = 64 * 2;
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "SP" : "TP");
    Costs total;
    for (const auto& layer : m.layers()) total += layer_costs(layer, m.training(), {2, sp, 0});
    const int L = 3;
    // F: embedding all-reduce (SP: reduce-scatter); per block two all-reduces (SP: two all-gathers
    // + two reduce-scatters); head: SP all-gather + 3 cross-entropy all-reduces of T fp32.
    EXPECT_EQ(total.forward_tp_bytes, (sp ? N : 2 * N) + L * 4 * N + (sp ? N : 0) + 3 * 2 * T * 4);
    EXPECT_EQ(total.forward_tp_collectives, 1 + L * (sp ? 4 : 2) + (sp ? 1 : 0) + 3);
    // B: the mirror of each block's collectives; the head's input gradient; SP: the embedding's
    // output gradient is all-gathered.
    EXPECT_EQ(total.backward_tp_bytes, (sp ? N : 0) + L * 4 * N + (sp ? N : 2 * N));
    EXPECT_EQ(total.backward_tp_collectives, (sp ? 1 : 0) + L * (sp ? 4 : 2) + 1);
  }
}

// Recomputation adds forward work to B: selective the attention core (4·b·s²·h / t FLOPs per
// layer), full the whole block forward (with its TP collectives).
TEST(TensorParallel, RecomputeAddsForwardWorkToBackward) {
  const Model m = build_model(small_gpt());
  for (const auto& layer : m.layers()) {
    if (layer.block < 0) continue;
    SCOPED_TRACE(layer.name);
    const Costs none = layer_costs(layer, m.training(), {2, true, 0});
    const Costs sel = layer_costs(layer, m.training(), {2, true, 1});
    const Costs full = layer_costs(layer, m.training(), {2, true, 2});
    const double core = layer.kind == LayerKind::Attention ? 4 * b * s * s * h / 2 : 0;
    EXPECT_DOUBLE_EQ(sel.backward_input_flops - none.backward_input_flops, core);
    EXPECT_DOUBLE_EQ(sel.recompute_flops, core);
    EXPECT_DOUBLE_EQ(full.backward_input_flops - none.backward_input_flops, none.forward_flops);
    EXPECT_EQ(full.backward_tp_bytes - none.backward_tp_bytes, none.forward_tp_bytes);
    EXPECT_EQ(sel.forward_flops, none.forward_flops);
  }
}

// GEMM kernels per pass, counted by hand for Megatron-LM's layer (fused QKV, output projection,
// fc1, fc2; standard attention's QK^T and P·V batched GEMMs, four in the backward): TP splits each
// GEMM but keeps the kernel; selective recomputation reruns the two core GEMMs in BI, full the
// block's forward GEMMs.
TEST(TensorParallel, GemmKernelsPerPass) {
  const Model m = build_model(small_gpt());
  for (const auto& layer : m.layers()) {
    SCOPED_TRACE(layer.name);
    int f = 0, bi = 0, bw = 0;  // expected, layout {2, SP, none}
    switch (layer.kind) {
      case LayerKind::Attention:
        f = 2 + 2, bi = 2 + 4, bw = 2;
        break;
      case LayerKind::Mlp:
        f = 2, bi = 2, bw = 2;
        break;
      case LayerKind::Head:
        f = 1, bi = 1, bw = 1;
        break;
      default:
        break;  // embedding gather, norms: no GEMM
    }
    const Costs none = layer_costs(layer, m.training(), {2, true, 0});
    EXPECT_EQ(none.forward_gemm_kernels, f);
    EXPECT_EQ(none.backward_input_gemm_kernels, bi);
    EXPECT_EQ(none.backward_weight_gemm_kernels, bw);
    EXPECT_EQ(layer_costs(layer, m.training()).forward_gemm_kernels, f);  // TP does not change the count
    const Costs sel = layer_costs(layer, m.training(), {2, true, 1});
    EXPECT_EQ(sel.backward_input_gemm_kernels, bi + (layer.kind == LayerKind::Attention ? 2 : 0));
    const Costs full = layer_costs(layer, m.training(), {2, true, 2});
    EXPECT_EQ(full.backward_input_gemm_kernels, bi + (layer.block >= 0 ? f : 0));
    EXPECT_EQ(full.backward_weight_gemm_kernels, bw);
  }
  // FlashAttention: one fused core kernel each way.
  ModelConfig flash = small_gpt();
  flash.attention_kernel = AttentionKernel::Flash;
  const Model fm = build_model(flash);
  for (const auto& layer : fm.layers())
    if (layer.kind == LayerKind::Attention) {
      const Costs c = layer_costs(layer, fm.training());
      EXPECT_EQ(c.forward_gemm_kernels, 3);
      EXPECT_EQ(c.backward_input_gemm_kernels, 3);
      EXPECT_EQ(c.backward_weight_gemm_kernels, 2);
    }
}

// Standard attention's serial HBM traffic per layer, by hand (bf16, dropout, biases; scores = b·a·s²,
// hidden = s·b·h elements; the QKV output is 3·hidden, the context hidden):
// forward: scale-mask-softmax reads and writes each score (2 + 2), dropout reads, writes and masks
// it (2 + 2 + 1), and QK^T's epilogue writes it (2); bias-dropout-add on the hidden reads two,
// writes one and masks (3·2 + 1 per element); the context's permute to [s, b, h] reads and writes
// it (2 + 2); the QKV bias, added by a kernel of its own, reads and writes the QKV output (3·(2 + 2)).
// Backward: softmax reads two and writes (3·2), dropout reads the gradient and mask and writes
// (2 + 1 + 2), dP's epilogue writes (2); the hidden bias-dropout-add (2·2 + 1), autograd's sum of
// the layer input's gradients through the norm and the residual (3·2) and the output projection's
// bias gradient, a sum over the tokens (2); the permute's gradient (2 + 2); the QKV
// bias gradient (3·2); torch.split's gradient, concatenating the q, k, v gradients (3·(2 + 2)); and
// baddbmm's alpha scaling the q and k gradients (2·(2 + 2)). TP splits the score, context and QKV
// terms by heads; SP slices the hidden ones.
// The MLP (ffn f = 4h, T·f = 4·hidden): bias + GELU reads and writes T·f (2 + 2), the hidden
// bias-dropout-add as above; backward GELU reads the input and the gradient and writes (3·2), fc1's
// bias gradient reads the gradient (2), and the hidden part as the attention's (2·2 + 1 + 3·2 + 2).
TEST(TensorParallel, StandardAttentionElementwiseBytesByHand) {
  const Model m = build_model(small_gpt());
  const double scores = b * a * s * s, hidden = s * b * h;
  int attention = 0, mlp = 0;
  for (const auto& layer : m.layers()) {
    if (layer.kind == LayerKind::Mlp) {
      ++mlp;
      const Costs c = layer_costs(layer, m.training());
      EXPECT_EQ(c.forward_elementwise_bytes, 4 * hidden * 4 + hidden * 7);
      EXPECT_EQ(c.backward_elementwise_bytes, 4 * hidden * 8 + hidden * 13);
      const Costs sp = layer_costs(layer, m.training(), {2, true, 0});
      EXPECT_EQ(sp.forward_elementwise_bytes, (4 * hidden * 4 + hidden * 7) / 2);
      EXPECT_EQ(sp.backward_elementwise_bytes, (4 * hidden * 8 + hidden * 13) / 2);
      const Costs tp = layer_costs(layer, m.training(), {2, false, 0});  // TP alone: the hidden part whole
      EXPECT_EQ(tp.backward_elementwise_bytes, 4 * hidden * 8 / 2 + hidden * 13);
    }
    if (layer.kind != LayerKind::Attention) continue;
    ++attention;
    const Costs base = layer_costs(layer, m.training());
    EXPECT_EQ(base.forward_elementwise_bytes, scores * (4 + 5 + 2) + hidden * (7 + 4 + 12));
    EXPECT_EQ(base.backward_elementwise_bytes, scores * (6 + 5 + 2) + hidden * (13 + 4 + 6 + 12 + 8));
    const Costs sp = layer_costs(layer, m.training(), {2, true, 0});
    EXPECT_EQ(sp.forward_elementwise_bytes, (scores * 11 + hidden * 23) / 2);
    EXPECT_EQ(sp.backward_elementwise_bytes, (scores * 13 + hidden * 43) / 2);
    // Selective recomputation reruns the core: softmax, dropout, QK^T (with its epilogue) and the
    // context's permute, in the backward.
    const Costs sel = layer_costs(layer, m.training(), {2, true, 1});
    EXPECT_EQ(sel.backward_elementwise_bytes - sp.backward_elementwise_bytes, (scores * 11 + hidden * 4) / 2);
  }
  EXPECT_EQ(attention, 2);
  EXPECT_EQ(mlp, 2);
}

// A plan whose standard-attention core says another dtype than its training precision (edited after
// compiling) is refused on load, naming the kernel, as an edited GEMM is.
TEST(TensorParallel, AnEditedStandardAttentionCoreDtypeIsRefused) {
  StrategyOptions o;
  o.tp = 2;
  const Program p = compile_scenario(tp_scenario(write_spec(small_gpt(2)), o)).result.program;
  json j = p.to_json();
  std::string where;
  for (std::size_t i = 0; i < j["segments"].size() && where.empty(); ++i) {
    json& list = j["segments"][i]["kernels"]["F"];
    for (std::size_t k = 0; k < list.size(); ++k)
      if (list[k]["kind"] == "attention_std_fwd") {
        list[k]["dtype"] = "fp32";
        where = "segments[" + std::to_string(i) + "].kernels.F[" + std::to_string(k) + "].dtype";
        break;
      }
  }
  ASSERT_FALSE(where.empty()) << "no standard-attention kernel in the plan";
  EXPECT_EQ(Program::from_json(p.to_json()), p);
  try {
    (void)Program::from_json(j);
    ADD_FAILURE() << "an fp32 core in a bf16 plan was accepted";
  } catch (const PlanError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(where), std::string::npos) << m;
    EXPECT_NE(m.find("a fp32 standard-attention core, but the plan trains in bf16"), std::string::npos) << m;
  }
}

// TP groups: consecutive devices (k + tp·(r + d·pp)); DP replicas strided; gradients over 1/t.
TEST(TensorParallel, GroupsInTheProgram) {
  StrategyOptions o;
  o.pp = 2;
  o.dp = 2;
  o.tp = 2;
  o.sequence_parallel = true;
  o.microbatches = 4;
  const auto compiled = compile_scenario(tp_scenario(write_spec(small_gpt(4)), o));
  const Program& p = compiled.result.program;
  EXPECT_EQ(p.num_devices, 8);
  EXPECT_TRUE(verify(p).empty());
  for (const auto& sg : p.segments) {
    ASSERT_EQ(sg.tp_degree, 2);
    EXPECT_TRUE(sg.sequence_parallel);
    ASSERT_GE(sg.tp_family, 0);
    EXPECT_EQ(p.families[static_cast<std::size_t>(sg.tp_family)].purpose, FamilyPurpose::Tp);
    EXPECT_EQ(sg.replicas, 2);
  }
  // PP rank 0 holds devices {0,1} (DP 0) and {4,5} (DP 1); rank 1 holds {2,3} and {6,7}.
  const auto& s0 = p.segments.front();
  EXPECT_EQ(p.device_sets[static_cast<std::size_t>(s0.devices)], (std::vector<int>{0, 1, 4, 5}));
  EXPECT_EQ(p.group_of(s0.tp_family, 4), (std::vector<int>{4, 5}));
  // The gradient all-reduce of segment 0 runs over the strided group {0, 4}, on 1/t of the weights.
  bool found = false;
  for (const auto& st : p.plan_for(0).streams)
    for (const auto& op : st.ops)
      if (op.kind == OpKind::AllReduce && op.segments == std::vector<int>{0}) {
        found = true;
        EXPECT_EQ(p.group_of(op.family, 0), (std::vector<int>{0, 4}));
        std::int64_t local = 0;
        const Model& m = compiled.model;
        for (int l = s0.first_layer; l < s0.last_layer; ++l)
          local += layer_costs(m.layers()[static_cast<std::size_t>(l)], m.training(), {2, true, 0}).params;
        EXPECT_EQ(op.bytes, local * 2);
      }
  EXPECT_TRUE(found);
  // Every F of a TP segment carries its collectives; activations between SP stages are sliced.
  for (const auto& st : p.plan_for(0).streams)
    for (const auto& op : st.ops) {
      if (op.kind == OpKind::Compute && op.pass == Pass::F) {
        EXPECT_GT(op.tp_collectives, 0);
      }
      if (op.kind == OpKind::Send && op.pass == Pass::F) {
        EXPECT_EQ(op.bytes, 64 * 2 * 64 * 2 / 2);
      }
    }
  // The JSON round trip keeps the TP fields.
  EXPECT_TRUE(Program::from_json(p.to_json()) == p);
}

TEST(TensorParallel, VerifierChecksGroups) {
  StrategyOptions o;
  o.tp = 2;
  o.dp = 2;
  o.microbatches = 2;
  const Program good = compile_scenario(tp_scenario(write_spec(small_gpt()), o)).result.program;
  ASSERT_TRUE(verify(good).empty());
  {
    Program bad = good;
    bad.families[static_cast<std::size_t>(bad.segments[0].tp_family)].group_size = 4;
    auto issues = verify(bad);
    ASSERT_FALSE(issues.empty());
    bool tp = false;
    for (const auto& i : issues) tp = tp || i.check == "tp-group";
    EXPECT_TRUE(tp);
  }
  {
    // Device 1 gets its own plan whose first TP op moves different bytes than device 0's.
    Program bad = good;
    Plan changed = bad.plan_for(1);
    for (auto& st : changed.streams)
      for (auto& op : st.ops)
        if (op.tp_collectives > 0) {
          op.tp_bytes += 2;
          goto done;
        }
  done:
    bad.plans.push_back(changed);
    bad.plan_of_device[1] = static_cast<int>(bad.plans.size()) - 1;
    auto issues = verify(bad);
    ASSERT_FALSE(issues.empty());
    EXPECT_EQ(issues.front().check, "tp-group");
    EXPECT_NE(issues.front().message.find("device 1"), std::string::npos) << issues.front().message;
  }
}

TEST(TensorParallel, DirectiveValidation) {
  auto error_of = [](const json& program) -> std::string {
    try {
      (void)parse_directives(program);
    } catch (const DirectiveError& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_NE(error_of(json::parse(R"([{"op":"tensor_parallel","filter":{"PP":0}}])")).find("degree"), std::string::npos);
  EXPECT_NE(error_of(json::parse(R"([{"op":"tensor_parallel","filter":{"PP":0},"degree":0}])")).find("degree"),
            std::string::npos);
  EXPECT_NE(error_of(json::parse(R"([{"op":"tensor_parallel","filter":{},"degree":1,"sequence_parallel":true}])"))
                .find("sequence_parallel"),
            std::string::npos);
  EXPECT_NE(
      error_of(json::parse(R"([{"op":"tensor_parallel","filter":{},"degree":2,"overlap":true}])")).find("overlap"),
      std::string::npos);
  EXPECT_NE(error_of(json::parse(
                         R"([{"op":"place","filter":{},"devices":[0]},{"op":"recompute","filter":{},"mode":"some"}])"))
                .find("directive 1"),
            std::string::npos);
  EXPECT_NE(error_of(json::parse(R"([{"op":"recompute","filter":{}}])")).find("mode"), std::string::npos);

  // Against the model: 3 does not divide 4 heads; a segment made TP twice.
  const Model m = build_model(small_gpt());
  auto apply_error = [&](const json& program) -> std::string {
    GlobalDag dag = build_dag(m);
    try {
      apply_directives(dag, parse_directives(program));
    } catch (const DirectiveError& e) {
      return e.what();
    }
    return "(no error)";
  };
  const std::string heads = apply_error(
      json::parse(R"([{"op":"place","filter":{},"devices":[0,1,2]},{"op":"tensor_parallel","filter":{},"degree":3}])"));
  EXPECT_NE(heads.find("directive 1"), std::string::npos) << heads;
  EXPECT_NE(heads.find("heads"), std::string::npos) << heads;
  const std::string twice = apply_error(json::parse(
      R"([{"op":"place","filter":{},"devices":[0,1]},{"op":"tensor_parallel","filter":{},"degree":2},{"op":"tensor_parallel","filter":{},"degree":2}])"));
  EXPECT_NE(twice.find("directive 2"), std::string::npos) << twice;
  const std::string devices = apply_error(
      json::parse(R"([{"op":"place","filter":{},"devices":[0,1,2]},{"op":"tensor_parallel","filter":{},"degree":2}])"));
  EXPECT_NE(devices.find("does not divide the 3 devices"), std::string::npos) << devices;
}

TEST(TensorParallel, StrategyFlagsAndGlobalBatch) {
  StrategyOptions o;
  o.dp = 2;
  o.tp = 4;
  o.sequence_parallel = true;
  o.recompute = "selective";
  o.global_batch = 16;
  resolve_global_batch(o, 2);
  EXPECT_EQ(o.microbatches, 4);  // 16 / (2 × 2)
  o.global_batch = 10;
  try {
    resolve_global_batch(o, 2);
    ADD_FAILURE() << "10 is not divisible by 2 × 2";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--global-batch 10"), std::string::npos);
  }
  o.global_batch = 0;
  const json program = generate_program(o).to_json();
  int tp = 0, rc = 0;
  for (const auto& d : program) {
    if (d["op"] == "tensor_parallel") {
      ++tp;
      EXPECT_EQ(d["degree"], 4);
      EXPECT_EQ(d["sequence_parallel"], true);
    }
    if (d["op"] == "recompute") {
      ++rc;
      EXPECT_EQ(d["mode"], "selective");
    }
    if (d["op"] == "place") {
      EXPECT_EQ(d["devices"], json({0, 1, 2, 3, 4, 5, 6, 7}));
    }
  }
  EXPECT_EQ(tp, 1);
  EXPECT_EQ(rc, 1);
  StrategyOptions bad;
  bad.sequence_parallel = true;
  EXPECT_THROW(validate_strategy_options(bad), std::invalid_argument);
}

// The simulator costs an op's TP collectives on the intra-node fabric, not overlapped: per call an
// all-gather of tp_bytes / calls over the group, (t-1)·alpha + (t-1)/t · bytes / B.
TEST(TensorParallel, SimulatorCostsTheCollectivesInsideTheOp) {
  StrategyOptions o;
  o.tp = 4;
  const Program p = compile_scenario(tp_scenario(write_spec(small_gpt()), o)).result.program;
  const piper::sim::Cluster cluster = piper::sim::with_devices(piper::sim::load_cluster("dgx-a100-80g"), 4);
  const piper::sim::CostModel cost(cluster);
  const Op* f = nullptr;
  for (const auto& st : p.plan_for(0).streams)
    for (const auto& op : st.ops)
      if (op.kind == OpKind::Compute && op.pass == Pass::F) f = &op;
  ASSERT_NE(f, nullptr);
  const auto& node = cluster.nodes.front();
  const double per_call = static_cast<double>(f->tp_bytes) / f->tp_collectives;
  const double expected =
      f->tp_collectives * (3 * node.nvlink_latency_s + 0.75 * std::floor(per_call) / 230e9);  // NCCL on A100 NVLink
  EXPECT_NEAR(cost.tp_seconds(p, 0, *f), expected, 1e-12);
  Op plain = *f;
  plain.tp_collectives = 0;
  plain.tp_bytes = 0;
  EXPECT_NEAR(cost.compute_seconds(p, 0, *f) - cost.compute_seconds(p, 0, plain), expected, 1e-12);
}

// The report shows the TP collectives that COMPUTE ops run inside themselves apart from the rest of
// the compute: per device the sum of the cost model's figure over the device's COMPUTE ops, on the
// critical path the same (PP 1: the path is one device's chain of ops); 0, and no column, without
// TP or when an override gives the ops' times (a measured time is not split).
TEST(TensorParallel, ReportShowsTheCollectivesInsideComputeApart) {
  StrategyOptions o;
  o.tp = 4;
  o.sequence_parallel = true;
  o.microbatches = 2;
  const auto program =
      std::make_shared<const Program>(compile_scenario(tp_scenario(write_spec(small_gpt()), o)).result.program);
  const piper::sim::CostModel cost(piper::sim::with_devices(piper::sim::load_cluster("dgx-a100-80g"), 4));
  piper::sim::SimulateOptions so;
  so.cluster = "dgx-a100-80g";
  for (const std::string engine : {"analytic", "simgrid"}) {
    SCOPED_TRACE(engine);
    so.engine = engine;
    const auto r = piper::sim::simulate_program(program, so);
    ASSERT_EQ(r.report.per_device.size(), 4u);
    for (int d = 0; d < 4; ++d) {
      double expected = 0;
      int ops = 0;
      for (const auto& st : program->plan_for(d).streams)
        for (const auto& op : st.ops)
          if (op.kind == OpKind::Compute && op.tp_collectives > 0) expected += cost.tp_seconds(*program, d, op), ++ops;
      EXPECT_GE(ops, 4);  // 2 microbatches x (F, B) at least
      EXPECT_NEAR(r.report.per_device[static_cast<std::size_t>(d)].tp_comm_s, expected, 1e-12);
      EXPECT_LT(expected, r.report.per_device[static_cast<std::size_t>(d)].busy_s);
    }
    EXPECT_NEAR(r.report.critical_path.tp_s, r.report.per_device[0].tp_comm_s, 1e-12);
    const std::string text = r.report.to_text();
    EXPECT_NE(text.find("TP ms"), std::string::npos) << text;
    EXPECT_NE(text.find(fmt::format("(TP collectives {:.3f} ms)", r.report.critical_path.tp_s * 1e3)),
              std::string::npos)
        << text;
    const auto back = piper::sim::Report::from_json(r.report.to_json());
    EXPECT_EQ(back.per_device[2].tp_comm_s, r.report.per_device[2].tp_comm_s);
    EXPECT_EQ(back.critical_path.tp_s, r.report.critical_path.tp_s);
  }

  so.engine = "analytic";
  so.op_override = [](const Op& op) -> std::optional<double> {
    if (op.kind == OpKind::Compute) return 1e-3;
    return std::nullopt;
  };
  const auto overridden = piper::sim::simulate_program(program, so);
  EXPECT_EQ(overridden.report.per_device[0].tp_comm_s, 0);
  EXPECT_EQ(overridden.report.critical_path.tp_s, 0);
  EXPECT_EQ(overridden.report.to_text().find("TP ms"), std::string::npos);

  StrategyOptions plain = o;
  plain.tp = 1;
  plain.sequence_parallel = false;
  plain.dp = 4;
  so.op_override = {};
  const auto no_tp = piper::sim::simulate_program(
      std::make_shared<const Program>(compile_scenario(tp_scenario(write_spec(small_gpt()), plain)).result.program),
      so);
  for (const auto& d : no_tp.report.per_device) EXPECT_EQ(d.tp_comm_s, 0);
  EXPECT_EQ(no_tp.report.to_text().find("TP"), std::string::npos);
}

// Every schedule family composes with TP + SP + recompute, with ZeRO 0-3 and (MoE) EP: each
// combination that compiles without TP compiles with it, verifies, and simulates.
TEST(TensorParallel, ComposesWithSchedulesEpAndZero) {
  ModelConfig moe = small_gpt(4);
  moe.name = "tp-moe";
  moe.experts = 4;
  moe.top_k = 2;
  moe.expert_ffn = 64;
  const std::string dense_path = write_spec(small_gpt(4)), moe_path = write_spec(moe);
  int combinations = 0;
  for (const auto& family : schedule_registry()) {
    for (int zero = 0; zero <= 3; ++zero) {
      for (bool with_ep : {false, true}) {
        StrategyOptions o;
        o.schedule = family.name;
        o.pp = 2;
        o.dp = 2;
        o.ep = with_ep ? 2 : 1;
        o.zero = zero;
        o.microbatches = 4;
        o.virtual_stages =
            family.name == "zb-v" || family.name == "dualpipev" || family.name == "interleaved-1f1b-overlap" ? 2 : 1;
        o.tp = 2;
        o.sequence_parallel = true;
        o.recompute = zero % 2 ? "selective" : "full";
        SCOPED_TRACE(family.name + " zero " + std::to_string(zero) + (with_ep ? " ep2" : ""));
        auto sc = tp_scenario(with_ep ? moe_path : dense_path, o);
        std::shared_ptr<const Program> program;
        try {
          program = std::make_shared<const Program>(compile_scenario(sc).result.program);
        } catch (const std::exception& e) {
          ADD_FAILURE() << e.what();
          continue;
        }
        EXPECT_TRUE(verify(*program).empty());
        piper::sim::SimulateOptions so;
        so.cluster = "dgx-a100-80g";
        so.engine = "analytic";
        const auto r = piper::sim::simulate_program(program, so);
        EXPECT_GT(r.report.step_time_s, 0);
        ++combinations;
      }
    }
  }
  EXPECT_EQ(combinations, static_cast<int>(schedule_registry().size()) * 8);
}

// A paper's GPT typed in as a spec: the 22B GPT of Korthikanti et al. (with Megatron's biases,
// learned positions and tied embeddings) has 12Lh² + 13Lh + (V + P)h + 2h parameters.
TEST(TensorParallel, ModelSpecTakesAPapersGpt) {
  const ModelConfig c = load_model_config(std::string(PIPER_SOURCE_DIR) + "/examples/models/gpt-22b-korthikanti.json");
  EXPECT_EQ(c.layers, 48);
  EXPECT_EQ(c.hidden, 6144);
  EXPECT_EQ(c.heads, 64);
  EXPECT_EQ(c.ffn, 4 * 6144);
  EXPECT_EQ(c.activation, MlpActivation::GELU);
  EXPECT_EQ(c.norm, NormKind::LayerNorm);
  EXPECT_EQ(c.attention_kernel, AttentionKernel::Standard);
  EXPECT_TRUE(c.dropout);
  const std::int64_t L = 48, hh = 6144, V = 51200, P = 2048;
  EXPECT_EQ(build_model(c).parameter_count(), 12 * L * hh * hh + 13 * L * hh + (V + P) * hh + 2 * hh);
  const ModelConfig back = config_from_spec_json(config_to_spec_json(c), "round trip");
  EXPECT_EQ(back.attention_kernel, AttentionKernel::Standard);
  EXPECT_DOUBLE_EQ(back.dropout_probability, 0.1);

  json spec = config_to_spec_json(c);
  spec["attention"] = "fast";
  try {
    (void)config_from_spec_json(spec, "m.json");
    ADD_FAILURE() << "attention 'fast' accepted";
  } catch (const ModelError& e) {
    EXPECT_NE(std::string(e.what()).find("m.json: field 'attention'"), std::string::npos) << e.what();
  }
  spec = config_to_spec_json(c);
  spec["dropout"] = 1.5;
  EXPECT_THROW((void)config_from_spec_json(spec, "m.json"), ModelError);
}

// The fidelity point (Korthikanti et al. 2022, Table 5): the simulator's step time for the 22B GPT
// on one DGX A100, TP 8, global batch 4, within the documented error of the published 1.42 s (full
// recomputation) and 1.10 s (SP + selective). Each bound is the error measured when the cost model
// was last changed (docs/tensor-parallel.md): the 5 % goal is met at micro-batch 1, not at the
// paper's micro-batch 4.
// A Korthikanti et al. 2022 GPT (examples/models/gpt-<name>-korthikanti.json) with TP 8 and the given
// SP / recompute mode; `shape` sets the rest. Its step time on one or more DGX A100s, analytic engine,
// on the A100's efficiency curve ("kernel_table": ""), the cost model these bounds were documented
// for; the preset's kernel table (a100-80gb-sxm) predicts the larger figures docs/tensor-parallel.md
// lists, outside these bounds (sim/data/README.md says why).
template <class Shape>
double korthikanti_step_s(const std::string& name, bool sp, const std::string& recompute, Shape shape) {
  Scenario sc;
  sc.model = std::string(PIPER_SOURCE_DIR) + "/examples/models/gpt-" + name + "-korthikanti.json";
  sc.strategy.tp = 8;
  sc.strategy.sequence_parallel = sp;
  sc.strategy.recompute = recompute;
  shape(sc);
  const std::string curve = ::testing::TempDir() + "/a100-curve-" + std::to_string(::getpid()) + ".json";
  std::ofstream(curve) << R"({"preset": "dgx-a100-80g", "node": {"gpu": {"kernel_table": ""}}})";
  piper::sim::SimulateOptions so;
  so.cluster = curve;
  so.engine = "analytic";
  return piper::sim::simulate(sc, so).report.step_time_s;
}

TEST(TensorParallel, Korthikanti22BWithinDocumentedError) {
  auto step = [](int micro_batch, bool sp, const std::string& recompute) {
    return korthikanti_step_s("22b", sp, recompute, [&](Scenario& sc) {
      sc.micro_batch_size = micro_batch;
      sc.strategy.global_batch = 4;
    });
  };
  // The paper's Table 5 cells against the errors documented in docs/tensor-parallel.md (no constant
  // is fitted to them): micro-batch 4 (the paper's Table 3) -6.5 % and -10.8 %, micro-batch 1
  // (issue #10's command) -3.0 % and -6.4 %. The bounds sit about 1.3 points above those errors.
  const double full4 = step(4, false, "full"), selective4 = step(4, true, "selective");
  EXPECT_NEAR(full4, 1.42, 0.078 * 1.42);
  EXPECT_NEAR(selective4, 1.10, 0.121 * 1.10);
  const double full1 = step(1, false, "full"), selective1 = step(1, true, "selective");
  EXPECT_NEAR(full1, 1.42, 0.043 * 1.42);
  EXPECT_NEAR(selective1, 1.10, 0.077 * 1.10);
  // Selective + SP must beat full recomputation by about the paper's factor 1.42 / 1.10 = 1.29.
  EXPECT_NEAR(full4 / selective4, 1.42 / 1.10, 0.10);
  EXPECT_NEAR(full1 / selective1, 1.42 / 1.10, 0.10);
}

// An independent check, not used for any constant: the paper's 175B cells (Table 5: 18.13 s full
// recomputation, 13.75 s SP + selective; TP 8 x PP 8 interleaved with 3 chunks per rank, global
// batch 64, micro-batch 1) against the errors docs/tensor-parallel.md documents (-4.5 %, -8.5 %).
TEST(TensorParallel, Korthikanti175BWithinDocumentedError) {
  auto step = [](bool sp, const std::string& recompute) {
    return korthikanti_step_s("175b", sp, recompute, [](Scenario& sc) {
      sc.micro_batch_size = 1;
      sc.strategy.pp = 8;
      sc.strategy.schedule = "interleaved-1f1b";
      sc.strategy.virtual_stages = 3;
      sc.strategy.global_batch = 64;
    });
  };
  EXPECT_NEAR(step(false, "full"), 18.13, 0.058 * 18.13);
  EXPECT_NEAR(step(true, "selective"), 13.75, 0.098 * 13.75);
}

// Sweep spec keys tp / sequence_parallel / recompute / global_batch expand like every knob and run.
TEST(TensorParallel, SweepKeys) {
  const std::string model = write_spec(small_gpt());
  const json spec = {{"model", model},
                     {"cluster", "dgx-a100-80g"},
                     {"dp", 2},
                     {"tp", json::array({1, 2})},
                     {"sequence_parallel", json::array({false, true})},
                     {"recompute", "selective"},
                     {"global_batch", 8}};
  const auto points = piper::search::expand(piper::search::SweepSpec::from_json(spec, "s.json"));
  ASSERT_EQ(points.size(), 4u);
  EXPECT_EQ(points[3].tp, 2);
  EXPECT_TRUE(points[3].sequence_parallel);
  EXPECT_NE(points[3].key().find("/tp2/sp/rc-selective/gb8"), std::string::npos) << points[3].key();
  const auto ok = piper::search::run_point(points[3], "");
  EXPECT_EQ(ok.status, "ok") << ok.reason;
  EXPECT_EQ(ok.devices, 4);
  // SP without TP is rejected as a combination, not as a spec.
  EXPECT_EQ(piper::search::run_point(points[1], "").status, "invalid");
  json bad = spec;
  bad["recompute"] = "some";
  EXPECT_THROW((void)piper::search::SweepSpec::from_json(bad, "s.json"), piper::search::SweepError);
}

// The CLI: a global batch that does not divide is one error line and exit status 2.
TEST(TensorParallel, CliGlobalBatchError) {
  const std::string err = ::testing::TempDir() + "/tp-cli-err.txt";
  const std::string cmd = std::string(PIPER_CLI) + " compile --model " + write_spec(small_gpt()) +
                          " --dp 2 --tp 2 --micro-batch-size 2 --global-batch 6 >/dev/null 2>" + err;
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
  std::ifstream in(err);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("--global-batch 6 is not divisible by micro-batch size 2 x --dp 2"), std::string::npos)
      << text.str();
}
