// RankExchange on a communicator that fails: exchange() and agree() return the error, and only
// once the stream has passed the copies they queued. Before, an aborted communicator failed the
// all-gather at once and the call returned while the copy of the words into its send buffer
// was still queued: the buffer was freed and the stream then wrote into freed memory (the heap
// corruption the soak hit when a rank restarted on a communicator a failed read had aborted).
#include "engine/rank_exchange.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

TEST(RankExchange, AFailedExchangeReturnsOnlyAfterTheStreamPassedItsCopies) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Device& device = *ranks.devices[0];
  Communicator& comm = *ranks.comms[0];
  Result<std::unique_ptr<Stream>> stream = device.create_stream("exchange test");
  ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
  Result<std::unique_ptr<Event>> event = device.create_event();
  ASSERT_TRUE(event.is_ok()) << event.status().to_string();
  StickyError sticky;
  Result<RankExchange> exchange =
      RankExchange::create(device, comm, **stream, **event, std::chrono::seconds(10), sticky);
  ASSERT_TRUE(exchange.is_ok()) << exchange.status().to_string();
  comm.abort(Status::io_error("a rank's read failed"));

  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE(call == 0 ? "exchange" : "agree");
    // Hold the stream, so that what the call queues is still queued when the all-gather fails.
    std::atomic<bool> released{false};
    ASSERT_TRUE(device
                    .launch_host(**stream,
                                 [&released]() {
                                   while (!released.load()) {
                                     std::this_thread::sleep_for(std::chrono::milliseconds(1));
                                   }
                                   return Status::ok();
                                 })
                    .is_ok());
    std::thread release([&released]() {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      released.store(true);
    });
    const std::uint64_t words[2] = {0x0123456789abcdefULL, 0xfedcba9876543210ULL};
    Status st;
    if (call == 0) {
      st = exchange->exchange(words, 2).status();
    } else {
      st = exchange->agree("test", Status::ok());
    }
    const bool stream_was_held = !released.load();
    release.join();
    EXPECT_EQ(st.code(), Code::kAborted) << st.to_string();
    EXPECT_NE(st.message().find("a rank's read failed"), std::string::npos) << st.to_string();
    EXPECT_FALSE(stream_was_held) << "returned while the stream still held its queued copies";
  }
}

}  // namespace
}  // namespace zinf
