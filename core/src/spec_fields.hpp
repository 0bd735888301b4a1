// Typed, one-line-error access to the fields of a JSON model spec, shared by the spec reader
// (model.cpp) and the Hugging Face importer (hf_import.cpp). Internal to piper_core.
#pragma once

#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/model.hpp"
#include "piper/core/suggest.hpp"

namespace piper::core::spec {

using nlohmann::json;

[[noreturn]] inline void field_error(const std::string& where, const std::string& field, const std::string& msg) {
  throw ModelError(where + ": field '" + field + "': " + msg);
}

// What a front end calls a model spec field (hf_import.cpp: the config.json keys), so that an error
// names the key the user's file spells; a field not in the map keeps the spec's name.
using FieldNames = std::map<std::string, std::string>;

// Checks the invariants every consumer of a ModelConfig relies on; fields are named as `names` says,
// else as the spec does (model.cpp).
void validate_config(const ModelConfig& c, const std::string& where, const FieldNames& names = {});

// Typed access to one JSON object with one-line errors naming `where` and the dotted field.
class FieldReader {
 public:
  FieldReader(const json& j, std::string where, std::string prefix = "")
      : j_(j), where_(std::move(where)), prefix_(std::move(prefix)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& msg) const {
    field_error(where_, prefix_ + field, msg);
  }
  bool has(const std::string& f) const {
    read_.insert(f);
    return j_.contains(f) && !j_.at(f).is_null();
  }
  // Keys this reader has looked at (present or not).
  const std::set<std::string>& read_keys() const { return read_; }

  std::optional<std::int64_t> opt_int(const std::string& f) const {
    if (!has(f)) return std::nullopt;
    const json& v = j_.at(f);
    if (!v.is_number_integer()) fail(f, "must be an integer");
    return v.get<std::int64_t>();
  }
  std::int64_t req_positive(const std::string& f) const {
    auto v = opt_int(f);
    if (!v) fail(f, "missing required field (a positive integer)");
    if (*v <= 0) fail(f, "must be a positive integer");
    return *v;
  }
  std::int64_t positive_or(const std::string& f, std::int64_t dflt) const {
    auto v = opt_int(f);
    if (v && *v <= 0) fail(f, "must be a positive integer");
    return v.value_or(dflt);
  }
  std::int64_t non_negative_or(const std::string& f, std::int64_t dflt) const {
    auto v = opt_int(f);
    if (v && *v < 0) fail(f, "must be a non-negative integer");
    return v.value_or(dflt);
  }
  bool bool_or(const std::string& f, bool dflt) const {
    if (!has(f)) return dflt;
    if (!j_.at(f).is_boolean()) fail(f, "must be true or false");
    return j_.at(f).get<bool>();
  }
  std::optional<std::string> opt_string(const std::string& f) const {
    if (!has(f)) return std::nullopt;
    if (!j_.at(f).is_string()) fail(f, "must be a string");
    return j_.at(f).get<std::string>();
  }
  const json* opt_object(const std::string& f) const {
    if (!has(f)) return nullptr;
    if (!j_.at(f).is_object()) fail(f, "must be a JSON object");
    return &j_.at(f);
  }
  void reject_unknown(const std::set<std::string>& known) const {
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (!known.count(it.key()))
        fail(it.key(), "unknown field" + did_you_mean(it.key(), {known.begin(), known.end()}));
  }

 private:
  const json& j_;
  std::string where_;
  std::string prefix_;
  mutable std::set<std::string> read_;
};

inline void require_object(const json& j, const std::string& where, const char* what) {
  if (!j.is_object()) throw ModelError(where + ": " + what + " must be a JSON object");
}

}  // namespace piper::core::spec
