// The one table of strategy settings. Each entry declares a knob of StrategyOptions once: its name
// (snake_case: the scenario key, sweep spec key, results CSV column and Python keyword; the CLI flag is
// --kebab-case), type, allowed values, one-line help and where it lives in StrategyOptions. The CLI
// flags, the scenario and sweep readers (strict: an unknown key is an error with a did-you-mean),
// the results CSV columns and their readers, the Python bindings and the studio's fields all come
// from it. The entries are the lines of strategy_settings.def, which also declares StrategyOptions'
// members: adding a setting is one line there plus the code that uses it.
#pragma once

#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/strategy.hpp"

namespace piper::core {

enum class SettingType { Int, Double, Bool, String };

struct Setting {
  std::string name;  // snake_case; the CLI flag is --kebab-case of it
  SettingType type = SettingType::Int;
  std::string help;  // one line, for --help, the studio's tool tips and piper.strategy_settings()
  std::variant<int StrategyOptions::*, double StrategyOptions::*, bool StrategyOptions::*,
               std::string StrategyOptions::*>
      member;
  // Int/Double: a value other than the default must lie in [min, max] (the default, often 0 for
  // "off", is always accepted).
  double min = 0, max = 0;
  // String: the allowed values besides the default (empty: any string; `schedule` uses the registry).
  std::vector<std::string> choices;
  // Sweep and tune keys (the resume identity) name a setting when it is not at its default, as
  // "/<key_tag><value>" (a Bool: "/<key_tag>"). `essential` settings are always in keys and always
  // written to scenario files.
  std::string key_tag;
  bool essential = false;
  // Applies only to a program the generator emits, so the CLI flag excludes --directives.
  bool generator_only = true;
};

// Every strategy setting, in a stable order (the order of CSV columns and sweep key parts).
const std::vector<Setting>& strategy_settings();
// The setting named `name`, or nullptr.
const Setting* find_setting(const std::string& name);
std::vector<std::string> setting_names();

std::string setting_flag(const Setting& s);       // "--dp-shard"
std::string setting_type_name(const Setting& s);  // "int", "double", "bool", "string"
// The allowed values of a String setting (`schedule`: the registered families); empty: any.
std::vector<std::string> setting_choices(const Setting& s);

nlohmann::json setting_value(const Setting& s, const StrategyOptions& o);
nlohmann::json setting_default(const Setting& s);
bool at_default(const Setting& s, const StrategyOptions& o);

// Why `v` is not an allowed value of `s` ("must be an integer in 0..3 (got 5)"); empty when it is.
std::string setting_problem(const Setting& s, const nlohmann::json& v);
// Sets `s` in `o` to `v`; throws Error "<where>: <problem>" for a value of the wrong type or range.
void set_setting(const Setting& s, StrategyOptions& o, const nlohmann::json& v, const std::string& where);

// Results CSV text: integers and doubles in shortest round-trip form, Bool 1/0, strings as they are.
std::string setting_text(const Setting& s, const StrategyOptions& o);
// Parses a CSV field written by setting_text; throws Error "<where>: <problem>".
nlohmann::json setting_from_text(const Setting& s, const std::string& text, const std::string& where);
// "/tp2", "/sp", "/rc-full" when `s` is not at its default (or is essential); else "".
std::string setting_key_part(const Setting& s, const StrategyOptions& o);

// Reads a strategy object (scenario "strategy", Python keywords): every key must be a setting (else
// Error "<where>: field '<prefix><key>': unknown field (did you mean ...)"), every value of its type
// and range. Keys not given keep o's values.
void read_strategy_json(const nlohmann::json& obj, StrategyOptions& o, const std::string& where,
                        const std::string& prefix = "strategy.");
// The settings of `o` as a JSON object: the essential ones and every one not at its default (all of
// them with `all`).
nlohmann::json strategy_to_json(const StrategyOptions& o, bool all = false);

// The table as JSON (name, flag, type, default, help, choices, min, max), for Python and docs.
nlohmann::json settings_table_json();

}  // namespace piper::core
