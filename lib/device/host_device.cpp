#include "device/host_device.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <utility>

#include "base/assert.hpp"
#include "base/wait.hpp"

namespace zinf {
namespace {

// cudaMalloc aligns to 256 bytes; matching it keeps alignment assumptions honest on both.
constexpr std::size_t kAllocAlignment = 256;
// Set in an opaque device's pointers: user-space addresses on x86-64 and AArch64 (48-bit virtual
// addresses; 5-level paging only maps above 2^47 when asked to) stay below it, so an address with
// it set is either non-canonical or unmapped, and a host access faults.
constexpr std::uintptr_t kOpaqueBit = std::uintptr_t{1} << 52;

}  // namespace

// --- HostEvent -----------------------------------------------------------------------------------

HostEvent::~HostEvent() {
  std::lock_guard<std::mutex> lock(owner_->mu_);
  --owner_->live_events_;
}

void HostEventState::complete(std::uint64_t generation, const Status& stream_error) {
  // Notify under the lock: once a waiter sees `completed` it may destroy the event, so nothing
  // here may touch the state after the unlock (the shared_ptr in the operation keeps it alive
  // anyway; this keeps the rule simple).
  std::lock_guard<std::mutex> lock(mu);
  if (generation > completed) {
    completed = generation;
    error = stream_error;
  }
  cv.notify_all();
}

// --- HostStream ----------------------------------------------------------------------------------

HostStream::HostStream(HostDevice* owner, std::string name, std::uint32_t index)
    : owner_(owner),
      name_(std::move(name)),
      jitter_(owner->options_.jitter_seed ^ (0x9e3779b97f4a7c15ull * (index + 1))),
      jitter_max_us_(owner->options_.jitter_max_us),
      ring_(owner->options_.stream_queue_depth) {
  worker_ = std::thread([this] { run(); });
}

HostStream::~HostStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  worker_.join();
  std::lock_guard<std::mutex> lock(owner_->mu_);
  --owner_->live_streams_;
}

Status HostStream::enqueue(const Op& op) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Bounded: the issuer waits for room, as a full GPU launch queue makes it wait.
    space_cv_.wait(lock, [&] { return count_ < ring_.size() || stop_; });
    if (stop_) return Status::failed_precondition(fmt::format("stream '{}' is closing", name_));
    ring_[(head_ + count_) % ring_.size()] = op;
    ++count_;
    ++issued_;
  }
  work_cv_.notify_one();
  return Status::ok();
}

Status HostStream::synchronize(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const std::uint64_t target = issued_;
  if (!wait_for_or_forever(space_cv_, lock, timeout, [&] { return completed_ >= target; })) {
    return Status::timeout(fmt::format("synchronize stream '{}' on {}: not done after {} ms", name_,
                                       owner_->name(), timeout.count()));
  }
  return error_;
}

void HostStream::run() {
  for (;;) {
    Op op;
    Status upstream;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // The ring drains before stop takes effect: destroying a stream waits for its work.
      work_cv_.wait(lock, [&] { return count_ > 0 || stop_; });
      if (count_ == 0) return;
      op = std::move(ring_[head_]);
      upstream = error_;
    }
    if (jitter_max_us_ != 0) {
      const auto sleep_us = jitter_.next() % (std::uint64_t{jitter_max_us_} + 1);
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    }
    Status failure = execute(op, upstream);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure.is_ok() && error_.is_ok()) error_ = std::move(failure);
      head_ = (head_ + 1) % ring_.size();
      --count_;
      ++completed_;
    }
    space_cv_.notify_all();
  }
}

Status HostStream::execute(const Op& op, const Status& upstream) {
  using Type = Op::Type;
  switch (op.type) {
    case Type::kRecord:
      // Runs on a failed stream too, so that waiters wake up and learn the error.
      op.event->complete(op.generation, upstream);
      return Status::ok();
    case Type::kWait: {
      std::unique_lock<std::mutex> lock(op.event->mu);
      // No timeout: the record this waits for was issued before the wait (generations are taken
      // at issue time), so it cannot depend on this stream's later work and always completes.
      op.event->cv.wait(lock, [&] { return op.event->completed >= op.generation; });
      // Work that depends on failed work must not run on garbage: inherit the error.
      if (upstream.is_ok() && !op.event->error.is_ok()) {
        return op.event->error.with_context(
            fmt::format("stream '{}' waited on an event after failed work", name_));
      }
      return Status::ok();
    }
    case Type::kFree:
      // Frees even after a failure: releasing memory is always safe once the stream got here.
      return owner_->free_now(op.dst);
    case Type::kHostFunc: {
      Status status = op.func(op.user, upstream);
      if (!upstream.is_ok()) return Status::ok();
      return status;
    }
    case Type::kCopy:
      if (upstream.is_ok()) std::memcpy(op.dst, op.src, op.bytes);
      return Status::ok();
    case Type::kMemset:
      if (upstream.is_ok()) std::memset(op.dst, op.value, op.bytes);
      return Status::ok();
  }
  return Status::internal("unknown stream operation");
}

// --- HostDevice ----------------------------------------------------------------------------------

HostDevice::HostDevice(const HostDeviceOptions& options)
    : options_(options),
      name_(fmt::format("host:{}", options.ordinal)),
      opaque_bit_(options.opaque ? kOpaqueBit : 0) {}

HostDevice::~HostDevice() {
  std::lock_guard<std::mutex> lock(mu_);
  ZINF_ASSERT_MSG(live_streams_ == 0 && live_events_ == 0,
                  "HostDevice destroyed before its streams and events");
  for (const auto& [base, bytes] : allocations_) std::free(reinterpret_cast<void*>(base));
  std::vector<void*> released;
  release_kept_locked(&released);
  for (void* ptr : released) std::free(ptr);
  if (!kept_.empty()) {
    // A writer that outlives the device may still write this memory: kept to the process's end,
    // reachable, so that no leak checker reports it. Never destroyed, the mutex too: a device may
    // be destroyed during static destruction.
    static auto* kept_mu = new std::mutex();
    static auto* kept = new std::vector<void*>();
    std::lock_guard<std::mutex> kept_lock(*kept_mu);
    for (const auto& [base, bytes] : kept_) kept->push_back(reinterpret_cast<void*>(base));
  }
}

HostStream& HostDevice::host_stream(Stream& stream) const {
  auto* host = dynamic_cast<HostStream*>(&stream);
  ZINF_ASSERT_MSG(host != nullptr && host->owner_ == this, "stream of another device");
  return *host;
}

HostEvent& HostDevice::host_event(Event& event) const {
  auto* host = dynamic_cast<HostEvent*>(&event);
  ZINF_ASSERT_MSG(host != nullptr && host->owner_ == this, "event of another device");
  return *host;
}

Result<void*> HostDevice::allocate(std::size_t bytes) {
  if (bytes == 0) return Status::invalid_argument(fmt::format("{}: allocate of 0 bytes", name_));
  std::vector<void*> released;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes > options_.memory_limit_bytes - used_bytes_) {
      return Status::resource_exhausted(
          fmt::format("{}: allocating {} bytes would exceed the device memory limit ({} of {} "
                      "bytes in use)",
                      name_, bytes, used_bytes_, options_.memory_limit_bytes));
    }
    used_bytes_ += bytes;
    if (!kept_.empty()) release_kept_locked(&released);
  }
  for (void* kept : released) std::free(kept);
  const std::size_t rounded = (bytes + kAllocAlignment - 1) / kAllocAlignment * kAllocAlignment;
  void* ptr = std::aligned_alloc(kAllocAlignment, rounded);
  if (ptr == nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    used_bytes_ -= bytes;
    return Status::resource_exhausted(
        fmt::format("{}: host memory for {} bytes of device memory is exhausted", name_, bytes));
  }
  if (options_.poison_allocations) std::memset(ptr, 0xff, rounded);
  ZINF_ASSERT((reinterpret_cast<std::uintptr_t>(ptr) & kOpaqueBit) == 0);
  std::lock_guard<std::mutex> lock(mu_);
  allocations_.emplace(reinterpret_cast<std::uintptr_t>(ptr), bytes);
  return device_address(ptr);
}

Status HostDevice::free_now(void* device_ptr) {
  void* ptr = host_address(device_ptr);
  std::vector<void*> released;
  {
    // An opaque device's memory is freed by its device pointer only.
    std::lock_guard<std::mutex> lock(mu_);
    const auto key = reinterpret_cast<std::uintptr_t>(ptr);
    auto it = allocations_.find(key);
    if (it == allocations_.end() || device_address(ptr) != device_ptr) {
      return Status::invalid_argument(
          fmt::format("{}: free of {} which this device did not allocate (or freed already)", name_,
                      device_ptr));
    }
    const std::size_t bytes = it->second;
    used_bytes_ -= bytes;
    allocations_.erase(it);
    pending_frees_.erase(key);
    if (!writers_.empty() || !kept_.empty()) {
      release_kept_locked(&released);
      if (kept_locked(key, bytes)) {
        kept_.emplace(key, bytes);
        ptr = nullptr;
      }
    }
  }
  for (void* kept : released) std::free(kept);
  std::free(ptr);
  return Status::ok();
}

void HostDevice::keep_while(const void* ptr, std::size_t bytes, std::weak_ptr<const void> writer) {
  if (bytes == 0) return;
  const auto begin = reinterpret_cast<std::uintptr_t>(host_address(ptr));
  std::lock_guard<std::mutex> lock(mu_);
  writers_.push_back({.begin = begin, .end = begin + bytes, .alive = std::move(writer)});
}

std::size_t HostDevice::kept_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t total = 0;
  for (const auto& [base, bytes] : kept_) total += bytes;
  return total;
}

bool HostDevice::kept_locked(std::uintptr_t base, std::size_t bytes) const {
  for (const Writer& writer : writers_) {
    if (writer.begin < base + bytes && base < writer.end && !writer.alive.expired()) return true;
  }
  return false;
}

void HostDevice::release_kept_locked(std::vector<void*>* released) {
  std::erase_if(writers_, [](const Writer& writer) { return writer.alive.expired(); });
  for (auto it = kept_.begin(); it != kept_.end();) {
    if (kept_locked(it->first, it->second)) {
      ++it;
    } else {
      released->push_back(reinterpret_cast<void*>(it->first));
      it = kept_.erase(it);
    }
  }
}

Status HostDevice::free(void* ptr) {
  if (ptr == nullptr) return Status::ok();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_frees_.count(reinterpret_cast<std::uintptr_t>(host_address(ptr))) != 0) {
      return Status::invalid_argument(
          fmt::format("{}: free of {} which a free_async already releases", name_, ptr));
    }
  }
  return free_now(ptr);
}

Result<void*> HostDevice::allocate_async(std::size_t bytes, Stream& stream) {
  (void)host_stream(stream);
  // Host memory exists at once, which is a valid (earlier) point in the stream's order.
  return allocate(bytes);
}

Status HostDevice::free_async(void* ptr, Stream& stream) {
  HostStream& host = host_stream(stream);
  if (ptr == nullptr) return Status::ok();
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto key = reinterpret_cast<std::uintptr_t>(host_address(ptr));
    if (allocations_.count(key) == 0 || pending_frees_.count(key) != 0 ||
        device_address(host_address(ptr)) != ptr) {
      return Status::invalid_argument(
          fmt::format("{}: free_async of {} which this device did not allocate (or frees already)",
                      name_, ptr));
    }
    pending_frees_.insert(key);
  }
  HostStream::Op op;
  op.type = HostStream::Op::Type::kFree;
  op.dst = ptr;
  return host.enqueue(op);
}

std::size_t HostDevice::memory_used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_bytes_;
}

Status HostDevice::reserve(std::size_t bytes, std::string_view what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > options_.memory_limit_bytes - used_bytes_) {
    return Status::resource_exhausted(
        fmt::format("{}: {}: {} bytes would exceed the device memory limit ({} of {} bytes in use)",
                    name_, what, bytes, used_bytes_, options_.memory_limit_bytes));
  }
  used_bytes_ += bytes;
  reserved_bytes_ += bytes;
  return Status::ok();
}

void HostDevice::unreserve(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  ZINF_ASSERT_MSG(bytes <= reserved_bytes_, "unreserve of more bytes than reserve() counted");
  used_bytes_ -= bytes;
  reserved_bytes_ -= bytes;
}

Status HostDevice::register_host(void* ptr, std::size_t bytes) {
  if (ptr == nullptr || bytes == 0) {
    return Status::invalid_argument(
        fmt::format("{}: register_host needs a non-null pointer and bytes > 0", name_));
  }
  std::lock_guard<std::mutex> lock(mu_);
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  auto next = registered_.lower_bound(begin);
  const bool overlaps_next = next != registered_.end() && next->first < begin + bytes;
  bool overlaps_prev = false;
  if (next != registered_.begin()) {
    auto prev = std::prev(next);
    overlaps_prev = prev->first + prev->second > begin;
  }
  if (overlaps_next || overlaps_prev) {
    return Status::invalid_argument(fmt::format(
        "{}: register_host of {} ({} bytes) overlaps a registered range", name_, ptr, bytes));
  }
  registered_.emplace(begin, bytes);
  return Status::ok();
}

bool HostDevice::registered(const void* ptr, std::size_t bytes) const {
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto next = registered_.upper_bound(begin);
  if (next == registered_.begin()) return false;
  auto range = std::prev(next);
  return begin + bytes <= range->first + range->second;
}

Status HostDevice::unregister_host(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  if (registered_.erase(reinterpret_cast<std::uintptr_t>(ptr)) == 0) {
    return Status::invalid_argument(
        fmt::format("{}: unregister_host of {} which is not registered", name_, ptr));
  }
  return Status::ok();
}

bool HostDevice::contains(const void* ptr, std::size_t bytes) const {
  // A host address of an opaque device's memory is not a device pointer.
  if (opaque_bit_ != 0 && (reinterpret_cast<std::uintptr_t>(ptr) & opaque_bit_) == 0) return false;
  const auto begin = reinterpret_cast<std::uintptr_t>(host_address(ptr));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.upper_bound(begin);
  if (it == allocations_.begin()) return false;
  --it;
  return begin >= it->first && begin + bytes <= it->first + it->second;
}

Result<std::unique_ptr<Stream>> HostDevice::create_stream(std::string_view name) {
  std::uint32_t index;
  {
    std::lock_guard<std::mutex> lock(mu_);
    index = streams_created_++;
    ++live_streams_;
  }
  std::string full =
      name.empty() ? fmt::format("{}/stream{}", name_, index) : fmt::format("{}/{}", name_, name);
  return std::unique_ptr<Stream>(new HostStream(this, std::move(full), index));
}

Result<std::unique_ptr<Event>> HostDevice::create_event() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++live_events_;
  }
  return std::unique_ptr<Event>(new HostEvent(this));
}

Status HostDevice::record(Event& event, Stream& stream) {
  HostEvent& host_ev = host_event(event);
  HostStream& host = host_stream(stream);
  HostStream::Op op;
  op.type = HostStream::Op::Type::kRecord;
  op.event = host_ev.state_;
  {
    std::lock_guard<std::mutex> lock(host_ev.state_->mu);
    op.generation = ++host_ev.state_->recorded;
  }
  return host.enqueue(op);
}

Status HostDevice::wait(Stream& stream, Event& event) {
  HostEvent& host_ev = host_event(event);
  HostStream& host = host_stream(stream);
  HostStream::Op op;
  op.type = HostStream::Op::Type::kWait;
  op.event = host_ev.state_;
  {
    std::lock_guard<std::mutex> lock(host_ev.state_->mu);
    op.generation = host_ev.state_->recorded;
  }
  if (op.generation == 0) return Status::ok();  // never recorded: nothing to wait for
  return host.enqueue(op);
}

Result<bool> HostDevice::query(Event& event) {
  HostEventState& state = *host_event(event).state_;
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.completed < state.recorded) return false;
  if (!state.error.is_ok()) return state.error;
  return true;
}

Status HostDevice::synchronize(Event& event, std::chrono::milliseconds timeout) {
  HostEventState& state = *host_event(event).state_;
  std::unique_lock<std::mutex> lock(state.mu);
  const std::uint64_t target = state.recorded;
  if (!wait_for_or_forever(state.cv, lock, timeout, [&] { return state.completed >= target; })) {
    return Status::timeout(
        fmt::format("{}: synchronize event: not reached after {} ms", name_, timeout.count()));
  }
  return state.error;
}

Status HostDevice::synchronize(Stream& stream, std::chrono::milliseconds timeout) {
  return host_stream(stream).synchronize(timeout);
}

Status HostDevice::copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                              Stream& stream) {
  HostStream& host = host_stream(stream);
  if (bytes == 0) return Status::ok();
  const bool dst_on_device = kind != CopyKind::kDeviceToHost;
  const bool src_on_device = kind != CopyKind::kHostToDevice;
  const char* kind_name = kind == CopyKind::kHostToDevice   ? "host-to-device"
                          : kind == CopyKind::kDeviceToHost ? "device-to-host"
                                                            : "device-to-device";
  if (dst == nullptr || src == nullptr || (dst_on_device && !contains(dst, bytes)) ||
      (src_on_device && !contains(src, bytes))) {
    return Status::invalid_argument(fmt::format(
        "{}: {} copy of {} bytes from {} to {} on stream '{}': the device side is not inside "
        "memory this device allocated",
        name_, kind_name, bytes, src, dst, host.name()));
  }
  if (options_.require_registered_host && kind != CopyKind::kDeviceToDevice) {
    const void* host_side = dst_on_device ? src : dst;
    if (!registered(host_side, bytes)) {
      return Status::failed_precondition(fmt::format(
          "{}: {} copy of {} bytes from {} to {} on stream '{}': the host side is not registered "
          "memory (register_host), which a GPU would copy synchronously",
          name_, kind_name, bytes, src, dst, host.name()));
    }
  }
  if (dst_on_device) dst = host_address(dst);
  if (src_on_device) src = host_address(src);
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  if (d < s + bytes && s < d + bytes) {
    return Status::invalid_argument(
        fmt::format("{}: {} copy of {} bytes from {} to {}: the "
                    "ranges overlap",
                    name_, kind_name, bytes, src, dst));
  }
  HostStream::Op op;
  op.type = HostStream::Op::Type::kCopy;
  op.dst = dst;
  op.src = src;
  op.bytes = bytes;
  return host.enqueue(op);
}

Status HostDevice::memset_async(void* dst, int value, std::size_t bytes, Stream& stream) {
  HostStream& host = host_stream(stream);
  if (bytes == 0) return Status::ok();
  if (dst == nullptr || !contains(dst, bytes)) {
    return Status::invalid_argument(
        fmt::format("{}: memset of {} bytes at {} on stream '{}': not inside memory this device "
                    "allocated",
                    name_, bytes, dst, host.name()));
  }
  HostStream::Op op;
  op.type = HostStream::Op::Type::kMemset;
  op.dst = host_address(dst);
  op.value = value & 0xff;
  op.bytes = bytes;
  return host.enqueue(op);
}

Status HostDevice::launch_host_func(Stream& stream, HostFunc func, void* user) {
  HostStream& host = host_stream(stream);
  if (func == nullptr) {
    return Status::invalid_argument(
        fmt::format("{}: launch_host_func with a null function on "
                    "stream '{}'",
                    name_, host.name()));
  }
  HostStream::Op op;
  op.type = HostStream::Op::Type::kHostFunc;
  op.func = func;
  op.user = user;
  return host.enqueue(op);
}

int HostDevice::live_stream_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_streams_;
}

Result<std::unique_ptr<Device>> make_host_device(const HostDeviceOptions& options) {
  if (options.stream_queue_depth == 0) {
    return Status::invalid_argument("HostDeviceOptions.stream_queue_depth must be at least 1");
  }
  if (options.memory_limit_bytes == 0) {
    return Status::invalid_argument("HostDeviceOptions.memory_limit_bytes must be at least 1");
  }
  return std::unique_ptr<Device>(new HostDevice(options));
}

}  // namespace zinf
