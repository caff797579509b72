// Gradient unscale with an inf/NaN flag: the mixed-precision loss scaler's per-step check.
//
// Maths (torch._amp_foreach_non_finite_check_and_unscale_, which torch.cuda.amp.GradScaler
// calls): for every element, grad[i] <- grad[i] * inv_scale, and if any input grad[i] is not
// finite (an infinity or a NaN) the flag *found_inf is set to 1. The flag is only ever set,
// never cleared, so one flag can collect the check over many tensors; the caller zeroes it
// before the first. A step whose flag is set is skipped and the scale lowered (LossScaler).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/launch.h"

namespace zinf::kernels {

// Enqueues the unscale of `count` fp32 gradients in place on `stream`. `found_inf` is one
// std::int32_t in device memory. 16-byte vector access when `grad` is 16-byte aligned.
// Returns 0 or the launch's cudaError_t.
LaunchError unscale_grads(float* grad, std::size_t count, float inv_scale, std::int32_t* found_inf,
                          Stream stream);

// The scalar reference on host memory.
void unscale_grads_ref(float* grad, std::size_t count, float inv_scale, std::int32_t* found_inf);

}  // namespace zinf::kernels
