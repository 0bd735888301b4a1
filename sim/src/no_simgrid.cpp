// Stub for builds without SimGrid: the "simgrid" engine name exists but says why it cannot run.
#include "piper/core/error.hpp"
#include "piper/sim/engine.hpp"

namespace piper::sim {

std::unique_ptr<Engine> make_simgrid_engine() {
  throw core::Error("engine 'simgrid' is not available: piper was built without SimGrid (use --engine analytic)");
}

}  // namespace piper::sim
