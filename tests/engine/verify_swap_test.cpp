// Engine::verify_swap: each rank reads its swap files back and checks every written block
// against the checksum kept when it was written. After training with the optimizer state and the
// parameter shards on NVMe, every rank's files verify; once bytes of one rank's swap file are
// overwritten behind the engine's back, that rank's check is kCorruption naming the file, and the
// other rank's (its own directory) still verifies. A failed engine (sticky error) still checks.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

namespace fs = std::filesystem;

// Overwrites the first `bytes` bytes of every file in `dir` with 0x5a.
void scribble(const std::string& dir, std::size_t bytes) {
  for (const fs::directory_entry& f : fs::directory_iterator(dir)) {
    const int fd = ::open(f.path().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0) << f.path();
    const std::vector<char> junk(bytes, 0x5a);
    ASSERT_EQ(::pwrite(fd, junk.data(), junk.size(), 0), static_cast<ssize_t>(junk.size()));
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
  }
}

TEST(VerifySwap, EveryRanksBlocksVerifyAndAScribbledFileIsCorruptionOnItsRankOnly) {
  constexpr int kWorld = 2;
  engine_test::ScratchDir dir("verify_swap");
  const Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNvme, dir.path());
  const engine_test::Model model = engine_test::make_model(DType::kF32, 99);
  engine_test::Ranks ranks = engine_test::make_ranks(kWorld);
  std::vector<std::unique_ptr<Engine>> engines(kWorld);
  std::vector<std::string> rank_dirs;
  for (int r = 0; r < kWorld; ++r) {
    rank_dirs.push_back(dir.path() + "/rank" + std::to_string(r));
    fs::create_directories(rank_dirs.back());
  }
  engine_test::TrainOptions options;
  options.steps = 2;
  options.check_gathered = false;
  std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Env env;
    env.device = ranks.devices[r].get();
    env.comm = ranks.comms[r].get();
    env.nvme_paths = {rank_dirs[r]};
    ZINF_ASSIGN_OR_RETURN(engines[r], Engine::open(config, env));
    return engine_test::train_rank(*engines[r], model, rank, options, nullptr, nullptr);
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(st[static_cast<std::size_t>(r)].is_ok())
        << st[static_cast<std::size_t>(r)].to_string();
  }
  // Each rank holds its slice of the master and both moments (12 bytes an element) at least.
  std::size_t elements = 0;
  for (const engine_test::ParamDef& d : model.params) elements += d.element_count();
  for (int r = 0; r < kWorld; ++r) {
    Result<SwapCheckReport> check = engines[static_cast<std::size_t>(r)]->verify_swap();
    ASSERT_TRUE(check.is_ok()) << "rank " << r << ": " << check.status().to_string();
    EXPECT_GT(check->blocks, 0u);
    EXPECT_GE(check->bytes, 12 * elements / kWorld) << "rank " << r;
  }

  scribble(rank_dirs[1], 64 * 1024);
  Result<SwapCheckReport> bad = engines[1]->verify_swap();
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), Code::kCorruption) << bad.status().to_string();
  EXPECT_NE(bad.status().message().find(rank_dirs[1]), std::string::npos)
      << bad.status().to_string();
  Result<SwapCheckReport> good = engines[0]->verify_swap();
  EXPECT_TRUE(good.is_ok()) << good.status().to_string();
}

TEST(VerifySwap, WithoutNvmeThereIsNothingToCheck) {
  engine_test::ScratchDir dir("verify_swap_none");
  const Config config =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, dir.path());
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Env env;
  env.device = ranks.devices[0].get();
  env.comm = ranks.comms[0].get();
  Result<std::unique_ptr<Engine>> engine = Engine::open(config, env);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  Result<SwapCheckReport> check = (*engine)->verify_swap();
  ASSERT_TRUE(check.is_ok()) << check.status().to_string();
  EXPECT_EQ(check->blocks, 0u);
}

}  // namespace
}  // namespace zinf
