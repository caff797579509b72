// The C API (include/zinf/zinf.h): handles that own the C++ objects, and one guarded forwarding
// function per C call. The layer adds only what C needs: null checks naming the argument, the
// thread-local last error, use counts that keep a device or a communicator group alive while
// something depends on it, and the element counts of registered parameters (to check the size
// of a caller's read buffer, which C cannot carry with the pointer).
//
// Longer than 800 lines on purpose: one short guarded forwarder per C entry point, each the same
// shape, read one at a time against zinf.h; split by object they would only move the shared
// guard and handle helpers into a header.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "capi/capi_internal.hpp"
#if defined(ZINF_HAVE_MPI)
#include "comm/mpi_comm.hpp"
#endif
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"
#include "zinf/run_local.hpp"
#include "zinf/trace.hpp"
#include "zinf/version.hpp"
#include "zinf/zinf.h"

// The C codes and dtypes are the C++ ones, value for value, so conversions are casts.
static_assert(ZINF_OK == static_cast<int>(zinf::Code::kOk));
static_assert(ZINF_INVALID_ARGUMENT == static_cast<int>(zinf::Code::kInvalidArgument));
static_assert(ZINF_NOT_FOUND == static_cast<int>(zinf::Code::kNotFound));
static_assert(ZINF_IO_ERROR == static_cast<int>(zinf::Code::kIoError));
static_assert(ZINF_CORRUPTION == static_cast<int>(zinf::Code::kCorruption));
static_assert(ZINF_NO_SPACE == static_cast<int>(zinf::Code::kNoSpace));
static_assert(ZINF_RESOURCE_EXHAUSTED == static_cast<int>(zinf::Code::kResourceExhausted));
static_assert(ZINF_TIMEOUT == static_cast<int>(zinf::Code::kTimeout));
static_assert(ZINF_UNSUPPORTED == static_cast<int>(zinf::Code::kUnsupported));
static_assert(ZINF_FAILED_PRECONDITION == static_cast<int>(zinf::Code::kFailedPrecondition));
static_assert(ZINF_DEVICE_ERROR == static_cast<int>(zinf::Code::kDeviceError));
static_assert(ZINF_COMM_ERROR == static_cast<int>(zinf::Code::kCommError));
static_assert(ZINF_ABORTED == static_cast<int>(zinf::Code::kAborted));
static_assert(ZINF_INTERNAL == static_cast<int>(zinf::Code::kInternal));
static_assert(ZINF_DTYPE_F32 == static_cast<int>(zinf::DType::kF32));
static_assert(ZINF_DTYPE_F16 == static_cast<int>(zinf::DType::kF16));
static_assert(ZINF_DTYPE_BF16 == static_cast<int>(zinf::DType::kBF16));

struct zinf_config {
  zinf::Config config;
};

struct zinf_trace {
  explicit zinf_trace(std::size_t max_events) : trace(max_events) {}
  zinf::Trace trace;
  // Engines recording into it.
  std::atomic<int> users{0};
};

// Hashes std::string and std::string_view alike, so that a map keyed by std::string is searched
// with a view of the caller's C string without making a std::string (an allocation for keys past
// the small-string size).
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept {
    return std::hash<std::string_view>{}(s);
  }
};

struct zinf_engine {
  // zinf_engine_set_cuda_stream's stream (a borrowed cudaStream_t); destroyed after the engine.
  std::unique_ptr<zinf::Stream> compute_stream;
  std::unique_ptr<zinf::Engine> engine;
  zinf_device* device = nullptr;
  zinf_comm_group* group = nullptr;
  zinf_comm* comm = nullptr;    // its in_use is this engine's while it is open
  zinf_trace* trace = nullptr;  // may be null
  // Lent to a rank function by zinf_run_local, which owns the engine, its device and its
  // communicator (none of them here): zinf_engine_close leaves it alone.
  bool lent() const { return group == nullptr; }
  // Element counts of the registered parameters, for read_parameters' buffer check.
  std::unordered_map<std::string, std::size_t> element_counts;
  // Reused by reduce_gradients so that a training loop allocates nothing after its first step.
  std::vector<zinf::GradientRef> gradient_refs;
  // Bytes of each activation saved and not loaded yet (0: none), for load_activation's buffer
  // check. Keys are kept once seen and searched without a copy (a training loop saves the same
  // keys every step), so a steady loop allocates nothing here after its first step.
  std::unordered_map<std::string, std::size_t, StringHash, std::equal_to<>> activation_bytes;
};

namespace zinf::capi {
namespace {

struct LastError {
  zinf_code_t code = ZINF_OK;
  int sys_code = 0;
  std::string message;
};

LastError& last_error() {
  thread_local LastError error;
  return error;
}

void store(zinf_code_t code, int sys_code, std::string_view message) noexcept {
  LastError& e = last_error();
  e.code = code;
  e.sys_code = sys_code;
  try {
    e.message.assign(message);
  } catch (...) {
    // The message did not fit in memory; keep the code and say so. shrink_to_fit() frees the
    // old buffer, after which the 13-character literal fits the small-string buffer (no
    // allocation in libstdc++ and libc++).
    e.message.clear();
    e.message.shrink_to_fit();
    try {
      e.message.assign("out of memory");
    } catch (...) {
    }
  }
}

// The engine handles that may be used now: zinf_engine_open's until zinf_engine_close, and the
// ones zinf_run_local lends while their rank function runs. A C program (or a binding's
// finalizer) that uses a handle after closing it, or closes it twice, gets
// ZINF_INVALID_ARGUMENT or a warning instead of a read of freed memory. Lookups take a shared
// lock and allocate nothing, so a training loop's calls stay allocation-free; only open and close
// write. A later open may reuse a closed handle's address, which then names the new engine: the
// check catches a stale handle until then, not forever.
class OpenEngines {
 public:
  void add(const zinf_engine* engine) {
    std::unique_lock lock(mu_);
    engines_.insert(engine);
  }
  bool remove(const zinf_engine* engine) {
    std::unique_lock lock(mu_);
    return engines_.erase(engine) != 0;
  }
  enum class Take { kTaken, kNotOpen, kLent };
  // Removes an open, unlent handle and says so; the check and the erase hold one lock, so of two
  // closes racing on one handle only one gets kTaken (and deletes it). A lent handle stays.
  Take take(const zinf_engine* engine) {
    std::unique_lock lock(mu_);
    const auto it = engines_.find(engine);
    if (it == engines_.end()) return Take::kNotOpen;
    if ((*it)->lent()) return Take::kLent;
    engines_.erase(it);
    return Take::kTaken;
  }
  bool contains(const zinf_engine* engine) const {
    std::shared_lock lock(mu_);
    return engines_.contains(engine);
  }

 private:
  mutable std::shared_mutex mu_;
  std::unordered_set<const zinf_engine*> engines_;
};

OpenEngines& open_engines() {
  // Never destroyed: a handle may be closed from another static object's destructor.
  static OpenEngines* engines = new OpenEngines;
  return *engines;
}

bool valid_dtype(zinf_dtype_t dtype) {
  return dtype == ZINF_DTYPE_F32 || dtype == ZINF_DTYPE_F16 || dtype == ZINF_DTYPE_BF16;
}

}  // namespace

Status require(const void* pointer, const char* where, const char* what) {
  if (pointer != nullptr) return Status::ok();
  return Status::invalid_argument(fmt::format("{}: {} is null", where, what));
}

zinf_code_t record(const Status& status) noexcept {
  const auto code = static_cast<zinf_code_t>(status.code());
  store(code, status.sys_code(), status.message());
  return code;
}

zinf_code_t record_exception(const char* where, std::exception_ptr error) noexcept {
  try {
    std::rethrow_exception(error);
  } catch (const std::bad_alloc& e) {
    store(ZINF_RESOURCE_EXHAUSTED, 0, "out of memory");
    // A second try with the context: the first store() made sure something is recorded.
    try {
      store(ZINF_RESOURCE_EXHAUSTED, 0, fmt::format("{}: out of memory ({})", where, e.what()));
    } catch (...) {
    }
    return ZINF_RESOURCE_EXHAUSTED;
  } catch (const std::exception& e) {
    try {
      store(ZINF_INTERNAL, 0, fmt::format("{}: unexpected exception: {}", where, e.what()));
    } catch (...) {
      store(ZINF_INTERNAL, 0, "unexpected exception");
    }
  } catch (...) {
    try {
      store(ZINF_INTERNAL, 0, fmt::format("{}: unexpected exception of unknown type", where));
    } catch (...) {
      store(ZINF_INTERNAL, 0, "unexpected exception");
    }
  }
  return ZINF_INTERNAL;
}

Status require_engine(const zinf_engine_t* engine, const char* where) {
  ZINF_RETURN_IF_ERROR(require(engine, where, "engine"));
  if (open_engines().contains(engine)) return Status::ok();
  return Status::invalid_argument(
      fmt::format("{}: engine {} is not open (zinf_engine_close closed it already, or it never "
                  "came from zinf_engine_open or zinf_run_local): use a handle only until its "
                  "close",
                  where, static_cast<const void*>(engine)));
}

Engine* engine_of(zinf_engine_t* engine) noexcept {
  return engine == nullptr ? nullptr : engine->engine.get();
}

Result<Device*> device_of(zinf_engine_t* engine, const char* where) {
  if (engine->device == nullptr) {
    return Status::invalid_argument(
        fmt::format("{}: the engine zinf_run_local lends runs on a host device; it takes no CUDA "
                    "stream",
                    where));
  }
  return engine->device->device.get();
}

Status set_compute_stream(zinf_engine_t* engine, std::unique_ptr<Stream> stream) {
  ZINF_RETURN_IF_ERROR(engine->engine->set_compute_stream(stream.get()));
  engine->compute_stream = std::move(stream);
  return Status::ok();
}

}  // namespace zinf::capi

using zinf::Status;
using zinf::capi::guard;
using zinf::capi::require;
using zinf::capi::require_engine;
using zinf::capi::valid_dtype;

// ---- Status ------------------------------------------------------------------------------------

const char* zinf_code_name(zinf_code_t code) {
  if (code < ZINF_OK || code > ZINF_INTERNAL) return "unknown";
  // code_name() returns views of string literals, so data() is NUL-terminated.
  return zinf::code_name(static_cast<zinf::Code>(code)).data();
}

zinf_code_t zinf_last_error_code(void) { return zinf::capi::last_error().code; }
int zinf_last_error_sys_code(void) { return zinf::capi::last_error().sys_code; }
const char* zinf_last_error_message(void) { return zinf::capi::last_error().message.c_str(); }

const char* zinf_version(void) { return zinf::version(); }
int zinf_c_abi_version(void) { return ZINF_C_ABI_VERSION; }

// ---- Config ------------------------------------------------------------------------------------

zinf_code_t zinf_config_from_json(const char* json, size_t json_bytes, zinf_config_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(json, fn, "json"));
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    ZINF_ASSIGN_OR_RETURN(zinf::Config config,
                          zinf::parse_config(std::string_view(json, json_bytes)));
    *out = new zinf_config{std::move(config)};
    return Status::ok();
  });
}

zinf_code_t zinf_config_load(const char* path, zinf_config_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(path, fn, "path"));
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    ZINF_ASSIGN_OR_RETURN(zinf::Config config, zinf::load_config(path));
    *out = new zinf_config{std::move(config)};
    return Status::ok();
  });
}

zinf_code_t zinf_config_to_json(const zinf_config_t* config, char* buffer, size_t buffer_bytes,
                                size_t* needed_bytes) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(config, fn, "config"));
    if (buffer_bytes > 0) ZINF_RETURN_IF_ERROR(require(buffer, fn, "buffer"));
    const std::string json = zinf::config_to_json(config->config);
    if (needed_bytes != nullptr) *needed_bytes = json.size() + 1;
    if (buffer_bytes < json.size() + 1) {
      return Status::resource_exhausted(fmt::format(
          "{}: the JSON needs {} bytes, the buffer holds {}", fn, json.size() + 1, buffer_bytes));
    }
    std::memcpy(buffer, json.c_str(), json.size() + 1);
    return Status::ok();
  });
}

void zinf_config_destroy(zinf_config_t* config) { delete config; }

// ---- Devices and communicators -----------------------------------------------------------------

zinf_code_t zinf_host_device_create(int ordinal, uint64_t memory_limit_bytes, zinf_device_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    zinf::HostDeviceOptions options;
    options.ordinal = ordinal;
    if (memory_limit_bytes != 0) options.memory_limit_bytes = memory_limit_bytes;
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<zinf::Device> device, zinf::make_host_device(options));
    auto handle = std::make_unique<zinf_device>();
    handle->device = std::move(device);
    *out = handle.release();
    return Status::ok();
  });
}

#if !defined(ZINF_BUILDS_CUDA)
// Without the CUDA backend; with it, zinf::cuda defines these (lib/capi/capi_cuda.cpp).
zinf_code_t zinf_cuda_device_create(int ordinal, uint64_t, zinf_device_t** out) {
  return guard(__func__, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(out, "zinf_cuda_device_create", "out"));
    return zinf::make_cuda_device(ordinal).status();
  });
}

zinf_code_t zinf_engine_set_cuda_stream(zinf_engine_t* engine, void* cuda_stream) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    if (cuda_stream == nullptr) return zinf::capi::set_compute_stream(engine, nullptr);
    ZINF_ASSIGN_OR_RETURN(zinf::Device * device, zinf::capi::device_of(engine, fn));
    return zinf::wrap_cuda_stream(*device, cuda_stream).status();
  });
}
#endif

zinf_code_t zinf_device_destroy(zinf_device_t* device) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    if (device == nullptr) return Status::ok();
    const int users = device->users.load();
    if (users > 0) {
      return Status::failed_precondition(
          fmt::format("{}: {} is still used by {} communicator group(s) or engine(s); destroy "
                      "them first",
                      fn, device->device->name(), users));
    }
    delete device;
    return Status::ok();
  });
}

zinf_code_t zinf_local_comm_group_create(zinf_device_t* const* devices, int world_size,
                                         int64_t timeout_ms, zinf_comm_group_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(devices, fn, "devices"));
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    if (world_size <= 0) {
      return Status::invalid_argument(
          fmt::format("{}: world_size is {}; it must be positive", fn, world_size));
    }
    if (timeout_ms < 0) {
      return Status::invalid_argument(
          fmt::format("{}: timeout_ms is {}; it must be >= 0", fn, timeout_ms));
    }
    auto group = std::make_unique<zinf_comm_group>();
    std::vector<zinf::Device*> raw;
    for (int r = 0; r < world_size; ++r) {
      zinf_device* d = devices[r];
      if (d == nullptr) {
        return Status::invalid_argument(fmt::format("{}: devices[{}] is null", fn, r));
      }
      group->devices.push_back(d);
      raw.push_back(d->device.get());
    }
    zinf::LocalCommOptions options;
    if (timeout_ms > 0) options.timeout = std::chrono::milliseconds(timeout_ms);
    ZINF_ASSIGN_OR_RETURN(group->comms, zinf::make_local_comm_group(raw, options));
    group->world_size = world_size;
    group->handles.resize(group->comms.size());
    for (std::size_t r = 0; r < group->comms.size(); ++r) {
      group->handles[r] = zinf_comm{group.get(), group->devices[r], group->comms[r].get()};
    }
    for (zinf_device* d : group->devices) d->users.fetch_add(1);
    *out = group.release();
    return Status::ok();
  });
}

namespace zinf::capi {

// A group holding this process's one communicator of a job (MPI, NCCL).
Status make_process_group(zinf_device* device, std::unique_ptr<zinf::Communicator> comm,
                          zinf_comm_group_t** out) {
  auto group = std::make_unique<zinf_comm_group>();
  group->first_rank = comm->rank();
  group->world_size = comm->world_size();
  group->devices.push_back(device);
  group->comms.push_back(std::move(comm));
  group->handles.push_back(zinf_comm{group.get(), device, group->comms[0].get()});
  device->users.fetch_add(1);
  *out = group.release();
  return Status::ok();
}

}  // namespace zinf::capi

zinf_code_t zinf_mpi_comm_group_create(zinf_device_t* device, const void* mpi_comm,
                                       int64_t timeout_ms, zinf_comm_group_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(device, fn, "device"));
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    if (timeout_ms < 0) {
      return Status::invalid_argument(
          fmt::format("{}: timeout_ms is {}; it must be >= 0", fn, timeout_ms));
    }
    zinf::MpiCommOptions options;
    if (timeout_ms > 0) options.timeout = std::chrono::milliseconds(timeout_ms);
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<zinf::Communicator> comm,
                          mpi_comm == nullptr
                              ? zinf::make_mpi_comm(*device->device, options)
                              : zinf::make_mpi_comm(mpi_comm, *device->device, options));
    return zinf::capi::make_process_group(device, std::move(comm), out);
  });
}

#if !defined(ZINF_BUILDS_NCCL)
// Without NCCL; with it, zinf::cuda defines this (lib/capi/capi_cuda.cpp).
zinf_code_t zinf_nccl_comm_group_create(zinf_device_t* device, void* nccl_comm, int, int64_t,
                                        zinf_comm_group_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(device, fn, "device"));
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    return zinf::make_nccl_comm(nccl_comm, *device->device, false).status();
  });
}
#endif

zinf_code_t zinf_comm_rank(const zinf_comm_t* comm, int* rank, int* world_size) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(comm, fn, "comm"));
    if (rank != nullptr) *rank = comm->comm->rank();
    if (world_size != nullptr) *world_size = comm->comm->world_size();
    return Status::ok();
  });
}

zinf_code_t zinf_comm_group_get(zinf_comm_group_t* group, int rank, zinf_comm_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(group, fn, "group"));
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    if (rank == ZINF_RANK_OF_THIS_PROCESS) {
      // A group of one process per rank holds this process's communicator only; a LocalComm
      // group of several ranks has no one rank of "this process".
      if (group->handles.size() != 1) {
        return Status::invalid_argument(fmt::format(
            "{}: rank -1 (ZINF_RANK_OF_THIS_PROCESS) asks for this process's rank in a group of "
            "one process per rank (MPI, NCCL); this group holds all {} ranks of the job: pass a "
            "rank in [0, {})",
            fn, group->handles.size(), group->handles.size()));
      }
      *out = &group->handles[0];
      return Status::ok();
    }
    const int last = group->first_rank + static_cast<int>(group->handles.size());
    if (rank < group->first_rank || rank >= last) {
      return Status::invalid_argument(
          group->handles.size() == static_cast<std::size_t>(group->world_size)
              ? fmt::format("{}: rank {} is outside [0, {})", fn, rank, group->handles.size())
              : fmt::format("{}: rank {} is not this process's; it holds rank {} of {}", fn, rank,
                            group->first_rank, group->world_size));
    }
    *out = &group->handles[static_cast<std::size_t>(rank - group->first_rank)];
    return Status::ok();
  });
}

zinf_code_t zinf_comm_group_world_size(const zinf_comm_group_t* group, int* world_size) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(group, fn, "group"));
    ZINF_RETURN_IF_ERROR(require(world_size, fn, "world_size"));
    *world_size = group->world_size;
    return Status::ok();
  });
}

zinf_code_t zinf_comm_group_destroy(zinf_comm_group_t* group) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    if (group == nullptr) return Status::ok();
    const int users = group->users.load();
    if (users > 0) {
      return Status::failed_precondition(fmt::format(
          "{}: {} engine(s) still use this group's communicators; close them first", fn, users));
    }
    // Collectives that MPI_Finalize, called before this, cut short or refused: the group is
    // destroyed all the same, and the code says that work was lost.
    Status lost;
#if defined(ZINF_HAVE_MPI)
    for (const std::unique_ptr<zinf::Communicator>& comm : group->comms) {
      if (lost.is_ok()) lost = zinf::mpi_finalize_losses(*comm);
    }
#endif
    // The communicators go first: they run on the devices.
    group->handles.clear();
    group->comms.clear();
    for (zinf_device* d : group->devices) d->users.fetch_sub(1);
    delete group;
    return lost;
  });
}

// ---- Traces ------------------------------------------------------------------------------------

zinf_code_t zinf_trace_create(size_t max_events, zinf_trace_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    *out = new zinf_trace(max_events == 0 ? std::size_t{1} << 20 : max_events);
    return Status::ok();
  });
}

int64_t zinf_trace_now_ns(void) { return zinf::Trace::now_ns(); }

zinf_code_t zinf_trace_add(zinf_trace_t* trace, const char* track, const char* name,
                           int64_t start_ns, int64_t end_ns) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(trace, fn, "trace"));
    ZINF_RETURN_IF_ERROR(require(track, fn, "track"));
    ZINF_RETURN_IF_ERROR(require(name, fn, "name"));
    if (end_ns < start_ns) {
      return Status::invalid_argument(
          fmt::format("{}: span \"{}\" ends ({} ns) before it starts "
                      "({} ns)",
                      fn, name, end_ns, start_ns));
    }
    trace->trace.add(trace->trace.track(track), name, start_ns, end_ns);
    return Status::ok();
  });
}

zinf_code_t zinf_trace_event_count(const zinf_trace_t* trace, size_t* kept, size_t* dropped) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(trace, fn, "trace"));
    if (kept != nullptr) *kept = trace->trace.event_count();
    if (dropped != nullptr) *dropped = trace->trace.dropped_count();
    return Status::ok();
  });
}

zinf_code_t zinf_trace_write_json(const zinf_trace_t* trace, const char* path) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(trace, fn, "trace"));
    ZINF_RETURN_IF_ERROR(require(path, fn, "path"));
    return trace->trace.write_json(path);
  });
}

zinf_code_t zinf_trace_destroy(zinf_trace_t* trace) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    if (trace == nullptr) return Status::ok();
    const int users = trace->users.load();
    if (users > 0) {
      return Status::failed_precondition(fmt::format(
          "{}: {} engine(s) still record into this trace; close them first", fn, users));
    }
    delete trace;
    return Status::ok();
  });
}

// ---- Engine ------------------------------------------------------------------------------------

zinf_code_t zinf_engine_open(const zinf_config_t* config, const zinf_env_t* env,
                             zinf_engine_t** out) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(config, fn, "config"));
    ZINF_RETURN_IF_ERROR(require(env, fn, "env"));
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    // Read only the bytes the caller's struct has; later fields keep their zero defaults.
    if (env->struct_size < offsetof(zinf_env_t, comm) + sizeof(env->comm)) {
      return Status::invalid_argument(fmt::format(
          "{}: env->struct_size is {}; set it to sizeof(zinf_env_t)", fn, env->struct_size));
    }
    zinf_env_t e{};
    std::memcpy(&e, env, std::min(env->struct_size, sizeof(zinf_env_t)));
    ZINF_RETURN_IF_ERROR(require(e.device, fn, "env->device"));
    ZINF_RETURN_IF_ERROR(require(e.comm, fn, "env->comm"));
    if (e.comm->device != e.device) {
      return Status::invalid_argument(fmt::format("{}: env->comm runs on {}, not on env->device {}",
                                                  fn, e.comm->device->device->name(),
                                                  e.device->device->name()));
    }
    if (e.comm->in_use) {
      return Status::failed_precondition(fmt::format(
          "{}: env->comm ({}) is used by another open engine; each communicator serves one "
          "engine at a time (two would interleave their collectives): close that engine first, "
          "or give this one a communicator of its own",
          fn, e.comm->comm->name()));
    }
    zinf::Env cpp_env;
    cpp_env.device = e.device->device.get();
    cpp_env.comm = e.comm->comm;
    if (e.nvme_path_count > 0) {
      ZINF_RETURN_IF_ERROR(require(e.nvme_paths, fn, "env->nvme_paths"));
      for (std::size_t i = 0; i < e.nvme_path_count; ++i) {
        if (e.nvme_paths[i] == nullptr) {
          return Status::invalid_argument(fmt::format("{}: env->nvme_paths[{}] is null", fn, i));
        }
        cpp_env.nvme_paths.emplace_back(e.nvme_paths[i]);
      }
    }
    if (e.trace != nullptr) cpp_env.trace = &e.trace->trace;
    auto handle = std::make_unique<zinf_engine>();
    ZINF_ASSIGN_OR_RETURN(handle->engine, zinf::Engine::open(config->config, cpp_env));
    handle->device = e.device;
    handle->group = e.comm->group;
    handle->comm = e.comm;
    handle->trace = e.trace;
    // add() may throw (bad_alloc): before the counts below are raised, so a throw leaves none up.
    zinf::capi::open_engines().add(handle.get());
    handle->comm->in_use = true;
    handle->device->users.fetch_add(1);
    handle->group->users.fetch_add(1);
    if (handle->trace != nullptr) handle->trace->users.fetch_add(1);
    *out = handle.release();
    return Status::ok();
  });
}

void zinf_engine_close(zinf_engine_t* engine) {
  if (engine == nullptr) return;
  // Looked up before the handle is read: a closed one is freed memory.
  const auto taken = zinf::capi::open_engines().take(engine);
  if (taken == zinf::capi::OpenEngines::Take::kNotOpen) {
    zinf::log_warn("zinf_engine_close: engine {} is not open (closed twice?); nothing done",
                   static_cast<const void*>(engine));
    return;
  }
  if (taken == zinf::capi::OpenEngines::Take::kLent) return;
  // The engine's destructor joins its threads and frees device memory; it does not throw.
  engine->engine.reset();
  engine->comm->in_use = false;
  engine->group->users.fetch_sub(1);
  engine->device->users.fetch_sub(1);
  if (engine->trace != nullptr) engine->trace->users.fetch_sub(1);
  delete engine;
}

zinf_code_t zinf_engine_rank(const zinf_engine_t* engine, int* rank) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(rank, fn, "rank"));
    *rank = engine->engine->rank();
    return Status::ok();
  });
}

zinf_code_t zinf_engine_world_size(const zinf_engine_t* engine, int* world_size) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(world_size, fn, "world_size"));
    *world_size = engine->engine->world_size();
    return Status::ok();
  });
}

namespace {

// The checks and the bookkeeping of both registration functions; `spec` holds the initial values
// or the initializer.
Status register_spec(zinf_engine_t* engine, const char* fn, const char* name, const char* module,
                     const int64_t* shape, size_t ndim, zinf_dtype_t dtype,
                     zinf::ParameterSpec& spec) {
  ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
  ZINF_RETURN_IF_ERROR(require(name, fn, "name"));
  ZINF_RETURN_IF_ERROR(require(module, fn, "module"));
  if (ndim > 0 && shape == nullptr) {
    return Status::invalid_argument(
        fmt::format("{}: parameter \"{}\": shape is null with ndim {}", fn, name, ndim));
  }
  if (!valid_dtype(dtype)) {
    return Status::invalid_argument(
        fmt::format("{}: parameter \"{}\": dtype {} is not f32 (0), "
                    "f16 (1) or bf16 (2)",
                    fn, name, static_cast<int>(dtype)));
  }
  spec.name = name;
  spec.module = module;
  spec.shape.assign(shape, shape + ndim);
  spec.dtype = static_cast<zinf::DType>(dtype);
  // Reserve the map entry first, so that a registration the engine accepted is always known
  // here (the engine has no "unregister" to undo it if this allocation failed after).
  engine->element_counts.reserve(engine->element_counts.size() + 1);
  ZINF_RETURN_IF_ERROR(engine->engine->register_parameter(spec));
  std::size_t element_count = 1;
  for (std::int64_t d : spec.shape) element_count *= static_cast<std::size_t>(d);
  engine->element_counts[spec.name] = element_count;
  return Status::ok();
}

// A C initializer as the engine's. A C function cannot carry a message: the code comes back with
// one that names it, and the engine adds the parameter and the elements.
zinf::ParameterInitializer c_initializer(zinf_initializer_fn initializer, void* user) {
  return [initializer, user](std::size_t first_element, std::size_t element_count,
                             float* out) -> Status {
    const zinf_code_t code = initializer(user, first_element, element_count, out);
    if (code == ZINF_OK) return Status::ok();
    const bool known = code > ZINF_OK && code <= ZINF_INTERNAL;
    return Status(known ? static_cast<zinf::Code>(code) : zinf::Code::kInternal, 0,
                  fmt::format("the C initializer returned code {}", static_cast<int>(code)));
  };
}

}  // namespace

zinf_code_t zinf_engine_register_parameter(zinf_engine_t* engine, const char* name,
                                           const char* module, const int64_t* shape, size_t ndim,
                                           zinf_dtype_t dtype, const float* initial_values) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    zinf::ParameterSpec spec;
    spec.initial_values = initial_values;
    return register_spec(engine, fn, name, module, shape, ndim, dtype, spec);
  });
}

zinf_code_t zinf_engine_register_parameter_with_initializer(
    zinf_engine_t* engine, const char* name, const char* module, const int64_t* shape, size_t ndim,
    zinf_dtype_t dtype, zinf_initializer_fn initializer, void* user) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    if (initializer == nullptr) {
      // Named here: the engine would say "neither of initial_values and initializer".
      return Status::invalid_argument(fmt::format("{}: parameter \"{}\": initializer is null", fn,
                                                  name != nullptr ? name : "(null)"));
    }
    zinf::ParameterSpec spec;
    spec.initializer = c_initializer(initializer, user);
    return register_spec(engine, fn, name, module, shape, ndim, dtype, spec);
  });
}

zinf_code_t zinf_engine_add_param_group(zinf_engine_t* engine, const char* name,
                                        double weight_decay, double lr_scale) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(name, fn, "name"));
    return engine->engine->add_param_group({name, weight_decay, lr_scale});
  });
}

zinf_code_t zinf_engine_register_parameter_in_group(zinf_engine_t* engine, const char* name,
                                                    const char* module, const int64_t* shape,
                                                    size_t ndim, zinf_dtype_t dtype,
                                                    const char* group, const float* initial_values,
                                                    zinf_initializer_fn initializer, void* user) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(group, fn, "group"));
    if ((initial_values == nullptr) == (initializer == nullptr)) {
      return Status::invalid_argument(
          fmt::format("{}: parameter \"{}\": give exactly one of initial_values and initializer",
                      fn, name != nullptr ? name : "(null)"));
    }
    zinf::ParameterSpec spec;
    spec.group = group;
    spec.initial_values = initial_values;
    if (initializer != nullptr) spec.initializer = c_initializer(initializer, user);
    return register_spec(engine, fn, name, module, shape, ndim, dtype, spec);
  });
}

zinf_code_t zinf_engine_finalize(zinf_engine_t* engine) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    return engine->engine->finalize();
  });
}

zinf_code_t zinf_engine_gather(zinf_engine_t* engine, const char* module) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(module, fn, "module"));
    return engine->engine->gather(module);
  });
}

zinf_code_t zinf_engine_release(zinf_engine_t* engine, const char* module) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(module, fn, "module"));
    return engine->engine->release(module);
  });
}

zinf_code_t zinf_engine_parameter(zinf_engine_t* engine, const char* name, void** data,
                                  zinf_dtype_t* dtype, size_t* element_count) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(name, fn, "name"));
    ZINF_ASSIGN_OR_RETURN(zinf::TensorView view, engine->engine->parameter(name));
    if (data != nullptr) *data = view.data;
    if (dtype != nullptr) *dtype = static_cast<zinf_dtype_t>(view.dtype);
    if (element_count != nullptr) *element_count = view.element_count;
    return Status::ok();
  });
}

zinf_code_t zinf_engine_reduce_gradients(zinf_engine_t* engine, const char* module,
                                         const zinf_gradient_t* gradients, size_t gradient_count) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(module, fn, "module"));
    if (gradient_count > 0) ZINF_RETURN_IF_ERROR(require(gradients, fn, "gradients"));
    std::vector<zinf::GradientRef>& refs = engine->gradient_refs;
    refs.clear();
    for (std::size_t i = 0; i < gradient_count; ++i) {
      const zinf_gradient_t& g = gradients[i];
      if (g.name == nullptr) {
        return Status::invalid_argument(
            fmt::format("{}: module \"{}\": gradients[{}].name is null", fn, module, i));
      }
      if (!valid_dtype(g.dtype)) {
        return Status::invalid_argument(
            fmt::format("{}: gradient of \"{}\": dtype {} is not f32 (0), f16 (1) or bf16 (2)", fn,
                        g.name, static_cast<int>(g.dtype)));
      }
      refs.push_back({g.name, g.data, g.element_count, static_cast<zinf::DType>(g.dtype)});
    }
    return engine->engine->reduce_gradients(module, refs);
  });
}

namespace {

// zinf_engine_step and zinf_engine_step_average, named `fn` in errors.
zinf_code_t engine_step(const char* fn, zinf_engine_t* engine, int32_t average_over,
                        zinf_step_report_t* report) {
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    if (report != nullptr && report->struct_size < sizeof(report->struct_size)) {
      return Status::invalid_argument(
          fmt::format("{}: report->struct_size is {}; set it to sizeof(zinf_step_report_t)", fn,
                      report->struct_size));
    }
    if (average_over < 0) {
      return Status::invalid_argument(
          fmt::format("{}: average_over is {}; it must be >= 0", fn, average_over));
    }
    ZINF_ASSIGN_OR_RETURN(zinf::StepReport r, engine->engine->step(average_over));
    if (report == nullptr) return Status::ok();
    zinf_step_report_t full{};
    full.struct_size = report->struct_size;
    full.step = r.step;
    full.skipped = r.skipped ? 1 : 0;
    full.micro_batches = r.micro_batches;
    full.loss_scale = r.loss_scale;
    full.next_loss_scale = r.next_loss_scale;
    full.grad_norm = r.grad_norm;
    full.clip_coef = r.clip_coef;
    full.reduce_ns = r.reduce_ns;
    full.norm_ns = r.norm_ns;
    full.optimizer_ns = r.optimizer_ns;
    full.publish_ns = r.publish_ns;
    full.wall_ns = r.wall_ns;
    full.optimizer_nvme_read_bytes = r.optimizer_nvme_read_bytes;
    full.optimizer_nvme_write_bytes = r.optimizer_nvme_write_bytes;
    full.param_nvme_write_bytes = r.param_nvme_write_bytes;
    full.master_nvme_read_bytes = r.master_nvme_read_bytes;
    full.overlapped = r.overlapped ? 1 : 0;
    full.in_backward = r.in_backward ? 1 : 0;
    full.hidden_ns = r.hidden_ns;
    full.gather_wait_ns = r.gather_wait_ns;
    full.read_ahead = r.read_ahead ? 1 : 0;
    // An older caller's struct is a prefix of ours: write only what it has.
    std::memcpy(report, &full, std::min(report->struct_size, sizeof(full)));
    return Status::ok();
  });
}

}  // namespace

zinf_code_t zinf_engine_step(zinf_engine_t* engine, zinf_step_report_t* report) {
  return engine_step(__func__, engine, 0, report);
}

zinf_code_t zinf_engine_step_average(zinf_engine_t* engine, int32_t average_over,
                                     zinf_step_report_t* report) {
  return engine_step(__func__, engine, average_over, report);
}

zinf_code_t zinf_engine_save_checkpoint_tag(zinf_engine_t* engine, const char* dir,
                                            const char* tag) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(dir, fn, "dir"));
    if (tag == nullptr) return engine->engine->save_checkpoint(dir);
    return engine->engine->save_checkpoint(dir, tag);
  });
}

zinf_code_t zinf_engine_save_checkpoint(zinf_engine_t* engine, const char* dir) {
  return zinf_engine_save_checkpoint_tag(engine, dir, nullptr);
}

zinf_code_t zinf_engine_load_checkpoint_tag(zinf_engine_t* engine, const char* dir,
                                            const char* tag) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(dir, fn, "dir"));
    return engine->engine->load_checkpoint(dir, tag == nullptr ? "" : tag);
  });
}

zinf_code_t zinf_engine_load_checkpoint(zinf_engine_t* engine, const char* dir) {
  return zinf_engine_load_checkpoint_tag(engine, dir, nullptr);
}

zinf_code_t zinf_engine_applied_steps(const zinf_engine_t* engine, int64_t* applied_steps) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(applied_steps, fn, "applied_steps"));
    *applied_steps = engine->engine->applied_steps();
    return Status::ok();
  });
}

zinf_code_t zinf_engine_set_client_state(zinf_engine_t* engine, const void* data, size_t bytes) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    if (bytes > 0) ZINF_RETURN_IF_ERROR(require(data, fn, "data"));
    engine->engine->set_client_state(
        bytes == 0 ? std::string_view() : std::string_view(static_cast<const char*>(data), bytes));
    return Status::ok();
  });
}

zinf_code_t zinf_engine_client_state(const zinf_engine_t* engine, const void** data,
                                     size_t* bytes) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    const std::string& blob = engine->engine->client_state();
    if (data != nullptr) *data = blob.data();
    if (bytes != nullptr) *bytes = blob.size();
    return Status::ok();
  });
}

zinf_code_t zinf_engine_read_parameters(zinf_engine_t* engine, const char* name, float* out,
                                        size_t out_count) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(name, fn, "name"));
    ZINF_RETURN_IF_ERROR(require(out, fn, "out"));
    const auto it = engine->element_counts.find(name);
    if (it == engine->element_counts.end()) {
      return Status::not_found(fmt::format("{}: no parameter \"{}\"", fn, name));
    }
    if (out_count != it->second) {
      return Status::invalid_argument(fmt::format(
          "{}: parameter \"{}\" has {} elements; out holds {}", fn, name, it->second, out_count));
    }
    return engine->engine->read_parameters(name, out);
  });
}

zinf_code_t zinf_engine_loss_scale(const zinf_engine_t* engine, double* loss_scale) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(loss_scale, fn, "loss_scale"));
    *loss_scale = engine->engine->loss_scale();
    return Status::ok();
  });
}

zinf_code_t zinf_engine_set_learning_rate(zinf_engine_t* engine, double learning_rate) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    // The engine refuses such a rate too; this message names the C parameter.
    if (!std::isfinite(learning_rate) || learning_rate < 0) {
      return Status::invalid_argument(
          fmt::format("{}: learning_rate {} is not a finite number >= 0", fn, learning_rate));
    }
    return engine->engine->set_learning_rate(learning_rate);
  });
}

zinf_code_t zinf_engine_counters(const zinf_engine_t* engine, zinf_engine_counters_t* counters) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(counters, fn, "counters"));
    if (counters->struct_size < sizeof(counters->struct_size)) {
      return Status::invalid_argument(
          fmt::format("{}: counters->struct_size is {}; set it to sizeof(zinf_engine_counters_t)",
                      fn, counters->struct_size));
    }
    const zinf::EngineCounters& c = engine->engine->counters();
    zinf_engine_counters_t full{};
    full.struct_size = counters->struct_size;
    full.gathers = c.gathers;
    full.gathers_issued = c.gathers_issued;
    full.prefetches_issued = c.prefetches_issued;
    full.prefetch_hits = c.prefetch_hits;
    full.prefetches_dropped = c.prefetches_dropped;
    full.order_misses = c.order_misses;
    full.live_elements = c.live_elements;
    full.live_elements_peak = c.live_elements_peak;
    full.persistent_elements = c.persistent_elements;
    full.all_gather_bytes = c.all_gather_bytes;
    full.reduce_scatter_bytes = c.reduce_scatter_bytes;
    full.buckets_reduced = c.buckets_reduced;
    full.param_nvme_read_bytes = c.param_nvme_read_bytes;
    full.param_nvme_write_bytes = c.param_nvme_write_bytes;
    full.steps = c.steps;
    full.skipped_steps = c.skipped_steps;
    std::memcpy(counters, &full, std::min(counters->struct_size, sizeof(full)));
    return Status::ok();
  });
}

zinf_code_t zinf_engine_memory(const zinf_engine_t* engine, zinf_memory_report_t* report) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(report, fn, "report"));
    if (report->struct_size < sizeof(report->struct_size)) {
      return Status::invalid_argument(
          fmt::format("{}: report->struct_size is {}; set it to sizeof(zinf_memory_report_t)", fn,
                      report->struct_size));
    }
    if (!engine->engine->finalized()) {
      return Status::failed_precondition(
          fmt::format("{}: the engine is not finalized (its buffers are sized at finalize)", fn));
    }
    const zinf::MemoryReport m = engine->engine->memory();
    zinf_memory_report_t full{};
    full.struct_size = report->struct_size;
    full.device_bytes = m.device_bytes;
    full.host_bytes = m.host_bytes;
    full.nvme_bytes = m.nvme_bytes;
    full.activation_device_bytes_peak = m.activation_device_bytes_peak;
    full.activation_host_bytes = m.activation_host_bytes;
    full.activation_nvme_bytes = m.activation_nvme_bytes;
    full.activation_nvme_write_bytes = m.activation_nvme_write_bytes;
    full.activation_nvme_read_bytes = m.activation_nvme_read_bytes;
    std::memcpy(report, &full, std::min(report->struct_size, sizeof(full)));
    return Status::ok();
  });
}

// ---- Activation checkpoints --------------------------------------------------------------------

zinf_code_t zinf_engine_save_activation(zinf_engine_t* engine, const char* key, const void* data,
                                        size_t bytes) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(key, fn, "key"));
    // The engine refuses a null pointer and 0 bytes naming the key; an entry is made (or
    // reused) first so that a saved key always has one.
    auto it = engine->activation_bytes.find(std::string_view(key));
    if (it == engine->activation_bytes.end()) it = engine->activation_bytes.emplace(key, 0).first;
    ZINF_RETURN_IF_ERROR(engine->engine->save_activation(key, data, bytes));
    it->second = bytes;
    return Status::ok();
  });
}

zinf_code_t zinf_engine_load_activation(zinf_engine_t* engine, const char* key, void* data,
                                        size_t data_bytes) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    ZINF_RETURN_IF_ERROR(require(key, fn, "key"));
    const auto it = engine->activation_bytes.find(std::string_view(key));
    // A key never saved, or loaded already: the engine's kNotFound names it.
    if (it != engine->activation_bytes.end() && it->second != 0 && it->second != data_bytes) {
      return Status::invalid_argument(fmt::format(
          "{}('{}'): data holds {} bytes, the activation {}", fn, key, data_bytes, it->second));
    }
    ZINF_RETURN_IF_ERROR(engine->engine->load_activation(key, data));
    if (it != engine->activation_bytes.end()) it->second = 0;
    return Status::ok();
  });
}

zinf_code_t zinf_engine_flush_activations(zinf_engine_t* engine) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    return engine->engine->flush_activations();
  });
}

zinf_code_t zinf_engine_set_activation_bytes(zinf_engine_t* engine, uint64_t device_bytes) {
  const char* const fn = __func__;
  return guard(fn, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require_engine(engine, fn));
    engine->engine->set_activation_bytes(device_bytes);
    return Status::ok();
  });
}

// ---- Ranks as threads --------------------------------------------------------------------------

zinf_code_t zinf_run_local(int world_size, const zinf_config_t* config, zinf_rank_fn fn,
                           void* user) {
  const char* const where = __func__;
  return guard(where, [&]() -> Status {
    ZINF_RETURN_IF_ERROR(require(config, where, "config"));
    if (fn == nullptr) return Status::invalid_argument(fmt::format("{}: fn is null", where));
    return zinf::run_local(world_size, config->config, [&](zinf::Engine& engine, int rank) {
      // A handle that borrows the rank's engine: run_local owns and destroys it.
      zinf_engine handle;
      handle.engine.reset(&engine);
      struct Unborrow {
        zinf_engine& handle;
        ~Unborrow() {
          zinf::capi::open_engines().remove(&handle);
          static_cast<void>(handle.engine.release());
        }
      } unborrow{handle};
      // Added once unborrow exists: should add() throw (bad_alloc), the handle still gives the
      // engine back instead of deleting run_local's.
      zinf::capi::open_engines().add(&handle);
      const zinf_code_t code = fn(user, &handle, rank);
      if (code == ZINF_OK) return Status::ok();
      if (code < ZINF_OK || code > ZINF_INTERNAL) {
        return Status::internal(fmt::format("the rank function returned {}, not a zinf_code_t",
                                            static_cast<int>(code)));
      }
      // The message of this thread's last failed call, when it is the error fn passes on.
      const zinf::capi::LastError& last = zinf::capi::last_error();
      if (last.code == code && !last.message.empty()) {
        return Status(static_cast<zinf::Code>(code), last.sys_code, last.message);
      }
      return Status(static_cast<zinf::Code>(code), 0,
                    fmt::format("the rank function returned {}", zinf_code_name(code)));
    });
  });
}
