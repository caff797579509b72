// Scalar reference of kernels/adam.cu, and the per-step scalars both use.
#include <cmath>

#include "base/assert.hpp"
#include "kernels/adam.h"
#include "zinf/dtype.hpp"

// The reference must round after every operation, as the kernel does (it uses _rn intrinsics),
// so that the two agree bit for bit. GCC contracts a * b + c into an FMA by default in C++ when
// the target has FMA (-march=native, say); turn that off for this file.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace zinf::kernels {

AdamStepArgs adam_step_args(const AdamHyper& hyper, std::int64_t step) {
  ZINF_ASSERT(step >= 1);
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(hyper.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(hyper.beta2), t);
  AdamStepArgs args{};
  args.lr = hyper.lr;
  args.beta1 = hyper.beta1;
  args.beta2 = hyper.beta2;
  args.eps = hyper.eps;
  args.weight_decay = hyper.weight_decay;
  args.adamw = hyper.adamw;
  args.step_size = static_cast<float>(static_cast<double>(hyper.lr) / bc1);
  args.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  args.decay_factor =
      hyper.adamw ? static_cast<float>(1.0 - static_cast<double>(hyper.lr) * hyper.weight_decay)
                  : 1.0f;
  return args;
}

void adam_step_ref(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                   std::uint16_t* param_half, HalfType half_type, std::size_t count,
                   const AdamStepArgs& args) {
  const float one_minus_beta1 = 1.0f - args.beta1;
  const float one_minus_beta2 = 1.0f - args.beta2;
  for (std::size_t i = 0; i < count; ++i) {
    float p = param[i];
    float g = grad[i];
    if (args.adamw) {
      p = p * args.decay_factor;
    } else {
      g = g + args.weight_decay * p;
    }
    const float m = args.beta1 * exp_avg[i] + one_minus_beta1 * g;
    const float v = args.beta2 * exp_avg_sq[i] + one_minus_beta2 * (g * g);
    const float denom = std::sqrt(v) * args.inv_sqrt_bc2 + args.eps;
    p = p - args.step_size * (m / denom);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (half_type == HalfType::kBf16) param_half[i] = f32_to_bf16(p);
    if (half_type == HalfType::kF16) param_half[i] = f32_to_f16(p);
  }
}

}  // namespace zinf::kernels
