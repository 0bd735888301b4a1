// Runtime equivalence: compiled plans run as MPI ranks (one per device) and as virtual devices (threads
// of one process) and must match the single-process reference, for every schedule family and
// strategy (expect_equivalent, runtime_support.hpp).
#include <unistd.h>

#include <gtest/gtest.h>

#include "runtime_support.hpp"

using namespace runtime_test;

TEST(RuntimeEquivalence, OneFOneB_PP2xDP2) { expect_equivalent("1f1b", 4, strategy(2, 2, 1, 0, 4, "1f1b")); }
TEST(RuntimeEquivalence, GPipe_PP4) { expect_equivalent("gpipe", 4, strategy(4, 1, 1, 0, 4, "gpipe")); }
// Synchronous pipeline transfers (place "blocking", DeepSpeed's engine) change when ops run, not what they compute.
TEST(RuntimeEquivalence, OneFOneB_PP2xDP2_BlockingTransfers) {
  core::StrategyOptions o = strategy(2, 2, 1, 0, 4, "1f1b");
  o.p2p_blocking = true;
  expect_equivalent("blocking", 4, o);
}
TEST(RuntimeEquivalence, OneFOneB_PP2xDP2xEP2_Zero2) { expect_equivalent("zero2", 4, strategy(2, 2, 2, 2, 4, "1f1b")); }
TEST(RuntimeEquivalence, OneFOneB_PP2xDP2xEP2_Zero3) { expect_equivalent("zero3", 4, strategy(2, 2, 2, 3, 4, "1f1b")); }
TEST(RuntimeEquivalence, BucketedDP2) { expect_equivalent("bucket", 2, strategy(1, 2, 1, 0, 2, "1f1b", 1, 0.05)); }
TEST(RuntimeEquivalence, Interleaved1F1B_PP2x2Chunks) {
  expect_equivalent("interleaved", 2, strategy(2, 1, 1, 0, 4, "interleaved-1f1b", 2));
}
TEST(RuntimeEquivalence, ZBH1_PP2) { expect_equivalent("zbh1", 2, strategy(2, 1, 1, 0, 4, "zb-h1")); }
// The automatic zero-bubble scheduler (ZB-1p, ZB-2p): orders that no hand-made family emits.
TEST(RuntimeEquivalence, ZBAuto1p_PP2) { expect_equivalent("zbauto1p", 2, strategy(2, 1, 1, 0, 4, "zb-auto")); }
TEST(RuntimeEquivalence, ZBAuto2p_PP4) {
  core::StrategyOptions o = strategy(4, 1, 1, 0, 8, "zb-auto");
  o.zb_memory_limit = "2p";
  expect_equivalent("zbauto2p", 4, o);
}
TEST(RuntimeEquivalence, DualPipeV_PP2xDP2xEP2) {
  expect_equivalent("dualpipev", 4, strategy(2, 2, 2, 0, 4, "dualpipev"));
}
TEST(RuntimeEquivalence, ZBV_PP2) { expect_equivalent("zbv", 2, strategy(2, 1, 1, 0, 4, "zb-v")); }
// The embedding and the head as regions of their own (--v-embedding, --v-head): the head's rank gets
// the last V block's output and sends back its gradient; the embedding's feeds the V's first block.
TEST(RuntimeEquivalence, ZBV_PP2_HeadAndEmbeddingRegionsOnRank1) {
  core::StrategyOptions o = strategy(2, 1, 1, 0, 4, "zb-v");
  o.v_head = "1";
  o.v_embedding = "1";
  expect_equivalent("zbv-ends", 2, o);
}
// The head alone on the last rank, the V over the other two (4 blocks in 4 regions).
TEST(RuntimeEquivalence, DualPipeV_PP3_HeadAlone) {
  core::StrategyOptions o = strategy(3, 1, 1, 0, 4, "dualpipev");
  o.v_head = "alone";
  expect_equivalent("dualpipev-alone", 3, o);
}
TEST(RuntimeEquivalence, DualPipeV_PP2xDP2xEP2_HeadRegionOnRank1) {
  core::StrategyOptions o = strategy(2, 2, 2, 0, 4, "dualpipev");
  o.v_head = "1";
  expect_equivalent("dualpipev-head", 4, o);
}
// Two mirrored model copies: each device runs different data-parallel ranks in different segments.
TEST(RuntimeEquivalence, DualPipe_PP2) { expect_equivalent("dualpipe", 2, strategy(2, 1, 1, 0, 4, "dualpipe")); }
TEST(RuntimeEquivalence, ClipGrad_DualPipe_PP2) {
  expect_equivalent("clip-dualpipe", 2, clipped(strategy(2, 1, 1, 0, 4, "dualpipe")));
}
TEST(RuntimeEquivalence, ClipGrad_PP2xDP2xEP2_Zero2) {
  expect_equivalent("clip-zero2-ep", 4, clipped(strategy(2, 2, 2, 2, 4, "1f1b")));
}
TEST(RuntimeEquivalence, PublishedFixtureV_PP4xDP2xEP2) {
  expect_equivalent("fixture-v", 4, {}, std::string(PIPER_FIXTURES) + "/piper-directives/pp4_dp2_ep2_v_placement.json");
}

// The microbatch of every op is Op::microbatch, whatever the split's dimension is called (issue 24:
// the runtime read the tag "MB" and ran every microbatch of another dimension on microbatch 0's data).
TEST(RuntimeEquivalence, CustomSplitDimension_1F1B_PP2xDP2xEP2) {
  const auto o = strategy(2, 2, 2, 0, 4, "1f1b");
  const std::string program = rewritten_program(
      "custom-dim", o,
      [](json& f) {
        f["SAMPLE"] = f["MB"];
        f.erase("MB");
      },
      json::array({split_directive("SAMPLE", 4)}));
  expect_equivalent("custom-dim", 4, {}, program);
}

// Nested splits (2 x 2 microbatches): filter {MB: k} becomes {outer: k / 2, inner: k % 2}, and
// the flat index outer * 2 + inner must run on microbatch k's data. Zero-bubble orders also split B
// into BI and BW per microbatch.
namespace {
std::function<void(json&)> nest(const std::string& outer, const std::string& inner) {
  return [=](json& f) {
    const json mb = f["MB"];
    f.erase("MB");
    if (mb.is_number_integer()) {
      f[outer] = mb.get<int>() / 2;
      f[inner] = mb.get<int>() % 2;
    } else {
      f[outer] = mb, f[inner] = mb;
    }
  };
}
}  // namespace
TEST(RuntimeEquivalence, NestedSplits_ZBH1_PP2) {
  const std::string program =
      rewritten_program("nested", strategy(2, 1, 1, 0, 4, "zb-h1"), nest("OUTER", "INNER"),
                        json::array({split_directive("OUTER", 2), split_directive("INNER", 2)}));
  expect_equivalent("nested", 2, {}, program);
}
TEST(RuntimeEquivalence, NestedSplits_1F1B_PP2xDP2) {
  const std::string program = rewritten_program("nested-dp", strategy(2, 2, 1, 0, 4, "1f1b"), nest("DATA", "ACC"),
                                                json::array({split_directive("DATA", 2), split_directive("ACC", 2)}));
  expect_equivalent("nested-dp", 4, {}, program);
}

// Tensor and sequence parallelism, recomputation (issue 10): TP collectives run inside the compute ops
// over MPI; every composition must still match the single-process reference.
TEST(RuntimeEquivalence, TP2xPP2xDP2_1F1B) {
  expect_equivalent("tp2pp2dp2", 8, megatron(strategy(2, 2, 1, 0, 4, "1f1b"), 2, false, "none"), "", kDense);
}
TEST(RuntimeEquivalence, TP2_SP_PP2_1F1B) {
  expect_equivalent("tp2sp-1f1b", 4, megatron(strategy(2, 1, 1, 0, 4, "1f1b"), 2, true, "none"), "", kDense);
}
TEST(RuntimeEquivalence, TP2_SP_PP2_Interleaved_FullRecompute) {
  expect_equivalent("tp2sp-interleaved", 4, megatron(strategy(2, 1, 1, 0, 4, "interleaved-1f1b", 2), 2, true, "full"),
                    "", kDense);
}
TEST(RuntimeEquivalence, TP2xDP2_Zero3) {
  expect_equivalent("tp2-zero3", 4, megatron(strategy(1, 2, 1, 3, 2, "1f1b"), 2, false, "none"), "", kDense);
}
// BI/BW split: the recomputation runs at the start of BI, BW uses what it rebuilt.
TEST(RuntimeEquivalence, TP2_PP2_ZBH1_SelectiveRecompute) {
  expect_equivalent("tp2-zbh1-selective", 4, megatron(strategy(2, 1, 1, 0, 4, "zb-h1"), 2, false, "selective"), "",
                    kDense);
}
// Context parallelism (issue 26): each CP rank holds two load-balanced causal chunks of every sequence,
// attention gathers K/V over the CP group with the causal mask by global position and returns dK/dV
// to their owners, and the gradients are reduced over DP x CP; the loss and parameters must match the
// single-process reference. (The ring and the all-gather variant compute the same sums.)
TEST(RuntimeEquivalence, CP2_Ring) {
  expect_equivalent("cp2", 2, context_parallel(strategy(1, 1, 1, 0, 2, "1f1b"), 2), "", kDense);
}
TEST(RuntimeEquivalence, CP4_AllGather_SelectiveRecompute) {
  expect_equivalent("cp4-ag", 4,
                    megatron(context_parallel(strategy(1, 1, 1, 0, 2, "1f1b"), 4, true), 1, false, "selective"), "",
                    kDense);
}
TEST(RuntimeEquivalence, CP2xPP2_1F1B) {
  expect_equivalent("cp2pp2", 4, context_parallel(strategy(2, 1, 1, 0, 4, "1f1b"), 2), "", kDense);
}
TEST(RuntimeEquivalence, CP2xDP2_Zero1) {
  expect_equivalent("cp2dp2-zero1", 4, context_parallel(strategy(1, 2, 1, 1, 2, "1f1b"), 2), "", kDense);
}
TEST(RuntimeEquivalence, ClipGrad_CP2xDP2_Zero1) {
  expect_equivalent("clip-cp2dp2", 4, clipped(context_parallel(strategy(1, 2, 1, 1, 2, "1f1b"), 2)), "", kDense);
}
// EP groups across DP x CP (Megatron-core's layout, issue 26): each CP rank routes its own load-balanced
// chunks of the sequence to the experts of its EP group (CP 2 x EP 2: the CP pair is the EP group; with
// DP 2 x CP 2 x EP 2 the experts' gradients are reduced over the two replicas holding the same experts).
TEST(RuntimeEquivalence, CP2xEP2_MoE) {
  expect_equivalent("cp2-ep2", 2, context_parallel(strategy(1, 1, 2, 0, 2, "1f1b"), 2));
}
TEST(RuntimeEquivalence, DP2xCP2xEP2_MoE) {
  expect_equivalent("dp2cp2-ep2", 4, context_parallel(strategy(1, 2, 2, 0, 2, "1f1b"), 2));
}
TEST(RuntimeEquivalence, TP2xCP2_SP) {
  expect_equivalent("tp2cp2", 4, megatron(context_parallel(strategy(1, 1, 1, 0, 2, "1f1b"), 2), 2, true, "none"), "",
                    kDense);
}

// MoE: routed experts keep EP beside the TP segments. Without SP both TP ranks route the same tokens
// (the experts' gradients are divided by the copies); with SP each routes its sequence slice.
TEST(RuntimeEquivalence, TP2xDP2xEP2_MoE) {
  expect_equivalent("tp2-ep2", 4, megatron(strategy(1, 2, 2, 0, 2, "1f1b"), 2, false, "none"));
}
TEST(RuntimeEquivalence, TP2_SP_DP2xEP2_MoE) {
  expect_equivalent("tp2sp-ep2", 4, megatron(strategy(1, 2, 2, 0, 2, "1f1b"), 2, true, "none"));
}
// EP groups formed over DP x TP (Megatron-core's rule, issue 26): EP 2 over the two TP ranks of one
// replica, and whole experts on both TP ranks, their gradients reduced over the pair (with SP the
// ranks route different tokens; without it the same ones, divided by the copies).
TEST(RuntimeEquivalence, TP2_SP_EP2_MoE_EpOverTheTpGroup) {
  expect_equivalent("tp2sp-ep2-dp1", 2, megatron(strategy(1, 1, 2, 0, 2, "1f1b"), 2, true, "none"));
}
TEST(RuntimeEquivalence, TP2_SP_MoE_ExpertsOnBothTpRanks) {
  expect_equivalent("tp2sp-ep1", 2, megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, true, "none"));
}
TEST(RuntimeEquivalence, TP2_MoE_ExpertsOnBothTpRanks) {
  expect_equivalent("tp2-ep1", 2, megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, false, "none"));
}
// Expert tensor parallelism (issue 26): each expert's FFN split over the ETP group (fc1 columns, fc2
// rows), the routed rows all-gathered before fc1 and the partial sums reduce-scattered after fc2; EP
// groups take one device of each ETP group, expert gradients reduced over the expert-DP group.
TEST(RuntimeEquivalence, TP2_SP_ETP2_MoE) {
  core::StrategyOptions o = megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, true, "none");
  o.etp = 2;
  expect_equivalent("tp2sp-etp2", 2, o);
}
TEST(RuntimeEquivalence, ClipGrad_TP2_SP_PP2) {
  expect_equivalent("clip-tp2sp", 4, clipped(megatron(strategy(2, 1, 1, 0, 4, "1f1b"), 2, true, "none")), "", kDense);
}
TEST(RuntimeEquivalence, ClipGrad_TP2_SP_ETP2_MoE) {
  core::StrategyOptions o = clipped(megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, true, "none"));
  o.etp = 2;
  expect_equivalent("clip-tp2sp-etp2", 2, o);
}
TEST(RuntimeEquivalence, TP2_ETP2_MoE_WithoutSp) {
  core::StrategyOptions o = megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, false, "none");
  o.etp = 2;
  expect_equivalent("tp2-etp2", 2, o);
}
TEST(RuntimeEquivalence, TP2_SP_DP2xEP2xETP2_MoE) {
  core::StrategyOptions o = megatron(strategy(1, 2, 2, 0, 2, "1f1b"), 2, true, "none");
  o.etp = 2;
  expect_equivalent("tp2sp-ep2-etp2", 4, o);
}
// ETP across data-parallel replicas (no dense TP): the pair gathers each other's tokens.
TEST(RuntimeEquivalence, DP2xETP2_MoE_Zero1) {
  core::StrategyOptions o = strategy(1, 2, 1, 1, 2, "1f1b");
  o.etp = 2;
  expect_equivalent("dp2-etp2", 2, o);
}
TEST(RuntimeEquivalence, FullRecompute_ZBH1_PP2) {
  expect_equivalent("full-zbh1", 2, megatron(strategy(2, 1, 1, 0, 4, "zb-h1"), 1, false, "full"));
}
// Every 2nd block (TorchTitan's ac_freq 2): the plan recomputes blocks 1 and 3 and nothing else, and
// the host backend runs exactly those segments with full recomputation (one segment per block).
TEST(RuntimeEquivalence, FullRecomputeEverySecondBlock_1F1B_PP2) {
  core::StrategyOptions o = megatron(strategy(2, 1, 1, 0, 4, "1f1b"), 1, false, "full");
  o.recompute_every = 2;
  const fs::path plan = compile_plan(temp_dir("every2-plan"), o, "", kDense);
  std::ifstream in(plan);
  const core::Program p = core::Program::from_json(json::parse(in));
  std::set<int> recomputed;
  for (const auto& seg : p.segments)
    if (seg.recompute == core::Recompute::Full) recomputed.insert(seg.tags.at("BLK"));
  EXPECT_EQ(recomputed, (std::set<int>{1, 3}));
  expect_equivalent("every2-1f1b", 2, o, "", kDense);
}
// Uneven pipelines: 4 blocks in 3 interleaved chunks on 2 ranks (rank 0 holds chunks 0 and 2, rank
// 1 chunk 1), and 1F1B with a one-block first stage (Megatron's --decoder-first-pipeline-num-layers).
TEST(RuntimeEquivalence, Uneven_Interleaved_3ChunksOn2Ranks) {
  expect_equivalent("uneven-interleaved", 2, strategy(2, 1, 1, 0, 4, "interleaved-1f1b"), "", kDense,
                    [](core::Scenario& s) { s.stages = 3; });
}
TEST(RuntimeEquivalence, Uneven_1F1B_FirstStageOneBlock_PP2xDP2) {
  expect_equivalent("uneven-first", 4, strategy(2, 2, 1, 0, 4, "1f1b"), "", kDense,
                    [](core::Scenario& s) { s.first_stage_layers = 1; });
}
TEST(RuntimeEquivalence, SelectiveRecompute_PP2xDP2xEP2) {
  expect_equivalent("selective-ep", 4, megatron(strategy(2, 2, 2, 0, 4, "1f1b"), 1, false, "selective"));
}

// HSDP: the gradient is reduce-scattered inside each shard group, each shard all-reduced across the
// groups, and (ZeRO-1/2) the updated shards gathered inside the group, or (ZeRO-3) gathered there
// before each use. With EP2 over DP4 the experts' 2 replicas are one group (plain ZeRO).
TEST(RuntimeEquivalence, HSDP_DP4_Zero1) {
  expect_equivalent("hsdp-zero1", 4, hsdp(strategy(1, 4, 1, 1, 2, "1f1b"), 2));
}
TEST(RuntimeEquivalence, ClipGrad_HSDP_DP4_Zero3) {
  expect_equivalent("clip-hsdp-zero3", 4, clipped(hsdp(strategy(1, 4, 1, 3, 2, "1f1b"), 2)), "", kDense);
}
TEST(RuntimeEquivalence, HSDP_PP2xDP4xEP2_Zero2) {
  expect_equivalent("hsdp-zero2-ep", 8, hsdp(strategy(2, 4, 2, 2, 4, "1f1b"), 2));
}
TEST(RuntimeEquivalence, HSDP_TP2xDP4_Zero3) {
  expect_equivalent("hsdp-tp2-zero3", 8, hsdp(megatron(strategy(1, 4, 1, 3, 2, "1f1b"), 2, false, "none"), 2), "",
                    kDense);
}

// GPT-style models. Tied: the embedding (first stage) and the head's copy (last stage) sum their
// gradients before the data-parallel reduction and the update; every layout must still match the
// single-process reference, where the head uses the embedding's table itself.
TEST(RuntimeEquivalence, Gpt_Tied_1F1B_PP2xDP2) {
  expect_equivalent("gpt-1f1b", 4, strategy(2, 2, 1, 0, 4, "1f1b"), "", kGpt);
}
TEST(RuntimeEquivalence, ClipGrad_Gpt_Tied_PP2xDP2) {  // the head's copy of the table is not counted again
  expect_equivalent("clip-gpt", 4, clipped(strategy(2, 2, 1, 0, 4, "1f1b")), "", kGpt);
}
TEST(RuntimeEquivalence, Gpt_Untied_1F1B_PP2xDP2) {
  expect_equivalent("gpt-untied-1f1b", 4, strategy(2, 2, 1, 0, 4, "1f1b"), "", kGptUntied);
}
TEST(RuntimeEquivalence, Gpt_Tied_TP2_SP_PP2) {
  expect_equivalent("gpt-tp2sp-pp2", 4, megatron(strategy(2, 1, 1, 0, 4, "1f1b"), 2, true, "none"), "", kGpt);
}
TEST(RuntimeEquivalence, Gpt_Tied_TP2xDP2_Zero3) {
  expect_equivalent("gpt-tp2-zero3", 4, megatron(strategy(1, 2, 1, 3, 2, "1f1b"), 2, false, "none"), "", kGpt);
}
// ZeRO-3 across stages: the tied sum runs on the local gradients before the reduce-scatter.
TEST(RuntimeEquivalence, Gpt_Tied_PP2xDP2_Zero3) {
  expect_equivalent("gpt-pp2-zero3", 4, strategy(2, 2, 1, 3, 4, "1f1b"), "", kGpt);
}
TEST(RuntimeEquivalence, Gpt_Tied_ZBH1_PP2_SelectiveRecompute) {
  expect_equivalent("gpt-zbh1-selective", 2, megatron(strategy(2, 1, 1, 0, 4, "zb-h1"), 1, false, "selective"), "",
                    kGpt);
}
// V placement: device 0 holds both the embedding and the head (two segments): the sum is local.
TEST(RuntimeEquivalence, Gpt_Tied_ZBV_PP2) {
  expect_equivalent("gpt-zbv", 2, strategy(2, 1, 1, 0, 4, "zb-v"), "", kGpt);
}
// The tied head as a region of its own on rank 1: the table's two copies sum across ranks again.
TEST(RuntimeEquivalence, Gpt_Tied_ZBV_PP2_HeadRegionOnRank1) {
  core::StrategyOptions o = strategy(2, 1, 1, 0, 4, "zb-v");
  o.v_head = "1";
  expect_equivalent("gpt-zbv-head", 2, o, "", kGpt);
}
TEST(RuntimeEquivalence, Gpt_Tied_DualPipeV_PP2xDP2) {
  expect_equivalent("gpt-dualpipev", 4, strategy(2, 2, 1, 0, 4, "dualpipev"), "", kGpt);
}
// Untied, the bidirectional placement that the tied model refuses runs as any other.
TEST(RuntimeEquivalence, Gpt_Untied_DualPipe_PP2) {
  expect_equivalent("gpt-untied-dualpipe", 2, strategy(2, 1, 1, 0, 4, "dualpipe"), "", kGptUntied);
}
TEST(RuntimeEquivalence, Gpt_Tied_Interleaved_PP2x2Chunks) {
  expect_equivalent("gpt-interleaved", 2, strategy(2, 1, 1, 0, 4, "interleaved-1f1b", 2), "", kGpt);
}
