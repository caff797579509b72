// DeviceOptimizer (see device_optimizer.hpp).
#include "engine/device_optimizer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "base/assert.hpp"
#include "kernels/sq_norm.h"

namespace zinf {
namespace {

// The kernel's per-step scalars (kernels/adam.h: the hyper-parameters as floats, the bias
// corrections in double).
kernels::AdamStepArgs adam_args(const OptimizerParams& params, std::int64_t step) {
  kernels::AdamHyper hyper;
  hyper.lr = static_cast<float>(params.lr);
  hyper.beta1 = static_cast<float>(params.beta1);
  hyper.beta2 = static_cast<float>(params.beta2);
  hyper.eps = static_cast<float>(params.eps);
  hyper.weight_decay = static_cast<float>(params.weight_decay);
  hyper.adamw = params.kind == OptimizerKind::kAdamW;
  return kernels::adam_step_args(hyper, step);
}

constexpr std::size_t kScratchFloats = kernels::kSqNormPartials + 2;  // partials, sum, flag

}  // namespace

Status DeviceOptimizer::check(const OptimizerParams& params, const Device& device) {
  if (params.kind == OptimizerKind::kAdam || params.kind == OptimizerKind::kAdamW) {
    if (params.bias_correction) return Status::ok();
    return Status::unsupported(fmt::format(
        "optimizer.params.bias_correction: false with zero_optimization.offload_optimizer.device "
        "\"none\" on {} (not host-accessible): the device's Adam always corrects the bias",
        device.name()));
  }
  return Status::unsupported(fmt::format(
      "optimizer.type: {} with zero_optimization.offload_optimizer.device \"none\" on {} (not "
      "host-accessible): only Adam and AdamW run on the device; offload the optimizer to \"cpu\" "
      "or \"nvme\"",
      optimizer_name(params.kind), device.name()));
}

Result<std::unique_ptr<DeviceOptimizer>> DeviceOptimizer::create(
    Device& device, std::vector<Group> groups, std::size_t partition_elements, const float* master,
    std::chrono::milliseconds timeout, std::vector<OptimizerRange> ranges) {
  std::unique_ptr<DeviceOptimizer> o(new DeviceOptimizer(device, timeout));
  o->groups_ = std::move(groups);
  o->partition_elements_ = partition_elements;
  if (ranges.empty()) ranges.push_back(OptimizerRange{});
  ZINF_ASSERT(ranges[0].begin == 0);
  // Cut each dtype group at the range boundaries inside it.
  for (std::uint32_t g = 0; g < o->groups_.size(); ++g) {
    const Group& group = o->groups_[g];
    const std::size_t end = group.offset + group.count;
    auto r = std::upper_bound(ranges.begin(), ranges.end(), group.offset,
                              [](std::size_t e, const OptimizerRange& x) { return e < x.begin; }) -
             1;
    for (std::size_t b = group.offset; b < end; ++r) {
      const std::size_t stop = r + 1 != ranges.end() ? std::min(end, r[1].begin) : end;
      ZINF_ASSERT(r->group < kMaxOptimizerGroups);
      o->runs_.push_back(Run{g, r->group, b, stop - b});
      b = stop;
    }
  }
  ZINF_ASSIGN_OR_RETURN(o->ops_, make_device_ops(device));
  ZINF_ASSIGN_OR_RETURN(o->stream_, device.create_stream("optimizer"));
  const std::size_t bytes = std::max<std::size_t>(partition_elements, 1) * sizeof(float);
  ZINF_ASSIGN_OR_RETURN(o->master_, DeviceBuffer::allocate(device, bytes));
  ZINF_ASSIGN_OR_RETURN(o->exp_avg_, DeviceBuffer::allocate(device, bytes));
  ZINF_ASSIGN_OR_RETURN(o->exp_avg_sq_, DeviceBuffer::allocate(device, bytes));
  ZINF_ASSIGN_OR_RETURN(o->grads_, DeviceBuffer::allocate(device, bytes));
  std::size_t half_bytes = 0;
  for (const Group& g : o->groups_) {
    if (g.dtype != DType::kF32) half_bytes = std::max(half_bytes, g.byte_offset + g.count * 2);
  }
  if (half_bytes > 0) {
    ZINF_ASSIGN_OR_RETURN(o->half_, DeviceBuffer::allocate(device, half_bytes));
  }
  ZINF_ASSIGN_OR_RETURN(o->scratch_, DeviceBuffer::allocate(device, kScratchFloats * 4));
  ZINF_ASSIGN_OR_RETURN(o->result_, RegisteredBuffer::allocate(device, sizeof(float)));
  Stream& s = *o->stream_;
  ZINF_RETURN_IF_ERROR(device.copy_h2d(o->master_.data(), master, partition_elements * 4, s));
  ZINF_RETURN_IF_ERROR(device.memset_async(o->exp_avg_.data(), 0, bytes, s));
  ZINF_RETURN_IF_ERROR(device.memset_async(o->exp_avg_sq_.data(), 0, bytes, s));
  ZINF_RETURN_IF_ERROR(device.memset_async(o->grads_.data(), 0, bytes, s));
  ZINF_RETURN_IF_ERROR(device.synchronize(s, timeout));
  return o;
}

DeviceOptimizer::~DeviceOptimizer() {
  if (stream_ != nullptr) (void)device_.synchronize(*stream_, timeout_);
}

Result<double> DeviceOptimizer::sum_of_squares() {
  float* scratch = scratch_.as<float>();
  float* sum = scratch + kernels::kSqNormPartials;
  ZINF_RETURN_IF_ERROR(ops_->sum_of_squares(grads(), partition_elements_, scratch, sum, *stream_));
  ZINF_RETURN_IF_ERROR(device_.copy_d2h(result_.data(), sum, sizeof(float), *stream_));
  ZINF_RETURN_IF_ERROR(device_.synchronize(*stream_, timeout_));
  return static_cast<double>(*result_.as<float>());
}

Status DeviceOptimizer::step(std::int64_t step, float grad_scale, const OptimizerParams& params) {
  return this->step(step, grad_scale, std::span<const OptimizerParams>(&params, 1));
}

Status DeviceOptimizer::step(std::int64_t step, float grad_scale,
                             std::span<const OptimizerParams> groups) {
  ZINF_ASSERT(!groups.empty() && groups.size() <= kMaxOptimizerGroups);
  // Every group's scalars once per step, on the stack: a step allocates nothing.
  std::array<kernels::AdamStepArgs, kMaxOptimizerGroups> args;
  for (std::size_t g = 0; g < groups.size(); ++g) args[g] = adam_args(groups[g], step);
  auto* flag = reinterpret_cast<std::int32_t*>(scratch_.as<float>() + kernels::kSqNormPartials + 1);
  std::size_t run = 0;
  for (std::uint32_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    // The overflow check ran before the step: the flag is not read.
    ZINF_RETURN_IF_ERROR(
        ops_->scale(grads_.as<float>() + g.offset, g.count, grad_scale, flag, *stream_));
    for (; run < runs_.size() && runs_[run].group == gi; ++run) {
      const Run& r = runs_[run];
      ZINF_ASSERT(r.param_group < groups.size());
      const std::size_t at = r.offset;
      void* half = g.dtype == DType::kF32
                       ? nullptr
                       : half_.as<std::byte>() + g.byte_offset + (at - g.offset) * 2;
      ZINF_RETURN_IF_ERROR(ops_->adam_step(master_.as<float>() + at, grads_.as<float>() + at,
                                           exp_avg_.as<float>() + at, exp_avg_sq_.as<float>() + at,
                                           half, g.dtype, r.count, args[r.param_group], *stream_));
    }
  }
  return device_.synchronize(*stream_, timeout_);
}

const void* DeviceOptimizer::values(std::uint32_t g) const {
  const Group& group = groups_[g];
  if (group.dtype == DType::kF32) return master_.as<float>() + group.offset;
  return half_.as<std::byte>() + group.byte_offset;
}

Status DeviceOptimizer::read_master(std::size_t first, std::size_t count, float* out) {
  return read_state(0, first, count, out);
}

DeviceBuffer& DeviceOptimizer::state(int which, std::size_t first, std::size_t count) {
  ZINF_ASSERT(which >= 0 && which <= 2 && first + count <= partition_elements_);
  return which == 0 ? master_ : which == 1 ? exp_avg_ : exp_avg_sq_;
}

Status DeviceOptimizer::read_state(int which, std::size_t first, std::size_t count, float* out) {
  const float* src = state(which, first, count).as<const float>() + first;
  ZINF_RETURN_IF_ERROR(device_.copy_d2h(out, src, count * sizeof(float), *stream_));
  return device_.synchronize(*stream_, timeout_);
}

Status DeviceOptimizer::write_state(int which, std::size_t first, std::size_t count,
                                    const float* in) {
  float* dst = state(which, first, count).as<float>() + first;
  ZINF_RETURN_IF_ERROR(device_.copy_h2d(dst, in, count * sizeof(float), *stream_));
  return device_.synchronize(*stream_, timeout_);
}

std::uint64_t DeviceOptimizer::device_bytes() const {
  return master_.bytes() + exp_avg_.bytes() + exp_avg_sq_.bytes() + grads_.bytes() + half_.bytes();
}

}  // namespace zinf
