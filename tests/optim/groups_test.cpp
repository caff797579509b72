// Parameter groups in the CPU kernels: optimizer_step() over ranges with their own lr and
// weight_decay. Each element must match the double-precision reference of its own group's
// hyper-parameters, equal bit for bit one call per range, and be the same on every SIMD path,
// tile size and thread count; bad ranges are refused before anything is written.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "base/random.hpp"
#include "optim/optim_util.hpp"

namespace zinf::optim_test {
namespace {

// Ranges of random lengths (1 to 300 elements) over `count` elements, cycling through
// `group_count` groups in a random order.
std::vector<OptimizerRange> random_ranges(std::size_t count, std::uint32_t group_count,
                                          std::uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<OptimizerRange> ranges;
  std::size_t begin = 0;
  while (begin < count) {
    ranges.push_back({begin, static_cast<std::uint32_t>(rng.next() % group_count)});
    begin += 1 + rng.next() % 300;
  }
  return ranges;
}

std::vector<OptimizerParams> make_groups(OptimizerKind kind) {
  // A decayed group, a decay-free one, and one at a scaled learning rate with its own decay.
  OptimizerParams a;
  a.kind = kind;
  a.lr = 1e-2;
  a.weight_decay = 0.1;
  OptimizerParams b = a;
  b.weight_decay = 0.0;
  OptimizerParams c = a;
  c.lr = 3e-2;
  c.weight_decay = 0.5;
  return {a, b, c};
}

class Groups : public ::testing::TestWithParam<OptimizerKind> {};

TEST_P(Groups, EachRangeStepsWithItsGroupsHyperParameters) {
  const OptimizerKind kind = GetParam();
  const std::vector<OptimizerParams> groups = make_groups(kind);
  const std::size_t count = 5003;
  const std::uint64_t seed = 0x6a0 + static_cast<std::uint64_t>(kind);
  const std::vector<OptimizerRange> ranges = random_ranges(count, 3, seed);
  ASSERT_GT(ranges.size(), 20u);
  StepOptions options;
  options.step = 7;
  options.grad_scale = 0.5f;
  options.tile_elements = 64;  // tiles end inside ranges and ranges inside tiles
  Problem before(count, DType::kBF16, true, DType::kBF16, 3, {}, seed);

  std::vector<Problem> results;
  for (const Path& path : available_paths()) {
    Problem after = before;
    OptimizerSpan span = after.span();
    Result<StepResult> r = optim::step_with(*path.table, path.simd, groups, ranges, span, options);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    int failures = 0;
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const std::size_t end = k + 1 < ranges.size() ? ranges[k + 1].begin : count;
      const OptimizerParams& hp = groups[ranges[k].group];
      for (std::size_t i = ranges[k].begin; i < end && failures < 5; ++i) {
        const RefElement ref =
            reference_element(hp, options.step, options.grad_scale, before.params()[i],
                              before.exp_avg()[i], before.exp_avg_sq()[i], before.grad(i));
        const double p = after.params()[i];
        bool ok = std::fabs(p - ref.param) <= 1e-6 * ref.param_scale;
        if (!ok && ref.sign_ambiguous) {
          for (double s : {-1.0, 0.0, 1.0}) {
            ok = ok || std::fabs(p - (ref.param_decayed - hp.lr * s)) <= 1e-6 * ref.param_scale;
          }
        }
        if (!ok) {
          ++failures;
          ADD_FAILURE() << fmt::format("{} {}: element {} of range {} (group {}): {} want {}",
                                       path.name, optimizer_name(kind), i, k, ranges[k].group, p,
                                       ref.param);
        }
      }
    }
    results.push_back(after);
  }
  // One call per range, on the scalar path, gives the same bits.
  Problem per_range = before;
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    const std::size_t end = k + 1 < ranges.size() ? ranges[k + 1].begin : count;
    Problem& p = per_range;
    OptimizerSpan span = p.span();
    span.params += ranges[k].begin;
    span.exp_avg += ranges[k].begin;
    span.exp_avg_sq += ranges[k].begin;
    span.grads = static_cast<const std::uint16_t*>(span.grads) + ranges[k].begin;
    span.params_half = static_cast<std::uint16_t*>(span.params_half) + ranges[k].begin;
    span.count = end - ranges[k].begin;
    StepOptions o = options;
    o.simd = Simd::kScalar;
    ASSERT_TRUE(optimizer_step(groups[ranges[k].group], span, o).is_ok());
  }
  for (std::size_t k = 0; k < results.size(); ++k) {
    EXPECT_TRUE(results[k].same_bits(per_range)) << available_paths()[k].name;
  }
  // Another tile size and thread count change nothing.
  Problem threaded = before;
  StepOptions o = options;
  o.tile_elements = 1000;
  o.threads = 3;
  OptimizerSpan span = threaded.span();
  ASSERT_TRUE(optimizer_step(groups, ranges, span, o).is_ok());
  EXPECT_TRUE(threaded.same_bits(per_range));
}

INSTANTIATE_TEST_SUITE_P(AllKinds, Groups,
                         ::testing::Values(OptimizerKind::kAdam, OptimizerKind::kAdamW,
                                           OptimizerKind::kAdagrad, OptimizerKind::kLion),
                         [](const auto& info) { return std::string(optimizer_name(info.param)); });

TEST(GroupsRefused, BadRangesAndGroupsWriteNothing) {
  const std::vector<OptimizerParams> groups = make_groups(OptimizerKind::kAdamW);
  Problem before(100, DType::kF32, false, DType::kBF16, 1, {}, 17);
  struct Bad {
    std::vector<OptimizerParams> groups;
    std::vector<OptimizerRange> ranges;
    const char* message;
  };
  OptimizerParams adam = groups[0];
  adam.kind = OptimizerKind::kAdam;
  OptimizerParams negative = groups[0];
  negative.weight_decay = -1;
  const std::vector<Bad> bad = {
      {groups, {}, "begins at element 0"},
      {groups, {{5, 0}}, "begins at element 0"},
      {groups, {{0, 0}, {50, 1}, {50, 2}}, "range 2 begins at element 50"},
      {groups, {{0, 0}, {60, 1}, {40, 2}}, "range 2 begins at element 40"},
      {groups, {{0, 0}, {100, 1}}, "range 1 begins at element 100"},
      {groups, {{0, 0}, {10, 3}}, "names group 3 of 3"},
      {{}, {{0, 0}}, "0 parameter groups"},
      {std::vector<OptimizerParams>(kMaxOptimizerGroups + 1, groups[0]),
       {{0, 0}},
       "65 parameter groups"},
      {{groups[0], adam}, {{0, 0}, {10, 1}}, "different kinds"},
      {{groups[0], negative}, {{0, 0}, {10, 1}}, "parameter group 1"},
  };
  for (const Bad& b : bad) {
    Problem after = before;
    OptimizerSpan span = after.span();
    Result<StepResult> r = optimizer_step(b.groups, b.ranges, span, StepOptions{});
    ASSERT_FALSE(r.is_ok()) << b.message;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find(b.message), std::string::npos) << r.status().to_string();
    EXPECT_TRUE(after.same_bits(before)) << b.message;
  }
}

}  // namespace
}  // namespace zinf::optim_test
