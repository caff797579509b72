// The overlapped step (zinf.overlap_step, the optimizer state in host memory) leaves the
// persistent groups that no gather of the next forward all-gathered to the next collective call:
// its settle() all-gathers every one of them, in that call, once; a later call, with none left,
// all-gathers nothing but its own groups. Two ranks at stage 2 (every group persistent), six
// parameters, each its own module and group. One training step, then a forward that gathers
// modules 0 and 2 only; write_parameters("w1") then all-gathers groups 1, 3, 4 and 5 (pending)
// and group 1 again (the write's own), a second write of w1 group 1 alone, and gathers of every
// module afterwards none. Every device copy then equals the master (read_parameters), bit for bit,
// and the same on both ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "one_param_modules.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

constexpr int kPublishWorld = 2;
constexpr std::size_t kParams = 6;
constexpr std::size_t kEach = 40;  // elements a parameter
constexpr std::uint64_t kPendingSeed = 6120;

// What a group's all-gather receives: kEach elements padded to kPublishWorld * 128 (the
// partitioner's alignment_elements), f32.
constexpr std::uint64_t kGroupBytes = kPublishWorld * 128 * sizeof(float);

// The device copy of parameter i, read through the device; the module stays gathered.
Result<std::vector<float>> device_copy(Engine& engine, Device& device, std::size_t i) {
  ZINF_ASSIGN_OR_RETURN(TensorView copy, engine.parameter(fmt::format("w{}", i)));
  return engine_test::copy_to_host(device, copy.data, kEach);
}

TEST(PublishPending, TheNextCollectiveCallAllGathersTheGroupsNoGatherPublishedOnce) {
  SCOPED_TRACE(testing::Message() << "seed " << kPendingSeed);
  engine_test::Ranks ranks = engine_test::make_ranks(kPublishWorld);
  Config config;
  config.optimizer.kind = OptimizerKind::kAdamW;
  config.optimizer.lr = 1e-2;
  config.zero.stage = 2;
  config.zero.offload_optimizer.device = OffloadDevice::kHost;
  config.overlap_step = true;
  config.collective_timeout_ms = 30000;  // as make_ranks()' communicators

  struct Seen {
    std::uint64_t pending_write_bytes = 0;  // write_parameters() right after the partial forward
    std::uint64_t second_write_bytes = 0;   // the next write_parameters()
    std::uint64_t gathers_bytes = 0;        // gathers of every module after both
    std::vector<std::vector<float>> masters, copies;
  };
  std::vector<Seen> seen(kPublishWorld);
  // Parameter i's initial values are seeded with kPendingSeed + i.
  const engine_test::Model model =
      engine_test::one_param_modules(kParams, kEach, kPendingSeed, -1.0f, 1.0f);
  const std::vector<float> written = engine_test::seeded(kEach, kPendingSeed + 99, -1.0f, 1.0f);
  const std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        Seen& s = seen[static_cast<std::size_t>(rank)];
        ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
        ZINF_RETURN_IF_ERROR(engine.finalize());
        // One step: every module gathered and released, its gradients (each rank's own) reduced
        // last module first.
        for (std::size_t i = 0; i < kParams; ++i) {
          ZINF_RETURN_IF_ERROR(engine.gather(fmt::format("m{}", i)));
          ZINF_RETURN_IF_ERROR(engine.release(fmt::format("m{}", i)));
        }
        for (std::size_t i = kParams; i-- > 0;) {
          const std::string name = fmt::format("w{}", i);
          const std::vector<float> grad = engine_test::seeded(
              kEach, kPendingSeed * 7 + static_cast<std::uint64_t>(rank) * 100 + i, -1.0f, 1.0f);
          const GradientRef ref{name, grad.data(), kEach, DType::kF32};
          ZINF_RETURN_IF_ERROR(engine.reduce_gradients(fmt::format("m{}", i), {&ref, 1}));
        }
        ZINF_RETURN_IF_ERROR(engine.step().status());
        // The next forward gathers modules 0 and 2 alone: their groups are all-gathered there.
        for (std::size_t i : {0, 2}) {
          ZINF_RETURN_IF_ERROR(engine.gather(fmt::format("m{}", i)));
          ZINF_RETURN_IF_ERROR(engine.release(fmt::format("m{}", i)));
        }
        std::uint64_t before = engine.counters().all_gather_bytes;
        ZINF_RETURN_IF_ERROR(engine.write_parameters("w1", written.data()));
        s.pending_write_bytes = engine.counters().all_gather_bytes - before;
        before = engine.counters().all_gather_bytes;
        ZINF_RETURN_IF_ERROR(engine.write_parameters("w1", written.data()));
        s.second_write_bytes = engine.counters().all_gather_bytes - before;
        before = engine.counters().all_gather_bytes;
        for (std::size_t i = 0; i < kParams; ++i) {
          ZINF_RETURN_IF_ERROR(engine.gather(fmt::format("m{}", i)));
        }
        s.gathers_bytes = engine.counters().all_gather_bytes - before;
        for (std::size_t i = 0; i < kParams; ++i) {
          ZINF_ASSIGN_OR_RETURN(
              std::vector<float> copy,
              device_copy(engine, *ranks.devices[static_cast<std::size_t>(rank)], i));
          s.copies.push_back(std::move(copy));
          ZINF_RETURN_IF_ERROR(engine.release(fmt::format("m{}", i)));
        }
        for (std::size_t i = 0; i < kParams; ++i) {
          std::vector<float> master(kEach);
          ZINF_RETURN_IF_ERROR(engine.read_parameters(fmt::format("w{}", i), master.data()));
          s.masters.push_back(std::move(master));
        }
        return Status::ok();
      });
  for (int rank = 0; rank < kPublishWorld; ++rank) {
    const auto r = static_cast<std::size_t>(rank);
    ASSERT_TRUE(st[r].is_ok()) << "rank " << rank << ": " << st[r].to_string();
    const Seen& s = seen[r];
    EXPECT_EQ(s.pending_write_bytes, 5 * kGroupBytes)
        << "rank " << rank << ": groups 1, 3, 4, 5 pending and group 1 written";
    EXPECT_EQ(s.second_write_bytes, kGroupBytes) << "rank " << rank << ": group 1 alone";
    EXPECT_EQ(s.gathers_bytes, 0u) << "rank " << rank << ": every group published already";
    ASSERT_EQ(s.copies.size(), kParams);
    ASSERT_EQ(s.masters.size(), kParams);
    for (std::size_t i = 0; i < kParams; ++i) {
      EXPECT_EQ(std::memcmp(s.copies[i].data(), s.masters[i].data(), kEach * sizeof(float)), 0)
          << "rank " << rank << ", w" << i << "'s device copy against its master";
      EXPECT_EQ(std::memcmp(s.masters[i].data(), seen[0].masters[i].data(), kEach * sizeof(float)),
                0)
          << "rank " << rank << ", w" << i << " against rank 0's";
    }
    EXPECT_EQ(std::memcmp(s.masters[1].data(), written.data(), kEach * sizeof(float)), 0)
        << "rank " << rank << ": w1 holds what was written";
    // The step changed the others.
    for (std::size_t i : {0, 2, 3, 4, 5}) {
      EXPECT_NE(std::memcmp(s.masters[i].data(), model.initial[i].data(), kEach * sizeof(float)), 0)
          << "rank " << rank << ", w" << i << " unchanged by the step";
    }
  }
}

}  // namespace
}  // namespace zinf
