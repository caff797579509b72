// CudaDevice: the Device interface (include/zinf/device.hpp) on one CUDA GPU.
//
// Each Device call maps onto the CUDA call the interface names: streams are non-blocking
// cudaStreams, events are timing-free cudaEvents, allocate_async/free_async use the device's
// default stream-ordered pool (cudaMallocAsync), whose release threshold is raised so that memory
// freed in one step is reused in the next instead of going back to the driver. Host memory that
// copies read or write asynchronously is page-locked with register_host (cudaHostRegister): the
// PinnedPool registers its blocks once, so the block an NVMe read lands in is the source of the
// host-to-device copy, with no bounce buffer.
//
// Errors: every CUDA error becomes a Status through status_from_cuda. Differences from
// HostDevice a caller may notice: a kernel fault is sticky for the whole CUDA context, so every
// later call on this device returns it; an error returned by a host function is sticky for its
// stream (later host functions see it as `upstream`, synchronize() returns it), and wait() passes
// it to the waiting stream only if it was already set when wait() was called, since GPU work
// cannot be skipped after the fact. Timed waits poll (cudaEventQuery / cudaStreamQuery) with a
// backoff of at most 1 ms; untimed ones block in the driver.
//
// Thread-safety: as Device. Every call makes this device current on the calling thread first.
#pragma once

#if defined(ZINF_HAVE_CUDA)

#include <cstddef>
#include <cstdint>
#include <memory>

#include "zinf/device.hpp"

namespace zinf {

struct CudaDeviceOptions {
  // The CUDA device ordinal (LOCAL_RANK in a torchrun job).
  int ordinal = 0;
  // Most bytes allocate() and allocate_async() hand out together; beyond it kResourceExhausted.
  // 0: the GPU's total memory.
  std::size_t memory_limit_bytes = 0;
  // Bytes the stream-ordered pool keeps when memory is freed to it
  // (cudaMemPoolAttrReleaseThreshold). The default keeps everything: no allocation goes back to
  // the driver between steps.
  std::uint64_t pool_release_threshold_bytes = UINT64_MAX;
};

// Opens GPU `options.ordinal`. kUnsupported when there is no usable device (no driver, no GPU),
// kInvalidArgument for an ordinal out of range.
// REQUIRES: every stream and event it creates is destroyed before it.
Result<std::unique_ptr<Device>> make_cuda_device(const CudaDeviceOptions& options = {});

// Makes `device` current on the calling thread (cudaSetDevice), as every CudaDevice call does
// first, so that a kernel launched on one of its streams goes to that GPU. kInvalidArgument when
// `device` is not a CudaDevice.
Status make_cuda_device_current(Device& device);

}  // namespace zinf

#endif  // ZINF_HAVE_CUDA
