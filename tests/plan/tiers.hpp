// Short names of the memory tiers for the planner tests' tables of placements.
#pragma once

#include "plan/estimate.hpp"

namespace zinf::plan {

inline constexpr MemoryTier kDev = MemoryTier::kDevice;
inline constexpr MemoryTier kHost = MemoryTier::kHost;
inline constexpr MemoryTier kNvme = MemoryTier::kNvme;

}  // namespace zinf::plan
