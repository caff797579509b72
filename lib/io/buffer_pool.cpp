#include "io/buffer_pool.hpp"

#include <fmt/format.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "base/arith.hpp"
#include "base/assert.hpp"
#include "io/io_engine.hpp"
#include "zinf/log.hpp"

namespace zinf {

namespace {
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// Anonymous memory aligned to 2 MiB (so THP can back it with whole huge pages): map 2 MiB
// more, then trim both ends.
void* map_aligned(std::size_t bytes) {
  const std::size_t padded = bytes + kHugePageBytes;
  void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = round_up(start, kHugePageBytes);
  if (aligned > start) munmap(raw, aligned - start);
  const std::uintptr_t end = start + padded;
  if (end > aligned + bytes)
    munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  return reinterpret_cast<void*>(aligned);
}

std::atomic<bool> g_warned_normal{false};
std::atomic<bool> g_warned_lock{false};
}  // namespace

std::string_view page_kind_name(PageKind kind) {
  switch (kind) {
    case PageKind::kHugeTlb:
      return "hugetlb";
    case PageKind::kTransparentHuge:
      return "thp";
    case PageKind::kNormal:
      return "normal";
    case PageKind::kExternal:
      return "external";
  }
  return "unknown";
}

Result<std::unique_ptr<BufferPool>> BufferPool::create(const BufferPoolOptions& options) {
  if (options.block_bytes == 0 || options.block_bytes % 4096 != 0 || options.block_count == 0) {
    return Status::invalid_argument(fmt::format(
        "BufferPool: block_bytes {} must be a positive multiple of 4096 and block_count {} > 0",
        options.block_bytes, options.block_count));
  }
  const std::size_t bytes = options.block_bytes * options.block_count;
  const std::size_t mapped = round_up(bytes, kHugePageBytes);
  std::unique_ptr<BufferPool> pool(new BufferPool());
  void* base = nullptr;
  PageKind kind = PageKind::kNormal;

  if (options.huge_pages == HugePages::kAuto || options.huge_pages == HugePages::kHugeTlbOnly) {
    base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_POPULATE, -1, 0);
    if (base == MAP_FAILED) {
      base = nullptr;
      if (options.huge_pages == HugePages::kHugeTlbOnly) {
        return Status::resource_exhausted(fmt::format(
            "BufferPool: no {} MiB of reserved huge pages (raise /proc/sys/vm/nr_hugepages): {}",
            mapped >> 20, std::strerror(errno)));
      }
    } else {
      kind = PageKind::kHugeTlb;
    }
  }
  if (base == nullptr) {
    base = map_aligned(mapped);
    if (base == nullptr) {
      return Status::resource_exhausted(
          fmt::format("BufferPool: cannot map {} bytes: {}", mapped, std::strerror(errno)));
    }
    kind = PageKind::kNormal;
    if (options.huge_pages != HugePages::kNone && madvise(base, mapped, MADV_HUGEPAGE) == 0) {
      kind = PageKind::kTransparentHuge;
    } else if (options.huge_pages != HugePages::kNone &&
               !g_warned_normal.exchange(true, std::memory_order_relaxed)) {
      log_warn(
          "io: buffer pool on 4 KiB pages (no hugetlb reserve, THP refused: {}); large "
          "O_DIRECT requests may be split by the block layer",
          std::strerror(errno));
    }
  }
  pool->base_ = static_cast<std::byte*>(base);
  pool->mapped_bytes_ = mapped;
  pool->block_bytes_ = options.block_bytes;
  pool->block_count_ = options.block_count;
  pool->page_kind_ = kind;
  // Pre-fault: touching every page now moves the page-fault and zeroing cost out of the first
  // I/O, and lets THP back the range while it is still empty.
  if (options.prefault) {
    for (std::size_t off = 0; off < mapped; off += 4096) pool->base_[off] = std::byte{0};
  }
  if (options.lock) {
    if (mlock(base, mapped) == 0) {
      pool->locked_ = true;
    } else if (!g_warned_lock.exchange(true, std::memory_order_relaxed)) {
      log_warn("io: mlock of the {} MiB buffer pool failed ({}); it may be swapped out",
               mapped >> 20, std::strerror(errno));
    }
  }
  pool->init_free_list();
  return pool;
}

Result<std::unique_ptr<BufferPool>> BufferPool::adopt(void* base, std::size_t block_bytes,
                                                      std::size_t block_count) {
  if (base == nullptr || reinterpret_cast<std::uintptr_t>(base) % 4096 != 0 || block_bytes == 0 ||
      block_bytes % 4096 != 0 || block_count == 0) {
    return Status::invalid_argument(
        "BufferPool::adopt: base must be 4096-aligned, block_bytes a positive multiple of 4096");
  }
  std::unique_ptr<BufferPool> pool(new BufferPool());
  pool->base_ = static_cast<std::byte*>(base);
  pool->block_bytes_ = block_bytes;
  pool->block_count_ = block_count;
  pool->page_kind_ = PageKind::kExternal;
  pool->init_free_list();
  return pool;
}

void BufferPool::init_free_list() {
  free_.reserve(block_count_);
  for (std::size_t i = block_count_; i-- > 0;) free_.push_back(static_cast<std::uint32_t>(i));
  in_use_.assign(block_count_, 0);
}

BufferPool::~BufferPool() {
  if (mapped_bytes_ != 0) {
    if (locked_) munlock(base_, mapped_bytes_);
    munmap(base_, mapped_bytes_);
  }
}

std::byte* BufferPool::block(std::size_t index) const {
  ZINF_ASSERT(index < block_count_);
  return base_ + index * block_bytes_;
}

Status BufferPool::register_with(IoEngine& engine) const {
  return engine.register_memory(base_, bytes());
}

Result<std::size_t> BufferPool::acquire(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!freed_.wait_for(lock, timeout, [&] { return !free_.empty(); })) {
    return Status::timeout(fmt::format("BufferPool: no block of {} freed within {} ms",
                                       block_count_, timeout.count()));
  }
  const std::uint32_t index = free_.back();
  free_.pop_back();
  in_use_[index] = 1;
  return static_cast<std::size_t>(index);
}

std::optional<std::size_t> BufferPool::try_acquire() {
  std::lock_guard lock(mutex_);
  if (free_.empty()) return std::nullopt;
  const std::uint32_t index = free_.back();
  free_.pop_back();
  in_use_[index] = 1;
  return static_cast<std::size_t>(index);
}

void BufferPool::release(std::size_t index) {
  {
    std::lock_guard lock(mutex_);
    ZINF_ASSERT(index < block_count_);
    ZINF_ASSERT_MSG(in_use_[index] == 1, "BufferPool::release: block was not acquired");
    in_use_[index] = 0;
    free_.push_back(static_cast<std::uint32_t>(index));
  }
  freed_.notify_one();
}

std::size_t BufferPool::free_count() const {
  std::lock_guard lock(mutex_);
  return free_.size();
}

}  // namespace zinf
