// Lowering: the rewritten global DAG becomes the Program (core/src/lower.cpp). Kept apart from
// program.hpp so that the Program contract compiles without the DAG and Boost.
#pragma once

#include "piper/core/dag.hpp"
#include "piper/core/program.hpp"

namespace piper::core {

// Stream-ordering policy (see ARCHITECTURE.md): each device issues its ops in one deterministic
// topological order of the DAG (ties broken by node creation order, which follows microbatch and
// order-directive position); each op goes to its node's logical stream in that order; an op waits
// for every predecessor op of this device that sits on another stream. Fills Op::microbatch from
// the DAG's splits.
Program lower(const GlobalDag& dag);

}  // namespace piper::core
