// The tiered optimizer step on a real filesystem that fails: a small ext4 on a loop device
// (tests/common/loop_mount.hpp) holds the swap file. The disk fills up between steps; the kernel
// turns the filesystem read-only in the middle of a step. Each ends either in a step that
// succeeded with the exact state of the in-memory run, or in a Status naming the swap file and
// the cause, without a hang; and every sub-group the store does not mark torn reads back, its
// checksums verified, as exactly the old or the new state. Skips, naming the reason, where the
// machine cannot mount a loop filesystem.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/aligned.hpp"
#include "base/random.hpp"
#include "common/loop_mount.hpp"
#include "io/fault.hpp"
#include "tier_test_util.hpp"

namespace zinf {
namespace {

using test_common::LoopMount;
using tier_test::Reference;
using tier_test::Rig;
using tier_test::RigOptions;

RigOptions loop_rig_options(const std::string& dir, std::shared_ptr<FaultInjector> faults) {
  RigOptions so;
  so.swap_dir = dir;
  so.faults = std::move(faults);
  so.io_block_bytes = 16 << 10;
  so.store.param_count = 200'000;
  so.store.sub_group_params = 16'384;
  so.store.grad_dtype = DType::kBF16;
  so.pool_blocks = 3;
  so.pipeline.optimizer.kind = OptimizerKind::kAdamW;
  so.pipeline.optimizer.lr = 1e-2;
  so.pipeline.threads = 1;
  so.pipeline.io_timeout = std::chrono::seconds(20);
  return so;
}

// Each test's setup: a 128 MiB loop filesystem holding the swap file, a rig open on it with
// seeded state, and step 1's gradients loaded (into ref_ as well). Members are destroyed in
// reverse order, so the rig closes its swap file before the filesystem is unmounted.
class LoopFilesystem : public ::testing::Test {
 protected:
  // Mounts the filesystem; false (mount_->reason() says why) where the machine cannot.
  bool mount(const char* name, const char* what, std::uint64_t seed) {
    mount_ = std::make_unique<LoopMount>(name, 128);
    if (!mount_->ok()) return false;
    std::printf("loop fs %s: seed %llu, %s on %s\n", what, static_cast<unsigned long long>(seed),
                mount_->path().c_str(), mount_->device().c_str());
    return true;
  }

  void open_rig(const char* name, std::uint64_t seed, std::shared_ptr<FaultInjector> faults) {
    so_ = loop_rig_options(mount_->path(), std::move(faults));
    Status opened = tier_test::open_loaded_rig(name, so_, seed, 0, &rig_, &ref_);
    ASSERT_TRUE(opened.is_ok()) << opened.to_string();
    load_grads(seed + 1);
  }

  // Seeded gradients for the next step, in the reference and the store.
  void load_grads(std::uint64_t seed) {
    ref_.make_grads(DType::kBF16, seed);
    ASSERT_TRUE(tier_test::load_grads(*rig_.store, ref_).is_ok());
  }

  // After a failed step t: every sub-group is old, new or torn, and each that is not torn reads
  // back (checksums verified) equal to that version. Returns "torn/old/new" counts.
  std::string check_versions(std::int64_t t, const Reference& old) {
    int torn = 0, old_groups = 0, new_groups = 0;
    for (std::size_t i = 0; i < rig_.store->sub_group_count(); ++i) {
      const Version v = rig_.store->version(i, t);
      if (v == Version::kTorn) {
        ++torn;
        continue;
      }
      v == Version::kNew ? ++new_groups : ++old_groups;
      EXPECT_EQ(tier_test::compare_sub_group(*rig_.store, i, v == Version::kNew ? ref_ : old), "")
          << "sg " << i << " says " << version_name(v);
    }
    return fmt::format("{} torn, {} old, {} new", torn, old_groups, new_groups);
  }

  std::unique_ptr<LoopMount> mount_;
  RigOptions so_;
  Rig rig_;
  Reference ref_;
};

TEST_F(LoopFilesystem, FullDiskBetweenStepsNeitherHangsNorLosesState) {
  const std::uint64_t seed = 1901;
  if (!mount("full-step", "full disk", seed)) GTEST_SKIP() << mount_->reason();
  ASSERT_NO_FATAL_FAILURE(open_rig("loop-full", seed, nullptr));
  ASSERT_TRUE(rig_.pipeline->step({.step = 1}).is_ok());
  ref_.step(so_.pipeline.optimizer, so_.store, 1, 1.0f);

  const std::uint64_t filled = mount_->fill();
  std::printf("filled the filesystem with %llu bytes\n", static_cast<unsigned long long>(filled));
  ASSERT_NO_FATAL_FAILURE(load_grads(seed + 2));
  const Reference old = ref_;
  ref_.step(so_.pipeline.optimizer, so_.store, 2, 1.0f);
  const auto start = std::chrono::steady_clock::now();
  Result<StepStats> r = rig_.pipeline->step({.step = 2});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  if (r.is_ok()) {
    // The swap file was preallocated at open, so a full filesystem takes nothing from it.
    std::printf("step on a full disk: ok (the swap file is preallocated)\n");
    EXPECT_EQ(tier_test::compare_all(*rig_.store, ref_), "");
    return;
  }
  const std::string message = r.status().to_string();
  std::printf("step on a full disk: %s\n", message.c_str());
  EXPECT_EQ(r.status().code(), Code::kNoSpace) << message;
  EXPECT_NE(message.find(mount_->path()), std::string::npos) << message;
  std::printf("sub-groups: %s\n", check_versions(2, old).c_str());
}

TEST_F(LoopFilesystem, ReadOnlyMidStepFailsNamingTheFileAndKeepsUntornState) {
  const std::uint64_t seed = 1902;
  if (!mount("ro-step", "read-only", seed)) GTEST_SKIP() << mount_->reason();
  // Every write completes 3 ms late, so that the step is still writing when the filesystem
  // turns read-only.
  FaultSpec spec;
  spec.seed = seed;
  spec.reads = false;
  spec.latency_rate = 1.0;
  spec.latency = std::chrono::microseconds(3000);
  auto faults = std::make_shared<FaultInjector>(spec);
  faults->set_enabled(false);
  ASSERT_NO_FATAL_FAILURE(open_rig("loop-ro", seed, faults));
  const Reference old = ref_;
  ref_.step(so_.pipeline.optimizer, so_.store, 1, 1.0f);

  faults->set_enabled(true);
  bool turned = false;
  std::thread remount([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    turned = mount_->turn_read_only();
  });
  const auto start = std::chrono::steady_clock::now();
  Result<StepStats> r = rig_.pipeline->step({.step = 1});
  const auto took = std::chrono::steady_clock::now() - start;
  remount.join();
  faults->set_enabled(false);
  if (!turned) GTEST_SKIP() << "this kernel cannot turn ext4 read-only (no trigger_fs_error)";
  EXPECT_LT(took, std::chrono::seconds(30));
  ASSERT_FALSE(r.is_ok()) << "the step finished before the filesystem turned read-only; "
                          << "it took " << std::chrono::duration<double>(took).count() << " s";
  const std::string message = r.status().to_string();
  std::printf("step on a filesystem turned read-only: %s\n", message.c_str());
  EXPECT_EQ(r.status().sys_code(), EROFS) << message;
  EXPECT_NE(message.find(mount_->path()), std::string::npos) << message;
  EXPECT_NE(message.find("optimizer step 1: sub-group "), std::string::npos) << message;
  // Sticky, and what is on the read-only disk is still readable and verified.
  EXPECT_EQ(rig_.pipeline->step({.step = 2}).status().to_string(), message);
  std::printf("sub-groups: %s\n", check_versions(1, old).c_str());
}

// A frozen sub-group whose exp_avg is released (kZero, as finalize or a checkpoint load of zeros
// leaves it) and whose exp_avg_sq is not zero (a parameter trained, then frozen: exp_avg underflows
// long before exp_avg_sq) is updated by every step until exp_avg_sq decays to zero. Its exp_avg
// stays zero and is not written back into its hole, so a step on a disk that filled up meanwhile
// takes no new block: it succeeds, as it did when the swap file was wholly preallocated.
TEST(LoopFilesystemFrozen, AReleasedMomentStaysReleasedThroughStepsOnAFullDisk) {
  const std::uint64_t seed = 1903;
  LoopMount mount("frozen-full", 128);
  if (!mount.ok()) GTEST_SKIP() << mount.reason();
  std::printf("loop fs frozen moments: seed %llu, %s on %s\n",
              static_cast<unsigned long long>(seed), mount.path().c_str(), mount.device().c_str());
  constexpr std::size_t kSub = 16384;
  const std::vector<bool>& frozen = tier_test::kFrozenSubGroups;
  RigOptions so =
      tier_test::frozen_rig_options(kSub,
                                    {StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme,
                                     StoreMedium::kHost, StoreMedium::kHost},
                                    /*threads=*/1);
  so.swap_dir = mount.path();
  so.io_block_bytes = 16 << 10;
  Rig s;
  Reference ref;
  const Status opened = tier_test::open_loaded_rig("loop-frozen", so, seed, 0, &s, &ref);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  AlignedBuffer block(kSub * 4 + 4096);
  auto load_frozen_grads = [&](std::uint64_t grads_seed) {
    ref.make_grads(DType::kF32, grads_seed);
    auto* g = reinterpret_cast<float*>(ref.grads.data());
    for (std::size_t i = 0; i < frozen.size(); ++i) {
      if (frozen[i]) std::fill_n(g + i * kSub, kSub, 0.0f);
    }
    ASSERT_TRUE(tier_test::load_grads(*s.store, ref).is_ok());
  };
  // The frozen moments zero, as finalize leaves them: step 1 settles and releases them.
  std::memset(block.data(), 0, block.bytes());
  for (std::size_t i = 0; i < frozen.size(); ++i) {
    if (!frozen[i]) continue;
    for (Piece piece : {Piece::kExpAvg, Piece::kExpAvgSq}) {
      ASSERT_TRUE(s.store->write_piece(piece, i, block.data()).is_ok());
    }
  }
  ASSERT_NO_FATAL_FAILURE(load_frozen_grads(seed + 1));
  ASSERT_TRUE(s.pipeline->step({.step = 1}).is_ok());
  if (s.store->residency(Piece::kExpAvg, 3) != Residency::kZero) {
    GTEST_SKIP() << "this filesystem cannot punch holes";
  }
  // Sub-group 3's exp_avg_sq loaded non-zero (seeded, positive); its exp_avg stays released.
  std::vector<float> v(kSub);
  fill_uniform(v.data(), kSub, seed + 2, 1e-6f, 1e-3f);
  std::memcpy(block.data(), v.data(), kSub * 4);
  ASSERT_TRUE(s.store->write_piece(Piece::kExpAvgSq, 3, block.data()).is_ok());
  AlignedBuffer master(kSub * 4 + 4096);
  ASSERT_TRUE(s.store->read_piece(Piece::kParams, 3, master.data()).is_ok());

  const std::uint64_t filled = mount.fill();
  std::printf("filled the filesystem with %llu bytes\n", static_cast<unsigned long long>(filled));
  const double beta2 = so.pipeline.groups[1].beta2;
  for (std::int64_t t = 2; t <= 3; ++t) {
    ASSERT_NO_FATAL_FAILURE(load_frozen_grads(seed + static_cast<std::uint64_t>(t)));
    Result<StepStats> r = s.pipeline->step({.step = t});
    ASSERT_TRUE(r.is_ok()) << "step " << t << " on a full disk: " << r.status().to_string();
    EXPECT_EQ(s.store->residency(Piece::kExpAvg, 3), Residency::kZero) << "step " << t;
    EXPECT_EQ(s.store->residency(Piece::kExpAvgSq, 3), Residency::kDisk) << "step " << t;
    // Gradient zero: exp_avg_sq only decays, by beta2 a step; the master does not move.
    for (float& x : v) x = static_cast<float>(beta2 * x);
  }
  ASSERT_TRUE(s.store->read_piece(Piece::kExpAvgSq, 3, block.data()).is_ok());
  const float* got = block.as<const float>();
  for (std::size_t k = 0; k < kSub; ++k) {
    ASSERT_NEAR(got[k], v[k], 1e-6 * v[k]) << "exp_avg_sq " << k;
  }
  ASSERT_TRUE(s.store->read_piece(Piece::kExpAvg, 3, block.data()).is_ok());
  std::vector<float> zeros(kSub, 0.0f);
  EXPECT_EQ(std::memcmp(block.data(), zeros.data(), kSub * 4), 0);
  ASSERT_TRUE(s.store->read_piece(Piece::kParams, 3, block.data()).is_ok());
  EXPECT_EQ(std::memcmp(block.data(), master.data(), kSub * 4), 0);
}

}  // namespace
}  // namespace zinf
