// Internal interface between the optimizer step (optim.cpp: validation, constants, tiling,
// threads) and the per-ISA kernels (kernel_scalar.cpp, kernel_avx2.cpp, kernel_avx512.cpp).
//
// Every path computes each element with the same sequence of float operations (written out once
// in kernel_update.hpp, which each path instantiates with its own vector type), so all paths give
// bitwise identical results:
//   Adam/AdamW:  g = grad * grad_scale
//                if has_l2:    g = fma(l2, p, g)
//                m = fma(omb1, g, beta1 * m)
//                v = fma(omb2 * g, g, beta2 * v)
//                d = fma(sqrt(v), inv_sqrt_bc2, eps)
//                if has_decay: p = p * decay
//                p = fma(-step_size, m / d, p)
//   Adagrad:     g = grad * grad_scale;  if has_l2: g = fma(l2, p, g)
//                s = fma(g, g, s);  d = sqrt(s) + eps;  p = fma(-step_size, g / d, p)
//   Lion:        g = grad * grad_scale;  if has_decay: p = p * decay
//                c = fma(omb1, g, beta1 * m);  p = fma(-step_size, sign(c), p)
//                m = fma(omb2, g, beta2 * m)
// Thread-safety: the kernels are pure functions of their arguments over [begin, end).
#pragma once

#include <cstddef>
#include <cstdint>

#include "zinf/dtype.hpp"
#include "zinf/optim.hpp"

namespace zinf::optim {

// Per-call constants, the same for every element and every path.
struct KernelArgs {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float beta1 = 0, beta2 = 0;
  float omb1 = 0, omb2 = 0;  // 1 - beta1, 1 - beta2, computed in double
  float step_size = 0;       // Adam: lr / (1 - beta1^t); Adagrad: clr; Lion: lr
  float inv_sqrt_bc2 = 1;    // Adam: 1 / sqrt(1 - beta2^t)
  float eps = 0;
  float l2 = 0;     // Adam/Adagrad L2 coefficient
  float decay = 1;  // AdamW/Lion: 1 - lr * weight_decay
  bool has_l2 = false;
  bool has_decay = false;
  float grad_scale = 1;
};

// Updates elements [begin, end) of `span`.
using UpdateFn = void (*)(const KernelArgs& args, const OptimizerSpan& span, std::size_t begin,
                          std::size_t end);
// True when elements [begin, end) of `data` are all finite.
using FiniteFn = bool (*)(const void* data, DType dtype, std::size_t begin, std::size_t end);
// Converts [begin, end) of f32 `src` to bf16/f16 `dst` exactly as f32_to_bf16 / f32_to_f16.
using ConvertFn = void (*)(const float* src, std::uint16_t* dst, DType dtype, std::size_t begin,
                           std::size_t end);

struct KernelTable {
  UpdateFn update;
  FiniteFn finite;
  ConvertFn convert;
};

// The kernels of one path. kernels_avx512(false) uses integer rounding for bf16 outputs instead
// of the AVX512-BF16 instructions (what runs on AVX-512 CPUs without them; tests force it).
// REQUIRES: the CPU has the path's features.
const KernelTable& kernels_scalar();
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512(bool use_bf16_instructions);

// The table for a resolved path (kAuto is not allowed), using the BF16 instructions on AVX-512
// when the CPU has them.
const KernelTable& kernels_for(Simd simd);

// optimizer_step() on the given kernels, reported as path `simd` (tests force a variant with it).
// options.simd is ignored.
Result<StepResult> step_with(const KernelTable& kernels, Simd simd, const OptimizerParams& params,
                             const OptimizerSpan& span, const StepOptions& options);
// The same with per-range hyper-parameters.
Result<StepResult> step_with(const KernelTable& kernels, Simd simd,
                             std::span<const OptimizerParams> groups,
                             std::span<const OptimizerRange> ranges, const OptimizerSpan& span,
                             const StepOptions& options);

}  // namespace zinf::optim
