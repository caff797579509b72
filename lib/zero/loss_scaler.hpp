// LossScaler: the dynamic loss scale of f16 training (Micikevicius et al. 2018, "Mixed
// Precision Training", section 3.2; DeepSpeed's DynamicLossScaler).
//
// The loss is multiplied by scale() before the backward pass so that small f16 gradients do not
// flush to zero; the step divides it out again. When a step's gradients overflow (an inf or NaN
// on any rank) the step is skipped and, once `hysteresis` overflowing steps have been seen since
// the last good run, the scale is divided by 2 (never below min_scale). The scale is multiplied
// by 2 at the good step that follows `window` good steps in a row, and again every `window` good
// steps after that, as DeepSpeed's DynamicLossScaler.update_scale counts them ((steps since the
// last overflow - 1) a positive multiple of the window), which refills the hysteresis too. A
// static scaler (dynamic = false) never changes.
//
// Thread-safety: a value; not shared.
#pragma once

#include <algorithm>
#include <cstdint>

namespace zinf {

struct LossScalerOptions {
  bool dynamic = true;
  double initial_scale = 65536.0;
  std::int64_t window = 1000;
  int hysteresis = 2;
  double min_scale = 1.0;
};

class LossScaler {
 public:
  LossScaler() = default;
  explicit LossScaler(const LossScalerOptions& options)
      : options_(options), scale_(options.initial_scale), hysteresis_left_(options.hysteresis) {}

  double scale() const { return scale_; }
  // Good steps in a row since the last overflow or the last raise (that step counted).
  std::int64_t good_steps() const { return good_steps_; }
  int hysteresis_left() const { return hysteresis_left_; }
  // Puts back a state read from a checkpoint (the options stay this scaler's).
  void restore(double scale, std::int64_t good_steps, int hysteresis_left) {
    scale_ = scale;
    good_steps_ = good_steps;
    hysteresis_left_ = hysteresis_left;
  }

  // Whether an overflow now would lower a scale that is already at min_scale: the training cannot
  // get out of it by scaling, so the engine reports it as DeepSpeed does (it raises an error).
  bool at_floor() const {
    return options_.dynamic && hysteresis_left_ <= 1 && scale_ <= options_.min_scale;
  }

  // Records the outcome of one step (called on every rank with the same, all-reduced, flag).
  void update(bool overflow) {
    if (!options_.dynamic) return;
    if (overflow) {
      good_steps_ = 0;
      if (hysteresis_left_ <= 1) {
        scale_ = std::max(scale_ / 2.0, options_.min_scale);
      } else {
        --hysteresis_left_;
      }
      return;
    }
    ++good_steps_;
    if (good_steps_ > options_.window) {
      scale_ *= 2.0;
      good_steps_ = 1;  // this step begins the next window
      hysteresis_left_ = options_.hysteresis;
    }
  }

 private:
  LossScalerOptions options_;
  double scale_ = 1.0;
  int hysteresis_left_ = 1;
  std::int64_t good_steps_ = 0;
};

}  // namespace zinf
