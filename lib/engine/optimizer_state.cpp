// OptimizerState: the factory and what the homes share (see optimizer_state.hpp).
#include "engine/optimizer_state.hpp"

#include <fmt/format.h>

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

Result<std::unique_ptr<OptimizerState>> open_optimizer_state(const StateContext& ctx) {
  if (ctx.config->zero.offload_optimizer.device != OffloadDevice::kNone) {
    return open_store_state(ctx);
  }
  if (!ctx.device->host_accessible()) return open_device_state(ctx);
  return open_host_state(ctx);
}

}  // namespace zinf
