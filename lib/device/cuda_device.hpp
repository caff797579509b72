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

// CudaDeviceOptions and make_cuda_device are public (include/zinf/device.hpp).

// Makes `device` current on the calling thread (cudaSetDevice), as every CudaDevice call does
// first, so that a kernel launched on one of its streams goes to that GPU. kInvalidArgument when
// `device` is not a CudaDevice.
Status make_cuda_device_current(Device& device);

}  // namespace zinf

#endif  // ZINF_HAVE_CUDA
