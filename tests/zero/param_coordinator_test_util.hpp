// The model the ParamCoordinator tests share: modules "m0", "m1", ... of one f32 parameter
// "m<i>.w" each, at stage 3, so that module i uses group i alone.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <vector>

#include "zero/param_coordinator.hpp"
#include "zero/partitioner.hpp"
#include "zinf/status.hpp"

namespace zinf::test {

// A finalized stage-3 partitioner over `world` ranks: `module_count` modules "m<i>", each of one
// f32 parameter "m<i>.w" of `shape`, in group i. kInternal when the partitioner made another
// number of groups.
inline Result<Partitioner> one_group_modules(int world, std::uint32_t module_count,
                                             const std::vector<std::int64_t>& shape) {
  PartitionerOptions po;
  po.world_size = world;
  po.stage = ZeroStage::kStage3;
  ZINF_ASSIGN_OR_RETURN(Partitioner part, Partitioner::create(po));
  for (std::uint32_t m = 0; m < module_count; ++m) {
    ZINF_RETURN_IF_ERROR(
        part.add({fmt::format("m{}.w", m), fmt::format("m{}", m), shape, DType::kF32}).status());
  }
  ZINF_RETURN_IF_ERROR(part.finalize());
  if (part.group_count() != module_count) {
    return Status::internal(
        fmt::format("{} groups for {} modules", part.group_count(), module_count));
  }
  return part;
}

// The coordinator's modules for one_group_modules(): module "m<g>" uses group g.
inline std::vector<CoordinatorModule> one_group_coordinator_modules(std::uint32_t module_count) {
  std::vector<CoordinatorModule> modules;
  for (std::uint32_t g = 0; g < module_count; ++g) modules.push_back({fmt::format("m{}", g), {g}});
  return modules;
}

}  // namespace zinf::test
