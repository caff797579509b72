// What a save reads of the tags already in its directory: each manifest once (rank 0 lists the
// directory once per save, a summary of each manifest, and keep_last works from that list), so a
// save into a directory of many tags does not read them two or three times over. Counted through
// the engine's fault injector, which sees every read of the checkpoint's I/O.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "io/fault.hpp"

namespace zinf {
namespace {

using engine_test::Model;

// Saves tags t1..t6 from one rank; the reads each save made.
std::vector<std::uint64_t> reads_per_save(int keep_last, const std::string& dir) {
  const Model model = engine_test::make_model(DType::kF32, 9);
  Config config = engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, "");
  config.keep_last = keep_last;
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  std::shared_ptr<FaultInjector> counter = engine_test::io_counter(/*reads=*/true);
  std::vector<std::uint64_t> reads;
  const std::vector<Status> st = engine_test::run_ranks(1, [&](int rank) -> Status {
    ZINF_ASSIGN_OR_RETURN(auto e, engine_test::open_finalized(ranks, rank, config, model, counter));
    for (int i = 1; i <= 6; ++i) {
      ZINF_RETURN_IF_ERROR(engine_test::train_steps(*e, model, rank, i, i));
      const std::uint64_t before = counter->counts().latency;
      ZINF_RETURN_IF_ERROR(e->save_checkpoint(dir, fmt::format("t{}", i)));
      reads.push_back(counter->counts().latency - before);
    }
    return Status::ok();
  });
  EXPECT_TRUE(st[0].is_ok()) << st[0].to_string();
  return reads;
}

TEST(CheckpointListReads, ASaveReadsEachManifestInItsDirectoryOnce) {
  engine_test::ScratchDir tmp("ckpt-list-reads");
  // The manifests are small (one read each): save i reads the i - 1 tags there.
  const std::vector<std::uint64_t> want = {0, 1, 2, 3, 4, 5};
  EXPECT_EQ(reads_per_save(0, tmp.path() + "/keep_all"), want);
  // keep_last prunes from the same listing: nothing read again after the save (and with 3 kept,
  // save i finds min(i - 1, 3) tags).
  EXPECT_EQ(reads_per_save(100, tmp.path() + "/keep_100"), want);
  EXPECT_EQ(reads_per_save(3, tmp.path() + "/keep_3"),
            (std::vector<std::uint64_t>{0, 1, 2, 3, 3, 3}));
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(tmp.path() + "/keep_3")) {
    left.push_back(e.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{".zinf-save.lock", "latest", "t4", "t5", "t6"}));
}

}  // namespace
}  // namespace zinf
