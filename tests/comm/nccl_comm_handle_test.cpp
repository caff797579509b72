// AbortableHandle (lib/comm/nccl_comm_handle.hpp), the rule that keeps NcclComm::abort() from
// freeing the ncclComm_t under an issue() or wait() in flight on another thread: the release must
// wait for the last borrow, run exactly once, and no borrow may succeed after the abort.
#include "comm/nccl_comm_handle.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

namespace zinf {
namespace {

// A stand-in for an ncclComm_t: the release marks it freed; using a freed one is the bug.
struct FakeComm {
  std::atomic<int> releases{0};
  std::atomic<bool> freed{false};
};

TEST(AbortableHandle, ReleaseWaitsForTheCallInFlight) {
  FakeComm comm;
  AbortableHandle<FakeComm*> handle(&comm, [](FakeComm* c) {
    c->freed = true;
    ++c->releases;
  });
  std::optional<AbortableHandle<FakeComm*>::Borrow> in_flight = handle.borrow();
  ASSERT_TRUE(in_flight.has_value());

  std::thread aborter([&] { EXPECT_TRUE(handle.abort()); });
  aborter.join();  // abort() returns without waiting for the borrow
  EXPECT_TRUE(handle.aborted());
  EXPECT_FALSE(comm.freed) << "released under a call in flight";
  EXPECT_FALSE(handle.borrow().has_value()) << "a new call got an aborted handle";
  EXPECT_FALSE(handle.abort()) << "a second abort is a no-op";

  in_flight.reset();  // the call returns: now the release runs, once
  EXPECT_TRUE(comm.freed);
  EXPECT_EQ(comm.releases, 1);
}

TEST(AbortableHandle, AbortWithNothingBorrowedReleasesAtOnce) {
  FakeComm comm;
  AbortableHandle<FakeComm*> handle(&comm, [](FakeComm* c) { ++c->releases; });
  EXPECT_TRUE(handle.abort());
  EXPECT_EQ(comm.releases, 1);
  EXPECT_FALSE(handle.take().has_value());
}

TEST(AbortableHandle, AbortFromInsideABorrowDefersToItsEnd) {
  FakeComm comm;
  AbortableHandle<FakeComm*> handle(&comm, [](FakeComm* c) { ++c->releases; });
  {
    std::optional<AbortableHandle<FakeComm*>::Borrow> b = handle.borrow();
    ASSERT_TRUE(b.has_value());
    EXPECT_TRUE(handle.abort());  // as NcclComm::settle() does on an NCCL error
    EXPECT_EQ(comm.releases, 0);
  }
  EXPECT_EQ(comm.releases, 1);
}

TEST(AbortableHandle, TakeHandsOverTheLiveHandleWithoutRelease) {
  FakeComm comm;
  AbortableHandle<FakeComm*> handle(&comm, [](FakeComm* c) { ++c->releases; });
  EXPECT_EQ(handle.take(), std::optional<FakeComm*>(&comm));
  EXPECT_FALSE(handle.borrow().has_value());
  EXPECT_FALSE(handle.abort());
  EXPECT_EQ(comm.releases, 0);
}

// Many threads issue and poll while one aborts at a random moment: no call may ever see a freed
// handle, and the release runs exactly once. Seeded; the seed is printed.
TEST(AbortableHandle, NoCallSeesAFreedHandleUnderConcurrentAbort) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    FakeComm comm;
    AbortableHandle<FakeComm*> handle(&comm, [](FakeComm* c) {
      c->freed = true;
      ++c->releases;
    });
    std::atomic<int> used_after_free{0};
    std::atomic<bool> stop{false};
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; ++t) {
      callers.emplace_back([&] {
        while (!stop) {
          std::optional<AbortableHandle<FakeComm*>::Borrow> b = handle.borrow();
          if (!b.has_value()) return;
          for (int i = 0; i < 50; ++i) {
            if (b->get()->freed) ++used_after_free;
          }
        }
      });
    }
    std::mt19937_64 rng(seed);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    handle.abort();
    stop = true;
    for (std::thread& t : callers) t.join();
    EXPECT_EQ(used_after_free, 0);
    EXPECT_EQ(comm.releases, 1);
    EXPECT_EQ(handle.borrow_count(), 0u);
  }
}

}  // namespace
}  // namespace zinf
