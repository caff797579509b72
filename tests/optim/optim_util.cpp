#include "optim/optim_util.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "base/cpu.hpp"
#include "base/random.hpp"

namespace zinf::optim_test {

std::optional<Path> find_path(std::string_view name, std::string* why_not) {
  const CpuFeatures& cpu = cpu_features();
  std::string reason;
  if (name == "scalar") return Path{"scalar", &optim::kernels_scalar(), Simd::kScalar};
  if (name == "avx2") {
    if (cpu.has_avx2_path()) return Path{"avx2", &optim::kernels_avx2(), Simd::kAvx2};
    reason = "this CPU has no AVX2+FMA+F16C";
  } else if (name == "avx512-intbf16" || name == "avx512-bf16") {
    const bool bf16 = name == "avx512-bf16";
    if (!cpu.has_avx512_path()) {
      reason = "this CPU has no AVX-512 F/BW/VL/DQ";
    } else if (bf16 && !cpu.avx512bf16) {
      reason = "this CPU has no AVX512-BF16 (VCVTNEPS2BF16)";
    } else {
      return Path{std::string(name), &optim::kernels_avx512(bf16), Simd::kAvx512};
    }
  } else {
    reason = fmt::format("no path is called '{}'", name);
  }
  if (why_not != nullptr) *why_not = reason;
  return std::nullopt;
}

std::vector<Path> available_paths() {
  std::vector<Path> paths;
  for (const char* name : kPathNames) {
    if (std::optional<Path> path = find_path(name, nullptr)) paths.push_back(*path);
  }
  return paths;
}

Problem::Problem(std::size_t count, DType grad_dtype, bool with_half, DType half_dtype,
                 std::size_t offset, Magnitudes magnitudes, std::uint64_t seed)
    : count_(count),
      offset_(offset),
      grad_dtype_(grad_dtype),
      half_dtype_(half_dtype),
      with_half_(with_half),
      params_(count + offset),
      exp_avg_(count + offset),
      exp_avg_sq_(count + offset),
      grad32_(grad_dtype == DType::kF32 ? count + offset : 0),
      grad16_(grad_dtype == DType::kF32 ? 0 : count + offset),
      half_(with_half ? count + offset : 0) {
  SplitMix64 rng(seed);
  // Uniform in +-scale, never exactly zero.
  auto signed_value = [&](double scale) {
    double u = rng.uniform() * 2.0 - 1.0;
    if (u == 0.0) u = 0.5;
    return static_cast<float>(u * scale);
  };
  for (std::size_t i = 0; i < count; ++i) {
    params()[i] = signed_value(magnitudes.param_scale);
    exp_avg()[i] = signed_value(magnitudes.grad_scale);
    const double g = magnitudes.grad_scale * rng.uniform();
    exp_avg_sq()[i] = static_cast<float>(g * g);
    set_grad(i, signed_value(magnitudes.grad_scale));
  }
  // Garbage in the half copy, so a missing write shows.
  for (std::uint16_t& h : half_) h = static_cast<std::uint16_t>(rng.next());
}

OptimizerSpan Problem::span() {
  OptimizerSpan s;
  s.params = params();
  s.exp_avg = exp_avg();
  s.exp_avg_sq = exp_avg_sq();
  s.grads = grad_data();
  s.grad_dtype = grad_dtype_;
  s.params_half = half();
  s.half_dtype = half_dtype_;
  s.count = count_;
  return s;
}

void* Problem::grad_data() {
  if (grad_dtype_ == DType::kF32) return grad32_.data() + offset_;
  return grad16_.data() + offset_;
}

float Problem::grad(std::size_t i) const {
  switch (grad_dtype_) {
    case DType::kF32:
      return grad32_[offset_ + i];
    case DType::kBF16:
      return bf16_to_f32(grad16_[offset_ + i]);
    case DType::kF16:
      return f16_to_f32(grad16_[offset_ + i]);
  }
  return 0;
}

void Problem::set_grad(std::size_t i, float value) {
  switch (grad_dtype_) {
    case DType::kF32:
      grad32_[offset_ + i] = value;
      break;
    case DType::kBF16:
      grad16_[offset_ + i] = f32_to_bf16(value);
      break;
    case DType::kF16:
      grad16_[offset_ + i] = f32_to_f16(value);
      break;
  }
}

bool Problem::same_bits(const Problem& other) const {
  // An unused vector's data() is null, which memcmp must not be given even for 0 bytes.
  auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
  };
  return same(params_, other.params_) && same(exp_avg_, other.exp_avg_) &&
         same(exp_avg_sq_, other.exp_avg_sq_) && same(half_, other.half_) &&
         same(grad32_, other.grad32_) && same(grad16_, other.grad16_);
}

RefElement reference_element(const OptimizerParams& hp, std::int64_t step, double grad_scale,
                             double p, double m, double v, double grad) {
  RefElement r;
  const double lr = hp.lr, wd = hp.weight_decay, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps;
  const double t = static_cast<double>(step);
  double g = grad * grad_scale;
  double g_scale = std::fabs(g);
  switch (hp.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      if (hp.kind == OptimizerKind::kAdam && wd != 0) {
        g += wd * p;
        g_scale += std::fabs(wd * p);
      }
      const double pd = hp.kind == OptimizerKind::kAdamW ? p * (1.0 - lr * wd) : p;
      r.exp_avg = b1 * m + (1.0 - b1) * g;
      r.exp_avg_scale = std::fabs(b1 * m) + (1.0 - b1) * g_scale;
      r.exp_avg_sq = b2 * v + (1.0 - b2) * g * g;
      r.exp_avg_sq_scale = b2 * v + (1.0 - b2) * g_scale * g_scale;
      const double bc1 = hp.bias_correction ? 1.0 - std::pow(b1, t) : 1.0;
      const double bc2 = hp.bias_correction ? 1.0 - std::pow(b2, t) : 1.0;
      const double denom = std::sqrt(r.exp_avg_sq) / std::sqrt(bc2) + eps;
      const double update = lr / bc1 * r.exp_avg / denom;
      r.param = pd - update;
      r.param_scale = std::fabs(pd) + lr / bc1 * r.exp_avg_scale / denom;
      break;
    }
    case OptimizerKind::kAdagrad: {
      if (wd != 0) {
        g += wd * p;
        g_scale += std::fabs(wd * p);
      }
      const double clr = lr / (1.0 + (t - 1.0) * hp.lr_decay);
      r.exp_avg = m;  // untouched
      r.exp_avg_sq = v + g * g;
      r.exp_avg_sq_scale = v + g_scale * g_scale;
      const double denom = std::sqrt(r.exp_avg_sq) + eps;
      r.param = p - clr * g / denom;
      r.param_scale = std::fabs(p) + clr * g_scale / denom;
      break;
    }
    case OptimizerKind::kLion: {
      const double pd = p * (1.0 - lr * wd);
      const double c = b1 * m + (1.0 - b1) * g;
      const double c_scale = std::fabs(b1 * m) + std::fabs((1.0 - b1) * g);
      const double sign = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
      r.sign_ambiguous = std::fabs(c) <= 1e-5 * c_scale;
      r.param_decayed = pd;
      r.param = pd - lr * sign;
      r.param_scale = std::fabs(pd) + lr;
      r.exp_avg = b2 * m + (1.0 - b2) * g;
      r.exp_avg_scale = std::fabs(b2 * m) + std::fabs((1.0 - b2) * g);
      r.exp_avg_sq = v;  // untouched
      break;
    }
  }
  return r;
}

std::uint16_t round_half(float value, DType dtype) {
  return dtype == DType::kBF16 ? f32_to_bf16(value) : f32_to_f16(value);
}

}  // namespace zinf::optim_test
