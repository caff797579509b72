// DeviceOps for CudaDevice: the kernels of kernels/ on the stream's cudaStream_t.
#include <fmt/format.h>

#include "device/cuda_device.hpp"
#include "device/cuda_status.hpp"
#include "device/device_ops.hpp"
#include "kernels/widen.h"

namespace zinf {
namespace {

kernels::HalfType half_type(DType dtype) {
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

class CudaDeviceOps final : public DeviceOps {
 public:
  explicit CudaDeviceOps(Device& device) : device_(device) {}

  Status widen(const void* src, DType src_dtype, float* dst, std::size_t count, bool accumulate,
               Stream& stream) override {
    if (count == 0) return Status::ok();
    // Kernels launch on the calling thread's current device; the stream belongs to this one.
    ZINF_RETURN_IF_ERROR(make_cuda_device_current(device_));
    const int err = kernels::widen_to_f32(src, half_type(src_dtype), dst, count, accumulate,
                                          stream.native_handle());
    if (err == 0) return Status::ok();
    return status_from_cuda(
        fmt::format("{}: widen of {} {} elements on stream '{}'", device_.name(), count,
                    dtype_name(src_dtype), stream.name()),
        err);
  }

 private:
  Device& device_;
};

}  // namespace

std::unique_ptr<DeviceOps> make_cuda_device_ops(Device& device) {
  if (device.kind() != DeviceKind::kCuda) return nullptr;
  return std::make_unique<CudaDeviceOps>(device);
}

}  // namespace zinf
