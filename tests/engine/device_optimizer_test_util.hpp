// The device optimizer's frozen-run tests, shared by tests/engine (an opaque HostDevice) and
// tests/gpu (CUDA): a partition of four dtype groups with frozen runs, and a fixture holding an
// optimizer told which runs are frozen (packed moments and gradients) beside one that steps every
// run, over that partition or one a test sets, with seeded gradients, steps and bit-for-bit
// comparisons of their state.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/device_optimizer.hpp"
#include "engine/engine_test_util.hpp"

namespace zinf::device_optimizer_test {

using engine_test::seeded;

constexpr auto kTimeout = std::chrono::seconds(30);

// Four dtype groups (bf16, bf16, f32, bf16) cut into runs of the default group (0), a second
// group (1) and the frozen group (2, learning rate 0 and weight decay 0), frozen runs in each.
// The second dtype group's one run is frozen (a frozen partitioner group: no room for
// gradients), and its 2003 elements are not a multiple of 16: the packed gradients of the groups
// after it lie before their partition offsets, the first of them past an alignment gap.
constexpr std::size_t kPartition = 14'011;
constexpr std::size_t kFrozenGroupElements = 2003;  // the second dtype group's
inline const std::vector<DeviceOptimizer::Group> kGroups = {{0, 4000, 0, DType::kBF16},
                                                            {4000, 2003, 8000, DType::kBF16},
                                                            {6003, 3000, 12'006, DType::kF32},
                                                            {9003, 5008, 12'006, DType::kBF16}};
inline const std::vector<OptimizerRange> kRanges = {{0, 0},    {1024, 2},   {2048, 1},
                                                    {4000, 2}, {6003, 2},   {7603, 0},
                                                    {9003, 2}, {11'003, 1}, {13'006, 2}};
constexpr std::uint32_t kFrozenGroup = 2;

// A partition of `elements` elements: its dtype groups and its runs of optimizer groups, those
// of kFrozenGroup frozen.
struct Partition {
  std::vector<DeviceOptimizer::Group> groups;
  std::vector<OptimizerRange> ranges;
  std::size_t elements = 0;
};
// The four dtype groups above.
inline const Partition kDefaultPartition = {kGroups, kRanges, kPartition};

inline std::size_t range_end(std::size_t r, const Partition& p = kDefaultPartition) {
  return r + 1 < p.ranges.size() ? p.ranges[r + 1].begin : p.elements;
}

inline std::vector<bool> frozen_flags(const Partition& p = kDefaultPartition) {
  std::vector<bool> out;
  for (const OptimizerRange& r : p.ranges) out.push_back(r.group == kFrozenGroup);
  return out;
}

// Whether partition element e is in a frozen range.
inline std::vector<bool> frozen_elements(const Partition& p = kDefaultPartition) {
  std::vector<bool> out(p.elements, false);
  for (std::size_t r = 0; r < p.ranges.size(); ++r) {
    if (p.ranges[r].group != kFrozenGroup) continue;
    std::fill(out.begin() + static_cast<std::ptrdiff_t>(p.ranges[r].begin),
              out.begin() + static_cast<std::ptrdiff_t>(range_end(r, p)), true);
  }
  return out;
}

inline std::vector<OptimizerParams> group_params() {
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

// The fixture's partition is kDefaultPartition unless a subclass sets partition_ (and master_)
// before SetUp().
class DeviceOptimizerFrozen : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_ == nullptr) {
      HostDeviceOptions o;
      o.opaque = true;
      device_ = std::move(make_host_device(o)).value();
    }
    stream_ = std::move(device_->create_stream("test")).value();
    const Partition& p = partition_;
    if (master_.empty()) master_ = seeded(p.elements, 8101, -1.0f, 1.0f);
    packed_ = std::move(DeviceOptimizer::create(*device_, p.groups, p.elements, master_.data(),
                                                kTimeout, p.ranges, frozen_flags(p),
                                                /*pack_grads=*/true))
                  .value();
    full_ = std::move(DeviceOptimizer::create(*device_, p.groups, p.elements, master_.data(),
                                              kTimeout, p.ranges))
                .value();
  }

  // Seeded gradients, zero on the frozen elements (they take none), into both accumulators,
  // each group's where grad_offsets() puts it (none for a group without room).
  void set_grads(std::uint64_t seed) {
    const std::vector<DeviceOptimizer::Group>& groups = partition_.groups;
    std::vector<float> g = seeded(partition_.elements, seed, -0.5f, 0.5f);
    const std::vector<bool> frozen = frozen_elements(partition_);
    for (std::size_t e = 0; e < partition_.elements; ++e) {
      if (frozen[e]) g[e] = 0.0f;
    }
    for (DeviceOptimizer* o : {packed_.get(), full_.get()}) {
      for (std::size_t k = 0; k < groups.size(); ++k) {
        const std::size_t at = o->grad_offsets()[k];
        if (at == DeviceOptimizer::kNoGrad) continue;
        ASSERT_TRUE(device_
                        ->copy_h2d(o->grads() + at, g.data() + groups[k].offset,
                                   groups[k].count * 4, *stream_)
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

  // Piece `which` read in pieces of piece_elements_ (pieces that end inside runs); a failed read
  // is reported once and ends the read.
  std::vector<float> read(DeviceOptimizer& o, int which) {
    const std::size_t elements = partition_.elements;
    std::vector<float> out(elements);
    for (std::size_t first = 0; first < elements; first += piece_elements_) {
      const std::size_t count = std::min(piece_elements_, elements - first);
      const Status s = o.read_state(which, first, count, out.data() + first);
      if (!s.is_ok()) {
        ADD_FAILURE() << "read_state(" << which << ", " << first << ", " << count
                      << "): " << s.to_string();
        return out;
      }
    }
    return out;
  }
  void write(DeviceOptimizer& o, int which, const std::vector<float>& in) {
    const std::size_t elements = partition_.elements;
    for (std::size_t first = 0; first < elements; first += piece_elements_) {
      const std::size_t count = std::min(piece_elements_, elements - first);
      const Status s = o.write_state(which, first, count, in.data() + first);
      ASSERT_TRUE(s.is_ok()) << "write_state(" << which << ", " << first << ", " << count
                             << "): " << s.to_string();
    }
  }
  std::vector<std::uint16_t> half(DeviceOptimizer& o, std::uint32_t g) {
    std::vector<std::uint16_t> out(partition_.groups[g].count);
    EXPECT_TRUE(device_->copy_d2h(out.data(), o.values(g), out.size() * 2, *stream_).is_ok());
    EXPECT_TRUE(device_->synchronize(*stream_, kTimeout).is_ok());
    return out;
  }

  // The packed optimizer's master, moments and half copies (of every group not f32) are the full
  // one's, bit for bit.
  void expect_same(const char* what) {
    SCOPED_TRACE(what);
    for (int which = 0; which < 3; ++which) {
      const std::vector<float> a = read(*packed_, which);
      const std::vector<float> b = read(*full_, which);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "piece " << which;
    }
    for (std::uint32_t g = 0; g < partition_.groups.size(); ++g) {
      if (partition_.groups[g].dtype == DType::kF32) continue;
      EXPECT_EQ(half(*packed_, g), half(*full_, g)) << "group " << g;
    }
  }

  Partition partition_ = kDefaultPartition;  // set before SetUp() to replace the default
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::vector<float> master_;  // set before SetUp() to replace the seeded default
  // Elements per read_state / write_state call of read() and write(): small, so that the pieces
  // end inside runs; a test of a large partition sets more, as each call synchronizes.
  std::size_t piece_elements_ = 1000;
  std::unique_ptr<DeviceOptimizer> packed_, full_;
};

inline std::size_t frozen_count(const Partition& p = kDefaultPartition) {
  std::size_t n = 0;
  for (bool f : frozen_elements(p)) n += f ? 1 : 0;
  return n;
}

}  // namespace zinf::device_optimizer_test
