// AbortableHandle: a handle (an ncclComm_t in NcclComm) that several threads use and that an
// abort may free, without ever freeing it under a call in flight.
//
// Every call that uses the handle borrows it for its duration (borrow() returns a Borrow, or
// nothing once the handle was aborted). abort() takes the handle away at once, so no new borrow
// succeeds, and runs the release function (ncclCommAbort) itself when nothing is borrowed, or
// else leaves it to the last borrow to end. So abort() never waits for a call in flight (it may
// be called from inside one, by the thread that borrowed), and the release runs exactly once,
// after every call that could still touch the handle has returned. Loops inside a borrow that
// may take long (polling a non-blocking NCCL call) watch aborted() and give up when it is set.
//
// No NCCL here, so that the rule is tested on any machine (tests/comm/nccl_comm_handle_test.cpp).
//
// Thread-safety: every member may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <mutex>
#include <optional>
#include <utility>

#include "base/assert.hpp"

namespace zinf {

template <typename Handle>
class AbortableHandle {
 public:
  // `release` frees an aborted handle. It runs at most once, outside the lock.
  AbortableHandle(Handle handle, std::function<void(Handle)> release)
      : handle_(handle), release_(std::move(release)) {}
  AbortableHandle(const AbortableHandle&) = delete;
  AbortableHandle& operator=(const AbortableHandle&) = delete;
  // REQUIRES: nothing borrowed.
  ~AbortableHandle() { ZINF_ASSERT(borrows_ == 0); }

  class Borrow {
   public:
    Borrow(Borrow&& other) noexcept
        : owner_(std::exchange(other.owner_, nullptr)), handle_(other.handle_) {}
    Borrow& operator=(Borrow&& other) noexcept {
      if (this != &other) {
        if (owner_ != nullptr) owner_->end_borrow();
        owner_ = std::exchange(other.owner_, nullptr);
        handle_ = other.handle_;
      }
      return *this;
    }
    Borrow(const Borrow&) = delete;
    Borrow& operator=(const Borrow&) = delete;
    ~Borrow() {
      if (owner_ != nullptr) owner_->end_borrow();
    }
    Handle get() const { return handle_; }

   private:
    friend class AbortableHandle;
    Borrow(AbortableHandle* owner, Handle handle) : owner_(owner), handle_(handle) {}
    AbortableHandle* owner_;
    Handle handle_;
  };

  // The handle for the duration of one call, or nullopt once aborted (or taken).
  std::optional<Borrow> borrow() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!live_) return std::nullopt;
    ++borrows_;
    return Borrow(this, handle_);
  }

  // Takes the handle away; the release runs now if nothing is borrowed, else when the last
  // borrow ends. Returns false when the handle had already been aborted or taken (no-op).
  bool abort() {
    Handle to_release{};
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!live_) return false;
      live_ = false;
      aborted_.store(true, std::memory_order_release);
      if (borrows_ > 0) {
        release_pending_ = true;
        return true;
      }
      to_release = handle_;
    }
    release_(to_release);
    return true;
  }

  // Hands the live handle to the caller (for an orderly destroy) and makes later borrows fail.
  // nullopt when aborted. REQUIRES: nothing borrowed.
  std::optional<Handle> take() {
    std::lock_guard<std::mutex> lock(mu_);
    ZINF_ASSERT(borrows_ == 0);
    if (!live_) return std::nullopt;
    live_ = false;
    return handle_;
  }

  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  std::size_t borrow_count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return borrows_;
  }

 private:
  void end_borrow() {
    bool release_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ZINF_ASSERT(borrows_ > 0);
      --borrows_;
      if (borrows_ == 0 && release_pending_) {
        release_pending_ = false;
        release_now = true;
      }
    }
    if (release_now) release_(handle_);
  }

  const Handle handle_;
  const std::function<void(Handle)> release_;
  mutable std::mutex mu_;
  std::size_t borrows_ = 0;       // calls in flight with the handle
  bool live_ = true;              // false once aborted or taken
  bool release_pending_ = false;  // aborted while borrowed: the last borrow releases
  std::atomic<bool> aborted_{false};
};

}  // namespace zinf
