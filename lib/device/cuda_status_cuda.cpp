#include <cuda_runtime.h>
#include <fmt/format.h>

#include "device/cuda_status.hpp"

namespace zinf {

Status status_from_cuda(std::string_view context, int err) {
  if (err == 0) return Status::ok();
  const auto e = static_cast<cudaError_t>(err);
  std::string message =
      fmt::format("{}: {}: {}", context, cudaGetErrorName(e), cudaGetErrorString(e));
  switch (e) {
    case cudaErrorMemoryAllocation:
      return Status(Code::kResourceExhausted, err, std::move(message));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported:
      // No sys_code: Status prints a kUnsupported code as an errno; the name is in the message.
      return Status(Code::kUnsupported, 0, std::move(message));
    default:
      return Status(Code::kDeviceError, err, std::move(message));
  }
}

}  // namespace zinf
