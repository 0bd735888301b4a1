// Resource limits: the largest inputs Piper accepts, in one table, so that an absurd input (a 10 GB
// file, 10^12 layers, 10^6 microbatches or devices) is refused up front with one line naming the limit
// instead of running away in memory or time. Each limit is overridable: `piper --limit NAME=VALUE`
// or the environment variable PIPER_LIMIT_<NAME> (upper case, '-' -> '_'); see docs/reliability.md.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "piper/core/error.hpp"

namespace piper::core {

enum class Limit {
  InputBytes,           // size of any input file read (programs, specs, configs, CSVs, plans)
  Layers,               // model blocks (layers / num_hidden_layers)
  ModelWidth,           // hidden, ffn, expert_ffn, heads, head_dim, vocab, MLA ranks, positions
  Experts,              // MoE experts (and top_k, shared experts)
  TokensPerMicrobatch,  // seq_len x micro_batch_size
  Microbatches,         // microbatches per step (flags, split directives, CSVs, plans)
  Devices,              // devices in a program, cluster or strategy; device ids are below it
  DagNodes,             // nodes of the global training DAG while compiling
  SimulatedOps,         // op instances a simulation runs (sum over devices of their plan's ops)
  SweepRuns,            // combinations in one sweep
  JsonDepth,            // nesting depth of arrays/objects in any JSON input (deeper would overflow the stack)
  DataBytes,            // size of a --data token file
  CheckpointBytes,      // size of a checkpoint file read by --resume
};

struct LimitInfo {
  Limit limit;
  const char* name;  // as given to --limit, e.g. "microbatches"
  std::int64_t default_value;
  const char* what;  // one line for docs and errors
};

// Every limit with its default, in declaration order.
const std::vector<LimitInfo>& limit_table();

// A limit was exceeded (or an override was malformed). The message names the limit and how to raise it.
class LimitError : public Error {
 public:
  using Error::Error;
};

// The current value: an override (set_limit), else PIPER_LIMIT_<NAME> from the environment, else
// the default. Thread-safe; read the environment once.
std::int64_t limit_value(Limit l);

// Overrides a limit by name ("microbatches"); throws LimitError for an unknown name or a value < 1.
void set_limit(const std::string& name, std::int64_t value);
// Parses "NAME=VALUE" (the --limit flag) and applies it; throws LimitError naming the flag.
void set_limit_from_flag(const std::string& spec);
// Restores every limit to its default (ignoring the environment); for tests and fuzz harnesses.
void reset_limits_to_defaults();

// "<value> <unit> exceeds the limit of <max> (limit 'NAME'; raise it with --limit NAME=N or ...)",
// for errors that carry their own location (a directive index and field).
std::string limit_message(Limit l, std::int64_t value, const std::string& unit);

// Throws LimitError "<where>: <value> <unit> exceeds the limit of <max> (...)" when value > limit.
// `where` names the file/field or flag; `unit` says what was counted ("microbatches").
void check_limit(Limit l, std::int64_t value, const std::string& where, const std::string& unit);

// Reads a whole input file after checking its size against Limit::InputBytes (before reading a
// byte). Throws Error "<path>: ..." for a missing, unreadable or oversized file or a directory.
std::string read_input_file(const std::string& path);

// The same, bounded by `bytes_limit` (Limit::DataBytes for --data, Limit::CheckpointBytes for a
// checkpoint) and, when max_bytes >= 0, also by max_bytes (what the input can hold at most, e.g. a
// checkpoint of a known model; `what` names it in the error). Regular files are sized before a byte
// is read; pipes and devices (/dev/zero) are read in chunks and stopped once they pass the bound.
std::string read_input_file(const std::string& path, Limit bytes_limit, std::int64_t max_bytes = -1,
                            const std::string& what = "");

// Throws LimitError "<where>: JSON nested N deep (or more) exceeds the limit of ... 'json-depth' ..."
// when arrays/objects in `text` nest deeper than Limit::JsonDepth. A linear scan that skips strings
// (with their escapes) and stops at the first level past the limit; call it before json::parse, whose
// recursive destructor and conversions would overflow the stack on 10^5 levels. Malformed text is left
// for the parser to report.
void check_json_depth(std::string_view text, const std::string& where);
// check_json_depth, then nlohmann::json::parse: every input parser's entry point. Syntax errors stay
// nlohmann's json::exception for the caller to word; the depth limit is a LimitError.
nlohmann::json parse_json(std::string_view text, const std::string& where);

// Input echoed into an error line, made safe to print: control bytes and bytes that are not UTF-8
// become \xNN, and past max_bytes (0: no cap) the rest is replaced by "... (N bytes in all)". A CSV
// cell of 355 binary bytes used to be written raw into the error line.
std::string printable(std::string_view text, std::size_t max_bytes = 0);
// A name or label safe to print as it is: printable() leaves it unchanged and it holds no bidirectional
// control (U+202A-U+202E, U+2066-U+2069, which reorder what follows them on a terminal).
bool plain_text(std::string_view text);
// printable(), with bidirectional controls also escaped (\u202e): for echoing a refused name.
std::string printable_text(std::string_view text, std::size_t max_bytes = 0);

// The first key of the JSON object `obj` that is not among `known`: the key made printable (80 bytes
// at most) and "unknown field" with did_you_mean's hint, or the allowed keys when none is near; nullopt
// when every key is known. The plan, plan-kernel, calibration and scenario readers word their refusal
// of a misspelt key from it.
struct UnknownField {
  std::string key, message;
};
std::optional<UnknownField> unknown_field(const nlohmann::json& obj, std::span<const std::string_view> known);
std::optional<UnknownField> unknown_field(const nlohmann::json& obj, std::initializer_list<std::string_view> known);

// A JSON object that is plainly another of Piper's inputs than the reader expects (`expected`: "a
// plan", "a scenario", "a model spec"): a plan ("format": "piper-program"), a scenario (a "model" to
// load), a model spec ("vocab", "hidden", "layers") or a Hugging Face config ("model_type"). Returns the
// line saying so and where such a file goes, or "" when it is not plainly another kind. A plan given to
// --scenario (or a scenario to --plan) said only "field 'device_sets': unknown field".
std::string wrong_input_kind(const nlohmann::json& obj, std::string_view expected);

}  // namespace piper::core
