// The Adam/AdamW reference against the torch.optim formulas evaluated here in double precision
// over several steps, and against what a user would check on the first step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "base/random.hpp"
#include "kernels/adam.h"
#include "zinf/dtype.hpp"

namespace zinf::kernels {
namespace {

struct DoubleState {
  std::vector<double> p, m, v;
};

// torch.optim.Adam / AdamW, written from their documentation, in double.
void adam_double(DoubleState& s, const std::vector<float>& grad, const AdamHyper& h,
                 std::int64_t step) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(step));
  for (std::size_t i = 0; i < s.p.size(); ++i) {
    double g = grad[i];
    if (h.adamw) {
      s.p[i] *= 1.0 - static_cast<double>(h.lr) * h.weight_decay;
    } else {
      g += static_cast<double>(h.weight_decay) * s.p[i];
    }
    s.m[i] = h.beta1 * s.m[i] + (1.0 - h.beta1) * g;
    s.v[i] = h.beta2 * s.v[i] + (1.0 - h.beta2) * g * g;
    const double m_hat = s.m[i] / bc1;
    const double v_hat = s.v[i] / bc2;
    s.p[i] -= h.lr * m_hat / (std::sqrt(v_hat) + h.eps);
  }
}

struct Case {
  std::size_t count;
  bool adamw;
  HalfType half;
};

class AdamRef : public ::testing::TestWithParam<Case> {};

TEST_P(AdamRef, FiveStepsMatchDoublePrecisionTorchFormulas) {
  const Case c = GetParam();
  AdamHyper hyper;
  hyper.lr = 1e-2f;
  hyper.weight_decay = 0.1f;
  hyper.adamw = c.adamw;
  std::vector<float> p(c.count), g(c.count), m(c.count, 0.0f), v(c.count, 0.0f);
  std::vector<std::uint16_t> half(c.count, 0);
  fill_uniform(p.data(), c.count, 0xada + c.count, -1.0f, 1.0f);
  DoubleState ref{std::vector<double>(p.begin(), p.end()), std::vector<double>(c.count, 0.0),
                  std::vector<double>(c.count, 0.0)};
  for (std::int64_t step = 1; step <= 5; ++step) {
    fill_uniform(g.data(), c.count, 0x9a + static_cast<std::uint64_t>(step), -2.0f, 2.0f);
    adam_step_ref(p.data(), g.data(), m.data(), v.data(),
                  c.half == HalfType::kNone ? nullptr : half.data(), c.half, c.count,
                  adam_step_args(hyper, step));
    adam_double(ref, g, hyper, step);
  }
  for (std::size_t i = 0; i < c.count; ++i) {
    ASSERT_NEAR(p[i], ref.p[i], 1e-6 + 1e-5 * std::fabs(ref.p[i])) << "param " << i;
    ASSERT_NEAR(m[i], ref.m[i], 1e-6 + 1e-5 * std::fabs(ref.m[i])) << "exp_avg " << i;
    ASSERT_NEAR(v[i], ref.v[i], 1e-7 + 1e-5 * std::fabs(ref.v[i])) << "exp_avg_sq " << i;
    if (c.half == HalfType::kBf16) {
      ASSERT_EQ(half[i], f32_to_bf16(p[i])) << i;
    } else if (c.half == HalfType::kF16) {
      ASSERT_EQ(half[i], f32_to_f16(p[i])) << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, AdamRef,
    ::testing::Values(Case{0, false, HalfType::kNone}, Case{1, false, HalfType::kBf16},
                      Case{7, true, HalfType::kF16}, Case{1029, false, HalfType::kNone},
                      Case{1029, true, HalfType::kBf16}, Case{65539, true, HalfType::kNone}));

// With m = v = 0, the first step is lr * g / (|g| + eps) = lr * sign(g) for |g| >> eps:
// every parameter moves by lr against its gradient's sign, whatever the gradient's size.
TEST(AdamRefFirstStep, MovesEachParameterByLrAgainstItsGradient) {
  const std::size_t count = 101;
  std::vector<float> p(count), g(count), m(count, 0.0f), v(count, 0.0f);
  fill_uniform(p.data(), count, 1, -1.0f, 1.0f);
  fill_uniform(g.data(), count, 2, -1e3f, 1e3f);
  const std::vector<float> before = p;
  AdamHyper hyper;
  hyper.lr = 0.01f;
  adam_step_ref(p.data(), g.data(), m.data(), v.data(), nullptr, HalfType::kNone, count,
                adam_step_args(hyper, 1));
  for (std::size_t i = 0; i < count; ++i) {
    ASSERT_NEAR(p[i] - before[i], g[i] > 0 ? -0.01f : 0.01f, 1e-6f) << i;
  }
}

// AdamW with a zero gradient only decays: p <- p * (1 - lr * wd); Adam (L2) moves the parameter
// by lr against its sign instead, since the decay enters through the gradient.
TEST(AdamRefWeightDecay, DecoupledDecayScalesParameters) {
  const std::size_t count = 13;
  std::vector<float> p(count), g(count, 0.0f), m(count, 0.0f), v(count, 0.0f);
  fill_uniform(p.data(), count, 3, 0.5f, 2.0f);
  const std::vector<float> before = p;
  AdamHyper hyper;
  hyper.lr = 0.1f;
  hyper.weight_decay = 0.5f;
  hyper.adamw = true;
  adam_step_ref(p.data(), g.data(), m.data(), v.data(), nullptr, HalfType::kNone, count,
                adam_step_args(hyper, 1));
  for (std::size_t i = 0; i < count; ++i) EXPECT_FLOAT_EQ(p[i], before[i] * 0.95f) << i;
  p = before;
  hyper.adamw = false;
  adam_step_ref(p.data(), g.data(), m.data(), v.data(), nullptr, HalfType::kNone, count,
                adam_step_args(hyper, 1));
  for (std::size_t i = 0; i < count; ++i) EXPECT_NEAR(p[i], before[i] - 0.1f, 1e-6f) << i;
}

}  // namespace
}  // namespace zinf::kernels
