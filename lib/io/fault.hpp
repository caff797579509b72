// FaultInjector: seeded storage faults for tests, injected inside the engines.
//
// Set IoOptions::faults and every piece an engine completes is shown to the injector first,
// which may turn its result into a fault. Because this happens where the backend reads the
// completion (the io_uring CQE, the pread return value), injected short transfers, EINTR and
// EAGAIN exercise the engine's own retry loop; a decorator above IoEngine could only fake it.
//
// What each fault does, and what the caller then sees (the documented contract the tests hold):
//   eio         the piece fails with EIO           -> wait(): io_error, sys_code EIO, path+offset
//   enospc      a write piece fails with ENOSPC    -> wait(): no_space, sys_code ENOSPC, path
//   short_io    the piece moves fewer bytes        -> the engine resubmits the rest; wait(): OK
//   eintr       the piece fails with EINTR         -> retried (at most retry_max times in a row);
//   eagain      the piece fails with EAGAIN           OK, or io_error with that errno beyond it
//   latency     the completion is delayed          -> OK, later (a wait may time out)
//   bit_flip    one random bit of a read piece is  -> wait(): OK (the engine cannot know);
//               flipped after a successful read       SwapSpace::wait(): corruption
//   hang        the completion never arrives: the  -> wait(): timeout, again and again, until
//               engine keeps the piece in flight      cancel(); then the request fails with
//               (a drive that stopped answering)      ECANCELED (io_error). With
//                                                     hang_ignores_cancel, cancel() does not
//                                                     reach it either: it stays in flight until
//                                                     the engine closes
// Ring faults (UringEngine only), where the engine talks to the ring rather than to the drive:
//   submit_errno  io_uring_submit fails with it and   -> EAGAIN / EBUSY / EINTR: the entries stay
//                 the kernel takes nothing               queued and go with a later submit; any
//                                                        other errno breaks the ring: wait() of
//                                                        each request whose pieces it held, and
//                                                        of every later request on that ring:
//                                                        io_error with that errno, path+offset
//   wait_errno    io_uring_wait_cqe fails with it     -> completions are still reaped (polled
//                                                        with a bounded back-off), one log line
// Rates are probabilities per piece completion, drawn from one SplitMix64 stream seeded with
// `seed` (the draw order follows completion order, which threads can reorder; a failing test
// replays the same fault mix, not always the same sequence).
//
// Thread-safety: on_complete() may be called from any engine thread; counters are atomic.
#pragma once

#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "base/random.hpp"
#include "io/io_engine.hpp"

namespace zinf {

struct FaultSpec {
  std::uint64_t seed = 1;
  double eio_rate = 0;
  double enospc_rate = 0;  // writes only
  double short_rate = 0;
  double eintr_rate = 0;
  double eagain_rate = 0;
  double latency_rate = 0;
  std::chrono::microseconds latency{2000};
  double bit_flip_rate = 0;  // reads only
  double hang_rate = 0;
  std::uint32_t hang_max = 0;        // at most this many pieces hang; 0: no limit
  bool hang_ignores_cancel = false;  // a hung piece is not released by IoEngine::cancel()
  // Restrict faults to reads or writes when set.
  bool reads = true;
  bool writes = true;
  // Ring faults (see the file comment): io_uring_submit fails with -submit_errno from the
  // (submit_after + 1)-th submit on, at most submit_max times (0: no limit); every
  // io_uring_wait_cqe fails with -wait_errno. 0: no fault.
  int submit_errno = 0;
  std::uint32_t submit_after = 0;
  std::uint32_t submit_max = 0;
  int wait_errno = 0;
};

struct FaultCounts {
  std::uint64_t eio = 0, enospc = 0, short_io = 0, eintr = 0, eagain = 0, latency = 0, bit_flip = 0,
                hang = 0, submit_error = 0, wait_error = 0;
};

class FaultInjector {
 public:
  static constexpr long kHang = LONG_MIN;

  explicit FaultInjector(const FaultSpec& spec) : spec_(spec), random_(spec.seed) {}

  // Called by an engine when a piece of `op` on [offset, offset + requested_bytes) completed
  // with `result` (bytes moved, or -errno) into / from `data`. Returns the result to act on:
  // `result` unchanged, a smaller byte count (short), -EIO / -ENOSPC / -EINTR / -EAGAIN, or
  // kHang: the engine must then keep the piece in flight, unfinished, until it is cancelled
  // (IoEngine::cancel, unless spec().hang_ignores_cancel) or the engine closes.
  // May sleep (latency) and may flip a bit in data[0, result) of a read.
  long on_complete(IoOp op, std::uint64_t offset, std::size_t requested_bytes, void* data,
                   long result);

  // Called by UringEngine before each io_uring_submit and io_uring_wait_cqe. Returns 0 (go on
  // and call it) or -errno: the call is not made and fails with that.
  int on_submit();
  int on_wait();

  // Turns injection on or off (e.g. off while a test writes its reference data).
  void set_enabled(bool enabled) { enabled_.store(enabled, std::memory_order_relaxed); }
  FaultCounts counts() const;
  const FaultSpec& spec() const { return spec_; }

 private:
  FaultSpec spec_;
  std::mutex mutex_;  // guards random_
  SplitMix64 random_;
  std::atomic<bool> enabled_{true};
  std::atomic<std::uint64_t> eio_{0}, enospc_{0}, short_{0}, eintr_{0}, eagain_{0}, latency_{0},
      bit_flip_{0}, hang_{0}, submit_calls_{0}, submit_error_{0}, wait_error_{0};
};

}  // namespace zinf
