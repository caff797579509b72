// Device: the memory, streams, events and asynchronous copies of one accelerator.
//
// The interface is shaped after CUDA's stream model so that `CudaDevice` maps onto it one call
// for one call, and `HostDevice` (device memory is host memory, every stream an ordered queue run
// by its own worker thread) runs the same engine code on a CPU-only machine with the same ordering
// rules, so that a missing event wait shows up in tests as it would on a GPU:
//
//   Device                    CUDA
//   allocate / free           cudaMalloc / cudaFree
//   allocate_async/free_async cudaMallocAsync / cudaFreeAsync (stream-ordered pool)
//   create_stream             cudaStreamCreateWithFlags(cudaStreamNonBlocking)
//   create_event              cudaEventCreateWithFlags(cudaEventDisableTiming)
//   record(event, stream)     cudaEventRecord
//   wait(stream, event)       cudaStreamWaitEvent
//   query(event)              cudaEventQuery
//   synchronize(event/stream) cudaEventSynchronize / cudaStreamSynchronize, with a timeout
//   copy_async                cudaMemcpyAsync (H2D from pinned memory, D2H, D2D)
//   memset_async              cudaMemsetAsync
//   launch_host_func          cudaLaunchHostFunc
//   register_host             cudaHostRegister
//
// Ordering: work on one stream runs in issue order; work on different streams is unordered unless
// a stream waits on an event recorded on the other. Device pointers are only valid for the
// device's own operations (copies, kernels, collectives) unless host_accessible() is true.
//
// Errors: a call that cannot enqueue its work (bad pointer, out of memory, a destroyed device)
// returns a Status at once. Work that fails later, while the stream runs it, sets the stream's
// sticky error: the stream skips the rest of its work, synchronize() of the stream or of an event
// recorded after the failure returns that error, and a stream that waits on such an event
// inherits it (so work that depends on failed data never runs on it).
//
// Thread-safety: every Device method may be called from any thread. Streams and events are
// handles owned by their creator; do not destroy one while another thread uses it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "zinf/status.hpp"

namespace zinf {

enum class DeviceKind : std::uint8_t { kHost = 0, kCuda = 1 };
// "host" or "cuda".
std::string_view device_kind_name(DeviceKind kind);

// Waits that take a timeout treat this value (or anything at least a day) as "no limit".
inline constexpr std::chrono::milliseconds kWaitForever = std::chrono::milliseconds::max();

// An ordered queue of device work (a cudaStream_t on CUDA). Created by Device::create_stream.
// Destroying a stream waits for the work already queued on it to finish.
class Stream {
 public:
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // The name given at creation, for errors and traces.
  virtual std::string_view name() const = 0;
  // The backend's handle (cudaStream_t on CUDA), for launching kernels on this stream;
  // nullptr on HostDevice.
  virtual void* native_handle() const = 0;

 protected:
  Stream() = default;
};

// A marker in a stream's work (a cudaEvent_t on CUDA). Created by Device::create_event.
// An event that was never recorded counts as complete, as in CUDA. Recording it again moves the
// marker: query() and synchronize() then refer to the latest record.
class Event {
 public:
  virtual ~Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  virtual void* native_handle() const = 0;

 protected:
  Event() = default;
};

// Work run on a stream's worker (HostDevice) or CUDA's callback thread (cudaLaunchHostFunc), in
// stream order. It must not call Device or Communicator methods (CUDA forbids it in callbacks)
// and should be short. A non-OK return becomes the stream's sticky error.
// It runs even when earlier work on the stream failed, so that it can release what `user` holds
// and tell others (a collective tells the other ranks): `upstream` is then that error, and the
// return value is ignored. `upstream` is OK otherwise.
using HostFunc = Status (*)(void* user, const Status& upstream);

enum class CopyKind : std::uint8_t {
  kHostToDevice = 0,    // src in host memory (pinned for a truly asynchronous CUDA copy)
  kDeviceToHost = 1,    // dst in host memory
  kDeviceToDevice = 2,  // both on this device
};

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceKind kind() const = 0;
  // For example "host:0" or "cuda:1 (NVIDIA H200)".
  virtual std::string_view name() const = 0;
  // True when device pointers may be dereferenced by host code (HostDevice).
  virtual bool host_accessible() const = 0;

  // --- Memory ------------------------------------------------------------------------------
  // Device memory, aligned to at least 256 bytes. Its contents are unspecified (HostDevice fills
  // it with 0xff bytes, a NaN in every dtype, so reads of unwritten memory show up in tests).
  // Returns kInvalidArgument for 0 bytes, kResourceExhausted when the device's memory (or its
  // configured limit) cannot hold `bytes` more.
  virtual Result<void*> allocate(std::size_t bytes) = 0;
  // Frees memory from allocate() or allocate_async() once all work already issued on any
  // stream has finished with it (the caller ensures that, as with cudaFree).
  // Returns kInvalidArgument for a pointer this device did not allocate.
  virtual Status free(void* ptr) = 0;
  // Stream-ordered allocation: the memory may be used by work issued on `stream` after this call
  // (and by other streams after they wait on an event recorded after it).
  virtual Result<void*> allocate_async(std::size_t bytes, Stream& stream) = 0;
  // Stream-ordered free: the memory returns to the pool when `stream` reaches this point.
  virtual Status free_async(void* ptr, Stream& stream) = 0;
  // Bytes currently allocated, and the most this device will hand out.
  virtual std::size_t memory_used_bytes() const = 0;
  virtual std::size_t memory_limit_bytes() const = 0;

  // Page-locks `bytes` of host memory at `ptr` for asynchronous copies (cudaHostRegister).
  // No-op on HostDevice apart from checking the arguments.
  // REQUIRES: [ptr, ptr + bytes) is not registered already.
  virtual Status register_host(void* ptr, std::size_t bytes) = 0;
  virtual Status unregister_host(void* ptr) = 0;

  // --- Streams and events --------------------------------------------------------------------
  virtual Result<std::unique_ptr<Stream>> create_stream(std::string_view name) = 0;
  virtual Result<std::unique_ptr<Event>> create_event() = 0;
  // Marks the point in `stream` after all work issued on it so far.
  virtual Status record(Event& event, Stream& stream) = 0;
  // Work issued on `stream` after this call starts only once `event`'s latest record (at the
  // time of this call) has completed. An event never recorded is no wait.
  virtual Status wait(Stream& stream, Event& event) = 0;
  // True when the event's latest record has been reached; the stream's error when work before
  // it failed.
  virtual Result<bool> query(Event& event) = 0;
  // Blocks until the event's latest record is reached, its stream's error, or kTimeout.
  virtual Status synchronize(Event& event, std::chrono::milliseconds timeout = kWaitForever) = 0;
  // Blocks until all work issued on `stream` so far has finished; its sticky error, or kTimeout.
  virtual Status synchronize(Stream& stream, std::chrono::milliseconds timeout = kWaitForever) = 0;

  // --- Work ----------------------------------------------------------------------------------
  // Copies `bytes` from `src` to `dst` in stream order. kInvalidArgument (naming the copy) when
  // the device side of the copy is not inside memory this device allocated.
  // REQUIRES: the ranges do not overlap; host memory stays valid until the copy has run.
  virtual Status copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                            Stream& stream) = 0;
  // Sets `bytes` bytes at device pointer `dst` to `value` (the low 8 bits) in stream order.
  virtual Status memset_async(void* dst, int value, std::size_t bytes, Stream& stream) = 0;
  // Runs `func(user)` in stream order (see HostFunc). `user` must stay valid until it has run.
  virtual Status launch_host_func(Stream& stream, HostFunc func, void* user) = 0;

  // Convenience over launch_host_func for a closure (allocates: not for hot paths). The closure
  // is skipped (destroyed without running) when earlier work on the stream failed.
  Status launch_host(Stream& stream, std::function<Status()> func);

  Status copy_h2d(void* device_dst, const void* host_src, std::size_t bytes, Stream& stream) {
    return copy_async(device_dst, host_src, bytes, CopyKind::kHostToDevice, stream);
  }
  Status copy_d2h(void* host_dst, const void* device_src, std::size_t bytes, Stream& stream) {
    return copy_async(host_dst, device_src, bytes, CopyKind::kDeviceToHost, stream);
  }
  Status copy_d2d(void* device_dst, const void* device_src, std::size_t bytes, Stream& stream) {
    return copy_async(device_dst, device_src, bytes, CopyKind::kDeviceToDevice, stream);
  }

 protected:
  Device() = default;
};

// Owns one allocation of a Device; frees it (synchronously) when destroyed.
// Thread-safety: a value; not shared.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, std::size_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : device_(std::exchange(other.device_, nullptr)),
        data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      device_ = std::exchange(other.device_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  // Allocates `bytes` on `device`.
  static Result<DeviceBuffer> allocate(Device& device, std::size_t bytes) {
    Result<void*> data = device.allocate(bytes);
    if (!data.is_ok()) return data.status();
    return DeviceBuffer(&device, *data, bytes);
  }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }
  // Frees the memory now. REQUIRES: no issued work still uses it.
  void reset() {
    if (data_ != nullptr) (void)device_->free(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// --- HostDevice --------------------------------------------------------------------------------

struct HostDeviceOptions {
  // Appears in name() as "host:<ordinal>"; the rank in multi-rank tests.
  int ordinal = 0;
  // Most bytes allocate() hands out at once; beyond it kResourceExhausted, as a full GPU would.
  std::size_t memory_limit_bytes = std::size_t{16} << 30;
  // Operations a stream holds before an issuing call blocks until one finishes (a GPU's launch
  // queue is bounded the same way).
  std::size_t stream_queue_depth = 1024;
  // When non-zero, each stream sleeps a random 0..jitter_max_us microseconds (from jitter_seed and
  // the stream's creation index) before each operation, so that work on unsynchronised streams
  // interleaves differently from run to run, and a missing wait() corrupts results in a test.
  std::uint32_t jitter_max_us = 0;
  std::uint64_t jitter_seed = 1;
  // Fill new allocations with 0xff bytes (a NaN in f32, f16 and bf16).
  bool poison_allocations = true;
  // An "opaque" device: host_accessible() is false, so the engine takes the path it takes on a
  // GPU (copies, stream operations, collectives, never host code on device memory), and device
  // pointers are the memory's host address with bit 52 set, beyond the user address space, so a
  // host load or store through one faults (SIGSEGV) instead of passing unnoticed. Only the
  // device's own operations (copies, memsets, LocalComm's collectives, the device ops of
  // lib/device/device_ops.hpp) reach the memory. Pointer arithmetic on device pointers works as
  // on a GPU.
  bool opaque = false;
  // Host-to-device and device-to-host copies fail (kFailedPrecondition, naming the copy) unless
  // their host side lies inside a register_host range. On CUDA a copy from pageable memory runs
  // synchronously, so a test with this set shows that a path keeps its copies asynchronous there.
  bool require_registered_host = false;
};

// A Device whose memory is host memory and whose streams are worker threads.
// REQUIRES: every stream and event it created is destroyed before it.
Result<std::unique_ptr<Device>> make_host_device(const HostDeviceOptions& options = {});

// --- CudaDevice ----------------------------------------------------------------------------------

struct CudaDeviceOptions {
  // The CUDA device ordinal (LOCAL_RANK in a torchrun job). make_cuda_device(ordinal, options)
  // overrides it.
  int ordinal = 0;
  // Most bytes allocate() and allocate_async() hand out together; beyond it kResourceExhausted.
  // 0: the GPU's total memory.
  std::size_t memory_limit_bytes = 0;
  // Bytes the stream-ordered pool keeps when memory is freed to it
  // (cudaMemPoolAttrReleaseThreshold). The default keeps everything: no allocation goes back to
  // the driver between steps.
  std::uint64_t pool_release_threshold_bytes = UINT64_MAX;
};

// Opens GPU `options.ordinal` as a Device (streams are cudaStreams, memory comes from the
// stream-ordered pool; see docs/GPU.md). kUnsupported naming ZINF_WITH_CUDA when zinf was built
// without CUDA, or when there is no usable device (no driver, no GPU); kInvalidArgument for an
// ordinal out of range.
// REQUIRES: every stream and event it creates is destroyed before it.
Result<std::unique_ptr<Device>> make_cuda_device(const CudaDeviceOptions& options = {});
// The same on GPU `ordinal`.
inline Result<std::unique_ptr<Device>> make_cuda_device(int ordinal,
                                                        CudaDeviceOptions options = {}) {
  options.ordinal = ordinal;
  return make_cuda_device(options);
}

// A Stream for a CUDA stream the caller owns (a cudaStream_t such as a framework's current
// stream; nullptr is CUDA's legacy default stream) on CudaDevice `device`, so that it can be the
// engine's compute stream (Engine::set_compute_stream) or take part in the device's event
// waits. It borrows the handle: destroying the Stream neither synchronises nor destroys the
// cudaStream_t, which must outlive it. kUnsupported naming ZINF_WITH_CUDA when zinf was built
// without CUDA; kInvalidArgument when `device` is not a CudaDevice.
// REQUIRES: `cuda_stream` belongs to the device's GPU.
Result<std::unique_ptr<Stream>> wrap_cuda_stream(Device& device, void* cuda_stream,
                                                 std::string_view name = "caller");

}  // namespace zinf
