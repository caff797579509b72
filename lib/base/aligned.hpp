// AlignedBuffer: an owned, aligned, uninitialised byte buffer for O_DIRECT I/O and SIMD loads.
// Huge-page backed, locked pools live in lib/device/ (PinnedPool); this is the plain kind.
// Thread-safety: a value; not shared.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "base/assert.hpp"

namespace zinf {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // REQUIRES: alignment is a power of two and a multiple of sizeof(void*).
  explicit AlignedBuffer(std::size_t bytes, std::size_t alignment = 4096) : bytes_(bytes) {
    ZINF_ASSERT(alignment != 0 && (alignment & (alignment - 1)) == 0);
    if (bytes == 0) return;
    void* p = nullptr;
    const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
    ZINF_ASSERT_MSG(posix_memalign(&p, alignment, rounded) == 0, "out of host memory");
    data_ = static_cast<std::byte*>(p);
  }
  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      std::free(data_);
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data_);
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace zinf
