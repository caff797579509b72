// The engine config the planner writes (`zinf plan --out config.json`) and reads back: a
// DeepSpeed-style JSON file whose `zero_optimization` section uses DeepSpeed's keys, with zinf's
// own knobs in a `zinf` section. docs/PLAN.md lists every key; in brief:
//
//   {
//     "train_micro_batch_size_per_gpu": 1,
//     "gradient_accumulation_steps": 1,
//     "bf16": {"enabled": true},
//     "zero_optimization": {
//       "stage": 3,
//       "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": true,
//                             "buffer_count": 4},
//       "offload_param": {"device": "cpu", "nvme_path": "/nvme", "pin_memory": true,
//                         "buffer_count": 5, "buffer_size": 100000000},
//       "sub_group_size": 67108864,
//       "reduce_bucket_size": 67108864,
//       "stage3_prefetch_bucket_size": 60397977,
//       "stage3_max_live_parameters": 1000000000,
//       "stage3_param_persistence_threshold": 81920,
//       "overlap_comm": true, "contiguous_gradients": true
//     },
//     "aio": {"block_size": 1048576, "queue_depth": 32},
//     "zinf": {"world_size": 4, "ranks_per_machine": 4, "pinned_pool_bytes": 4294967296,
//              "gradients_on_nvme": false, "device_reserved_bytes": 1073741824}
//   }
//
// Counts (`*_size`, `*_parameters`, `*_threshold`) are parameters, as in DeepSpeed; zinf's
// `*_bytes` are bytes. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "plan/estimate.hpp"
#include "zinf/status.hpp"

namespace zinf::plan {

struct PlanConfig {
  EngineSetup setup;
  std::uint64_t micro_batch = 1;
  std::uint64_t grad_accum_steps = 1;
  std::string nvme_path;  // swap directory for state on NVMe ("" when nothing is there)
  // The pinned pool the engine allocates; at least pinned_pool_bytes(setup).
  std::uint64_t pinned_pool_bytes = 0;
};

// The config as JSON text (2-space indented, keys as above).
std::string config_to_json(const PlanConfig& config);

// Parses a config written by config_to_json() or by hand. Missing keys take EngineSetup's
// defaults. Fails with invalid_argument naming the key for a wrong type or value, and with the
// validate_setup() error for a setup the engine cannot run.
Result<PlanConfig> config_from_json(std::string_view text);

// Writes config_to_json() to `path`; io_error naming the path on failure.
Status write_config(const PlanConfig& config, const std::string& path);

}  // namespace zinf::plan
