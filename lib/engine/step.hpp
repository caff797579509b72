// StepNumerics: the numbers a step decides before it touches any state. From this rank's sum of
// squares of the accumulated gradients it computes the global gradient norm (every rank's sum
// all-gathered as a double and added in rank order, so every rank gets the same bits), the
// overflow check (an inf or NaN on any rank), the clipping coefficient and the factor the
// optimizer multiplies the gradients by; and it owns the loss scaler, updated after the step.
//
// The optimizer sees the mean gradient over micro-batches, divided by the loss scale, times the
// clipping coefficient gradient_clipping / (norm + 1e-6) when the norm exceeds
// gradient_clipping (torch.nn.utils.clip_grad_norm_).
//
// Thread-safety: one thread (the rank's).
#pragma once

#include <chrono>
#include <cstdint>

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

 private:
  StepNumerics(Device& device, Communicator& comm, std::chrono::milliseconds timeout)
      : device_(&device), comm_(&comm), timeout_(timeout) {}

  Device* device_;
  Communicator* comm_;
  std::chrono::milliseconds timeout_;
  double gradient_clipping_ = 0.0;
  LossScaler scaler_;
  DeviceBuffer scratch_;        // this rank's double, then every rank's
  RegisteredBuffer norm_host_;  // host side of scratch_
};

}  // namespace zinf
