// The small types shared by the global DAG (dag.hpp, Boost.Graph) and the Program (program.hpp, the
// contract the simulator, runtime, GUI and exporters read). This header and everything it includes
// are free of Boost, so program.hpp compiles without the DAG (checked by the CTest test
// program_hpp_has_no_boost).
#pragma once

#include <cstdint>
#include <string>

#include "piper/core/model.hpp"

namespace piper::core {

enum class Pass { None, F, B, BI, BW };
std::string to_string(Pass p);
Pass pass_from_string(const std::string& s);  // "F", "B", "BI", "BW"; throws std::invalid_argument

// Activation recomputation of a segment (Korthikanti et al. 2022): None keeps every activation for
// backward; Selective drops the attention core (QK^T, softmax, dropout, softmax·V) and recomputes it
// in B; Full keeps only the segment input and reruns the segment's forward at the start of its B/BI;
// Op is TorchTitan's op-level selective checkpointing: a block keeps its input and the outputs of
// attention and of every other matmul (the 1st, 3rd, ... of the block) and recomputes the rest.
enum class Recompute { None, Selective, Full, Op };
std::string to_string(Recompute r);                     // "none", "selective", "full", "op"
Recompute recompute_from_string(const std::string& s);  // throws std::invalid_argument

// SM partitioning (Piper's sm_partition directive): a static split of every GPU's SMs between its
// communication streams (every stream but "compute") and its compute stream, as DeepSeek-V3 gives
// communication 20 of 132 SMs. `stream` names the partitioned stream class; "comm" is the only one.
struct SmPartition {
  std::string stream = "comm";
  int sms = 0;  // SMs the communication streams run on; compute gets the rest
  friend bool operator==(const SmPartition&, const SmPartition&) = default;
};

// Device sets are interned: nodes refer to them by index, so a DP-1024 region costs one int per node.
// Order matters: the j-th device of a sender set talks to the j-th device of the receiver set.
using DeviceSetId = std::int32_t;
constexpr DeviceSetId kNoDevices = -1;

// What a communicator family is for. In plan JSON and dumps it is written as the string in the
// comment (to_string / family_purpose_from_string).
enum class FamilyPurpose {
  Dp,             // "dp": data-parallel gradient reduction of a replicated (or TP) segment
  DpEp,           // "dp-ep": reduction over the strided groups holding the same expert shard
  DpShard,        // "dp-shard": HSDP, within one shard group
  DpReplicate,    // "dp-replicate": HSDP, across the shard groups
  Ep,             // "ep": expert-parallel all-to-all
  Tp,             // "tp": the tensor-parallel groups of a segment (ProgramSegment::tp_family)
  TiedEmbedding,  // "tied-embedding": pairs of devices summing the tied embedding/head gradients
  Cp,             // "cp": the context-parallel groups of a segment (ProgramSegment::cp_family)
  GradNorm,       // "grad-norm": every device, summing its owned gradients' squares (the clip_grad directive)
};
std::string to_string(FamilyPurpose p);
FamilyPurpose family_purpose_from_string(const std::string& s);  // throws std::invalid_argument naming the choices

// Communicator family: the device set is partitioned into groups (e.g. EP groups of consecutive
// devices, or the strided data-parallel groups of experts); one collective node is issued on every group.
struct CommFamily {
  DeviceSetId devices = kNoDevices;
  int group_size = 0;  // devices per group; groups = |devices| / group_size
  int stride = 1;      // 1: consecutive chunks; k: group j = {devices[j + i*k]} (strided)
  FamilyPurpose purpose = FamilyPurpose::Dp;
  friend bool operator==(const CommFamily&, const CommFamily&) = default;
};

}  // namespace piper::core
