// --runtime and --attention-kernel (piper simulate, piper tune): the training runtime's settings over
// a cluster's, as a derived cluster spec (sim/cluster.hpp, docs/cost-model.md).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace piper::cli {

// --runtime and --attention-kernel: the training runtime's settings (docs/cost-model.md) over the
// cluster's, for the commands that cost a plan on a cluster (simulate, tune).
struct RuntimeFlags {
  std::string runtime, attention_kernel;
  void add_to(CLI::App* app);
  bool given() const { return !runtime.empty() || !attention_kernel.empty(); }
  // `cluster` (a preset, a file or an inline spec) unchanged when neither flag is given, else the
  // derived cluster spec {"cluster": ..., "runtime": ..., "attention_kernel": ...} as inline JSON, a file
  // named by its absolute path (the spec may be saved in a scenario and read from elsewhere). Checks
  // the flags against the cluster's kernel tables; throws CliError naming the flag.
  std::string applied_to(const std::string& cluster) const;
};
// A cluster as printed: a derived spec of RuntimeFlags::applied_to as its cluster and settings
// ("dgx-h100 (runtime eager, attention fa2)"), anything else as given.
std::string cluster_label(const std::string& cluster);

}  // namespace piper::cli
