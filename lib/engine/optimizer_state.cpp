// OptimizerState: the factory and what the homes share (see optimizer_state.hpp).
#include "engine/optimizer_state.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "engine/param_groups.hpp"

namespace zinf {

std::vector<Piece> state_pieces(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return {Piece::kParams, Piece::kExpAvg, Piece::kExpAvgSq};
    case OptimizerKind::kAdagrad:
      return {Piece::kParams, Piece::kExpAvgSq};
    case OptimizerKind::kLion:
      return {Piece::kParams, Piece::kExpAvg};
  }
  return {Piece::kParams};
}

Status check_pinned_limit(const Config& config, std::uint64_t optimizer_pool,
                          std::uint64_t param_staging) {
  const std::uint64_t limit = config.pinned_pool_bytes;
  const std::uint64_t need = optimizer_pool + param_staging;
  if (limit == 0 || need <= limit) return Status::ok();
  return Status::resource_exhausted(fmt::format(
      "zinf.pinned_pool_bytes: {} bytes, but this rank's pinned blocks need {} (optimizer "
      "pool {} = offload_optimizer.buffer_count x one sub-group's NVMe pieces; parameter "
      "staging {}); lower zero_optimization.sub_group_size or the buffer counts, or raise the "
      "limit",
      limit, need, optimizer_pool, param_staging));
}

std::vector<OptimizerParams> context_groups(const StateContext& ctx) {
  if (ctx.groups.empty()) return {ctx.config->optimizer};
  return {ctx.groups.begin(), ctx.groups.end()};
}

std::vector<OptimizerRange> context_ranges(const StateContext& ctx) {
  if (ctx.group_ranges.empty()) return {OptimizerRange{}};
  return {ctx.group_ranges.begin(), ctx.group_ranges.end()};
}

std::vector<bool> frozen_ranges(const StateContext& ctx, std::span<const OptimizerRange> ranges) {
  std::vector<bool> out(ranges.size(), false);
  if (ctx.groups.size() < 2) return out;
  const std::size_t total = ctx.layout->partition_elements();
  auto end = [&](std::size_t r) { return r + 1 < ranges.size() ? ranges[r + 1].begin : total; };
  const std::vector<bool> untrained = frozen_runs(
      *ctx.layout, ctx.rank, ranges.size(), [&](std::size_t r) { return ranges[r].begin; },
      [&](std::size_t r) { return end(r) - ranges[r].begin; });
  // The frozen group is the last of ctx.groups (param_groups.hpp: frozen_group(), one past the
  // added groups, after the default group).
  const auto frozen = static_cast<std::uint32_t>(ctx.groups.size() - 1);
  for (std::size_t r = 0; r < ranges.size(); ++r) {
    out[r] = ranges[r].group == frozen && untrained[r];
  }
  return out;
}

Status check_group_params(std::span<const OptimizerParams> groups, std::size_t count,
                          OptimizerKind kind) {
  if (groups.size() != count) {
    return Status::invalid_argument(fmt::format(
        "optimizer state: {} parameter groups given, {} at finalize", groups.size(), count));
  }
  for (const OptimizerParams& g : groups) {
    if (g.kind != kind) {
      return Status::invalid_argument(fmt::format("optimizer state: a group of {}, the state of {}",
                                                  optimizer_name(g.kind), optimizer_name(kind)));
    }
  }
  return Status::ok();
}

Result<std::unique_ptr<OptimizerState>> open_optimizer_state(const StateContext& ctx) {
  if (ctx.config->zero.offload_optimizer.device != OffloadDevice::kNone) {
    return open_store_state(ctx);
  }
  if (!ctx.device->host_accessible()) return open_device_state(ctx);
  return open_host_state(ctx);
}

InMemoryState::InMemoryState(const StateContext& ctx)
    : ctx_(ctx),
      layout_(*ctx.layout),
      pub_(*ctx.publisher),
      groups_(context_groups(ctx)),
      partition_elements_(layout_.partition_elements()) {}

Status InMemoryState::set_group_params(std::span<const OptimizerParams> groups) {
  ZINF_RETURN_IF_ERROR(check_group_params(groups, groups_.size(), groups_[0].kind));
  std::copy(groups.begin(), groups.end(), groups_.begin());
  return Status::ok();
}

Status InMemoryState::write_buffer(bool gather_persistent, bool frozen_too) {
  ZINF_RETURN_IF_ERROR(
      pub_.write_shards([&](std::uint32_t g) -> const std::byte* { return pub_.buffer(g); },
                        gather_persistent, frozen_too));
  return gather_persistent ? Status::ok() : pub_.wait_writes();
}

}  // namespace zinf
