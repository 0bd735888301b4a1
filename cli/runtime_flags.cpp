#include "cli/runtime_flags.hpp"

#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/common.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/kernel_table.hpp"

namespace piper::cli {

void RuntimeFlags::add_to(CLI::App* app) {
  app->add_option("--runtime", runtime,
                  "training runtime whose kernels are costed, over the cluster's \"runtime\": fused (torch.compile, "
                  "Megatron-LM), eager (PyTorch eager), eager-fused-loss, eager-unfused-norm, piper-cuda "
                  "(docs/cost-model.md)");
  app->add_option("--attention-kernel", attention_kernel,
                  "attention implementation costed, over the cluster's \"attention_kernel\": fa2 (FlashAttention-2), "
                  "fa1 (FlashAttention 1.x); default: the kernel tables' own (cuDNN on Hopper)");
}

std::string RuntimeFlags::applied_to(const std::string& cluster) const {
  if (!given()) return cluster;
  if (!runtime.empty()) try {
      sim::runtime_profile_from_string(runtime);
    } catch (const sim::ClusterError& e) {
      throw CliError("", fmt::format("--runtime '{}': {}", runtime, e.what()));
    }
  const std::string text = sim::derived_cluster_spec(cluster, runtime, attention_kernel);
  try {
    sim::load_cluster(text);
  } catch (const sim::ClusterError& e) {
    const std::string m = e.what();
    // The flag's own mistake named as the flag; the cluster's as it reads.
    const std::string field = "--cluster: field 'attention_kernel': ";
    if (m.rfind(field, 0) == 0)
      throw CliError("", fmt::format("--attention-kernel '{}': {}", attention_kernel, m.substr(field.size())));
    const std::string base = "--cluster: field 'cluster': ";
    throw CliError("", m.rfind(base, 0) == 0 ? "--cluster " + m.substr(base.size()) : m);
  }
  return text;
}

std::string cluster_label(const std::string& cluster) {
  const auto parts = sim::derived_cluster_parts(cluster);
  if (!parts) return cluster;
  std::vector<std::string> settings;
  if (!parts->runtime.empty()) settings.push_back("runtime " + parts->runtime);
  if (!parts->attention_kernel.empty()) settings.push_back("attention " + parts->attention_kernel);
  return settings.empty() ? parts->cluster : fmt::format("{} ({})", parts->cluster, fmt::join(settings, ", "));
}

}  // namespace piper::cli
