// The engine's swap directories and swap space: see engine_swap.hpp.
#include "engine/engine_swap.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "base/arith.hpp"
#include "engine/nvme_dir.hpp"
#include "engine/optimizer_state.hpp"
#include "tier/state_store.hpp"

namespace zinf {

Result<std::vector<std::string>> find_nvme_dirs(const Config& config, const Env& env, int rank) {
  const ZeroConfig& z = config.zero;
  const bool opt_nvme = z.offload_optimizer.device == OffloadDevice::kNvme;
  const bool param_nvme = z.offload_param.device == OffloadDevice::kNvme;
  std::vector<std::string> out;
  if (!opt_nvme && !param_nvme) return out;
  std::string key = opt_nvme ? "zero_optimization.offload_optimizer.nvme_path"
                             : "zero_optimization.offload_param.nvme_path";
  if (!env.nvme_paths.empty()) {
    key = "Env::nvme_paths";
    out = env.nvme_paths;
  } else {
    std::set<std::string> dirs;
    if (opt_nvme) {
      if (z.offload_optimizer.nvme_path.empty()) {
        return Status::invalid_argument(
            fmt::format("{}: empty, and the optimizer state is offloaded to nvme", key));
      }
      dirs.insert(z.offload_optimizer.nvme_path);
    }
    if (param_nvme) {
      const std::string& p = z.offload_param.nvme_path.empty() ? z.offload_optimizer.nvme_path
                                                               : z.offload_param.nvme_path;
      if (p.empty()) {
        return Status::invalid_argument(
            "zero_optimization.offload_param.nvme_path: empty, and the parameters are "
            "offloaded to nvme");
      }
      dirs.insert(p);
    }
    out.assign(dirs.begin(), dirs.end());
  }
  for (const std::string& dir : out) {
    ZINF_RETURN_IF_ERROR(prepare_nvme_directory(key, dir, rank));
  }
  // The config's two paths may spell one directory two ways ("/nvme" and "/nvme/"): one swap
  // space there (compared by device and inode, so only once the directories exist). A repeat in
  // Env::nvme_paths stays an error of SwapSpace::open.
  if (env.nvme_paths.empty()) out = unique_directories(out);
  return out;
}

Result<EngineSwap> open_engine_swap(const Config& config, const Env& env,
                                    const ParameterLayout& layout, int rank,
                                    const std::vector<std::string>& dirs) {
  const ZeroConfig& z = config.zero;
  const bool opt_nvme = z.offload_optimizer.device == OffloadDevice::kNvme;
  const bool param_nvme = z.stage == 3 && z.offload_param.device == OffloadDevice::kNvme;
  EngineSwap out;
  if (!opt_nvme && !param_nvme) return out;
  std::uint64_t capacity = 0;
  std::uint32_t extents = 0;
  if (opt_nvme) {
    ZINF_ASSIGN_OR_RETURN(StoreLayout store,
                          StateStore::layout(store_options(config, layout, rank)));
    capacity += store.nvme_bytes;
    extents += static_cast<std::uint32_t>(store.nvme_extents);
  }
  if (param_nvme) {
    std::size_t largest = 0;
    for (std::uint32_t g = 0; g < layout.group_count(); ++g) {
      if (layout.persistent()[g]) continue;
      const GroupInfo& info = layout.group(g);
      const std::size_t bytes = round_page(info.shard_element_count * dtype_bytes(info.dtype));
      capacity += bytes;
      largest = std::max(largest, bytes);
      ++extents;
    }
    // The coordinator's staging blocks: one shard of the largest group each.
    if (largest > 0) {
      out.param_staging_bytes = largest * std::max<std::size_t>(1, z.offload_param.buffer_count);
    }
  }
  IoOptions io;
  io.block_bytes = config.aio_block_bytes;
  io.queue_depth = static_cast<std::uint32_t>(config.aio_queue_depth);
  io.faults = env.io_faults;
  ZINF_ASSIGN_OR_RETURN(out.io, open_engine(io));
  SwapOptions swap;
  swap.dirs = dirs;
  swap.block_bytes = config.aio_block_bytes;
  // In one directory an extent takes its bytes rounded up to a page (SwapSpace::create()), which
  // `capacity` sums already. Striped over several, each extent's share of each directory is
  // whole blocks: up to a block more per extent and directory. Only striping gets that slack,
  // since the swap file is preallocated to its size (fallocate) and a checkpoint saved by link
  // holds the whole file: a block of slack per extent was gigabytes on disk for megabytes of
  // state with a small sub_group_size. (At least a block: a space with nothing on NVMe, every
  // shard persistent, still opens.)
  swap.capacity_bytes = dirs.size() == 1 ? std::max<std::uint64_t>(capacity, config.aio_block_bytes)
                                         : capacity + std::uint64_t{extents + 4} *
                                                          config.aio_block_bytes * dirs.size();
  swap.max_extents = extents + 16;
  swap.file_name = swap_file_name("swap", rank);
  Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*out.io, swap);
  if (!opened.is_ok()) {
    return opened.status().with_context(fmt::format("swap space in {}", fmt::join(dirs, ", ")));
  }
  out.swap = std::move(opened).value();
  return out;
}

}  // namespace zinf
