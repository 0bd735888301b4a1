// `piper limits`: the resource limits in force (defaults, environment and --limit overrides).
#include <fmt/format.h>

#include "cli/common.hpp"
#include "piper/core/limits.hpp"

namespace piper::cli {

Command add_limits_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("limits", "list the resource limits in force and how to override them");
  return {cmd, [] {
            for (const auto& info : core::limit_table()) {
              const std::int64_t value = core::limit_value(info.limit);
              fmt::print("{:<24}{:>14}{}  {}\n", info.name, value, value == info.default_value ? " " : "*", info.what);
            }
            fmt::print(
                "(* overridden; change one with --limit NAME=N or PIPER_LIMIT_NAME=N, e.g. PIPER_LIMIT_DAG_NODES)\n");
            return 0;
          }};
}

}  // namespace piper::cli
