// PinnedPool: the bounded host memory of the offloaded optimizer step. A fixed number of
// fixed-size blocks, allocated once at create(), backed by huge pages, pre-faulted and locked,
// registered once with each IoEngine that reads or writes them (fixed buffers on io_uring) and,
// when a Device is given, page-locked for that device too (Device::register_host, which is
// cudaHostRegister on CudaDevice), so one block serves the NVMe read and the host-to-device copy
// without a bounce buffer.
//
// Blocks are leased through RAII handles (Lease): the block returns to the pool when its lease
// is destroyed or released. acquire() waits, with a timeout, for a block to come back; it never
// allocates. The pool's total size is the configuration value that bounds the step's host memory.
//
// The blocks themselves come from BufferPool (lib/io/buffer_pool.hpp), which does the mapping,
// the huge-page fallback chain and the locking; this class adds the leases, the device
// registration and the bookkeeping the step's telemetry reads.
//
// Thread-safety: acquire() / try_acquire() / Lease::release() and the accessors may be called from
// any thread, concurrently. register_with() and the destructor: one thread, with no I/O in flight
// into the pool. REQUIRES at destruction: every lease has been returned.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "io/buffer_pool.hpp"
#include "zinf/status.hpp"

namespace zinf {

class Device;
class IoEngine;

struct PinnedPoolOptions {
  // Bytes of one block: a positive multiple of 4096. The step puts one sub-group in a block.
  std::size_t block_bytes = std::size_t{64} << 20;
  // Blocks (> 0). The step needs at least 2 (one updated while the other reads or writes); with
  // 3 or more, reads of later sub-groups run ahead while earlier ones are written.
  std::size_t block_count = 16;
  // hugetlb, else THP, else 4 KiB pages (see BufferPool). Note that hugetlb pages do not show
  // in a process's RSS while THP and normal pages do.
  HugePages huge_pages = HugePages::kAuto;
  // mlock() the blocks (a refusal is one warning: the memory still works).
  bool lock = true;
  // When set, the whole pool is page-locked for this device with register_host at create() and
  // unregistered at destruction (cudaHostRegister on CudaDevice; a checked no-op on HostDevice).
  // The device must outlive the pool.
  Device* device = nullptr;
};

class PinnedPool {
 public:
  // A leased block. Move-only; returns the block to the pool when destroyed or released.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)), index_(other.index_) {}
    Lease& operator=(Lease&& other) noexcept {
      if (this != &other) {
        release();
        pool_ = std::exchange(other.pool_, nullptr);
        index_ = other.index_;
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { release(); }

    bool valid() const { return pool_ != nullptr; }
    // REQUIRES: valid().
    std::size_t index() const;
    std::byte* data() const;
    std::size_t bytes() const;
    // Returns the block now. REQUIRES: no I/O into or out of it is in flight. No-op if invalid.
    void release();

   private:
    friend class PinnedPool;
    Lease(PinnedPool* pool, std::size_t index) : pool_(pool), index_(index) {}
    PinnedPool* pool_ = nullptr;
    std::size_t index_ = 0;
  };

  // Maps, pre-faults and locks block_count * block_bytes, and registers it with
  // options.device when set. Errors: invalid_argument (bad sizes), resource_exhausted (no memory
  // of the asked kind), and the device's register_host error (message names the pool's size).
  static Result<std::unique_ptr<PinnedPool>> create(const PinnedPoolOptions& options);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Registers every block with `engine` for fixed-buffer I/O; unregistered at destruction.
  // REQUIRES: the engine outlives the pool (or the pool is destroyed first). Errors: the engine's
  // (resource_exhausted when its table is full, io_error when the kernel refuses).
  Status register_with(IoEngine& engine);

  // Leases a free block, waiting at most `timeout` for one to be returned. Status::timeout when
  // none came back (the message names the pool's size and the timeout). Never allocates.
  Result<Lease> acquire(std::chrono::milliseconds timeout);
  // Leases a free block if there is one now.
  std::optional<Lease> try_acquire();

  std::size_t block_bytes() const { return blocks_->block_bytes(); }
  std::size_t block_count() const { return blocks_->block_count(); }
  std::size_t bytes() const { return blocks_->bytes(); }
  std::size_t free_count() const { return blocks_->free_count(); }
  // REQUIRES: index < block_count(). For code that must address a block by index (tests).
  std::byte* block(std::size_t index) const { return blocks_->block(index); }
  PageKind page_kind() const { return blocks_->page_kind(); }
  bool locked() const { return blocks_->locked(); }
  bool device_registered() const { return device_ != nullptr; }
  // Most blocks leased at once since create() (or since reset_peak()).
  std::size_t leased_peak() const { return leased_peak_.load(std::memory_order_relaxed); }
  void reset_peak() { leased_peak_.store(block_count() - free_count()); }

 private:
  PinnedPool() = default;
  void note_leased();

  std::unique_ptr<BufferPool> blocks_;
  Device* device_ = nullptr;  // registered with, when not null
  std::vector<IoEngine*> engines_;
  std::atomic<std::size_t> leased_{0};
  std::atomic<std::size_t> leased_peak_{0};
};

}  // namespace zinf
