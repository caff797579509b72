// The checkpoint manifest (manifest.json) as load_checkpoint reads it: a manifest edited by hand or
// damaged on disk is refused as corruption naming the key, never read as something it does not
// say. Floats where integers belong were converted (1.5 read as world_size 1; 1e300 converted with
// undefined behaviour), and a rank's file named outside the directory was opened. The parser
// alone (parse_checkpoint_manifest) is also the `checkpoint_manifest` fuzz target's.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// One rank: trains 2 steps and saves to `dir`; then, for each edit of the manifest, writes the
// edited manifest and loads into a fresh engine, returning what the load said.
class ManifestEdits : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch_.path() + "/ckpt";
    const Status saved = with_engine([&](Engine& e) -> Status {
      engine_test::TrainOptions options;
      options.steps = 2;
      ZINF_RETURN_IF_ERROR(engine_test::train_rank(e, model_, 0, options, nullptr, nullptr));
      return e.save_checkpoint(dir_);
    });
    ASSERT_TRUE(saved.is_ok()) << saved.to_string();
    original_ = nlohmann::json::parse(read_all(manifest()));
  }

  std::string manifest() const { return dir_ + "/manifest.json"; }

  Status with_engine(const std::function<Status(Engine&)>& fn) {
    engine_test::Ranks ranks = engine_test::make_ranks(1);
    Env env;
    env.device = ranks.devices[0].get();
    env.comm = ranks.comms[0].get();
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config_, env));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model_));
    ZINF_RETURN_IF_ERROR(engine->finalize());
    return fn(*engine);
  }

  Status load_edited(const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json m = original_;
    edit(m);
    std::ofstream(manifest(), std::ios::trunc) << m.dump(2);
    return with_engine([&](Engine& e) { return e.load_checkpoint(dir_); });
  }

  engine_test::ScratchDir scratch_{"ckpt-manifest"};
  std::string dir_;
  Model model_ = engine_test::make_model(DType::kF32, 4411);
  Config config_ =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, scratch_.path());
  nlohmann::json original_;
};

TEST_F(ManifestEdits, TheSavedManifestLoads) {
  const Status loaded = load_edited([](nlohmann::json&) {});
  EXPECT_TRUE(loaded.is_ok()) << loaded.to_string();
}

TEST_F(ManifestEdits, FloatsWhereIntegersBelongAreCorruptionNamingTheKey) {
  const struct {
    const char* key;
    double value;
  } edits[] = {
      {"world_size", 1.5},  // was read as 1, this engine's world size
      {"stage", 2.25},
      {"stage", 1e300},               // out of int's range: undefined behaviour in a conversion
      {"partition_elements", -1e30},  // likewise for an unsigned count
      {"step", 1e300},
  };
  for (const auto& edit : edits) {
    SCOPED_TRACE(std::string(edit.key) + " = " + std::to_string(edit.value));
    const Status st = load_edited([&](nlohmann::json& m) { m[edit.key] = edit.value; });
    EXPECT_EQ(st.code(), Code::kCorruption) << st.to_string();
    EXPECT_NE(st.message().find(manifest()), std::string::npos) << st.to_string();
    EXPECT_NE(st.message().find(std::string("'") + edit.key + "' is not an integer"),
              std::string::npos)
        << st.to_string();
  }
  const Status bytes = load_edited([](nlohmann::json& m) { m["ranks"][0]["bytes"] = 4096.5; });
  EXPECT_EQ(bytes.code(), Code::kCorruption) << bytes.to_string();
  EXPECT_NE(bytes.message().find("ranks[0]: 'bytes' is not an integer"), std::string::npos)
      << bytes.to_string();
}

TEST_F(ManifestEdits, ARankFileOutsideTheDirectoryIsCorruptionNotOpened) {
  // A copy of the rank file one level up, with the same bytes and checksum: it must not load.
  std::filesystem::copy_file(dir_ + "/rank0.zinfckpt", scratch_.path() + "/rank0.zinfckpt");
  for (const char* file : {"../rank0.zinfckpt", "", "..", "sub/rank0.zinfckpt"}) {
    SCOPED_TRACE(file);
    const Status st = load_edited([&](nlohmann::json& m) { m["ranks"][0]["file"] = file; });
    EXPECT_EQ(st.code(), Code::kCorruption) << st.to_string();
    EXPECT_NE(st.message().find("ranks[0]: 'file' is not a file name in the directory"),
              std::string::npos)
        << st.to_string();
  }
}

TEST_F(ManifestEdits, MissingKeysAndOtherTypesAreCorruptionNamingTheKey) {
  const Status no_step = load_edited([](nlohmann::json& m) { m.erase("step"); });
  EXPECT_EQ(no_step.code(), Code::kCorruption) << no_step.to_string();
  EXPECT_NE(no_step.message().find("no key 'step'"), std::string::npos) << no_step.to_string();
  const Status opt = load_edited([](nlohmann::json& m) { m["optimizer"] = 7; });
  EXPECT_EQ(opt.code(), Code::kCorruption) << opt.to_string();
  EXPECT_NE(opt.message().find("'optimizer' is not a string"), std::string::npos)
      << opt.to_string();
  const Status ranks = load_edited([](nlohmann::json& m) { m["ranks"] = {1, 2}; });
  EXPECT_EQ(ranks.code(), Code::kCorruption) << ranks.to_string();
  EXPECT_NE(ranks.message().find("'ranks' is not an array of world_size (1) entries"),
            std::string::npos)
      << ranks.to_string();
  const Status xxh3 = load_edited([](nlohmann::json& m) { m["ranks"][0].erase("xxh3"); });
  EXPECT_EQ(xxh3.code(), Code::kCorruption) << xxh3.to_string();
  EXPECT_NE(xxh3.message().find("ranks[0] has no key 'xxh3'"), std::string::npos)
      << xxh3.to_string();
  // A version of 2^32 + 1 is not version 1.
  const Status version =
      load_edited([](nlohmann::json& m) { m["version"] = (std::uint64_t{1} << 32) + 1; });
  EXPECT_EQ(version.code(), Code::kCorruption) << version.to_string();
  EXPECT_NE(version.message().find("not a zinf checkpoint of version 1"), std::string::npos)
      << version.to_string();
}

// The parser alone, on the manifest save_checkpoint wrote.
TEST_F(ManifestEdits, TheParserReadsWhatSaveWrote) {
  Result<CheckpointManifest> m = parse_checkpoint_manifest(read_all(manifest()));
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_EQ(m->world_size, 1);
  EXPECT_EQ(m->stage, 2);
  EXPECT_EQ(m->optimizer, original_["optimizer"].get<std::string>());
  EXPECT_EQ(m->fingerprint.size(), 16u);
  EXPECT_EQ(m->step, 2);
  ASSERT_EQ(m->ranks.size(), 1u);
  EXPECT_EQ(m->ranks[0].file, "rank0.zinfckpt");
  EXPECT_EQ(m->ranks[0].bytes, std::filesystem::file_size(dir_ + "/rank0.zinfckpt"));
  EXPECT_EQ(m->ranks[0].xxh3.size(), 16u);
  EXPECT_EQ(m->partition_elements, original_["partition_elements"].get<std::uint64_t>());
}

}  // namespace
}  // namespace zinf
