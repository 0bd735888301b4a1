// Fuzzes cluster spec files as `simulate --cluster FILE` reads them: text -> Cluster -> grown to a
// program's device count -> the device-to-node map the engines use.
#include "fuzz_common.hpp"
#include "piper/sim/cluster.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  piper::fuzz::small_limits();
  piper::fuzz::rejects_cleanly([&] {
    const piper::sim::Cluster c = piper::sim::cluster_from_text(piper::fuzz::text_of(data, size), "fuzz.json");
    const piper::sim::Cluster grown = piper::sim::with_devices(c, 16);
    for (int d = 0; d < grown.num_devices(); ++d) (void)grown.node_of(d);
    (void)grown.to_json();
  });
  return 0;
}
