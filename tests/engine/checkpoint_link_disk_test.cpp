// What a checkpoint saved by link (the NVMe swap file hard-linked as the rank file) takes on the
// disk: the swap file is preallocated, and the link pins all of it, so its size is what a user
// pays per tag. With one swap directory it is the state (the layout the manifest counts) and at
// most one aio block of rounding; before, each extent reserved an aio block of slack (sub-groups
// of 1024 parameters: megabytes of slack for kilobytes of state, 3 GiB per tag for 12 MiB in
// `train_lm --params 1M --sub-group-size 1024`).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"

namespace zinf {
namespace {

TEST(CheckpointLinkDisk, LinkedRankFileTakesTheStateAndAtMostABlock) {
  engine_test::ScratchDir scratch("ckpt-link-disk");
  const std::string dir = scratch.path() + "/ckpt";
  const engine_test::Model model = engine_test::page_model(53);
  Config config =
      engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, scratch.path());
  config.zero.sub_group_size = 1024;              // 10 sub-groups of 3 pieces each
  config.aio_block_bytes = std::size_t{1} << 20;  // the default
  std::vector<Status> st =
      engine_test::with_engines(config, model, 1, [&](int rank, Engine& e) -> Status {
        engine_test::TrainOptions options;
        options.steps = 2;
        options.check_gathered = false;
        ZINF_RETURN_IF_ERROR(engine_test::train_rank(e, model, rank, options, nullptr, nullptr));
        return e.save_checkpoint(dir, "t");
      });
  ASSERT_EQ(st.size(), 1u);
  ASSERT_TRUE(st[0].is_ok()) << st[0].to_string();
  const std::string text = engine_test::read_file(dir + "/t/manifest.json");
  Result<CheckpointManifest> m = parse_checkpoint_manifest(text, "manifest.json");
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  const ManifestFile& f = m->ranks.at(0);
  ASSERT_FALSE(f.blocks.empty()) << "the rank file was copied, not linked";
  const std::string file = checkpoint_rank_path(dir + "/t", 0);
  struct stat s {};
  ASSERT_EQ(::stat(file.c_str(), &s), 0) << file;
  const std::uint64_t allocated = static_cast<std::uint64_t>(s.st_blocks) * 512;
  std::printf("layout %llu bytes; linked file %llu bytes, %llu allocated\n",
              static_cast<unsigned long long>(f.bytes), static_cast<unsigned long long>(s.st_size),
              static_cast<unsigned long long>(allocated));
  EXPECT_GE(static_cast<std::uint64_t>(s.st_size), f.bytes);
  EXPECT_LE(static_cast<std::uint64_t>(s.st_size), f.bytes + config.aio_block_bytes);
  EXPECT_LE(allocated, f.bytes + config.aio_block_bytes);
  // inspect's disk_bytes counts the same blocks (and the small files beside them).
  Result<nlohmann::json> info = inspect_checkpoints(dir, true);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_EQ((*info)["tags"][0]["checksums"], "ok");
  EXPECT_LE((*info)["tags"][0]["disk_bytes"].get<std::uint64_t>(),
            f.bytes + config.aio_block_bytes + 64 * 1024);
}

}  // namespace
}  // namespace zinf
