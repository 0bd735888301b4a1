// Chakra execution-trace export: one file per device, a GlobalMetadata message followed by one Node
// per op of the device's plan, each length-delimited (varint size, then the message), as Chakra's
// protolib encodeMessage writes them and ASTRA-sim's feeder reads them; and the communicator-group
// file ASTRA-sim takes with --comm-group-configuration.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "piper/core/program.hpp"

namespace piper::chakra {

// How an export is written.
struct ExportOptions {
  std::string prefix = "piper";  // files <prefix>.<device>.et and <prefix>.comm_groups.json
  // COMPUTE and UPD ops: the op's time in seconds on `device` (the CLI passes the simulator's cost
  // model), written as duration_micros rounded to whole microseconds, the unit Chakra's field has.
  // Empty: duration_micros stays 0 and a replay costs num_ops and tensor_size with its own model.
  std::function<double(int device, const core::Op& op)> compute_seconds;
};

// ASTRA-sim's communicator groups of a program: one per group of every family that a collective op
// uses, numbered 1, 2, ... in family order, then group order (ASTRA-sim reserves "0" and "" for "all
// NPUs"). Groups of different families stay distinct even with the same members: ASTRA-sim matches a
// group's collectives by their order, which only a family fixes across its members.
struct CommGroups {
  std::vector<std::vector<int>> members;  // members[id - 1]: the device ids of group `id`
  std::vector<std::vector<int>> id_of;    // id_of[family][device]: the group holding device, 0 for none
  // The pg_name of a collective op of `family` on `device`; throws core::Error when it has no group.
  std::string pg_name(int family, int device) const;
  // The --comm-group-configuration file: {"1": [0, 1], "2": [2, 3], ...}.
  std::string to_json() const;
};
// Throws core::Error past ASTRA-sim's limit (it numbers a group's collective streams from
// id x 1,000,000 in an int: at most 2,147 groups).
CommGroups comm_groups(const core::Program& program);
inline constexpr int kMaxCommGroups = 2147;

// The bytes of device `device`'s trace. Node ids are 0..ops-1 in a topological order of the device's
// ops (a dependency always has a smaller id; among ops ready together, compute and transfers before
// collectives, then by stream and index). Every dependency is a data_dep (see docs/simulator.md).
// Collectives carry pg_name, their group's number in `groups` (comm_groups(program)).
std::string encode_device_trace(const core::Program& program, int device, const CommGroups& groups,
                                const ExportOptions& options = {});
std::string encode_device_trace(const core::Program& program, int device);

// Writes <out_dir>/<prefix>.<device>.et for every device and <out_dir>/<prefix>.comm_groups.json
// (each file atomically; the folder is created if missing) and returns the traces' paths. The
// program must verify (core::verify_or_throw). A failed write removes what the call created (new
// files, folders), so nothing half-written remains.
std::vector<std::string> export_traces(const core::Program& program, const std::string& out_dir,
                                       const ExportOptions& options = {});
std::vector<std::string> export_traces(const core::Program& program, const std::string& out_dir,
                                       const std::string& prefix);

// The Chakra file name of a device: "<prefix>.<device>.et" (the converter's naming).
std::string trace_file_name(const std::string& prefix, int device);
// The communicator-group file name: "<prefix>.comm_groups.json".
std::string comm_groups_file_name(const std::string& prefix);

}  // namespace piper::chakra
