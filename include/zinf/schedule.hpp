// Learning-rate schedules: DeepSpeed's `scheduler` section (WarmupLR, WarmupDecayLR,
// WarmupCosineLR, OneCycle), with the parameters and formulas of DeepSpeed's
// deepspeed/runtime/lr_schedules.py.
//
// A schedule is a pure function of one integer, DeepSpeed's `last_batch_iteration`: -1 before the
// scheduler's first step(), then 0, 1, 2, ... DeepSpeed's engine sets the learning rate for
// iteration -1 when it builds the scheduler and steps the scheduler after every optimizer step
// that was applied (a step skipped for an fp16 overflow does not advance it), so the k-th applied
// optimizer step (k = 1, 2, ...) runs with lr_at(k - 2). The formulas, with n =
// last_batch_iteration and W = max(2, warmup_num_steps):
//
//   WarmupLR       gamma = log(n + 1) / log(W)  (warmup_type "log")  or  n / W  ("linear"),
//                  for 0 <= n < W; 1 after.  lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr)
//                  * gamma; lr = warmup_min_lr at n = -1.
//   WarmupDecayLR  as WarmupLR during warm-up; after it gamma = max(0, (T - n) / max(1, T - W))
//                  with T = total_num_steps.
//   WarmupCosineLR lr = base_lr * ratio, base_lr the optimizer's lr; ratio = 0 at n = -1;
//                  during warm-up ratio = r0 + (1 - r0) * gamma (r0 = warmup_min_ratio, gamma as
//                  WarmupLR); after it, with p = min(1, (n - W + 1) / max(1, T - W)),
//                  ratio = max(0, c + (1 - c) * (1 + cos(pi * p)) / 2), c = cos_min_ratio.
//   OneCycle       one cycle of S = S1 + S2 iterations (cycle_first_step_size,
//                  cycle_second_step_size), indexed by b = n + 1: x = b / S - floor(b / S);
//                  scale = x / (S1 / S) while x <= S1 / S, else (x - 1) / (S1 / S - 1);
//                  lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale while n < S.
//                  A stair count k > 0 for a half quantises scale to floor(position * k) / k,
//                  position = (b mod S) / S1 in the first half, (S - b mod S) / S2 in the second.
//                  After the cycle (n >= S), with d = n - S + 1: lr = cycle_min_lr /
//                  (1 + decay_lr_rate * d / decay_step_size) (cycle_min_lr when either is 0).
//                  With cycle_momentum, beta1 = cycle_max_mom - (cycle_max_mom - cycle_min_mom)
//                  * scale during the cycle and cycle_max_mom * (1 + decay_mom_rate * d /
//                  decay_step_size) after it, and beta2 = 0.99 throughout (DeepSpeed sets the
//                  betas to (momentum, 0.99)).
//
// With parameter groups, the scheduled lr is the lr of the default group; a group with an lr
// multiplier runs at the scheduled lr times its multiplier.
//
// Thread-safety: an LrSchedule is a value; const calls may run concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "zinf/status.hpp"

namespace zinf {

enum class ScheduleKind : std::uint8_t {
  kNone = 0,  // the optimizer's lr, constant (and set_learning_rate())
  kWarmupLR = 1,
  kWarmupDecayLR = 2,
  kWarmupCosineLR = 3,
  kOneCycle = 4,
};

// "none", and DeepSpeed's type names: "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle".
std::string_view schedule_name(ScheduleKind kind);

// The `scheduler` section. Fields keep DeepSpeed's names and defaults; each applies to the types
// named beside it.
struct ScheduleConfig {
  ScheduleKind kind = ScheduleKind::kNone;
  // WarmupLR, WarmupDecayLR, WarmupCosineLR: iterations of warm-up (at least 1; DeepSpeed uses
  // max(2, warmup_num_steps)); warmup_type "log" (DeepSpeed's default) or "linear".
  std::int64_t warmup_num_steps = 1000;
  bool warmup_linear = false;
  // WarmupLR, WarmupDecayLR. warmup_max_lr < 0 means "not given": WarmupLR then warms up to the
  // optimizer's lr, WarmupDecayLR to 0.001 (DeepSpeed's defaults).
  double warmup_min_lr = 0.0;
  double warmup_max_lr = -1.0;
  // WarmupDecayLR and WarmupCosineLR (required by both).
  std::int64_t total_num_steps = -1;
  // WarmupCosineLR.
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 0.0001;
  // OneCycle. cycle_min_lr and cycle_max_lr are required; cycle_second_step_size < 0 means equal
  // to cycle_first_step_size, cycle_second_stair_count < 0 equal to cycle_first_stair_count.
  double cycle_min_lr = -1.0;
  double cycle_max_lr = -1.0;
  double decay_lr_rate = 0.0;
  std::int64_t cycle_first_step_size = 2000;
  std::int64_t cycle_second_step_size = -1;
  std::int64_t cycle_first_stair_count = 0;
  std::int64_t cycle_second_stair_count = -1;
  std::int64_t decay_step_size = 0;
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
  // Every type: the iteration the schedule starts from (DeepSpeed's last_batch_iteration
  // argument; -1: from the beginning).
  std::int64_t last_batch_iteration = -1;

  bool operator==(const ScheduleConfig&) const = default;
};

// Beta1 and beta2 that OneCycle's momentum cycling sets.
struct ScheduledBetas {
  bool set = false;  // false: the schedule leaves the optimizer's betas alone
  double beta1 = 0.0;
  double beta2 = 0.0;
};

class LrSchedule {
 public:
  // A schedule that keeps `base_lr` (kind kNone).
  LrSchedule() = default;
  // Checks `config` (kInvalidArgument naming the scheduler.params key that is missing or out of
  // range) and makes the schedule. `base_lr` is the optimizer's lr (optimizer.params.lr).
  static Result<LrSchedule> create(const ScheduleConfig& config, double base_lr);

  ScheduleKind kind() const { return config_.kind; }
  const ScheduleConfig& config() const { return config_; }

  // DeepSpeed's get_lr() when last_batch_iteration == `iteration` (>= -1).
  double lr_at(std::int64_t iteration) const;
  // DeepSpeed's get_mom(): OneCycle with cycle_momentum only.
  ScheduledBetas betas_at(std::int64_t iteration) const;
  // Whether the optimizer can take lr_at() and betas_at() at `iteration`: OneCycle's momentum
  // after the cycle, cycle_max_mom x (1 + decay_mom_rate x ...), leaves [0, 1) after some
  // iteration, which create() cannot know the run reaches. kInvalidArgument naming the iteration
  // and the value, and the key where one is at fault (decay_mom_rate for the momentum; an lr out
  // of range names the schedule).
  Status check_at(std::int64_t iteration) const;

  // The state a checkpoint keeps: the last iteration stepped (DeepSpeed's state_dict()).
  std::int64_t last_batch_iteration() const { return last_batch_iteration_; }
  // Advances by one iteration (DeepSpeed's step()).
  void step() { ++last_batch_iteration_; }
  // Restores the state (DeepSpeed's load_state_dict()). kInvalidArgument when below -1.
  Status set_last_batch_iteration(std::int64_t iteration);
  // The lr and betas for the current iteration.
  double lr() const { return lr_at(last_batch_iteration_); }
  ScheduledBetas betas() const { return betas_at(last_batch_iteration_); }

 private:
  double warmup_gamma(std::int64_t iteration) const;
  double one_cycle_scale(std::int64_t iteration) const;

  ScheduleConfig config_;
  double base_lr_ = 0.0;
  double warmup_max_lr_ = 0.0;  // the resolved warmup_max_lr
  std::int64_t warmup_steps_ = 2;
  std::int64_t last_batch_iteration_ = -1;
};

}  // namespace zinf
