// Strategy search (`piper tune`): enumerate the legal strategies for a model on N devices, prune
// those whose closed-form memory lower bound exceeds the cap, rank the rest with the analytic engine
// (in parallel), try a few PP region placements balanced with the real cost model for the leaders,
// re-simulate the best on the SimGrid engine, and keep every result in a resumable CSV.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/search/results_csv.hpp"

namespace piper::search {

// A bad tune request or results file: one line naming the flag, file or field.
class TuneError : public core::Error {
 public:
  using core::Error::Error;
};

// The default memory reserve: 5 % of a GPU's HBM (4 GiB of an 80 GiB H100, 7 GiB of a 141 GB H200),
// about what a CUDA context (0.5-1 GiB), NCCL's buffers (1-2 GiB at scale) and the caching
// allocator's fragmentation take beside the tensors a plan holds.
constexpr double kDefaultMemoryReserveFraction = 0.05;

// "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", ...
std::string ordinal(long long n);

struct TuneSpec {
  std::string model = "qwen3-9m";    // zoo name, model spec or HF config
  std::string cluster = "dgx-h200";  // preset or file; grown to `devices` when not fixed
  int devices = 8;
  std::int64_t global_batch = 0;                      // sequences per step; 0: 4 per device
  std::int64_t seq_len = 0;                           // 0: the model's
  std::vector<std::int64_t> micro_batch_sizes{1, 2};  // sequences per microbatch to try
  std::vector<int> zero_levels{0, 1, 2, 3};
  // Tensor-parallel degrees to try; empty: every degree dividing the devices and the GPUs of every
  // node (TP groups stay inside a node) that the compiler accepts for the model (heads, ffn, ...).
  std::vector<int> tp_degrees;
  // Context-parallel degrees to try (--cp); empty: CP 1 only. A degree whose 2·cp chunks do not cut
  // the sequence, or whose tp·cp does not divide the devices, is left out (EnumerationStats::cp_rejected).
  std::vector<int> cp_degrees;
  // Pins: the pipeline-parallel, data-parallel and expert-parallel degrees to try; empty: every legal
  // one. A pinned PP or DP degree must divide the devices.
  std::vector<int> pp_degrees, dp_degrees, ep_degrees;
  // Expert tensor-parallel degrees to try (--etp); each must divide the candidate's TP degree (the
  // ETP groups then sit inside the TP groups) and the experts' FFN. Empty: 1 (whole experts).
  std::vector<int> etp_degrees;
  std::vector<bool> sequence_parallel{false, true};  // tried for TP degrees > 1 (TP 1 has none)
  std::vector<std::string> recompute_modes{"none", "selective", "full"};
  // SMs of each GPU given to communication (the sm_partition directive, --comm-sms) to try; 0 is
  // "shared" (no partition). Empty: shared only.
  std::vector<int> comm_sms;
  // HSDP shard groups (data-parallel replicas per ZeRO shard group, --dp-shard) to try with ZeRO >= 1;
  // 0 is plain ZeRO. A size that does not split a candidate's replicas is skipped for it. Empty:
  // plain ZeRO only.
  std::vector<int> dp_shards;
  // ZeRO-2/3 gradient reductions to try (--reduce-every): "microbatch" (DeepSpeed, FSDP2) and/or
  // "step" (whole gradients kept, FSDP no_sync). Empty: both.
  std::vector<std::string> reduce_every;
  std::vector<std::string> schedules;  // families to try; empty: every registered family
  int max_virtual = 4;                 // largest regions-per-rank count tried (families that take it)
  double memory_cap_bytes = 0;         // 0: the smallest HBM of the cluster's GPUs less the reserve
  // Bytes of HBM kept out of the default cap for what the simulator does not model: the CUDA context,
  // NCCL buffers and allocator fragmentation. < 0: kDefaultMemoryReserveFraction of the HBM. Not
  // applied to an explicit memory_cap_bytes (that is the whole budget).
  double memory_reserve_bytes = -1;
  int top_k = 3;                 // re-simulated on the SimGrid engine (0: none)
  bool placement_search = true;  // try cost-model-balanced PP boundaries for the leaders
  int placement_leaders = 0;     // strategies whose placement is searched; 0: max(top_k, 4)
  // The best this many plans are exact: a candidate whose step time lower bound exceeds the
  // exact_top-th best fitting step time found so far is not simulated (branch and bound).
  int exact_top = 10;
  std::string calibration_path;
  // The settings the search does not vary (bucket_mb, tp_comm_overlap, fp8_all_gather, ...): every
  // candidate starts from these; the searched ones are overwritten.
  core::StrategyOptions fixed;

  std::int64_t effective_global_batch() const { return global_batch > 0 ? global_batch : 4LL * devices; }
};

// One point of the search space: the strategy settings (core/settings.hpp; the search varies pp, dp,
// ep, zero, tp, sequence_parallel, recompute, comm_sms, dp_shard, reduce_every, schedule,
// virtual_stages and microbatches, each one loop in enumerate_candidates; the others come from
// TuneSpec::fixed) plus the batch split and the PP placement.
struct TuneCandidate : core::StrategyOptions {
  std::int64_t micro_batch_size = 1;  // sequences per microbatch
  std::string placement = "default";  // how the PP boundaries were chosen (a label)
  std::vector<int> pp_ranges;         // first block of each PP region; empty: the generator's balance
  // Device group of each pipeline rank (a permutation of 0..pp-1; empty: rank r on group r). Group g
  // is the devices the generator gives rank g (core::devices_of_rank, in the --device-order).
  std::vector<int> rank_order;

  // Stable identity (no commas): the resume key.
  std::string key() const;
  // "PP 4 x TP 2 (SP) x DP 2, <family>, 8 microbatches of 1, ZeRO-1, recompute selective" and the
  // boundaries when not the default.
  std::string describe() const;
  friend bool operator==(const TuneCandidate&, const TuneCandidate&) = default;
};

// The scenario that compiles `c` for the spec's model (training shape, strategy, PP ranges, cluster).
core::Scenario tune_scenario(const TuneSpec& spec, const TuneCandidate& c, const std::string& engine = "analytic");

// How enumeration went: every combination of degrees, batch split and family considered, and why
// the illegal ones were dropped.
struct EnumerationStats {
  std::size_t considered = 0;            // (tp, pp, dp, ep, micro batch size, family, virtual) tuples
  std::vector<int> tp_degrees;           // the TP degrees tried
  std::vector<std::string> tp_rejected;  // "TP 3: <why>" for each degree left out
  std::vector<int> cp_degrees;           // the CP degrees tried
  std::vector<std::string> cp_rejected;  // "CP 3: <why>" for each degree left out
  std::size_t batch_indivisible = 0;     // global batch not a multiple of dp x micro batch size
  std::size_t family_rejected = 0;       // the schedule family's constraints (e.g. microbatch count)
  std::size_t legal = 0;                 // candidates (with ZeRO levels)
};

// Every legal candidate, in a stable order: tp, pp, then ep, micro batch size, family, regions,
// sequence parallelism, recompute mode, ZeRO, communication SMs.
std::vector<TuneCandidate> enumerate_candidates(const TuneSpec& spec, EnumerationStats* stats = nullptr);

// A lower bound of the simulator's peak memory (bytes, max over devices) for `c`, in closed form from
// the model's layer costs: each device's parameters, gradients and optimizer states (sized by ZeRO
// level, replicas and expert sharding, as lowering sizes them) plus the activations one microbatch
// keeps on that device until its backward pass. Pruning with it never drops a plan that fits.
std::int64_t memory_lower_bound(const TuneSpec& spec, const TuneCandidate& c);

// A lower bound of the simulated step time (seconds) of `c`, in closed form from the model's layer
// costs under c's layout: a device's compute ops run one at a time, each at least max(FLOPs /
// (peak x max efficiency), HBM bytes / bandwidth) plus its element-wise kernels and TP collectives,
// so each pipeline rank needs every microbatch's F and B of the regions it holds, after the first
// microbatch has gone through every region before its earliest one. The fastest GPU and link of the
// cluster are used. 0 with a calibration file (measured times replace the model).
double step_time_lower_bound(const TuneSpec& spec, const TuneCandidate& c);

// Up to three alternatives to c's PP boundaries: regions balanced by the cost model's compute time on
// the cluster's GPU (not FLOPs), minimising the busiest device (which sees every region it holds, as
// in V and mirrored placements), and that balance with the last region's boundary moved one block
// either way (the LM head makes the last region heavy). Alternatives equal to the default are dropped.
std::vector<TuneCandidate> placement_variants(const TuneSpec& spec, const TuneCandidate& c);

// Alternatives to the order of c's pipeline ranks on the device groups, for clusters whose groups
// differ (heterogeneous nodes): the busiest ranks (cost-model time of the regions each holds, both
// copies for mirrored families, both arms of a V) on the fastest groups, and the reversed order. On a
// cluster whose groups all have the same GPUs none is returned: the generator's order keeps every
// pipeline transfer between adjacent groups, and any other order is the same chain relabelled or
// crosses more node boundaries.
std::vector<TuneCandidate> rank_order_variants(const TuneSpec& spec, const TuneCandidate& c);

// Megatron's device order (--device-order tp-cp-dp-pp, pipeline rank outermost) for a candidate with
// pipeline and expert parallelism in the default order, when it puts an expert group on fewer nodes
// (its all-to-all then runs more on NVLink, its pipeline transfers cross nodes); else none.
std::vector<TuneCandidate> device_order_variants(const TuneSpec& spec, const TuneCandidate& c);

// The first block of each PP region that compile_scenario would use for `c` (the default balance
// when c.pp_ranges is empty).
std::vector<int> effective_pp_ranges(const TuneSpec& spec, const TuneCandidate& c);

struct TuneRow {
  TuneCandidate candidate;
  std::string engine;  // "analytic" | "simgrid" | "" (pruned: not simulated)
  std::string status;  // "ok" | "pruned" | "invalid" | "error"
  std::string reason;
  std::int64_t estimated_memory_bytes = 0;
  int devices = 0;
  double step_time_s = 0, tokens_per_s = 0, mfu = 0, bubble_fraction = 0;
  std::int64_t peak_memory_bytes = 0;
  bool oom = false;
  double compile_time_s = 0, simulate_time_s = 0;
  double tp_comm_s = 0;  // TP collectives (inside compute ops) on the critical path
  bool fits(double memory_cap_bytes) const {
    return status == "ok" && !oom && static_cast<double>(peak_memory_bytes) <= memory_cap_bytes;
  }
};

// Compiles and simulates `c` with `engine`; never throws for a bad candidate (status says why).
TuneRow evaluate_candidate(const TuneSpec& spec, const TuneCandidate& c, const std::string& engine,
                           std::int64_t estimated_memory_bytes = 0);

const std::vector<std::string>& tune_csv_columns();
std::string to_csv(const TuneSpec& spec, const TuneRow& row);
// A data row of a tune CSV back into the spec fields it names (model, cluster, devices, global batch,
// seq_len) and the row. Throws TuneError naming `where` and the column on a malformed field.
TuneRow tune_row_from_csv(const std::vector<std::string>& fields, TuneSpec* spec, const std::string& where);
// Reads every data row of a tune results file (for the studio and the CLI's summary; the search
// itself resumes with Repair::CutPartialLine, see read_results).
std::vector<TuneRow> read_tune_results(const std::string& csv_path, TuneSpec* spec = nullptr,
                                       Repair repair = Repair::LeaveFile);

struct TuneProgress {
  std::string phase;                // "estimate" | "analytic" | "placement" | "simgrid"
  std::size_t done = 0, total = 0;  // in this phase (resumed rows included)
  double elapsed_s = 0;             // since run_tune started
};

struct TuneOptions {
  int jobs = 1;         // worker threads for analytic simulations
  double budget_s = 0;  // 0: none; else no new simulation starts after this
  // Called after every row (from a worker thread, one call at a time).
  std::function<void(const TuneProgress&)> on_progress;
};

struct TuneSummary {
  EnumerationStats enumeration;
  std::size_t candidates = 0;  // legal strategies (default placement)
  std::size_t pruned = 0;      // by the memory lower bound
  // Recompute variants deferred to the last wave (a budget cuts them first): the same strategy with
  // less recomputation fits the cap, so they are normally slower (see run_tune).
  std::size_t dominated = 0;
  std::size_t bounded = 0;             // not simulated: step time lower bound above the exact_top-th best
  std::size_t simulated = 0;           // analytic rows (this run and resumed), placement variants included
  std::size_t placement_variants = 0;  // of which placement alternatives
  std::size_t simgrid = 0;             // SimGrid rows
  std::size_t resumed = 0;             // rows read back from the CSV
  std::size_t ran = 0;                 // simulations run by this call
  std::size_t fitting = 0;             // ok rows within the memory cap (analytic)
  double memory_cap_bytes = 0;
  double hbm_bytes = 0;             // the smallest HBM of the devices
  double memory_reserve_bytes = 0;  // HBM left out of the default cap (0 with an explicit cap)
  // Plans left out of `ranked` because another ranked plan is the same: at PP 1 with one region per
  // rank every schedule family orders the same ops, so families that differ only in name give the
  // same step time and memory; the best-named one (first by key) stands for all of them.
  std::size_t coinciding = 0;
  double elapsed_s = 0;
  bool budget_exhausted = false;
  std::string stopped;  // where the budget stopped the search ("" when it did not)
  // Best first: candidates re-simulated on SimGrid by their SimGrid step time, then the others by
  // their analytic step time; only rows that fit the cap. `ranked[i].engine` says which engine.
  std::vector<TuneRow> ranked;
};

// Runs (or resumes) the search, appending every row to `csv_path`. Throws TuneError on a bad spec or
// a results file of another search.
TuneSummary run_tune(const TuneSpec& spec, const std::string& csv_path, const TuneOptions& options = {});

// The rows no other row beats on both throughput (higher) and peak memory (lower), by increasing
// peak memory. Rows that are not "ok" are ignored.
std::vector<TuneRow> pareto_front(std::vector<TuneRow> rows);

// The directive program of `c` as compiled (generated placement + schedule; regions without experts
// drop their shard directives). Region boundaries are not part of a directive program: compile it
// with the model and --pp-ranges effective_pp_ranges(spec, c).
nlohmann::json tune_directives(const TuneSpec& spec, const TuneCandidate& c);

}  // namespace piper::search
