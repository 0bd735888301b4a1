// The compile driver shared by the CLI, GUI and sweeps: model + directives -> verified Program.
#pragma once

#include <string>

#include "piper/core/directives.hpp"
#include "piper/core/program.hpp"

namespace piper::core {

struct CompileResult {
  GlobalDag dag;
  Program program;
};

// Builds the DAG, applies the directives (calling `hook` after each pass), lowers, verifies, and
// fills program.stats (DAG node counts, compile seconds, compiler peak RSS).
CompileResult compile(const Model& model, const DirectiveProgram& program, const AfterPassHook& hook = {});
// The same, filling `result` in place (a caller that keeps the result in a larger object, such as
// CompiledScenario, builds it there).
void compile(const Model& model, const DirectiveProgram& program, CompileResult& result,
             const AfterPassHook& hook = {});

// Peak resident set size of this process so far, in bytes (from /proc/self/status VmHWM).
std::int64_t peak_rss_bytes();

}  // namespace piper::core
