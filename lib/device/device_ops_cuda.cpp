// DeviceOps for CudaDevice: the kernels of kernels/ on the stream's cudaStream_t.
#include <fmt/format.h>

#include "device/cuda_device.hpp"
#include "device/cuda_status.hpp"
#include "device/device_ops.hpp"
#include "kernels/cast.h"
#include "kernels/sq_norm.h"
#include "kernels/unscale.h"
#include "kernels/widen.h"

namespace zinf {
namespace {

class CudaDeviceOps final : public DeviceOps {
 public:
  explicit CudaDeviceOps(Device& device) : device_(device) {}

  Status widen(const void* src, DType src_dtype, float* dst, std::size_t count, bool accumulate,
               Stream& stream) override {
    if (count == 0) return Status::ok();
    // Kernels launch on the calling thread's current device; the stream belongs to this one.
    ZINF_RETURN_IF_ERROR(make_cuda_device_current(device_));
    const int err = kernels::widen_to_f32(src, kernel_half_type(src_dtype), dst, count, accumulate,
                                          stream.native_handle());
    if (err == 0) return Status::ok();
    return status_from_cuda(
        fmt::format("{}: widen of {} {} elements on stream '{}'", device_.name(), count,
                    dtype_name(src_dtype), stream.name()),
        err);
  }

  Status scale(float* x, std::size_t count, float factor, std::int32_t* found_inf,
               Stream& stream) override {
    if (count == 0) return Status::ok();
    ZINF_RETURN_IF_ERROR(make_cuda_device_current(device_));
    return launched(kernels::unscale_grads(x, count, factor, found_inf, stream.native_handle()),
                    "scale", count, stream);
  }

  Status sum_of_squares(const float* x, std::size_t count, float* partials, float* out,
                        Stream& stream) override {
    ZINF_RETURN_IF_ERROR(make_cuda_device_current(device_));
    return launched(kernels::sq_norm(x, kernels::HalfType::kNone, count, partials, out,
                                     /*accumulate=*/false, stream.native_handle()),
                    "sum of squares", count, stream);
  }

  Status narrow(const float* src, DType dst_dtype, void* dst, std::size_t count,
                Stream& stream) override {
    if (count == 0) return Status::ok();
    if (dst_dtype == DType::kF32) return device_.copy_d2d(dst, src, count * sizeof(float), stream);
    ZINF_RETURN_IF_ERROR(make_cuda_device_current(device_));
    auto* d = static_cast<std::uint16_t*>(dst);
    const int err = dst_dtype == DType::kBF16
                        ? kernels::cast_f32_to_bf16(src, d, count, stream.native_handle())
                        : kernels::cast_f32_to_f16(src, d, count, stream.native_handle());
    if (err == 0) return Status::ok();
    return status_from_cuda(
        fmt::format("{}: narrow of {} elements to {} on stream '{}'", device_.name(), count,
                    dtype_name(dst_dtype), stream.name()),
        err);
  }

  Status adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                   void* param_half, DType half_dtype, std::size_t count,
                   const kernels::AdamStepArgs& args, Stream& stream) override {
    if (count == 0) return Status::ok();
    ZINF_RETURN_IF_ERROR(make_cuda_device_current(device_));
    return launched(kernels::adam_step(
                        param, grad, exp_avg, exp_avg_sq, static_cast<std::uint16_t*>(param_half),
                        kernel_half_type(half_dtype), count, args, stream.native_handle()),
                    "adam step", count, stream);
  }

 private:
  Status launched(int err, const char* what, std::size_t count, Stream& stream) const {
    if (err == 0) return Status::ok();
    return status_from_cuda(fmt::format("{}: {} of {} elements on stream '{}'", device_.name(),
                                        what, count, stream.name()),
                            err);
  }

  Device& device_;
};

}  // namespace

std::unique_ptr<DeviceOps> make_cuda_device_ops(Device& device) {
  if (device.kind() != DeviceKind::kCuda) return nullptr;
  return std::make_unique<CudaDeviceOps>(device);
}

}  // namespace zinf
