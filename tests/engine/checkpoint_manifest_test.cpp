// The checkpoint manifest (<tag>/manifest.json) as load_checkpoint reads it: a manifest edited by
// hand or damaged on disk is refused as corruption naming the file and the key, never read as
// something it does not say. The manifest carries its own xxh3 (a flipped bit anywhere is caught
// before its fields are read); these tests re-stamp that checksum after each edit, as a hand edit
// that also fixed the checksum would, so that the checks behind it are reached. The parser alone
// (parse_checkpoint_manifest) is also the `checkpoint_manifest` fuzz target's.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
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

// The manifest's text with a correct checksum, laid out as save_checkpoint lays it out.
std::string stamp(nlohmann::json j) {
  j["checksum"] = std::string(16, '0');
  std::string text = j.dump(1) + "\n";
  const std::string key = "\"checksum\": \"";
  const std::size_t at = text.find(key);
  text.replace(at + key.size(), 16, fmt::format("{:016x}", XXH3_64bits(text.data(), text.size())));
  return text;
}

// One rank: trains 2 steps and saves tag "t" under `dir`; each test edits the manifest and parses
// it, or writes it and loads it into a fresh engine.
class ManifestEdits : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch_.path() + "/ckpt";
    const Status saved = with_engine([&](Engine& e) -> Status {
      engine_test::TrainOptions options;
      options.steps = 2;
      ZINF_RETURN_IF_ERROR(engine_test::train_rank(e, model_, 0, options, nullptr, nullptr));
      return e.save_checkpoint(dir_, "t");
    });
    ASSERT_TRUE(saved.is_ok()) << saved.to_string();
    text_ = engine_test::read_file(manifest());
    original_ = nlohmann::json::parse(text_);
  }

  std::string manifest() const { return dir_ + "/t/manifest.json"; }

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

  Status parse_edited(const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json m = original_;
    edit(m);
    return parse_checkpoint_manifest(stamp(m), manifest()).status();
  }

  engine_test::ScratchDir scratch_{"ckpt-manifest"};
  std::string dir_;
  std::string text_;
  Model model_ = engine_test::make_model(DType::kF32, 4411);
  Config config_ =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, scratch_.path());
  nlohmann::json original_;
};

void expect_corruption_naming(const Status& st, const std::string& path, const std::string& what) {
  EXPECT_EQ(st.code(), Code::kCorruption) << st.to_string();
  EXPECT_NE(st.message().find(path), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find(what), std::string::npos) << st.to_string();
}

TEST_F(ManifestEdits, TheParserReadsWhatSaveWroteAndItsStampIsSaves) {
  EXPECT_EQ(stamp(original_), text_);  // the test's re-stamping is save_checkpoint's
  Result<CheckpointManifest> m = parse_checkpoint_manifest(text_, manifest());
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_EQ(m->tag, "t");
  EXPECT_EQ(m->world_size, 1);
  EXPECT_EQ(m->stage, 2);
  EXPECT_EQ(m->resume.step, 2);
  ASSERT_EQ(m->ranks.size(), 1u);
  EXPECT_EQ(m->ranks[0].bytes, std::filesystem::file_size(dir_ + "/t/" + m->ranks[0].file));
  EXPECT_EQ(encode_checkpoint_manifest(*m), text_);
}

TEST_F(ManifestEdits, AnEditWithoutANewChecksumIsCorruptionNamingTheFile) {
  nlohmann::json m = original_;
  m["step"] = 3;
  const std::string edited = m.dump(1) + "\n";  // the old checksum kept
  const Status st = parse_checkpoint_manifest(edited, manifest()).status();
  expect_corruption_naming(st, manifest(), "does not match its checksum");
}

TEST_F(ManifestEdits, FloatsWhereIntegersBelongAreCorruptionNamingTheKey) {
  const struct {
    const char* key;
    double value;
    const char* what;
  } edits[] = {
      {"world_size", 1.5, "'world_size' is not an integer"},
      {"stage", 2.25, "'stage' is not an integer"},
      {"stage", 1e300, "'stage' is not an integer"},
      {"partition_elements", -1e30, "'partition_elements' is not an unsigned integer"},
      {"step", 1e300, "'step' is not an integer"},
  };
  for (const auto& edit : edits) {
    SCOPED_TRACE(std::string(edit.key) + " = " + std::to_string(edit.value));
    const Status st = parse_edited([&](nlohmann::json& m) { m[edit.key] = edit.value; });
    expect_corruption_naming(st, manifest(), edit.what);
  }
  const Status bytes = parse_edited([](nlohmann::json& m) { m["ranks"][0]["bytes"] = 4096.5; });
  expect_corruption_naming(bytes, manifest(), "'bytes' is not an unsigned integer");
}

TEST_F(ManifestEdits, ARankFileOutsideTheDirectoryIsCorruptionNotOpened) {
  // A copy of the rank file one level up, with the same bytes and checksum: it must not load.
  const std::string file = original_["ranks"][0]["file"].get<std::string>();
  std::filesystem::copy_file(dir_ + "/t/" + file, dir_ + "/" + file);
  const std::vector<std::string> names = {"../" + file, "", "..", "sub/" + file};
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const Status st = parse_edited([&](nlohmann::json& m) { m["ranks"][0]["file"] = name; });
    expect_corruption_naming(st, manifest(), "'ranks[].file' is not a plain file name");
    nlohmann::json m = original_;
    m["ranks"][0]["file"] = name;
    std::ofstream(manifest(), std::ios::trunc) << stamp(m);
    const Status loaded = with_engine([&](Engine& e) { return e.load_checkpoint(dir_, "t"); });
    EXPECT_EQ(loaded.code(), Code::kCorruption) << loaded.to_string();
  }
}

// "trainable" is written for a frozen parameter only: absent it reads as true (every manifest
// before the key, and every parameter of this model), false reads back and is written again as it
// was, and a value that is not true or false is corruption naming the key.
TEST_F(ManifestEdits, TrainableIsOptionalAndRoundTrips) {
  EXPECT_EQ(original_["params"][0].count("trainable"), 0u);
  Result<CheckpointManifest> plain = parse_checkpoint_manifest(text_, manifest());
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  for (const ManifestParam& p : plain->params) EXPECT_TRUE(p.trainable) << p.name;
  nlohmann::json edited = original_;
  edited["params"][1]["trainable"] = false;
  const std::string text = stamp(edited);
  Result<CheckpointManifest> frozen = parse_checkpoint_manifest(text, manifest());
  ASSERT_TRUE(frozen.is_ok()) << frozen.status().to_string();
  EXPECT_TRUE(frozen->params[0].trainable);
  EXPECT_FALSE(frozen->params[1].trainable);
  EXPECT_EQ(encode_checkpoint_manifest(*frozen), text);
  expect_corruption_naming(parse_edited([](nlohmann::json& m) { m["params"][0]["trainable"] = 0; }),
                           manifest(), "'trainable' is not true or false");
}

TEST_F(ManifestEdits, MissingKeysAndOtherTypesAreCorruptionNamingTheKey) {
  expect_corruption_naming(parse_edited([](nlohmann::json& m) { m.erase("step"); }), manifest(),
                           "'step' is missing");
  expect_corruption_naming(parse_edited([](nlohmann::json& m) { m["optimizer"] = 7; }), manifest(),
                           "'optimizer' is not a string");
  expect_corruption_naming(parse_edited([](nlohmann::json& m) {
                             m["ranks"] = {1, 2};
                           }),
                           manifest(), "'file' is in something that is not an object");
  expect_corruption_naming(parse_edited([](nlohmann::json& m) { m["ranks"][0].erase("xxh3"); }),
                           manifest(), "'xxh3' is missing");
  // A version of 2^32 + 1 is not this build's version.
  const Status version =
      parse_edited([](nlohmann::json& m) { m["version"] = (std::uint64_t{1} << 32) + 1; });
  expect_corruption_naming(version, manifest(), "'version' is too large");
}

// A manifest of another format version is refused by its number, naming the file, its version and
// those this build reads: version 4 is a later build's, version 1 an older format. Version 3 added
// rank files linked from the swap space, whose manifest entry a version-2 reader would misjudge
// (it ignores "blocks" and calls the file corrupt); a version-2 checkpoint, all copied, still
// loads, with the values it holds.
TEST_F(ManifestEdits, OtherVersionsAreRefusedNamingTheFileAndVersion2StillLoads) {
  EXPECT_EQ(original_["version"], 3);
  for (const int other : {1, 4}) {
    SCOPED_TRACE(other);
    const Status st = parse_edited([&](nlohmann::json& m) { m["version"] = other; });
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find(manifest()), std::string::npos) << st.to_string();
    EXPECT_NE(st.message().find(fmt::format("format version {};", other)), std::string::npos)
        << st.to_string();
    EXPECT_NE(st.message().find("reads versions 2 to 3"), std::string::npos) << st.to_string();
  }
  // The saved masters, then the checkpoint rewritten as version 2 wrote it: the manifest's version
  // and the rank file header's, with the file's checksum in the manifest made again.
  std::vector<std::vector<float>> saved;
  ASSERT_TRUE(with_engine([&](Engine& e) -> Status {
                ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir_, "t"));
                for (const engine_test::ParamDef& d : model_.params) {
                  saved.emplace_back(d.element_count());
                  ZINF_RETURN_IF_ERROR(e.read_parameters(d.name, saved.back().data()));
                }
                return Status::ok();
              }).is_ok());
  const std::string rank_file = dir_ + "/t/" + original_["ranks"][0]["file"].get<std::string>();
  std::string bytes = engine_test::read_file(rank_file);
  ASSERT_EQ(bytes[8], 3);
  bytes[8] = 2;
  std::ofstream(rank_file, std::ios::binary | std::ios::trunc) << bytes;
  nlohmann::json m = original_;
  m["version"] = 2;
  m["ranks"][0]["xxh3"] = fmt::format("{:016x}", XXH3_64bits(bytes.data(), bytes.size()));
  std::ofstream(manifest(), std::ios::trunc) << stamp(m);
  const Status loaded = with_engine([&](Engine& e) -> Status {
    ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir_, "t"));
    for (std::size_t p = 0; p < model_.params.size(); ++p) {
      std::vector<float> values(model_.params[p].element_count());
      ZINF_RETURN_IF_ERROR(e.read_parameters(model_.params[p].name, values.data()));
      if (std::memcmp(values.data(), saved[p].data(), values.size() * sizeof(float)) != 0) {
        return Status::internal(fmt::format("'{}' differs", model_.params[p].name));
      }
    }
    return Status::ok();
  });
  EXPECT_TRUE(loaded.is_ok()) << loaded.to_string();
  // A header whose version is not the manifest's is not this checkpoint's.
  m["version"] = 3;
  std::ofstream(manifest(), std::ios::trunc) << stamp(m);
  const Status mixed = with_engine([&](Engine& e) { return e.load_checkpoint(dir_, "t"); });
  expect_corruption_naming(mixed, rank_file, "its header does not match the manifest");
}

// A checkpoint whose schedule this build refuses (a negative decay_lr_rate, which an earlier build
// took) fails the load of an engine that would take it (one without a schedule of its own), naming
// the manifest and the key, where the engine used to keep its old schedule without a word. An
// engine with a schedule of its own, which replaces the checkpoint's, loads it.
TEST_F(ManifestEdits, ASavedScheduleThisBuildRefusesFailsTheLoadNamingTheKey) {
  nlohmann::json m = original_;
  nlohmann::json& schedule = m["lr_schedule"];
  schedule["type"] = "OneCycle";
  schedule["cycle_min_lr"] = 0.001;
  schedule["cycle_max_lr"] = 0.01;
  schedule["cycle_first_step_size"] = 4;
  schedule["decay_step_size"] = 2;
  schedule["decay_lr_rate"] = -0.5;
  std::ofstream(manifest(), std::ios::trunc) << stamp(m);
  const Status refused = with_engine([&](Engine& e) { return e.load_checkpoint(dir_, "t"); });
  EXPECT_EQ(refused.code(), Code::kInvalidArgument) << refused.to_string();
  for (const std::string& part :
       {manifest(), std::string("'lr_schedule' (OneCycle)"), std::string("decay_lr_rate")}) {
    EXPECT_NE(refused.message().find(part), std::string::npos)
        << part << ": " << refused.to_string();
  }
  // The same checkpoint with a valid rate loads, so the rate is what was refused.
  schedule["decay_lr_rate"] = 0.5;
  std::ofstream(manifest(), std::ios::trunc) << stamp(m);
  const Status valid = with_engine([&](Engine& e) { return e.load_checkpoint(dir_, "t"); });
  EXPECT_TRUE(valid.is_ok()) << valid.to_string();

  schedule["decay_lr_rate"] = -0.5;
  std::ofstream(manifest(), std::ios::trunc) << stamp(m);
  ScheduleConfig warmup;
  warmup.kind = ScheduleKind::kWarmupLR;
  warmup.warmup_num_steps = 3;
  const Status own = with_engine([&](Engine& e) -> Status {
    ZINF_RETURN_IF_ERROR(e.set_lr_schedule(warmup));
    return e.load_checkpoint(dir_, "t");
  });
  EXPECT_TRUE(own.is_ok()) << own.to_string();
}

}  // namespace
}  // namespace zinf
