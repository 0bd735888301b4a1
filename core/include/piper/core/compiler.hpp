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
// The same, filling `result` in place: with Boost 1.74 a GlobalDag cannot be moved (adjacency_list has
// no move constructor, so a "move" copies the whole graph), and callers that keep the result in a
// larger object (CompiledScenario) use this to avoid that copy.
void compile(const Model& model, const DirectiveProgram& program, CompileResult& result,
             const AfterPassHook& hook = {});

// Peak resident set size of this process so far, in bytes (from /proc/self/status VmHWM).
std::int64_t peak_rss_bytes();

}  // namespace piper::core
