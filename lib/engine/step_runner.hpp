// StepRunner: the thread the overlapped optimizer step runs on (zinf.overlap_step). The engine's
// step() decides the step (norm, overflow, clipping) on the caller's thread, then hands the
// optimizer pass and the shard writes to this thread and returns; the caller's next forward runs
// while the pass goes on, each gather() waiting only for its own module's new values
// (publisher.hpp counts the groups written). The engine calls finish() before anything that
// needs the whole step (the next reduce_gradients(), step(), checkpoints, read-back).
//
// One job at a time; the thread is made at open and lives as long as the runner, so a step
// allocates nothing here.
//
// Thread-safety: start() and finish() from one thread (the rank's); the job runs on the runner's.
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>

#include "zinf/status.hpp"

namespace zinf {

class StepRunner {
 public:
  using Job = Status (*)(void* user);

  StepRunner();
  // Waits for a job in flight, then ends the thread.
  ~StepRunner();
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  // Runs job(user) on the runner's thread. REQUIRES: !running().
  void start(Job job, void* user);
  // Between start() and finish().
  bool running() const { return running_; }
  // Waits for the job started last and returns its Status. REQUIRES: running().
  Status finish();

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  Job job_ = nullptr;  // the job to run, null when none is waiting
  void* user_ = nullptr;
  bool done_ = false;  // the job started last has returned
  bool stop_ = false;
  Status status_;
  bool running_ = false;  // the caller's view: started and not yet finished
  std::thread thread_;
};

}  // namespace zinf
