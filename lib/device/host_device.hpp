// HostDevice: a Device whose memory is host memory and whose streams are worker threads.
//
// Each stream owns one thread and a bounded ring of operations that it runs in issue order; an
// issuing call blocks while the ring is full. Events carry a generation count: record() bumps it
// and queues "reach generation g" on the stream; wait() captures the generation current at the
// call and queues "block until the event reaches it". So the engine's cross-stream ordering is
// enforced exactly where a GPU would enforce it, and with jitter enabled (random sleeps before
// each operation) a missing wait() corrupts results instead of passing by luck.
//
// Opaque mode (HostDeviceOptions::opaque): device pointers are host addresses with bit 52 set, so
// host code that dereferences one faults; every method takes device pointers and translates them
// (host_address), and the allocation table is keyed by host addresses.
//
// Thread-safety: as Device (every method from any thread).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "zinf/device.hpp"

namespace zinf {

class HostDevice;

// What an event's records reach. Shared between the event and the stream operations that refer
// to it, so that destroying an event with records still queued is safe, as in CUDA.
struct HostEventState {
  std::mutex mu;
  std::condition_variable cv;
  // Generations: recorded counts record() calls; completed is the highest one reached.
  // A record that completes after a later one (on another stream) does not move completed back.
  std::uint64_t recorded = 0;
  std::uint64_t completed = 0;
  Status error;  // the error of the stream when it reached `completed`

  // Marks generation `generation` reached, by a stream whose error is `stream_error`.
  void complete(std::uint64_t generation, const Status& stream_error);
};

class HostEvent final : public Event {
 public:
  explicit HostEvent(HostDevice* owner)
      : owner_(owner), state_(std::make_shared<HostEventState>()) {}
  ~HostEvent() override;
  void* native_handle() const override { return nullptr; }

 private:
  friend class HostDevice;
  HostDevice* owner_;
  std::shared_ptr<HostEventState> state_;
};

class HostStream final : public Stream {
 public:
  struct Op {
    enum class Type : std::uint8_t { kCopy, kMemset, kHostFunc, kRecord, kWait, kFree };
    Type type = Type::kCopy;
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t bytes = 0;
    int value = 0;
    HostFunc func = nullptr;
    void* user = nullptr;
    std::shared_ptr<HostEventState> event;
    std::uint64_t generation = 0;
  };

  HostStream(HostDevice* owner, std::string name, std::uint32_t index);
  ~HostStream() override;

  std::string_view name() const override { return name_; }
  void* native_handle() const override { return nullptr; }

 private:
  friend class HostDevice;
  // Queues `op`, blocking while the ring is full.
  Status enqueue(const Op& op);
  Status synchronize(std::chrono::milliseconds timeout);
  void run();
  // Runs one operation; returns its error (OK when fine).
  Status execute(const Op& op, const Status& upstream);

  HostDevice* owner_;
  std::string name_;
  SplitMix64 jitter_;
  std::uint32_t jitter_max_us_;

  std::mutex mu_;
  std::condition_variable work_cv_;   // the worker waits for work
  std::condition_variable space_cv_;  // issuers wait for room and synchronize() for completion
  std::vector<Op> ring_;
  std::size_t head_ = 0;
  std::size_t count_ = 0;  // queued, including the one running
  std::uint64_t issued_ = 0;
  std::uint64_t completed_ = 0;
  Status error_;  // sticky: the first failure
  bool stop_ = false;
  std::thread worker_;
};

class HostDevice final : public Device {
 public:
  explicit HostDevice(const HostDeviceOptions& options);
  // REQUIRES: every stream and event created by this device has been destroyed.
  ~HostDevice() override;

  DeviceKind kind() const override { return DeviceKind::kHost; }
  std::string_view name() const override { return name_; }
  bool host_accessible() const override { return !options_.opaque; }

  Result<void*> allocate(std::size_t bytes) override;
  Status free(void* ptr) override;
  Result<void*> allocate_async(std::size_t bytes, Stream& stream) override;
  Status free_async(void* ptr, Stream& stream) override;
  // Includes the bytes reserve() counts.
  std::size_t memory_used_bytes() const override;
  std::size_t memory_limit_bytes() const override { return options_.memory_limit_bytes; }
  // Counts `bytes` of host memory that stands for this device's memory but that its user maps
  // itself (HostState's moments and gradient accumulator, zero pages that take memory only where
  // written) against memory_limit_bytes(), as allocate() counts its own: a configuration that
  // would not fit the device fails where it would fail on a GPU. kResourceExhausted naming
  // `what` and `bytes` when the limit cannot hold them (nothing is counted then).
  Status reserve(std::size_t bytes, std::string_view what);
  // Stops counting `bytes` that reserve() counted.
  // REQUIRES: at most the bytes reserved and not yet given back.
  void unreserve(std::size_t bytes);
  Status register_host(void* ptr, std::size_t bytes) override;
  Status unregister_host(void* ptr) override;
  // Whether [ptr, ptr + bytes) lies inside one register_host range.
  bool registered(const void* ptr, std::size_t bytes) const;

  Result<std::unique_ptr<Stream>> create_stream(std::string_view name) override;
  Result<std::unique_ptr<Event>> create_event() override;
  Status record(Event& event, Stream& stream) override;
  Status wait(Stream& stream, Event& event) override;
  Result<bool> query(Event& event) override;
  Status synchronize(Event& event, std::chrono::milliseconds timeout) override;
  Status synchronize(Stream& stream, std::chrono::milliseconds timeout) override;

  Status copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                    Stream& stream) override;
  Status memset_async(void* dst, int value, std::size_t bytes, Stream& stream) override;
  Status launch_host_func(Stream& stream, HostFunc func, void* user) override;

  // Streams alive now (each is one thread).
  int live_stream_count() const;

  // Keeps the memory of [ptr, ptr + bytes) while `writer` lives, for a transfer given up on that
  // may still write it: an MPI receive left open after its collective failed (MpiComm). A free of
  // an allocation that overlaps the range succeeds (the allocation leaves the table and the used
  // bytes at once) but its memory is released only once every such writer has expired, by a later
  // allocate or free; one still kept when the device is destroyed is kept to the process's end.
  void keep_while(const void* ptr, std::size_t bytes, std::weak_ptr<const void> writer);
  // The bytes of freed allocations whose memory keep_while() still keeps.
  std::size_t kept_bytes() const;

  // The host address of device pointer `ptr` (`ptr` itself unless the device is opaque; see
  // HostDeviceOptions::opaque). For the code that plays the device's part on the host: LocalComm's
  // collectives and the device ops' scalar implementations.
  void* host_address(const void* ptr) const {
    return reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(ptr) & ~opaque_bit_);
  }
  // The device pointer of host address `ptr` inside one of this device's allocations.
  void* device_address(void* ptr) const {
    return reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(ptr) | opaque_bit_);
  }

 private:
  friend class HostStream;
  friend class HostEvent;
  HostStream& host_stream(Stream& stream) const;
  HostEvent& host_event(Event& event) const;
  // True when [ptr, ptr + bytes) lies inside one live allocation.
  bool contains(const void* ptr, std::size_t bytes) const;
  Status free_now(void* ptr);
  // Whether a live writer of keep_while() overlaps [base, base + bytes). REQUIRES: mu_ held.
  bool kept_locked(std::uintptr_t base, std::size_t bytes) const;
  // Drops the expired writers and moves the kept memory no live writer overlaps any more to
  // `released`, to be freed outside the lock. REQUIRES: mu_ held.
  void release_kept_locked(std::vector<void*>* released);

  HostDeviceOptions options_;
  std::string name_;
  // Set in device pointers of an opaque device (see HostDeviceOptions::opaque), else 0.
  std::uintptr_t opaque_bit_ = 0;

  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> allocations_;  // base -> bytes
  std::set<std::uintptr_t> pending_frees_;             // queued by free_async, not yet run
  std::map<std::uintptr_t, std::size_t> registered_;   // register_host ranges
  std::size_t used_bytes_ = 0;                         // allocations and reservations
  std::size_t reserved_bytes_ = 0;                     // reserve()'s share of used_bytes_
  struct Writer {
    std::uintptr_t begin = 0, end = 0;  // host addresses
    std::weak_ptr<const void> alive;
  };
  std::vector<Writer> writers_;                 // keep_while()
  std::map<std::uintptr_t, std::size_t> kept_;  // freed, memory kept: base -> bytes
  std::uint32_t streams_created_ = 0;
  int live_streams_ = 0;
  int live_events_ = 0;
};

}  // namespace zinf
