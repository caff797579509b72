// The C API of the backends in zinf::cuda (include/zinf/zinf.h): CudaDevice and NcclComm. Without
// them the core (lib/capi/capi.cpp) defines these as kUnsupported.
#include <fmt/format.h>

#include <chrono>
#include <memory>

#include "capi/capi_internal.hpp"
#include "zinf/zinf.h"

using zinf::Status;
using zinf::capi::guard;

zinf_code_t zinf_cuda_device_create(int ordinal, uint64_t memory_limit_bytes, zinf_device_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(zinf::capi::require(out, fn, "out"));
    zinf::CudaDeviceOptions options;
    options.memory_limit_bytes = memory_limit_bytes;
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<zinf::Device> device,
                          zinf::make_cuda_device(ordinal, options));
    auto handle = std::make_unique<zinf_device>();
    handle->device = std::move(device);
    *out = handle.release();
    return Status::ok();
  });
}

zinf_code_t zinf_engine_set_cuda_stream(zinf_engine_t* engine, void* cuda_stream) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(zinf::capi::require_engine(engine, fn));
    std::unique_ptr<zinf::Stream> stream;
    if (cuda_stream != nullptr) {
      ZINF_ASSIGN_OR_RETURN(zinf::Device * device, zinf::capi::device_of(engine, fn));
      ZINF_ASSIGN_OR_RETURN(stream, zinf::wrap_cuda_stream(*device, cuda_stream));
    }
    return zinf::capi::set_compute_stream(engine, std::move(stream));
  });
}

#if defined(ZINF_HAVE_NCCL)
zinf_code_t zinf_nccl_comm_group_create(zinf_device_t* device, void* nccl_comm, int take_ownership,
                                        int64_t init_timeout_ms, zinf_comm_group_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(zinf::capi::require(device, fn, "device"));
    ZINF_RETURN_IF_ERROR(zinf::capi::require(out, fn, "out"));
    if (init_timeout_ms < 0) {
      return Status::invalid_argument(
          fmt::format("{}: init_timeout_ms is {}; it must be >= 0", fn, init_timeout_ms));
    }
    zinf::NcclCommOptions options;
    if (init_timeout_ms > 0) options.init_timeout = std::chrono::milliseconds(init_timeout_ms);
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<zinf::Communicator> comm,
                          nccl_comm == nullptr ? zinf::make_nccl_comm(*device->device, options)
                                               : zinf::make_nccl_comm(nccl_comm, *device->device,
                                                                      take_ownership != 0));
    return zinf::capi::make_process_group(device, std::move(comm), out);
  });
}

#endif  // ZINF_HAVE_NCCL
