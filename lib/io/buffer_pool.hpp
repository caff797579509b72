// BufferPool: a bounded set of fixed-size blocks for O_DIRECT I/O, backed by 2 MiB huge pages,
// pre-faulted and locked, and registered once with an IoEngine as fixed buffers.
//
// Why huge pages: a 1 MiB O_DIRECT request from a buffer of scattered 4 KiB pages becomes many
// physical segments and is split by the block layer on the virtual disks measured here, while
// one from 2 MiB pages is not; fio reads about 2.4x faster with --iomem=shmhuge than with
// malloc at 1 MiB x depth 32 (docs/IO.md has our own figure).
//
// Backing, tried in order (BufferPoolOptions::huge_pages):
//   kHugeTlb           mmap(MAP_HUGETLB) from the reserved pool (/proc/sys/vm/nr_hugepages)
//   kTransparentHuge   anonymous mmap aligned to 2 MiB with madvise(MADV_HUGEPAGE)
//   kNormal            4 KiB pages, with one warning
// then every page is touched (pre-faulted) and mlock()ed; a refused mlock is one warning, not
// an error (the memory still works, it may be swapped).
//
// The pool can also adopt external memory (for example pinned memory that a CUDA device
// registered), which it neither maps nor frees.
//
// Thread-safety: block(), data(), accessors: any thread. acquire() / try_acquire() / release():
// any thread, concurrently; the free list is bounded by block_count and allocates nothing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

#include "zinf/status.hpp"

namespace zinf {

class IoEngine;

enum class PageKind : std::uint8_t {
  kHugeTlb = 0,          // explicit 2 MiB pages (MAP_HUGETLB)
  kTransparentHuge = 1,  // THP requested with madvise (the kernel may still split some)
  kNormal = 2,           // 4 KiB pages
  kExternal = 3,         // adopted memory; its pages are the owner's business
};
std::string_view page_kind_name(PageKind kind);  // "hugetlb", "thp", "normal", "external"

enum class HugePages : std::uint8_t {
  kAuto = 0,         // hugetlb, else THP, else normal pages with one warning
  kHugeTlbOnly = 1,  // hugetlb or Status::resource_exhausted (for measurements)
  kThpOnly = 2,      // THP via madvise (never hugetlb)
  kNone = 3,         // normal 4 KiB pages (for comparison)
};

struct BufferPoolOptions {
  std::size_t block_bytes = std::size_t{1} << 20;  // a multiple of 4096
  std::size_t block_count = 8;                     // > 0
  HugePages huge_pages = HugePages::kAuto;
  bool lock = true;  // mlock() the pages (a failure is one warning)
  // Fill every byte once at creation (pre-faulting). Always on except for tests of the
  // page-fault cost; the first touch of an unfaulted huge page costs ~100 us.
  bool prefault = true;
};

class BufferPool {
 public:
  // Maps block_count * block_bytes (rounded up to 2 MiB for huge pages). Errors:
  // invalid_argument for bad options, resource_exhausted when no memory of the asked kind.
  static Result<std::unique_ptr<BufferPool>> create(const BufferPoolOptions& options);
  // Wraps memory the caller owns. REQUIRES: base 4096-aligned, block_bytes a multiple of 4096,
  // the memory outlives the pool.
  static Result<std::unique_ptr<BufferPool>> adopt(void* base, std::size_t block_bytes,
                                                   std::size_t block_count);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // REQUIRES: index < block_count().
  std::byte* block(std::size_t index) const;
  std::byte* data() const { return base_; }
  std::size_t block_bytes() const { return block_bytes_; }
  std::size_t block_count() const { return block_count_; }
  std::size_t bytes() const { return block_bytes_ * block_count_; }
  PageKind page_kind() const { return page_kind_; }
  bool locked() const { return locked_; }

  // Registers the whole pool with `engine` (see IoEngine::register_memory).
  Status register_with(IoEngine& engine) const;

  // Takes a free block index, waiting at most `timeout`; Status::timeout when none freed.
  Result<std::size_t> acquire(std::chrono::milliseconds timeout);
  std::optional<std::size_t> try_acquire();
  // REQUIRES: `index` was acquired and not yet released.
  void release(std::size_t index);
  std::size_t free_count() const;

 private:
  BufferPool() = default;
  void init_free_list();

  std::byte* base_ = nullptr;
  std::size_t mapped_bytes_ = 0;  // 0 for adopted memory
  std::size_t block_bytes_ = 0;
  std::size_t block_count_ = 0;
  PageKind page_kind_ = PageKind::kNormal;
  bool locked_ = false;

  mutable std::mutex mutex_;
  std::condition_variable freed_;
  std::vector<std::uint32_t> free_;   // stack of free indices, capacity block_count
  std::vector<std::uint8_t> in_use_;  // catches a double release
};

}  // namespace zinf
