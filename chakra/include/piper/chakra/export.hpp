// Chakra execution-trace export: one file per device, a GlobalMetadata message followed by one Node
// per op of the device's plan, each length-delimited (varint size, then the message), as Chakra's
// protolib encodeMessage writes them and ASTRA-sim's feeder reads them.
#pragma once

#include <string>
#include <vector>

#include "piper/core/program.hpp"

namespace piper::chakra {

// The bytes of device `device`'s trace. Node ids are 0..ops-1 in a topological order of the device's
// ops (a dependency always has a smaller id). Every dependency is a data_dep (see docs/simulator.md).
std::string encode_device_trace(const core::Program& program, int device);

// Writes <out_dir>/<prefix>.<device>.et for every device (each file atomically; the folder is
// created if missing) and returns their paths. The program must verify (core::verify_or_throw). A
// failed write removes what the call created (new files, folders), so nothing half-written remains.
std::vector<std::string> export_traces(const core::Program& program, const std::string& out_dir,
                                       const std::string& prefix = "piper");

// The Chakra file name of a device: "<prefix>.<device>.et" (the converter's naming).
std::string trace_file_name(const std::string& prefix, int device);

}  // namespace piper::chakra
