// The one place a cudaError_t becomes a Status (lib/device/cuda_status_cuda.cpp). The header
// needs no CUDA headers, so kernel launchers' results (kernels/launch.h: an int) convert too.
#pragma once

#include <string_view>

#include "zinf/status.hpp"

namespace zinf {

// OK for 0 (cudaSuccess). Otherwise "<context>: <cudaGetErrorName>: <cudaGetErrorString>" with
// sys_code() = err and the code: kResourceExhausted for out-of-memory, kUnsupported (sys_code 0,
// as Status prints that code's sys_code as an errno) when there is no device or the driver is too
// old, kDeviceError for everything else.
Status status_from_cuda(std::string_view context, int err);

}  // namespace zinf
