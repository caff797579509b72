#include "device/pinned_pool.hpp"

#include <fmt/format.h>

#include "base/assert.hpp"
#include "io/io_engine.hpp"
#include "zinf/device.hpp"
#include "zinf/log.hpp"

namespace zinf {

std::size_t PinnedPool::Lease::index() const {
  ZINF_ASSERT(pool_ != nullptr);
  return index_;
}

std::byte* PinnedPool::Lease::data() const {
  ZINF_ASSERT(pool_ != nullptr);
  return pool_->blocks_->block(index_);
}

std::size_t PinnedPool::Lease::bytes() const {
  ZINF_ASSERT(pool_ != nullptr);
  return pool_->blocks_->block_bytes();
}

void PinnedPool::Lease::release() {
  if (pool_ == nullptr) return;
  PinnedPool* pool = std::exchange(pool_, nullptr);
  pool->leased_.fetch_sub(1, std::memory_order_relaxed);
  pool->blocks_->release(index_);
}

Result<std::unique_ptr<PinnedPool>> PinnedPool::create(const PinnedPoolOptions& options) {
  if (options.block_bytes == 0 || options.block_bytes % 4096 != 0 || options.block_count == 0) {
    return Status::invalid_argument(fmt::format(
        "PinnedPool: block_bytes {} must be a positive multiple of 4096 and block_count {} > 0",
        options.block_bytes, options.block_count));
  }
  BufferPoolOptions buffer_options;
  buffer_options.block_bytes = options.block_bytes;
  buffer_options.block_count = options.block_count;
  buffer_options.huge_pages = options.huge_pages;
  buffer_options.lock = options.lock;
  buffer_options.prefault = true;
  std::unique_ptr<PinnedPool> pool(new PinnedPool());
  ZINF_ASSIGN_OR_RETURN(pool->blocks_, BufferPool::create(buffer_options));
  if (options.device != nullptr) {
    Status status = options.device->register_host(pool->blocks_->data(), pool->blocks_->bytes());
    if (!status.is_ok()) {
      return status.with_context(fmt::format("PinnedPool: page-locking {} bytes for {}",
                                             pool->blocks_->bytes(), options.device->name()));
    }
    pool->device_ = options.device;
  }
  return pool;
}

PinnedPool::~PinnedPool() {
  ZINF_ASSERT_MSG(leased_.load() == 0, "PinnedPool destroyed with blocks still leased");
  for (IoEngine* engine : engines_) {
    Status status = engine->unregister_memory(blocks_->data());
    if (!status.is_ok()) log_warn("device: pinned pool: {}", status.to_string());
  }
  if (device_ != nullptr) {
    Status status = device_->unregister_host(blocks_->data());
    if (!status.is_ok()) log_warn("device: pinned pool: {}", status.to_string());
  }
}

Status PinnedPool::register_with(IoEngine& engine) {
  for (IoEngine* e : engines_) {
    if (e == &engine) return Status::ok();
  }
  ZINF_RETURN_IF_ERROR(blocks_->register_with(engine));
  engines_.push_back(&engine);
  return Status::ok();
}

void PinnedPool::note_leased() {
  const std::size_t now = leased_.fetch_add(1, std::memory_order_relaxed) + 1;
  std::size_t peak = leased_peak_.load(std::memory_order_relaxed);
  while (now > peak && !leased_peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

Result<PinnedPool::Lease> PinnedPool::acquire(std::chrono::milliseconds timeout) {
  Result<std::size_t> index = blocks_->acquire(timeout);
  if (!index.is_ok()) {
    return Status::timeout(
        fmt::format("PinnedPool: none of {} blocks of {} bytes returned within {} ms",
                    block_count(), block_bytes(), timeout.count()));
  }
  note_leased();
  return Lease(this, *index);
}

std::optional<PinnedPool::Lease> PinnedPool::try_acquire() {
  std::optional<std::size_t> index = blocks_->try_acquire();
  if (!index) return std::nullopt;
  note_leased();
  return Lease(this, *index);
}

}  // namespace zinf
