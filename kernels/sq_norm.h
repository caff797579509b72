// Squared L2 norm of a gradient (or any array), for global gradient-norm clipping.
//
// Maths: sum over i of x[i]^2. Clipping needs ||g|| = sqrt(sum over all tensors and ranks of
// their squared norms), so the kernel produces the squared norm, which adds across tensors and
// (with an all-reduce of one float) across ranks; the square root is taken once at the end
// (torch.nn.utils.clip_grad_norm_ with norm_type=2 does the same per tensor).
//
// The GPU sum is deterministic: its grid depends only on `count`, each block sums a fixed set
// of elements in a fixed order in fp32, and the block partials are summed in fp64 by one block
// in a fixed order. So the same input gives the same bits on every run and on every GPU. An
// inf or NaN input gives an inf or NaN result, as the loss scaler expects.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/launch.h"

namespace zinf::kernels {

// Size, in floats, of the device scratch buffer `partials` the launchers need.
constexpr std::size_t kSqNormPartials = 1024;

// Enqueues *out = sum(x[i]^2) (or *out += that sum when `accumulate`) on `stream`, reading
// `count` elements of the given type (fp32, or 16-bit patterns of bf16 / f16 when `type` is
// kBf16 / kF16; kNone means fp32). `out` is one float and `partials` kSqNormPartials floats, both
// device memory; `partials` may be reused as soon as the stream has moved past this call.
// Accumulating calls on one stream are applied in stream order, so they too are deterministic.
// Returns 0 or the launch's cudaError_t.
LaunchError sq_norm(const void* x, HalfType type, std::size_t count, float* partials, float* out,
                    bool accumulate, Stream stream);

// The scalar reference on host memory: the sum in fp64, in index order, returned as float.
float sq_norm_ref(const void* x, HalfType type, std::size_t count);

}  // namespace zinf::kernels
