// N ranks of one process as N threads: a HostDevice and a LocalComm a rank (make_host_ranks()),
// and body(rank) on a thread a rank (run_ranks()), each rank's Status kept apart.
//
// The threads are joined against a deadline. A rank blocked in a collective comes back by itself
// (HostRanksOptions::timeout); one blocked anywhere else would hold the test until ctest kills
// the process, or for ever where a binary runs outside ctest (the sanitizer stages of
// scripts/test). At the deadline run_ranks() prints which ranks are still running and what the
// others returned, then aborts: it cannot return while those threads use the caller's objects,
// and a killed process would name no rank.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "base/wait.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/status.hpp"

namespace zinf::test {

// One HostDevice a rank and a LocalComm group over them.
struct HostRanks {
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<std::unique_ptr<Communicator>> comms;
};

struct HostRanksOptions {
  // LocalCommOptions::timeout: how long a collective waits for the other ranks.
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
  // HostDeviceOptions::jitter_max_us, seeded by jitter_seed + rank: stream work delayed at
  // random, so that a missing wait shows up.
  std::uint32_t jitter_max_us = 0;
  std::uint64_t jitter_seed = 0;
  // HostDeviceOptions::opaque: device memory the host must not read, as a GPU's.
  bool opaque = false;
};

inline HostRanks make_host_ranks(int world, const HostRanksOptions& options = {}) {
  HostRanks ranks;
  std::vector<Device*> raw;
  for (int rank = 0; rank < world; ++rank) {
    HostDeviceOptions o;
    o.ordinal = rank;
    o.jitter_max_us = options.jitter_max_us;
    o.jitter_seed = options.jitter_seed + static_cast<std::uint64_t>(rank);
    o.opaque = options.opaque;
    ranks.devices.push_back(std::move(make_host_device(o)).value());
    raw.push_back(ranks.devices.back().get());
  }
  LocalCommOptions co;
  co.timeout = options.timeout;
  ranks.comms = std::move(make_local_comm_group(raw, co)).value();
  return ranks;
}

// Below ctest's 600 s a test, so that under ctest too a hung rank is named before the process
// is killed; far above the longest run_ranks() of the suite (the whole engine binary takes about
// 300 s under ThreadSanitizer on CI, docs/RELIABILITY.md).
inline constexpr std::chrono::seconds kRankDeadline{480};

// Runs body(rank) for rank 0 .. world - 1, each on its own thread, and returns the statuses in
// rank order once every rank has returned. An exception that leaves body becomes that rank's
// Status (internal, with what() when it is a std::exception); a rank whose thread cannot be
// started, and each after it, gets resource_exhausted. Aborts the process, printing each rank's
// state, when some rank has not returned within `deadline` (a day or more: no deadline).
inline std::vector<Status> run_ranks(int world, const std::function<Status(int rank)>& body,
                                     std::chrono::milliseconds deadline = kRankDeadline) {
  const auto ranks = static_cast<std::size_t>(world);
  std::mutex mu;
  std::condition_variable returned;
  std::vector<Status> statuses(ranks);  // guarded by mu until every thread is joined
  std::vector<bool> done(ranks, false);
  std::size_t running = ranks;
  std::vector<std::thread> threads;
  threads.reserve(ranks);
  for (int rank = 0; rank < world; ++rank) {
    try {
      threads.emplace_back([&, rank] {
        Status status;
        try {
          status = body(rank);
        } catch (const std::exception& e) {
          status = Status::internal("rank " + std::to_string(rank) + " threw: " + e.what());
        } catch (...) {
          status = Status::internal("rank " + std::to_string(rank) + " threw a non-std exception");
        }
        const std::lock_guard<std::mutex> lock(mu);
        statuses[static_cast<std::size_t>(rank)] = std::move(status);
        done[static_cast<std::size_t>(rank)] = true;
        --running;
        returned.notify_all();
      });
    } catch (const std::system_error& e) {
      // The ranks not started fail here; those started still run to the end (one waiting in a
      // collective for a missing rank comes back at HostRanksOptions::timeout) and are joined.
      const std::lock_guard<std::mutex> lock(mu);
      for (std::size_t r = static_cast<std::size_t>(rank); r < ranks; ++r) {
        statuses[r] = Status::resource_exhausted(
            "rank " + std::to_string(r) + " not started: cannot start a thread: " + e.what());
        done[r] = true;
        --running;
      }
      break;
    }
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    // wait_for_or_forever: a deadline of a day or more (milliseconds::max() among them) waits
    // without a limit, where wait_for would overflow now() + deadline.
    if (!wait_for_or_forever(returned, lock, deadline, [&] { return running == 0; })) {
      std::string report;
      for (std::size_t r = 0; r < ranks; ++r) {
        report += "  rank " + std::to_string(r) + ": " +
                  (done[r] ? statuses[r].to_string() : std::string("still running")) + "\n";
      }
      std::fprintf(stderr, "run_ranks: %zu of %zu ranks still running after %lld ms:\n%s", running,
                   ranks, static_cast<long long>(deadline.count()), report.c_str());
      std::fflush(stderr);
      std::abort();
    }
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

// Success when every rank's Status is ok; else a failure that names each failed rank and its
// Status, for ASSERT_TRUE / EXPECT_TRUE.
inline ::testing::AssertionResult ranks_ok(const std::vector<Status>& statuses) {
  std::string failed;
  for (std::size_t r = 0; r < statuses.size(); ++r) {
    if (statuses[r].is_ok()) continue;
    failed += "\n  rank " + std::to_string(r) + ": " + statuses[r].to_string();
  }
  if (failed.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "failed ranks:" << failed;
}

}  // namespace zinf::test
