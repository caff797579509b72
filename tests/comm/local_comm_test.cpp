// LocalComm against a plain serial computation over ranks, for world sizes 1..5, every dtype and
// reduction, in and out of place; and its failure modes: ranks that disagree, a rank that never
// arrives, an abort, bad arguments, a failed stream, a wait past its timeout. Every failure must
// reach every rank quickly, never hang.
#include "comm/local_comm.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "comm_test_util.hpp"
#include "common/run_ranks.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// N HostDevices (with jitter, so that timing differs between ranks and runs) and their LocalComm
// group (test::make_host_ranks); run() drives each rank from its own thread, as a multi-GPU job
// drives one GPU per process, against test::run_ranks' deadline: a rank that hangs aborts the
// test naming the ranks still running, rather than holding it until ctest's timeout.
class World {
 public:
  explicit World(int world_size, milliseconds timeout = std::chrono::seconds(30),
                 std::uint64_t seed = 1, bool opaque = false) {
    test::HostRanksOptions options;
    options.timeout = timeout;
    options.jitter_max_us = 100;
    options.jitter_seed = seed * 131;  // rank r's device gets seed * 131 + r
    options.opaque = opaque;
    ranks_ = test::make_host_ranks(world_size, options);
  }

  int world_size() const { return static_cast<int>(ranks_.devices.size()); }
  Device& device(int rank) { return *ranks_.devices[static_cast<std::size_t>(rank)]; }
  Communicator& comm(int rank) { return *ranks_.comms[static_cast<std::size_t>(rank)]; }

  // Runs body(rank) on one thread per rank and returns each rank's Status, in rank order.
  std::vector<Status> run(const std::function<Status(int)>& body) {
    return test::run_ranks(world_size(), body);
  }

 private:
  test::HostRanks ranks_;
};

using comm_test::random_data;
using comm_test::serial_reduce;

// One rank's device-side scratch for a collective: copies in, runs `issue`, copies out, waits.
// The buffers come first so that they are destroyed last: destroying the stream first waits
// for work still queued on it (after an early error return) that may use them.
struct RankBuffers {
  Device& device;
  DeviceBuffer send;
  DeviceBuffer recv;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<Event> done;

  RankBuffers(Device& d, std::size_t send_bytes, std::size_t recv_bytes) : device(d) {
    stream = std::move(d.create_stream("comm")).value();
    done = std::move(d.create_event()).value();
    send = std::move(DeviceBuffer::allocate(d, send_bytes)).value();
    recv = std::move(DeviceBuffer::allocate(d, recv_bytes)).value();
  }
};

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMax, ReduceOp::kMin};

class LocalCommWorld : public ::testing::TestWithParam<int> {};

TEST_P(LocalCommWorld, AllReduceMatchesTheSerialReferenceBitForBit) {
  const int world_size = GetParam();
  World world(world_size, std::chrono::seconds(30), 10 + static_cast<std::uint64_t>(world_size));
  const std::size_t count = 1037;  // divisible by no world size here but 1
  std::uint64_t seed = 1000;
  for (DType dtype : kDTypes) {
    for (ReduceOp op : kOps) {
      for (bool in_place : {false, true}) {
        std::vector<std::vector<std::byte>> inputs;
        for (int r = 0; r < world_size; ++r) inputs.push_back(random_data(count, dtype, ++seed));
        const std::vector<std::byte> expected = serial_reduce(inputs, 0, count, dtype, op);
        const std::size_t bytes = count * dtype_bytes(dtype);
        std::vector<std::vector<std::byte>> outputs(static_cast<std::size_t>(world_size),
                                                    std::vector<std::byte>(bytes));
        std::vector<Status> statuses = world.run([&](int rank) -> Status {
          Device& device = world.device(rank);
          RankBuffers b(device, bytes, bytes);
          void* recv = in_place ? b.send.data() : b.recv.data();
          ZINF_RETURN_IF_ERROR(device.copy_h2d(
              b.send.data(), inputs[static_cast<std::size_t>(rank)].data(), bytes, *b.stream));
          ZINF_RETURN_IF_ERROR(world.comm(rank).all_reduce(b.send.data(), recv, count, dtype, op,
                                                           *b.stream, "grads"));
          ZINF_RETURN_IF_ERROR(device.copy_d2h(outputs[static_cast<std::size_t>(rank)].data(), recv,
                                               bytes, *b.stream));
          ZINF_RETURN_IF_ERROR(device.record(*b.done, *b.stream));
          return world.comm(rank).wait(*b.done, std::chrono::seconds(30));
        });
        for (int r = 0; r < world_size; ++r) {
          ASSERT_TRUE(statuses[static_cast<std::size_t>(r)].is_ok())
              << statuses[static_cast<std::size_t>(r)].to_string();
          ASSERT_EQ(outputs[static_cast<std::size_t>(r)], expected)
              << "rank " << r << " dtype " << dtype_name(dtype) << " op " << reduce_op_name(op)
              << " in_place " << in_place;
        }
      }
    }
  }
}

TEST_P(LocalCommWorld, ReduceScatterGivesEachRankItsReducedChunk) {
  const int world_size = GetParam();
  World world(world_size, std::chrono::seconds(30), 20 + static_cast<std::uint64_t>(world_size));
  const std::size_t chunk = 517;
  std::uint64_t seed = 2000;
  for (DType dtype : kDTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMax}) {
      for (bool in_place : {false, true}) {
        const std::size_t total = chunk * static_cast<std::size_t>(world_size);
        const std::size_t element_bytes = dtype_bytes(dtype);
        std::vector<std::vector<std::byte>> inputs;
        for (int r = 0; r < world_size; ++r) inputs.push_back(random_data(total, dtype, ++seed));
        std::vector<std::vector<std::byte>> outputs(static_cast<std::size_t>(world_size),
                                                    std::vector<std::byte>(chunk * element_bytes));
        std::vector<Status> statuses = world.run([&](int rank) -> Status {
          Device& device = world.device(rank);
          RankBuffers b(device, total * element_bytes, chunk * element_bytes);
          void* recv = in_place ? b.send.as<std::byte>() +
                                      static_cast<std::size_t>(rank) * chunk * element_bytes
                                : b.recv.data();
          ZINF_RETURN_IF_ERROR(device.copy_h2d(b.send.data(),
                                               inputs[static_cast<std::size_t>(rank)].data(),
                                               total * element_bytes, *b.stream));
          ZINF_RETURN_IF_ERROR(world.comm(rank).reduce_scatter(b.send.data(), recv, chunk, dtype,
                                                               op, *b.stream, "bucket"));
          ZINF_RETURN_IF_ERROR(device.copy_d2h(outputs[static_cast<std::size_t>(rank)].data(), recv,
                                               chunk * element_bytes, *b.stream));
          ZINF_RETURN_IF_ERROR(device.record(*b.done, *b.stream));
          return world.comm(rank).wait(*b.done);
        });
        for (int r = 0; r < world_size; ++r) {
          ASSERT_TRUE(statuses[static_cast<std::size_t>(r)].is_ok())
              << statuses[static_cast<std::size_t>(r)].to_string();
          const std::vector<std::byte> expected =
              serial_reduce(inputs, static_cast<std::size_t>(r) * chunk, chunk, dtype, op);
          ASSERT_EQ(outputs[static_cast<std::size_t>(r)], expected)
              << "rank " << r << " dtype " << dtype_name(dtype) << " op " << reduce_op_name(op)
              << " in_place " << in_place;
        }
      }
    }
  }
}

TEST_P(LocalCommWorld, AllGatherAndBroadcastCopyEveryRanksData) {
  const int world_size = GetParam();
  World world(world_size, std::chrono::seconds(30), 30 + static_cast<std::uint64_t>(world_size));
  const std::size_t chunk = 333;
  std::uint64_t seed = 3000;
  for (DType dtype : kDTypes) {
    for (bool in_place : {false, true}) {
      const std::size_t element_bytes = dtype_bytes(dtype);
      const std::size_t chunk_bytes = chunk * element_bytes;
      const std::size_t total_bytes = chunk_bytes * static_cast<std::size_t>(world_size);
      std::vector<std::vector<std::byte>> inputs;
      for (int r = 0; r < world_size; ++r) inputs.push_back(random_data(chunk, dtype, ++seed));
      const int root = world_size - 1;
      std::vector<std::vector<std::byte>> gathered(static_cast<std::size_t>(world_size),
                                                   std::vector<std::byte>(total_bytes));
      std::vector<std::vector<std::byte>> broadcast(static_cast<std::size_t>(world_size),
                                                    std::vector<std::byte>(chunk_bytes));
      std::vector<Status> statuses = world.run([&](int rank) -> Status {
        Device& device = world.device(rank);
        Communicator& comm = world.comm(rank);
        const auto urank = static_cast<std::size_t>(rank);
        RankBuffers b(device, chunk_bytes, total_bytes);
        const void* send = b.send.data();
        if (in_place) send = b.recv.as<std::byte>() + urank * chunk_bytes;
        ZINF_RETURN_IF_ERROR(
            device.copy_h2d(const_cast<void*>(send), inputs[urank].data(), chunk_bytes, *b.stream));
        ZINF_RETURN_IF_ERROR(comm.all_gather(send, b.recv.data(), chunk, dtype, *b.stream));
        ZINF_RETURN_IF_ERROR(
            device.copy_d2h(gathered[urank].data(), b.recv.data(), total_bytes, *b.stream));
        // Broadcast the root's chunk, in place into `send` when asked.
        ZINF_RETURN_IF_ERROR(
            device.copy_h2d(b.send.data(), inputs[urank].data(), chunk_bytes, *b.stream));
        void* recv = in_place ? b.send.data() : b.recv.data();
        ZINF_RETURN_IF_ERROR(
            comm.broadcast(b.send.data(), recv, chunk, dtype, root, *b.stream, "weights"));
        ZINF_RETURN_IF_ERROR(
            device.copy_d2h(broadcast[urank].data(), recv, chunk_bytes, *b.stream));
        ZINF_RETURN_IF_ERROR(device.record(*b.done, *b.stream));
        return comm.wait(*b.done);
      });
      std::vector<std::byte> expected;
      for (const auto& input : inputs) expected.insert(expected.end(), input.begin(), input.end());
      for (int r = 0; r < world_size; ++r) {
        ASSERT_TRUE(statuses[static_cast<std::size_t>(r)].is_ok())
            << statuses[static_cast<std::size_t>(r)].to_string();
        EXPECT_EQ(gathered[static_cast<std::size_t>(r)], expected) << "rank " << r;
        EXPECT_EQ(broadcast[static_cast<std::size_t>(r)], inputs[static_cast<std::size_t>(root)])
            << "rank " << r;
      }
    }
  }
}

// Twenty collectives issued back to back, alternating between two streams per rank, complete in
// any interleaving the jitter produces and each still matches its own reference.
TEST_P(LocalCommWorld, ManyCollectivesOnTwoStreamsStayMatched) {
  const int world_size = GetParam();
  World world(world_size, std::chrono::seconds(30), 40 + static_cast<std::uint64_t>(world_size));
  constexpr int kCalls = 20;
  const std::size_t count = 257;
  std::vector<std::vector<std::vector<std::byte>>> inputs(kCalls);
  for (int c = 0; c < kCalls; ++c) {
    for (int r = 0; r < world_size; ++r) {
      inputs[static_cast<std::size_t>(c)].push_back(
          random_data(count, DType::kF32, 5000 + static_cast<std::uint64_t>(c * 16 + r)));
    }
  }
  std::vector<std::vector<std::vector<std::byte>>> outputs(
      kCalls, std::vector<std::vector<std::byte>>(static_cast<std::size_t>(world_size),
                                                  std::vector<std::byte>(count * 4)));
  std::vector<Status> statuses = world.run([&](int rank) -> Status {
    Device& device = world.device(rank);
    Communicator& comm = world.comm(rank);
    const auto urank = static_cast<std::size_t>(rank);
    auto a = std::move(device.create_stream("a")).value();
    auto b = std::move(device.create_stream("b")).value();
    auto a_done = std::move(device.create_event()).value();
    auto b_done = std::move(device.create_event()).value();
    std::vector<DeviceBuffer> buffers;
    for (int c = 0; c < kCalls; ++c) {
      buffers.push_back(std::move(DeviceBuffer::allocate(device, count * 4)).value());
    }
    ZINF_RETURN_IF_ERROR(comm.group_start());
    for (int c = 0; c < kCalls; ++c) {
      const auto uc = static_cast<std::size_t>(c);
      Stream& stream = (c % 2 == 0) ? *a : *b;
      ZINF_RETURN_IF_ERROR(
          device.copy_h2d(buffers[uc].data(), inputs[uc][urank].data(), count * 4, stream));
      ZINF_RETURN_IF_ERROR(comm.all_reduce(buffers[uc].data(), buffers[uc].data(), count,
                                           DType::kF32, ReduceOp::kSum, stream));
      ZINF_RETURN_IF_ERROR(
          device.copy_d2h(outputs[uc][urank].data(), buffers[uc].data(), count * 4, stream));
    }
    ZINF_RETURN_IF_ERROR(comm.group_end());
    ZINF_RETURN_IF_ERROR(device.record(*a_done, *a));
    ZINF_RETURN_IF_ERROR(device.record(*b_done, *b));
    ZINF_RETURN_IF_ERROR(comm.wait(*a_done));
    return comm.wait(*b_done);
  });
  for (int r = 0; r < world_size; ++r) {
    ASSERT_TRUE(statuses[static_cast<std::size_t>(r)].is_ok())
        << statuses[static_cast<std::size_t>(r)].to_string();
  }
  for (int c = 0; c < kCalls; ++c) {
    const auto uc = static_cast<std::size_t>(c);
    const std::vector<std::byte> expected =
        serial_reduce(inputs[uc], 0, count, DType::kF32, ReduceOp::kSum);
    for (int r = 0; r < world_size; ++r) {
      ASSERT_EQ(outputs[uc][static_cast<std::size_t>(r)], expected)
          << "call " << c << " rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, LocalCommWorld, ::testing::Values(1, 2, 3, 4, 5));

TEST(LocalComm, MaxAndMinPropagateNaN) {
  World world(3);
  const std::size_t count = 64;
  std::vector<std::vector<float>> results(3, std::vector<float>(count));
  std::vector<Status> statuses = world.run([&](int rank) -> Status {
    Device& device = world.device(rank);
    RankBuffers b(device, count * 4, count * 4);
    std::vector<float> input(count);
    fill_uniform(input.data(), count, 77 + static_cast<std::uint64_t>(rank));
    if (rank == 1) input[5] = NAN;  // an overflow marker on one rank
    ZINF_RETURN_IF_ERROR(device.copy_h2d(b.send.data(), input.data(), count * 4, *b.stream));
    ZINF_RETURN_IF_ERROR(world.comm(rank).all_reduce(b.send.data(), b.recv.data(), count,
                                                     DType::kF32, ReduceOp::kMax, *b.stream));
    ZINF_RETURN_IF_ERROR(world.comm(rank).all_reduce(b.send.data(), b.send.data(), count,
                                                     DType::kF32, ReduceOp::kMin, *b.stream));
    ZINF_RETURN_IF_ERROR(device.synchronize(*b.stream));
    for (std::size_t i = 0; i < count; ++i) {
      const float mx = b.recv.as<float>()[i];
      const float mn = b.send.as<float>()[i];
      if ((i == 5) != std::isnan(mx) || (i == 5) != std::isnan(mn)) {
        return Status::internal("NaN not propagated at " + std::to_string(i));
      }
      if (i != 5 && !(mn <= mx)) return Status::internal("min > max");
    }
    return Status::ok();
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.is_ok()) << s.to_string();
}

// --- Failures --------------------------------------------------------------------------------

// Issues one all_reduce of `count` elements on `rank` and waits for it.
Status one_all_reduce(World& world, int rank, std::size_t count, std::string_view name) {
  Device& device = world.device(rank);
  RankBuffers b(device, 4096 * 4, 4096 * 4);
  ZINF_RETURN_IF_ERROR(world.comm(rank).all_reduce(b.send.data(), b.recv.data(), count, DType::kF32,
                                                   ReduceOp::kSum, *b.stream, name));
  ZINF_RETURN_IF_ERROR(device.record(*b.done, *b.stream));
  return world.comm(rank).wait(*b.done, std::chrono::seconds(30));
}

TEST(LocalComm, RanksThatDisagreeFailEveryRankNamingTheCollective) {
  World world(4);
  std::vector<Status> statuses = world.run([&](int rank) {
    return one_all_reduce(world, rank, rank == 1 ? 101 : 100, "grads.bucket7");
  });
  for (int r = 0; r < 4; ++r) {
    const Status& s = statuses[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.code(), Code::kCommError) << s.to_string();
    EXPECT_NE(s.message().find("ranks disagree"), std::string_view::npos) << s.to_string();
    EXPECT_NE(s.message().find("rank 1 issued all_reduce of 101 f32"), std::string_view::npos)
        << s.to_string();
    EXPECT_NE(s.message().find("grads.bucket7"), std::string_view::npos) << s.to_string();
  }
  // Sticky: the next call on any rank is refused with the first error.
  Status later = one_all_reduce(world, 2, 100, "next");
  EXPECT_EQ(later.code(), Code::kAborted);
  EXPECT_NE(later.message().find("ranks disagree"), std::string_view::npos) << later.to_string();
  EXPECT_EQ(world.comm(0).status().code(), Code::kCommError);
}

// Same kind, size and dtype, but not the same collective: rank 1 names another tensor (an
// engine's gather of another module, whose padded shard is as large). Without the names the
// collective would run and rank 1 would read rank 0's data as its own tensor's.
TEST(LocalComm, RanksThatNameTheSameShapedCallDifferentlyDisagree) {
  World world(3);
  std::vector<Status> statuses = world.run([&](int rank) {
    return one_all_reduce(world, rank, 100, rank == 1 ? "params group 1" : "params group 0");
  });
  for (int r = 0; r < 3; ++r) {
    const Status& s = statuses[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.code(), Code::kCommError) << s.to_string();
    EXPECT_NE(s.message().find("ranks disagree"), std::string_view::npos) << s.to_string();
    EXPECT_NE(s.message().find("rank 1 issued all_reduce of 100 f32 (sum) 'params group 1'"),
              std::string_view::npos)
        << s.to_string();
  }
  // A call one rank leaves unnamed is not compared by name.
  World unnamed(2);
  std::vector<Status> ok = unnamed.run(
      [&](int rank) { return one_all_reduce(unnamed, rank, 100, rank == 1 ? "" : "grads"); });
  for (const Status& s : ok) EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST(LocalComm, ARankThatNeverArrivesTimesOutOnEveryRank) {
  World world(3, milliseconds(200));
  const auto start = Clock::now();
  std::vector<Status> statuses = world.run([&](int rank) -> Status {
    if (rank == 2) return Status::ok();  // this rank skips the collective
    return one_all_reduce(world, rank, 100, "params.layer3");
  });
  const auto elapsed = Clock::now() - start;
  for (int r = 0; r < 2; ++r) {
    const Status& s = statuses[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
    EXPECT_NE(s.message().find("rank(s) 2 to arrive"), std::string_view::npos) << s.to_string();
    EXPECT_NE(s.message().find("params.layer3"), std::string_view::npos) << s.to_string();
  }
  EXPECT_LT(elapsed, std::chrono::seconds(5));
  // The late rank is refused at once instead of waiting for ranks that gave up.
  EXPECT_EQ(one_all_reduce(world, 2, 100, "params.layer3").code(), Code::kAborted);
}

// A rank may run ahead of the others by more collectives than it has records for
// (LocalGroup::kTasksPerRank): its issue() waits for a record to come back, and every result is
// still right once the late rank catches up. Long names are cut, not refused.
TEST(LocalComm, ARankFarAheadWaitsForItsRecordsAndStaysCorrect) {
  World world(2, std::chrono::seconds(30), 91);
  constexpr std::size_t kCalls = LocalGroup::kTasksPerRank * 3 + 5;
  constexpr std::size_t kCount = 33;
  std::vector<std::vector<std::vector<std::byte>>> inputs(kCalls);
  for (std::size_t c = 0; c < kCalls; ++c) {
    for (int r = 0; r < 2; ++r) {
      inputs[c].push_back(
          random_data(kCount, DType::kF32, 9000 + c * 4 + static_cast<std::uint64_t>(r)));
    }
  }
  std::vector<std::vector<std::vector<std::byte>>> outputs(
      kCalls, std::vector<std::vector<std::byte>>(2, std::vector<std::byte>(kCount * 4)));
  const std::string long_name(300, 'n');
  std::vector<Status> statuses = world.run([&](int rank) -> Status {
    Device& device = world.device(rank);
    Communicator& comm = world.comm(rank);
    const auto urank = static_cast<std::size_t>(rank);
    auto stream = std::move(device.create_stream("s")).value();
    auto done = std::move(device.create_event()).value();
    std::vector<DeviceBuffer> buffers;
    for (std::size_t c = 0; c < kCalls; ++c) {
      buffers.push_back(std::move(DeviceBuffer::allocate(device, kCount * 4)).value());
      ZINF_RETURN_IF_ERROR(
          device.copy_h2d(buffers[c].data(), inputs[c][urank].data(), kCount * 4, *stream));
    }
    ZINF_RETURN_IF_ERROR(device.synchronize(*stream));
    // Rank 1 starts late, so rank 0 has all its records in flight and waits for them.
    if (rank == 1) std::this_thread::sleep_for(milliseconds(100));
    for (std::size_t c = 0; c < kCalls; ++c) {
      ZINF_RETURN_IF_ERROR(comm.all_reduce(buffers[c].data(), buffers[c].data(), kCount,
                                           DType::kF32, ReduceOp::kSum, *stream, long_name));
      ZINF_RETURN_IF_ERROR(
          device.copy_d2h(outputs[c][urank].data(), buffers[c].data(), kCount * 4, *stream));
    }
    ZINF_RETURN_IF_ERROR(device.record(*done, *stream));
    return comm.wait(*done);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(statuses[static_cast<std::size_t>(r)].is_ok())
        << statuses[static_cast<std::size_t>(r)].to_string();
  }
  for (std::size_t c = 0; c < kCalls; ++c) {
    const std::vector<std::byte> expected =
        serial_reduce(inputs[c], 0, kCount, DType::kF32, ReduceOp::kSum);
    for (std::size_t r = 0; r < 2; ++r) ASSERT_EQ(outputs[c][r], expected) << "call " << c;
  }
}

// A rank whose records are all in flight for a rank that never comes fails within the timeout
// instead of waiting forever, and so does the rest of the group.
TEST(LocalComm, ARankOutOfRecordsForAMissingRankFailsPromptly) {
  World world(2, milliseconds(200), 92);
  const auto start = Clock::now();
  std::vector<Status> statuses = world.run([&](int rank) -> Status {
    if (rank == 1) return Status::ok();  // never issues anything
    Device& device = world.device(rank);
    Communicator& comm = world.comm(rank);
    auto stream = std::move(device.create_stream("s")).value();
    auto done = std::move(device.create_event()).value();
    auto buffer = std::move(DeviceBuffer::allocate(device, 64)).value();
    for (std::size_t c = 0; c < LocalGroup::kTasksPerRank + 1; ++c) {
      ZINF_RETURN_IF_ERROR(comm.all_reduce(buffer.data(), buffer.data(), 16, DType::kF32,
                                           ReduceOp::kSum, *stream, "params.layer9"));
    }
    ZINF_RETURN_IF_ERROR(device.record(*done, *stream));
    return comm.wait(*done, std::chrono::seconds(30));
  });
  const auto elapsed = Clock::now() - start;
  const Status& s = statuses[0];
  EXPECT_TRUE(s.code() == Code::kTimeout || s.code() == Code::kAborted) << s.to_string();
  // Whichever wait ran out first names the collective: the stream's, or issue()'s.
  EXPECT_NE(s.message().find("params.layer9"), std::string_view::npos) << s.to_string();
  EXPECT_LT(elapsed, std::chrono::seconds(5));
  EXPECT_EQ(world.comm(1).status().code(), Code::kTimeout);
}

TEST(LocalComm, AbortOnOneRankFailsTheOthersPromptly) {
  World world(4);  // 30 s timeout: only the abort can end this quickly
  const auto start = Clock::now();
  std::vector<Status> statuses = world.run([&](int rank) -> Status {
    if (rank == 1) {
      std::this_thread::sleep_for(milliseconds(20));
      world.comm(rank).abort(Status::device_error("rank 1 lost its device"));
      return Status::ok();
    }
    return one_all_reduce(world, rank, 100, "x");
  });
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  for (int r : {0, 2, 3}) {
    const Status& s = statuses[static_cast<std::size_t>(r)];
    // kAborted when the abort came before this rank issued its call.
    EXPECT_TRUE(s.code() == Code::kDeviceError || s.code() == Code::kAborted) << s.to_string();
    EXPECT_NE(s.message().find("rank 1 lost its device"), std::string_view::npos) << s.to_string();
  }
}

TEST(LocalComm, BadArgumentsOnOneRankFailEveryRankPromptly) {
  struct Case {
    const char* what;
    std::function<Status(Communicator&, Device&, RankBuffers&)> bad_call;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"null recv",
       [](Communicator& c, Device&, RankBuffers& b) {
         return c.all_reduce(b.send.data(), nullptr, 100, DType::kF32, ReduceOp::kSum, *b.stream,
                             "w");
       },
       "null recv"},
      {"root out of range",
       [](Communicator& c, Device&, RankBuffers& b) {
         return c.broadcast(b.send.data(), b.recv.data(), 100, DType::kF32, 9, *b.stream, "w");
       },
       "root 9"},
      {"overlap not in place",
       [](Communicator& c, Device&, RankBuffers& b) {
         return c.all_reduce(b.send.data(), b.send.as<float>() + 1, 100, DType::kF32,
                             ReduceOp::kSum, *b.stream, "w");
       },
       "overlap"},
  };
  for (const Case& c : cases) {
    World world(3);
    const auto start = Clock::now();
    std::vector<Status> statuses = world.run([&](int rank) -> Status {
      if (rank != 0) return one_all_reduce(world, rank, 100, "w");
      Device& device = world.device(rank);
      RankBuffers b(device, 4096, 4096);
      return c.bad_call(world.comm(rank), device, b);
    });
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5)) << c.what;
    EXPECT_EQ(statuses[0].code(), Code::kInvalidArgument) << c.what;
    for (int r = 0; r < 3; ++r) {
      // The others fail in their collective, or are refused as they issue it if rank 0 failed
      // first; either way with rank 0's reason.
      const Status& s = statuses[static_cast<std::size_t>(r)];
      EXPECT_TRUE(s.code() == Code::kInvalidArgument || s.code() == Code::kAborted)
          << c.what << ": " << s.to_string();
      EXPECT_NE(s.message().find(c.expected), std::string_view::npos)
          << c.what << ": " << s.to_string();
    }
  }
}

TEST(LocalComm, AFailedStreamOnOneRankFailsTheCollectiveEverywhere) {
  World world(3);
  const auto start = Clock::now();
  std::vector<Status> statuses = world.run([&](int rank) -> Status {
    Device& device = world.device(rank);
    RankBuffers b(device, 4096, 4096);
    if (rank == 0) {
      ZINF_RETURN_IF_ERROR(device.launch_host(
          *b.stream, [] { return Status::io_error("read of grads shard failed"); }));
    }
    ZINF_RETURN_IF_ERROR(world.comm(rank).all_reduce(b.send.data(), b.recv.data(), 100, DType::kF32,
                                                     ReduceOp::kSum, *b.stream));
    ZINF_RETURN_IF_ERROR(device.record(*b.done, *b.stream));
    return world.comm(rank).wait(*b.done);
  });
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(statuses[0].code(), Code::kIoError) << statuses[0].to_string();
  for (const Status& s : statuses) {
    // A rank that issues after rank 0 failed is refused at once (kAborted), with the reason.
    EXPECT_TRUE(s.code() == Code::kIoError || s.code() == Code::kAborted) << s.to_string();
    EXPECT_NE(s.message().find("read of grads shard failed"), std::string_view::npos)
        << s.to_string();
  }
}

TEST(LocalComm, WaitPastItsTimeoutAbortsTheGroup) {
  World world(2);
  std::atomic<bool> release{false};
  std::vector<Status> statuses = world.run([&](int rank) -> Status {
    Device& device = world.device(rank);
    RankBuffers b(device, 4096, 4096);
    if (rank == 0) {
      ZINF_RETURN_IF_ERROR(device.launch_host(*b.stream, [&release] {
        while (!release.load()) std::this_thread::yield();
        return Status::ok();
      }));
    }
    ZINF_RETURN_IF_ERROR(world.comm(rank).all_reduce(b.send.data(), b.recv.data(), 100, DType::kF32,
                                                     ReduceOp::kSum, *b.stream));
    ZINF_RETURN_IF_ERROR(device.record(*b.done, *b.stream));
    Status s = world.comm(rank).wait(*b.done, milliseconds(rank == 0 ? 50 : 30000));
    if (rank == 0) release = true;  // let the stream finish so that it can be destroyed
    return s;
  });
  EXPECT_EQ(statuses[0].code(), Code::kTimeout) << statuses[0].to_string();
  EXPECT_NE(statuses[0].message().find("not done after 50 ms"), std::string_view::npos);
  EXPECT_TRUE(statuses[1].code() == Code::kTimeout || statuses[1].code() == Code::kAborted)
      << statuses[1].to_string();
  EXPECT_NE(statuses[1].message().find("not done after 50 ms"), std::string_view::npos);
}

TEST(LocalComm, BarrierWaitsForEveryRankOrTimesOut) {
  World world(4);
  std::atomic<int> before{0};
  std::vector<Status> statuses = world.run([&](int rank) -> Status {
    std::this_thread::sleep_for(milliseconds(5 * rank));
    ++before;
    ZINF_RETURN_IF_ERROR(world.comm(rank).barrier(std::chrono::seconds(30)));
    if (before.load() != 4) return Status::internal("left the barrier before all arrived");
    return world.comm(rank).barrier(std::chrono::seconds(30));
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.is_ok()) << s.to_string();

  World partial(3);
  statuses = partial.run([&](int rank) -> Status {
    if (rank == 0) return Status::ok();
    return partial.comm(rank).barrier(milliseconds(100));
  });
  for (int r : {1, 2}) {
    const Status& s = statuses[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
    EXPECT_NE(s.message().find("barrier"), std::string_view::npos) << s.to_string();
  }
}

// Seeded faults: a random rank fails a random one of a run of all_reduces in a random way
// (stops issuing, aborts, issues a different size, passes a null buffer). The calls before it
// must succeed with exact results on every rank; that call must fail on every rank; nothing
// hangs. Each case prints its seed.
TEST(LocalComm, SeededFaultsReachEveryRankAndSpareEarlierCalls) {
  const char* kFaultNames[] = {"stops issuing", "aborts", "issues another size",
                               "passes a null buffer"};
  constexpr int kCalls = 6;
  const std::size_t count = 300;
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    SplitMix64 rng(seed);
    const int world_size = 2 + static_cast<int>(rng.next() % 4);
    const int fail_at = static_cast<int>(rng.next() % kCalls);
    const int fail_rank = static_cast<int>(rng.next() % static_cast<std::uint64_t>(world_size));
    const int fault = static_cast<int>(rng.next() % 4);
    std::printf("seed %llu: world %d, rank %d %s at call %d\n",
                static_cast<unsigned long long>(seed), world_size, fail_rank, kFaultNames[fault],
                fail_at);
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    World world(world_size, milliseconds(500), seed);
    std::vector<std::vector<std::vector<std::byte>>> inputs(kCalls);
    for (int c = 0; c < kCalls; ++c) {
      for (int r = 0; r < world_size; ++r) {
        inputs[static_cast<std::size_t>(c)].push_back(
            random_data(count, DType::kF32, seed * 1000 + static_cast<std::uint64_t>(c * 8 + r)));
      }
    }
    // Per rank: the index of the first call that failed (kCalls when none), and results.
    std::vector<int> failed_at(static_cast<std::size_t>(world_size), kCalls);
    std::vector<std::vector<std::vector<std::byte>>> outputs(
        static_cast<std::size_t>(world_size), std::vector<std::vector<std::byte>>(kCalls));
    const auto start = Clock::now();
    world.run([&](int rank) -> Status {
      const auto urank = static_cast<std::size_t>(rank);
      Device& device = world.device(rank);
      Communicator& comm = world.comm(rank);
      RankBuffers b(device, 4096, 4096);
      for (int c = 0; c < kCalls; ++c) {
        const auto uc = static_cast<std::size_t>(c);
        std::size_t elements = count;
        void* recv = b.recv.data();
        if (rank == fail_rank && c == fail_at) {
          if (fault == 0) return Status::ok();
          if (fault == 1) {
            comm.abort(Status::aborted("injected abort"));
            return Status::ok();
          }
          if (fault == 2) elements = count + 1;
          if (fault == 3) recv = nullptr;
        }
        Status s = device.copy_h2d(b.send.data(), inputs[uc][urank].data(), count * 4, *b.stream);
        if (s.is_ok()) {
          s = comm.all_reduce(b.send.data(), recv, elements, DType::kF32, ReduceOp::kSum, *b.stream,
                              "step");
        }
        if (s.is_ok()) s = device.record(*b.done, *b.stream);
        if (s.is_ok()) s = comm.wait(*b.done, std::chrono::seconds(30));
        if (!s.is_ok()) {
          failed_at[urank] = c;
          return s;
        }
        outputs[urank][uc].resize(count * 4);
        std::memcpy(outputs[urank][uc].data(), b.recv.data(), count * 4);
      }
      return Status::ok();
    });
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
    for (int r = 0; r < world_size; ++r) {
      if (r == fail_rank && (fault == 0 || fault == 1)) continue;  // it left on purpose
      EXPECT_EQ(failed_at[static_cast<std::size_t>(r)], fail_at) << "rank " << r;
    }
    for (int c = 0; c < fail_at; ++c) {
      const auto uc = static_cast<std::size_t>(c);
      const std::vector<std::byte> expected =
          serial_reduce(inputs[uc], 0, count, DType::kF32, ReduceOp::kSum);
      for (int r = 0; r < world_size; ++r) {
        EXPECT_EQ(outputs[static_cast<std::size_t>(r)][uc], expected)
            << "call " << c << " rank " << r;
      }
    }
    EXPECT_FALSE(world.comm(0).status().is_ok());
  }
}

// A rank that aborts the moment its all_reduce returned (its stream runs the abort next) must not
// fail that all_reduce on a peer still waking from its last wait in it: every rank had finished
// the collective. Found by ThreadSanitizer's slowdown in SeededFaultsReachEveryRankAndSpareEarlier
// Calls (seed 12: rank 4's call 2 failed with rank 3's abort from call 3); before the fix a peer
// that woke after the abort returned the abort. Repeated, since it is a race of thread wake-ups.
TEST(LocalComm, AnAbortRightAfterACollectiveFailsItOnNoRank) {
  constexpr int kWorld = 5;
  constexpr int kTrials = 40;
  const std::size_t count = 256;
  int failed = 0;
  std::string first_failure;
  for (int trial = 0; trial < kTrials; ++trial) {
    World world(kWorld, std::chrono::seconds(30), 700 + static_cast<std::uint64_t>(trial));
    std::vector<std::vector<std::byte>> inputs;
    for (int r = 0; r < kWorld; ++r) {
      inputs.push_back(random_data(count, DType::kF32, 7000 + trial * 8 + r));
    }
    const std::vector<std::byte> expected =
        serial_reduce(inputs, 0, count, DType::kF32, ReduceOp::kSum);
    std::vector<std::vector<std::byte>> outputs(kWorld, std::vector<std::byte>(count * 4));
    std::vector<Status> statuses = world.run([&](int rank) -> Status {
      const auto urank = static_cast<std::size_t>(rank);
      Device& device = world.device(rank);
      Communicator& comm = world.comm(rank);
      RankBuffers b(device, count * 4, count * 4);
      ZINF_RETURN_IF_ERROR(
          device.copy_h2d(b.send.data(), inputs[urank].data(), count * 4, *b.stream));
      ZINF_RETURN_IF_ERROR(comm.all_reduce(b.send.data(), b.recv.data(), count, DType::kF32,
                                           ReduceOp::kSum, *b.stream, "last"));
      if (rank == 0) {
        ZINF_RETURN_IF_ERROR(device.launch_host(*b.stream, [&comm] {
          comm.abort(Status::aborted("rank 0 aborts after its last collective"));
          return Status::ok();
        }));
      }
      ZINF_RETURN_IF_ERROR(
          device.copy_d2h(outputs[urank].data(), b.recv.data(), count * 4, *b.stream));
      ZINF_RETURN_IF_ERROR(device.record(*b.done, *b.stream));
      return device.synchronize(*b.done, std::chrono::seconds(30));
    });
    for (int r = 0; r < kWorld; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      if (statuses[ur].is_ok() && outputs[ur] == expected) continue;
      if (failed++ == 0) {
        first_failure = fmt::format("trial {} rank {}: {}", trial, r, statuses[ur].to_string());
      }
    }
    EXPECT_FALSE(world.comm(1).status().is_ok());  // the abort reached the group
  }
  EXPECT_EQ(failed, 0) << "ranks whose finished all_reduce failed; first: " << first_failure;
}

// On opaque HostDevices (pointers that host code cannot dereference, as on a GPU) the collectives
// reach the memory through its host addresses: a reduce-scatter (out of place and in place) and
// an all-gather give the serial reference's bits.
TEST(LocalComm, CollectivesRunOnOpaqueDevices) {
  const int world_size = 3;
  World world(world_size, std::chrono::seconds(30), 9, /*opaque=*/true);
  ASSERT_FALSE(world.device(0).host_accessible());
  const std::size_t chunk = 301;
  const std::size_t total = chunk * world_size;
  std::vector<std::vector<std::byte>> inputs;
  for (int r = 0; r < world_size; ++r) inputs.push_back(random_data(total, DType::kF32, 70 + r));
  for (bool in_place : {false, true}) {
    std::vector<std::vector<std::byte>> reduced(world_size, std::vector<std::byte>(chunk * 4));
    std::vector<std::vector<std::byte>> gathered(world_size, std::vector<std::byte>(total * 4));
    std::vector<Status> statuses = world.run([&](int rank) -> Status {
      const auto r = static_cast<std::size_t>(rank);
      Device& device = world.device(rank);
      RankBuffers b(device, total * 4, total * 4);
      float* recv = in_place ? b.send.as<float>() + r * chunk : b.recv.as<float>();
      ZINF_RETURN_IF_ERROR(device.copy_h2d(b.send.data(), inputs[r].data(), total * 4, *b.stream));
      ZINF_RETURN_IF_ERROR(world.comm(rank).reduce_scatter(
          b.send.data(), recv, chunk, DType::kF32, ReduceOp::kAverage, *b.stream, "bucket"));
      ZINF_RETURN_IF_ERROR(device.copy_d2h(reduced[r].data(), recv, chunk * 4, *b.stream));
      // The gather reuses the send buffer, the rank's reduced chunk in its slot (there already
      // when in place).
      float* full = b.send.as<float>();
      if (!in_place) {
        ZINF_RETURN_IF_ERROR(device.copy_d2d(full + r * chunk, recv, chunk * 4, *b.stream));
      }
      ZINF_RETURN_IF_ERROR(world.comm(rank).all_gather(full + r * chunk, full, chunk, DType::kF32,
                                                       *b.stream, "params"));
      ZINF_RETURN_IF_ERROR(device.copy_d2h(gathered[r].data(), full, total * 4, *b.stream));
      ZINF_RETURN_IF_ERROR(device.record(*b.done, *b.stream));
      return world.comm(rank).wait(*b.done);
    });
    std::vector<std::byte> all;
    for (int r = 0; r < world_size; ++r) {
      ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
      const std::vector<std::byte> expected = serial_reduce(
          inputs, static_cast<std::size_t>(r) * chunk, chunk, DType::kF32, ReduceOp::kAverage);
      ASSERT_EQ(reduced[r], expected) << "rank " << r << " in_place " << in_place;
      all.insert(all.end(), expected.begin(), expected.end());
    }
    for (int r = 0; r < world_size; ++r) EXPECT_EQ(gathered[r], all) << "rank " << r;
  }
}

TEST(LocalComm, GroupCallsNestAndMustMatch) {
  World world(1);
  Communicator& comm = world.comm(0);
  EXPECT_EQ(comm.group_end().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(comm.group_start().is_ok());
  EXPECT_TRUE(comm.group_start().is_ok());
  EXPECT_TRUE(comm.group_end().is_ok());
  EXPECT_TRUE(comm.group_end().is_ok());
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.world_size(), 1);
  EXPECT_EQ(comm.name(), "local rank 0 of 1");
}

TEST(LocalComm, FactoryRejectsBadDevicesAndOptions) {
  EXPECT_EQ(make_local_comm_group({}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(make_local_comm_group({nullptr}).status().code(), Code::kInvalidArgument);
  auto device = std::move(make_host_device()).value();
  LocalCommOptions options;
  options.timeout = milliseconds(0);
  EXPECT_EQ(make_local_comm_group({device.get()}, options).status().code(), Code::kInvalidArgument);
  // One device for two ranks: refused, naming both.
  auto other = std::move(make_host_device()).value();
  const Status shared = make_local_comm_group({device.get(), other.get(), device.get()}).status();
  EXPECT_EQ(shared.code(), Code::kInvalidArgument);
  EXPECT_NE(shared.message().find("ranks 0 and 2 were given the same device"), std::string::npos)
      << shared.to_string();
}

}  // namespace
}  // namespace zinf
