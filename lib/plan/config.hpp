// The planner's view of the engine config: the knobs `zinf plan` chooses (EngineSetup) and the
// batch shape, converted to and from zinf::Config. There is one parser and one writer
// (parse_config() and config_to_json() in zinf/config.hpp); the functions here only convert, so
// the planner reads and writes exactly what the engine does, with the same errors. docs/PLAN.md
// lists the keys the planner sets.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "plan/estimate.hpp"
#include "zinf/config.hpp"
#include "zinf/status.hpp"

namespace zinf::plan {

struct PlanConfig {
  EngineSetup setup;
  std::uint64_t micro_batch = 1;
  std::uint64_t grad_accum_steps = 1;
  std::string nvme_path;  // swap directory for state on NVMe ("" when nothing is there)
  // The pinned pool the engine allocates; at least pinned_pool_bytes(setup).
  std::uint64_t pinned_pool_bytes = 0;
  // The host arena of offloaded activation checkpoints (activation_checkpointing.
  // cpu_checkpointing true, zinf.activation_host_bytes); 0: the checkpoints stay on the device.
  std::uint64_t activation_host_bytes = 0;
  // The step the plan was timed for, written where DeepSpeed has them: "gradient_clipping" (0:
  // off), zinf.clip_from_previous_step (clip by the last applied step's norm, so the pass need not
  // wait for this step's) and "fp16" with dynamic loss scaling (in place of bf16, which DeepSpeed
  // and the engine refuse beside it). setup.exact_clipping_or_loss_scaling must agree with them
  // (exact_clipping_or_loss_scaling(config)): engine_config() asserts it, plan_config() derives it.
  double gradient_clipping = 0.0;
  bool clip_from_previous_step = false;
  bool fp16 = false;
};

// Whether the step `config` describes needs every gradient before the optimizer pass: clipping by
// the step's own norm (gradient_clipping > 0 without clip_from_previous_step) or fp16 loss scaling
// (the overflow check). The one place the planner reads the three keys as
// EngineSetup::exact_clipping_or_loss_scaling.
bool exact_clipping_or_loss_scaling(const PlanConfig& config);

// The engine config of a plan: the plan's knobs set, bf16 on (fp16 instead where config.fp16),
// every other key at Config's default. pinned_pool_bytes is at least
// pinned_pool_bytes(config.setup).
// REQUIRES: config.setup.exact_clipping_or_loss_scaling == exact_clipping_or_loss_scaling(config),
// so the config written runs the step the plan was timed for.
Config engine_config(const PlanConfig& config);

// The plan of an engine config. Fails with invalid_argument naming the key when the planner
// cannot represent it: a setup validate_setup() refuses, state on NVMe with no nvme_path, or two
// different nvme_paths.
Result<PlanConfig> plan_config(const Config& config);

// config_to_json(engine_config(config)): the engine's writer.
std::string config_to_json(const PlanConfig& config);

// plan_config(parse_config(text)): the engine's parser, so the same keys are refused with the
// same messages.
Result<PlanConfig> config_from_json(std::string_view text);

// Writes config_to_json() to `path`; io_error naming the path on failure.
Status write_config(const PlanConfig& config, const std::string& path);

}  // namespace zinf::plan
