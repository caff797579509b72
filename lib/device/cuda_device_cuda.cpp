// CudaDevice (see cuda_device.hpp).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "base/assert.hpp"
#include "device/cuda_device.hpp"
#include "device/cuda_status.hpp"
#include "device/device_ops.hpp"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;

// status_from_cuda, formatting the context only on failure (the success path allocates nothing).
template <typename... Args>
Status cuda_status(cudaError_t err, fmt::format_string<Args...> format, Args&&... args) {
  if (err == cudaSuccess) return Status::ok();
  return status_from_cuda(fmt::format(format, std::forward<Args>(args)...), err);
}

class CudaStream final : public Stream {
 public:
  // `owned`: made by create_stream; else a caller's stream (wrap_cuda_stream), left alone.
  CudaStream(std::string name, cudaStream_t handle, bool owned = true)
      : name_(std::move(name)), handle_(handle), owned_(owned) {}
  ~CudaStream() override {
    if (!owned_) return;
    // The interface promises that destroying a stream waits for its queued work.
    (void)cudaStreamSynchronize(handle_);
    (void)cudaStreamDestroy(handle_);
  }
  std::string_view name() const override { return name_; }
  void* native_handle() const override { return handle_; }

  cudaStream_t handle() const { return handle_; }
  Status error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  void set_error(const Status& error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.is_ok()) error_ = error;
  }

 private:
  std::string name_;
  cudaStream_t handle_;
  bool owned_;
  mutable std::mutex mu_;
  Status error_;  // sticky: the first error a host function returned on this stream
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(cudaEvent_t handle) : handle_(handle) {}
  ~CudaEvent() override { (void)cudaEventDestroy(handle_); }
  void* native_handle() const override { return handle_; }

  cudaEvent_t handle() const { return handle_; }
  // The stream of the latest record (null if never recorded), whose host-function errors a
  // synchronize() of this event reports.
  CudaStream* recorded_on() const {
    std::lock_guard<std::mutex> lock(mu_);
    return recorded_on_;
  }
  void set_recorded_on(CudaStream* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    recorded_on_ = stream;
  }

 private:
  cudaEvent_t handle_;
  mutable std::mutex mu_;
  CudaStream* recorded_on_ = nullptr;
};

// What a host function needs when CUDA calls it back.
struct HostCall {
  HostFunc func;
  void* user;
  CudaStream* stream;
};

// cudaStreamAddCallback (rather than cudaLaunchHostFunc) because it passes the stream's error,
// which becomes `upstream`: the interface runs host functions after a failure too, so that they
// can release what they hold.
void CUDART_CB run_host_call(cudaStream_t, cudaError_t status, void* data) {
  std::unique_ptr<HostCall> call(static_cast<HostCall*>(data));
  Status upstream = call->stream->error();
  if (upstream.is_ok() && status != cudaSuccess) {
    upstream = cuda_status(status, "stream '{}'", call->stream->name());
  }
  Status result = call->func(call->user, upstream);
  if (upstream.is_ok() && !result.is_ok()) call->stream->set_error(result);
}

// Polls `query` (cudaSuccess: done; cudaErrorNotReady: not yet) until done or the timeout, with
// a backoff from a yield up to 1 ms.
template <typename Query>
Status poll_until(Query query, std::chrono::milliseconds timeout, const std::string& what) {
  const auto deadline = Clock::now() + timeout;
  auto pause = std::chrono::microseconds(0);
  for (;;) {
    const cudaError_t err = query();
    if (err == cudaSuccess) return Status::ok();
    if (err != cudaErrorNotReady) return status_from_cuda(what, err);
    if (Clock::now() >= deadline) {
      return Status::timeout(fmt::format("{}: not done after {} ms", what, timeout.count()));
    }
    if (pause.count() == 0) {
      std::this_thread::yield();
      pause = std::chrono::microseconds(10);
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
    }
  }
}

bool waits_forever(std::chrono::milliseconds timeout) { return timeout >= std::chrono::hours(24); }

class CudaDevice final : public Device {
 public:
  CudaDevice(const CudaDeviceOptions& options, std::string name, std::size_t limit_bytes)
      : options_(options), name_(std::move(name)), limit_bytes_(limit_bytes) {}

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string_view name() const override { return name_; }
  bool host_accessible() const override { return false; }

  Result<void*> allocate(std::size_t bytes) override {
    ZINF_RETURN_IF_ERROR(make_current());
    ZINF_RETURN_IF_ERROR(reserve(bytes, "allocate"));
    void* ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, bytes);
    if (err != cudaSuccess) {
      unreserve(bytes);
      return cuda_status(err, "{}: cudaMalloc({} bytes)", name_, bytes);
    }
    track(ptr, bytes);
    return ptr;
  }

  Status free(void* ptr) override {
    ZINF_RETURN_IF_ERROR(make_current());
    ZINF_ASSIGN_OR_RETURN(const std::size_t bytes, untrack(ptr, "free"));
    const cudaError_t err = cudaFree(ptr);
    unreserve(bytes);
    return cuda_status(err, "{}: cudaFree", name_);
  }

  Result<void*> allocate_async(std::size_t bytes, Stream& stream) override {
    ZINF_RETURN_IF_ERROR(make_current());
    ZINF_RETURN_IF_ERROR(reserve(bytes, "allocate_async"));
    void* ptr = nullptr;
    const cudaError_t err = cudaMallocAsync(&ptr, bytes, cuda_stream(stream).handle());
    if (err != cudaSuccess) {
      unreserve(bytes);
      return status_from_cuda(
          fmt::format("{}: cudaMallocAsync({} bytes) on stream '{}'", name_, bytes, stream.name()),
          err);
    }
    track(ptr, bytes);
    return ptr;
  }

  Status free_async(void* ptr, Stream& stream) override {
    ZINF_RETURN_IF_ERROR(make_current());
    ZINF_ASSIGN_OR_RETURN(const std::size_t bytes, untrack(ptr, "free_async"));
    // Counted as free from now: the pool keeps the memory for this process either way.
    const cudaError_t err = cudaFreeAsync(ptr, cuda_stream(stream).handle());
    unreserve(bytes);
    return cuda_status(err, "{}: cudaFreeAsync on stream '{}'", name_, stream.name());
  }

  std::size_t memory_used_bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return used_bytes_;
  }
  std::size_t memory_limit_bytes() const override { return limit_bytes_; }

  Status register_host(void* ptr, std::size_t bytes) override {
    if (ptr == nullptr || bytes == 0) {
      return Status::invalid_argument(fmt::format("{}: register_host of an empty range", name_));
    }
    ZINF_RETURN_IF_ERROR(make_current());
    const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    if (err == cudaErrorHostMemoryAlreadyRegistered) {
      (void)cudaGetLastError();  // Not sticky: clear it so that later calls do not see it.
      return Status::invalid_argument(fmt::format(
          "{}: register_host: {} bytes at {} overlap a registered range", name_, bytes, ptr));
    }
    return cuda_status(err, "{}: cudaHostRegister({} bytes)", name_, bytes);
  }

  Status unregister_host(void* ptr) override {
    ZINF_RETURN_IF_ERROR(make_current());
    const cudaError_t err = cudaHostUnregister(ptr);
    if (err == cudaErrorHostMemoryNotRegistered) {
      (void)cudaGetLastError();
      return Status::invalid_argument(
          fmt::format("{}: unregister_host: {} was not registered", name_, ptr));
    }
    return cuda_status(err, "{}: cudaHostUnregister", name_);
  }

  Result<std::unique_ptr<Stream>> create_stream(std::string_view name) override {
    ZINF_RETURN_IF_ERROR(make_current());
    cudaStream_t handle = nullptr;
    const cudaError_t err = cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking);
    if (err != cudaSuccess) {
      return cuda_status(err, "{}: create stream '{}'", name_, name);
    }
    return std::unique_ptr<Stream>(std::make_unique<CudaStream>(std::string(name), handle));
  }

  Result<std::unique_ptr<Event>> create_event() override {
    ZINF_RETURN_IF_ERROR(make_current());
    cudaEvent_t handle = nullptr;
    const cudaError_t err = cudaEventCreateWithFlags(&handle, cudaEventDisableTiming);
    if (err != cudaSuccess) return cuda_status(err, "{}: create event", name_);
    return std::unique_ptr<Event>(std::make_unique<CudaEvent>(handle));
  }

  Status record(Event& event, Stream& stream) override {
    ZINF_RETURN_IF_ERROR(make_current());
    CudaEvent& ev = cuda_event(event);
    CudaStream& st = cuda_stream(stream);
    const cudaError_t err = cudaEventRecord(ev.handle(), st.handle());
    if (err != cudaSuccess) {
      return cuda_status(err, "{}: record on stream '{}'", name_, st.name());
    }
    ev.set_recorded_on(&st);
    return Status::ok();
  }

  Status wait(Stream& stream, Event& event) override {
    ZINF_RETURN_IF_ERROR(make_current());
    CudaEvent& ev = cuda_event(event);
    CudaStream& st = cuda_stream(stream);
    if (CudaStream* source = ev.recorded_on(); source != nullptr && source != &st) {
      Status upstream = source->error();
      if (!upstream.is_ok()) st.set_error(upstream);
    }
    const cudaError_t err = cudaStreamWaitEvent(st.handle(), ev.handle(), 0);
    return cuda_status(err, "{}: stream '{}' wait event", name_, st.name());
  }

  Result<bool> query(Event& event) override {
    ZINF_RETURN_IF_ERROR(make_current());
    CudaEvent& ev = cuda_event(event);
    const cudaError_t err = cudaEventQuery(ev.handle());
    if (err == cudaErrorNotReady) return false;
    if (err != cudaSuccess) return cuda_status(err, "{}: query event", name_);
    if (CudaStream* source = ev.recorded_on(); source != nullptr) {
      ZINF_RETURN_IF_ERROR(source->error());
    }
    return true;
  }

  Status synchronize(Event& event, std::chrono::milliseconds timeout) override {
    ZINF_RETURN_IF_ERROR(make_current());
    CudaEvent& ev = cuda_event(event);
    const std::string what = fmt::format("{}: synchronize event", name_);
    if (waits_forever(timeout)) {
      ZINF_RETURN_IF_ERROR(status_from_cuda(what, cudaEventSynchronize(ev.handle())));
    } else {
      ZINF_RETURN_IF_ERROR(poll_until([&] { return cudaEventQuery(ev.handle()); }, timeout, what));
    }
    if (CudaStream* source = ev.recorded_on(); source != nullptr) return source->error();
    return Status::ok();
  }

  Status synchronize(Stream& stream, std::chrono::milliseconds timeout) override {
    ZINF_RETURN_IF_ERROR(make_current());
    CudaStream& st = cuda_stream(stream);
    const std::string what = fmt::format("{}: synchronize stream '{}'", name_, st.name());
    if (waits_forever(timeout)) {
      ZINF_RETURN_IF_ERROR(status_from_cuda(what, cudaStreamSynchronize(st.handle())));
    } else {
      ZINF_RETURN_IF_ERROR(poll_until([&] { return cudaStreamQuery(st.handle()); }, timeout, what));
    }
    return st.error();
  }

  Status copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                    Stream& stream) override {
    if (bytes == 0) return Status::ok();
    ZINF_RETURN_IF_ERROR(make_current());
    cudaMemcpyKind cuda_kind = cudaMemcpyDeviceToDevice;
    const char* kind_name = "device-to-device";
    bool dst_on_device = true;
    bool src_on_device = true;
    switch (kind) {
      case CopyKind::kHostToDevice:
        cuda_kind = cudaMemcpyHostToDevice;
        kind_name = "host-to-device";
        src_on_device = false;
        break;
      case CopyKind::kDeviceToHost:
        cuda_kind = cudaMemcpyDeviceToHost;
        kind_name = "device-to-host";
        dst_on_device = false;
        break;
      case CopyKind::kDeviceToDevice:
        break;
    }
    if ((dst_on_device && !contains(dst, bytes)) || (src_on_device && !contains(src, bytes))) {
      return Status::invalid_argument(
          fmt::format("{}: {} copy of {} bytes from {} to {}: the device side is not inside memory "
                      "this device allocated",
                      name_, kind_name, bytes, src, dst));
    }
    CudaStream& st = cuda_stream(stream);
    const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cuda_kind, st.handle());
    return cuda_status(err, "{}: {} copy of {} bytes on stream '{}'", name_, kind_name, bytes,
                       st.name());
  }

  Status memset_async(void* dst, int value, std::size_t bytes, Stream& stream) override {
    if (bytes == 0) return Status::ok();
    ZINF_RETURN_IF_ERROR(make_current());
    if (!contains(dst, bytes)) {
      return Status::invalid_argument(
          fmt::format("{}: memset of {} bytes at {}: not inside memory this device allocated",
                      name_, bytes, dst));
    }
    CudaStream& st = cuda_stream(stream);
    return cuda_status(cudaMemsetAsync(dst, value, bytes, st.handle()), "{}: memset on stream '{}'",
                       name_, st.name());
  }

  Status launch_host_func(Stream& stream, HostFunc func, void* user) override {
    ZINF_RETURN_IF_ERROR(make_current());
    CudaStream& st = cuda_stream(stream);
    auto call = std::make_unique<HostCall>(HostCall{func, user, &st});
    const cudaError_t err = cudaStreamAddCallback(st.handle(), &run_host_call, call.get(), 0);
    if (err != cudaSuccess) {
      return cuda_status(err, "{}: host function on stream '{}'", name_, st.name());
    }
    (void)call.release();  // run_host_call owns it now.
    return Status::ok();
  }

  Status make_current() const {
    return cuda_status(cudaSetDevice(options_.ordinal), "{}: cudaSetDevice", name_);
  }

 private:
  // Every stream and event this device hands out is one of ours; a foreign one is a bug.
  static CudaStream& cuda_stream(Stream& stream) {
    auto* s = dynamic_cast<CudaStream*>(&stream);
    ZINF_ASSERT_MSG(s != nullptr, "a stream from another device was passed to a CudaDevice");
    return *s;
  }
  static CudaEvent& cuda_event(Event& event) {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    ZINF_ASSERT_MSG(e != nullptr, "an event from another device was passed to a CudaDevice");
    return *e;
  }

  Status reserve(std::size_t bytes, const char* what) {
    if (bytes == 0) return Status::invalid_argument(fmt::format("{}: {} of 0 bytes", name_, what));
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes > limit_bytes_ - used_bytes_) {
      return Status::resource_exhausted(
          fmt::format("{}: {} of {} bytes: {} of the limit of {} bytes are in use", name_, what,
                      bytes, used_bytes_, limit_bytes_));
    }
    used_bytes_ += bytes;
    return Status::ok();
  }
  void unreserve(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    used_bytes_ -= bytes;
  }
  void track(void* ptr, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    allocations_[reinterpret_cast<std::uintptr_t>(ptr)] = bytes;
  }
  Result<std::size_t> untrack(void* ptr, const char* what) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == allocations_.end()) {
      return Status::invalid_argument(
          fmt::format("{}: {} of {}: not allocated by this device", name_, what, ptr));
    }
    const std::size_t bytes = it->second;
    allocations_.erase(it);
    return bytes;
  }
  bool contains(const void* ptr, std::size_t bytes) const {
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.upper_bound(p);
    if (it == allocations_.begin()) return false;
    --it;
    return p - it->first <= it->second && bytes <= it->second - (p - it->first);
  }

  CudaDeviceOptions options_;
  std::string name_;
  std::size_t limit_bytes_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> allocations_;  // base -> bytes
  std::size_t used_bytes_ = 0;
};

}  // namespace

Status make_cuda_device_current(Device& device) {
  auto* cuda = dynamic_cast<CudaDevice*>(&device);
  if (cuda == nullptr) {
    return Status::invalid_argument(
        fmt::format("make_cuda_device_current: {} is not a CUDA device", device.name()));
  }
  return cuda->make_current();
}

Result<std::unique_ptr<Stream>> wrap_cuda_stream(Device& device, void* cuda_stream,
                                                 std::string_view name) {
  if (dynamic_cast<CudaDevice*>(&device) == nullptr) {
    return Status::invalid_argument(
        fmt::format("wrap_cuda_stream('{}'): {} is not a CUDA device (a cudaStream_t needs one)",
                    name, device.name()));
  }
  return std::unique_ptr<Stream>(std::make_unique<CudaStream>(
      std::string(name), static_cast<cudaStream_t>(cuda_stream), /*owned=*/false));
}

// lib/device/device_ops_cuda.cpp; null when `device` is not a CudaDevice.
std::unique_ptr<DeviceOps> make_cuda_device_ops(Device& device);

Result<std::unique_ptr<Device>> make_cuda_device(const CudaDeviceOptions& options) {
  // The engine finds this device's kernels through the factory (lib/device/device_ops.hpp).
  set_device_ops_factory(&make_cuda_device_ops);
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return status_from_cuda("make_cuda_device: cudaGetDeviceCount", err);
  }
  if (count == 0) return Status::unsupported("make_cuda_device: no CUDA device");
  if (options.ordinal < 0 || options.ordinal >= count) {
    return Status::invalid_argument(
        fmt::format("make_cuda_device: ordinal {} is not in [0, {})", options.ordinal, count));
  }
  err = cudaSetDevice(options.ordinal);
  if (err != cudaSuccess) return status_from_cuda("make_cuda_device: cudaSetDevice", err);
  cudaDeviceProp prop{};
  err = cudaGetDeviceProperties(&prop, options.ordinal);
  if (err != cudaSuccess) return status_from_cuda("make_cuda_device: properties", err);
  cudaMemPool_t pool = nullptr;
  err = cudaDeviceGetDefaultMemPool(&pool, options.ordinal);
  if (err != cudaSuccess) return status_from_cuda("make_cuda_device: default memory pool", err);
  std::uint64_t threshold = options.pool_release_threshold_bytes;
  err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  if (err != cudaSuccess) return status_from_cuda("make_cuda_device: pool release threshold", err);
  const std::size_t limit =
      options.memory_limit_bytes != 0 ? options.memory_limit_bytes : prop.totalGlobalMem;
  return std::unique_ptr<Device>(std::make_unique<CudaDevice>(
      options, fmt::format("cuda:{} ({})", options.ordinal, prop.name), limit));
}

}  // namespace zinf
