// StepNumerics: the numbers a step decides before it touches any state. From this rank's sum of
// squares of the accumulated gradients it computes the global gradient norm (every rank's sum
// all-gathered as a double and added in rank order, so every rank gets the same bits), the
// overflow check (an inf or NaN on any rank), the clipping coefficient and the factor the
// optimizer multiplies the gradients by; and it owns the loss scaler, updated after the step.
//
// The optimizer sees the mean gradient over micro-batches, divided by the loss scale, times the
// clipping coefficient gradient_clipping / (norm + 1e-6) when the norm exceeds
// gradient_clipping (torch.nn.utils.clip_grad_norm_): of this step's norm, or with
// zinf.clip_from_previous_step of the last applied step's (the first step's own).
//
// Thread-safety: one thread (the rank's).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include "device/device_ops.hpp"
#include "zero/loss_scaler.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/status.hpp"
#include "zinf/trace.hpp"

namespace zinf {

struct StepDecision {
  bool overflow = false;    // skip the step
  double grad_norm = 0.0;   // of the mean unscaled gradient (inf on overflow)
  double clip_coef = 1.0;   // 1: no clipping
  float grad_scale = 1.0f;  // clip_coef / (micro-batches x loss scale)
};

class StepNumerics {
 public:
  // Allocates the norm exchange's buffers (device and registered host).
  static Result<StepNumerics> create(const Config& config, Device& device, Communicator& comm,
                                     std::chrono::milliseconds timeout);

  // Collective: every rank's sum of squares (of the gradients as accumulated: summed over
  // `micro_batches`, scaled by the loss scale) into the step's decision. `stream` and `event`
  // are the engine's.
  Result<StepDecision> decide(double local_sum_of_squares, int micro_batches, Stream& stream,
                              Event& event);

  LossScaler& scaler() { return scaler_; }
  const LossScaler& scaler() const { return scaler_; }

  // The grad_scale decide() will give a step of `micro_batches` that is not skipped, when it
  // does not depend on the step's own norm: without clipping, or with zinf.clip_from_previous_step
  // after an applied step. Else nullopt.
  std::optional<float> scale_before_norm(int micro_batches) const;
  // zinf.clip_from_previous_step: the coefficient of the last applied step's own norm, which the
  // next step applies (nullopt before the first, and after a load that carries none).
  std::optional<double> previous_clip_coef() const {
    return clip_previous_ && has_previous_ ? std::optional<double>(previous_coef_) : std::nullopt;
  }
  // (Without the mode the value is not kept: a later save carries none.)
  void set_previous_clip_coef(std::optional<double> coef) {
    has_previous_ = clip_previous_ && coef.has_value();
    previous_coef_ = has_previous_ ? *coef : 1.0;
  }

 private:
  StepNumerics(Device& device, Communicator& comm, std::chrono::milliseconds timeout)
      : device_(&device), comm_(&comm), timeout_(timeout) {}

  Device* device_;
  Communicator* comm_;
  std::chrono::milliseconds timeout_;
  double gradient_clipping_ = 0.0;
  bool clip_previous_ = false;  // zinf.clip_from_previous_step
  bool has_previous_ = false;
  double previous_coef_ = 1.0;
  LossScaler scaler_;
  DeviceBuffer scratch_;        // this rank's double, then every rank's
  RegisteredBuffer norm_host_;  // host side of scratch_
};

}  // namespace zinf
