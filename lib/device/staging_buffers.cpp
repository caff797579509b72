#include "device/staging_buffers.hpp"

#include <algorithm>
#include <bit>
#include <utility>

namespace zinf {

Result<RegisteredBuffer> StagingBuffers::take(std::size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->bytes() >= bytes && (best == free_.end() || it->bytes() < best->bytes())) best = it;
    }
    if (best != free_.end()) {
      RegisteredBuffer out = std::move(*best);
      free_.erase(best);
      return out;
    }
  }
  // Registered outside the lock: cudaHostRegister of a large buffer takes milliseconds.
  Result<RegisteredBuffer> made =
      RegisteredBuffer::allocate(device_, std::bit_ceil(std::max(bytes, kMinBytes)));
  if (made.is_ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    ++registered_count_;
  }
  return made;
}

void StagingBuffers::give_back(RegisteredBuffer buffer) {
  RegisteredBuffer released;  // unregistered after the lock is dropped
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(std::move(buffer));
  if (free_.size() > kMaxFree) {
    auto smallest = std::min_element(
        free_.begin(), free_.end(),
        [](const RegisteredBuffer& a, const RegisteredBuffer& b) { return a.bytes() < b.bytes(); });
    released = std::move(*smallest);
    free_.erase(smallest);
  }
}

std::size_t StagingBuffers::registered_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return registered_count_;
}

std::size_t StagingBuffers::free_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

}  // namespace zinf
