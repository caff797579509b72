// Engine::load_checkpoint's republish on two ranks: each rank writes its new shards from the
// loaded master before the load's last agreement, and the persistent groups are all-gathered only
// once every rank agreed that its load and its shard writes succeeded. So a failure of one rank
// there (a write error on a shard on NVMe, a flipped bit in the master of a linked file taken in
// place, which the republish is the first to read) fails the load on every rank in the same call,
// the others with kAborted naming the rank, at once rather than at the collective timeout; every
// rank's engine stays failed (the shards disagree), and the communicator is not aborted.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"
#include "io/fault.hpp"

namespace zinf {
namespace {

using engine_test::Model;

constexpr int kWorld = 2;
constexpr auto kPublishTimeout = std::chrono::seconds(6);

// What each rank saw of its load_checkpoint() and of the calls after it.
struct Outcome {
  std::vector<Status> loaded = std::vector<Status>(kWorld);
  std::vector<Status> next = std::vector<Status>(kWorld);  // a read-back after the load
  std::vector<double> seconds = std::vector<double>(kWorld);
};

// The checks every case makes: rank 0 failed with `code` and `what` in its message, rank 1
// with kAborted naming rank 0, both at once; both stay failed; the communicator was not aborted.
void expect_every_rank_failed(const Outcome& o, const engine_test::Ranks& ranks, Code code,
                              const std::string& what) {
  EXPECT_EQ(o.loaded[0].code(), code) << o.loaded[0].to_string();
  EXPECT_THAT(o.loaded[0].message(), ::testing::HasSubstr("load_checkpoint("));
  EXPECT_THAT(o.loaded[0].message(), ::testing::HasSubstr(what));
  EXPECT_EQ(o.loaded[1].code(), Code::kAborted) << o.loaded[1].to_string();
  EXPECT_THAT(o.loaded[1].message(),
              ::testing::HasSubstr(fmt::format("rank 0 failed ({})", code_name(code))));
  for (std::size_t r = 0; r < kWorld; ++r) {
    EXPECT_LT(o.seconds[r], 3.0) << "rank " << r << " waited for the collective timeout";
    EXPECT_EQ(o.next[r].to_string(), o.loaded[r].to_string()) << "rank " << r << ": sticky";
    EXPECT_TRUE(ranks.comms[r]->status().is_ok())
        << "rank " << r << ": " << ranks.comms[r]->status().to_string();
  }
}

// A write error on rank 0's shards on NVMe during the republish (stage 3; the state in host
// memory, in HostState's memory or on an opaque device, so the load itself writes nothing to
// NVMe), with persistent groups (the other rank waited in their all-gather before) and without
// (the other rank's load returned OK before).
TEST(CheckpointPublish, AShardWriteErrorOnOneRankFailsEveryRankInTheLoad) {
  struct LoadCase {
    OffloadDevice optimizer;
    bool opaque;
  };
  for (const LoadCase& c :
       {LoadCase{OffloadDevice::kHost, false}, LoadCase{OffloadDevice::kNone, false},
        LoadCase{OffloadDevice::kNone, true}}) {
    for (const bool none_persistent : {false, true}) {
      const std::string label =
          fmt::format("opt_{}{}{}", offload_device_name(c.optimizer), c.opaque ? "_opaque" : "",
                      none_persistent ? "_none_persistent" : "");
      SCOPED_TRACE(label);
      engine_test::ScratchDir dir("ckpt_publish_shard_" + label);
      const std::string ckpt = dir.path() + "/ckpt";
      const Model model = engine_test::make_model(DType::kF32, 91);
      engine_test::Ranks ranks = engine_test::make_ranks(kWorld, kPublishTimeout, 0, c.opaque);
      Config config = engine_test::small_config(3, c.optimizer, OffloadDevice::kNvme, dir.path());
      config.collective_timeout_ms = 6000;
      if (none_persistent) config.zero.stage3_param_persistence_threshold = 0;
      Outcome o;
      std::vector<std::uint64_t> errors(kWorld);
      std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
        const auto r = static_cast<std::size_t>(rank);
        auto faults = engine_test::failing_io(/*reads=*/false);
        ZINF_ASSIGN_OR_RETURN(auto engine,
                              engine_test::open_finalized(ranks, rank, config, model, faults));
        ZINF_RETURN_IF_ERROR(engine->save_checkpoint(ckpt, "a"));
        faults->set_enabled(rank == 0);
        const auto start = std::chrono::steady_clock::now();
        o.loaded[r] = engine->load_checkpoint(ckpt, "a");
        o.seconds[r] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        faults->set_enabled(false);
        errors[r] = faults->counts().eio;
        std::vector<float> out(model.params[0].element_count());
        o.next[r] = engine->read_parameters(model.params[0].name, out.data());
        return Status::ok();
      });
      for (std::size_t r = 0; r < kWorld; ++r) {
        ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
      }
      ASSERT_GT(errors[0], 0u) << "no shard write failed";
      EXPECT_EQ(errors[1], 0u);
      expect_every_rank_failed(o, ranks, Code::kIoError, "swap extent rank0/param/group");
    }
  }
}

// A linked rank file taken in place (the optimizer state on NVMe in the checkpoint layout) is
// read first by the republish, which checks each master block against its checksum: a flipped
// bit in rank 0's master is kCorruption naming the file on rank 0, and fails rank 1's load too,
// where before rank 1 waited in the all-gather of the persistent groups (stage 2: all of them).
TEST(CheckpointPublish, ACorruptLinkedMasterOnOneRankFailsEveryRankInTheLoad) {
  engine_test::ScratchDir dir("ckpt_publish_linked");
  const std::string ckpt = dir.path() + "/ckpt";
  const Model model = engine_test::page_model(92);
  Config config =
      engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  config.zero.sub_group_size = 1024;
  config.collective_timeout_ms = 6000;
  {
    engine_test::Ranks ranks = engine_test::make_ranks(kWorld, kPublishTimeout);
    for (const Status& st : engine_test::run_engines(config, ranks, [&](int, Engine& e) -> Status {
           ZINF_RETURN_IF_ERROR(engine_test::register_model(e, model));
           ZINF_RETURN_IF_ERROR(e.finalize());
           return e.save_checkpoint(ckpt, "a");
         })) {
      ASSERT_TRUE(st.is_ok()) << st.to_string();
    }
  }
  std::ifstream in(ckpt + "/a/manifest.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Result<CheckpointManifest> m = parse_checkpoint_manifest(text, ckpt);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  ASSERT_FALSE(m->ranks.at(0).blocks.empty()) << "the save did not link the swap file";
  const std::string victim = ckpt + "/a/rank0.zinfckpt";
  ASSERT_TRUE(engine_test::flip_bits(victim, 4096 + 5, 0x40));  // rank 0's first master block

  engine_test::Ranks ranks = engine_test::make_ranks(kWorld, kPublishTimeout);
  Outcome o;
  std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        const auto r = static_cast<std::size_t>(rank);
        ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
        ZINF_RETURN_IF_ERROR(engine.finalize());
        const auto start = std::chrono::steady_clock::now();
        o.loaded[r] = engine.load_checkpoint(ckpt, "a");
        o.seconds[r] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::vector<float> out(model.params[0].element_count());
        o.next[r] = engine.read_parameters(model.params[0].name, out.data());
        return Status::ok();
      });
  for (std::size_t r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  }
  expect_every_rank_failed(o, ranks, Code::kCorruption, victim);
  EXPECT_THAT(o.loaded[0].message(), ::testing::HasSubstr("checksum"));
}

// One rank on an opaque device whose stream runs each operation after a random delay of up to
// 20 ms (seeded: make_ranks' jitter), stage 3, the optimizer state on the device (DeviceState)
// and the shards on NVMe: the republish of a load writes the persistent bias (the first group)
// with a copy up queued on the coordinator's stream from the publisher's buffer, then fails
// writing the next group's shard (EIO on every write). The load fails with the write's io_error,
// stickily, and the buffer outlives the queued copy: an AddressSanitizer build reports the copy's
// read of a freed buffer where the failed publish freed it at once.
TEST(CheckpointPublish, AShardWriteErrorAfterAQueuedPersistentCopyFailsTheLoadOnAnOpaqueDevice) {
  engine_test::ScratchDir dir("ckpt_publish_opaque_copy");
  const std::string ckpt = dir.path() + "/ckpt";
  Model model;
  model.modules = {"a", "b"};
  model.params = {{"a.b", "a", {16}, DType::kF32},
                  {"a.w", "a", {48, 64}, DType::kF32},
                  {"b.w", "b", {64, 64}, DType::kF32}};
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    std::vector<float> v(model.params[p].element_count());
    fill_uniform(v.data(), v.size(), 9300 + p, -1.0f, 1.0f);
    model.initial.push_back(std::move(v));
  }
  engine_test::Ranks ranks = engine_test::make_ranks(1, kPublishTimeout, /*jitter_max_us=*/20'000,
                                                     /*opaque=*/true);
  Config config =
      engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNvme, dir.path());
  config.collective_timeout_ms = 6000;
  auto faults = engine_test::failing_io(/*reads=*/false);
  Status loaded, next;
  {
    Result<std::unique_ptr<Engine>> opened =
        engine_test::open_finalized(ranks, 0, config, model, faults);
    ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
    Engine& engine = **opened;
    ASSERT_TRUE(engine.save_checkpoint(ckpt, "a").is_ok());
    faults->set_enabled(true);
    loaded = engine.load_checkpoint(ckpt, "a");
    faults->set_enabled(false);
    std::vector<float> out(model.params[0].element_count());
    next = engine.read_parameters(model.params[0].name, out.data());
  }
  EXPECT_GT(faults->counts().eio, 0u) << "no shard write failed";
  EXPECT_EQ(loaded.code(), Code::kIoError) << loaded.to_string();
  EXPECT_THAT(loaded.message(), ::testing::HasSubstr("swap extent rank0/param/group"));
  EXPECT_EQ(next.to_string(), loaded.to_string()) << "sticky";
}

}  // namespace
}  // namespace zinf
