// StepNumerics: see step.hpp.
#include "engine/step.hpp"

#include <cmath>
#include <limits>

namespace zinf {

Result<StepNumerics> StepNumerics::create(const Config& config, Device& device, Communicator& comm,
                                          std::chrono::milliseconds timeout) {
  StepNumerics n(device, comm, timeout);
  n.gradient_clipping_ = config.gradient_clipping;
  n.clip_previous_ = config.clip_from_previous_step && config.gradient_clipping > 0.0;
  LossScalerOptions ls;
  ls.dynamic = config.fp16.enabled && config.fp16.loss_scale == 0.0;
  ls.initial_scale = !config.fp16.enabled ? 1.0
                     : ls.dynamic         ? std::ldexp(1.0, config.fp16.initial_scale_power)
                                          : config.fp16.loss_scale;
  ls.window = config.fp16.loss_scale_window;
  ls.hysteresis = config.fp16.hysteresis;
  ls.min_scale = config.fp16.min_loss_scale;
  n.scaler_ = LossScaler(ls);
  const std::size_t bytes = (1 + static_cast<std::size_t>(comm.world_size())) * sizeof(double);
  ZINF_ASSIGN_OR_RETURN(n.scratch_, DeviceBuffer::allocate(device, bytes));
  ZINF_ASSIGN_OR_RETURN(n.norm_host_, RegisteredBuffer::allocate(device, n.scratch_.bytes()));
  return n;
}

Result<StepDecision> StepNumerics::decide(double sumsq, int micro_batches, Stream& stream,
                                          Event& event) {
  StepDecision d;
  const double unscale = 1.0 / (static_cast<double>(micro_batches) * scaler_.scale());
  // An inf or NaN anywhere makes the sum inf or NaN (the square of a finite float never
  // overflows a double), so the sum is the overflow check too.
  bool overflow = !std::isfinite(sumsq);
  sumsq *= unscale * unscale;
  // Each rank's sum of squares travels as a double (all-gathered bit for bit) and every rank
  // adds them in rank order in double, so the norm carries no f32 rounding of the reduction and
  // is the same bits everywhere. An overflow travels as an infinity. Through host staging and
  // copies: device memory may not be host-accessible.
  const int world = comm_->world_size();
  double* buf = norm_host_.as<double>();
  double* dev = scratch_.as<double>();
  const std::size_t all_bytes = static_cast<std::size_t>(world) * sizeof(double);
  buf[0] = overflow ? std::numeric_limits<double>::infinity() : sumsq;
  ZINF_RETURN_IF_ERROR(device_->copy_h2d(dev, buf, sizeof(double), stream));
  ZINF_RETURN_IF_ERROR(comm_->all_gather(dev, dev + 1, 2, DType::kF32, stream, "grad norm"));
  ZINF_RETURN_IF_ERROR(device_->copy_d2h(buf + 1, dev + 1, all_bytes, stream));
  ZINF_RETURN_IF_ERROR(device_->record(event, stream));
  ZINF_RETURN_IF_ERROR(comm_->wait(event, timeout_));
  double total = 0.0;
  for (int r = 0; r < world; ++r) total += buf[1 + r];
  d.overflow = !std::isfinite(total);
  d.grad_norm = d.overflow ? std::numeric_limits<double>::infinity() : std::sqrt(total);
  if (d.overflow) return d;
  if (gradient_clipping_ > 0.0 && d.grad_norm > gradient_clipping_) {
    d.clip_coef = gradient_clipping_ / (d.grad_norm + 1e-6);
  }
  if (clip_previous_) {
    // This step applies the last applied step's coefficient; its own goes to the next.
    const double own = d.clip_coef;
    if (has_previous_) d.clip_coef = previous_coef_;
    previous_coef_ = own;
    has_previous_ = true;
  }
  d.grad_scale = static_cast<float>(d.clip_coef * unscale);
  return d;
}

std::optional<float> StepNumerics::scale_before_norm(int micro_batches) const {
  double coef = 1.0;
  if (gradient_clipping_ > 0.0) {
    if (!clip_previous_ || !has_previous_) return std::nullopt;
    coef = previous_coef_;
  }
  const double unscale = 1.0 / (static_cast<double>(micro_batches) * scaler_.scale());
  return static_cast<float>(coef * unscale);
}

}  // namespace zinf
