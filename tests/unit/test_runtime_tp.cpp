// Tensor/sequence parallelism and recomputation in the host model, without MPI: TP ranks run as
// threads over an in-process TpComm, and their gradients (mapped to the canonical layout) and losses
// must equal the single-rank model's on the same microbatch.
#include <barrier>
#include <cmath>
#include <map>
#include <thread>

#include <gtest/gtest.h>

#include "piper/core/model.hpp"
#include "piper/runtime/host_model.hpp"

namespace core = piper::core;
using namespace piper::runtime::host;

namespace {

const std::string kDense = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-dense.json";
const std::string kMoe = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";
const std::string kGpt = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-gpt.json";

// Threads of one TP group: each collective deposits its buffer, meets the others at a barrier,
// reads all buffers in rank order, and meets them again before the slots are reused.
struct Group {
  explicit Group(int n) : size(n), barrier(n), slots(static_cast<std::size_t>(n)) {}
  int size;
  std::barrier<> barrier;
  std::vector<std::vector<float>> slots;
};

class ThreadComm : public TpComm {
 public:
  ThreadComm(Group& g, int rank) : g_(g), rank_(rank) {}
  int size() const override { return g_.size; }
  int rank() const override { return rank_; }
  void allreduce_sum(float* d, std::int64_t n) override {
    exchange(d, n, [&](std::int64_t i) {
      float s = 0;
      for (const auto& v : g_.slots) s += v[static_cast<std::size_t>(i)];
      d[i] = s;
    });
  }
  void allreduce_max(float* d, std::int64_t n) override {
    exchange(d, n, [&](std::int64_t i) {
      float m = g_.slots[0][static_cast<std::size_t>(i)];
      for (const auto& v : g_.slots) m = std::max(m, v[static_cast<std::size_t>(i)]);
      d[i] = m;
    });
  }
  void allgather(const float* in, std::int64_t n, float* out) override {
    g_.slots[static_cast<std::size_t>(rank_)].assign(in, in + n);
    g_.barrier.arrive_and_wait();
    for (int r = 0; r < g_.size; ++r)
      std::copy(g_.slots[static_cast<std::size_t>(r)].begin(), g_.slots[static_cast<std::size_t>(r)].end(),
                out + r * n);
    g_.barrier.arrive_and_wait();
  }
  void reduce_scatter(const float* in, std::int64_t n, float* out) override {
    g_.slots[static_cast<std::size_t>(rank_)].assign(in, in + n * g_.size);
    g_.barrier.arrive_and_wait();
    for (std::int64_t i = 0; i < n; ++i) {
      float s = 0;
      for (const auto& v : g_.slots) s += v[static_cast<std::size_t>(rank_ * n + i)];
      out[i] = s;
    }
    g_.barrier.arrive_and_wait();
  }

 private:
  template <class F>
  void exchange(float* d, std::int64_t n, F each) {
    g_.slots[static_cast<std::size_t>(rank_)].assign(d, d + n);
    g_.barrier.arrive_and_wait();
    for (std::int64_t i = 0; i < n; ++i) each(i);
    g_.barrier.arrive_and_wait();
  }
  Group& g_;
  int rank_;
};

struct Outcome {
  double loss = 0;
  std::map<int, std::vector<float>> grads;  // canonical layout per layer
  std::int64_t stash_floats = 0;            // kept between F and B (summed over segments)
};

void merge(std::map<int, std::vector<float>>& into, const std::vector<ParamRecord>& records, const core::Model& m,
           const HostModel& hm) {
  for (const auto& r : records) {
    auto& v = into[r.layer];
    v.resize(static_cast<std::size_t>(hm.layer_param_count(r.layer)), std::nanf(""));
    std::copy(r.values.begin(), r.values.end(), v.begin() + r.offset);
  }
  (void)m;
}

// One microbatch (2 sequences) through the model cut into segments at `cuts`, on `tp` ranks.
Outcome run(const std::string& spec, int tp, bool seq_par, RecomputeMode recompute, std::vector<int> cuts = {}) {
  const core::Model model = core::build_model(core::load_model_config(spec));
  const int layers = static_cast<int>(model.layers().size());
  cuts.insert(cuts.begin(), 0);
  cuts.push_back(layers);
  TokenStream stream(model.config()->vocab, model.training().seq_len, 5);
  const MicrobatchData data = stream.microbatch(0, 0, 0, 1, 1, model.training().micro_batch_size);
  const float scale = 1.0f / static_cast<float>(data.tokens.size());
  Group group(tp);
  std::vector<Outcome> per_rank(static_cast<std::size_t>(tp));
  std::vector<std::unique_ptr<HostModel>> models(static_cast<std::size_t>(tp));
  auto body = [&](int rank) {
    std::vector<SegmentSpec> specs;
    for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
      SegmentSpec sp;
      sp.segment = static_cast<int>(s), sp.first_layer = cuts[s], sp.last_layer = cuts[s + 1];
      sp.tp_degree = tp, sp.tp_rank = rank, sp.sequence_parallel = seq_par, sp.recompute = recompute;
      specs.push_back(sp);
    }
    auto& m = models[static_cast<std::size_t>(rank)];
    m = std::make_unique<HostModel>(model, specs, 11);
    ThreadComm comm(group, rank);
    if (tp > 1)
      for (const auto& sp : specs) m->set_tp_comm(sp.segment, &comm);
    Outcome& o = per_rank[static_cast<std::size_t>(rank)];
    std::vector<SegmentStash> stash(specs.size());
    ForwardState state;
    for (std::size_t s = 0; s < specs.size(); ++s)
      o.loss += m->forward(static_cast<int>(s), data, scale, state, stash[s]);
    for (const auto& st : stash) o.stash_floats += st.floats();
    BackwardState g;
    for (std::size_t s = specs.size(); s-- > 0;) m->backward_input(static_cast<int>(s), g, stash[s]);
    for (std::size_t s = 0; s < specs.size(); ++s) m->backward_weight(static_cast<int>(s), stash[s]);
    // Tied embeddings cut into two segments: sum the embedding's and the head copy's gradients (the
    // backend does this between the two devices before the update).
    std::vector<std::span<float>> tied;
    for (std::size_t s = 0; s < specs.size(); ++s)
      if (auto t = m->tied_grads(static_cast<int>(s)); !t.empty()) tied.push_back(t);
    if (tied.size() == 2)
      for (std::size_t i = 0; i < tied[0].size(); ++i) tied[0][i] = tied[1][i] = tied[0][i] + tied[1][i];
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
  Outcome out;
  for (int r = 0; r < tp; ++r) {
    out.loss += per_rank[static_cast<std::size_t>(r)].loss;
    out.stash_floats = std::max(out.stash_floats, per_rank[static_cast<std::size_t>(r)].stash_floats);
    merge(out.grads, models[static_cast<std::size_t>(r)]->grad_records(), model, *models[static_cast<std::size_t>(r)]);
  }
  return out;
}

// Gradients are sums of a few hundred products of O(1) terms: fp32 reassociation stays ~1e-6.
void expect_same(const Outcome& ref, const Outcome& got, const std::string& what) {
  EXPECT_NEAR(got.loss, ref.loss, 1e-5 * std::abs(ref.loss)) << what;
  ASSERT_EQ(got.grads.size(), ref.grads.size()) << what;
  double worst = 0, scale = 0;
  for (const auto& [layer, a] : ref.grads) {
    const auto& b = got.grads.at(layer);
    ASSERT_EQ(a.size(), b.size()) << what << " layer " << layer;
    for (std::size_t i = 0; i < a.size(); ++i) {
      ASSERT_FALSE(std::isnan(b[i])) << what << ": layer " << layer << " element " << i << " has no gradient";
      worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])));
      scale = std::max(scale, static_cast<double>(std::abs(a[i])));
    }
  }
  EXPECT_LT(worst, 1e-5 * scale) << what << " (largest gradient " << scale << ")";
}

}  // namespace

TEST(RuntimeTp, TensorParallelGradientsMatchTheSingleRank) {
  const Outcome ref = run(kDense, 1, false, RecomputeMode::None);
  expect_same(ref, run(kDense, 2, false, RecomputeMode::None), "TP2");
  expect_same(ref, run(kDense, 2, true, RecomputeMode::None), "TP2+SP");
  expect_same(ref, run(kDense, 2, true, RecomputeMode::None, {5, 9}), "TP2+SP, three segments");
  expect_same(ref, run(kDense, 2, false, RecomputeMode::None, {5, 9}), "TP2, three segments");
}

TEST(RuntimeTp, MoeRouterAndLocalExpertsUnderTensorParallelism) {
  const Outcome ref = run(kMoe, 1, false, RecomputeMode::None);
  expect_same(ref, run(kMoe, 2, false, RecomputeMode::None), "MoE TP2");
  expect_same(ref, run(kMoe, 2, true, RecomputeMode::None), "MoE TP2+SP");
}

// Recomputation changes what is kept, never the result.
TEST(RuntimeTp, RecomputeKeepsLessAndMatches) {
  const Outcome none = run(kDense, 1, false, RecomputeMode::None);
  const Outcome selective = run(kDense, 1, false, RecomputeMode::Selective);
  const Outcome full = run(kDense, 1, false, RecomputeMode::Full);
  expect_same(none, selective, "selective");
  expect_same(none, full, "full");
  // Selective drops per layer the softmax (seqs * heads * L^2) and the core output (T * heads * hd).
  const core::Model model = core::build_model(core::load_model_config(kDense));
  const auto& a = *model.config();
  const std::int64_t L = model.training().seq_len, B = model.training().micro_batch_size;
  const std::int64_t core_floats = a.layers * (B * a.heads * L * L + B * L * a.heads * a.head_dim);
  EXPECT_EQ(none.stash_floats - selective.stash_floats, core_floats);
  // Full keeps the segment input: the tokens and targets of the microbatch (the first segment has no
  // activation input).
  EXPECT_EQ(full.stash_floats, 2 * B * L);
  const Outcome full_tp = run(kDense, 2, true, RecomputeMode::Full, {5, 9});
  expect_same(none, full_tp, "full, TP2+SP, three segments");
  expect_same(none, run(kDense, 2, false, RecomputeMode::Selective, {5}), "selective, TP2");
}

// GPT layers under TP: column-parallel q/k/v and fc1 biases split with their weights, the
// row-parallel output biases added once after the reduction, LayerNorms and positions replicated (SP:
// their gradients summed over the group), and the tied head's copy of the embedding in another segment.
TEST(RuntimeTp, GptLayersMatchTheSingleRank) {
  const Outcome ref = run(kGpt, 1, false, RecomputeMode::None);
  expect_same(ref, run(kGpt, 1, false, RecomputeMode::None, {5, 17}), "tied copy in the last segment");
  expect_same(ref, run(kGpt, 2, false, RecomputeMode::None), "GPT TP2");
  expect_same(ref, run(kGpt, 2, true, RecomputeMode::None), "GPT TP2+SP");
  expect_same(ref, run(kGpt, 2, true, RecomputeMode::None, {5, 17}), "GPT TP2+SP, three segments, tied copy");
  expect_same(ref, run(kGpt, 2, false, RecomputeMode::Selective, {9}), "GPT TP2, selective, tied copy");
  expect_same(ref, run(kGpt, 2, true, RecomputeMode::Full, {5, 9}), "GPT TP2+SP, full recompute");
}
