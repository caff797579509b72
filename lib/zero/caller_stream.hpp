// CallerStream: the caller's compute stream (Engine::set_compute_stream) and the events that
// order the engine's streams with it, shared by the engine, its ParamCoordinator and its
// GradReducer.
//
// The caller queues its forward and backward work on its own stream and does not synchronise
// it; the engine orders itself by events instead of host waits:
//   gather()            the caller's stream waits for the module's all-gather (wait_for()).
//   release()           the coordinator's stream waits for the caller's work queued so far
//                       before a later gather overwrites the buffers (order_after_caller()).
//   reduce_gradients()  the stream that reads the gradients waits for the caller's work first
//                       (order_after_caller()), and the caller's stream waits for that read
//                       before its later work may overwrite them (order_caller_after()).
// host_wait() is the host-side wait, for what host code reads (a host-accessible device) and
// for the rare buffer really freed rather than kept for reuse.
//
// The events are re-recorded by each call; a wait takes the record made just before it, so one
// pair serves every call in turn. Recording and waiting allocate nothing.
//
// Thread-safety: one thread (the rank's).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>

#include "zinf/device.hpp"
#include "zinf/status.hpp"

namespace zinf {

class CallerStream {
 public:
  // `stream` must be a stream of `device`; both must outlive this.
  static Result<std::unique_ptr<CallerStream>> create(Device& device, Stream& stream);
  // Replaces `*slot` with one for `stream` (null: none), after waiting on the host for the work
  // queued on the old one (its error, kTimeout; `*slot` is then unchanged).
  static Status replace(std::unique_ptr<CallerStream>* slot, Device& device, Stream* stream,
                        std::chrono::milliseconds timeout);

  Stream& stream() const { return stream_; }
  // The caller's stream waits for `event`'s latest record (the engine's work before it).
  Status wait_for(Event& event);
  // `engine_stream` waits for the work queued on the caller's stream so far. `before_read`: the
  // engine is about to read the caller's data (reduce_gradients), else to overwrite what the
  // caller read (release); only the test switch tells them apart.
  Status order_after_caller(Stream& engine_stream, bool before_read);
  // The caller's stream waits for the work queued on `engine_stream` so far.
  Status order_caller_after(Stream& engine_stream);
  // Blocks until the work queued on the caller's stream so far has run (its error, kTimeout).
  Status host_wait(std::chrono::milliseconds timeout);

 private:
  CallerStream(Device& device, Stream& stream) : device_(device), stream_(stream) {}

  Device& device_;
  Stream& stream_;
  std::unique_ptr<Event> caller_done_;  // recorded on the caller's stream
  std::unique_ptr<Event> engine_done_;  // recorded on an engine stream
};

// Tests only (the negative controls of tests/engine/compute_stream_test.cpp): the CallerStream
// calls whose bit is set return OK without ordering anything.
enum CallerWaitSkip : unsigned {
  kSkipGatherReady = 1,  // wait_for
  kSkipRelease = 2,      // order_after_caller(before_read = false)
  kSkipBeforeRead = 4,   // order_after_caller(before_read = true)
  kSkipAfterRead = 8,    // order_caller_after
  kSkipHostWait = 16,    // host_wait
};
extern std::atomic<unsigned> g_test_skip_caller_stream_waits;

}  // namespace zinf
