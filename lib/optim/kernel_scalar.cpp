// The scalar path: the update of kernel_update.hpp one element at a time, the reference for every
// SIMD path (see kernel.hpp), built for baseline x86-64. std::fma is one rounding, exactly as the
// FMA instructions of the SIMD paths; the build uses -ffp-contract=off (ISO C++ mode), so no other
// multiply-add is fused.
#include <cmath>
#include <cstring>

#include "optim/kernel.hpp"
#include "optim/kernel_update.hpp"

namespace zinf::optim {
namespace {

// One element at a time: the vector type is float.
struct Isa {
  using Vec = float;
  static float set1(float x) { return x; }
  static float mul(float a, float b) { return a * b; }
  static float add(float a, float b) { return a + b; }
  static float div(float a, float b) { return a / b; }
  static float sqrt(float a) { return std::sqrt(a); }
  static float fma(float a, float b, float c) { return std::fma(a, b, c); }
  // sign(c) as torch.sign: -1, 0 or +1, and NaN for NaN.
  static float sign(float c) {
    if (c > 0.0f) return 1.0f;
    if (c < 0.0f) return -1.0f;
    if (std::isnan(c)) return c;
    return 0.0f;
  }
};

struct Lanes {
  std::size_t i;
  float load(const float* base) const { return base[i]; }
  void store(float* base, float x) const { base[i] = x; }
  template <DType G>
  float load_grad(const void* grads) const {
    if constexpr (G == DType::kF32) {
      return static_cast<const float*>(grads)[i];
    } else if constexpr (G == DType::kBF16) {
      return bf16_to_f32(static_cast<const std::uint16_t*>(grads)[i]);
    } else {
      return f16_to_f32(static_cast<const std::uint16_t*>(grads)[i]);
    }
  }
  template <Out O>
  void store_half(void* half, float p) const {
    static_cast<std::uint16_t*>(half)[i] = O == Out::kBF16 ? f32_to_bf16(p) : f32_to_f16(p);
  }
};

struct Ops {
  template <OptimizerKind K, DType G, Out O>
  static void range(const KernelArgs& a, const OptimizerSpan& s, std::size_t begin,
                    std::size_t end) {
    const Consts<Isa> c(a);
    const Flags f{a.has_l2, a.has_decay};
    const Streams st{s.params, s.exp_avg, s.exp_avg_sq, s.grads, s.params_half};
    for (std::size_t i = begin; i < end; ++i) update_lanes<Isa, K, G, O>(f, c, st, Lanes{i});
  }
};

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
  static const KernelTable table{&update<Ops>, &finite, &convert};
  return table;
}

}  // namespace zinf::optim
