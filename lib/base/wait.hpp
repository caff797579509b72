// Bounded condition-variable waits that also accept kWaitForever (include/zinf/device.hpp).
// std::condition_variable::wait_for adds the timeout to now(), which overflows for
// milliseconds::max(); a timeout of a day or more therefore waits without a limit.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace zinf {

// Waits on `cv` (with `lock` held) until `pred()` is true or `timeout` has passed, and returns
// pred(). A timeout of 24 hours or more (kWaitForever among them) waits until pred() is true.
template <typename Pred>
bool wait_for_or_forever(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                         std::chrono::milliseconds timeout, Pred pred) {
  if (timeout >= std::chrono::hours(24)) {
    cv.wait(lock, pred);
    return true;
  }
  return cv.wait_for(lock, timeout, pred);
}

}  // namespace zinf
