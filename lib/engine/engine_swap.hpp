// The engine's NVMe side, made at open() and finalize(): the swap directories (from Env or the
// config) and one swap space, on one I/O engine, for everything on NVMe (the optimizer's extents
// and the ZeRO-3 parameter shards).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/layout.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "zinf/config.hpp"
#include "zinf/engine.hpp"
#include "zinf/status.hpp"

namespace zinf {

// The swap directories: Env::nvme_paths when given, else the config's nvme_path keys (the
// parameters' falling back to the optimizer's). Each is probed (prepare_nvme_directory()); errors
// name the key or Env::nvme_paths. Empty when nothing is on NVMe.
Result<std::vector<std::string>> find_nvme_dirs(const Config& config, const Env& env, int rank);

struct EngineSwap {
  std::unique_ptr<IoEngine> io;
  std::unique_ptr<SwapSpace> swap;
  // The coordinator's pinned staging blocks for NVMe shards (0 without them).
  std::uint64_t param_staging_bytes = 0;
};

// The I/O engine and swap space in `dirs` sized for this rank's partition of `layout`, or none
// (null members) when nothing is on NVMe. REQUIRES: layout laid out.
Result<EngineSwap> open_engine_swap(const Config& config, const Env& env,
                                    const ParameterLayout& layout, int rank,
                                    const std::vector<std::string>& dirs);

}  // namespace zinf
