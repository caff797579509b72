// ParamCoordinatorOptions::shared_host_shards: a partitioned group's host shard lent by its
// owner. Two ranks at stage 3, shards in host memory, on HostDevices that copy only from
// registered host memory (HostDeviceOptions::require_registered_host, as a GPU needs for an
// asynchronous copy): the coordinator keeps no shard for the lent group, gathers it from the
// lent memory, takes a write of those bytes as done and refuses one from elsewhere, and after
// unshare_host_shard() keeps a copy of its own.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

#include "base/aligned.hpp"
#include "base/arith.hpp"
#include "base/random.hpp"
#include "common/run_ranks.hpp"
#include "zero/param_coordinator.hpp"
#include "zero/param_coordinator_test_util.hpp"
#include "zero/partitioner.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"

namespace zinf {
namespace {

constexpr int kWorld = 2;

TEST(ParamCoordinatorLent, GathersTheLentShardAndKeepsNoCopyUntilUnshared) {
  constexpr std::uint64_t kSeed = 4242;
  SCOPED_TRACE(testing::Message() << "seed " << kSeed);
  Result<Partitioner> created = test::one_group_modules(kWorld, 2, {16, 256});
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  Partitioner& part = *created;
  const std::size_t shard_elements = part.group(1).shard_element_count;
  const std::size_t shard_bytes = shard_elements * sizeof(float);

  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < kWorld; ++r) {
    HostDeviceOptions o;
    o.ordinal = r;
    o.require_registered_host = true;
    devices.push_back(std::move(make_host_device(o)).value());
    raw.push_back(devices.back().get());
  }
  LocalCommOptions lo;
  lo.timeout = std::chrono::seconds(20);
  std::vector<std::unique_ptr<Communicator>> comms =
      std::move(make_local_comm_group(raw, lo)).value();

  // Each rank's lent shard of group 1, seeded; registered (all but in the refusal below).
  std::vector<AlignedBuffer> lent;
  for (int r = 0; r < kWorld; ++r) {
    lent.emplace_back(shard_bytes);
    fill_uniform(lent.back().as<float>(), shard_elements, kSeed + r);
    ASSERT_TRUE(raw[r]->register_host(lent.back().data(), shard_bytes).is_ok());
  }
  std::vector<std::unique_ptr<ParamCoordinator>> coords;
  for (int r = 0; r < kWorld; ++r) {
    ParamCoordinatorOptions co;
    co.shard_tier = OffloadDevice::kHost;
    co.timeout = std::chrono::seconds(20);
    co.shared_host_shards = {nullptr, lent[r].data()};
    Result<std::unique_ptr<ParamCoordinator>> coord = ParamCoordinator::create(
        part, r, *raw[r], *comms[r], test::one_group_coordinator_modules(2), {false, false}, co,
        nullptr, nullptr, nullptr);
    ASSERT_TRUE(coord.is_ok()) << coord.status().to_string();
    coords.push_back(std::move(*coord));
    // Group 0's shard alone, one page.
    EXPECT_EQ(coords.back()->host_bytes(), round_page(part.group(0).shard_element_count * 4));
    EXPECT_TRUE(coords.back()->shares_host_shard(1));
    EXPECT_FALSE(coords.back()->shares_host_shard(0));
  }

  // Every rank's full group 1 after a gather: both ranks' shards as `want` says.
  auto gather_and_check = [&](const std::vector<std::vector<float>>& want, const char* when) {
    const std::vector<Status> st = test::run_ranks(kWorld, [&](int rank) -> Status {
      ParamCoordinator& c = *coords[rank];
      ZINF_RETURN_IF_ERROR(c.gather(1));
      const auto* full = static_cast<const float*>(c.group_data(1));
      for (int q = 0; q < kWorld; ++q) {
        if (std::memcmp(full + part.shard_offset(1, q), want[q].data(), shard_bytes) != 0) {
          return Status::internal(fmt::format("rank {}: rank {}'s shard differs", rank, q));
        }
      }
      return c.release(1);
    });
    for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << when << ": " << s.to_string();
  };
  std::vector<std::vector<float>> first(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    first[r].assign(lent[r].as<float>(), lent[r].as<float>() + shard_elements);
    // A write of the lent bytes themselves copies nothing; one from other memory is a bug.
    EXPECT_TRUE(coords[r]->write_shard(1, lent[r].data()).is_ok());
    EXPECT_TRUE(coords[r]->write_shard_part(1, 3, 5, lent[r].as<float>() + 3).is_ok());
    EXPECT_EQ(coords[r]->write_shard(1, first[r].data()).code(), Code::kInternal);
    EXPECT_TRUE(coords[r]->wait_writes().is_ok());
  }
  gather_and_check(first, "lent");

  // New values in the lent memory are what the next gather moves.
  std::vector<std::vector<float>> second(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    fill_uniform(lent[r].as<float>(), shard_elements, kSeed * 7 + r);
    second[r].assign(lent[r].as<float>(), lent[r].as<float>() + shard_elements);
  }
  gather_and_check(second, "rewritten");

  // Unshared: a copy of its own, one page more; the lent memory is the owner's again.
  for (int r = 0; r < kWorld; ++r) {
    const std::uint64_t before = coords[r]->host_bytes();
    ASSERT_TRUE(coords[r]->unshare_host_shard(1).is_ok());
    EXPECT_FALSE(coords[r]->shares_host_shard(1));
    EXPECT_EQ(coords[r]->host_bytes(), before + round_page(shard_bytes));
    fill_uniform(lent[r].as<float>(), shard_elements, kSeed * 13 + r);
  }
  gather_and_check(second, "unshared");
  coords.clear();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(raw[r]->unregister_host(lent[r].data()).is_ok());
  }
}

// Lent memory the device does not know is refused by a device that copies only from registered
// memory: the lender registers it (StoreState registers its half array).
TEST(ParamCoordinatorLent, AnUnregisteredLentShardFailsTheGather) {
  Result<Partitioner> created = test::one_group_modules(1, 1, {8, 256});
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  Partitioner& part = *created;
  HostDeviceOptions o;
  o.require_registered_host = true;
  std::unique_ptr<Device> device = std::move(make_host_device(o)).value();
  Device* raw = device.get();
  std::vector<std::unique_ptr<Communicator>> comms =
      std::move(make_local_comm_group(std::vector<Device*>{raw}, LocalCommOptions{})).value();
  AlignedBuffer lent(part.group(0).shard_element_count * sizeof(float));
  fill_uniform(lent.as<float>(), part.group(0).shard_element_count, 77);
  ParamCoordinatorOptions co;
  co.shard_tier = OffloadDevice::kHost;
  co.shared_host_shards = {lent.data()};
  Result<std::unique_ptr<ParamCoordinator>> coord =
      ParamCoordinator::create(part, 0, *device, *comms[0], test::one_group_coordinator_modules(1),
                               {false}, co, nullptr, nullptr, nullptr);
  ASSERT_TRUE(coord.is_ok()) << coord.status().to_string();
  EXPECT_EQ((*coord)->gather(0).code(), Code::kFailedPrecondition);
}

}  // namespace
}  // namespace zinf
