// Every SIMD path against a double-precision reference of the torch formulas, on random data of
// odd lengths, unaligned starts and large and tiny magnitudes: fp32 results within 1e-6 of the
// reference relative to the size of their terms; half-precision copies exactly the rounding of
// the fp32 result; and every path bitwise identical to the scalar path.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "optim/optim_util.hpp"

namespace zinf::optim_test {
namespace {

constexpr double kRelTol = 1e-6;
// Lets a result that lands among the f32 subnormals be off by their spacing.
constexpr double kAbsFloor = static_cast<double>(FLT_MIN) * 1e-6;

struct Case {
  OptimizerParams hp;
  std::int64_t step;
  float grad_scale;
  Magnitudes magnitudes;
  std::size_t count;
  std::size_t offset;
};

// Cases for one optimizer kind: every combination gets odd lengths, unaligned starts, a step
// number, weight decay on or off, and magnitudes from tiny to large (limited to what the
// gradient dtype can hold).
std::vector<Case> make_cases(OptimizerKind kind, DType grad_dtype, std::uint64_t seed) {
  std::vector<Case> cases;
  SplitMix64 rng(seed);
  const std::vector<std::size_t> counts = {1, 7, 15, 16, 17, 31, 33, 257, 1001, 4099};
  std::vector<Magnitudes> magnitudes = {{1.0, 1.0}, {1e-6, 1e-3}, {1e3, 10.0}};
  if (grad_dtype != DType::kF16) {
    // f16 holds neither of these gradient scales; f32 and bf16 hold both.
    magnitudes.push_back({1e-30, 1e-15});
    magnitudes.push_back({1e15, 1e15});  // g * g and (g + wd * p)^2 stay finite in f32
  }
  const std::int64_t steps[] = {1, 2, 10, 1000};
  int index = 0;
  for (const Magnitudes& mag : magnitudes) {
    for (std::size_t count : counts) {
      Case c;
      c.hp.kind = kind;
      // Large rates and decays in some cases, so a wrong constant shows above the tolerance.
      c.hp.lr = (index % 2 ? 0.1 : 1.0) * (kind == OptimizerKind::kLion ? 1e-4 : 1e-3);
      if (index % 4 == 1) c.hp.lr = 0.1;
      c.hp.beta2 = kind == OptimizerKind::kLion ? 0.99 : 0.999;
      c.hp.eps = kind == OptimizerKind::kAdagrad ? 1e-10 : 1e-8;
      c.hp.weight_decay = (index % 3 == 2) ? 0.0 : (index % 3 == 1 ? 0.5 : 0.01);
      c.hp.bias_correction = index % 4 != 3;
      c.hp.lr_decay = kind == OptimizerKind::kAdagrad && index % 2 ? 0.01 : 0.0;
      c.step = steps[rng.next() % 4];
      c.grad_scale = index % 5 == 4 ? 1.0f / 1024.0f : 1.0f;
      c.magnitudes = mag;
      c.count = count;
      c.offset = 1 + rng.next() % 15;
      cases.push_back(c);
      ++index;
    }
  }
  return cases;
}

bool within(double got, double want, double scale) {
  return std::fabs(got - want) <= kRelTol * scale + kAbsFloor;
}

// Runs `path` on the case and checks every element against the reference. Returns the problem
// after the update, for the bitwise comparison between paths.
Problem run_and_check(const Path& path, const Case& c, DType grad_dtype, int out_kind,
                      std::uint64_t seed, int* failures) {
  const bool with_half = out_kind != 0;
  const DType half_dtype = out_kind == 2 ? DType::kF16 : DType::kBF16;
  Problem before(c.count, grad_dtype, with_half, half_dtype, c.offset, c.magnitudes, seed);
  Problem after = before;
  StepOptions options;
  options.step = c.step;
  options.grad_scale = c.grad_scale;
  OptimizerSpan span = after.span();
  const Result<StepResult> result = optim::step_with(*path.table, path.simd, c.hp, span, options);
  EXPECT_TRUE(result.is_ok()) << result.status().to_string();
  const auto name = optimizer_name(c.hp.kind);
  for (std::size_t i = 0; i < c.count && *failures < 10; ++i) {
    Problem& b = before;
    const RefElement r = reference_element(c.hp, c.step, c.grad_scale, b.params()[i],
                                           b.exp_avg()[i], b.exp_avg_sq()[i], b.grad(i));
    const float p = after.params()[i];
    bool ok = within(p, r.param, r.param_scale);
    if (!ok && r.sign_ambiguous) {
      for (double s : {-1.0, 0.0, 1.0}) {
        ok = ok || within(p, r.param_decayed - c.hp.lr * s, r.param_scale);
      }
    }
    if (c.hp.kind == OptimizerKind::kAdagrad) {
      ok = ok && after.exp_avg()[i] == b.exp_avg()[i];
    } else {
      ok = ok && within(after.exp_avg()[i], r.exp_avg, r.exp_avg_scale);
    }
    if (c.hp.kind == OptimizerKind::kLion) {
      ok = ok && after.exp_avg_sq()[i] == b.exp_avg_sq()[i];
    } else {
      ok = ok && within(after.exp_avg_sq()[i], r.exp_avg_sq, r.exp_avg_sq_scale);
    }
    if (with_half) ok = ok && after.half()[i] == round_half(p, half_dtype);
    if (!ok) {
      ++*failures;
      ADD_FAILURE() << fmt::format(
          "{} {} grad {} out {} count {} offset {} step {} wd {} element {}: p {} (ref {}, scale "
          "{}), m {} (ref {}), v {} (ref {}), half {:#06x} (want {:#06x}) seed {}",
          path.name, name, dtype_name(grad_dtype), out_kind, c.count, c.offset, c.step,
          c.hp.weight_decay, i, p, r.param, r.param_scale, after.exp_avg()[i], r.exp_avg,
          after.exp_avg_sq()[i], r.exp_avg_sq, with_half ? after.half()[i] : 0,
          with_half ? round_half(p, half_dtype) : 0, seed);
    }
  }
  return after;
}

class KernelAccuracy : public ::testing::TestWithParam<OptimizerKind> {};

TEST_P(KernelAccuracy, EveryPathMatchesDoubleReferenceAndScalarBits) {
  const OptimizerKind kind = GetParam();
  const std::vector<Path> paths = available_paths();
  int failures = 0;
  std::uint64_t seed = 0x0b71 + static_cast<std::uint64_t>(kind) * 1000;
  for (DType grad_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int out_kind = 0; out_kind < 3; ++out_kind) {
      for (const Case& c : make_cases(kind, grad_dtype, seed)) {
        ++seed;
        std::vector<Problem> results;
        for (const Path& path : paths) {
          results.push_back(run_and_check(path, c, grad_dtype, out_kind, seed, &failures));
        }
        for (std::size_t k = 1; k < results.size(); ++k) {
          if (!results[k].same_bits(results[0])) {
            ++failures;
            ADD_FAILURE() << fmt::format(
                "{} differs from scalar: {} grad {} out {} count {} seed {}", paths[k].name,
                optimizer_name(kind), dtype_name(grad_dtype), out_kind, c.count, seed);
          }
        }
        if (failures >= 10) return;
      }
    }
  }
}

// The bf16/f16 conversion of every path against f32_to_bf16 / f32_to_f16, bit for bit: every
// sign/exponent/top-mantissa pattern (the high 16 bits) with low bits that hit the rounding
// ties of both formats, their neighbours and random bits. Covers zeros, denormals (which
// VCVTNEPS2BF16 flushes and the AVX-512 path must redo), infinities, quiet and signalling NaNs
// with and without payload, and overflow to infinity.
TEST(HalfConversion, EveryPathRoundsExactlyLikeTheScalarConversion) {
  std::uint64_t seed = 0xc0417;
  fmt::print("seed {}\n", seed);
  SplitMix64 rng(seed);
  std::vector<float> values;
  const std::uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff,
                                0x0fff, 0x1000, 0x1001, 0x2000, 0x3000};
  for (std::uint32_t hi = 0; hi < 0x10000; ++hi) {
    for (std::uint32_t lo : lows) values.push_back(std::bit_cast<float>(hi << 16 | lo));
    values.push_back(
        std::bit_cast<float>(hi << 16 | static_cast<std::uint32_t>(rng.next() & 0xffff)));
  }
  const std::size_t begin = 3;  // an unaligned start and an odd tail
  for (const Path& path : available_paths()) {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      std::vector<std::uint16_t> out(values.size(), 0x5a5a);
      path.table->convert(values.data(), out.data(), dtype, begin, values.size());
      int failures = 0;
      for (std::size_t i = 0; i < values.size() && failures < 5; ++i) {
        const std::uint16_t want = i < begin ? 0x5a5a : round_half(values[i], dtype);
        if (out[i] != want) {
          ++failures;
          ADD_FAILURE() << fmt::format("{} {}: f32 bits {:#010x} -> {:#06x}, want {:#06x}",
                                       path.name, dtype_name(dtype),
                                       std::bit_cast<std::uint32_t>(values[i]), out[i], want);
        }
      }
    }
  }
}

// The half copy written by the update itself, for parameters that are denormal, infinite, NaN
// or at the top of the range: with lr = 0 the update leaves p as it is, so the copy must be the
// rounding of p exactly, on every path.
TEST(HalfConversion, UpdateWritesExactRoundingOfSpecialParams) {
  std::vector<float> specials = {std::bit_cast<float>(0x00000001u),
                                 std::bit_cast<float>(0x80400000u),
                                 std::bit_cast<float>(0x007f8000u),
                                 std::bit_cast<float>(0x00018000u),
                                 std::numeric_limits<float>::infinity(),
                                 -std::numeric_limits<float>::infinity(),
                                 std::bit_cast<float>(0x7fc00001u),
                                 std::bit_cast<float>(0xffa50000u),
                                 std::bit_cast<float>(0x7f800001u),
                                 FLT_MAX,
                                 -FLT_MAX,
                                 65519.0f,
                                 65520.0f,
                                 std::bit_cast<float>(0x7f7f8000u),
                                 5.96e-8f,
                                 2.98e-8f,
                                 1.0f + 0x1p-8f,
                                 1e-40f};
  for (const Path& path : available_paths()) {
    for (DType half_dtype : {DType::kBF16, DType::kF16}) {
      const std::size_t count = 3 * specials.size() + 5;
      Problem problem(count, DType::kF32, true, half_dtype, 5, {1.0, 1.0}, 0x5bec);
      for (std::size_t i = 0; i < count; ++i) {
        if (i % 3 != 1) problem.params()[i] = specials[i / 3 % specials.size()];
      }
      std::vector<float> before(problem.params(), problem.params() + count);
      OptimizerParams hp;
      hp.kind = OptimizerKind::kAdam;
      hp.lr = 0.0;
      hp.weight_decay = 0.0;
      OptimizerSpan span = problem.span();
      ASSERT_TRUE(optim::step_with(*path.table, path.simd, hp, span, {}).is_ok());
      for (std::size_t i = 0; i < count; ++i) {
        const float p = problem.params()[i];
        if (!std::isnan(before[i])) {
          EXPECT_EQ(p, before[i]) << path.name << " element " << i;
        } else {
          EXPECT_TRUE(std::isnan(p)) << path.name << " element " << i;
        }
        EXPECT_EQ(problem.half()[i], round_half(p, half_dtype))
            << fmt::format("{} {} element {}: f32 bits {:#010x}", path.name, dtype_name(half_dtype),
                           i, std::bit_cast<std::uint32_t>(p));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, KernelAccuracy,
                         ::testing::Values(OptimizerKind::kAdam, OptimizerKind::kAdamW,
                                           OptimizerKind::kAdagrad, OptimizerKind::kLion),
                         [](const auto& info) { return std::string(optimizer_name(info.param)); });

// One test per path the kernels have: it skips, with the reason, where this CPU cannot run the
// path (so ctest reports what the loops above left out), and otherwise checks that the path is
// among those the loops run, has its own kernels (not the scalar table under another name), and
// rounds seeded random values to bf16 and f16 exactly as the scalar conversion does.
class SimdPaths : public ::testing::TestWithParam<const char*> {};

TEST_P(SimdPaths, RunsHere) {
  std::string why_not;
  const std::optional<Path> path = find_path(GetParam(), &why_not);
  if (!path) {
    GTEST_SKIP() << GetParam() << " path not tested: " << why_not;
  }
  bool listed = false;
  for (const Path& p : available_paths()) listed = listed || p.name == path->name;
  EXPECT_TRUE(listed) << path->name;
  if (path->name != "scalar") {
    EXPECT_NE(path->table, &optim::kernels_scalar());
  }
  std::vector<float> in(4099);
  fill_uniform(in.data(), in.size(), 0x51d + path->name.size(), -1e4f, 1e4f);
  std::vector<std::uint16_t> out(in.size());
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    path->table->convert(in.data(), out.data(), dtype, 0, in.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
      ASSERT_EQ(out[i], round_half(in[i], dtype)) << path->name << " " << dtype_name(dtype) << " "
                                                  << in[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Names, SimdPaths, ::testing::ValuesIn(kPathNames),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace zinf::optim_test
