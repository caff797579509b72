// ParamCoordinator::wait_writes() after a failed shard write: it returns the first error only once
// every write queued on the coordinator's stream has run, so the caller may free the memory those
// writes read from; drain_writes() says the wait itself completed. And publish(groups): the
// persistent groups it lists all-gathered, no other. And first_in_use(), which keeps a count of
// the modules in use: the same answer as a walk over the modules after every call of a seeded
// sequence of gathers, releases, refused calls, prefetches, drops and a failed gather.
#include "zero/param_coordinator.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "common/run_ranks.hpp"
#include "common/scratch_dir.hpp"
#include "io/fault.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "zero/param_coordinator_test_util.hpp"
#include "zero/partitioner.hpp"
#include "zero/zero_counters.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"

namespace zinf {
namespace {

// Two ranks at stage 3, three modules of one group each: groups 0 and 2 stay gathered (their
// shards are copied up on the coordinator's stream), group 1's shard lives on NVMe, where rank 0's
// write fails with EIO. Rank 0 writes group 0's shard, queues its all-gather, which waits on the
// stream for rank 1, then writes group 2's shard (a copy queued behind the all-gather) and group
// 1's, which fails. Rank 1 joins the all-gather only after rank 0's wait_writes() has returned
// and rank 0 has read the slice group 2's copy writes, or after the wait has gone 2 s without
// returning, so the copy is still queued when the wait starts, whatever the load. wait_writes()
// on rank 0 must return the write's EIO, and only after group 2's copy ran: its slice of the
// gathered buffer then holds the values written (HostDevice memory reads as the host's; unwritten
// memory is 0xff bytes). A wait_writes() that returned at once would find the copy still queued
// behind the all-gather, which cannot run before rank 1 joins; one that drains blocks until rank
// 1 gives up waiting for the return and joins. drain_writes()
// then returns ok, the wait's own status, not the sticky EIO: the caller may free the memory. No
// write comes after the failed one: a coordinator that failed refuses every later write.
TEST(ParamCoordinatorWaitWrites, AFailedWriteIsReturnedOnceTheQueuedWritesHaveRun) {
  constexpr int kWorld = 2;
  constexpr std::uint64_t kSeed = 4711;
  SCOPED_TRACE(testing::Message() << "seed " << kSeed);
  test::ScratchDir dir("param_coordinator_wait_writes");

  Result<Partitioner> created = test::one_group_modules(kWorld, 3, {16, 32});
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  Partitioner& part = *created;
  const std::vector<bool> persistent = {true, false, true};

  test::HostRanks ranks = test::make_host_ranks(kWorld, {.timeout = std::chrono::seconds(20)});

  // Each rank's NVMe shard in a swap space of its own; rank 0's writes fail once enabled.
  FaultSpec spec;
  spec.seed = kSeed;
  spec.eio_rate = 1.0;
  spec.reads = false;
  auto failing = std::make_shared<FaultInjector>(spec);
  failing->set_enabled(false);
  std::vector<std::unique_ptr<IoEngine>> engines;
  std::vector<std::unique_ptr<SwapSpace>> swaps;
  std::vector<std::unique_ptr<ParamCoordinator>> coords;
  for (int r = 0; r < kWorld; ++r) {
    IoOptions io;
    io.block_bytes = 64 << 10;
    io.queue_depth = 8;
    if (r == 0) io.faults = failing;
    Result<std::unique_ptr<IoEngine>> engine = open_engine(io);
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    SwapOptions so;
    so.dirs = {dir.path()};
    so.file_name = fmt::format("rank{}-{{pid}}.bin", r);
    so.block_bytes = 64 << 10;
    so.capacity_bytes = 1 << 20;
    so.max_ops = 16;
    Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(**engine, so);
    ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
    ParamCoordinatorOptions co;
    co.shard_tier = OffloadDevice::kNvme;
    co.staging_blocks = 2;
    co.timeout = std::chrono::seconds(20);
    Result<std::unique_ptr<ParamCoordinator>> coord = ParamCoordinator::create(
        part, r, *ranks.devices[static_cast<std::size_t>(r)],
        *ranks.comms[static_cast<std::size_t>(r)], test::one_group_coordinator_modules(3),
        persistent, co, swap->get(), engine->get(), nullptr);
    ASSERT_TRUE(coord.is_ok()) << coord.status().to_string();
    engines.push_back(std::move(*engine));
    swaps.push_back(std::move(*swap));
    coords.push_back(std::move(*coord));
  }

  // Seeded shards, one per rank and group.
  const std::size_t shard_elements = part.group(0).shard_element_count;
  std::vector<std::vector<float>> shards;
  for (std::size_t k = 0; k < 3 * kWorld; ++k) {
    shards.emplace_back(shard_elements);
    fill_uniform(shards.back().data(), shard_elements, kSeed * 31 + k);
  }
  auto shard = [&](int rank, std::uint32_t g) {
    return shards[3 * static_cast<std::size_t>(rank) + g].data();
  };

  // `waiting` is set just before rank 0 waits, `returned` once its wait returned and the slice
  // was read; both on any way out before that, so rank 1 never waits forever.
  std::mutex mutex;
  std::condition_variable changed;
  bool waiting = false;
  bool returned = false;
  auto set_flag = [&](bool* flag) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      *flag = true;
    }
    changed.notify_all();
  };
  std::thread late([&] {
    {
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait(lock, [&] { return waiting; });
      // A wait_writes() that drains does not return before this rank joins: 2 s without a
      // return is that one, and the join then lets it return.
      changed.wait_for(lock, std::chrono::seconds(2), [&] { return returned; });
    }
    ParamCoordinator& c = *coords[1];
    EXPECT_TRUE(c.write_shard(0, shard(1, 0)).is_ok());
    EXPECT_TRUE(c.publish_group(0).is_ok());
    EXPECT_TRUE(c.publish_wait().is_ok());
  });
  // Joined on every way out, before the coordinators go.
  struct Join {
    std::thread& thread;
    decltype(set_flag)& set;
    bool* waiting;
    bool* returned;
    ~Join() {
      set(waiting);
      set(returned);
      if (thread.joinable()) thread.join();
    }
  } join{late, set_flag, &waiting, &returned};
  ParamCoordinator& c = *coords[0];
  ASSERT_TRUE(c.write_shard(0, shard(0, 0)).is_ok());
  ASSERT_TRUE(c.publish_group(0).is_ok());
  ASSERT_TRUE(c.write_shard(2, shard(0, 2)).is_ok());
  failing->set_enabled(true);
  const Status failed = c.write_shard(1, shard(0, 1));
  EXPECT_EQ(failed.code(), Code::kIoError) << failed.to_string();
  set_flag(&waiting);
  const Status waited = c.wait_writes();
  // What the copy of group 2's shard left in rank 0's slice, read before rank 1 may join when
  // wait_writes() returned early.
  std::vector<float> slice(shard_elements);
  std::memcpy(slice.data(), static_cast<const float*>(c.group_data(2)) + part.shard_offset(2, 0),
              shard_elements * sizeof(float));
  set_flag(&returned);
  late.join();
  EXPECT_EQ(waited.code(), Code::kIoError) << waited.to_string();
  EXPECT_EQ(waited.sys_code(), EIO) << waited.to_string();
  EXPECT_EQ(std::memcmp(slice.data(), shard(0, 2), shard_elements * sizeof(float)), 0)
      << "wait_writes() returned while group 2's copy was still queued";
  // And the all-gather it waited behind is whole: both ranks' shards of group 0.
  const auto* full = static_cast<const float*>(c.group_data(0));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(
        std::memcmp(full + part.shard_offset(0, r), shard(r, 0), shard_elements * sizeof(float)), 0)
        << "rank " << r << "'s shard of group 0";
  }
  // The wait itself completed: nothing queued can still read the shards.
  const Status drained = c.drain_writes();
  EXPECT_TRUE(drained.is_ok()) << drained.to_string();
  // Sticky: every later call returns the same error.
  EXPECT_EQ(c.wait_writes().code(), Code::kIoError);
  EXPECT_EQ(c.write_shard(2, shard(0, 2)).code(), Code::kIoError);
}

// Two ranks at stage 3, four modules of one group each, groups 0, 2 and 3 kept gathered, shards
// in host memory. Every rank writes seeded shards of every group, then publish({0, 1, 3}): groups
// 0 and 3 hold both ranks' shards, group 2 (persistent, not listed) holds only the rank's own,
// group 1 (listed, partitioned) is not gathered, and the counters show two all-gathers.
TEST(ParamCoordinatorPublish, AllGathersTheListedPersistentGroupsAlone) {
  constexpr int kWorld = 2;
  constexpr std::uint32_t kGroups = 4;
  constexpr std::uint64_t kSeed = 815;
  SCOPED_TRACE(testing::Message() << "seed " << kSeed);
  Result<Partitioner> created = test::one_group_modules(kWorld, kGroups, {8, 32});
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  Partitioner& part = *created;
  const std::vector<bool> persistent = {true, false, true, true};

  test::HostRanks ranks = test::make_host_ranks(kWorld, {.timeout = std::chrono::seconds(20)});
  std::vector<ZeroCounters> counters(kWorld);
  std::vector<std::unique_ptr<ParamCoordinator>> coords;
  for (int r = 0; r < kWorld; ++r) {
    const auto ri = static_cast<std::size_t>(r);
    ParamCoordinatorOptions co;
    co.shard_tier = OffloadDevice::kHost;
    co.timeout = std::chrono::seconds(20);
    Result<std::unique_ptr<ParamCoordinator>> coord = ParamCoordinator::create(
        part, r, *ranks.devices[ri], *ranks.comms[ri], test::one_group_coordinator_modules(kGroups),
        persistent, co, nullptr, nullptr, &counters[ri]);
    ASSERT_TRUE(coord.is_ok()) << coord.status().to_string();
    coords.push_back(std::move(*coord));
  }
  const std::size_t shard_elements = part.group(0).shard_element_count;
  std::vector<std::vector<float>> shards;
  for (std::size_t k = 0; k < kGroups * kWorld; ++k) {
    shards.emplace_back(shard_elements);
    fill_uniform(shards.back().data(), shard_elements, kSeed * 31 + k);
  }
  auto shard = [&](int rank, std::uint32_t g) {
    return shards[kGroups * static_cast<std::size_t>(rank) + g].data();
  };

  const std::vector<std::uint32_t> listed = {0, 1, 3};
  const std::vector<Status> st = test::run_ranks(kWorld, [&](int rank) -> Status {
    ParamCoordinator& c = *coords[static_cast<std::size_t>(rank)];
    for (std::uint32_t g = 0; g < kGroups; ++g)
      ZINF_RETURN_IF_ERROR(c.write_shard(g, shard(rank, g)));
    ZINF_RETURN_IF_ERROR(c.wait_writes());
    counters[static_cast<std::size_t>(rank)] = ZeroCounters{};
    return c.publish(std::span<const std::uint32_t>(listed));
  });
  for (int r = 0; r < kWorld; ++r) {
    const auto ri = static_cast<std::size_t>(r);
    ASSERT_TRUE(st[ri].is_ok()) << "rank " << r << ": " << st[ri].to_string();
    EXPECT_EQ(counters[ri].all_gather_bytes, 2 * part.group(0).padded_element_count * sizeof(float))
        << "rank " << r;
    const ParamCoordinator& c = *coords[ri];
    for (std::uint32_t g : {0u, 2u, 3u}) {
      const auto* full = static_cast<const float*>(c.group_data(g));
      ASSERT_NE(full, nullptr) << "group " << g;
      for (int q = 0; q < kWorld; ++q) {
        const bool has = std::memcmp(full + part.shard_offset(g, q), shard(q, g),
                                     shard_elements * sizeof(float)) == 0;
        // Its own shard is written in place; another rank's only by the all-gather.
        EXPECT_EQ(has, q == r || g != 2)
            << "rank " << r << ", group " << g << ", rank " << q << "'s shard";
      }
    }
  }
}

// One rank at stage 3, shards in host memory: nine modules, eight of one partitioned group each
// (256 elements) and one of a persistent group alone (nothing to gather), prefetching within 512
// elements and keeping at most 1024 live. A seeded sequence records two passes in module order,
// freezes the order (prefetches from then on, and drops when a module does not fit), then makes
// 600 calls: gathers and releases of random modules, some refused (a module gathered twice, one
// released that is not gathered), and now and then drop_prefetched(). After every call the
// modules the test holds gathered are the ones gathered() reports, and first_in_use() is the
// first of them, or -1. Last, a gather whose issue fails (the issue hook returns an error) leaves
// the module idle and the coordinator failed: first_in_use() still names the modules held.
TEST(ParamCoordinatorInUse, FirstInUseMatchesAWalkOverTheModules) {
  constexpr std::uint32_t kGroups = 9;
  constexpr std::uint32_t kPersistent = 5;  // module 5's only group
  constexpr std::uint64_t kSeed = 20261206;
  SCOPED_TRACE(testing::Message() << "seed " << kSeed);
  Result<Partitioner> created = test::one_group_modules(1, kGroups, {8, 32});
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  Partitioner& part = *created;
  std::vector<bool> persistent(kGroups, false);
  persistent[kPersistent] = true;

  test::HostRanks ranks = test::make_host_ranks(1, {.timeout = std::chrono::seconds(20)});
  ZeroCounters counters;
  ParamCoordinatorOptions co;
  co.shard_tier = OffloadDevice::kHost;
  co.prefetch_elements = 512;
  co.max_live_elements = 1024;
  co.timeout = std::chrono::seconds(20);
  Result<std::unique_ptr<ParamCoordinator>> coord = ParamCoordinator::create(
      part, 0, *ranks.devices[0], *ranks.comms[0], test::one_group_coordinator_modules(kGroups),
      persistent, co, nullptr, nullptr, &counters);
  ASSERT_TRUE(coord.is_ok()) << coord.status().to_string();
  ParamCoordinator& c = **coord;
  const std::size_t shard_elements = part.group(0).shard_element_count;
  // A buffer per group: a write copies from it on a stream until wait_writes().
  std::vector<std::vector<float>> shards(kGroups, std::vector<float>(shard_elements));
  for (std::uint32_t g = 0; g < kGroups; ++g) {
    fill_uniform(shards[g].data(), shard_elements, kSeed + g);
    ASSERT_TRUE(c.write_shard(g, shards[g].data()).is_ok());
  }
  ASSERT_TRUE(c.wait_writes().is_ok());

  // The modules this test gathered and has not released.
  std::vector<bool> held(kGroups, false);
  std::size_t calls = 0;
  auto check = [&](const char* what, std::size_t m) {
    ++calls;
    long first = -1;
    for (std::size_t k = 0; k < kGroups; ++k) {
      ASSERT_EQ(c.gathered(k), held[k])
          << "module " << k << " after call " << calls << " (" << what << " " << m << ")";
      if (held[k] && first < 0) first = static_cast<long>(k);
    }
    ASSERT_EQ(c.first_in_use(), first) << "after call " << calls << " (" << what << " " << m << ")";
  };
  auto gather = [&](std::size_t m) {
    const Status st = c.gather(m);
    if (held[m]) {
      ASSERT_EQ(st.code(), Code::kFailedPrecondition) << st.to_string();
    } else {
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      held[m] = true;
    }
    check("gather", m);
  };
  auto release = [&](std::size_t m) {
    const Status st = c.release(m);
    if (held[m]) {
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      held[m] = false;
    } else {
      ASSERT_EQ(st.code(), Code::kFailedPrecondition) << st.to_string();
    }
    check("release", m);
  };
  check("create", 0);
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t m = 0; m < kGroups; ++m) {
      ASSERT_NO_FATAL_FAILURE(gather(m));
      ASSERT_NO_FATAL_FAILURE(release(m));
    }
  }
  c.freeze_order();
  check("freeze_order", 0);
  std::mt19937_64 rng(kSeed);
  std::uniform_int_distribution<std::size_t> pick(0, kGroups - 1);
  std::uniform_int_distribution<int> roll(0, 99);
  for (int k = 0; k < 600; ++k) {
    const std::size_t m = pick(rng);
    const int r = roll(rng);
    if (r < 5) {
      ASSERT_TRUE(c.drop_prefetched().is_ok());
      check("drop_prefetched", 0);
    } else if (r < 15) {
      // Refused: a module gathered twice or released while not gathered.
      ASSERT_NO_FATAL_FAILURE(held[m] ? gather(m) : release(m));
    } else {
      // Mostly gathers while few are held, so that several modules are in use at times.
      const std::size_t count =
          static_cast<std::size_t>(std::count(held.begin(), held.end(), true));
      const bool want_gather = roll(rng) >= static_cast<int>(count * 20);
      if (want_gather && !held[m]) {
        ASSERT_NO_FATAL_FAILURE(gather(m));
      } else if (held[m]) {
        ASSERT_NO_FATAL_FAILURE(release(m));
      }
    }
  }
  EXPECT_GT(counters.prefetch_hits, 0u);
  EXPECT_GT(counters.prefetches_dropped, 0u);

  // A failed gather: two modules held, then a third whose issue fails.
  for (std::size_t m = 0; m < kGroups; ++m) {
    if (held[m]) {
      ASSERT_NO_FATAL_FAILURE(release(m));
    }
  }
  ASSERT_TRUE(c.drop_prefetched().is_ok());
  ASSERT_NO_FATAL_FAILURE(gather(6));
  ASSERT_NO_FATAL_FAILURE(gather(2));
  ASSERT_TRUE(c.drop_prefetched().is_ok());
  c.set_issue_hook(
      [](void*, std::size_t module) {
        return Status::io_error(fmt::format("issue of module {} refused", module));
      },
      nullptr, nullptr);
  const Status failed = c.gather(4);
  EXPECT_EQ(failed.code(), Code::kIoError) << failed.to_string();
  check("failed gather", 4);
  EXPECT_EQ(c.first_in_use(), 2);
  // Sticky: nothing changes state after it.
  EXPECT_EQ(c.release(2).code(), Code::kIoError);
  check("release after the failure", 2);
}

}  // namespace
}  // namespace zinf
