// Adam / AdamW kernel (see kernels/adam.h for the contract and the maths).
#include "kernels/adam.h"
#include "kernels/common.cuh"

namespace zinf::kernels {
namespace {

using detail::global_thread;
using detail::grid_threads;

// One element, in the order the header and adam_step_ref use. The _rn intrinsics keep nvcc
// from contracting multiply-adds into FMAs, so every operation is one correctly rounded IEEE
// fp32 operation, as on the host: the kernel matches the reference bit for bit.
__device__ inline void adam_one(float& p, float g, float& m, float& v, const AdamStepArgs& a) {
  if (a.adamw) {
    p = __fmul_rn(p, a.decay_factor);
  } else {
    g = __fadd_rn(g, __fmul_rn(a.weight_decay, p));
  }
  m = __fadd_rn(__fmul_rn(a.beta1, m), __fmul_rn(__fsub_rn(1.0f, a.beta1), g));
  v = __fadd_rn(__fmul_rn(a.beta2, v), __fmul_rn(__fsub_rn(1.0f, a.beta2), __fmul_rn(g, g)));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), a.inv_sqrt_bc2), a.eps);
  p = __fsub_rn(p, __fmul_rn(a.step_size, __fdiv_rn(m, denom)));
}

template <HalfType kHalf>
__device__ inline std::uint16_t to_half(float p) {
  return kHalf == HalfType::kBf16 ? detail::f32_to_bf16(p) : detail::f32_to_f16(p);
}

// Four elements a thread per step with 16-byte loads of p, g, m, v and an 8-byte store of the
// half copy. REQUIRES: every pointer 16-byte aligned (param_half 8-byte).
template <HalfType kHalf>
__global__ void adam_vec4(float4* __restrict__ param, const float4* __restrict__ grad,
                          float4* __restrict__ exp_avg, float4* __restrict__ exp_avg_sq,
                          uint2* __restrict__ param_half, std::size_t groups, AdamStepArgs a) {
  for (std::size_t i = global_thread(); i < groups; i += grid_threads()) {
    float4 p = param[i];
    const float4 g = grad[i];
    float4 m = exp_avg[i];
    float4 v = exp_avg_sq[i];
    adam_one(p.x, g.x, m.x, v.x, a);
    adam_one(p.y, g.y, m.y, v.y, a);
    adam_one(p.z, g.z, m.z, v.z, a);
    adam_one(p.w, g.w, m.w, v.w, a);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kHalf != HalfType::kNone) {
      // Widen before shifting: a uint16_t promotes to int, and int << 16 can overflow.
      const std::uint32_t h0 = to_half<kHalf>(p.x), h1 = to_half<kHalf>(p.y);
      const std::uint32_t h2 = to_half<kHalf>(p.z), h3 = to_half<kHalf>(p.w);
      param_half[i] = make_uint2(h0 | (h1 << 16), h2 | (h3 << 16));
    }
  }
}

template <HalfType kHalf>
__global__ void adam_scalar(float* __restrict__ param, const float* __restrict__ grad,
                            float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                            std::uint16_t* __restrict__ param_half, std::size_t count,
                            AdamStepArgs a) {
  for (std::size_t i = global_thread(); i < count; i += grid_threads()) {
    float p = param[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    adam_one(p, grad[i], m, v, a);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kHalf != HalfType::kNone) param_half[i] = to_half<kHalf>(p);
  }
}

template <HalfType kHalf>
cudaError_t adam_launch(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                        std::uint16_t* param_half, std::size_t count, const AdamStepArgs& a,
                        cudaStream_t s) {
  std::size_t done = 0;
  cudaError_t err = cudaSuccess;
  const bool half_ok =
      kHalf == HalfType::kNone || (reinterpret_cast<std::uintptr_t>(param_half) & 7u) == 0;
  if (detail::aligned16(param) && detail::aligned16(grad) && detail::aligned16(exp_avg) &&
      detail::aligned16(exp_avg_sq) && half_ok) {
    const std::size_t groups = count / 4;
    if (groups > 0) {
      err =
          detail::launch(adam_vec4<kHalf>, detail::blocks_for(groups), detail::kThreads, s,
                         reinterpret_cast<float4*>(param), reinterpret_cast<const float4*>(grad),
                         reinterpret_cast<float4*>(exp_avg), reinterpret_cast<float4*>(exp_avg_sq),
                         reinterpret_cast<uint2*>(param_half), groups, a);
      done = groups * 4;
    }
  }
  if (err == cudaSuccess && done < count) {
    err = detail::launch(adam_scalar<kHalf>, detail::blocks_for(count - done), detail::kThreads, s,
                         param + done, grad + done, exp_avg + done, exp_avg_sq + done,
                         param_half == nullptr ? nullptr : param_half + done, count - done, a);
  }
  return err;
}

}  // namespace

LaunchError adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                      std::uint16_t* param_half, HalfType half_type, std::size_t count,
                      const AdamStepArgs& args, Stream stream) {
  if (count == 0) return 0;
  if (half_type != HalfType::kNone && param_half == nullptr) {
    return static_cast<LaunchError>(cudaErrorInvalidValue);
  }
  auto* s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaErrorInvalidValue;
  switch (half_type) {
    case HalfType::kNone:
      err = adam_launch<HalfType::kNone>(param, grad, exp_avg, exp_avg_sq, nullptr, count, args, s);
      break;
    case HalfType::kBf16:
      err = adam_launch<HalfType::kBf16>(param, grad, exp_avg, exp_avg_sq, param_half, count, args,
                                         s);
      break;
    case HalfType::kF16:
      err =
          adam_launch<HalfType::kF16>(param, grad, exp_avg, exp_avg_sq, param_half, count, args, s);
      break;
  }
  return static_cast<LaunchError>(err);
}

}  // namespace zinf::kernels
