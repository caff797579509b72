// LossScaler: the dynamic loss scale of f16 training (Micikevicius et al. 2018, "Mixed
// Precision Training", section 3.2), by the rule of DeepSpeed's ZeRO optimizers (stages 1-3 call
// DynamicLossScaler.update_scale in deepspeed/runtime/fp16/loss_scaler.py once per step, skipped
// or not).
//
// The loss is multiplied by scale() before the backward pass so that small f16 gradients do not
// flush to zero; the step divides it out again. When a step's gradients overflow (an inf or NaN
// on any rank) the step is skipped and the scale is divided by 2 (never below min_scale), unless
// hysteresis is left: then the hysteresis left drops by one and the scale stays. With H the
// configured hysteresis, the H-th overflow since the start or the last raise (in a row or not)
// lowers the scale, and so does every overflow after it until the next raise.
//
// The scale is multiplied by 2 at every good step that makes the good steps since the last
// overflow (or since the start) a multiple of `window`: with a window of 3 and no overflow, at
// steps 3, 6, 9, ...; after an overflow, at the 3rd, 6th, ... good step after it. This is
// DeepSpeed's `(cur_iter - last_overflow_iter) % scale_window == 0`, where cur_iter counts every
// step and last_overflow_iter starts at -1. A raise refills the hysteresis (DeepSpeed's default,
// consecutive_hysteresis false). DeepSpeed's stage-0 FP16_Optimizer raises one step later, after
// window + 1 good steps; zinf follows the ZeRO optimizers. A static scaler (dynamic = false)
// never changes.
//
// The state is (scale, good steps since the last overflow, hysteresis left): restore() of what
// the accessors returned continues exactly as the saved scaler would have. The count is not
// reduced modulo the window; only its residue decides a raise.
//
// Thread-safety: a value; not shared.
#pragma once

#include <algorithm>
#include <cstdint>

namespace zinf {

struct LossScalerOptions {
  bool dynamic = true;
  double initial_scale = 65536.0;
  // REQUIRES: >= 1 (the engine's config refuses fp16.loss_scale_window below 1).
  std::int64_t window = 1000;
  // REQUIRES: >= 1 (the engine's config refuses fp16.hysteresis below 1).
  int hysteresis = 2;
  double min_scale = 1.0;
};

class LossScaler {
 public:
  LossScaler() = default;
  explicit LossScaler(const LossScalerOptions& options)
      : options_(options), scale_(options.initial_scale), hysteresis_left_(options.hysteresis) {}

  double scale() const { return scale_; }
  // Good steps since the last overflow, or since the start (that step counted): DeepSpeed's
  // cur_iter - last_overflow_iter - 1 after its update. The scale doubled at each multiple of the
  // window.
  std::int64_t good_steps() const { return good_steps_; }
  int hysteresis_left() const { return hysteresis_left_; }
  // Whether update() moves the scale (LossScalerOptions::dynamic).
  bool dynamic() const { return options_.dynamic; }
  // Puts back a state read from a checkpoint (the options stay this scaler's). A count saved by
  // an earlier zinf, which restarted it at a raise, differs from the good steps since the last
  // overflow by a multiple of the window, so the next raise still comes where this rule puts it.
  void restore(double scale, std::int64_t good_steps, int hysteresis_left) {
    scale_ = scale;
    good_steps_ = good_steps;
    hysteresis_left_ = hysteresis_left;
  }

  // Back to the state the options start from (initial_scale, no good steps, full hysteresis).
  void reset() { *this = LossScaler(options_); }

  // Whether an overflow now would lower a scale that is already at min_scale: the training cannot
  // get out of it by scaling, so the engine reports it where DeepSpeed raises an error (the same
  // condition: no hysteresis left and the scale equal to min_scale).
  bool at_floor() const {
    return options_.dynamic && lowers_on_overflow() && scale_ == options_.min_scale;
  }

  // Records the outcome of one step (called on every rank with the same, all-reduced, flag).
  void update(bool overflow) {
    if (!options_.dynamic) return;
    if (overflow) {
      if (lowers_on_overflow()) {
        scale_ = std::max(scale_ / 2.0, options_.min_scale);
      } else {
        --hysteresis_left_;
      }
      good_steps_ = 0;
      return;
    }
    ++good_steps_;
    if (good_steps_ % options_.window == 0) {
      scale_ *= 2.0;
      hysteresis_left_ = options_.hysteresis;
    }
  }

 private:
  // DeepSpeed's `delayed_shift == 1 or cur_hysteresis == 1`; hysteresis_left_ below 1 comes only
  // from a restored state and lowers the scale too.
  bool lowers_on_overflow() const { return options_.hysteresis <= 1 || hysteresis_left_ <= 1; }

  LossScalerOptions options_;
  double scale_ = 1.0;
  int hysteresis_left_ = 1;
  std::int64_t good_steps_ = 0;
};

}  // namespace zinf
