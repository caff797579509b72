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

#include "engine/engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::seeded;

constexpr auto kTimeout = std::chrono::seconds(30);

// Four dtype groups (bf16, f32, bf16, bf16) cut into runs of the default group (0), a second
// group (1) and the frozen group (2, learning rate 0 and weight decay 0), frozen runs in each;
// the last group's one run is frozen (a frozen partitioner group: no room for gradients).
constexpr std::size_t kPartition = 14'008;
constexpr std::size_t kFrozenGroupElements = 2000;  // the last dtype group's
const std::vector<DeviceOptimizer::Group> kGroups = {{0, 4000, 0, DType::kBF16},
                                                     {4000, 3000, 8000, DType::kF32},
                                                     {7000, 5008, 8000, DType::kBF16},
                                                     {12'008, 2000, 18'016, DType::kBF16}};
const std::vector<OptimizerRange> kRanges = {{0, 0},    {1024, 2}, {2048, 1}, {4000, 2},
                                             {5600, 0}, {7000, 2}, {9000, 1}, {11'003, 2}};
constexpr std::uint32_t kFrozenGroup = 2;

std::size_t range_end(std::size_t r) {
  return r + 1 < kRanges.size() ? kRanges[r + 1].begin : kPartition;
}

std::vector<bool> frozen_flags() {
  std::vector<bool> out;
  for (const OptimizerRange& r : kRanges) out.push_back(r.group == kFrozenGroup);
  return out;
}

// Whether partition element e is in a frozen range.
std::vector<bool> frozen_elements() {
  std::vector<bool> out(kPartition, false);
  for (std::size_t r = 0; r < kRanges.size(); ++r) {
    if (kRanges[r].group != kFrozenGroup) continue;
    std::fill(out.begin() + static_cast<std::ptrdiff_t>(kRanges[r].begin),
              out.begin() + static_cast<std::ptrdiff_t>(range_end(r)), true);
  }
  return out;
}

std::vector<OptimizerParams> group_params() {
  OptimizerParams base;
  base.kind = OptimizerKind::kAdamW;
  base.lr = 1e-2;
  base.weight_decay = 0.01;
  OptimizerParams second = base;
  second.lr = 3e-2;
  second.weight_decay = 0.1;
  OptimizerParams frozen = base;
  frozen.lr = 0;
  frozen.weight_decay = 0;
  return {base, second, frozen};
}

class DeviceOptimizerFrozen : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_ == nullptr) {
      HostDeviceOptions o;
      o.opaque = true;
      device_ = std::move(make_host_device(o)).value();
    }
    stream_ = std::move(device_->create_stream("test")).value();
    if (master_.empty()) master_ = seeded(kPartition, 8101, -1.0f, 1.0f);
    packed_ = std::move(DeviceOptimizer::create(*device_, groups_, kPartition, master_.data(),
                                                kTimeout, kRanges, frozen_flags(),
                                                /*pack_grads=*/true))
                  .value();
    full_ = std::move(DeviceOptimizer::create(*device_, groups_, kPartition, master_.data(),
                                              kTimeout, kRanges))
                .value();
  }

  // Seeded gradients, zero on the frozen elements (they take none), into both accumulators,
  // each group's where grad_offsets() puts it (none for a group without room).
  void set_grads(std::uint64_t seed) {
    std::vector<float> g = seeded(kPartition, seed, -0.5f, 0.5f);
    const std::vector<bool> frozen = frozen_elements();
    for (std::size_t e = 0; e < kPartition; ++e) {
      if (frozen[e]) g[e] = 0.0f;
    }
    for (DeviceOptimizer* o : {packed_.get(), full_.get()}) {
      for (std::size_t k = 0; k < groups_.size(); ++k) {
        const std::size_t at = o->grad_offsets()[k];
        if (at == DeviceOptimizer::kNoGrad) continue;
        ASSERT_TRUE(device_
                        ->copy_h2d(o->grads() + at, g.data() + groups_[k].offset,
                                   groups_[k].count * 4, *stream_)
                        .is_ok());
      }
      ASSERT_TRUE(device_->synchronize(*stream_, kTimeout).is_ok());
    }
  }

  void step_both(std::int64_t step) {
    const std::vector<OptimizerParams> groups = group_params();
    for (DeviceOptimizer* o : {packed_.get(), full_.get()}) {
      ASSERT_TRUE(o->step(step, 0.5f, groups).is_ok());
    }
  }

  // Piece `which` read in chunks of 1000 elements (chunks that end inside runs).
  std::vector<float> read(DeviceOptimizer& o, int which) {
    std::vector<float> out(kPartition);
    for (std::size_t first = 0; first < kPartition; first += 1000) {
      const std::size_t count = std::min<std::size_t>(1000, kPartition - first);
      EXPECT_TRUE(o.read_state(which, first, count, out.data() + first).is_ok());
    }
    return out;
  }
  void write(DeviceOptimizer& o, int which, const std::vector<float>& in) {
    for (std::size_t first = 0; first < kPartition; first += 1000) {
      const std::size_t count = std::min<std::size_t>(1000, kPartition - first);
      ASSERT_TRUE(o.write_state(which, first, count, in.data() + first).is_ok());
    }
  }
  std::vector<std::uint16_t> half(DeviceOptimizer& o, std::uint32_t g) {
    std::vector<std::uint16_t> out(groups_[g].count);
    EXPECT_TRUE(device_->copy_d2h(out.data(), o.values(g), out.size() * 2, *stream_).is_ok());
    EXPECT_TRUE(device_->synchronize(*stream_, kTimeout).is_ok());
    return out;
  }

  // The packed optimizer's master, moments and bf16 copies are the full one's, bit for bit.
  void expect_same(const char* what) {
    SCOPED_TRACE(what);
    for (int which = 0; which < 3; ++which) {
      const std::vector<float> a = read(*packed_, which);
      const std::vector<float> b = read(*full_, which);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "piece " << which;
    }
    for (std::uint32_t g : {0u, 2u, 3u}) {
      EXPECT_EQ(half(*packed_, g), half(*full_, g)) << "group " << g;
    }
  }

  std::vector<DeviceOptimizer::Group> groups_ = kGroups;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::vector<float> master_;  // set before SetUp() to replace the seeded default
  std::unique_ptr<DeviceOptimizer> packed_, full_;
};

std::size_t frozen_count() {
  std::size_t n = 0;
  for (bool f : frozen_elements()) n += f ? 1 : 0;
  return n;
}

TEST_F(DeviceOptimizerFrozen, FrozenMomentsTakeNoDeviceMemoryAndStepTheSameBits) {
  ASSERT_TRUE(packed_->packed());
  ASSERT_FALSE(full_->packed());
  const std::uint64_t frozen_moments = frozen_count() * 8;
  // The packed moments hold the trainable runs' elements and the alignment that keeps each run's
  // moments congruent to its offset modulo 16: 16 elements, before the run at 9000 (its moments
  // at 4392, where those before end at 4376). Nothing else: the frozen runs' half copy is rounded
  // from the master without scratch. The gradients leave out the last group (frozen runs only):
  // the others lie at their partition offsets, which they keep.
  const std::uint64_t alignment = 16 * 8;
  const std::vector<std::size_t> at = packed_->grad_offsets();
  EXPECT_EQ(at, (std::vector<std::size_t>{0, 4000, 7000, DeviceOptimizer::kNoGrad}));
  EXPECT_EQ(packed_->grad_elements(), kPartition - kFrozenGroupElements);
  EXPECT_EQ(full_->grad_offsets(), (std::vector<std::size_t>{0, 4000, 7000, 12'008}));
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
    for (DeviceOptimizer::Group& g : groups_) {
      if (g.dtype == DType::kBF16) g.dtype = DType::kF16;
    }
    master_ = wide(8201);
    DeviceOptimizerFrozen::SetUp();
  }
  static std::vector<float> wide(std::uint64_t seed) {
    std::vector<float> out = seeded(kPartition, seed, -2.0f, 2.0f);
    std::mt19937_64 rng(seed + 1);
    for (float& x : out) x = std::ldexp(x, static_cast<int>(rng() % 48) - 30);  // 2^-30..2^18
    // Signed zeros in a trainable run (5) and in frozen ones of both half groups (1030, 1031,
    // 7003): a copy that loses -0's sign differs from the step's.
    out[5] = -0.0f;
    out[1030] = 0.0f;
    out[1031] = -0.0f;
    out[7003] = -0.0f;
    out[7001] = 65520.0f;  // ties to infinity
    out[7002] = 0x1p-25f;  // half the smallest subnormal: ties to zero
    return out;
  }
};

TEST_F(DeviceOptimizerFrozenF16, FrozenCopiesAreTheStepsBits) {
  ASSERT_TRUE(packed_->packed());
  set_grads(600);
  step_both(1);
  expect_same("created");
  // Some frozen f16 elements are infinite, subnormal, zero: the wide master reaches them.
  const std::vector<std::uint16_t> h = half(*packed_, 2);
  std::size_t inf = 0, subnormal = 0;
  for (std::size_t i = 11'003 - 7000; i < h.size(); ++i) {
    inf += (h[i] & 0x7fff) == 0x7c00 ? 1 : 0;
    subnormal += (h[i] & 0x7c00) == 0 && (h[i] & 0x3ff) != 0 ? 1 : 0;
  }
  EXPECT_GT(inf, 10u);
  EXPECT_GT(subnormal, 10u);
  // The frozen negative zeros kept their sign.
  EXPECT_EQ(half(*packed_, 0)[1031], 0x8000);
  EXPECT_EQ(h[7003 - 7000], 0x8000);
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
  // Every moment; the gradients still without the last group, which steps on a zero buffer of
  // its run's size (and 16 elements to align it).
  EXPECT_EQ(packed_->device_bytes() + kFrozenGroupElements * 4,
            full_->device_bytes() + (kFrozenGroupElements + 16) * 4);
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

// The same on a GPU (skipped without one): the packed gradients at their offsets step the same
// bits through CUDA's kernels, and the norm over the packed accumulator, whose fp32 block sums
// fall on other elements than over the whole partition, is the full one's to float rounding
// (printed, with the difference).
class DeviceOptimizerFrozenCuda : public DeviceOptimizerFrozen {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<Device>> cuda = make_cuda_device(0);
    if (!cuda.is_ok()) GTEST_SKIP() << "no CUDA device: " << cuda.status().to_string();
    device_ = std::move(cuda).value();
    DeviceOptimizerFrozen::SetUp();
  }
};

TEST_F(DeviceOptimizerFrozenCuda, PackedGradientsStepTheSameBits) {
  for (std::int64_t step = 1; step <= 3; ++step) {
    set_grads(950 + static_cast<std::uint64_t>(step));
    const double packed = packed_->sum_of_squares().value();
    const double full = full_->sum_of_squares().value();
    std::printf("step %lld: sum of squares packed %.9g, full %.9g, difference %.3g\n",
                static_cast<long long>(step), packed, full, packed - full);
    EXPECT_NEAR(packed, full, 1e-6 * full);
    step_both(step);
  }
  expect_same("three steps on the GPU");
}

}  // namespace
}  // namespace zinf
