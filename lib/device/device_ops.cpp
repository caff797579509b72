// DeviceOps for HostDevice, the factory, and RegisteredBuffer (see device_ops.hpp).
#include "device/device_ops.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>

#include "base/arith.hpp"
#include "device/host_device.hpp"
#include "kernels/cast.h"
#include "kernels/sq_norm.h"
#include "kernels/unscale.h"
#include "kernels/widen.h"

namespace zinf {

namespace {
std::atomic<DeviceOpsFactory> g_device_ops_factory{nullptr};
}  // namespace

void set_device_ops_factory(DeviceOpsFactory factory) { g_device_ops_factory.store(factory); }

kernels::HalfType kernel_half_type(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return kernels::HalfType::kNone;
    case DType::kBF16:
      return kernels::HalfType::kBf16;
    case DType::kF16:
      return kernels::HalfType::kF16;
  }
  return kernels::HalfType::kNone;
}

namespace {

// The references as host functions in stream order, on the memory's host addresses. The
// closure allocates (Device::launch_host); this is the test backend, not a hot path.
class HostDeviceOps final : public DeviceOps {
 public:
  explicit HostDeviceOps(HostDevice& device) : device_(device) {}

  Status widen(const void* src, DType src_dtype, float* dst, std::size_t count, bool accumulate,
               Stream& stream) override {
    if (count == 0) return Status::ok();
    if (src == nullptr || dst == nullptr) {
      return Status::invalid_argument(
          fmt::format("{}: widen of {} elements with a null pointer", device_.name(), count));
    }
    const void* s = device_.host_address(src);
    auto* d = static_cast<float*>(device_.host_address(dst));
    const kernels::HalfType type = kernel_half_type(src_dtype);
    return device_.launch_host(stream, [s, type, d, count, accumulate] {
      kernels::widen_to_f32_ref(s, type, d, count, accumulate);
      return Status::ok();
    });
  }

  Status scale(float* x, std::size_t count, float factor, std::int32_t* found_inf,
               Stream& stream) override {
    if (count == 0) return Status::ok();
    auto* h = static_cast<float*>(device_.host_address(x));
    auto* flag = static_cast<std::int32_t*>(device_.host_address(found_inf));
    return device_.launch_host(stream, [h, count, factor, flag] {
      kernels::unscale_grads_ref(h, count, factor, flag);
      return Status::ok();
    });
  }

  Status sum_of_squares(const float* x, std::size_t count, float* partials, float* out,
                        Stream& stream) override {
    (void)partials;  // the reference sums in one pass
    const void* h = device_.host_address(x);
    auto* o = static_cast<float*>(device_.host_address(out));
    return device_.launch_host(stream, [h, count, o] {
      *o = kernels::sq_norm_ref(h, kernels::HalfType::kNone, count);
      return Status::ok();
    });
  }

  Status narrow(const float* src, DType dst_dtype, void* dst, std::size_t count,
                Stream& stream) override {
    if (count == 0) return Status::ok();
    if (src == nullptr || dst == nullptr) {
      return Status::invalid_argument(
          fmt::format("{}: narrow of {} elements with a null pointer", device_.name(), count));
    }
    if (dst_dtype == DType::kF32) return device_.copy_d2d(dst, src, count * sizeof(float), stream);
    const auto* s = static_cast<const float*>(device_.host_address(src));
    auto* d = static_cast<std::uint16_t*>(device_.host_address(dst));
    return device_.launch_host(stream, [s, dst_dtype, d, count] {
      if (dst_dtype == DType::kBF16) {
        kernels::cast_f32_to_bf16_ref(s, d, count);
      } else {
        kernels::cast_f32_to_f16_ref(s, d, count);
      }
      return Status::ok();
    });
  }

  Status adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                   void* param_half, DType half_dtype, std::size_t count,
                   const kernels::AdamStepArgs& args, Stream& stream) override {
    if (count == 0) return Status::ok();
    auto* p = static_cast<float*>(device_.host_address(param));
    auto* g = static_cast<const float*>(device_.host_address(grad));
    auto* m = static_cast<float*>(device_.host_address(exp_avg));
    auto* v = static_cast<float*>(device_.host_address(exp_avg_sq));
    const kernels::HalfType type = kernel_half_type(half_dtype);
    auto* half = type == kernels::HalfType::kNone
                     ? nullptr
                     : static_cast<std::uint16_t*>(device_.host_address(param_half));
    return device_.launch_host(stream, [=] {
      kernels::adam_step_ref(p, g, m, v, half, type, count, args);
      return Status::ok();
    });
  }

 private:
  HostDevice& device_;
};

}  // namespace

Result<std::unique_ptr<DeviceOps>> make_device_ops(Device& device) {
  if (auto* host = dynamic_cast<HostDevice*>(&device); host != nullptr) {
    return std::unique_ptr<DeviceOps>(std::make_unique<HostDeviceOps>(*host));
  }
  if (DeviceOpsFactory factory = g_device_ops_factory.load(); factory != nullptr) {
    if (std::unique_ptr<DeviceOps> ops = factory(device); ops != nullptr) return ops;
  }
  return Status::unsupported(
      fmt::format("make_device_ops: no device ops for {} (a {} device) in this build",
                  device.name(), device_kind_name(device.kind())));
}

Result<RegisteredBuffer> RegisteredBuffer::allocate(Device& device, std::size_t bytes) {
  RegisteredBuffer out;
  out.buffer_ = AlignedBuffer(round_page(std::max<std::size_t>(bytes, 1)), kPage);
  ZINF_RETURN_IF_ERROR(device.register_host(out.buffer_.data(), out.buffer_.bytes()));
  out.device_ = &device;
  return out;
}

void RegisteredBuffer::reset() {
  if (device_ != nullptr) (void)device_->unregister_host(buffer_.data());
  device_ = nullptr;
  buffer_ = AlignedBuffer();
}

}  // namespace zinf
