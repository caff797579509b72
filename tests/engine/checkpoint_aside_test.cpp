// `zinf ckpt inspect` and `export` of a tag that a replacing save moved to .<tag>.old and did not
// rename back (a filesystem without RENAME_EXCHANGE, the save cut short between its two renames):
// a load reads the tag there (moved_aside_tag_dir), so inspect verifies it there and reports a
// flipped byte as a problem, and export writes its tensors. Before, inspect listed no tag and
// reported a clean directory, and export failed with kNotFound.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"
#include "plan/cli_test_util.hpp"
#include "safetensors_test_util.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

using engine_test::Model;

// Two ranks (stage 3) train 3 steps and save tag "t" into `dir`, which `latest` names; then the
// tag is moved to .t.old as the first of a replacing save's two renames leaves it. Returns every
// parameter's master as the saving engine reads it back, by name.
std::map<std::string, std::vector<float>> save_and_move_aside(const std::string& dir) {
  const Model model = engine_test::make_model(DType::kF32, 41);
  const Config config =
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, "");
  std::map<std::string, std::vector<float>> out;
  std::vector<Status> st =
      engine_test::with_engines(config, model, 2, [&](int rank, Engine& e) -> Status {
        engine_test::TrainOptions options;
        options.steps = 3;
        options.check_gathered = false;
        ZINF_RETURN_IF_ERROR(engine_test::train_rank(e, model, rank, options, nullptr, nullptr));
        ZINF_RETURN_IF_ERROR(e.save_checkpoint(dir, "t"));
        for (const engine_test::ParamDef& d : model.params) {
          std::vector<float> values(d.element_count());
          ZINF_RETURN_IF_ERROR(e.read_parameters(d.name, values.data()));
          if (rank == 0) out[d.name] = std::move(values);
        }
        return Status::ok();
      });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  std::filesystem::rename(dir + "/t", dir + "/.t.old");
  return out;
}

TEST(CheckpointAside, InspectVerifiesTheMovedAsideTag) {
  engine_test::ScratchDir scratch("ckpt-aside-inspect");
  const std::string dir = scratch.path() + "/ckpt";
  save_and_move_aside(dir);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string aside = dir + "/.t.old";
  Result<nlohmann::json> info = inspect_checkpoints(dir, true);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_EQ((*info)["latest"], "t");
  ASSERT_EQ((*info)["tags"].size(), 1u) << info->dump();
  const nlohmann::json& t = (*info)["tags"][0];
  EXPECT_EQ(t["tag"], "t");
  EXPECT_EQ(t["dir"], aside);
  EXPECT_EQ(t["step"], 3);
  EXPECT_EQ(t["world_size"], 2);
  EXPECT_EQ(t["checksums"], "ok");
  EXPECT_GT(t["disk_bytes"].get<std::uint64_t>(), 0u);
  EXPECT_TRUE((*info)["problems"].empty()) << (*info)["problems"].dump();
  ASSERT_EQ((*info)["notes"].size(), 1u) << (*info)["notes"].dump();
  EXPECT_NE((*info)["notes"][0].get<std::string>().find("moved aside"), std::string::npos);

  // One flipped bit in a rank file there: the check fails, naming the file, and is a problem.
  const std::string victim = aside + "/rank1.zinfckpt";
  ASSERT_TRUE(engine_test::flip_bits(victim, kCheckpointHeaderBytes + 20, 0x01));
  info = inspect_checkpoints(dir, true);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  ASSERT_EQ((*info)["tags"].size(), 1u);
  const std::string checksums = (*info)["tags"][0]["checksums"];
  EXPECT_NE(checksums.find(victim), std::string::npos) << checksums;
  ASSERT_EQ((*info)["problems"].size(), 1u) << (*info)["problems"].dump();
  EXPECT_EQ((*info)["problems"][0], "tag t: " + checksums);
  if (const std::string zinf = plan::zinf_binary(); zinf.empty()) {
    std::printf("bin/zinf is not built (target zinf_cli): its exit code is not checked\n");
  } else {
    std::string out;
    EXPECT_EQ(plan::run_command(zinf + " ckpt inspect " + dir + " 2>&1", &out), 1) << out;
    EXPECT_NE(out.find("t (.t.old)"), std::string::npos) << out;
    EXPECT_NE(out.find("problem: tag t: '" + victim), std::string::npos) << out;
  }
}

TEST(CheckpointAside, ExportReadsTheMovedAsideTag) {
  engine_test::ScratchDir scratch("ckpt-aside-export");
  const std::string dir = scratch.path() + "/ckpt";
  const std::map<std::string, std::vector<float>> masters = save_and_move_aside(dir);
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (const std::string tag : {"", "t"}) {  // the one `latest` names, and by name
    SCOPED_TRACE("tag '" + tag + "'");
    const std::string path = scratch.path() + "/model.safetensors";
    const Status st = export_checkpoint_safetensors(dir, tag, path, DType::kF32);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    engine_test::SafetensorsFile exported;
    ASSERT_NO_FATAL_FAILURE(engine_test::read_safetensors(path, exported));
    EXPECT_EQ(exported.header["__metadata__"]["zinf_tag"], "t");
    EXPECT_EQ(exported.header["__metadata__"]["zinf_step"], "3");
    for (const auto& [name, want] : masters) {
      std::vector<float> got;
      ASSERT_NO_FATAL_FAILURE(engine_test::read_f32_tensor(exported, name, want.size(), got));
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << name;
    }
  }
}

}  // namespace
}  // namespace zinf
