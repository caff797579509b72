// f32 / bf16 / f16 -> f32 widening kernel (see kernels/widen.h for the contract and the maths).
#include "kernels/common.cuh"
#include "kernels/widen.h"

namespace zinf::kernels {
namespace {

using detail::global_thread;
using detail::grid_threads;

// f32 <- f16, exact, NaN payloads kept as zinf::f16_to_f32 keeps them (the hardware conversion
// may return a canonical NaN instead).
__device__ inline float f16_bits_to_f32(std::uint16_t value) {
  if ((value & 0x7c00u) == 0x7c00u && (value & 0x03ffu) != 0) {
    const std::uint32_t sign = static_cast<std::uint32_t>(value & 0x8000u) << 16;
    return __uint_as_float(sign | 0x7f800000u |
                           (static_cast<std::uint32_t>(value & 0x03ffu) << 13));
  }
  return detail::f16_to_f32(value);
}

template <HalfType kType>
__device__ inline float widen_one(const void* src, std::size_t i) {
  if constexpr (kType == HalfType::kNone) {
    return static_cast<const float*>(src)[i];
  } else if constexpr (kType == HalfType::kBf16) {
    return detail::bf16_to_f32(static_cast<const std::uint16_t*>(src)[i]);
  } else {
    return f16_bits_to_f32(static_cast<const std::uint16_t*>(src)[i]);
  }
}

template <bool kAccumulate>
__device__ inline void store4(float4* dst, std::size_t g, float4 x) {
  if constexpr (kAccumulate) {
    const float4 d = dst[g];
    x.x = __fadd_rn(d.x, x.x);
    x.y = __fadd_rn(d.y, x.y);
    x.z = __fadd_rn(d.z, x.z);
    x.w = __fadd_rn(d.w, x.w);
  }
  dst[g] = x;
}

// Four elements a thread per step: one 16-byte store of floats from a 16-byte load of f32 or an
// 8-byte load of halves. REQUIRES: src and dst 16-byte aligned; the count % 4 tail is left to
// widen_scalar.
template <HalfType kType, bool kAccumulate>
__global__ void widen_vec4(const void* __restrict__ src, float4* __restrict__ dst,
                           std::size_t groups) {
  for (std::size_t g = global_thread(); g < groups; g += grid_threads()) {
    float4 x;
    if constexpr (kType == HalfType::kNone) {
      x = static_cast<const float4*>(src)[g];
    } else {
      const uint2 packed = static_cast<const uint2*>(src)[g];
      // Little-endian: element 2k is the low half of word k.
      const std::uint16_t h[4] = {static_cast<std::uint16_t>(packed.x & 0xffffu),
                                  static_cast<std::uint16_t>(packed.x >> 16),
                                  static_cast<std::uint16_t>(packed.y & 0xffffu),
                                  static_cast<std::uint16_t>(packed.y >> 16)};
      float f[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        f[k] = kType == HalfType::kBf16 ? detail::bf16_to_f32(h[k]) : f16_bits_to_f32(h[k]);
      }
      x = make_float4(f[0], f[1], f[2], f[3]);
    }
    store4<kAccumulate>(dst, g, x);
  }
}

template <HalfType kType, bool kAccumulate>
__global__ void widen_scalar(const void* __restrict__ src, float* __restrict__ dst,
                             std::size_t count) {
  for (std::size_t i = global_thread(); i < count; i += grid_threads()) {
    const float x = widen_one<kType>(src, i);
    dst[i] = kAccumulate ? __fadd_rn(dst[i], x) : x;
  }
}

template <HalfType kType, bool kAccumulate>
LaunchError widen_launch(const void* src, float* dst, std::size_t count, Stream stream) {
  auto* s = static_cast<cudaStream_t>(stream);
  const std::size_t element_bytes = kType == HalfType::kNone ? 4 : 2;
  std::size_t done = 0;
  cudaError_t err = cudaSuccess;
  if (detail::aligned16(src) && detail::aligned16(dst)) {
    const std::size_t groups = count / 4;
    if (groups > 0) {
      err = detail::launch(widen_vec4<kType, kAccumulate>, detail::blocks_for(groups),
                           detail::kThreads, s, src, reinterpret_cast<float4*>(dst), groups);
      done = groups * 4;
    }
  }
  if (err == cudaSuccess && done < count) {
    err = detail::launch(
        widen_scalar<kType, kAccumulate>, detail::blocks_for(count - done), detail::kThreads, s,
        static_cast<const unsigned char*>(src) + done * element_bytes, dst + done, count - done);
  }
  return static_cast<LaunchError>(err);
}

template <HalfType kType>
LaunchError widen_dispatch(const void* src, float* dst, std::size_t count, bool accumulate,
                           Stream stream) {
  return accumulate ? widen_launch<kType, true>(src, dst, count, stream)
                    : widen_launch<kType, false>(src, dst, count, stream);
}

}  // namespace

LaunchError widen_to_f32(const void* src, HalfType src_type, float* dst, std::size_t count,
                         bool accumulate, Stream stream) {
  if (count == 0) return 0;
  switch (src_type) {
    case HalfType::kNone:
      return widen_dispatch<HalfType::kNone>(src, dst, count, accumulate, stream);
    case HalfType::kBf16:
      return widen_dispatch<HalfType::kBf16>(src, dst, count, accumulate, stream);
    case HalfType::kF16:
      return widen_dispatch<HalfType::kF16>(src, dst, count, accumulate, stream);
  }
  return static_cast<LaunchError>(cudaErrorInvalidValue);
}

}  // namespace zinf::kernels
