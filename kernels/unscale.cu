// Gradient unscale kernel (see kernels/unscale.h for the contract and the maths).
#include "kernels/common.cuh"
#include "kernels/unscale.h"

namespace zinf::kernels {
namespace {

using detail::global_thread;
using detail::grid_threads;

// Finite means the exponent is not all ones: cheaper than isfinite() and exact for every
// pattern, NaNs included.
__device__ inline bool non_finite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// Many threads may set the flag; they all store the same value, so plain stores are enough, and
// each thread stores at most once per kernel.
__global__ void unscale_vec4(float4* __restrict__ grad, std::size_t groups, float inv_scale,
                             std::int32_t* __restrict__ found_inf) {
  bool bad = false;
  for (std::size_t g = global_thread(); g < groups; g += grid_threads()) {
    float4 x = grad[g];
    bad |= non_finite(x.x) | non_finite(x.y) | non_finite(x.z) | non_finite(x.w);
    x.x *= inv_scale;
    x.y *= inv_scale;
    x.z *= inv_scale;
    x.w *= inv_scale;
    grad[g] = x;
  }
  if (bad) *found_inf = 1;
}

__global__ void unscale_scalar(float* __restrict__ grad, std::size_t count, float inv_scale,
                               std::int32_t* __restrict__ found_inf) {
  bool bad = false;
  for (std::size_t i = global_thread(); i < count; i += grid_threads()) {
    const float x = grad[i];
    bad |= non_finite(x);
    grad[i] = x * inv_scale;
  }
  if (bad) *found_inf = 1;
}

}  // namespace

LaunchError unscale_grads(float* grad, std::size_t count, float inv_scale, std::int32_t* found_inf,
                          Stream stream) {
  if (count == 0) return 0;
  auto* s = static_cast<cudaStream_t>(stream);
  std::size_t done = 0;
  cudaError_t err = cudaSuccess;
  if (detail::aligned16(grad)) {
    const std::size_t groups = count / 4;
    if (groups > 0) {
      err = detail::launch(unscale_vec4, detail::blocks_for(groups), detail::kThreads, s,
                           reinterpret_cast<float4*>(grad), groups, inv_scale, found_inf);
      done = groups * 4;
    }
  }
  if (err == cudaSuccess && done < count) {
    err = detail::launch(unscale_scalar, detail::blocks_for(count - done), detail::kThreads, s,
                         grad + done, count - done, inv_scale, found_inf);
  }
  return static_cast<LaunchError>(err);
}

}  // namespace zinf::kernels
