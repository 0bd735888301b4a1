// The table of strategy settings (settings.hpp) and the conversions every front end shares.
#include "piper/core/settings.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include <fmt/format.h>

#include "piper/core/error.hpp"
#include "piper/core/suggest.hpp"

namespace piper::core {

using nlohmann::json;

namespace {

constexpr double kSettingNoMax = std::numeric_limits<int>::max();
constexpr int kEssential = 1, kWithDirectives = 2;

std::vector<std::string> split_choices(const std::string& text) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (!text.empty() && pos <= text.size()) {
    const std::size_t bar = std::min(text.find('|', pos), text.size());
    out.push_back(text.substr(pos, bar - pos));
    pos = bar + 1;
  }
  return out;
}

template <class T>
constexpr SettingType type_of() {
  if constexpr (std::is_same_v<T, bool>)
    return SettingType::Bool;
  else if constexpr (std::is_same_v<T, int>)
    return SettingType::Int;
  else if constexpr (std::is_same_v<T, double>)
    return SettingType::Double;
  else
    return SettingType::String;
}

std::vector<Setting> make_table() {
  std::vector<Setting> table;
#define PIPER_STRATEGY_SETTING(T_, M_, name_, default_value, min_, max_, choices_, key_tag_, traits, help_) \
  {                                                                                                         \
    Setting s;                                                                                              \
    s.name = name_;                                                                                         \
    s.type = type_of<T_>();                                                                                 \
    s.help = help_;                                                                                         \
    s.member = &StrategyOptions::M_;                                                                        \
    s.min = min_;                                                                                           \
    s.max = max_;                                                                                           \
    s.choices = split_choices(choices_);                                                                    \
    s.key_tag = key_tag_;                                                                                   \
    s.essential = ((traits)&kEssential) != 0;                                                               \
    s.generator_only = ((traits)&kWithDirectives) == 0;                                                     \
    table.push_back(std::move(s));                                                                          \
  }
#include "piper/core/strategy_settings.def"
#undef PIPER_STRATEGY_SETTING
  return table;
}

std::string number_text(double v) { return fmt::format("{}", v); }

// A value as the message shows it: JSON writes NaN and infinity (from a flag's "nan") as null.
std::string value_text(const json& v) {
  return v.is_number_float() && !std::isfinite(v.get<double>()) ? number_text(v.get<double>()) : v.dump();
}

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
    case SettingType::Int:
      return "int";
    case SettingType::Double:
      return "double";
    case SettingType::Bool:
      return "bool";
    case SettingType::String:
      return "string";
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
      // The range is stated with its upper bound where one applies: every number setting's (clip_grad's
      // 1e12 is above the largest int, which stands for "no maximum" only for integer settings), and an
      // integer's implicit one, the largest int, once the value is past it ("must be an integer >= 1
      // (got 4611686018427387904)" named only the bound that was kept).
      const bool above = v.is_number() && !(v.get<double>() <= s.max);
      auto range = [&] {
        const bool has_max = !is_int || s.max < kSettingNoMax || above;
        const std::string lo = number_text(s.min), hi = has_max ? number_text(s.max) : std::string();
        std::string r = hi.empty() ? ">= " + lo : "in " + lo + ".." + hi;
        if (!(def.get<double>() >= s.min && def.get<double>() <= s.max)) r += fmt::format(" (or {}: off)", def.dump());
        return r;
      };
      if (is_int ? !v.is_number_integer() : !v.is_number())
        return fmt::format("must be {} {} (got {})", is_int ? "an integer" : "a number", range(), value_text(v));
      const double x = v.get<double>();
      if (v == def || (std::isfinite(x) && x >= s.min && x <= s.max)) return {};
      return fmt::format("must be {} {} (got {})", is_int ? "an integer" : "a number", range(), value_text(v));
    }
    case SettingType::String: {
      if (!v.is_string()) return fmt::format("must be a string (got {})", v.dump());
      const std::vector<std::string> choices = setting_choices(s);
      const std::string x = v.get<std::string>();
      const bool listed = std::find(choices.begin(), choices.end(), x) != choices.end();
      if (choices.empty() || x == def.get<std::string>() || listed) return {};
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
    case SettingType::Bool:
      return v.get<bool>() ? "1" : "0";
    case SettingType::Int:
      return std::to_string(v.get<int>());
    case SettingType::Double:
      return number_text(v.get<double>());
    case SettingType::String:
      return v.get<std::string>();
  }
  return {};
}

json setting_from_text(const Setting& s, const std::string& text, const std::string& where) {
  json v;
  switch (s.type) {
    case SettingType::String:
      v = text;
      break;
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
        const char* what = s.type == SettingType::Int ? "an integer" : "a number";
        throw Error(fmt::format("{}: '{}' is not {}", where, text, what));
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
  if (!obj.is_object()) {
    const std::string field = prefix.empty() ? "strategy" : prefix.substr(0, prefix.size() - 1);
    throw Error(fmt::format("{}: field '{}': must be an object", where, field));
  }
  const std::vector<std::string> names = setting_names();
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const Setting* s = find_setting(it.key());
    if (!s) {
      throw Error(fmt::format("{}: field '{}{}': unknown field{}", where, prefix, it.key(),
                              unknown_field_hint(it.key(), names)));
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
    json e = {{"name", s.name},
              {"flag", setting_flag(s)},
              {"type", setting_type_name(s)},
              {"default", setting_default(s)},
              {"help", s.help}};
    if (s.type == SettingType::Int || s.type == SettingType::Double) {
      auto number = [&](double v) { return s.type == SettingType::Int ? json(static_cast<long long>(v)) : json(v); };
      e["min"] = number(s.min);
      if (s.max < kSettingNoMax || s.type == SettingType::Double) e["max"] = number(s.max);
    }
    if (const auto choices = setting_choices(s); !choices.empty()) e["choices"] = choices;
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace piper::core
