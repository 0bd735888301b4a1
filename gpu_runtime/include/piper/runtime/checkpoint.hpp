// Checkpoints in the canonical full layout (per model layer: parameters and AdamW moments, whatever
// PP/DP/EP/ZeRO layout wrote them), so that a run can resume under another strategy of the same model.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "piper/core/program.hpp"
#include "piper/runtime/host_model.hpp"

namespace piper::runtime {

// The three canonical tensors a checkpoint holds per layer.
enum class StateKind : std::int32_t { Params = 0, AdamM = 1, AdamV = 2 };

// One contiguous run of a layer's canonical vector of one kind, as one device holds it.
struct StateRecord {
  int layer = 0;
  StateKind kind = StateKind::Params;
  std::int64_t offset = 0;
  std::vector<float> values;
};

// What a checkpoint says about the run that wrote it (the JSON header line of the file).
struct CheckpointInfo {
  std::string model_name;
  std::string fingerprint;         // model_fingerprint(): spec only, never the layout
  int step = 0;                    // optimizer steps done (AdamW bias correction continues from it)
  std::int64_t data_position = 0;  // sequences of the token stream consumed (step * sequences_per_step)
  std::int64_t sequences_per_step = 0, seq_len = 0;
  std::string saved_layout;  // informational: how the saving run was laid out
  // Informational: the optimizer settings of the saving run (AdamW and the learning-rate schedule),
  // as JSON text; a resumed run may change them (its own flags apply from its first step).
  std::string optimizer;
  // Loss scaling's state after `step` (a run with loss scaling saved it; header "loss_scale"):
  // a resumed dynamic run continues from it, as an uninterrupted one would.
  std::optional<host::LossScaleState> loss_scale;
};

// The full state of every layer: kind -> values, NaN-free when complete.
struct CanonicalState {
  std::map<int, std::array<std::vector<float>, 3>> layers;
};

// This device's state as records of the canonical layout (ZeRO >= 1: the moments of its chunk only;
// ZeRO-3: the parameters of its chunk only). Replicas write identical values for shared elements.
std::vector<StateRecord> state_records(host::HostModel& model);
std::string serialize_state_records(const std::vector<StateRecord>& records);
std::vector<StateRecord> parse_state_records(const std::string& bytes);

// Puts records together into every layer of `model`; throws std::runtime_error naming the first
// layer and element no record covered (a layout that forgot part of the state).
CanonicalState assemble_state(const core::Model& model, const std::vector<StateRecord>& records);

// Writes header + state durably and atomically: a temporary file in the same folder, fsync, rename,
// fsync of the folder. A crash at any point leaves the previous checkpoint at `path` intact. First,
// temporary files of this checkpoint left by dead writers (`path.tmp.<pid>`, pid not alive) are
// removed. An existing device or FIFO at `path` is written into, never replaced.
// Format version 3: the JSON header carries `header_crc32` (CRC-32 of the header's JSON without that
// field) and per layer `crc32`: [parameters, first moment, second moment].
// Test hook: with PIPER_TEST_CRASH_BEFORE_RENAME=<step> in the environment the process exits
// (status 86) after the temporary file of that step is written and synced, before the rename.
void write_checkpoint(const std::string& path, const CheckpointInfo& info, const CanonicalState& state);

// Parses a checkpoint file's bytes; `path` names it in the one-line errors (std::invalid_argument).
// Refuses (version 3) a header or tensor whose CRC-32 differs, and (any version) a negative step, a
// data position other than step x sequences per step, and non-finite values or negative second
// moments. Version 2 (no checksums, earlier pipers) is still read.
struct Checkpoint {
  CheckpointInfo info;
  CanonicalState state;
};
Checkpoint parse_checkpoint(const std::string& path, const std::string& bytes);
// Reads a checkpoint file, bounded by Limit::CheckpointBytes and by checkpoint_bytes_bound(program)
// (sized before a byte is read); throws std::invalid_argument.
std::string read_checkpoint_bytes(const std::string& path, const core::Program& program);
// The most bytes a checkpoint of `program`'s model can take (parameters and Adam state, and its header).
std::int64_t checkpoint_bytes_bound(const core::Program& program);

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320: the checksum of zlib, gzip and PNG;
// crc32("123456789") = 0xCBF43926), continuing from `crc` (0 to start).
std::uint32_t crc32(const void* data, std::size_t size, std::uint32_t crc = 0);

// Held for a whole run that saves: an exclusive flock on `path.lock`, so that a second run saving to
// the same checkpoint is refused (std::invalid_argument, one line) instead of racing the first. The
// lock file stays after the run. Nothing is locked for an existing device or FIFO.
class SaveLock {
 public:
  explicit SaveLock(const std::string& checkpoint_path);
  ~SaveLock();
  SaveLock(const SaveLock&) = delete;
  SaveLock& operator=(const SaveLock&) = delete;

 private:
  int fd_ = -1;
};

// Checks that `ckpt` fits `program` (same model, sequence length and global batch); throws
// std::invalid_argument with one line naming `path` and what differs.
void check_compatible(const std::string& path, const Checkpoint& ckpt, const core::Program& program);

// Overwrites this device's parameters, master copies and moments from the canonical state (its
// shards and chunks only); gradients are zeroed. ZeRO-3 parameters stay poisoned outside gathers.
void load_state(host::HostModel& model, const CanonicalState& state);

// A short description of a Program's layout for the header ("4 devices: PP2 x DP2, EP2, ZeRO-2").
std::string layout_summary(const core::Program& program);

}  // namespace piper::runtime
