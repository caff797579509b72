// StepRunner: see step_runner.hpp.
#include "engine/step_runner.hpp"

#include "base/assert.hpp"

namespace zinf {

StepRunner::StepRunner() : thread_([this] { loop(); }) {}

StepRunner::~StepRunner() {
  if (running_) (void)finish();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StepRunner::start(Job job, void* user) {
  ZINF_ASSERT(!running_ && job != nullptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = job;
    user_ = user;
    done_ = false;
  }
  running_ = true;
  cv_.notify_all();
}

Status StepRunner::finish() {
  ZINF_ASSERT(running_);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  running_ = false;
  return status_;
}

void StepRunner::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || job_ != nullptr; });
    if (job_ == nullptr) return;  // stop_, and no job waiting
    Job job = job_;
    void* user = user_;
    job_ = nullptr;
    lock.unlock();
    Status st = job(user);
    lock.lock();
    status_ = std::move(st);
    done_ = true;
    cv_.notify_all();
  }
}

}  // namespace zinf
