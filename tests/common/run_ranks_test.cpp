// common/run_ranks.hpp, the rank runner of the comm, zero and engine tests: one thread a rank, the
// statuses in rank order, an exception kept as its rank's error, ranks_ok() naming each failed
// rank, and a rank still running at the deadline named before the process aborts.
#include "common/run_ranks.hpp"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/sanitizer.hpp"

namespace zinf {
namespace {

TEST(RunRanks, EachRankOnItsOwnThreadItsStatusInRankOrder) {
  constexpr int kWorld = 4;
  std::vector<std::thread::id> ids(kWorld);
  const std::vector<Status> st = test::run_ranks(kWorld, [&](int rank) -> Status {
    ids[static_cast<std::size_t>(rank)] = std::this_thread::get_id();
    if (rank % 2 == 0) return Status::ok();
    return Status::not_found("rank " + std::to_string(rank) + " found nothing");
  });
  ASSERT_EQ(st.size(), static_cast<std::size_t>(kWorld));
  for (int rank = 0; rank < kWorld; ++rank) {
    const Status& s = st[static_cast<std::size_t>(rank)];
    if (rank % 2 == 0) {
      EXPECT_TRUE(s.is_ok()) << rank << ": " << s.to_string();
    } else {
      EXPECT_EQ(s.code(), Code::kNotFound) << rank;
      EXPECT_EQ(s.message(), "rank " + std::to_string(rank) + " found nothing");
    }
  }
  const std::set<std::thread::id> distinct(ids.begin(), ids.end());
  EXPECT_EQ(distinct.size(), static_cast<std::size_t>(kWorld));
  EXPECT_EQ(distinct.count(std::this_thread::get_id()), 0u);
}

TEST(RunRanks, AnExceptionIsItsRanksError) {
  const std::vector<Status> st = test::run_ranks(3, [](int rank) -> Status {
    if (rank == 1) throw std::runtime_error("out of cheese");
    if (rank == 2) throw 7;
    return Status::ok();
  });
  ASSERT_EQ(st.size(), 3u);
  EXPECT_TRUE(st[0].is_ok()) << st[0].to_string();
  EXPECT_EQ(st[1].code(), Code::kInternal);
  EXPECT_EQ(st[1].message(), "rank 1 threw: out of cheese");
  EXPECT_EQ(st[2].code(), Code::kInternal);
  EXPECT_EQ(st[2].message(), "rank 2 threw a non-std exception");
}

TEST(RunRanks, RanksOkNamesEachFailedRank) {
  EXPECT_TRUE(test::ranks_ok({Status::ok(), Status::ok()}));
  const ::testing::AssertionResult r = test::ranks_ok(
      {Status::ok(), Status::aborted("peer gone"), Status::ok(), Status::internal("bad sum")});
  ASSERT_FALSE(r);
  const std::string message = r.message();
  EXPECT_NE(message.find("rank 1: " + Status::aborted("peer gone").to_string()), std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 3: " + Status::internal("bad sum").to_string()), std::string::npos)
      << message;
  EXPECT_EQ(message.find("rank 0"), std::string::npos) << message;
  EXPECT_EQ(message.find("rank 2"), std::string::npos) << message;
}

// A deadline of milliseconds::max() waits without a limit: adding it to now() would overflow
// and end the wait at once, aborting while both ranks still sleep.
TEST(RunRanks, TheLargestDeadlineWaitsForEveryRank) {
  const std::vector<Status> st = test::run_ranks(
      2,
      [](int rank) -> Status {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        return Status::not_found("rank " + std::to_string(rank) + " slept");
      },
      std::chrono::milliseconds::max());
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(st[0].message(), "rank 0 slept");
  EXPECT_EQ(st[1].message(), "rank 1 slept");
}

// Runs two ranks with no room left for a thread stack (RLIMIT_AS a little above the present
// size of the address space), prints each rank's Status, and exits 0 when both are
// resource_exhausted.
[[noreturn]] void run_ranks_without_room_for_a_thread() {
  long vm_pages = 0;
  if (std::FILE* statm = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(statm, "%ld", &vm_pages) != 1) vm_pages = 0;
    std::fclose(statm);
  }
  if (vm_pages <= 0) std::_Exit(2);
  // Room for small heap allocations, not for a thread stack (8 MiB by default).
  const rlim_t limit_bytes =
      static_cast<rlim_t>(vm_pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + (1u << 20);
  const rlimit rl{limit_bytes, limit_bytes};
  if (setrlimit(RLIMIT_AS, &rl) != 0) std::_Exit(3);
  const std::vector<Status> st = test::run_ranks(2, [](int) -> Status { return Status::ok(); });
  for (std::size_t r = 0; r < st.size(); ++r) {
    std::fprintf(stderr, "rank %zu: code %d: %s\n", r, static_cast<int>(st[r].code()),
                 std::string(st[r].message()).c_str());
  }
  std::_Exit(st.size() == 2 && st[0].code() == Code::kResourceExhausted &&
                     st[1].code() == Code::kResourceExhausted
                 ? 0
                 : 1);
}

// A rank whose thread cannot start, and each after it, fails with resource_exhausted instead of
// std::system_error leaving run_ranks. In a child whose address space has no room for another
// thread stack (RLIMIT_AS a little above its present size), no rank starts.
TEST(RunRanksDeathTest, ARankWithoutAThreadIsResourceExhausted) {
  if (test::kAddressSanitizer || test::kThreadSanitizer) {
    GTEST_SKIP() << "the sanitizer reserves address space beyond RLIMIT_AS";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_ranks_without_room_for_a_thread(), ::testing::ExitedWithCode(0),
              "rank 0: code [0-9]+: rank 0 not started: cannot start a thread: .*\n"
              "rank 1: code [0-9]+: rank 1 not started: cannot start a thread: ");
}

// Rank 1 sleeps past a deadline of 2 s: the process aborts (SIGABRT, not just any non-zero
// exit), naming it as still running and rank 0's error. The deadline leaves rank 0 time to
// return on busy cores; rank 1's sleep ends only with the child, killed by the abort.
TEST(RunRanksDeathTest, ARankPastTheDeadlineIsNamedAndTheProcessAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      test::run_ranks(
          2,
          [](int rank) -> Status {
            if (rank == 0) return Status::internal("rank 0 gave up");
            std::this_thread::sleep_for(std::chrono::seconds(60));
            return Status::ok();
          },
          std::chrono::seconds(2)),
      ::testing::KilledBySignal(SIGABRT),
      "1 of 2 ranks still running after 2000 ms:\n  rank 0: .*rank 0 gave up\n  rank 1: still "
      "running");
}

}  // namespace
}  // namespace zinf
