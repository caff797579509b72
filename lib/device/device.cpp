#include "zinf/device.hpp"

#include <fmt/format.h>

#include <memory>
#include <utility>

namespace zinf {

std::string_view device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kHost:
      return "host";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

namespace {

// Runs and frees the boxed closure of Device::launch_host; a failed stream only frees it.
Status run_boxed_closure(void* user, const Status& upstream) {
  std::unique_ptr<std::function<Status()>> func(static_cast<std::function<Status()>*>(user));
  if (!upstream.is_ok()) return Status::ok();
  return (*func)();
}

}  // namespace

Status Device::launch_host(Stream& stream, std::function<Status()> func) {
  auto boxed = std::make_unique<std::function<Status()>>(std::move(func));
  Status status = launch_host_func(stream, &run_boxed_closure, boxed.get());
  if (status.is_ok()) (void)boxed.release();  // the stream owns it now
  return status;
}

}  // namespace zinf

namespace zinf {

#if !defined(ZINF_BUILDS_CUDA)
Result<std::unique_ptr<Device>> make_cuda_device(const CudaDeviceOptions& options) {
  return Status::unsupported(
      fmt::format("make_cuda_device({}): zinf was built without CUDA (configure with "
                  "-DZINF_WITH_CUDA=ON where nvcc is installed)",
                  options.ordinal));
}

Result<std::unique_ptr<Stream>> wrap_cuda_stream(Device& /*device*/, void* /*cuda_stream*/,
                                                 std::string_view name) {
  return Status::unsupported(
      fmt::format("wrap_cuda_stream('{}'): zinf was built without CUDA (configure with "
                  "-DZINF_WITH_CUDA=ON where nvcc is installed)",
                  name));
}
#endif

}  // namespace zinf
