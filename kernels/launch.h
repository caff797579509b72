// What every kernel launcher in kernels/ shares, without CUDA headers.
//
// A launcher enqueues its kernel on `stream` and returns at once. It never exits and never
// synchronises: it returns the cudaError_t of the launch as an int (0 is cudaSuccess), and the
// caller turns it into a Status in one place (status_from_cuda in lib/device/cuda_status.hpp).
// Errors that happen while the kernel runs surface later, on the stream's next synchronisation.
//
// Thread-safety: launchers are free functions with no state; any thread may call them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf::kernels {

// A cudaStream_t, passed opaquely so that callers need no CUDA headers. nullptr is the legacy
// default stream.
using Stream = void*;

// A cudaError_t as an int: 0 on success.
using LaunchError = int;

// The 16-bit floating-point formats a kernel may write (see include/zinf/dtype.hpp for the
// rounding: nearest, ties to even; NaN payloads kept).
enum class HalfType : int { kNone = 0, kBf16 = 1, kF16 = 2 };

}  // namespace zinf::kernels
