// The tags a save refuses before it writes anything. Ranks that pass different tags: a checkpoint
// is one tag directory, so every rank fails, naming each rank's tag, and the previous checkpoint
// and `latest` stay as they were (DeepSpeed's checkpoint.tag_validation "Fail"; zinf does so
// whatever that key says).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;

// The names under `dir`, sorted.
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(CheckpointTagCheck, RanksPassingDifferentTagsFailEveryRankNamingEachTag) {
  engine_test::ScratchDir tmp("ckpt-tags-differ");
  const std::string dir = tmp.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 5);
  Config config = engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, "");
  const int world = 3;
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<Status> failed(world);
  std::vector<std::string> after_failed;
  std::string latest_after_failed;
  std::vector<std::vector<std::vector<float>>> trained(world), loaded(world);
  const std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    ZINF_ASSIGN_OR_RETURN(auto e, engine_test::open_finalized(ranks, rank, config, model));
    ZINF_RETURN_IF_ERROR(engine_test::train_steps(*e, model, rank, 1, 2));
    ZINF_RETURN_IF_ERROR(e->save_checkpoint(dir, "a"));
    ZINF_ASSIGN_OR_RETURN(trained[rank], engine_test::read_masters(*e, model));
    ZINF_RETURN_IF_ERROR(engine_test::train_steps(*e, model, rank, 3, 3));
    // Ranks 0 and 2 pass "b", rank 1 "c".
    failed[rank] = e->save_checkpoint(dir, rank == 1 ? "c" : "b");
    if (rank == 0) {
      // Every rank is past the refusal (it follows a collective), and nothing writes until the
      // save below: what the refused save left.
      after_failed = entries(dir);
      latest_after_failed = engine_test::read_file(dir + "/latest");
    }
    // The failure is not sticky: the same engines save under one tag and load `latest`.
    ZINF_RETURN_IF_ERROR(e->load_checkpoint(dir));
    ZINF_ASSIGN_OR_RETURN(loaded[rank], engine_test::read_masters(*e, model));
    return e->save_checkpoint(dir, "d");
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(failed[r].code(), Code::kInvalidArgument) << failed[r].to_string();
    EXPECT_EQ(failed[r].message(),
              fmt::format("save_checkpoint('{}', '{}'): the ranks save under different tags ('b' "
                          "on ranks 0, 2, 'c' on rank 1): every rank must pass the same tag, "
                          "since a checkpoint is one tag directory (zinf refuses differing tags "
                          "whatever checkpoint.tag_validation says); nothing was written",
                          dir, r == 1 ? "c" : "b"))
        << "rank " << r;
  }
  // The refused save wrote nothing: tag "a" and `latest` naming it, which loads a's masters.
  EXPECT_EQ(after_failed, (std::vector<std::string>{".zinf-save.lock", "a", "latest"}));
  EXPECT_EQ(latest_after_failed, "a");
  EXPECT_EQ(loaded[0], trained[0]);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{".zinf-save.lock", "a", "d", "latest"}));
  EXPECT_EQ(engine_test::read_file(dir + "/latest"), "d");
}

// "latest.tmp" is the file a save writes `latest` through: a tag of that name would be a
// directory there, so the save would write the whole tag and then fail. It is refused before
// anything is written, as "latest" is, and the previous checkpoint stays `latest`.
TEST(CheckpointTagCheck, TheTagLatestTmpIsRefusedBeforeAnythingIsWritten) {
  engine_test::ScratchDir tmp("ckpt-tag-latest-tmp");
  const std::string dir = tmp.path() + "/ckpt";
  const engine_test::Model model = engine_test::make_model(DType::kF32, 7);
  const Config config =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, "");
  ASSERT_TRUE(engine_test::train_and_save(config, model, 2, 2, dir, "first").is_ok());
  const Status st = engine_test::train_and_save(config, model, 2, 3, dir, "latest.tmp");
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find(
                "checkpoint tag 'latest.tmp': a tag is 1-200 characters of [A-Za-z0-9._-], does "
                "not start with '.' and is neither 'latest' nor 'latest.tmp' (the file naming the "
                "newest tag, and the one a save writes it through)"),
            std::string::npos)
      << st.to_string();
  EXPECT_EQ(entries(dir), (std::vector<std::string>{".zinf-save.lock", "first", "latest"}));
  EXPECT_EQ(engine_test::read_file(dir + "/latest"), "first");
}

}  // namespace
}  // namespace zinf
