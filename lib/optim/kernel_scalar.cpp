// The scalar path: the reference order of operations for every SIMD path (see kernel.hpp), built
// for baseline x86-64. std::fma is one rounding, exactly as the FMA instructions of the SIMD
// paths; the build uses -ffp-contract=off (ISO C++ mode), so no other multiply-add is fused.
#include <cmath>
#include <cstring>

#include "optim/kernel.hpp"

namespace zinf::optim {
namespace {

enum class Out { kNone, kBF16, kF16 };

template <DType G>
inline float load_grad(const void* grads, std::size_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(grads)[i];
  } else if constexpr (G == DType::kBF16) {
    return bf16_to_f32(static_cast<const std::uint16_t*>(grads)[i]);
  } else {
    return f16_to_f32(static_cast<const std::uint16_t*>(grads)[i]);
  }
}

template <Out O>
inline void store_half(void* out, std::size_t i, float value) {
  if constexpr (O == Out::kBF16) {
    static_cast<std::uint16_t*>(out)[i] = f32_to_bf16(value);
  } else if constexpr (O == Out::kF16) {
    static_cast<std::uint16_t*>(out)[i] = f32_to_f16(value);
  }
}

// sign(c) as torch.sign: -1, 0 or +1, and NaN for NaN.
inline float sign_of(float c) {
  if (c > 0.0f) return 1.0f;
  if (c < 0.0f) return -1.0f;
  if (std::isnan(c)) return c;
  return 0.0f;
}

template <OptimizerKind K, DType G, Out O>
void update_range(const KernelArgs& a, const OptimizerSpan& s, std::size_t begin, std::size_t end) {
  float* params = s.params;
  float* exp_avg = s.exp_avg;
  float* exp_avg_sq = s.exp_avg_sq;
  for (std::size_t i = begin; i < end; ++i) {
    float g = load_grad<G>(s.grads, i) * a.grad_scale;
    float p = params[i];
    if constexpr (K == OptimizerKind::kAdam || K == OptimizerKind::kAdamW) {
      if (a.has_l2) g = std::fma(a.l2, p, g);
      const float m = std::fma(a.omb1, g, a.beta1 * exp_avg[i]);
      const float v = std::fma(a.omb2 * g, g, a.beta2 * exp_avg_sq[i]);
      const float d = std::fma(std::sqrt(v), a.inv_sqrt_bc2, a.eps);
      if (a.has_decay) p = p * a.decay;
      p = std::fma(-a.step_size, m / d, p);
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
    } else if constexpr (K == OptimizerKind::kAdagrad) {
      if (a.has_l2) g = std::fma(a.l2, p, g);
      const float sum = std::fma(g, g, exp_avg_sq[i]);
      const float d = std::sqrt(sum) + a.eps;
      p = std::fma(-a.step_size, g / d, p);
      exp_avg_sq[i] = sum;
    } else {
      if (a.has_decay) p = p * a.decay;
      const float m = exp_avg[i];
      const float c = std::fma(a.omb1, g, a.beta1 * m);
      p = std::fma(-a.step_size, sign_of(c), p);
      exp_avg[i] = std::fma(a.omb2, g, a.beta2 * m);
    }
    params[i] = p;
    store_half<O>(s.params_half, i, p);
  }
}

template <OptimizerKind K, DType G>
UpdateFn pick_out(const OptimizerSpan& s) {
  if (s.params_half == nullptr) return &update_range<K, G, Out::kNone>;
  if (s.half_dtype == DType::kBF16) return &update_range<K, G, Out::kBF16>;
  return &update_range<K, G, Out::kF16>;
}

template <OptimizerKind K>
UpdateFn pick_grad(const OptimizerSpan& s) {
  switch (s.grad_dtype) {
    case DType::kF32:
      return pick_out<K, DType::kF32>(s);
    case DType::kBF16:
      return pick_out<K, DType::kBF16>(s);
    case DType::kF16:
      return pick_out<K, DType::kF16>(s);
  }
  return nullptr;
}

void update(const KernelArgs& a, const OptimizerSpan& s, std::size_t begin, std::size_t end) {
  UpdateFn fn = nullptr;
  switch (a.kind) {
    case OptimizerKind::kAdam:
      fn = pick_grad<OptimizerKind::kAdam>(s);
      break;
    case OptimizerKind::kAdamW:
      fn = pick_grad<OptimizerKind::kAdamW>(s);
      break;
    case OptimizerKind::kAdagrad:
      fn = pick_grad<OptimizerKind::kAdagrad>(s);
      break;
    case OptimizerKind::kLion:
      fn = pick_grad<OptimizerKind::kLion>(s);
      break;
  }
  fn(a, s, begin, end);
}

bool finite(const void* data, DType dtype, std::size_t begin, std::size_t end) {
  if (dtype == DType::kF32) {
    const float* f = static_cast<const float*>(data);
    for (std::size_t i = begin; i < end; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &f[i], 4);
      if ((bits & 0x7f800000u) == 0x7f800000u) return false;
    }
    return true;
  }
  const std::uint16_t* h = static_cast<const std::uint16_t*>(data);
  const std::uint16_t exp_mask = dtype == DType::kBF16 ? 0x7f80u : 0x7c00u;
  for (std::size_t i = begin; i < end; ++i) {
    if ((h[i] & exp_mask) == exp_mask) return false;
  }
  return true;
}

void convert(const float* src, std::uint16_t* dst, DType dtype, std::size_t begin,
             std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) {
    dst[i] = dtype == DType::kBF16 ? f32_to_bf16(src[i]) : f32_to_f16(src[i]);
  }
}

}  // namespace

const KernelTable& kernels_scalar() {
  static const KernelTable table{&update, &finite, &convert};
  return table;
}

}  // namespace zinf::optim
