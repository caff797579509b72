// StagingBuffers: reusable host buffers registered with a device, for code that moves device
// memory through the host (MpiComm's collectives on a device host code cannot touch).
//
// On CUDA a copy to or from pageable host memory runs synchronously through a driver bounce
// buffer; a copy from registered (page-locked) memory is a true asynchronous DMA. Registering is
// itself slow (cudaHostRegister pins pages one by one), so buffers are registered once and
// reused: take() hands out the smallest free buffer of at least the bytes asked for, or registers
// a new one whose size is rounded up to a power of two (at least kMinBytes), and give_back()
// returns it. At most kMaxFree buffers stay registered while free; when one more comes back the
// smallest is released, so host memory stays bounded by what is in flight plus kMaxFree of the
// largest sizes used.
//
// Thread-safety: take() and give_back() from any thread. The device must outlive the object and
// every buffer it handed out.
#pragma once

#include <cstddef>
#include <mutex>
#include <vector>

#include "device/device_ops.hpp"
#include "zinf/status.hpp"

namespace zinf {

class StagingBuffers {
 public:
  static constexpr std::size_t kMinBytes = std::size_t{64} << 10;
  static constexpr std::size_t kMaxFree = 8;

  explicit StagingBuffers(Device& device) : device_(device) {}
  StagingBuffers(const StagingBuffers&) = delete;
  StagingBuffers& operator=(const StagingBuffers&) = delete;

  // A registered buffer of at least `bytes` bytes (bytes > 0).
  Result<RegisteredBuffer> take(std::size_t bytes);
  // Returns a buffer take() handed out. REQUIRES: no issued copy still uses it.
  void give_back(RegisteredBuffer buffer);

  // Buffers registered so far (for tests: reuse means this stops growing).
  std::size_t registered_count() const;
  std::size_t free_count() const;

 private:
  Device& device_;
  mutable std::mutex mu_;
  std::vector<RegisteredBuffer> free_;  // guarded by mu_
  std::size_t registered_count_ = 0;    // guarded by mu_
};

}  // namespace zinf
