// The piper command: thin subcommands over the libraries. Each command lives in cli/cmd_*.cpp.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "cli/common.hpp"
#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"
#include "piper/runtime/executor.hpp"
#include "piper/sim/ready_tracker.hpp"
#include "piper/core/suggest.hpp"

using namespace piper::cli;

namespace {

// CLI11 says only "The following arguments were not expected" for a misspelt flag: name the first flag
// the subcommand does not know and the nearest one it does ("" when every --flag is known).
std::string unknown_flag_message(const CLI::App& app, int argc, char** argv) {
  const CLI::App* sub = nullptr;
  for (const CLI::App* s : app.get_subcommands({}))
    if (argc > 1 && s->get_name() == argv[1]) sub = s;
  std::vector<std::string> known;
  for (const CLI::App* a : {&app, sub})
    if (a)
      for (const CLI::Option* o : a->get_options({}))
        for (const auto& name : o->get_lnames()) known.push_back("--" + name);
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) continue;
    const std::string flag = arg.substr(0, arg.find('='));
    if (std::find(known.begin(), known.end(), flag) != known.end()) continue;
    return fmt::format("unknown flag '{}'{}", flag, piper::core::did_you_mean(flag, known));
  }
  return {};
}

// A rank other than 0 of an mpirun launch (OpenMPI, PMIx and MPICH name the rank in the environment).
// Every rank parses the same command line, so a flag error is the same on each: rank 0 says it, and
// `mpirun -np 8 piper run --steps 0` prints one line instead of eight. The output paths are rank 0's
// to check (it writes them).
bool another_mpi_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* rank = std::getenv(name); rank != nullptr && *rank != '\0') return std::string(rank) != "0";
  return false;
}

// The --limit NAME=N flags, each limit once: a second value would silently win.
void set_limits_from_flags(const std::vector<std::string>& flags) {
  std::vector<std::string> given;
  for (const auto& spec : flags) {
    const std::string name = spec.substr(0, spec.find('='));
    if (std::find(given.begin(), given.end(), name) != given.end())
      throw piper::core::LimitError(fmt::format("--limit {}: given twice (give each limit once)", name));
    given.push_back(name);
    piper::core::set_limit_from_flag(spec);
  }
}

// CLI11 would only say "A subcommand is required" for a misspelt one: name it instead. True (the line
// printed) when argv[1] is a word that names no command.
bool unknown_command(int argc, char** argv, const std::vector<Command>& commands) {
  std::vector<std::string> names;
  for (const auto& c : commands) names.push_back(c.app->get_name());
  if (argc <= 1 || argv[1][0] == '-' || std::find(names.begin(), names.end(), argv[1]) != names.end()) return false;
  std::string hint = piper::core::did_you_mean(argv[1], names);
  if (hint.empty()) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    hint = " (expected one of: " + list + ")";
  }
  if (!another_mpi_rank()) print_error("", fmt::format("unknown command '{}'{}", argv[1], hint));
  return true;
}

// Test hook (as checkpoint.cpp's PIPER_TEST_CRASH_BEFORE_RENAME): raise one failure of each class, so
// that tests/unit/test_cli.cpp can check the exit code each one maps to.
void raise_test_failure() {
  const char* fail = std::getenv("PIPER_TEST_FAIL");
  if (fail == nullptr) return;
  const std::string what = fail;
  if (what == "internal") throw piper::core::InternalError("test failure");
  if (what == "deadlock") throw piper::sim::DeadlockError("test deadlock");
  if (what == "runtime") throw piper::runtime::RuntimeError("runtime: test peer failure");
  if (what == "logic") throw std::logic_error("test logic error");
}

int run_command(int argc, char** argv) {
  CLI::App app{"piper: a programmable distributed-training compiler, simulator and runtime", "piper"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("piper ") + PIPER_VERSION, "print the version and exit");
  // Resource limits (docs/reliability.md) may be given before or after the subcommand.
  app.fallthrough();
  std::vector<std::string> limit_flags;
  app.add_option("--limit", limit_flags, "override a resource limit, NAME=N (repeatable; see `piper limits`)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  std::vector<Command> commands = {
      add_compile_command(app),  add_directives_command(app), add_verify_command(app),
      add_models_command(app),   add_run_command(app),        add_simulate_command(app),
      add_schedule_command(app), add_sweep_command(app),      add_export_chakra_command(app),
      add_tune_command(app),     add_plot_command(app),       add_calibrate_command(app),
      add_limits_command(app)};

  if (unknown_command(argc, argv, commands)) return kExitBadInput;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string help = argc > 1 && argv[1][0] != '-' ? fmt::format("piper {} --help", argv[1]) : "piper --help";
    std::string message = e.what();
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
      const std::string named = unknown_flag_message(app, argc, argv);
      if (!named.empty()) message = named;
    }
    if (!another_mpi_rank()) print_error("", fmt::format("{} (see '{}')", message, help));
    return kExitBadInput;
  }

  try {
    (void)piper::core::limit_value(piper::core::Limit::InputBytes);  // a malformed PIPER_LIMIT_* fails up front
    set_limits_from_flags(limit_flags);
    raise_test_failure();
    for (const auto& c : commands)
      if (c.app->parsed()) {
        // Under mpirun rank 0 writes every output (the run's report, trace and checkpoint, the sweep's
        // results file): it checks them, in one line; the job ends when it exits.
        refuse_loose_numbers(c.app);
        if (!another_mpi_rank()) refuse_outputs_over_inputs(c.app);
        return c.run();
      }
  } catch (const CliError& e) {
    print_error(e.file(), e.what());
    return kExitBadInput;
  } catch (const piper::sim::DeadlockError& e) {
    // Every plan is verified before it is simulated: a deadlock the verifier let through is piper's.
    print_internal_error(fmt::format("the simulator deadlocked on a verified plan: {}", e.what()));
    return kExitInternal;
  } catch (const piper::core::InternalError& e) {
    const std::string what = e.what();  // "internal: ..."; the line already says so
    print_internal_error(what.rfind("internal: ", 0) == 0 ? what.substr(10) : what);
    return kExitInternal;
  } catch (const piper::runtime::RuntimeError& e) {  // single-process runs; ranks abort with it (cmd_run.cpp)
    print_error("", e.what());
    return kExitPeerFailure;
  } catch (const piper::core::Error& e) {
    print_error("", e.what());
    return kExitBadInput;
  } catch (const std::invalid_argument& e) {
    print_error("", e.what());
    return kExitBadInput;
  } catch (const nlohmann::json::exception& e) {
    print_error("", json_message(e));
    return kExitBadInput;
  } catch (const std::system_error& e) {
    // fmt::print checks its writes: output longer than stdout's buffer fails here, not at exit.
    if (std::ferror(stdout)) {
      fmt::print(stderr, "piper: error writing standard output: {}\n", e.code().message());
      return 1;
    }
    print_error("", e.what());
    return kExitBadInput;
  } catch (const std::runtime_error& e) {  // file system errors (write_file_atomically, ...)
    print_error("", e.what());
    return kExitBadInput;
  } catch (const std::exception& e) {
    print_internal_error(e.what());
    return kExitInternal;
  }
  return 0;
}

// Output lost to a full disk or a closed pipe must not pass for success: stdout (std::cout shares its
// buffer, as sync_with_stdio is on) is flushed and checked once every command is done; the first
// failure is one line on stderr and exit status 1 (a command that already failed keeps its status).
int finish_standard_output(int code) {
  // fflush first: std::cout.flush() would flush stdout itself and the reason (errno) would be lost.
  errno = 0;
  const bool flush_failed = std::fflush(stdout) != 0;
  const int err = flush_failed ? errno : 0;
  std::cout.flush();
  if (!flush_failed && !std::ferror(stdout) && std::cout.good()) return code;
  if (code == 0)
    fmt::print(stderr, "piper: error writing standard output: {}\n", err != 0 ? std::strerror(err) : "write error");
  return code == 0 ? 1 : code;
}

}  // namespace

int main(int argc, char** argv) { return finish_standard_output(run_command(argc, argv)); }
