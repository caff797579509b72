// AlignedBuffer: an owned, aligned, uninitialised byte buffer for O_DIRECT I/O and SIMD loads.
// Huge-page backed, locked pools live in lib/device/ (PinnedPool); this is the plain kind.
// Thread-safety: a value; not shared.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

#include "base/assert.hpp"
#include "zinf/status.hpp"

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
  // A page-aligned buffer of zeros from an anonymous mapping, into *out (what it held is
  // released first; 0 bytes leave it empty): its pages take no memory until they are first
  // written, so a large array that is filled piece by piece (or stays zero for a while, like a
  // gradient accumulator before the first backward pass) does not count in the resident set
  // before it is used. kResourceExhausted, naming `what` and the bytes asked, when the kernel
  // refuses the mapping (the address space or the overcommit limit); *out is then empty.
  static Status zeroed_pages(std::size_t bytes, std::string_view what, AlignedBuffer* out) {
    *out = AlignedBuffer();
    if (bytes == 0) return Status::ok();
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      const Status st = status_from_errno(
          std::string(what) + ": mapping " + std::to_string(bytes) + " bytes of zero pages", err);
      return Status(Code::kResourceExhausted, err, std::string(st.message()));
    }
    out->data_ = static_cast<std::byte*>(p);
    out->bytes_ = bytes;
    out->mapped_ = true;
    return Status::ok();
  }
  // The most ranges of one buffer a caller advises off huge pages: each advised range splits the
  // mapping in up to three, and vm.max_map_count (65530 by default) bounds all of a process's
  // mappings; a caller with more ranges than this advises none.
  static constexpr std::size_t kMaxAdvisedStretches = 1024;
  // Asks the kernel not to back the whole pages inside bytes [offset_bytes, offset_bytes +
  // bytes) of a zeroed_pages() buffer with transparent huge pages (MADV_NOHUGEPAGE): where
  // /sys/kernel/mm/transparent_hugepage/enabled is "always", the first write next to a range
  // that stays zero would otherwise fault in the whole 2 MiB page around it, zeros included.
  // Each call splits the mapping into up to three (the kernel's map count limit,
  // vm.max_map_count, bounds them all). Advice only: false when there is no whole page inside
  // the range or the kernel refused (no THP support, the map count limit), and nothing is lost.
  // REQUIRES: a zeroed_pages() buffer; offset_bytes + bytes <= this->bytes().
  bool advise_no_huge_pages(std::size_t offset_bytes, std::size_t bytes) {
    ZINF_ASSERT(mapped_ && offset_bytes + bytes <= bytes_);
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t lo = (offset_bytes + page - 1) / page * page;
    const std::size_t hi = (offset_bytes + bytes) / page * page;
    if (hi <= lo) return false;
    return ::madvise(data_ + lo, hi - lo, MADV_NOHUGEPAGE) == 0;
  }

  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        mapped_(std::exchange(other.mapped_, false)) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      mapped_ = std::exchange(other.mapped_, false);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }

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
  void release() {
    if (mapped_) {
      ::munmap(data_, bytes_);
    } else {
      std::free(data_);
    }
    data_ = nullptr;
    bytes_ = 0;
    mapped_ = false;
  }

  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool mapped_ = false;  // from zeroed_pages(): munmap, not free
};

}  // namespace zinf
