// A checkpoint saved by more ranks than a checkpoint's I/O engine has file slots (64): 65 ranks
// (LocalComm threads) train a small stage-3 model and save, and a load at world 1 (which reads
// every saved rank's file), `zinf ckpt export` and `zinf ckpt inspect` all read it. What a user
// checks: the loaded masters and the exported tensors are the saved engine's read_parameters()
// to the bit, inspect finds every checksum ok, and a flipped byte in the 65th file is still
// found. Before, each of them kept a reader open for every saved rank and failed with
// "all 64 file slots are in use".
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"
#include "safetensors_test_util.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

using engine_test::Model;

constexpr int kSavedWorld = 65;

Config wide_config() {
  Config c = engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, "");
  c.collective_timeout_ms = 120'000;  // 65 ranks on a few cores
  return c;
}

// Two modules whose weights span every one of the 65 saved ranks: a group's shard is a
// multiple of 128 elements, so a group of 8256 elements has 128 on each of ranks 0-63 and 64 on
// rank 64 (a smaller model leaves the last ranks only padding, and a load reads fewer files).
Model wide_model() {
  Model m;
  m.modules = {"embed", "head"};
  m.params = {
      {"embed.w", "embed", {86, 96}, DType::kF32},
      {"head.w", "head", {96, 86}, DType::kF32},
      {"head.b", "head", {86}, DType::kF32},
  };
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    m.initial.push_back(engine_test::seeded(m.params[p].element_count(), 6500 + p, -1.0f, 1.0f));
  }
  return m;
}

// The saved ranks whose files hold some parameter's elements (not padding alone).
std::set<std::uint64_t> ranks_with_data(const CheckpointManifest& m) {
  std::set<std::uint64_t> out;
  for (const ManifestParam& p : m.params) {
    std::uint64_t elements = 1;
    for (std::int64_t d : p.shape) elements *= static_cast<std::uint64_t>(d);
    const std::uint64_t shard = m.groups[p.group].shard_elements;
    for (std::uint64_t r = p.group_offset / shard; r <= (p.group_offset + elements - 1) / shard;
         ++r) {
      out.insert(r);
    }
  }
  return out;
}

// Saved once for the suite: tag "t" of kSavedWorld ranks after 2 steps, and every parameter's
// master as the saving engine reads it back, by name.
class CheckpointWide : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new engine_test::ScratchDir("ckpt-wide");
    model_ = new Model(wide_model());
    masters_ = new std::map<std::string, std::vector<float>>();
    engine_test::Ranks ranks = engine_test::make_ranks(kSavedWorld, std::chrono::seconds(120));
    std::vector<Status> st = engine_test::run_ranks(kSavedWorld, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(auto e,
                            engine_test::open_finalized(ranks, rank, wide_config(), *model_));
      engine_test::TrainOptions options;
      options.steps = 2;
      options.check_gathered = false;
      ZINF_RETURN_IF_ERROR(engine_test::train_rank(*e, *model_, rank, options, nullptr, nullptr));
      ZINF_RETURN_IF_ERROR(e->save_checkpoint(dir(), "t"));
      for (const engine_test::ParamDef& d : model_->params) {
        std::vector<float> values(d.element_count());
        ZINF_RETURN_IF_ERROR(e->read_parameters(d.name, values.data()));
        if (rank == 0) (*masters_)[d.name] = std::move(values);
      }
      return Status::ok();
    });
    for (std::size_t r = 0; r < st.size(); ++r) {
      if (!st[r].is_ok())
        save_error_ = new std::string(fmt::format("rank {}: {}", r, st[r].to_string()));
    }
  }
  static void TearDownTestSuite() {
    delete masters_;
    delete model_;
    delete scratch_;
    delete save_error_;
    save_error_ = nullptr;
  }
  void SetUp() override {
    if (save_error_ != nullptr) GTEST_FAIL() << "the save failed: " << *save_error_;
  }
  static std::string dir() { return scratch_->path() + "/ckpt"; }

  static engine_test::ScratchDir* scratch_;
  static Model* model_;
  static std::map<std::string, std::vector<float>>* masters_;
  static std::string* save_error_;
};

engine_test::ScratchDir* CheckpointWide::scratch_ = nullptr;
Model* CheckpointWide::model_ = nullptr;
std::map<std::string, std::vector<float>>* CheckpointWide::masters_ = nullptr;
std::string* CheckpointWide::save_error_ = nullptr;

void expect_bits_equal(const std::vector<float>& got, const std::vector<float>& want,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << what;
}

TEST_F(CheckpointWide, LoadsIntoOneRank) {
  CheckpointManifest m;
  {
    const std::string text = engine_test::read_file(dir() + "/t/manifest.json");
    Result<CheckpointManifest> parsed = parse_checkpoint_manifest(text, "manifest.json");
    ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
    m = *parsed;
  }
  ASSERT_EQ(m.world_size, kSavedWorld);
  ASSERT_EQ(ranks_with_data(m).size(), static_cast<std::size_t>(kSavedWorld))
      << "the model must put data in every saved rank's file";
  // At world 1 the single rank's partition holds every element: every saved file is read.
  std::vector<Status> st =
      engine_test::with_engines(wide_config(), *model_, 1, [&](int, Engine& e) -> Status {
        ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir(), "t"));
        EXPECT_EQ(e.applied_steps(), 2);
        for (const engine_test::ParamDef& d : model_->params) {
          std::vector<float> values(d.element_count());
          ZINF_RETURN_IF_ERROR(e.read_parameters(d.name, values.data()));
          expect_bits_equal(values, masters_->at(d.name), d.name);
        }
        return Status::ok();
      });
  ASSERT_EQ(st.size(), 1u);
  EXPECT_TRUE(st[0].is_ok()) << st[0].to_string();
}

TEST_F(CheckpointWide, ExportsEveryTensor) {
  const std::string path = scratch_->path() + "/wide.safetensors";
  const Status st = export_checkpoint_safetensors(dir(), "", path, DType::kF32);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  engine_test::SafetensorsFile exported;
  ASSERT_NO_FATAL_FAILURE(engine_test::read_safetensors(path, exported));
  for (const auto& [name, want] : *masters_) {
    std::vector<float> got;
    ASSERT_NO_FATAL_FAILURE(engine_test::read_f32_tensor(exported, name, want.size(), got));
    expect_bits_equal(got, want, name);
  }
}

TEST_F(CheckpointWide, InspectVerifiesEveryFile) {
  Result<nlohmann::json> info = inspect_checkpoints(dir(), true);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  ASSERT_EQ((*info)["tags"].size(), 1u);
  EXPECT_EQ((*info)["tags"][0]["world_size"], kSavedWorld);
  EXPECT_EQ((*info)["tags"][0]["checksums"], "ok");
  EXPECT_TRUE((*info)["problems"].empty()) << (*info)["problems"].dump();
  // The last file, read after more than kCheckpointOpenReaderCount others, is checked too. A copy
  // of the tag keeps the suite's checkpoint intact for the other tests.
  const std::string copy = scratch_->path() + "/flipped";
  std::filesystem::create_directories(copy);
  std::filesystem::copy(dir() + "/t", copy + "/t", std::filesystem::copy_options::recursive);
  std::filesystem::copy(dir() + "/latest", copy + "/latest");
  const std::string victim = fmt::format("{}/t/rank{}.zinfckpt", copy, kSavedWorld - 1);
  ASSERT_TRUE(engine_test::flip_bits(victim, kCheckpointHeaderBytes + 12, 0x10));
  info = inspect_checkpoints(copy, true);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  const std::string checksums = (*info)["tags"][0]["checksums"];
  EXPECT_NE(checksums.find(victim), std::string::npos) << checksums;
  EXPECT_EQ((*info)["problems"].size(), 1u) << (*info)["problems"].dump();
  // And export refuses it, naming the file.
  const Status st =
      export_checkpoint_safetensors(copy, "t", copy + "/out.safetensors", DType::kF32);
  EXPECT_EQ(st.code(), Code::kCorruption) << st.to_string();
  EXPECT_NE(st.message().find(victim), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace zinf
