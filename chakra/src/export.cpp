// Chakra execution-trace export of a Program (see piper/chakra/export.hpp for the file layout).
#include "piper/chakra/export.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "et_def.pb.h"
#include "piper/core/error.hpp"
#include "piper/core/verifier.hpp"

namespace piper::chakra {

namespace {

namespace pb = ChakraProtoMsg;

// The schema string Chakra's own converters put in GlobalMetadata (text_converter.py).
constexpr const char* kChakraSchema = "1.0.2-chakra.1.0.0";

void add_attr(pb::Node& node, const std::string& name, auto setter) {
  pb::AttributeProto* a = node.add_attr();
  a->set_name(name);
  setter(*a);
}

pb::CollectiveCommType comm_type_of(core::OpKind kind) {
  switch (kind) {
    case core::OpKind::AllReduce:
      return pb::ALL_REDUCE;
    case core::OpKind::ReduceScatter:
      return pb::REDUCE_SCATTER;
    case core::OpKind::AllGather:
      return pb::ALL_GATHER;
    case core::OpKind::AllToAll:
      return pb::ALL_TO_ALL;
    default:
      throw core::Error("chakra export: " + core::to_string(kind) + " is not a collective");
  }
}

bool is_collective(core::OpKind kind) {
  return kind == core::OpKind::AllReduce || kind == core::OpKind::ReduceScatter || kind == core::OpKind::AllGather ||
         kind == core::OpKind::AllToAll;
}

// duration_micros: whole microseconds (Chakra's unit), from the caller's seconds.
std::uint64_t micros(double seconds, int device, const core::Op& op) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds > 1e9)
    throw core::Error(fmt::format("chakra export: device {}: op '{}' has compute time {} s, not a duration", device,
                                  op.label.empty() ? core::to_string(op.kind) : op.label, seconds));
  return static_cast<std::uint64_t>(std::llround(seconds * 1e6));
}

// ASTRA-sim's feeder reads comm_src/comm_dst/comm_tag as int32 attributes.
std::int32_t as_int32(std::int64_t v, const char* what) {
  if (v < 0 || v > std::numeric_limits<std::int32_t>::max())
    throw core::Error(fmt::format("chakra export: {} {} does not fit Chakra's int32 attribute", what, v));
  return static_cast<std::int32_t>(v);
}

// Appends `m` length-delimited: its size as a varint32, then its bytes (Chakra's encodeMessage).
void append_delimited(const google::protobuf::MessageLite& m, std::string& out) {
  google::protobuf::io::StringOutputStream raw(&out);
  google::protobuf::io::CodedOutputStream coded(&raw);
  coded.WriteVarint32(static_cast<std::uint32_t>(m.ByteSizeLong()));
  m.SerializeWithCachedSizes(&coded);
}

}  // namespace

std::string trace_file_name(const std::string& prefix, int device) { return fmt::format("{}.{}.et", prefix, device); }
std::string comm_groups_file_name(const std::string& prefix) { return prefix + ".comm_groups.json"; }

CommGroups comm_groups(const core::Program& program) {
  std::vector<bool> used(program.families.size(), false);
  for (const core::Plan& plan : program.plans)
    for (const core::Stream& stream : plan.streams)
      for (const core::Op& op : stream.ops)
        if (is_collective(op.kind)) {
          if (op.family < 0 || static_cast<std::size_t>(op.family) >= program.families.size())
            throw core::Error(fmt::format("chakra export: collective '{}' has no communicator family", op.label));
          used[static_cast<std::size_t>(op.family)] = true;
        }
  CommGroups out;
  out.id_of.resize(program.families.size());
  for (std::size_t f = 0; f < used.size(); ++f) {
    if (!used[f]) continue;
    out.id_of[f].assign(static_cast<std::size_t>(program.num_devices), 0);
    for (std::vector<int>& group : program.groups(static_cast<int>(f))) {
      out.members.push_back(std::move(group));
      const int id = static_cast<int>(out.members.size());
      if (id > kMaxCommGroups)
        throw core::Error(
            fmt::format("chakra export: the plan's collectives use more than {} communicator groups, the most "
                        "ASTRA-sim numbers (it counts a group's collectives from id x 1,000,000 in an int)",
                        kMaxCommGroups));
      for (int d : out.members.back()) out.id_of[f].at(static_cast<std::size_t>(d)) = id;
    }
  }
  return out;
}

std::string CommGroups::pg_name(int family, int device) const {
  const int id = family >= 0 && static_cast<std::size_t>(family) < id_of.size() &&
                         static_cast<std::size_t>(device) < id_of[static_cast<std::size_t>(family)].size()
                     ? id_of[static_cast<std::size_t>(family)][static_cast<std::size_t>(device)]
                     : 0;
  if (id <= 0)
    throw core::Error(fmt::format("chakra export: device {} is in no group of communicator family {}", device, family));
  return std::to_string(id);
}

std::string CommGroups::to_json() const {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (std::size_t i = 0; i < members.size(); ++i) j[std::to_string(i + 1)] = members[i];
  return j.dump() + "\n";
}

std::string encode_device_trace(const core::Program& program, int device) {
  return encode_device_trace(program, device, comm_groups(program));
}

namespace {

// The device's ops in issue order, numbered by it, with each op's dependencies: its stream predecessor
// and its cross-stream waits.
struct IssueOrder {
  std::map<core::OpRef, std::vector<core::OpRef>> deps;
  std::map<core::OpRef, std::uint64_t> id_of;
  std::vector<core::OpRef> order;
};

IssueOrder issue_order(const core::Plan& plan, int device) {
  IssueOrder out;
  auto& deps = out.deps;
  std::map<core::OpRef, std::vector<core::OpRef>> dependents;
  std::map<core::OpRef, int> missing;
  // Ready ops by (collective?, stream, index): a deterministic topological order in which, among ops
  // ready together, compute and point-to-point transfers come before collectives. ASTRA-sim issues
  // ready nodes in id order and runs one communication at a time per NPU, so this lets a pipeline
  // transfer take the communication slot ahead of a queue of data-parallel collectives.
  auto collective_at = [&](const core::OpRef& r) {
    return is_collective(plan.streams[static_cast<std::size_t>(r.stream)].ops[static_cast<std::size_t>(r.index)].kind);
  };
  auto before = [&](const core::OpRef& a, const core::OpRef& b) {
    return std::make_tuple(collective_at(a), a.stream, a.index) < std::make_tuple(collective_at(b), b.stream, b.index);
  };
  std::set<core::OpRef, decltype(before)> ready(before);
  for (int s = 0; s < static_cast<int>(plan.streams.size()); ++s) {
    const auto& ops = plan.streams[static_cast<std::size_t>(s)].ops;
    for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
      const core::OpRef me{s, i};
      std::vector<core::OpRef>& d = deps[me];
      if (i > 0) d.push_back({s, i - 1});
      for (const core::OpRef& w : ops[static_cast<std::size_t>(i)].waits) d.push_back(w);
      for (const core::OpRef& p : d) dependents[p].push_back(me);
      missing[me] = static_cast<int>(d.size());
      if (d.empty()) ready.insert(me);
    }
  }
  auto& id_of = out.id_of;
  auto& order = out.order;
  while (!ready.empty()) {
    const core::OpRef op = *ready.begin();
    ready.erase(ready.begin());
    id_of[op] = order.size();
    order.push_back(op);
    for (const core::OpRef& next : dependents[op])
      if (--missing[next] == 0) ready.insert(next);
  }
  if (order.size() != deps.size())
    throw core::Error(fmt::format("chakra export: device {}: the plan's stream order and waits form a cycle", device));
  return out;
}

// The trace's GlobalMetadata record.
void append_metadata(const core::Program& program, int device, std::string& out) {
  pb::GlobalMetadata meta;
  meta.set_version("0.0.4");
  auto meta_attr = [&](const std::string& name) {
    pb::AttributeProto* a = meta.add_attr();
    a->set_name(name);
    return a;
  };
  meta_attr("schema")->set_string_val(kChakraSchema);
  meta_attr("producer")->set_string_val("piper export-chakra");
  meta_attr("model")->set_string_val(program.model_name);
  meta_attr("device")->set_int64_val(device);
  meta_attr("devices")->set_int64_val(program.num_devices);
  append_delimited(meta, out);
}

// The node's type and its kind's attributes (compute cost, transfer ends, collective group).
void set_kind_attrs(pb::Node& node, const core::Op& op, const core::Program& program, int device,
                    const CommGroups& groups, const ExportOptions& options) {
  switch (op.kind) {
    case core::OpKind::Compute:
    case core::OpKind::Update:
      node.set_type(pb::COMP_NODE);
      add_attr(node, "num_ops", [&](auto& a) { a.set_int64_val(static_cast<std::int64_t>(op.flops)); });
      add_attr(node, "tensor_size", [&](auto& a) { a.set_uint64_val(static_cast<std::uint64_t>(op.memory_bytes)); });
      if (options.compute_seconds) node.set_duration_micros(micros(options.compute_seconds(device, op), device, op));
      break;
    case core::OpKind::Send:
    case core::OpKind::Recv: {
      const bool send = op.kind == core::OpKind::Send;
      const int peer = program.peer_of(op, device);
      node.set_type(send ? pb::COMM_SEND_NODE : pb::COMM_RECV_NODE);
      add_attr(node, "comm_src", [&](auto& a) { a.set_int32_val(as_int32(send ? device : peer, "device")); });
      add_attr(node, "comm_dst", [&](auto& a) { a.set_int32_val(as_int32(send ? peer : device, "device")); });
      add_attr(node, "comm_size", [&](auto& a) { a.set_int64_val(op.bytes); });
      // Both sides carry the transfer's pairing id (Op::pair: who meets whom, core/readiness.hpp); with
      // comm_src and comm_dst it names the transfer uniquely.
      add_attr(node, "comm_tag", [&](auto& a) { a.set_int32_val(as_int32(op.pair, "pairing id")); });
      break;
    }
    default: {
      node.set_type(pb::COMM_COLL_NODE);
      add_attr(node, "comm_type", [&](auto& a) { a.set_int64_val(comm_type_of(op.kind)); });
      // ASTRA-sim's sizes: an all-gather's comm_size is what each rank contributes (its ring sends
      // comm_size per step and ends with comm_size x n), the others' the full buffer, as Piper's bytes.
      const std::vector<int> group = program.group_of(op.family, device);
      const std::int64_t n = std::max<std::int64_t>(1, static_cast<std::int64_t>(group.size()));
      const std::int64_t comm_size = op.kind == core::OpKind::AllGather ? (op.bytes + n - 1) / n : op.bytes;
      add_attr(node, "comm_size", [&](auto& a) { a.set_int64_val(comm_size); });
      // One network dimension: ASTRA-sim spreads the collective over the dimensions marked true.
      add_attr(node, "involved_dim", [](auto& a) { a.mutable_bool_list()->add_values(true); });
      // ASTRA-sim's communicator group (the --comm-group-configuration file written beside the traces).
      add_attr(node, "pg_name", [&](auto& a) { a.set_string_val(groups.pg_name(op.family, device)); });
      add_attr(node, "piper_group", [&](auto& a) {
        for (int r : group) a.mutable_int64_list()->add_values(r);
      });
      add_attr(node, "piper_bytes", [&](auto& a) { a.set_int64_val(op.bytes); });
      // ASTRA-sim meets a group's collectives by their order on pg_name (the verifier checks every
      // member issues the family's pairing ids in one order); the id itself, for readers.
      add_attr(node, "piper_pair", [&](auto& a) { a.set_int64_val(op.pair); });
      break;
    }
  }
}

}  // namespace

std::string encode_device_trace(const core::Program& program, int device, const CommGroups& groups,
                                const ExportOptions& options) {
  const core::Plan& plan = program.plan_for(device);
  const IssueOrder issue = issue_order(plan, device);
  std::string out;
  append_metadata(program, device, out);

  pb::Node node;
  for (const core::OpRef& ref : issue.order) {
    const core::Stream& stream = plan.streams[static_cast<std::size_t>(ref.stream)];
    const core::Op& op = stream.ops[static_cast<std::size_t>(ref.index)];
    node.Clear();
    node.set_id(issue.id_of.at(ref));
    node.set_name(op.label.empty() ? core::to_string(op.kind) : op.label);
    for (const core::OpRef& d : issue.deps.at(ref)) node.add_data_deps(issue.id_of.at(d));
    add_attr(node, "is_cpu_op", [](auto& a) { a.set_bool_val(false); });
    set_kind_attrs(node, op, program, device, groups, options);
    // Where the node came from, so a reader can map it back to the plan.
    add_attr(node, "piper_stream", [&](auto& a) { a.set_string_val(stream.name); });
    add_attr(node, "piper_index", [&](auto& a) { a.set_int64_val(ref.index); });
    add_attr(node, "piper_kind", [&](auto& a) { a.set_string_val(core::to_string(op.kind)); });
    if (op.pass != core::Pass::None)
      add_attr(node, "piper_pass", [&](auto& a) { a.set_string_val(core::to_string(op.pass)); });
    append_delimited(node, out);
  }
  return out;
}

std::vector<std::string> export_traces(const core::Program& program, const std::string& out_dir,
                                       const std::string& prefix) {
  ExportOptions options;
  options.prefix = prefix;
  return export_traces(program, out_dir, options);
}

std::vector<std::string> export_traces(const core::Program& program, const std::string& out_dir,
                                       const ExportOptions& options) {
  const std::string& prefix = options.prefix;
  // The prefix names files inside out_dir: "" would hide them (".0.et"), "../x" or "a/b" leave the folder.
  const bool control = std::any_of(prefix.begin(), prefix.end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; });
  if (prefix.empty() || prefix.find('/') != std::string::npos || prefix == "." || prefix == ".." || control)
    throw core::Error("prefix '" + prefix +
                      "': must be a plain file name (not empty, no '/' or control characters): the traces are written "
                      "into the output folder");
  core::verify_or_throw(program);
  // Every file is encoded before any is written, so a bad plan leaves nothing behind.
  const CommGroups groups = comm_groups(program);
  std::vector<std::string> bytes;
  for (int d = 0; d < program.num_devices; ++d) bytes.push_back(encode_device_trace(program, d, groups, options));
  namespace fs = std::filesystem;
  if (out_dir.empty()) throw core::Error("cannot write Chakra traces: the output folder name is empty");
  // Traces of devices past this plan's, left by an export of a larger plan with the same prefix: a
  // replay of the folder (ASTRA-sim takes the prefix and its own NPU count) would mix the two plans.
  // Refused before anything is written; the folder is the user's to clear.
  {
    std::error_code list_ec;
    std::vector<int> stale;
    if (fs::is_directory(out_dir, list_ec))
      for (const auto& entry : fs::directory_iterator(out_dir, list_ec)) {
        const std::string name = entry.path().filename().string();
        const std::string head = prefix + ".", tail = ".et";
        if (name.size() <= head.size() + tail.size() || name.rfind(head, 0) != 0 ||
            name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
          continue;
        const std::string number = name.substr(head.size(), name.size() - head.size() - tail.size());
        if (number.size() > 9 || number.find_first_not_of("0123456789") != std::string::npos) continue;
        if (std::stoi(number) >= program.num_devices) stale.push_back(std::stoi(number));
      }
    if (!stale.empty()) {
      std::sort(stale.begin(), stale.end());
      throw core::Error(fmt::format(
          "{}: holds {}{} of another export (devices past this plan's {}): a replay would mix the two plans; remove "
          "{} or choose another folder",
          out_dir, trace_file_name(prefix, stale.front()),
          stale.size() > 1 ? fmt::format(" .. {} ({} files)", trace_file_name(prefix, stale.back()), stale.size()) : "",
          program.num_devices, stale.size() > 1 ? "them" : "it"));
    }
  }
  // What this call creates (the outermost missing folder, new files) is removed again if a write
  // fails (a full disk), so a failed export leaves nothing behind.
  std::error_code ec;
  fs::path created_root;
  for (fs::path p = fs::absolute(out_dir, ec); !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    created_root = p;
    if (p == p.parent_path()) break;
  }
  fs::create_directories(out_dir, ec);
  if (ec) throw core::Error(out_dir + ": cannot create folder: " + ec.message());
  std::vector<std::string> paths, created_files;
  try {
    for (int d = 0; d < program.num_devices; ++d) {
      const std::string path = (fs::path(out_dir) / trace_file_name(prefix, d)).string();
      const bool existed = fs::exists(path, ec);
      core::write_file_atomically(path, bytes[static_cast<std::size_t>(d)]);
      if (!existed) created_files.push_back(path);
      paths.push_back(path);
    }
    const std::string groups_path = (fs::path(out_dir) / comm_groups_file_name(prefix)).string();
    const bool existed = fs::exists(groups_path, ec);
    core::write_file_atomically(groups_path, groups.to_json());
    if (!existed) created_files.push_back(groups_path);
  } catch (...) {
    std::error_code ignored;
    for (const auto& f : created_files) fs::remove(f, ignored);
    if (!created_root.empty()) fs::remove_all(created_root, ignored);
    throw;
  }
  return paths;
}

}  // namespace piper::chakra
