// DeviceOps: the element-wise work the engine does on device memory, as stream operations.
//
// On a host-accessible device (HostDevice) the engine's reducer widens gradients into its fp32
// buckets with host code. On a device whose memory host code cannot touch (CudaDevice, or a
// HostDevice made opaque for tests) the same work is enqueued on a stream through this
// interface, in stream order with the copies and collectives around it:
//
//   widen       dst[i] = float(src[i]), or dst[i] += float(src[i]), for f32 / bf16 / f16 sources
//               (kernels/widen.h): a bucket filled from the gradients, micro-batches added into
//               stage 1's full-size fp32 gradients, and (f32 source with accumulate) an f32 add.
//   scale       x[i] *= factor, flagging inf/NaN (kernels/unscale.h): the step's gradient scale.
//   sum_of_squares  sum x[i]^2 as one float (kernels/sq_norm.h): the gradient norm. On CUDA each
//               block sums its share in fp32 and the block partials are added in fp64; the
//               HostDevice ops use the scalar reference, which sums in fp64 throughout.
//   adam_step   Adam / AdamW over state in device memory, writing the bf16/f16 copy in the same
//               pass (kernels/adam.h): the optimizer of offload_optimizer "none".
//   narrow      dst[i] = round(src[i]) to bf16 / f16, ties to even (kernels/cast.h; an f32
//               destination is a copy): the half copy of frozen runs, which no step writes,
//               rounded from the master as adam_step rounds its output.
//
// Fills are Device::memset_async and moves are Device::copy_async; what comes back to the host
// (reduced gradient chunks, bound for the fp32 accumulator in host memory or on NVMe) comes
// through a RegisteredBuffer (pinned on CUDA) by copy_d2h.
//
// Implementations: for CudaDevice the kernels of kernels/ on the stream's cudaStream_t (launch
// errors become a Status through status_from_cuda); for HostDevice, opaque or not, the kernels'
// scalar references (kernels/*_ref.cpp, the ground truth the kernels are tested against) run as
// host functions in stream order on the memory's host addresses, so both give the same bits.
//
// Thread-safety: as Device (any thread); the ops hold no state between calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "base/aligned.hpp"
#include "kernels/adam.h"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/status.hpp"

namespace zinf {

// The kernels' name for a parameter dtype (f32: kNone).
kernels::HalfType kernel_half_type(DType dtype);

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  DeviceOps(const DeviceOps&) = delete;
  DeviceOps& operator=(const DeviceOps&) = delete;

  // Enqueues dst[i] = float(src[i]) (accumulate: dst[i] += float(src[i]), one f32 addition) for
  // i < count on `stream`. `src` holds `src_dtype` elements; both are device pointers.
  // REQUIRES: the ranges do not overlap and stay valid until the stream has run the op.
  virtual Status widen(const void* src, DType src_dtype, float* dst, std::size_t count,
                       bool accumulate, Stream& stream) = 0;
  // Enqueues x[i] *= factor for i < count; sets *found_inf (device int32) to 1 when an input is
  // inf or NaN, never clears it.
  virtual Status scale(float* x, std::size_t count, float factor, std::int32_t* found_inf,
                       Stream& stream) = 0;
  // Enqueues *out = sum x[i]^2 (deterministic for a given count; block sums in fp32 on CUDA,
  // added in fp64, rounded to float once; a sum beyond FLT_MAX is inf, read as an overflow).
  // `partials` is kernels::kSqNormPartials floats of device scratch, `out` one device float.
  virtual Status sum_of_squares(const float* x, std::size_t count, float* partials, float* out,
                                Stream& stream) = 0;
  // Enqueues dst[i] = src[i] rounded to `dst_dtype` for i < count on `stream`: bf16 and f16
  // round to nearest with ties to even, overflow to infinity of the same sign, f16 keeps
  // subnormals, a NaN keeps its sign and top payload bits (zinf::f32_to_bf16 / f32_to_f16, the
  // rounding adam_step gives its half copy); f32 copies. Both are device pointers.
  // REQUIRES: the ranges do not overlap and stay valid until the stream has run the op.
  virtual Status narrow(const float* src, DType dst_dtype, void* dst, std::size_t count,
                        Stream& stream) = 0;
  // Enqueues one Adam/AdamW step (kernels/adam.h) over `count` elements of device memory; with
  // half_dtype bf16 or f16 the new parameters are also written, rounded, to `param_half`
  // (half_dtype kF32: no copy, param_half may be null).
  virtual Status adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                           void* param_half, DType half_dtype, std::size_t count,
                           const kernels::AdamStepArgs& args, Stream& stream) = 0;

 protected:
  DeviceOps() = default;
};

// The ops of `device`: kernels on a CudaDevice, the scalar references on a HostDevice.
// kUnsupported for any other device (or a CudaDevice in a build without CUDA).
Result<std::unique_ptr<DeviceOps>> make_device_ops(Device& device);

// Makes the ops of a device that is not a HostDevice, or returns null when it is not its kind.
using DeviceOpsFactory = std::unique_ptr<DeviceOps> (*)(Device& device);
// Installs the factory make_device_ops() asks for devices that are not HostDevices. The CUDA
// backend (zinf::cuda, lib/device/device_ops_cuda.cpp) installs its own when make_cuda_device()
// makes a device, so the core library refers to no CUDA symbol and links without the toolkit.
// Thread-safety: any thread.
void set_device_ops_factory(DeviceOpsFactory factory);

// Host memory registered with a device (cudaHostRegister on CUDA: page-locked, so copies to and
// from it are truly asynchronous) for as long as it lives.
// Thread-safety: a value; not shared.
class RegisteredBuffer {
 public:
  RegisteredBuffer() = default;
  RegisteredBuffer(RegisteredBuffer&& other) noexcept
      : device_(std::exchange(other.device_, nullptr)), buffer_(std::move(other.buffer_)) {}
  RegisteredBuffer& operator=(RegisteredBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      device_ = std::exchange(other.device_, nullptr);
      buffer_ = std::move(other.buffer_);
    }
    return *this;
  }
  RegisteredBuffer(const RegisteredBuffer&) = delete;
  RegisteredBuffer& operator=(const RegisteredBuffer&) = delete;
  ~RegisteredBuffer() { reset(); }

  // `bytes` (rounded up to whole pages) of page-aligned host memory registered with `device`.
  static Result<RegisteredBuffer> allocate(Device& device, std::size_t bytes);

  std::byte* data() { return buffer_.data(); }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(buffer_.data());
  }
  std::size_t bytes() const { return buffer_.bytes(); }
  // Unregisters and frees. REQUIRES: no issued copy still uses the memory.
  void reset();

 private:
  Device* device_ = nullptr;
  AlignedBuffer buffer_;
};

}  // namespace zinf
