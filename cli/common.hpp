// Shared pieces of the piper command: one-line errors, file reading, flag validators, and the flags
// that describe a scenario (model, training shape, strategy or directive program).
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/program.hpp"
#include "piper/core/scenario.hpp"

namespace piper::cli {

namespace core = piper::core;
using nlohmann::json;

// Exit codes (docs/reliability.md "Exit codes"); main.cpp maps exceptions onto them.
constexpr int kExitVerifyFailed = 1;  // `piper verify` found issues
constexpr int kExitBadInput = 2;      // every user error: bad file, bad directive, bad flag (one line naming where)
constexpr int kExitInternal = 3;      // a bug in piper, not in the input: the line asks for a report
constexpr int kExitPeerFailure = 4;   // `piper run`: a rank failed mid-step (a peer died, stalled or disagreed)

// A user-facing failure: printed as "piper: error: <file>: <message>" (file omitted when empty).
class CliError : public std::runtime_error {
 public:
  CliError(std::string file, const std::string& message) : std::runtime_error(message), file_(std::move(file)) {}
  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

// The message on one line: line ends at its end dropped, those inside escaped (\x0a) as core::printable does.
std::string one_line(std::string s);
std::string json_message(const json::exception& e);
std::string read_text_file(const std::string& path);
json read_json_file(const std::string& path);
// A plan file written by `piper compile -o`, read and verified (deadlock-free under the execution
// semantics); errors are CliError naming the file.
core::Program read_verified_plan(const std::string& path);
std::string human_count(std::int64_t n);
double mib(std::int64_t bytes);
void print_error(const std::string& file, const std::string& message);
// "piper: internal error: <message> (please report this: it is a bug in piper, not in the input)".
void print_internal_error(const std::string& message);

extern const CLI::Validator kPositiveInt;
extern const CLI::Validator kNonNegativeInt;
extern const CLI::Validator kNonNegativeInt64;  // a uint64 (a seed): digits only, "-1" refused
extern const CLI::Validator kNonNegativeNumber;
extern const CLI::Validator kPositiveNumber;
// An output file name: an empty one (`-o ""`) is refused instead of writing nothing. Options checked
// with it are the command's outputs for refuse_outputs_over_inputs (it finds them by the name
// kOutputPathName).
extern const CLI::Validator kOutputPath;
inline constexpr const char* kOutputPathName = "output-path";
// Checked beside kOutputPath on an output whose missing folders the command creates (a checkpoint,
// export-chakra's folder); every other output's folder must exist before the command runs.
extern const CLI::Validator kMakesItsFolder;
// Beside kOutputPath on an output written as PNG (`plot -o`, `tune --plot`): a name with another
// extension (chart.svg, chart.jpg) is refused at parse time rather than given PNG bytes; a name
// without an extension, or an existing device or FIFO (/dev/stdout), is taken.
extern const CLI::Validator kPngPath;
inline constexpr const char* kMakesItsFolderName = "makes-its-folder";
// Before a parsed command runs: an output (an option checked with kOutputPath) naming the same regular
// file as one of its inputs (any other option or positional naming an existing file) or as another
// output is refused (CliError), since writing it would destroy the input or the other output; so is an
// output whose folder does not exist (unless the option is marked kMakesItsFolder).
// `piper run --resume ck --save ck` continues its own checkpoint and is allowed.
void refuse_outputs_over_inputs(CLI::App* command);
// Numbers given to number options in decimal only (CLI11 also read "0x10" as 16 and " 2" as 2): a
// CliError naming the flag otherwise.
bool decimal_number(const std::string& text, bool integer);
void refuse_loose_numbers(CLI::App* command);

// Strategy flags: one per setting of the table (core/settings.hpp), named --kebab-case of the
// setting, with its help, type and range checks.
struct StrategyFlags {
  core::StrategyOptions options;
  std::vector<std::pair<std::string, CLI::Option*>> flags;  // setting name -> its flag, in table order
  CLI::Option* option(const std::string& setting) const;    // the flag of a setting of the table
  void add_to(CLI::App* app);
};

// The inputs of `piper compile`, reused by every command that compiles (simulate, run, ...):
// --model, --seq-len, --micro-batch-size, --stages, --directives and the strategy flags.
struct ScenarioFlags {
  std::string model;
  std::int64_t seq_len = 0, micro_batch_size = 0;
  int stages = 0;
  std::vector<int> pp_ranges;
  int first_stage_layers = 0, last_stage_layers = 0;
  std::string directives_path;
  std::string save_scenario_path;
  std::string scenario_path;  // --scenario FILE (add_file_option): the model and strategy from a scenario file
  StrategyFlags strategy;
  CLI::Option* directives = nullptr;
  // Every compile input (all of the above but --model): none of them applies to a compiled plan.
  std::vector<CLI::Option*> compile_inputs;
  void add_to(CLI::App* app);
  // --scenario FILE, in place of --model and the compile inputs (piper-studio's files, --save-scenario's);
  // makes --model optional. `help` says what the command takes from the file.
  CLI::Option* add_file_option(CLI::App* app, const std::string& help);
  // With --plan FILE the plan fixes the strategy: a compile input given beside it would be silently
  // ignored, so it is an error naming the flag (CliError).
  void reject_beside_plan() const;
  // --save-scenario FILE: writes the scenario (the file piper-studio opens) atomically, if asked.
  void save_if_requested(const core::Scenario& s) const;
  // The scenario file's (a compile input beside it is an error naming the flag), else the flags' after
  // checking their combinations and reading the directive file; throws CliError.
  core::Scenario scenario() const;
};

// The scenario file text for `s`, to be written at `path`: a model or cluster given as a relative
// file path is rewritten relative to the scenario's folder (where loading resolves it), so the file
// opens from any working directory.
std::string scenario_file_text(core::Scenario s, const std::string& path);

// "42s", "3m07s", "2h05m"; "?" for a negative or non-finite time.
std::string format_duration(double s);

// A long search's progress as whole lines, for a log or a pipe (a terminal gets a bar redrawn in
// place): nothing during its first `every_s` seconds (a short search stays quiet); then a line every
// `every_s` seconds while a phase runs and one as each phase ends ("tune: analytic: 7 of 9, elapsed
// 2m00s", "... 9 of 9 done, elapsed 2m41s"). report() returns the line to print, or "".
class ProgressLog {
 public:
  ProgressLog(std::string command, double every_s) : command_(std::move(command)), every_s_(every_s) {}
  std::string report(const std::string& phase, std::size_t done, std::size_t total, double elapsed_s);

 private:
  std::string command_;
  double every_s_;
  std::string ended_;  // the last phase whose end was reported
  double last_line_s_ = 0;
};

// Registers a subcommand: `run` is called when it was parsed. Commands live in cli/cmd_*.cpp.
struct Command {
  CLI::App* app;
  std::function<int()> run;
};
Command add_compile_command(CLI::App& app);
Command add_directives_command(CLI::App& app);
Command add_verify_command(CLI::App& app);
Command add_models_command(CLI::App& app);
Command add_simulate_command(CLI::App& app);
Command add_run_command(CLI::App& app);
Command add_schedule_command(CLI::App& app);
Command add_sweep_command(CLI::App& app);
Command add_export_chakra_command(CLI::App& app);
Command add_tune_command(CLI::App& app);
Command add_plot_command(CLI::App& app);
Command add_calibrate_command(CLI::App& app);
Command add_limits_command(CLI::App& app);

}  // namespace piper::cli
