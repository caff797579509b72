// DeviceOptimizer's frozen runs (device_optimizer.hpp), on an opaque HostDevice that runs the
// kernels' scalar references: an optimizer told which ranges are frozen keeps no moments for
// them, and its master, moments and bf16 copies are the same bits as those of one that steps
// every range, through steps, master writes, zero moments written into a frozen run (kept
// packed) and non-zero ones (the moments then allocated for every element, and decaying). The
// frozen-run optimizer also packs its gradients: a group of frozen runs only has none.
#include "engine/device_optimizer.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "engine/device_optimizer_test_util.hpp"
#include "engine/engine_test_util.hpp"

namespace zinf {
namespace {

using device_optimizer_test::DeviceOptimizerFrozen;
using device_optimizer_test::frozen_count;
using device_optimizer_test::frozen_elements;
using device_optimizer_test::kFrozenGroupElements;
using device_optimizer_test::kPartition;
using engine_test::seeded;

TEST_F(DeviceOptimizerFrozen, FrozenMomentsTakeNoDeviceMemoryAndStepTheSameBits) {
  ASSERT_TRUE(packed_->packed());
  ASSERT_FALSE(full_->packed());
  const std::uint64_t frozen_moments = frozen_count() * 8;
  // The packed moments hold the trainable runs' elements and the alignment that keeps each run's
  // moments congruent to its offset modulo 16: 3 elements before the run at 7603 (its moments at
  // 2979, where those before end at 2976) and 16 before the run at 11'003 (at 4395, after 4379).
  // Nothing else: the frozen runs' half copy is rounded from the master without scratch. The
  // gradients leave out the second group (frozen runs only): the third follows the first, 3
  // elements on to be congruent to its partition offset 6003 modulo 16 (4003), and the fourth
  // follows it with no gap (7003, congruent to 9003).
  const std::uint64_t alignment = (3 + 16) * 8 + 3 * 4;
  const std::vector<std::size_t> at = packed_->grad_offsets();
  EXPECT_EQ(at, (std::vector<std::size_t>{0, DeviceOptimizer::kNoGrad, 4003, 7003}));
  EXPECT_EQ(packed_->grad_elements(), kPartition - kFrozenGroupElements + 3);
  EXPECT_EQ(full_->grad_offsets(), (std::vector<std::size_t>{0, 4000, 6003, 9003}));
  std::printf(
      "device bytes: every moment %llu, frozen moments packed out %llu; frozen moments "
      "%llu\n",
      static_cast<unsigned long long>(full_->device_bytes()),
      static_cast<unsigned long long>(packed_->device_bytes()),
      static_cast<unsigned long long>(frozen_moments));
  EXPECT_EQ(packed_->device_bytes() + frozen_moments + kFrozenGroupElements * 4,
            full_->device_bytes() + alignment);
  for (std::int64_t step = 1; step <= 3; ++step) {
    set_grads(900 + static_cast<std::uint64_t>(step));
    // The HostDevice sums in fp64 in order: the alignment gap's and the frozen elements' zeros
    // leave the same bits.
    EXPECT_EQ(packed_->sum_of_squares().value(), full_->sum_of_squares().value()) << step;
    step_both(step);
  }
  expect_same("three steps");
  // The frozen master kept its bits, the trainable one moved.
  const std::vector<float> m = read(*packed_, 0);
  const std::vector<bool> frozen = frozen_elements();
  std::size_t moved = 0;
  for (std::size_t e = 0; e < kPartition; ++e) {
    if (frozen[e]) {
      ASSERT_EQ(std::memcmp(&m[e], &master_[e], 4), 0) << "element " << e;
    } else {
      moved += m[e] != master_[e] ? 1 : 0;
    }
  }
  EXPECT_GT(moved, (kPartition - frozen_count()) / 2);
}

// f16 copies of a master whose magnitudes run from below the smallest f16 subnormal to beyond
// the largest finite f16 (rounding to zero, subnormals, ties, infinities), with signed zeros: the
// frozen runs' copies rounded at create() and after a master write are the bits the full
// optimizer's learning-rate-0 steps write.
class DeviceOptimizerFrozenF16 : public DeviceOptimizerFrozen {
 protected:
  void SetUp() override {
    for (DeviceOptimizer::Group& g : partition_.groups) {
      if (g.dtype == DType::kBF16) g.dtype = DType::kF16;
    }
    master_ = wide(8201);
    DeviceOptimizerFrozen::SetUp();
  }
  static std::vector<float> wide(std::uint64_t seed) {
    std::vector<float> out = seeded(kPartition, seed, -2.0f, 2.0f);
    std::mt19937_64 rng(seed + 1);
    for (float& x : out) x = std::ldexp(x, static_cast<int>(rng() % 48) - 30);  // 2^-30..2^18
    // Signed zeros in a trainable run (5) and in frozen ones of the half groups (1030, 1031,
    // 4005, 9006): a copy that loses -0's sign differs from the step's.
    out[5] = -0.0f;
    out[1030] = 0.0f;
    out[1031] = -0.0f;
    out[4005] = -0.0f;
    out[9006] = -0.0f;
    out[9004] = 65520.0f;  // ties to infinity
    out[9005] = 0x1p-25f;  // half the smallest subnormal: ties to zero
    return out;
  }
};

TEST_F(DeviceOptimizerFrozenF16, FrozenCopiesAreTheStepsBits) {
  ASSERT_TRUE(packed_->packed());
  set_grads(600);
  step_both(1);
  expect_same("created");
  // Some frozen f16 elements are infinite, subnormal, zero: the wide master reaches them.
  const std::vector<std::uint16_t> h = half(*packed_, 3);
  std::size_t inf = 0, subnormal = 0;
  for (std::size_t i = 13'006 - 9003; i < h.size(); ++i) {
    inf += (h[i] & 0x7fff) == 0x7c00 ? 1 : 0;
    subnormal += (h[i] & 0x7c00) == 0 && (h[i] & 0x3ff) != 0 ? 1 : 0;
  }
  EXPECT_GT(inf, 10u);
  EXPECT_GT(subnormal, 10u);
  // The frozen negative zeros kept their sign.
  EXPECT_EQ(half(*packed_, 0)[1031], 0x8000);
  EXPECT_EQ(half(*packed_, 1)[4005 - 4000], 0x8000);
  EXPECT_EQ(h[9006 - 9003], 0x8000);
  const std::vector<float> master = wide(8202);
  write(*packed_, 0, master);
  write(*full_, 0, master);
  set_grads(601);
  step_both(2);
  expect_same("master written");
}

// A checkpoint's master written (new values everywhere, the frozen runs' bf16 copies rounded
// again), then moments with zeros on the frozen runs (kept packed), then moments saved with
// every run trainable (non-zero on the frozen runs: kept, the optimizer then unpacked), each
// followed by steps: the same bits as the optimizer that steps every run, and the frozen moments
// decay.
TEST_F(DeviceOptimizerFrozen, CheckpointWritesKeepTheBitsOfTheFullState) {
  set_grads(700);
  step_both(1);
  const std::uint64_t packed_bytes = packed_->device_bytes();
  // A new master.
  const std::vector<float> master = seeded(kPartition, 8102, -2.0f, 2.0f);
  write(*packed_, 0, master);
  write(*full_, 0, master);
  set_grads(701);
  step_both(2);
  expect_same("master written");
  // Moments with zeros on the frozen runs: nothing more allocated.
  const std::vector<bool> frozen = frozen_elements();
  for (int which = 1; which < 3; ++which) {
    std::vector<float> v = seeded(kPartition, 8103 + static_cast<std::uint64_t>(which), 0.0f, 0.1f);
    for (std::size_t e = 0; e < kPartition; ++e) {
      if (frozen[e]) v[e] = 0.0f;
    }
    write(*packed_, which, v);
    write(*full_, which, v);
    const std::vector<float> back = read(*packed_, which);
    EXPECT_EQ(std::memcmp(back.data(), v.data(), v.size() * 4), 0) << "piece " << which;
  }
  EXPECT_TRUE(packed_->packed());
  EXPECT_EQ(packed_->device_bytes(), packed_bytes);
  set_grads(702);
  step_both(3);
  expect_same("zero frozen moments written");
  // Moments saved with every run trainable.
  std::vector<std::vector<float>> loaded;
  for (int which = 1; which < 3; ++which) {
    loaded.push_back(seeded(kPartition, 8105 + static_cast<std::uint64_t>(which), 0.01f, 0.1f));
    write(*packed_, which, loaded.back());
    write(*full_, which, loaded.back());
    EXPECT_FALSE(packed_->packed()) << "piece " << which;
    const std::vector<float> back = read(*packed_, which);
    EXPECT_EQ(std::memcmp(back.data(), loaded.back().data(), back.size() * 4), 0)
        << "piece " << which;
  }
  // Every moment; the gradients still without the second group (and with their 3-element
  // alignment gap), which steps on a zero buffer of its run's size (and 16 elements to align it).
  EXPECT_EQ(packed_->device_bytes() + kFrozenGroupElements * 4,
            full_->device_bytes() + 3 * 4 + (kFrozenGroupElements + 16) * 4);
  for (std::int64_t step = 4; step <= 5; ++step) {
    set_grads(700 + static_cast<std::uint64_t>(step));
    step_both(step);
  }
  expect_same("non-zero frozen moments written");
  // They decayed: a frozen element's moments are not those loaded.
  const std::vector<float> m = read(*packed_, 1);
  std::size_t decayed = 0;
  for (std::size_t e = 0; e < kPartition; ++e) {
    if (frozen[e] && m[e] != loaded[0][e]) ++decayed;
  }
  EXPECT_EQ(decayed, frozen_count());
}

// Non-zero moments written into a frozen run on a device with room for the moments of every
// element but not for the zeros a frozen group without gradient slots steps on: the error names
// that buffer and its bytes.
TEST(DeviceOptimizerFrozenUnpack, NoRoomForTheZeroGradientsNamesThatBuffer) {
  using device_optimizer_test::frozen_flags;
  using device_optimizer_test::kGroups;
  using device_optimizer_test::kRanges;
  const std::vector<float> master = seeded(kPartition, 8301, -1.0f, 1.0f);
  HostDeviceOptions o;
  o.opaque = true;
  std::size_t packed_bytes = 0;
  {
    std::unique_ptr<Device> device = std::move(make_host_device(o)).value();
    std::unique_ptr<DeviceOptimizer> packed =
        std::move(DeviceOptimizer::create(*device, kGroups, kPartition, master.data(),
                                          device_optimizer_test::kTimeout, kRanges, frozen_flags(),
                                          /*pack_grads=*/true))
            .value();
    packed_bytes = device->memory_used_bytes();
  }
  // Room for both full moments, and 16 elements short of the zeros.
  const std::size_t zero_bytes = (kFrozenGroupElements + 16) * 4;
  o.memory_limit_bytes = packed_bytes + 2 * kPartition * 4 + zero_bytes - 16 * 4;
  std::unique_ptr<Device> device = std::move(make_host_device(o)).value();
  std::unique_ptr<DeviceOptimizer> packed =
      std::move(DeviceOptimizer::create(*device, kGroups, kPartition, master.data(),
                                        device_optimizer_test::kTimeout, kRanges, frozen_flags(),
                                        /*pack_grads=*/true))
          .value();
  const std::vector<float> moments = seeded(kPartition, 8302, 0.01f, 0.1f);
  const Status s = packed->write_state(1, 0, kPartition, moments.data());
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.to_string();
  EXPECT_NE(s.message().find("device buffer of zeros: 8076 bytes"), std::string_view::npos)
      << s.to_string();
  EXPECT_EQ(s.message().find("moments for every element"), std::string_view::npos) << s.to_string();
}

// A frozen group without gradient slots larger than DeviceOptimizer::kZeroChunkElements, its
// moments made non-zero (unpacked): it steps on a zero buffer of one chunk (and 16 elements to
// align it), in chunks, to the same bits as an optimizer that keeps gradients for every element.
class DeviceOptimizerFrozenChunks : public DeviceOptimizerFrozen {
 protected:
  static constexpr std::size_t kChunk = DeviceOptimizer::kZeroChunkElements;
  static constexpr std::size_t kFrozen = kChunk * 2 + 2003;  // two chunks and a partial one
  static constexpr std::size_t kLast = 4000 + kFrozen;
  static constexpr std::size_t kElements = kLast + 3000;

  void SetUp() override {
    partition_.groups = {{0, 4000, 0, DType::kBF16},
                         {4000, kFrozen, 8000, DType::kBF16},
                         {kLast, 3000, 8000 + kFrozen * 2, DType::kBF16}};
    partition_.ranges = {{0, 0}, {1024, 2}, {2048, 1}, {4000, 2}, {kLast, 0}, {kLast + 1000, 2}};
    partition_.elements = kElements;
    master_ = seeded(kElements, 8401, -1.0f, 1.0f);
    // Pieces of 64 Ki elements: 33 read_state calls for each state, not 2,100 of 1000 elements.
    piece_elements_ = std::size_t{1} << 16;
    DeviceOptimizerFrozen::SetUp();
  }
};

TEST_F(DeviceOptimizerFrozenChunks, ALargeFrozenRunStepsInChunksOnASmallZeroBuffer) {
  ASSERT_EQ(packed_->grad_offsets(), (std::vector<std::size_t>{0, DeviceOptimizer::kNoGrad, 4003}));
  set_grads(8411);
  step_both(1);
  for (int which = 1; which < 3; ++which) {
    const std::vector<float> v =
        seeded(kElements, 8402 + static_cast<std::uint64_t>(which), 0.01f, 0.1f);
    ASSERT_TRUE(packed_->write_state(which, 0, kElements, v.data()).is_ok());
    ASSERT_TRUE(full_->write_state(which, 0, kElements, v.data()).is_ok());
  }
  ASSERT_FALSE(packed_->packed());
  // The gradients without the frozen group (and with a 3-element alignment gap), and zeros for
  // one chunk, not for the frozen run.
  EXPECT_EQ(packed_->device_bytes() + kFrozen * 4,
            full_->device_bytes() + 3 * 4 + (kChunk + 16) * 4);
  for (std::int64_t step = 2; step <= 3; ++step) {
    set_grads(8410 + static_cast<std::uint64_t>(step));
    step_both(step);
  }
  expect_same("two steps after the moments were written");
  // Every chunk of the frozen run stepped: its first moments decayed from those written.
  const std::vector<float> m = read(*packed_, 1);
  const std::vector<float> written = seeded(kElements, 8403, 0.01f, 0.1f);
  std::size_t decayed = 0;
  for (std::size_t e = 4000; e < kLast; ++e) decayed += m[e] != written[e] ? 1 : 0;
  EXPECT_EQ(decayed, kFrozen);
}

}  // namespace
}  // namespace zinf
