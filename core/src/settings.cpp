// The table of strategy settings (settings.hpp) and the conversions every front end shares.
#include "piper/core/settings.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "piper/core/error.hpp"
#include "piper/core/suggest.hpp"

namespace piper::core {

using nlohmann::json;

namespace {

constexpr double kIntMax = std::numeric_limits<int>::max();

Setting int_setting(std::string name, int StrategyOptions::*m, double min, double max, std::string tag, std::string help) {
  Setting s;
  s.name = std::move(name);
  s.type = SettingType::Int;
  s.member = m;
  s.min = min;
  s.max = max;
  s.key_tag = std::move(tag);
  s.help = std::move(help);
  return s;
}

Setting bool_setting(std::string name, bool StrategyOptions::*m, std::string tag, std::string help) {
  Setting s;
  s.name = std::move(name);
  s.type = SettingType::Bool;
  s.member = m;
  s.key_tag = std::move(tag);
  s.help = std::move(help);
  return s;
}

Setting string_setting(std::string name, std::string StrategyOptions::*m, std::vector<std::string> choices, std::string tag,
                       std::string help) {
  Setting s;
  s.name = std::move(name);
  s.type = SettingType::String;
  s.member = m;
  s.choices = std::move(choices);
  s.key_tag = std::move(tag);
  s.help = std::move(help);
  return s;
}

Setting essential(Setting s) {
  s.essential = true;
  return s;
}

Setting also_with_directives(Setting s) {
  s.generator_only = false;
  return s;
}

std::vector<Setting> make_table() {
  using O = StrategyOptions;
  Setting bucket;
  bucket.name = "bucket_mb";
  bucket.type = SettingType::Double;
  bucket.member = &O::bucket_mb;
  bucket.min = 0;
  bucket.max = 1e9;  // bytes must fit in int64
  bucket.key_tag = "b";
  bucket.help = "gradient bucket size in MB (0: one per segment)";
  // Order: the essential settings first, then the others as they were added. It is the order of
  // CSV columns and of the parts of sweep keys, so a new setting goes at the end.
  return {
      essential(int_setting("pp", &O::pp, 1, kIntMax, "pp", "pipeline-parallel ranks")),
      essential(int_setting("dp", &O::dp, 1, kIntMax, "dp", "data-parallel replicas")),
      essential(int_setting("ep", &O::ep, 1, kIntMax, "ep", "expert-parallel degree (divides --dp)")),
      essential(int_setting("zero", &O::zero, 0, 3, "z", "ZeRO level: 0, 1 (optimizer), 2 (+grads), 3 (+params)")),
      essential(also_with_directives(string_setting("schedule", &O::schedule, {}, "", "pipeline schedule family"))),
      essential(also_with_directives(int_setting("microbatches", &O::microbatches, 1, kIntMax, "mb", "microbatches per step"))),
      essential(also_with_directives(
          int_setting("virtual", &O::virtual_stages, 1, kIntMax, "v", "model chunks per pipeline rank"))),
      essential(bucket),
      int_setting("tp", &O::tp, 1, kIntMax, "tp", "tensor-parallel degree (consecutive devices, inside a node)"),
      bool_setting("sequence_parallel", &O::sequence_parallel, "sp", "sequence parallelism inside each TP group (needs --tp >= 2)"),
      string_setting("recompute", &O::recompute, {"selective", "full", "op"}, "rc-",
                     "activation recomputation: none, selective (the attention core), full (whole blocks) or op "
                     "(TorchTitan's op-level policy)"),
      also_with_directives(int_setting("global_batch", &O::global_batch, 1, kIntMax, "gb",
                                       "sequences per step; microbatches = N / (micro-batch size x dp)")),
      int_setting("comm_sms", &O::comm_sms, 1, kIntMax, "sms",
                  "give the communication streams N SMs of each GPU, compute the rest (sm_partition directive)"),
      int_setting("dp_shard", &O::dp_shard, 2, kIntMax, "hs",
                  "HSDP: ZeRO shards over groups of N data-parallel replicas; the groups replicate each other"),
      bool_setting("tp_comm_overlap", &O::tp_comm_overlap, "tpo",
                   "overlap the TP collectives with the GEMMs (Megatron's --tp-comm-overlap, async TP)"),
      string_setting("reduce_every", &O::reduce_every, {"microbatch", "step"}, "rs-",
                     "ZeRO-2/3 gradient reduction: after every microbatch (default; DeepSpeed ZeRO-2, FSDP2) or once per "
                     "step (keeps whole gradients, as FSDP's no_sync)"),
      bool_setting("fp8_all_gather", &O::fp8_all_gather, "fp8ag",
                   "ZeRO-3 with fp8 training: gather the parameters in fp8, one byte each (TorchTitan's Float8)"),
  };
}

std::string number_text(double v) { return fmt::format("{}", v); }

}  // namespace

const std::vector<Setting>& strategy_settings() {
  static const std::vector<Setting> table = make_table();
  return table;
}

const Setting* find_setting(const std::string& name) {
  for (const auto& s : strategy_settings())
    if (s.name == name) return &s;
  return nullptr;
}

std::vector<std::string> setting_names() {
  std::vector<std::string> names;
  for (const auto& s : strategy_settings()) names.push_back(s.name);
  return names;
}

std::string setting_flag(const Setting& s) {
  std::string flag = "--" + s.name;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

std::string setting_type_name(const Setting& s) {
  switch (s.type) {
    case SettingType::Int: return "int";
    case SettingType::Double: return "double";
    case SettingType::Bool: return "bool";
    case SettingType::String: return "string";
  }
  return "?";
}

std::vector<std::string> setting_choices(const Setting& s) {
  if (s.type != SettingType::String) return {};
  if (s.name == "schedule") {
    std::vector<std::string> names;
    for (const auto& f : schedule_registry()) names.push_back(f.name);
    return names;
  }
  if (s.choices.empty()) return {};
  std::vector<std::string> all;
  const std::string d = setting_default(s).get<std::string>();
  if (!d.empty()) all.push_back(d);
  all.insert(all.end(), s.choices.begin(), s.choices.end());
  return all;
}

json setting_value(const Setting& s, const StrategyOptions& o) {
  return std::visit([&](auto m) { return json(o.*m); }, s.member);
}

json setting_default(const Setting& s) { return setting_value(s, StrategyOptions{}); }

bool at_default(const Setting& s, const StrategyOptions& o) { return setting_value(s, o) == setting_default(s); }

std::string setting_problem(const Setting& s, const json& v) {
  const json def = setting_default(s);
  switch (s.type) {
    case SettingType::Bool:
      return v.is_boolean() ? std::string() : fmt::format("must be true or false (got {})", v.dump());
    case SettingType::Int:
    case SettingType::Double: {
      const bool is_int = s.type == SettingType::Int;
      auto range = [&] {
        const std::string lo = number_text(s.min), hi = s.max >= kIntMax ? std::string() : number_text(s.max);
        std::string r = hi.empty() ? ">= " + lo : "in " + lo + ".." + hi;
        if (!(def.get<double>() >= s.min && def.get<double>() <= s.max)) r += fmt::format(" (or {}: off)", def.dump());
        return r;
      };
      if (is_int ? !v.is_number_integer() : !v.is_number())
        return fmt::format("must be {} {} (got {})", is_int ? "an integer" : "a number", range(), v.dump());
      const double x = v.get<double>();
      if (v == def || (std::isfinite(x) && x >= s.min && x <= s.max)) return {};
      return fmt::format("must be {} {} (got {})", is_int ? "an integer" : "a number", range(), v.dump());
    }
    case SettingType::String: {
      if (!v.is_string()) return fmt::format("must be a string (got {})", v.dump());
      const std::vector<std::string> choices = setting_choices(s);
      const std::string x = v.get<std::string>();
      if (choices.empty() || x == def.get<std::string>() || std::find(choices.begin(), choices.end(), x) != choices.end())
        return {};
      std::string list;
      for (std::size_t i = 0; i < choices.size(); ++i)
        list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
      return fmt::format("unknown value '{}'{}; expected {}", x, did_you_mean(x, choices), list);
    }
  }
  return {};
}

void set_setting(const Setting& s, StrategyOptions& o, const json& v, const std::string& where) {
  if (const std::string why = setting_problem(s, v); !why.empty()) throw Error(where + ": " + why);
  std::visit(
      [&](auto m) {
        using T = std::decay_t<decltype(o.*m)>;
        o.*m = v.get<T>();
      },
      s.member);
}

std::string setting_text(const Setting& s, const StrategyOptions& o) {
  const json v = setting_value(s, o);
  switch (s.type) {
    case SettingType::Bool: return v.get<bool>() ? "1" : "0";
    case SettingType::Int: return std::to_string(v.get<int>());
    case SettingType::Double: return number_text(v.get<double>());
    case SettingType::String: return v.get<std::string>();
  }
  return {};
}

json setting_from_text(const Setting& s, const std::string& text, const std::string& where) {
  json v;
  switch (s.type) {
    case SettingType::String: v = text; break;
    case SettingType::Bool:
      if (text != "0" && text != "1") throw Error(fmt::format("{}: '{}' is not 0 or 1", where, text));
      v = text == "1";
      break;
    case SettingType::Int:
    case SettingType::Double:
      try {
        std::size_t used = 0;
        if (s.type == SettingType::Int) {
          const long long x = std::stoll(text, &used);
          v = x;
        } else {
          v = std::stod(text, &used);
        }
        if (used != text.size() || text.empty()) throw std::invalid_argument(text);
      } catch (const std::exception&) {
        throw Error(fmt::format("{}: '{}' is not {}", where, text, s.type == SettingType::Int ? "an integer" : "a number"));
      }
      break;
  }
  if (const std::string why = setting_problem(s, v); !why.empty()) throw Error(where + ": " + why);
  return v;
}

std::string setting_key_part(const Setting& s, const StrategyOptions& o) {
  if (!s.essential && at_default(s, o)) return {};
  if (s.type == SettingType::Bool) return setting_value(s, o).get<bool>() ? "/" + s.key_tag : std::string();
  return "/" + s.key_tag + setting_text(s, o);
}

void read_strategy_json(const json& obj, StrategyOptions& o, const std::string& where, const std::string& prefix) {
  if (!obj.is_object()) throw Error(fmt::format("{}: field '{}': must be an object", where, prefix.empty() ? "strategy" : prefix.substr(0, prefix.size() - 1)));
  const std::vector<std::string> names = setting_names();
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const Setting* s = find_setting(it.key());
    if (!s) {
      std::string hint = did_you_mean(it.key(), names);
      if (hint.empty()) {
        hint = " (expected one of: ";
        for (std::size_t i = 0; i < names.size(); ++i) hint += (i ? ", " : "") + names[i];
        hint += ")";
      }
      throw Error(fmt::format("{}: field '{}{}': unknown field{}", where, prefix, it.key(), hint));
    }
    set_setting(*s, o, it.value(), fmt::format("{}: field '{}{}'", where, prefix, it.key()));
  }
}

json strategy_to_json(const StrategyOptions& o, bool all) {
  json j = json::object();
  for (const auto& s : strategy_settings())
    if (all || s.essential || !at_default(s, o)) j[s.name] = setting_value(s, o);
  return j;
}

json settings_table_json() {
  json out = json::array();
  for (const auto& s : strategy_settings()) {
    json e = {{"name", s.name},       {"flag", setting_flag(s)},      {"type", setting_type_name(s)},
              {"default", setting_default(s)}, {"help", s.help}};
    if (s.type == SettingType::Int || s.type == SettingType::Double) {
      e["min"] = s.min;
      if (s.max < kIntMax || s.type == SettingType::Double) e["max"] = s.max;
    }
    if (const auto choices = setting_choices(s); !choices.empty()) e["choices"] = choices;
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace piper::core
