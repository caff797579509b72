// The config's two NVMe paths spelling one directory two ways ("/nvme" and "/nvme/"): one swap
// space there, as with one spelling.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

TEST(EngineNvmePath, TwoSpellingsOfOneDirectoryGetOneSwapFile) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  engine_test::ScratchDir dir("nvme-spelling");
  Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNvme, dir.path());
  config.zero.offload_param.nvme_path = dir.path() + "/";
  Result<std::unique_ptr<Engine>> engine = engine_test::open_rank(ranks, 0, config);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  const engine_test::Model model = engine_test::make_model(DType::kBF16, 17);
  engine_test::TrainOptions options;
  options.steps = 2;
  options.check_gathered = false;
  ASSERT_TRUE(engine_test::train_rank(**engine, model, 0, options, nullptr, nullptr).is_ok());
  int swap_files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    if (entry.path().filename().string().starts_with("zinf-swap-")) ++swap_files;
  }
  EXPECT_EQ(swap_files, 1);
}

}  // namespace
}  // namespace zinf
