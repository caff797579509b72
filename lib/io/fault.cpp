#include "io/fault.hpp"

#include <cerrno>
#include <thread>

namespace zinf {

long FaultInjector::on_complete(IoOp op, std::uint64_t /*offset*/, std::size_t requested_bytes,
                                void* data, long result) {
  if (!enabled_.load(std::memory_order_relaxed) || result <= 0) return result;
  if ((op == IoOp::kRead && !spec_.reads) || (op == IoOp::kWrite && !spec_.writes)) {
    return result;
  }
  double fault_draw, latency_draw, flip_draw;
  std::uint64_t bits;
  {
    std::lock_guard lock(mutex_);
    fault_draw = random_.uniform();
    latency_draw = random_.uniform();
    flip_draw = random_.uniform();
    bits = random_.next();
  }
  if (latency_draw < spec_.latency_rate) {
    latency_.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(spec_.latency);
  }
  // One draw picks at most one of the exclusive faults, by cumulative rate.
  double x = fault_draw;
  if (x < spec_.hang_rate) {
    // Counted against hang_max without a lock: a compare-exchange loop on the counter.
    std::uint64_t hung = hang_.load(std::memory_order_relaxed);
    while (spec_.hang_max == 0 || hung < spec_.hang_max) {
      if (hang_.compare_exchange_weak(hung, hung + 1, std::memory_order_relaxed)) return kHang;
    }
    x = 2;  // hangs used up: this draw picks no other exclusive fault
  } else {
    x -= spec_.hang_rate;
  }
  if (x < spec_.eio_rate) {
    eio_.fetch_add(1, std::memory_order_relaxed);
    return -EIO;
  }
  x -= spec_.eio_rate;
  if (op == IoOp::kWrite) {
    if (x < spec_.enospc_rate) {
      enospc_.fetch_add(1, std::memory_order_relaxed);
      return -ENOSPC;
    }
    x -= spec_.enospc_rate;
  }
  if (x < spec_.eintr_rate) {
    eintr_.fetch_add(1, std::memory_order_relaxed);
    return -EINTR;
  }
  x -= spec_.eintr_rate;
  if (x < spec_.eagain_rate) {
    eagain_.fetch_add(1, std::memory_order_relaxed);
    return -EAGAIN;
  }
  x -= spec_.eagain_rate;
  if (x < spec_.short_rate && result > static_cast<long>(kDirectAlignment)) {
    // A short transfer of a whole number of 4 KiB blocks, as the kernel returns for O_DIRECT,
    // so the resubmitted rest keeps its alignment.
    const long blocks = (result - 1) / static_cast<long>(kDirectAlignment);
    const long keep = 1 + static_cast<long>(bits % static_cast<std::uint64_t>(blocks));
    short_.fetch_add(1, std::memory_order_relaxed);
    return keep * static_cast<long>(kDirectAlignment);
  }
  if (op == IoOp::kRead && flip_draw < spec_.bit_flip_rate) {
    const std::uint64_t bit = (bits >> 8) % (static_cast<std::uint64_t>(result) * 8);
    static_cast<unsigned char*>(data)[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    bit_flip_.fetch_add(1, std::memory_order_relaxed);
  }
  (void)requested_bytes;
  return result;
}

int FaultInjector::on_submit() {
  if (!enabled_.load(std::memory_order_relaxed) || spec_.submit_errno == 0) return 0;
  if (submit_calls_.fetch_add(1, std::memory_order_relaxed) < spec_.submit_after) return 0;
  std::uint64_t failed = submit_error_.load(std::memory_order_relaxed);
  while (spec_.submit_max == 0 || failed < spec_.submit_max) {
    if (submit_error_.compare_exchange_weak(failed, failed + 1, std::memory_order_relaxed)) {
      return -spec_.submit_errno;
    }
  }
  return 0;
}

int FaultInjector::on_wait() {
  if (!enabled_.load(std::memory_order_relaxed) || spec_.wait_errno == 0) return 0;
  wait_error_.fetch_add(1, std::memory_order_relaxed);
  return -spec_.wait_errno;
}

FaultCounts FaultInjector::counts() const {
  FaultCounts c;
  c.eio = eio_.load(std::memory_order_relaxed);
  c.enospc = enospc_.load(std::memory_order_relaxed);
  c.short_io = short_.load(std::memory_order_relaxed);
  c.eintr = eintr_.load(std::memory_order_relaxed);
  c.eagain = eagain_.load(std::memory_order_relaxed);
  c.latency = latency_.load(std::memory_order_relaxed);
  c.bit_flip = bit_flip_.load(std::memory_order_relaxed);
  c.hang = hang_.load(std::memory_order_relaxed);
  c.submit_error = submit_error_.load(std::memory_order_relaxed);
  c.wait_error = wait_error_.load(std::memory_order_relaxed);
  return c;
}

}  // namespace zinf
