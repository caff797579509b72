#include "zero/caller_stream.hpp"

namespace zinf {

std::atomic<unsigned> g_test_skip_caller_stream_waits{0};

namespace {
bool skip(unsigned wait) {
  return (g_test_skip_caller_stream_waits.load(std::memory_order_relaxed) & wait) != 0;
}
}  // namespace

Result<std::unique_ptr<CallerStream>> CallerStream::create(Device& device, Stream& stream) {
  std::unique_ptr<CallerStream> c(new CallerStream(device, stream));
  ZINF_ASSIGN_OR_RETURN(c->caller_done_, device.create_event());
  ZINF_ASSIGN_OR_RETURN(c->engine_done_, device.create_event());
  return c;
}

Status CallerStream::replace(std::unique_ptr<CallerStream>* slot, Device& device, Stream* stream,
                             std::chrono::milliseconds timeout) {
  std::unique_ptr<CallerStream> next;
  if (stream != nullptr) {
    ZINF_ASSIGN_OR_RETURN(next, create(device, *stream));
  }
  if (*slot != nullptr) ZINF_RETURN_IF_ERROR((*slot)->host_wait(timeout));
  *slot = std::move(next);
  return Status::ok();
}

Status CallerStream::wait_for(Event& event) {
  if (skip(kSkipGatherReady)) return Status::ok();
  return device_.wait(stream_, event);
}

Status CallerStream::order_after_caller(Stream& engine_stream, bool before_read) {
  if (skip(before_read ? kSkipBeforeRead : kSkipRelease)) return Status::ok();
  ZINF_RETURN_IF_ERROR(device_.record(*caller_done_, stream_));
  return device_.wait(engine_stream, *caller_done_);
}

Status CallerStream::order_caller_after(Stream& engine_stream) {
  if (skip(kSkipAfterRead)) return Status::ok();
  ZINF_RETURN_IF_ERROR(device_.record(*engine_done_, engine_stream));
  return device_.wait(stream_, *engine_done_);
}

Status CallerStream::host_wait(std::chrono::milliseconds timeout) {
  if (skip(kSkipHostWait)) return Status::ok();
  ZINF_RETURN_IF_ERROR(device_.record(*caller_done_, stream_));
  return device_.synchronize(*caller_done_, timeout);
}

}  // namespace zinf
