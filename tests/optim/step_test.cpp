// optimizer_step() as a caller uses it: results that do not depend on threads or tiles, 200
// steps of AdamW that track a double-precision run, the inf/NaN check that leaves the state
// untouched, argument errors, ZINF_SIMD, and values worked out by hand from torch's formulas.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>
#include <vector>

#include "base/cpu.hpp"
#include "base/random.hpp"
#include "common/counting_new.hpp"
#include "optim/optim_util.hpp"

namespace zinf::optim_test {
namespace {

OptimizerSpan scalar_span(float* p, float* m, float* v, const float* g, std::size_t count) {
  OptimizerSpan s;
  s.params = p;
  s.exp_avg = m;
  s.exp_avg_sq = v;
  s.grads = g;
  s.count = count;
  return s;
}

TEST(Step, BitwiseIdenticalForAnyThreadCountAndTileSize) {
  const std::size_t count = 200003;
  const std::uint64_t seed = 0x7b1e5;
  fmt::print("seed {}\n", seed);
  struct Variant {
    OptimizerKind kind;
    DType grad_dtype;
    bool half;
  };
  for (const Variant& variant : {Variant{OptimizerKind::kAdamW, DType::kBF16, true},
                                 Variant{OptimizerKind::kAdam, DType::kF32, false},
                                 Variant{OptimizerKind::kLion, DType::kF16, true}}) {
    OptimizerParams hp;
    hp.kind = variant.kind;
    Problem reference(count, variant.grad_dtype, variant.half, DType::kBF16, 3, {}, seed);
    StepOptions options;
    options.step = 7;
    options.threads = 1;
    options.tile_elements = count;  // one tile, one thread
    OptimizerSpan span = reference.span();
    ASSERT_TRUE(optimizer_step(hp, span, options).is_ok());
    for (int threads : {1, 2, 3, cpu_count()}) {
      for (std::size_t tile : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096},
                               std::size_t{65537}}) {
        if (tile == 1 && threads != 2) continue;  // 200k one-element tiles: once is enough
        Problem problem(count, variant.grad_dtype, variant.half, DType::kBF16, 3, {}, seed);
        options.threads = threads;
        options.tile_elements = tile;
        span = problem.span();
        ASSERT_TRUE(optimizer_step(hp, span, options).is_ok());
        EXPECT_TRUE(problem.same_bits(reference))
            << optimizer_name(variant.kind) << " threads " << threads << " tile " << tile;
      }
    }
    // The other paths, tiled, agree with it too.
    for (Simd simd : {Simd::kAvx2, Simd::kScalar}) {
      if (!resolve_simd(simd).is_ok()) continue;
      Problem problem(count, variant.grad_dtype, variant.half, DType::kBF16, 3, {}, seed);
      StepOptions forced = options;
      forced.simd = simd;
      forced.threads = 2;
      forced.tile_elements = 1001;
      span = problem.span();
      ASSERT_TRUE(optimizer_step(hp, span, forced).is_ok());
      EXPECT_TRUE(problem.same_bits(reference))
          << optimizer_name(variant.kind) << " " << simd_name(simd) << " tiled";
    }
    // threads = 0 runs in the caller's arena.
    Problem problem(count, variant.grad_dtype, variant.half, DType::kBF16, 3, {}, seed);
    options.threads = 0;
    options.tile_elements = 1000;
    span = problem.span();
    tbb::task_arena arena(2);
    arena.execute([&] { ASSERT_TRUE(optimizer_step(hp, span, options).is_ok()); });
    EXPECT_TRUE(problem.same_bits(reference)) << optimizer_name(variant.kind) << " in an arena";
  }
}

// 200 steps of AdamW on a random quadratic, loss = sum_i h_i (p_i - t_i)^2 / 2 plus gradient
// noise, each run computing its gradients from its own parameters: the float kernels against the
// same optimizer in double. Each element's error is judged relative to the largest magnitude
// that element had along the double trajectory.
TEST(Step, AdamW200StepsTrackDoubleReference) {
  const std::size_t count = 5001;
  const int steps = 200;
  const std::uint64_t seed = 0xada3;
  fmt::print("seed {}\n", seed);
  OptimizerParams hp;  // torch AdamW defaults, weight_decay 0.01
  hp.lr = 1e-2;
  SplitMix64 rng(seed);
  std::vector<double> curvature(count), target(count), p0(count);
  for (std::size_t i = 0; i < count; ++i) {
    curvature[i] = 0.1 + 10.0 * rng.uniform();
    target[i] = 2.0 * rng.uniform() - 1.0;
    p0[i] = 2.0 * rng.uniform() - 1.0;
  }
  auto noise = [&](int step, std::size_t i) {
    SplitMix64 r(seed ^ (static_cast<std::uint64_t>(step) << 32) ^ i);
    return 0.1 * (2.0 * r.uniform() - 1.0);
  };
  // The double run, from the formulas.
  std::vector<double> dp = p0, dm(count, 0.0), dv(count, 0.0), magnitude(count, 0.0);
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t i = 0; i < count; ++i) {
      // The float run sees its gradient rounded to f32; so does this one.
      const double g = static_cast<float>(curvature[i] * (dp[i] - target[i]) + noise(t, i));
      const RefElement r = reference_element(hp, t, 1.0, dp[i], dm[i], dv[i], g);
      dp[i] = r.param;
      dm[i] = r.exp_avg;
      dv[i] = r.exp_avg_sq;
      magnitude[i] = std::max(magnitude[i], std::fabs(dp[i]));
    }
  }
  for (const Path& path : available_paths()) {
    std::vector<float> p(count), m(count, 0.0f), v(count, 0.0f), g(count);
    for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<float>(p0[i]);
    for (int t = 1; t <= steps; ++t) {
      for (std::size_t i = 0; i < count; ++i) {
        g[i] = static_cast<float>(curvature[i] * (p[i] - target[i]) + noise(t, i));
      }
      StepOptions options;
      options.step = t;
      OptimizerSpan span = scalar_span(p.data(), m.data(), v.data(), g.data(), count);
      ASSERT_TRUE(optim::step_with(*path.table, path.simd, hp, span, options).is_ok());
    }
    double worst = 0;
    for (std::size_t i = 0; i < count; ++i) {
      worst = std::max(worst, std::fabs(p[i] - dp[i]) / magnitude[i]);
    }
    fmt::print("{}: worst relative error after {} steps {:.3g}\n", path.name, steps, worst);
    EXPECT_LE(worst, 1e-5) << path.name;
    // And the run did optimise: parameters moved towards their targets.
    double before = 0, after = 0;
    for (std::size_t i = 0; i < count; ++i) {
      before += std::fabs(p0[i] - target[i]);
      after += std::fabs(p[i] - target[i]);
    }
    EXPECT_LT(after, 0.5 * before) << path.name;
  }
}

TEST(Step, OverflowCheckReportsAndLeavesStateUntouched) {
  const std::uint64_t seed = 0x0fe1;
  fmt::print("seed {}\n", seed);
  SplitMix64 rng(seed);
  const float bad_values[] = {std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
  for (const Path& path : available_paths()) {
    for (DType grad_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (float bad : bad_values) {
        const std::size_t count = 1000 + rng.next() % 100000;
        const std::size_t position = rng.next() % count;
        Problem problem(count, grad_dtype, true, DType::kBF16, 1, {}, rng.next());
        problem.set_grad(position, bad);
        const Problem before = problem;
        StepOptions options;
        options.check_overflow = true;
        options.tile_elements = 4096;
        OptimizerParams hp;
        OptimizerSpan span = problem.span();
        const Result<StepResult> result =
            optim::step_with(*path.table, path.simd, hp, span, options);
        ASSERT_TRUE(result.is_ok());
        EXPECT_TRUE(result->overflow) << path.name << " " << dtype_name(grad_dtype) << " " << bad
                                      << " at " << position << " of " << count;
        EXPECT_TRUE(problem.same_bits(before)) << path.name << " wrote despite the overflow";
      }
      // Finite gradients, including the largest finite value of the format: the step runs.
      Problem problem(777, grad_dtype, false, DType::kBF16, 1, {}, rng.next());
      problem.set_grad(5, grad_dtype == DType::kF16 ? 65504.0f : 3e38f);
      const Problem before = problem;
      StepOptions options;
      options.check_overflow = true;
      OptimizerSpan span = problem.span();
      const Result<StepResult> result = optim::step_with(*path.table, path.simd, {}, span, options);
      ASSERT_TRUE(result.is_ok());
      EXPECT_FALSE(result->overflow) << path.name << " " << dtype_name(grad_dtype);
      EXPECT_FALSE(problem.same_bits(before)) << path.name << ": the step did not run";
    }
  }
}

TEST(Step, AllFiniteFindsANonFiniteValueAtEveryPosition) {
  for (const Path& path : available_paths()) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (std::size_t count : {std::size_t{1}, std::size_t{37}, std::size_t{100}}) {
        for (std::size_t position = 0; position < count; ++position) {
          Problem problem(count, dtype, false, DType::kBF16, 2, {}, 0xf1 + position);
          EXPECT_TRUE(path.table->finite(problem.grad_data(), dtype, 0, count));
          problem.set_grad(position, std::numeric_limits<float>::infinity());
          EXPECT_FALSE(path.table->finite(problem.grad_data(), dtype, 0, count))
              << path.name << " " << dtype_name(dtype) << " " << position << "/" << count;
          // Outside the range asked about, it does not count.
          if (position > 0) {
            EXPECT_TRUE(path.table->finite(problem.grad_data(), dtype, 0, position));
          }
        }
      }
    }
  }
  std::vector<float> data(100000, 1.0f);
  data[99999] = std::numeric_limits<float>::quiet_NaN();
  StepOptions options;
  options.tile_elements = 1000;
  EXPECT_FALSE(*all_finite(data.data(), DType::kF32, data.size(), options));
  EXPECT_TRUE(*all_finite(data.data(), DType::kF32, data.size() - 1, options));
}

// narrow_to_half against the scalar conversions (f32_to_bf16 / f32_to_f16), on every SIMD path
// and over several threads: random bit patterns (NaNs, infinities, subnormals and the rounding
// boundaries among them), with a count that leaves a partial tile.
TEST(Step, NarrowToHalfGivesTheScalarConversionsBits) {
  const std::size_t count = 70001;
  SplitMix64 rng(0x4a11);
  std::vector<float> src(count);
  for (float& x : src) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng.next()));
  src[0] = std::numeric_limits<float>::quiet_NaN();
  src[1] = -std::numeric_limits<float>::infinity();
  src[2] = std::bit_cast<float>(0x3f808000u);  // a bf16 tie
  for (const Path& path : available_paths()) {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      StepOptions options;
      options.simd = path.simd;
      options.threads = 2;
      options.tile_elements = 4096;
      std::vector<std::uint16_t> got(count, 0x5a5a);
      ASSERT_TRUE(narrow_to_half(src.data(), got.data(), dtype, count, options).is_ok());
      for (std::size_t i = 0; i < count; ++i) {
        const std::uint16_t want = dtype == DType::kBF16 ? f32_to_bf16(src[i]) : f32_to_f16(src[i]);
        ASSERT_EQ(got[i], want) << path.name << " " << dtype_name(dtype) << " element " << i;
      }
    }
  }
  std::uint16_t out = 0;
  EXPECT_EQ(narrow_to_half(src.data(), &out, DType::kF32, 1).code(), Code::kInvalidArgument);
  EXPECT_EQ(narrow_to_half(nullptr, &out, DType::kBF16, 1).code(), Code::kInvalidArgument);
}

TEST(Step, RejectsBadArgumentsWithoutWriting) {
  std::vector<float> p(10, 1.0f), m(10, 0.5f), v(10, 0.25f), g(10, 0.125f);
  const std::vector<float> p_before = p;
  auto expect_invalid = [&](const OptimizerParams& hp, OptimizerSpan span, StepOptions options,
                            const char* what) {
    const Result<StepResult> result = optimizer_step(hp, span, options);
    ASSERT_FALSE(result.is_ok()) << what;
    EXPECT_EQ(result.status().code(), Code::kInvalidArgument) << what;
    EXPECT_FALSE(result.status().message().empty());
    EXPECT_EQ(p, p_before) << what;
  };
  const OptimizerSpan good = scalar_span(p.data(), m.data(), v.data(), g.data(), 10);
  OptimizerSpan span = good;
  span.exp_avg = nullptr;
  expect_invalid({}, span, {}, "adamw without exp_avg");
  span = good;
  span.grads = nullptr;
  expect_invalid({}, span, {}, "no grads");
  span = good;
  span.params_half = p.data();
  span.half_dtype = DType::kF32;
  expect_invalid({}, span, {}, "f32 half copy");
  StepOptions options;
  options.step = 0;
  expect_invalid({}, good, options, "step 0");
  OptimizerParams hp;
  hp.beta2 = 1.0;
  expect_invalid(hp, good, {}, "beta2 = 1");
  hp = {};
  hp.lr = std::numeric_limits<double>::quiet_NaN();
  expect_invalid(hp, good, {}, "lr NaN");
  // Adagrad needs no exp_avg, Lion no exp_avg_sq.
  hp = {};
  hp.kind = OptimizerKind::kAdagrad;
  span = good;
  span.exp_avg = nullptr;
  EXPECT_TRUE(optimizer_step(hp, span, {}).is_ok());
  hp.kind = OptimizerKind::kLion;
  span = good;
  span.exp_avg_sq = nullptr;
  EXPECT_TRUE(optimizer_step(hp, span, {}).is_ok());
}

TEST(Step, SimdFromOptionAndEnvironment) {
  std::vector<float> p(40, 1.0f), m(40, 0.5f), v(40, 0.25f), g(40, 0.125f);
  const OptimizerSpan span = scalar_span(p.data(), m.data(), v.data(), g.data(), 40);
  const char* saved = std::getenv("ZINF_SIMD");
  const std::string saved_value = saved != nullptr ? saved : "";
  setenv("ZINF_SIMD", "scalar", 1);
  Result<StepResult> result = optimizer_step({}, span, {});
  ASSERT_TRUE(result.is_ok());
  EXPECT_EQ(result->simd, Simd::kScalar);
  if (cpu_features().has_avx2_path()) {
    StepOptions options;
    options.simd = Simd::kAvx2;  // an explicit option wins over the environment
    result = optimizer_step({}, span, options);
    ASSERT_TRUE(result.is_ok());
    EXPECT_EQ(result->simd, Simd::kAvx2);
  }
  setenv("ZINF_SIMD", "avx9000", 1);
  result = optimizer_step({}, span, {});
  ASSERT_FALSE(result.is_ok());
  EXPECT_EQ(result.status().code(), Code::kInvalidArgument);
  EXPECT_NE(result.status().message().find("ZINF_SIMD"), std::string_view::npos);
  if (saved != nullptr) {
    setenv("ZINF_SIMD", saved_value.c_str(), 1);
  } else {
    unsetenv("ZINF_SIMD");
  }
  if (!cpu_features().has_avx512_path()) {
    StepOptions options;
    options.simd = Simd::kAvx512;
    result = optimizer_step({}, span, options);
    ASSERT_FALSE(result.is_ok());
    EXPECT_EQ(result.status().code(), Code::kUnsupported);
  }
}

// Values worked out by hand from the torch formulas, on every path.
TEST(Step, HandComputedValues) {
  for (const Path& path : available_paths()) {
    // AdamW, step 1: m_hat = g and v_hat = g^2, so p moves by lr * g / (|g| + eps) after the
    // decay p * (1 - lr * wd): 2 * (1 - 1e-3 * 1e-2) - 1e-3 * 0.5 / (0.5 + 1e-8) = 1.99898000002.
    {
      float p = 2.0f, m = 0.0f, v = 0.0f, g = 0.5f;
      OptimizerParams hp;
      ASSERT_TRUE(
          optim::step_with(*path.table, path.simd, hp, scalar_span(&p, &m, &v, &g, 1), {}).is_ok());
      EXPECT_FLOAT_EQ(p, 1.99898f) << path.name;
      EXPECT_FLOAT_EQ(m, 0.05f) << path.name;
      EXPECT_FLOAT_EQ(v, 0.00025f) << path.name;
    }
    // Adagrad with L2 decay, torch numerator: g = 0.5 + 0.1 * 2 = 0.7, s = 0.49,
    // p = 2 - 0.1 * 0.7 / 0.7 = 1.9. (DeepSpeed's numerator would give 2 - 0.1 * 0.5 / 0.7.)
    {
      float p = 2.0f, v = 0.0f, g = 0.5f;
      OptimizerParams hp;
      hp.kind = OptimizerKind::kAdagrad;
      hp.lr = 0.1;
      hp.weight_decay = 0.1;
      hp.eps = 1e-10;
      ASSERT_TRUE(
          optim::step_with(*path.table, path.simd, hp, scalar_span(&p, nullptr, &v, &g, 1), {})
              .is_ok());
      EXPECT_FLOAT_EQ(p, 1.9f) << path.name;
      EXPECT_FLOAT_EQ(v, 0.49f) << path.name;
    }
    // Lion: p = 1 * (1 - 1e-4 * 0.1) = 0.99999; c = 0.9 * 0.2 + 0.1 * -1 = 0.08 > 0, so
    // p = 0.99999 - 1e-4 = 0.99989; m = 0.99 * 0.2 + 0.01 * -1 = 0.188.
    {
      float p = 1.0f, m = 0.2f, g = -1.0f;
      OptimizerParams hp;
      hp.kind = OptimizerKind::kLion;
      hp.lr = 1e-4;
      hp.beta2 = 0.99;
      hp.weight_decay = 0.1;
      ASSERT_TRUE(
          optim::step_with(*path.table, path.simd, hp, scalar_span(&p, &m, nullptr, &g, 1), {})
              .is_ok());
      EXPECT_FLOAT_EQ(p, 0.99989f) << path.name;
      EXPECT_FLOAT_EQ(m, 0.188f) << path.name;
    }
  }
}

// A user's check of Adam's best-known property: on the first step every parameter whose
// gradient is well above eps moves by lr against the sign of its gradient.
TEST(Step, FirstAdamStepMovesEveryParameterByLr) {
  const std::size_t count = 10007;
  Problem problem(count, DType::kBF16, false, DType::kBF16, 0, {}, 0xf125);
  std::fill(problem.exp_avg(), problem.exp_avg() + count, 0.0f);
  std::fill(problem.exp_avg_sq(), problem.exp_avg_sq() + count, 0.0f);
  const std::vector<float> before(problem.params(), problem.params() + count);
  OptimizerParams hp;
  hp.kind = OptimizerKind::kAdam;
  hp.weight_decay = 0.0;
  OptimizerSpan span = problem.span();
  ASSERT_TRUE(optimizer_step(hp, span, {}).is_ok());
  for (std::size_t i = 0; i < count; ++i) {
    if (std::fabs(problem.grad(i)) < 1e-4f) continue;
    const double moved = static_cast<double>(before[i]) - problem.params()[i];
    EXPECT_NEAR(moved, hp.lr * (problem.grad(i) > 0 ? 1.0 : -1.0), 1e-3 * hp.lr) << i;
  }
}

// The step path allocates nothing once warm (DESIGN: nothing allocated on hot paths), when run
// in the caller's arena (threads = 0).
using zinf::test::g_allocations;
using zinf::test::g_count_allocations;

TEST(Step, AllocatesNothingWhenWarm) {
  Problem problem(100000, DType::kBF16, true, DType::kBF16, 0, {}, 0xa110c);
  OptimizerSpan span = problem.span();
  StepOptions options;
  options.check_overflow = true;
  options.tile_elements = 4096;
  // The counter does see an allocation.
  g_count_allocations = true;
  delete new std::vector<int>(3);
  g_count_allocations = false;
  ASSERT_GE(g_allocations.load(), 1u);
  tbb::task_arena arena(2);
  arena.execute([&] {
    ASSERT_TRUE(optimizer_step({}, span, options).is_ok());  // warm-up
    g_allocations = 0;
    g_count_allocations = true;
    for (int step = 2; step < 5; ++step) {
      options.step = step;
      const bool ok = optimizer_step({}, span, options).is_ok();
      g_count_allocations = false;
      ASSERT_TRUE(ok);
      g_count_allocations = true;
    }
    g_count_allocations = false;
  });
  EXPECT_EQ(g_allocations.load(), 0u);
  // And with a thread count, which uses an arena kept from the first call.
  options.threads = 2;
  ASSERT_TRUE(optimizer_step({}, span, options).is_ok());  // warm-up: makes the arena
  g_allocations = 0;
  g_count_allocations = true;
  const bool ok = optimizer_step({}, span, options).is_ok();
  g_count_allocations = false;
  ASSERT_TRUE(ok);
  EXPECT_EQ(g_allocations.load(), 0u);
}

}  // namespace
}  // namespace zinf::optim_test
