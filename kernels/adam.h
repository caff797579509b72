// Adam / AdamW on the GPU, for optimizer state kept in device memory, and its scalar reference.
//
// Maths (torch.optim.Adam and torch.optim.AdamW with amsgrad=False, maximize=False; Kingma & Ba
// 2015, Algorithm 1; Loshchilov & Hutter 2019 for the decoupled weight decay). With step t
// counted from 1, bias corrections bc1 = 1 - beta1^t and bc2 = 1 - beta2^t:
//
//   Adam:   g <- g + weight_decay * p                    (L2 penalty folded into the gradient)
//   AdamW:  p <- p * (1 - lr * weight_decay)             (decoupled decay, before the update)
//   m <- beta1 * m + (1 - beta1) * g
//   v <- beta2 * v + (1 - beta2) * g * g
//   p <- p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//
// which is torch's `denom = (v.sqrt() / sqrt(bc2)).add_(eps); p.addcdiv_(m, denom,
// value=-lr/bc1)`. The scalars lr / bc1 and 1 / sqrt(bc2) are computed once per step in double
// on the host (adam_step_args) and applied in fp32 per element, in the order written above,
// by both the kernel and the reference, each operation a correctly rounded IEEE fp32 one (the
// kernel forbids FMA contraction), so the kernel's results equal the reference's bit for bit.
//
// Optionally the updated parameter is also written as bf16 or f16 (rounded to nearest even, as
// include/zinf/dtype.hpp), in the same pass: the half-precision copy the forward pass reads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/launch.h"

namespace zinf::kernels {

struct AdamHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  // true: AdamW (decoupled decay); false: Adam (L2 decay added to the gradient).
  bool adamw = false;
};

// The per-step scalars, derived from AdamHyper and the step number.
struct AdamStepArgs {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  bool adamw;
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float decay_factor;  // AdamW: 1 - lr * weight_decay; Adam: 1
};

// REQUIRES: step >= 1.
AdamStepArgs adam_step_args(const AdamHyper& hyper, std::int64_t step);

// Enqueues one Adam/AdamW step over `count` elements on `stream`: param, exp_avg (m) and
// exp_avg_sq (v) updated in place from grad; when half_type is not kNone, param_half[i] gets the
// rounded new parameter (param_half may be null otherwise). All pointers are device memory and
// must not overlap. 16-byte vector access when every pointer is 16-byte aligned (8-byte for
// param_half). Returns 0 or the launch's cudaError_t.
LaunchError adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                      std::uint16_t* param_half, HalfType half_type, std::size_t count,
                      const AdamStepArgs& args, Stream stream);

// The scalar reference on host memory, same arguments and the same fp32 operation order.
void adam_step_ref(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                   std::uint16_t* param_half, HalfType half_type, std::size_t count,
                   const AdamStepArgs& args);

}  // namespace zinf::kernels
