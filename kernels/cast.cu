// fp32 -> bf16 / f16 cast kernels (see kernels/cast.h for the contract and the maths).
#include "kernels/cast.h"
#include "kernels/common.cuh"

namespace zinf::kernels {
namespace {

using detail::global_thread;
using detail::grid_threads;

// Eight elements a thread per step: two 16-byte loads of floats, one 16-byte store of halves.
// REQUIRES: src and dst 16-byte aligned; the count % 8 tail is left to cast_scalar.
template <HalfType kType>
__global__ void cast_vec8(const float4* __restrict__ src, uint4* __restrict__ dst,
                          std::size_t groups) {
  for (std::size_t g = global_thread(); g < groups; g += grid_threads()) {
    const float4 a = src[2 * g];
    const float4 b = src[2 * g + 1];
    const float in[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    std::uint32_t packed[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t lo =
          kType == HalfType::kBf16 ? detail::f32_to_bf16(in[2 * k]) : detail::f32_to_f16(in[2 * k]);
      const std::uint32_t hi = kType == HalfType::kBf16 ? detail::f32_to_bf16(in[2 * k + 1])
                                                        : detail::f32_to_f16(in[2 * k + 1]);
      packed[k] = lo | (hi << 16);  // Little-endian: element 2k at the lower address.
    }
    dst[g] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

template <HalfType kType>
__global__ void cast_scalar(const float* __restrict__ src, std::uint16_t* __restrict__ dst,
                            std::size_t count) {
  for (std::size_t i = global_thread(); i < count; i += grid_threads()) {
    dst[i] = kType == HalfType::kBf16 ? detail::f32_to_bf16(src[i]) : detail::f32_to_f16(src[i]);
  }
}

template <HalfType kType>
LaunchError cast_launch(const float* src, std::uint16_t* dst, std::size_t count, Stream stream) {
  if (count == 0) return 0;
  auto* s = static_cast<cudaStream_t>(stream);
  std::size_t done = 0;
  cudaError_t err = cudaSuccess;
  if (detail::aligned16(src) && detail::aligned16(dst)) {
    const std::size_t groups = count / 8;
    if (groups > 0) {
      err = detail::launch(cast_vec8<kType>, detail::blocks_for(groups), detail::kThreads, s,
                           reinterpret_cast<const float4*>(src), reinterpret_cast<uint4*>(dst),
                           groups);
      done = groups * 8;
    }
  }
  if (err == cudaSuccess && done < count) {
    err = detail::launch(cast_scalar<kType>, detail::blocks_for(count - done), detail::kThreads, s,
                         src + done, dst + done, count - done);
  }
  return static_cast<LaunchError>(err);
}

}  // namespace

LaunchError cast_f32_to_bf16(const float* src, std::uint16_t* dst, std::size_t count,
                             Stream stream) {
  return cast_launch<HalfType::kBf16>(src, dst, count, stream);
}

LaunchError cast_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t count,
                            Stream stream) {
  return cast_launch<HalfType::kF16>(src, dst, count, stream);
}

}  // namespace zinf::kernels
