// The boundary of the C API (include/zinf/zinf.h): every exported function runs its body through
// guard(), which records the outcome as the calling thread's last error and turns any exception
// into a code, so that nothing is thrown across the ABI. Exposed here for the tests.
//
// Thread-safety: the last error is thread-local; guard() may run on any thread.
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/status.hpp"
#include "zinf/zinf.h"

namespace zinf {
class Engine;
}  // namespace zinf

// The handles of devices and communicator groups, shared with lib/capi/capi_cuda.cpp (the C API of
// the backends in zinf::cuda).
struct zinf_device {
  std::unique_ptr<zinf::Device> device;
  // Communicator groups and engines running on this device.
  std::atomic<int> users{0};
};

struct zinf_comm {
  zinf_comm_group* group = nullptr;
  zinf_device* device = nullptr;
  zinf::Communicator* comm = nullptr;
  // An open engine uses it: a second engine on the same communicator would interleave its
  // collectives with the first's. Set and cleared by the rank's own thread (zinf.h: each
  // communicator belongs to the one engine and thread of its rank).
  bool in_use = false;
};

struct zinf_comm_group {
  std::vector<zinf_device*> devices;
  std::vector<std::unique_ptr<zinf::Communicator>> comms;
  std::vector<zinf_comm> handles;  // one per rank of this process, pointing into comms
  // The job's ranks: handles[i] is rank first_rank + i of world_size (a LocalComm group holds all
  // of them; an MPI or NCCL group this process's one).
  int first_rank = 0;
  int world_size = 0;
  // Engines open on one of the communicators.
  std::atomic<int> users{0};
};

namespace zinf::capi {

// Stores `status` as this thread's last error and returns its code. Never throws: when the
// message cannot be stored (out of memory) a fixed message takes its place.
zinf_code_t record(const Status& status) noexcept;
// Stores an exception that reached the boundary: std::bad_alloc as ZINF_RESOURCE_EXHAUSTED,
// anything else as ZINF_INTERNAL, with `where` and the exception's what() in the message.
zinf_code_t record_exception(const char* where, std::exception_ptr error) noexcept;

// The Engine a C handle wraps (for tests that time the same engine through both APIs).
Engine* engine_of(zinf_engine_t* engine) noexcept;
// The engine's device, for zinf_engine_set_cuda_stream. kInvalidArgument naming `where` for the
// engine zinf_run_local lends a rank function: it runs on a host device of run_local's own, which
// takes no CUDA stream.
Result<Device*> device_of(zinf_engine_t* engine, const char* where);
// Engine::set_compute_stream(stream), the handle keeping `stream` (null: none) after it.
Status set_compute_stream(zinf_engine_t* engine, std::unique_ptr<Stream> stream);

// Takes `comm` (this process's one communicator of a job: MPI, NCCL) into a new group in *out.
Status make_process_group(zinf_device* device, std::unique_ptr<Communicator> comm,
                          zinf_comm_group_t** out);

// ok, or kInvalidArgument "<where>: <what> is null" for the null pointers C callers can pass.
Status require(const void* pointer, const char* where, const char* what);
// ok for an engine handle that is open (zinf_engine_open's until zinf_engine_close, or one
// zinf_run_local lends while its rank function runs); kInvalidArgument naming `where` for a null
// or closed one.
Status require_engine(const zinf_engine_t* engine, const char* where);

// Runs `body` (returning a Status) and records its outcome; `where` is the C function's name.
template <typename Body>
zinf_code_t guard(const char* where, Body&& body) noexcept {
  try {
    return record(std::forward<Body>(body)());
  } catch (...) {
    return record_exception(where, std::current_exception());
  }
}

}  // namespace zinf::capi
