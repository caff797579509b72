// run_local (include/zinf/run_local.hpp): devices, then the communicator group, then one thread
// per rank that opens its engine, runs the caller's function and destroys the engine; then the
// communicators and the devices, in that order, once every thread has been joined.
#include "zinf/run_local.hpp"

#include <fmt/format.h>

#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

namespace zinf {
namespace {

// The first error of the job, in time, and the communicators to abort when it arrives.
class FirstError {
 public:
  explicit FirstError(const std::vector<std::unique_ptr<Communicator>>& comms) : comms_(comms) {}

  // Keeps `status` (an error of `rank`) if it is the first, and aborts every communicator, so
  // ranks waiting in a collective for this one stop now.
  void report(int rank, const Status& status) {
    {
      std::lock_guard lock(mutex_);
      if (first_.has_value()) return;
      first_ = status.with_context(fmt::format("rank {}", rank));
    }
    for (const std::unique_ptr<Communicator>& comm : comms_) {
      comm->abort(
          Status::aborted(fmt::format("run_local: rank {} failed: {}", rank, status.to_string())));
    }
  }

  Status take() {
    std::lock_guard lock(mutex_);
    return first_.has_value() ? *first_ : Status::ok();
  }

 private:
  const std::vector<std::unique_ptr<Communicator>>& comms_;
  std::mutex mutex_;
  std::optional<Status> first_;
};

// One rank's thread body: opens the engine, runs fn, and destroys the engine before returning.
void run_rank(int rank, const Config& config, const Env& env, const LocalRankFn& fn,
              FirstError& first_error) {
  try {
    Result<std::unique_ptr<Engine>> engine = Engine::open(config, env);
    if (!engine.is_ok()) {
      first_error.report(rank, engine.status());
      return;
    }
    Status status = fn(**engine, rank);
    // The communicators are aborted before this rank's engine goes, so no other rank is left
    // inside a collective with it.
    if (!status.is_ok()) first_error.report(rank, status);
  } catch (const std::exception& error) {
    first_error.report(rank, Status::internal(fmt::format("exception: {}", error.what())));
  } catch (...) {
    first_error.report(rank, Status::internal("an exception that is not a std::exception"));
  }
}

}  // namespace

Status run_local(int world_size, const Config& config, const LocalRankFn& fn,
                 const LocalRunOptions& options) {
  if (world_size < 1) {
    return Status::invalid_argument(
        fmt::format("run_local: world_size is {}; it must be at least 1", world_size));
  }
  if (!fn) return Status::invalid_argument("run_local: no function to run on the ranks");
  // Declared in the order of construction, so they are destroyed in the reverse one: the
  // communicators before the devices (the engines are gone with their threads).
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> device_ptrs;
  for (int rank = 0; rank < world_size; ++rank) {
    HostDeviceOptions device_options = options.device;
    device_options.ordinal = rank;
    Result<std::unique_ptr<Device>> device = make_host_device(device_options);
    if (!device.is_ok()) {
      return device.status().with_context(fmt::format("rank {}: run_local: device", rank));
    }
    devices.push_back(std::move(device).value());
    device_ptrs.push_back(devices.back().get());
  }
  // The option's timeout, where given, bounds the engines' waits too (zinf.collective_timeout_ms):
  // Engine::open warns when the two differ.
  Config job_config = config;
  if (options.collective_timeout.count() > 0) {
    job_config.collective_timeout_ms = options.collective_timeout.count();
  }
  LocalCommOptions comm_options;
  comm_options.timeout = std::chrono::milliseconds(job_config.collective_timeout_ms);
  Result<std::vector<std::unique_ptr<Communicator>>> comms =
      make_local_comm_group(device_ptrs, comm_options);
  if (!comms.is_ok()) return comms.status().with_context("run_local: communicator group");

  FirstError first_error(*comms);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world_size));
  for (int rank = 0; rank < world_size; ++rank) {
    Env env;
    env.device = devices[static_cast<std::size_t>(rank)].get();
    env.comm = (*comms)[static_cast<std::size_t>(rank)].get();
    env.nvme_paths = options.nvme_paths;
    env.trace = options.trace;
    try {
      threads.emplace_back([&, rank, env] { run_rank(rank, job_config, env, fn, first_error); });
    } catch (const std::system_error& error) {
      // The threads already started must not wait for this rank in a collective.
      first_error.report(rank, Status::resource_exhausted(fmt::format(
                                   "run_local: cannot start a thread: {}", error.what())));
      break;
    }
  }
  for (std::thread& thread : threads) thread.join();
  return first_error.take();
}

}  // namespace zinf
