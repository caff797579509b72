// Saving a tag that exists already replaces it, as DeepSpeed's save_checkpoint writes over it (a
// fixed tag such as "last", or a job run again into its output directory). What a user checks:
// after two saves of one tag, a fresh engine loads the second save's state (the masters equal a
// double-checked single-process reference trained to the second save's step, not the first's),
// at world 1 and 2, with the optimizer state in host memory and on NVMe (the rank file the swap
// file itself, hard-linked), and the engine that saved trains on as the uninterrupted run. And
// that a crash at each point of the replacement leaves a complete checkpoint of the tag: a child
// process saving the tag again ends itself (_exit) at each named point of rank 0's commit
// (CheckpointSaveSeams), with the exchange of the two directories and with the two renames of a
// filesystem without one; a fresh engine then loads the old state or the new, whole, and the
// next save of the tag succeeds and leaves nothing behind.
#include <errno.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/child_process.hpp"
#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::page_model;
using engine_test::TrainOptions;
using engine_test::with_engines;
using Masters = std::vector<std::vector<float>>;

Config config_for(bool nvme, const std::string& scratch) {
  Config c = engine_test::small_config(2, nvme ? OffloadDevice::kNvme : OffloadDevice::kHost,
                                       OffloadDevice::kNone, nvme ? scratch : "");
  c.zero.sub_group_size = 1024;
  return c;
}

Status replace_train(Engine& engine, const Model& model, int rank, int first_step, int last_step) {
  TrainOptions options;
  options.first_step = first_step;
  options.steps = last_step;
  return engine_test::train_rank(engine, model, rank, options, nullptr, nullptr);
}

// The reference's masters after `steps` steps from the model's initial values.
Masters reference(const Config& config, const Model& model, int world, int steps) {
  TrainOptions options;
  options.steps = steps;
  return engine_test::run_reference(config, model, world, options).master;
}

// Fresh engines of `world` ranks load `tag` ("" for `latest`) from `dir`; rank 0's masters.
Result<Masters> load_masters(const Config& config, const Model& model, int world,
                             const std::string& dir, const std::string& tag) {
  Masters out;
  for (const Status& st : with_engines(config, model, world, [&](int rank, Engine&e) -> Status {
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, tag));
         Result<Masters> m = engine_test::read_masters(e, model);
         ZINF_RETURN_IF_ERROR(m.status());
         if (rank == 0) out = std::move(*m);
         return Status::ok();
       })) {
    if (!st.is_ok()) return st;
  }
  return out;
}

// What a save leaves in `dir` besides tags and `latest`: the save lock only.
std::vector<std::string> leftovers(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name[0] == '.' && name != kCheckpointSaveLock) out.push_back(name);
  }
  return out;
}

struct ReplaceCase {
  int world;
  bool nvme;
  bool exchange;
};

std::string replace_case_name(const ::testing::TestParamInfo<ReplaceCase>& info) {
  return fmt::format("World{}{}{}", info.param.world, info.param.nvme ? "Nvme" : "Host",
                     info.param.exchange ? "Exchange" : "TwoRenames");
}

class CheckpointReplace : public ::testing::TestWithParam<ReplaceCase> {
 protected:
  void SetUp() override {
    CheckpointSaveSeams seams;
    seams.exchange = GetParam().exchange;
    set_checkpoint_save_seams(seams);
  }
  void TearDown() override { set_checkpoint_save_seams({}); }
};

// Steps 1-2, save "last"; steps 3-4, save "last" again, twice; step 5 in the same engine. The tag
// holds step 4's state; the engine's step 5 is the uninterrupted run's, so replacing the tag (whose
// old rank file, on NVMe, was the swap file's frozen generation the engine still reads) took
// nothing from the engine. Then a fresh engine loads "last" (on NVMe taking the linked file in
// place as its state's home), saves "last" once more without a step between (the file it reads from
// is the one being replaced), and trains step 5: the uninterrupted run's again.
TEST_P(CheckpointReplace, SavingATagAgainLeavesTheSecondSavesState) {
  const ReplaceCase c = GetParam();
  engine_test::ScratchDir scratch(
      fmt::format("ckpt-replace-{}-{}-{}", c.world, c.nvme, c.exchange));
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = page_model(41);
  const Config config = config_for(c.nvme, scratch.path());
  const Masters at2 = reference(config, model, c.world, 2);
  const Masters at4 = reference(config, model, c.world, 4);
  const Masters at5 = reference(config, model, c.world, 5);
  ASSERT_GT(engine_test::worst_rel_diff(at4, at2), 1e-3) << "steps 3-4 must move the masters";

  Masters trained5;
  for (const Status& st : with_engines(config, model, c.world, [&](int rank, Engine&e) -> Status {
         ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 1, 2));
         ZINF_RETURN_IF_ERROR(e.save_checkpoint(dir, "last"));
         ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 3, 4));
         ZINF_RETURN_IF_ERROR(e.save_checkpoint(dir, "last"));
         const std::string path = dir + "/last/manifest.json";
         Result<CheckpointManifest> saved =
             parse_checkpoint_manifest(engine_test::read_file(path), path);
         ZINF_RETURN_IF_ERROR(saved.status());
         if (c.nvme && saved->ranks.at(static_cast<std::size_t>(rank)).blocks.empty()) {
           return Status::internal("the second save copied; it should link the swap file");
         }
         // Once more with no step between (as the Trainer's two calls): on NVMe the tag's
         // linked file is the swap file's frozen generation, which the engine still reads.
         ZINF_RETURN_IF_ERROR(e.save_checkpoint(dir, "last"));
         ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 5, 5));
         Result<Masters> m = engine_test::read_masters(e, model);
         ZINF_RETURN_IF_ERROR(m.status());
         if (rank == 0) trained5 = std::move(*m);
         return Status::ok();
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  EXPECT_LE(engine_test::worst_rel_diff(trained5, at5), 1e-6);
  EXPECT_EQ(engine_test::read_file(dir + "/latest"), "last");
  EXPECT_TRUE(leftovers(dir).empty()) << fmt::format("{}", fmt::join(leftovers(dir), " "));
  {
    const std::string path = dir + "/last/manifest.json";
    Result<CheckpointManifest> m = parse_checkpoint_manifest(engine_test::read_file(path), path);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    EXPECT_EQ(m->resume.step, 4);
    // The last save copied the state (the swap file was frozen by the save before it).
    if (c.nvme) {
      EXPECT_TRUE(m->ranks.at(0).blocks.empty());
    }
  }
  for (const std::string tag : {"", "last"}) {
    Result<Masters> loaded = load_masters(config, model, c.world, dir, tag);
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    EXPECT_LE(engine_test::worst_rel_diff(*loaded, at4), 1e-6) << "tag '" << tag << "'";
  }

  Masters again5;
  for (const Status& st : with_engines(config, model, c.world, [&](int rank, Engine&e) -> Status {
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "last"));
         ZINF_RETURN_IF_ERROR(e.save_checkpoint(dir, "last"));
         ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 5, 5));
         Result<Masters> m = engine_test::read_masters(e, model);
         ZINF_RETURN_IF_ERROR(m.status());
         if (rank == 0) again5 = std::move(*m);
         return Status::ok();
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  EXPECT_LE(engine_test::worst_rel_diff(again5, at5), 1e-6);
  Result<Masters> loaded = load_masters(config, model, c.world, dir, "last");
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_LE(engine_test::worst_rel_diff(*loaded, at4), 1e-6);
  EXPECT_TRUE(leftovers(dir).empty()) << fmt::format("{}", fmt::join(leftovers(dir), " "));
  Result<nlohmann::json> info = inspect_checkpoints(dir, true);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_TRUE((*info)["problems"].empty()) << info->dump();
}

INSTANTIATE_TEST_SUITE_P(Cases, CheckpointReplace,
                         ::testing::Values(ReplaceCase{1, false, true}, ReplaceCase{2, false, true},
                                           ReplaceCase{1, true, true}, ReplaceCase{2, true, true},
                                           ReplaceCase{1, false, false},
                                           ReplaceCase{2, true, false}),
                         replace_case_name);

struct CrashCase {
  bool exchange;
  bool nvme;
  std::string point;
  bool new_state;  // whether the tag holds the new save's state after a crash there
};

// The crash: the child loads "last" (step 2), trains steps 3-4 and saves "last" again, ending
// itself at `point`. Then: `latest` and the tag load whole, the old state or the new one as the
// point says, also after a save of another tag; the next save of the tag (step 5) succeeds,
// leaves nothing behind, and loads.
TEST(CheckpointReplaceCrash, ACrashAtEachPointLeavesTheOldTagOrTheNewWhole) {
  std::vector<CrashCase> cases;
  for (bool nvme : {false, true}) {
    for (const auto& [point, fresh] : std::vector<std::pair<std::string, bool>>{
             {"written", false}, {"exchanged", true}, {"committed", true}, {"latest", true}}) {
      cases.push_back({true, nvme, point, fresh});
    }
    for (const auto& [point, fresh] :
         std::vector<std::pair<std::string, bool>>{{"written", false},
                                                   {"moved-aside", false},
                                                   {"renamed", true},
                                                   {"committed", true},
                                                   {"latest", true}}) {
      cases.push_back({false, nvme, point, fresh});
    }
  }
  constexpr int kWorld = 2;
  const Model model = page_model(43);
  for (const CrashCase& c : cases) {
    SCOPED_TRACE(fmt::format("{} {} crash at '{}'", c.exchange ? "exchange" : "two renames",
                             c.nvme ? "nvme" : "host", c.point));
    engine_test::ScratchDir scratch(
        fmt::format("ckpt-replace-crash-{}-{}-{}", c.exchange, c.nvme, c.point));
    const std::string dir = scratch.path() + "/ckpt";
    const Config config = config_for(c.nvme, scratch.path());
    const Masters at2 = reference(config, model, kWorld, 2);
    const Masters at4 = reference(config, model, kWorld, 4);
    const Masters at5 = reference(config, model, kWorld, 5);
    for (const Status& st : with_engines(config, model, kWorld, [&](int rank, Engine&e) {
           ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 1, 2));
           return e.save_checkpoint(dir, "last");
         })) {
      ASSERT_TRUE(st.is_ok()) << st.to_string();
    }
    const test::ChildEnd child = test::in_child([&](int) {
      CheckpointSaveSeams seams;
      seams.exchange = c.exchange;
      seams.at = [&](std::string_view point) {
        if (point == c.point) ::_exit(0);
      };
      set_checkpoint_save_seams(seams);
      for (const Status& st : with_engines(config, model, kWorld, [&](int rank, Engine&e) {
             ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "last"));
             ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 3, 4));
             return e.save_checkpoint(dir, "last");
           })) {
        if (!st.is_ok()) {
          std::fprintf(stderr, "child: %s\n", st.to_string().c_str());
          return 2;
        }
      }
      return 3;  // the save never reached the point
    });
    ASSERT_EQ(child.exit_code(), 0);

    const Masters& want = c.new_state ? at4 : at2;
    // inspect finds no problem: what is left is a complete tag, a save's temporary, or the tag
    // moved aside, which it names.
    Result<nlohmann::json> crashed = inspect_checkpoints(dir, true);
    ASSERT_TRUE(crashed.is_ok()) << crashed.status().to_string();
    EXPECT_TRUE((*crashed)["problems"].empty()) << crashed->dump();
    if (c.point == "moved-aside") {
      EXPECT_NE((*crashed)["notes"].dump().find("tag 'last', complete, moved aside by a save"),
                std::string::npos)
          << crashed->dump();
    }
    for (const std::string tag : {"", "last"}) {
      Result<Masters> loaded = load_masters(config, model, kWorld, dir, tag);
      ASSERT_TRUE(loaded.is_ok()) << "tag '" << tag << "': " << loaded.status().to_string();
      EXPECT_LE(engine_test::worst_rel_diff(*loaded, want), 1e-6) << "tag '" << tag << "'";
    }
    // The next run saves another tag first: the crashed save's tag keeps its state (a save
    // removes what crashed saves left, and gives a tag moved aside its name back first).
    for (const Status& st : with_engines(config, model, kWorld, [&](int rank, Engine&e) {
           ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "last"));
           ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, c.new_state ? 5 : 3, 5));
           return e.save_checkpoint(dir, "next");
         })) {
      ASSERT_TRUE(st.is_ok()) << st.to_string();
    }
    Result<Masters> kept = load_masters(config, model, kWorld, dir, "last");
    ASSERT_TRUE(kept.is_ok()) << kept.status().to_string();
    EXPECT_LE(engine_test::worst_rel_diff(*kept, want), 1e-6);
    // Then the tag itself, from step 5.
    for (const Status& st : with_engines(config, model, kWorld, [&](int, Engine& e) {
           ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "next"));
           return e.save_checkpoint(dir, "last");
         })) {
      ASSERT_TRUE(st.is_ok()) << st.to_string();
    }
    EXPECT_TRUE(leftovers(dir).empty()) << fmt::format("{}", fmt::join(leftovers(dir), " "));
    EXPECT_EQ(engine_test::read_file(dir + "/latest"), "last");
    Result<Masters> loaded = load_masters(config, model, kWorld, dir, "");
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    EXPECT_LE(engine_test::worst_rel_diff(*loaded, at5), 1e-6);
    Result<nlohmann::json> info = inspect_checkpoints(dir, true);
    ASSERT_TRUE(info.is_ok()) << info.status().to_string();
    EXPECT_TRUE((*info)["problems"].empty()) << info->dump();
    EXPECT_TRUE((*info)["notes"].empty()) << info->dump();
  }
}

// A tag a replacing save moved aside (.<tag>.old complete, no <tag>: a crash between the two
// renames) whose rename back fails (no space, no permission: the seam) is the tag's only copy:
// the save of another tag succeeds and leaves it, the tag still loads, and a later save whose
// rename back succeeds gives it its name again.
TEST(CheckpointReplaceRestore, AMovedAsideTagThatCannotBeRenamedBackIsKept) {
  engine_test::ScratchDir scratch("ckpt-replace-restore-fails");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = page_model(53);
  const Config config = config_for(false, scratch.path());
  const Masters at2 = reference(config, model, 1, 2);
  for (const Status& st : with_engines(config, model, 1, [&](int rank, Engine&e) {
         ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 1, 2));
         return e.save_checkpoint(dir, "last");
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  std::filesystem::rename(dir + "/last", dir + "/.last.old");
  CheckpointSaveSeams seams;
  seams.restore_error = ENOSPC;
  set_checkpoint_save_seams(seams);
  Status saved = Status::ok();
  for (const Status& st : with_engines(config, model, 1, [&](int rank, Engine&e) {
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "last"));
         ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 3, 3));
         return e.save_checkpoint(dir, "next");
       })) {
    if (!st.is_ok()) saved = st;
  }
  set_checkpoint_save_seams({});
  ASSERT_TRUE(saved.is_ok()) << saved.to_string();
  EXPECT_TRUE(std::filesystem::exists(dir + "/.last.old/" + std::string(kCheckpointManifest)));
  Result<Masters> kept = load_masters(config, model, 1, dir, "last");
  ASSERT_TRUE(kept.is_ok()) << kept.status().to_string();
  EXPECT_LE(engine_test::worst_rel_diff(*kept, at2), 1e-6);
  // The rename back succeeds now: the tag has its name again, and nothing is left over.
  for (const Status& st : with_engines(config, model, 1, [&](int, Engine& e) {
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "next"));
         return e.save_checkpoint(dir, "next");
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  EXPECT_TRUE(leftovers(dir).empty()) << fmt::format("{}", fmt::join(leftovers(dir), " "));
  Result<Masters> restored = load_masters(config, model, 1, dir, "last");
  ASSERT_TRUE(restored.is_ok()) << restored.status().to_string();
  EXPECT_LE(engine_test::worst_rel_diff(*restored, at2), 1e-6);
}

// A crash while keep_last removes a tag (renamed aside, its manifest not yet removed) leaves no
// tag of that name: a load of it fails, inspect notes a pruning cut short (not a replacement to
// be renamed back), and the next save removes it without bringing it back.
TEST(CheckpointPruneCrash, ATagCutShortInItsPruningStaysPruned) {
  engine_test::ScratchDir scratch("ckpt-prune-crash");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = page_model(59);
  Config config = config_for(false, scratch.path());
  config.keep_last = 1;
  for (const Status& st : with_engines(config, model, 1, [&](int rank, Engine&e) {
         ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 1, 1));
         return e.save_checkpoint(dir, "a");
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  const test::ChildEnd child = test::in_child([&](int) {
    CheckpointSaveSeams seams;
    seams.at = [](std::string_view point) {
      if (point == "pruning") ::_exit(0);
    };
    set_checkpoint_save_seams(seams);
    for (const Status& st : with_engines(config, model, 1, [&](int rank, Engine&e) {
           ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "a"));
           ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 2, 2));
           return e.save_checkpoint(dir, "b");
         })) {
      if (!st.is_ok()) return 2;
    }
    return 3;  // the save never pruned
  });
  ASSERT_EQ(child.exit_code(), 0);
  EXPECT_FALSE(load_masters(config, model, 1, dir, "a").is_ok());
  Result<nlohmann::json> crashed = inspect_checkpoints(dir, true);
  ASSERT_TRUE(crashed.is_ok()) << crashed.status().to_string();
  EXPECT_TRUE((*crashed)["problems"].empty()) << crashed->dump();
  EXPECT_NE((*crashed)["notes"].dump().find("a tag keep_last was pruning"), std::string::npos)
      << crashed->dump();
  EXPECT_EQ((*crashed)["notes"].dump().find("moved aside"), std::string::npos) << crashed->dump();
  const Masters at3 = reference(config, model, 1, 3);
  for (const Status& st : with_engines(config, model, 1, [&](int rank, Engine&e) {
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, ""));
         ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 3, 3));
         return e.save_checkpoint(dir, "c");
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  EXPECT_TRUE(leftovers(dir).empty()) << fmt::format("{}", fmt::join(leftovers(dir), " "));
  EXPECT_FALSE(std::filesystem::exists(dir + "/a"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/b"));
  Result<Masters> loaded = load_masters(config, model, 1, dir, "");
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_LE(engine_test::worst_rel_diff(*loaded, at3), 1e-6);
}

// A directory of the tag's name that is not a checkpoint (neither a manifest nor rank files) is
// the program's: the save refuses it and leaves it as it was.
TEST(CheckpointReplaceRefused, ADirectoryThatIsNotACheckpointIsLeftAlone) {
  engine_test::ScratchDir scratch("ckpt-replace-not-ours");
  const std::string dir = scratch.path() + "/ckpt";
  std::filesystem::create_directories(dir + "/last");
  std::ofstream(dir + "/last/notes.txt") << "the program's";
  const Model model = page_model(47);
  const Config config = config_for(false, scratch.path());
  for (const Status& st : with_engines(config, model, 1, [&](int rank, Engine&e) {
         ZINF_RETURN_IF_ERROR(replace_train(e, model, rank, 1, 1));
         return e.save_checkpoint(dir, "last");
       })) {
    EXPECT_EQ(st.code(), Code::kFailedPrecondition) << st.to_string();
    EXPECT_NE(st.message().find("'" + dir + "/last' exists and is not a checkpoint directory"),
              std::string::npos)
        << st.to_string();
  }
  EXPECT_EQ(engine_test::read_file(dir + "/last/notes.txt"), "the program's");
  EXPECT_TRUE(leftovers(dir).empty()) << fmt::format("{}", fmt::join(leftovers(dir), " "));
}

}  // namespace
}  // namespace zinf
