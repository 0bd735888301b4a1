// The sm-partition pass: records the SM split for lowering (no node changes).
#include "pass.hpp"

namespace piper::core::passes {

void run_sm_partition(PassRun& run, const SmPartitionDirective& d, int) { run.cx.dag.sm_partition = d.partition; }

}  // namespace piper::core::passes
