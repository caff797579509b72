// CPU optimizer kernels: one update of a span of a partition, in place, at memory bandwidth.
//
// The step reads fp32 master parameters, fp32 optimizer state and a gradient (f32, bf16 or f16),
// and writes back the parameters and the state; optionally it also writes a bf16 or f16 copy of
// the updated parameters (round to nearest even, exactly zinf::f32_to_bf16 / f32_to_f16 of the
// fp32 result) in the same pass. The work is split into tiles and run on oneTBB; every element's
// arithmetic is fixed, so the result is bitwise the same for any thread count and tile size, and
// the same on every SIMD path (scalar, AVX2+FMA+F16C, AVX-512): the scalar path uses std::fma
// exactly where the SIMD paths use FMA instructions, and sqrt and division are correctly rounded
// everywhere. (NaN payloads are the one exception: a NaN stays a NaN, its payload may differ.)
//
// The maths, per element, with g = grad * grad_scale and t = StepOptions::step (1 on the first
// step). The constants (1 - beta^t, lr * weight_decay, ...) are computed once per call in double
// and rounded to float; the per-element arithmetic is float.
//
// Adam, L2 weight decay (torch.optim.Adam, amsgrad=False, maximize=False):
//   g  = g + weight_decay * p                                  (only when weight_decay != 0)
//   m  = beta1 * m + (1 - beta1) * g                           exp_avg
//   v  = beta2 * v + (1 - beta2) * g * g                       exp_avg_sq
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   With bias_correction = false both (1 - beta^t) factors are 1 (DeepSpeed's option; torch
//   always corrects). The division by sqrt(1 - beta2^t) is done as a multiplication by its
//   reciprocal (one rounding away from torch's division), to keep one divide per element.
// AdamW, decoupled weight decay (torch.optim.AdamW): as Adam without the L2 term, after first
//   p  = p * (1 - lr * weight_decay)
// Adagrad (torch.optim.Adagrad; exp_avg_sq holds torch's state_sum; exp_avg is unused):
//   clr = lr / (1 + (t - 1) * lr_decay)
//   g  = g + weight_decay * p                                  (only when weight_decay != 0)
//   s  = s + g * g
//   p  = p - clr * g / (sqrt(s) + eps)
//   DeepSpeed's CPU Adagrad divides the gradient *before* weight decay by the denominator; we
//   follow torch and use the decayed gradient in the numerator too.
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2, and
//   lucidrains/lion-pytorch; torch.optim has no Lion; exp_avg is the momentum, exp_avg_sq unused):
//   p  = p * (1 - lr * weight_decay)
//   c  = beta1 * m + (1 - beta1) * g
//   p  = p - lr * sign(c)                                      (sign(0) = 0, as torch.sign)
//   m  = beta2 * m + (1 - beta2) * g
//
// Parameter groups. The overload of optimizer_step() that takes ranges steps each run of the span
// with its own hyper-parameters (a parameter group's lr and weight_decay, as torch's
// param_groups): the per-call constants are computed once per group, the tiles are split where a
// range ends, and each element gets exactly the arithmetic of a one-group call with its range's
// hyper-parameters, so two groups cost nothing measurable over one (docs/BENCHMARKS.md).
//
// Thread-safety: optimizer_step() may be called concurrently on disjoint spans.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "zinf/dtype.hpp"
#include "zinf/status.hpp"

namespace zinf {

enum class OptimizerKind : std::uint8_t { kAdam = 0, kAdamW = 1, kAdagrad = 2, kLion = 3 };

// "adam", "adamw", "adagrad", "lion".
std::string_view optimizer_name(OptimizerKind kind);
bool parse_optimizer(std::string_view text, OptimizerKind* kind);

// Hyper-parameters, in double like torch's Python floats: each per-call constant (1 - beta1,
// lr / (1 - beta1^t), 1 - lr * weight_decay, ...) is computed in double and rounded to float
// once, as torch does when it applies a Python scalar to a float tensor. (With float fields,
// 1.0f - 0.999f would be 1.3e-5 away from torch's 0.001.) Defaults are torch.optim.AdamW's; set
// the torch defaults of the other optimizers yourself (Adagrad: lr 1e-2, eps 1e-10; Lion: lr
// 1e-4, beta2 0.99).
struct OptimizerParams {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  // Adam/AdamW: decay of the first moment. Lion: interpolation weight of the update direction.
  double beta1 = 0.9;
  // Adam/AdamW: decay of the second moment. Lion: decay of the momentum.
  double beta2 = 0.999;
  // Adam/AdamW/Adagrad: added to the denominator.
  double eps = 1e-8;
  // Adam and Adagrad: L2 (added to the gradient); AdamW and Lion: decoupled (shrinks p).
  double weight_decay = 1e-2;
  // Adam/AdamW only.
  bool bias_correction = true;
  // Adagrad only.
  double lr_decay = 0.0;
};

// Which instruction set runs the kernel.
enum class Simd : std::uint8_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

// "auto", "scalar", "avx2", "avx512".
std::string_view simd_name(Simd simd);
bool parse_simd(std::string_view text, Simd* simd);

// The path `requested` runs on this machine. kAuto: the ZINF_SIMD environment variable when it is
// set (avx512|avx2|scalar), else the best the CPU has. Fails with kUnsupported when the CPU lacks
// the forced path, kInvalidArgument when ZINF_SIMD holds anything else.
Result<Simd> resolve_simd(Simd requested);

// One sub-group: `count` parameters and their state, all contiguous. Pointers need no particular
// alignment. REQUIRES: the arrays do not overlap one another.
struct OptimizerSpan {
  float* params = nullptr;      // fp32 master parameters, updated in place
  float* exp_avg = nullptr;     // Adam/AdamW/Lion; ignored (may be null) for Adagrad
  float* exp_avg_sq = nullptr;  // Adam/AdamW; Adagrad's state_sum; ignored for Lion
  const void* grads = nullptr;  // `count` elements of grad_dtype, read only
  DType grad_dtype = DType::kF32;
  // Optional: when not null, receives the updated parameters as half_dtype (bf16 or f16).
  void* params_half = nullptr;
  DType half_dtype = DType::kBF16;
  std::size_t count = 0;
};

struct StepOptions {
  // The step number t of this update, counting from 1 (torch's state['step'] after its
  // increment). Enters Adam's bias correction and Adagrad's lr decay.
  std::int64_t step = 1;
  // Multiplies every gradient before use: 1 / loss_scale, times a clipping coefficient.
  float grad_scale = 1.0f;
  // When true, the gradients are scanned for inf/NaN before anything is written; if one is found
  // the call returns overflow = true and leaves params, state and params_half untouched. (A
  // single pass cannot promise that, since it would write the first tile before reading the last
  // gradient, so this costs one extra read of the gradients.)
  bool check_overflow = false;
  // kAuto as in resolve_simd().
  Simd simd = Simd::kAuto;
  // 0: run in the caller's current oneTBB arena (call it inside your arena.execute() to choose
  // the threads; outside any arena this is TBB's default arena, all cores). N > 0: run in an
  // arena of N threads that zinf makes on the first such call and keeps for later ones (up to
  // 256 threads), shared by concurrent callers asking for the same N.
  int threads = 0;
  // Elements per unit of parallel work; 0 picks a default (16Ki). Does not change the result.
  std::size_t tile_elements = 0;
};

struct StepResult {
  bool overflow = false;      // a gradient was inf or NaN; nothing was written
  Simd simd = Simd::kScalar;  // the path that ran
};

// Updates `span` in place with one step of `params.kind`.
// Fails (writing nothing) with kInvalidArgument when a pointer the optimizer needs is null, the
// dtypes are not f32/bf16/f16 (grads) or bf16/f16 (params_half), step < 1, or a hyper-parameter
// is out of range (lr, eps, weight_decay, lr_decay negative or not finite; betas outside [0, 1));
// with kUnsupported when the forced SIMD path is not available.
Result<StepResult> optimizer_step(const OptimizerParams& params, const OptimizerSpan& span,
                                  const StepOptions& options);

// The most parameter groups one optimizer_step() call takes.
inline constexpr std::size_t kMaxOptimizerGroups = 64;

// One run of a span stepped with one group's hyper-parameters: elements [begin, the next range's
// begin) of the span, the last range running to span.count.
struct OptimizerRange {
  std::size_t begin = 0;
  std::uint32_t group = 0;  // index into the groups of the call
};

// Updates `span` in place, range r with groups[ranges[r].group]. The result equals, bit for bit,
// one optimizer_step() per range with that range's hyper-parameters. Fails (writing nothing) as
// the one-group call for each group, and with kInvalidArgument when there are no groups or more
// than kMaxOptimizerGroups, the groups differ in kind, ranges is empty (for a non-empty span),
// ranges[0].begin is not 0, the begins are not strictly increasing below span.count, or a range
// names a group that is not there.
Result<StepResult> optimizer_step(std::span<const OptimizerParams> groups,
                                  std::span<const OptimizerRange> ranges, const OptimizerSpan& span,
                                  const StepOptions& options);

// True when all `count` values of `data` (of `dtype`) are finite. Runs like optimizer_step().
Result<bool> all_finite(const void* data, DType dtype, std::size_t count,
                        const StepOptions& options = {});

// dst[i] <- src[i] rounded to `dtype` (bf16 or f16), the bits optimizer_step() gives its half
// output (f32_to_bf16 / f32_to_f16). Runs like optimizer_step(): tiles over the options' threads,
// with the options' SIMD path. kInvalidArgument for another dtype or null pointers.
Status narrow_to_half(const float* src, std::uint16_t* dst, DType dtype, std::size_t count,
                      const StepOptions& options = {});

}  // namespace zinf
