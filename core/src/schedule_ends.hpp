// The V placements' ends (core/src/schedule_ends.cpp), internal to the schedule generators.
#pragma once

#include <vector>

#include "piper/core/strategy.hpp"

namespace piper::core {

// `core`: the V family's table over the regions between the ends, on rank_of_core.size() ranks
// (`rank_of_core[c]`: the pipeline rank of its rank c). Returns ctx's full table: the embedding's
// and/or head's steps (ctx.own_embedding / own_head) inserted where they become ready.
ScheduleTable insert_own_ends(const ScheduleContext& ctx, const ScheduleTable& core,
                              const std::vector<int>& rank_of_core);

}  // namespace piper::core
