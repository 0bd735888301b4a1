// Scenarios: model + strategy (flags or a directive program) -> the directive program -> a Program.
#include "piper/core/scenario.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <map>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <stdexcept>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/suggest.hpp"

namespace piper::core {

using nlohmann::json;

namespace {

// Runs `fn`, attributing input errors to `source` (a file or a flag) unless they already name it.
template <class F>
auto from(const std::string& source, F&& fn) -> decltype(fn()) {
  auto named = [&](const std::string& m) { return source.empty() || m.find(source) != std::string::npos; };
  try {
    return fn();
  } catch (const DirectiveError& e) {
    if (named(e.what())) throw;
    throw e.in_file(source);
  } catch (const ModelError& e) {
    if (named(e.what())) throw;
    throw ModelError(source + ": " + e.what());
  } catch (const Error& e) {
    if (named(e.what())) throw;
    throw Error(source + ": " + e.what());
  } catch (const std::invalid_argument& e) {
    throw Error(named(e.what()) ? e.what() : source + ": " + e.what());
  } catch (const json::exception& e) {
    throw Error(named(e.what()) ? e.what() : source + ": " + e.what());
  }
}

std::string model_file_of(const std::string& model) {
  std::error_code ec;
  return std::filesystem::exists(model, ec) ? model : std::string();
}

// Expert parallelism needs experts to shard: reject --ep (and --etp, which splits the experts) on a
// dense model before generating anything; the generated program would silently leave them out.
void check_ep(const ModelConfig& cfg, int ep, int etp) {
  if (etp > 1 && cfg.experts <= 0)
    throw Error(fmt::format("--etp {}: model '{}' has no MoE experts to split (use --etp 1; --tp splits dense layers)",
                            etp, cfg.name));
  if (ep <= 1) return;
  if (cfg.experts <= 0) throw Error(fmt::format("--ep {}: model '{}' has no MoE experts (use --ep 1)", ep, cfg.name));
  if (cfg.experts % ep != 0)
    throw Error(fmt::format("--ep {}: does not divide the {} experts of model '{}'", ep, cfg.experts, cfg.name));
}

// The ends a program's place directives put in regions of their own ("holds").
PipelineEnds ends_in_program(const DirectiveProgram& program) {
  PipelineEnds ends;
  for (const auto& d : program.directives)
    if (const auto* place = std::get_if<PlaceDirective>(&d)) {
      ends.embedding |= place->holds == "embedding";
      ends.head |= place->holds == "head";
    }
  return ends;
}

// Per pipeline rank, the F + B FLOPs of the regions placed on it (the balancer's measure).
std::vector<double> rank_loads(const Model& model, const std::vector<int>& rank_of_region, int ranks) {
  std::vector<double> load(static_cast<std::size_t>(ranks), 0.0);
  for (std::size_t l = 0; l < model.layers().size(); ++l) {
    const auto it = model.layers()[l].tags.find("PP");
    if (it == model.layers()[l].tags.end() || it->second >= static_cast<int>(rank_of_region.size())) continue;
    const Costs c = model.layer_cost(l);
    load[static_cast<std::size_t>(rank_of_region[static_cast<std::size_t>(it->second)])] +=
        c.forward_flops + c.backward_flops();
  }
  return load;
}

// `cfg`'s model split into the regions of the V that `o` asks for, balanced as compile_scenario does
// (the ends in regions of their own where asked), with each region's rank.
struct BalancedV {
  Model model;
  int regions = 0;
  std::vector<int> rank_of_region;
};
BalancedV balanced_v(const StrategyOptions& o, const ModelConfig& cfg) {
  const ScheduleFamily& family = schedule_family(o.schedule);
  BalancedV v{build_model(cfg), family.regions(o), {}};
  v.rank_of_region = family.placement(o, v.regions);
  const PipelineEnds ends{!o.v_embedding.empty(), !o.v_head.empty()};
  balance_pipeline(v.model, v.regions, ends);
  std::vector<std::vector<int>> devices(v.rank_of_region.size());
  for (std::size_t r = 0; r < v.rank_of_region.size(); ++r) devices[r] = {v.rank_of_region[r]};
  rebalance_for_devices(v.model, devices, ends);
  return v;
}

}  // namespace

std::vector<double> v_rank_loads(const StrategyOptions& o, const ModelConfig& cfg) {
  const BalancedV v = balanced_v(o, cfg);
  return rank_loads(v.model, v.rank_of_region, o.pp);
}

// The step time of the V that `o` gives `cfg`'s model, estimated as the cost-weighted replay of its
// schedule table: each region's F, I and W take their layers' roofline work (FLOPs, or HBM bytes at
// 300 FLOP/byte, as lowering's estimate), communication free.
double v_step_estimate(const StrategyOptions& o, const ModelConfig& cfg) {
  const BalancedV v = balanced_v(o, cfg);
  const Model& model = v.model;
  const int regions = v.regions;
  constexpr double kFlopsPerByte = 300;
  std::vector<std::array<double, 3>> cost(static_cast<std::size_t>(regions), {0, 0, 0});
  for (std::size_t l = 0; l < model.layers().size(); ++l) {
    const auto it = model.layers()[l].tags.find("PP");
    if (it == model.layers()[l].tags.end() || it->second >= regions) continue;
    const Costs c = model.layer_cost(l);
    auto& k = cost[static_cast<std::size_t>(it->second)];
    k[0] += std::max(c.forward_flops, kFlopsPerByte * static_cast<double>(c.forward_memory_bytes));
    const double b = std::max(c.backward_flops(), kFlopsPerByte * static_cast<double>(c.backward_memory_bytes));
    const double input_share = c.backward_flops() > 0 ? c.backward_input_flops / c.backward_flops() : 0.5;
    k[1] += b * input_share;
    k[2] += b * (1 - input_share);
  }
  return schedule_makespan(schedule_table(o), cost);
}

std::vector<StrategyOptions> v_end_choices(const StrategyOptions& o) {
  if (o.v_head != "auto" && o.v_embedding != "auto") return {o};
  const ScheduleFamily& family = schedule_family(o.schedule);
  if (!family.own_ends)
    throw Error(std::string(o.v_head == "auto" ? "--v-head" : "--v-embedding") +
                " applies only to V placements (zb-v, dualpipev), not --schedule " + family.name);
  std::vector<std::string> choices{""};
  for (int r = 0; r < o.pp; ++r) choices.push_back(std::to_string(r));
  std::vector<std::string> head_choices = choices;
  if (o.pp >= 2) head_choices.push_back("alone");
  const std::vector<std::string> heads = o.v_head == "auto" ? head_choices : std::vector<std::string>{o.v_head};
  const std::vector<std::string> embeddings =
      o.v_embedding == "auto" ? choices : std::vector<std::string>{o.v_embedding};
  std::vector<StrategyOptions> out;
  for (const auto& h : heads)
    for (const auto& e : embeddings) {
      StrategyOptions trial = o;
      trial.v_head = h;
      trial.v_embedding = e;
      out.push_back(trial);
    }
  return out;
}

StrategyOptions resolve_v_ends(StrategyOptions o, const ModelConfig& cfg) {
  if (o.v_head != "auto" && o.v_embedding != "auto") return o;
  // The choice with the shortest estimated step (ties within a part in a million: the earlier
  // choice, in the V first).
  StrategyOptions best = o;
  double best_step = -1;
  std::string family_refused;  // the first refusal by the family's own limits, if any
  for (const auto& trial : v_end_choices(o)) {
    double step = 0;
    try {
      step = v_step_estimate(trial, cfg);
    } catch (const ModelError&) {
      continue;  // too few blocks for this many regions
    } catch (const std::invalid_argument& e) {
      if (family_refused.empty()) family_refused = e.what();
      continue;  // the family's own limits (e.g. DualPipeV's microbatches) refuse this shape
    }
    if (best_step < 0 || step < best_step * (1 - 1e-6)) best = trial, best_step = step;
  }
  // A shape the family refuses whatever the ends (DualPipeV with fewer than 2 x PP microbatches) is
  // that refusal, not "too few blocks" (qwen3-9m's 4 blocks fit a V over PP 2).
  if (best_step < 0 && !family_refused.empty())
    throw std::invalid_argument(fmt::format("--v-head/--v-embedding auto: no placement fits: {}", family_refused));
  if (best_step < 0)
    throw Error(fmt::format("--v-head/--v-embedding auto: no placement of model '{}' fits --pp {} (too few blocks)",
                            cfg.name, o.pp));
  return best;
}

namespace {

ModelConfig load_config(const Scenario& s) {
  ModelConfig cfg = from(model_file_of(s.model), [&] {
    try {
      return load_model_config(s.model);
    } catch (const ModelError& e) {
      // A scenario file's model that names nothing is the file's field, not the loader's bare
      // "nosuch: neither a zoo model ..." (": neither ..." for an empty one). Python's dicts ("scenario")
      // keep the loader's words, which the bindings name as their own keyword.
      const std::string what = e.what(), lead = s.model + ": neither a zoo model";
      if (s.source.empty() || s.source == "scenario" || what.rfind(lead, 0) != 0) throw;
      if (s.model.empty()) throw ModelError(s.source + ": field 'model': required: a zoo name or a model file");
      throw ModelError(fmt::format("{}: field 'model': '{}'{}", s.source, s.model, what.substr(s.model.size())));
    }
  });
  if (s.seq_len > 0) cfg.training.seq_len = s.seq_len;
  if (s.micro_batch_size > 0) cfg.training.micro_batch_size = s.micro_batch_size;
  return cfg;
}

DirectiveProgram program_for(const Scenario& s, const ModelConfig& cfg, int* regions_out) {
  StrategyOptions opts = s.strategy;
  from("", [&] { return resolve_global_batch(opts, cfg.training.micro_batch_size), 0; });
  if (!s.directives) opts = from("", [&] { return resolve_v_ends(opts, cfg); });
  if (!s.stage_starts.empty() && s.stages > 0 && s.stages != static_cast<int>(s.stage_starts.size()))
    throw Error(
        fmt::format("--stages {} disagrees with the {} regions of --pp-ranges", s.stages, s.stage_starts.size()));
  int regions = s.stage_starts.empty() ? s.stages : static_cast<int>(s.stage_starts.size());
  // A scenario's own program is read here, once: the steps below see only typed directives.
  DirectiveProgram program;
  if (s.directives) {
    program = from(s.directives_source, [&] { return parse_directives(*s.directives); });
    if (regions == 0) regions = pp_regions_in_program(program);
  } else {
    check_ep(cfg, opts.ep, opts.etp);
    if (regions == 0) regions = from("--schedule", [&] { return schedule_family(opts.schedule).regions(opts); });
  }
  // Regions size per-region tables (balancing, placement): a "PP": 2000000000 filter must not allocate.
  check_limit(Limit::Layers, regions, s.directives ? s.directives_source : std::string("--stages"), "PP regions");
  if (regions_out) *regions_out = regions;
  if (s.directives) {
    if (s.append_schedule) {
      // As in Piper's harness: a placement-only program plus the schedule's split/order.
      from(s.directives_source, [&] {
        int pipeline_ranks = 0;
        bool own_embedding = false, own_head = false;
        std::vector<int> rank_of_region =
            rank_of_region_from_program(program, &pipeline_ranks, &own_embedding, &own_head);
        StrategyOptions o = opts;
        o.pp = pipeline_ranks;
        program.append(schedule_directives(o, rank_of_region, own_embedding, own_head));
        return 0;
      });
    }
    return program;
  }
  if (regions > 0 && (s.stages > 0 || !s.stage_starts.empty())) {
    // Explicit region count: place it with the family's own placement, then its schedule. More
    // regions than pipeline ranks is a strategy of its own (uneven interleaving, V chunks per rank,
    // as --virtual); fewer leaves a rank without one, which failed as "1f1b: pipeline rank 1 holds
    // no PP region", naming neither flag.
    std::string given;
    for (int start : s.stage_starts) given += (given.empty() ? "" : ",") + std::to_string(start);
    given = s.stage_starts.empty() ? fmt::format("--stages {}", s.stages) : "--pp-ranges " + given;
    if (regions < opts.pp)
      throw Error(
          fmt::format("{}: {} PP regions for the {} pipeline ranks of --pp {}: every rank needs at least one "
                      "(give {} or more, or a smaller --pp)",
                      given, regions, opts.pp, opts.pp, opts.pp));
    // A --virtual given beside the regions must agree with them: they would set the shape and the
    // flag would be dropped (2 ranges under --pp 2 --virtual 2 ran plain 1F1B).
    if (opts.virtual_stages > 1) {
      const int asked = from("--schedule", [&] { return schedule_family(opts.schedule).regions(opts); });
      if (asked != regions)
        throw Error(
            fmt::format("{}: {} PP regions, but --pp {} --virtual {} asks for {}: give {} (or leave "
                        "--virtual out: the regions then set the chunks per rank)",
                        given, regions, opts.pp, opts.virtual_stages, asked, asked));
    }
    return from("", [&] {
      const ScheduleFamily& family = schedule_family(opts.schedule);
      std::vector<int> rank_of_region = family.placement(opts, regions);
      DirectiveProgram p = placement_directives(opts, rank_of_region, family.mirrored);
      return p.append(schedule_directives(opts, rank_of_region));
    });
  }
  return from("", [&] { return generate_program(opts); });
}

// An error in a program generated from strategy flags names the flag the user wrote, not the
// directive and field of a program they never saw ("--tp 6: 6 does not divide the 16 heads ..."
// rather than "directive 1 field 'degree': ...").
std::string strategy_flag_error(const DirectiveProgram& program, const StrategyOptions& o, const DirectiveError& e) {
  std::string message = e.what();
  const std::string prefix =
      "directive " + std::to_string(e.index()) + (e.field().empty() ? "" : " field '" + e.field() + "'") + ": ";
  if (message.rfind(prefix, 0) == 0) message = message.substr(prefix.size());
  std::string op;
  if (e.index() >= 0 && static_cast<std::size_t>(e.index()) < program.size())
    op = op_name(program.directives[static_cast<std::size_t>(e.index())]);
  const std::string& field = e.field();
  std::string flag;
  if (op == "tensor_parallel")
    flag = field == "sequence_parallel" ? fmt::format("--tp {} --sequence-parallel", o.tp)
           : field == "comm_overlap"    ? fmt::format("--tp {} --tp-comm-overlap", o.tp)
           : field == "expert_degree"   ? fmt::format("--etp {}", o.etp)
                                        : fmt::format("--tp {}", o.tp);
  else if (op == "shard")
    flag = field == "chunks"           ? fmt::format("--a2a-chunks {}", o.a2a_chunks)
           : field == "dispatch_dtype" ? std::string("--fp8-dispatch")
                                       : fmt::format("--ep {}", o.ep);
  else if (op == "replicate")
    flag = field == "shard_group"    ? (o.cp > 1 ? fmt::format("--dp-shard {} x --cp {}", o.dp_shard, o.cp)
                                                 : fmt::format("--dp-shard {}", o.dp_shard))
           : field == "reduce_every" ? "--reduce-every " + o.reduce_every
           : field == "gather_dtype" ? std::string("--fp8-all-gather")
           : field.rfind("shard_", 0) == 0 || field == "prefetch" ? fmt::format("--zero {}", o.zero)
                                                                  : fmt::format("--dp {}", o.dp);
  else if (op == "recompute")
    flag = field == "every"   ? fmt::format("--recompute {} --recompute-every {}", o.recompute, o.recompute_every)
           : field == "first" ? fmt::format("--recompute {} --recompute-first {}", o.recompute, o.recompute_first)
                              : "--recompute " + o.recompute;
  else if (op == "context_parallel")
    flag = o.cp_all_gather ? fmt::format("--cp {} --cp-all-gather", o.cp) : fmt::format("--cp {}", o.cp);
  else if (op == "sm_partition")
    flag = fmt::format("--comm-sms {}", o.comm_sms);
  else if (op == "clip_grad")
    flag = fmt::format("--clip-grad {}", o.clip_grad);
  else if (op == "place")
    flag = fmt::format("--pp {}", o.pp);
  else
    flag = fmt::format("--schedule {} --microbatches {}", o.schedule, o.microbatches);
  return flag + ": " + message;
}

// A scenario file's strategy named as its fields. Errors from the strategy name the flags that set
// it ("--tp 3: 3 does not divide the 8 heads ..."), and a scenario file (`--scenario s.json`, the
// Python functions' dicts) sets them through its fields: the message then names the file and its
// field instead ("s.json: field 'strategy.tp': 3 does not divide ..."), each flag of the strategy or
// of the scenario's own keys (`--pp-ranges`: 'pp_ranges') as the field holding it.
struct FlagField {
  std::string field;  // "strategy.tp", "pp_ranges"
  std::string value;  // as the flag would be written ("3"; empty for a switch)
};

std::map<std::string, FlagField> scenario_flag_fields(const Scenario& s) {
  std::map<std::string, FlagField> out;
  for (const Setting& setting : strategy_settings())
    out[setting_flag(setting)] = {"strategy." + setting.name, setting.type == SettingType::Bool
                                                                  ? std::string()
                                                                  : setting_text(setting, s.strategy)};
  std::string ranges;
  for (int start : s.stage_starts) ranges += (ranges.empty() ? "" : ",") + std::to_string(start);
  out["--pp-ranges"] = {"pp_ranges", ranges};
  out["--stages"] = {"stages", std::to_string(s.stages)};
  out["--first-stage-layers"] = {"first_stage_layers", std::to_string(s.first_stage_layers)};
  out["--last-stage-layers"] = {"last_stage_layers", std::to_string(s.last_stage_layers)};
  out["--seq-len"] = {"seq_len", std::to_string(s.seq_len)};
  out["--micro-batch-size"] = {"micro_batch_size", std::to_string(s.micro_batch_size)};
  return out;
}

std::string in_scenario_terms(const Scenario& s, const std::string& message) {
  const std::string source = s.source.empty() ? std::string("scenario") : s.source;
  if (message.rfind(source + ": ", 0) == 0) return message;  // already the file's (its fields, its program)
  const std::map<std::string, FlagField> fields = scenario_flag_fields(s);
  // The flag at `pos` ("--tp" in "--tp 3: ..."), or none.
  auto flag_at = [&](std::size_t pos) -> const std::pair<const std::string, FlagField>* {
    if (message.compare(pos, 2, "--") != 0 ||
        (pos > 0 && (std::isalnum(static_cast<unsigned char>(message[pos - 1])) || message[pos - 1] == '-')))
      return nullptr;
    std::size_t end = pos + 2;
    while (end < message.size() && (std::islower(static_cast<unsigned char>(message[end])) ||
                                    std::isdigit(static_cast<unsigned char>(message[end])) || message[end] == '-'))
      ++end;
    const auto it = fields.find(message.substr(pos, end - pos));
    return it == fields.end() ? nullptr : &*it;
  };
  // The flags the message starts with ("--tp 2 --sequence-parallel: ", "--v-head/--v-embedding auto: "),
  // their values dropped where they are the file's: the prefix names the fields.
  std::vector<std::string> lead;
  std::size_t pos = 0;
  // The next flag of the group at `at` ("/--v-embedding", " --sequence-parallel", " x --dp"): its
  // position, or 0.
  auto joined = [&](std::size_t at) -> std::size_t {
    for (const char* sep : {"/", " ", " x "})
      if (message.compare(at, std::string(sep).size(), sep) == 0 && flag_at(at + std::string(sep).size()))
        return at + std::string(sep).size();
    return 0;
  };
  while (const auto* f = flag_at(pos)) {
    lead.push_back(f->second.field);
    pos += f->first.size();
    // Its value, where the field names it: before the colon or the group's next flag ("--tp 3: ...",
    // "--recompute full --recompute-first 3: ..."); in a sentence ("--dp-shard 3 must be ...") it stays.
    const std::string value = " " + f->second.value;
    if (const std::size_t after = pos + value.size();
        !f->second.value.empty() && message.compare(pos, value.size(), value) == 0 &&
        (after == message.size() || message[after] == ':' || joined(after)))
      pos = after;
    if (const std::size_t next = joined(pos)) {
      pos = next;
      continue;
    }
    break;
  }
  if (!lead.empty() && message.compare(pos, 2, ": ") == 0) pos += 2;
  if (!lead.empty() && message.compare(pos, 1, " ") == 0) pos += 1;
  // The flags further on, each as its field ("needs 'strategy.tp' >= 2").
  std::string body;
  for (std::size_t i = pos; i < message.size();) {
    if (const auto* f = flag_at(i)) {
      if (lead.empty()) lead.push_back(f->second.field);
      body += "'" + f->second.field + "'";
      i += f->first.size();
    } else {
      body += message[i++];
    }
  }
  if (lead.empty()) return message;  // no flag of the scenario's in it
  std::string names;
  for (std::size_t i = 0; i < lead.size(); ++i) names += (i == 0 ? "'" : ", '") + lead[i] + "'";
  return fmt::format("{}: field{} {}: {}", source, lead.size() > 1 ? "s" : "", names, body);
}

// Runs `fn`; where the scenario came from a file (or a dict), its errors name the file's fields.
template <class F>
auto in_scenario_terms(const Scenario& s, F&& fn) -> decltype(fn()) {
  if (s.source.empty()) return fn();
  try {
    return fn();
  } catch (const InternalError&) {
    throw;
  } catch (const DirectiveError&) {
    throw;  // its program's directive and field (a file's, or its own "directives")
  } catch (const ModelError& e) {
    throw ModelError(in_scenario_terms(s, e.what()));
  } catch (const LimitError& e) {
    throw LimitError(in_scenario_terms(s, e.what()));
  } catch (const Error& e) {
    throw Error(in_scenario_terms(s, e.what()));
  }
}

}  // namespace

int pp_regions_in_program(const DirectiveProgram& program) {
  int max_index = -1;
  auto see = [&](const Filter& f) {
    if (const auto it = f.exact.find("PP"); it != f.exact.end()) max_index = std::max(max_index, it->second);
  };
  for (const auto& d : program.directives)
    std::visit(
        [&](const auto& x) {
          if constexpr (requires { x.filter; }) see(x.filter);
          if constexpr (requires { x.groups; })
            for (const auto& group : x.groups)
              for (const auto& f : group) see(f);
        },
        d);
  return std::max(1, max_index + 1);
}

DirectiveProgram strategy_directives(const StrategyOptions& o, const std::string& model) {
  if (!model.empty()) {
    Scenario s;
    s.model = model;
    s.strategy = o;
    scenario_program(s);  // loads the model and checks --ep against its experts
    const ModelConfig cfg = load_config(s);
    // --global-batch sets the microbatches, as a compile does (the program said 1 microbatch: the
    // flag was ignored, exit 0).
    StrategyOptions resolved = o;
    resolve_global_batch(resolved, cfg.training.micro_batch_size);
    return generate_program(resolve_v_ends(resolved, cfg));
  }
  if (o.global_batch > 0)
    throw Error(
        fmt::format("--global-batch {}: needs --model, whose micro-batch size turns sequences into "
                    "microbatches (or give --microbatches)",
                    o.global_batch));
  return generate_program(o);
}

std::vector<int> first_last_stage_starts(int blocks, int regions, int first, int last) {
  std::string flags;
  if (first > 0) flags += fmt::format("--first-stage-layers {}", first);
  if (last > 0) flags += fmt::format("{}--last-stage-layers {}", flags.empty() ? "" : " ", last);
  const int fixed = (first > 0) + (last > 0);
  if (regions < fixed + 1)
    throw Error(fmt::format("{}: needs at least {} PP regions (there are {})", flags, fixed + 1, regions));
  const int middle = regions - fixed, rest = blocks - first - last;
  if (rest < middle)
    throw Error(fmt::format("{}: leaves {} blocks of {} for the other {} PP regions (at least one each)", flags, rest,
                            blocks, middle));
  if (rest % middle != 0)
    throw Error(
        fmt::format("{}: the other {} blocks do not divide evenly over the other {} PP regions", flags, rest, middle));
  std::vector<int> starts;
  int at = 0;
  for (int r = 0; r < regions; ++r) {
    starts.push_back(at);
    at += r == 0 && first > 0 ? first : r == regions - 1 && last > 0 ? last : rest / middle;
  }
  return starts;
}

void annotate_regions(const Scenario& s, Model& model, const DirectiveProgram& program, int regions) {
  const PipelineEnds ends = ends_in_program(program);
  if ((ends.embedding || ends.head) && (s.first_stage_layers > 0 || s.last_stage_layers > 0 || !s.stage_starts.empty()))
    throw Error(std::string("a place directive's \"holds\" (the ") + (ends.head ? "head" : "embedding") +
                " as a region of its own) cannot be combined with --pp-ranges or --first/last-stage-layers");
  if ((s.first_stage_layers > 0 || s.last_stage_layers > 0) && !s.stage_starts.empty())
    throw Error(
        "--first-stage-layers/--last-stage-layers cannot be combined with --pp-ranges (which fixes every region)");
  if (s.first_stage_layers > 0 || s.last_stage_layers > 0) {
    int blocks = 0;
    for (const auto& l : model.layers()) blocks = std::max(blocks, l.block + 1);
    annotate_pipeline_ranges(model,
                             first_last_stage_starts(blocks, regions, s.first_stage_layers, s.last_stage_layers));
    return;
  }
  try {
    if (s.stage_starts.empty()) {
      balance_pipeline(model, regions, ends);
      // Regions sharing a device (V placements, mirrored pairs) are balanced per device as well.
      std::vector<std::vector<int>> devices_of_region(static_cast<std::size_t>(regions));
      for (const auto& d : program.directives)
        if (const auto* place = std::get_if<PlaceDirective>(&d); place && place->filter.exact.size() == 1 &&
                                                                 place->filter.exact.contains("PP") &&
                                                                 place->filter.any.empty()) {
          const int r = place->filter.exact.at("PP");
          if (r < regions) devices_of_region[static_cast<std::size_t>(r)] = place->devices;
        }
      std::map<int, int> regions_of_device;
      bool complete = true;
      for (const auto& ds : devices_of_region) {
        complete &= !ds.empty();
        for (int dev : ds) ++regions_of_device[dev];
      }
      const bool shared =
          std::any_of(regions_of_device.begin(), regions_of_device.end(), [](const auto& kv) { return kv.second > 1; });
      if (complete && shared) rebalance_for_devices(model, devices_of_region, ends);
    } else {
      annotate_pipeline_ranges(model, s.stage_starts);
    }
  } catch (const Error& e) {
    // The balancer's own name means nothing to a user; say what was asked, and by which flag.
    std::string why = e.what();
    const std::string internal = "balance_pipeline: stages must be";
    if (const auto at = why.find(internal); at != std::string::npos)
      why.replace(at, internal.size(), "PP regions must be");
    std::string origin;
    if (!s.stage_starts.empty()) {  // the regions the user gave; they named --pp N (not given)
      std::string given;
      for (int start : s.stage_starts) given += (given.empty() ? "" : ",") + std::to_string(start);
      origin = "--pp-ranges " + given + ": ";
    } else if (s.stages > 0)
      origin = fmt::format("--stages {}: ", s.stages);
    else if (s.directives && s.stage_starts.empty())  // the regions its "PP" filters name
      origin = fmt::format("{}: \"PP\" filters up to {}: ", s.directives_source, regions - 1);
    else if (!s.directives)
      origin = s.strategy.virtual_stages > 1
                   ? fmt::format("--pp {} --virtual {}: ", s.strategy.pp, s.strategy.virtual_stages)
                   : fmt::format("--pp {}: ", s.strategy.pp);
    throw ModelError((model_file_of(s.model).empty() ? "" : model_file_of(s.model) + ": ") + origin +
                     fmt::format("cannot annotate {} PP regions: {}", regions, why));
  }
}

ModelConfig scenario_model_config(const Scenario& s) { return load_config(s); }

namespace {

// compile_scenario, its errors naming the flags of the strategy.
CompiledScenario compile_scenario_named_by_flags(const Scenario& s, const AfterPassHook& hook) {
  CompiledScenario out;
  out.config = load_config(s);
  out.model = from(model_file_of(s.model), [&] { return build_model(out.config); });
  int regions = 0;
  out.program = program_for(s, out.config, &regions);
  annotate_regions(s, out.model, out.program, regions);
  if (!s.directives) {
    // A generated program shards every region's experts; regions without experts (dense first blocks,
    // as in DeepSeek-V3) have nothing to shard, so their shard directive is dropped rather than
    // rejected. A hand-written program keeps the strict "filter matches nothing" error.
    out.program.remove_if([&](const Directive& d) {
      const auto* shard = std::get_if<ShardDirective>(&d);
      if (shard == nullptr || !shard->filter.exact.contains("PP")) return false;
      const int region = shard->filter.exact.at("PP");
      for (const auto& layer : out.model.layers())
        if (layer.tags.contains("EP") && layer.tags.contains("PP") && layer.tags.at("PP") == region) return false;
      return true;
    });
  }
  const std::string source = s.directives ? s.directives_source : std::string();
  try {
    // The program as the passes see it: its JSON form parsed, so that a generated program gets the
    // checks and errors a file's does (a scenario's own program was read from that form).
    DirectiveProgram program = from(source, [&] { return validated(out.program); });
    from(source, [&] { return compile(out.model, program, out.result, hook); });  // in place: see compiler.hpp
  } catch (const DirectiveError& e) {
    if (s.directives) throw;
    throw Error(strategy_flag_error(out.program, s.strategy, e));
  }
  return out;
}

}  // namespace

DirectiveProgram scenario_program(const Scenario& s, int* regions) {
  return in_scenario_terms(s, [&] { return program_for(s, load_config(s), regions); });
}

CompiledScenario compile_scenario(const Scenario& s, const AfterPassHook& hook) {
  return in_scenario_terms(s, [&] { return compile_scenario_named_by_flags(s, hook); });
}

namespace {

// Whether a number is above the largest T (2^70 reads as a float): its message says the upper bound,
// not "must be >= 1".
template <class T>
bool above_type(const json& v) {
  if (v.is_number_float()) return v.get<double>() > static_cast<double>(std::numeric_limits<T>::max());
  return v.is_number() && ((v.is_number_unsigned() && v.get<unsigned long long>() > INT64_MAX) ||
                           v.get<long long>() > static_cast<long long>(std::numeric_limits<T>::max()));
}

// "must be an integer in MIN..MAX" for a field held in a T: a value above it is told both bounds.
template <class T>
std::string integer_range(long long min) {
  return fmt::format("must be an integer in {}..{}", min, std::numeric_limits<T>::max());
}

// A scenario's "train" section, every key and value checked (the values' meaning is piper run's).
json checked_train(const json& t, const std::string& where) {
  auto fail = [&](const std::string& field, const std::string& msg) {
    return Error(where + ": field 'train." + field + "': " + msg);
  };
  if (!t.is_object())
    throw Error(where + ": field 'train': must be an object of training settings (piper run's flags)");
  const std::vector<std::string>& known = scenario_train_keys();
  for (auto it = t.begin(); it != t.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (std::find(known.begin(), known.end(), k) == known.end()) {
      std::string hint = did_you_mean(k, known);
      if (hint.empty()) hint = fmt::format(" (expected one of: {})", fmt::join(known, ", "));
      throw fail(k, "unknown field" + hint);
    }
    if (k == "data" || k == "resume") {  // a file: of text, as --data takes; a checkpoint, as --resume takes
      if (!v.is_string() || v.get<std::string>().empty()) throw fail(k, "must be a file name (a non-empty string)");
    } else if (k == "precision") {
      if (!v.is_string() || (v != "fp32" && v != "bf16" && v != "fp16"))
        throw fail(k, "must be \"fp32\", \"bf16\" or \"fp16\"");
    } else if (k == "on_nonfinite") {
      if (!v.is_string() || (v != "stop" && v != "skip")) throw fail(k, "must be \"stop\" or \"skip\"");
    } else if (k == "lr_decay") {
      if (!v.is_string() || (v != "constant" && v != "cosine" && v != "linear"))
        throw fail(k, "must be \"constant\", \"cosine\" or \"linear\"");
    } else if (k == "loss_scale") {
      if (!(v == "dynamic" || (v.is_number() && v.get<double>() >= 1 && std::isfinite(v.get<double>()))))
        throw fail(k, "must be \"dynamic\" or a static scale >= 1 (a power of two)");
    } else if (k == "steps" || k == "lr_decay_steps" || k == "loss_scale_window") {
      if (!v.is_number_integer() || v.get<long long>() < 1 || v.get<long long>() > 1'000'000'000)
        throw fail(k, "must be an integer in [1, 1e9]");
    } else if (k == "warmup_steps") {  // an int of piper run's (4294967297 must not wrap to 1)
      if (!v.is_number_integer() || v.get<long long>() < 0 || v.get<long long>() > 1'000'000'000)
        throw fail(k, "must be an integer in [0, 1e9]");
    } else if (k == "seed") {  // a uint64, as --seed takes
      if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<long long>() >= 0))
        throw fail(k, "must be an integer >= 0");
    } else if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>())) {
      throw fail(k, "must be a number >= 0");
    }
  }
  return t;
}

}  // namespace

Scenario Scenario::from_json(const json& j, const std::string& where, const std::string& base_dir) {
  auto fail = [&](const std::string& field, const std::string& msg) -> Error {
    return Error(where + ": field '" + field + "': " + msg);
  };
  if (!j.is_object()) throw Error(where + ": a scenario must be a JSON object");
  if (const std::string other = wrong_input_kind(j, "a scenario"); !other.empty()) throw Error(where + ": " + other);
  // Every key of every section is checked: a misspelt one ("microbatchs") would otherwise be ignored.
  if (auto u = unknown_field(
          j, {"model", "seq_len", "micro_batch_size", "stages", "pp_ranges", "first_stage_layers", "last_stage_layers",
              "directives", "append_schedule", "strategy", "cluster", "engine", "train"}))
    throw fail(u->key, u->message);
  auto resolve = [&](const std::string& p) {
    if (p.empty() || base_dir.empty() || std::filesystem::path(p).is_absolute()) return p;
    std::error_code ec;
    auto candidate = std::filesystem::path(base_dir) / p;
    return std::filesystem::exists(candidate, ec) ? candidate.string() : p;
  };
  Scenario s;
  s.source = where;
  // Within the field's type: 4294967298 stages must not wrap to 2.
  auto int_field = [&](const json& obj, const char* key, const std::string& path, auto& out, long long min) {
    using T = std::remove_reference_t<decltype(out)>;
    if (!obj.contains(key)) return;
    const json& v = obj[key];
    const bool above = above_type<T>(v);
    if (!above && (!v.is_number_integer() || v.get<long long>() < min))
      throw fail(path, fmt::format("must be an integer >= {}", min));
    if (above) throw fail(path, fmt::format("{} (got {})", integer_range<T>(min), v.dump()));
    out = static_cast<T>(v.get<long long>());
  };
  if (!j.contains("model") || !j["model"].is_string()) throw fail("model", "required: a zoo name or a model file");
  s.model = resolve(j["model"].get<std::string>());
  int_field(j, "seq_len", "seq_len", s.seq_len, 1);
  int_field(j, "micro_batch_size", "micro_batch_size", s.micro_batch_size, 1);
  int_field(j, "stages", "stages", s.stages, 1);
  int_field(j, "first_stage_layers", "first_stage_layers", s.first_stage_layers, 1);
  int_field(j, "last_stage_layers", "last_stage_layers", s.last_stage_layers, 1);
  if (j.contains("pp_ranges")) {
    if (!j["pp_ranges"].is_array()) throw fail("pp_ranges", "must be an array of first blocks, e.g. [0, 8, 16]");
    for (const auto& v : j["pp_ranges"]) {
      if (!v.is_number_integer() || v.get<long long>() < 0 || v.get<long long>() > std::numeric_limits<int>::max())
        throw fail("pp_ranges", fmt::format("entries must be integers in 0..{}", std::numeric_limits<int>::max()));
      s.stage_starts.push_back(v.get<int>());
    }
  }
  if (j.contains("directives")) {
    const json& d = j["directives"];
    if (d.is_string()) {
      s.directives_source = resolve(d.get<std::string>());
      std::string text;
      try {
        text = read_input_file(s.directives_source);
        // parse_json: the depth limit, and a key given twice refused as in every other input
        s.directives = parse_json(text, s.directives_source);
      } catch (const json::exception& e) {  // also number overflow (out_of_range.406)
        throw Error(s.directives_source + ": not JSON: " + e.what());
      } catch (const Error& e) {
        throw fail("directives", e.what());
      }
    } else if (d.is_array()) {
      s.directives = d;
      s.directives_source = where;
    } else {
      throw fail("directives", "must be a directive program (array) or a file name");
    }
  }
  if (j.contains("append_schedule")) {
    if (!j["append_schedule"].is_boolean()) throw fail("append_schedule", "must be true or false");
    s.append_schedule = j["append_schedule"].get<bool>();
  }
  if (j.contains("strategy")) read_strategy_json(j["strategy"], s.strategy, where);
  // A directive program fixes the placement, parallelism and sharding (the CLI's generator flags exclude
  // --directives), and its own split/order the schedule unless append_schedule: a setting it would
  // ignore is an error, not a silently different strategy.
  if (s.append_schedule && !s.directives)
    throw fail("append_schedule", "applies only with \"directives\" (the program the schedule is appended to)");
  if (s.directives)
    for (const Setting& setting : strategy_settings()) {
      if (at_default(setting, s.strategy)) continue;
      if (setting.generator_only)
        throw fail("strategy." + setting.name,
                   "the directive program fixes the placement, parallelism and sharding: this setting would be "
                   "ignored (drop it, or drop \"directives\")");
      if (!s.append_schedule)
        throw fail("strategy." + setting.name,
                   "applies only with \"append_schedule\": true (the directive program's own split and order fix "
                   "the schedule)");
    }
  for (const char* key : {"cluster", "engine"})
    if (j.contains(key) && (!j[key].is_string() || j[key].get<std::string>().empty()))
      throw fail(key, "must be a non-empty string (leave the field out for the default)");
  if (j.contains("cluster")) s.cluster = map_cluster_file(j["cluster"].get<std::string>(), resolve);
  if (j.contains("engine")) s.engine = j["engine"].get<std::string>();
  if (j.contains("train")) {
    s.train = checked_train(j["train"], where);
    for (const char* file : {"data", "resume"})
      if (s.train.contains(file)) s.train[file] = resolve(s.train[file].get<std::string>());
  }
  return s;
}

}  // namespace piper::core
