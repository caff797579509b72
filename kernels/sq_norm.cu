// Squared-norm reduction kernels (see kernels/sq_norm.h for the contract and the maths).
#include "kernels/common.cuh"
#include "kernels/sq_norm.h"

namespace zinf::kernels {
namespace {

using detail::global_thread;
using detail::grid_threads;

constexpr unsigned kWarp = 32;

// Sums `value` over the block with warp shuffles, then over warps through shared memory. The
// order is fixed, so the result is deterministic. Valid in thread 0 only.
template <typename T>
__device__ T block_sum(T value) {
  __shared__ T warp_sums[detail::kThreads / kWarp];
  for (unsigned offset = kWarp / 2; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  const unsigned lane = threadIdx.x % kWarp;
  const unsigned warp = threadIdx.x / kWarp;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  T total = 0;
  if (threadIdx.x == 0) {
    for (unsigned w = 0; w < blockDim.x / kWarp; ++w) total += warp_sums[w];
  }
  return total;
}

// Eight elements per 16-byte load for 16-bit types, four for fp32.
template <HalfType kType>
__device__ inline float sq_sum_vec(uint4 raw) {
  if constexpr (kType == HalfType::kNone) {
    const float a = __uint_as_float(raw.x), b = __uint_as_float(raw.y);
    const float c = __uint_as_float(raw.z), d = __uint_as_float(raw.w);
    return a * a + b * b + c * c + d * d;
  } else {
    const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const auto lo = static_cast<std::uint16_t>(words[k] & 0xffffu);
      const auto hi = static_cast<std::uint16_t>(words[k] >> 16);
      const float a = kType == HalfType::kBf16 ? detail::bf16_to_f32(lo) : detail::f16_to_f32(lo);
      const float b = kType == HalfType::kBf16 ? detail::bf16_to_f32(hi) : detail::f16_to_f32(hi);
      sum += a * a + b * b;
    }
    return sum;
  }
}

template <HalfType kType>
__device__ inline float load_one(const void* x, std::size_t i) {
  if constexpr (kType == HalfType::kNone) {
    return static_cast<const float*>(x)[i];
  } else {
    const std::uint16_t h = static_cast<const std::uint16_t*>(x)[i];
    return kType == HalfType::kBf16 ? detail::bf16_to_f32(h) : detail::f16_to_f32(h);
  }
}

// Pass 1: block b writes the fp32 sum of its grid-stride share to partials[b]. `vec_groups`
// 16-byte groups are read as vectors (0 when `x` is not 16-byte aligned); elements from
// vec_groups * per_vec to count are read one by one.
template <HalfType kType>
__global__ void sq_norm_partials(const void* __restrict__ x, std::size_t count,
                                 std::size_t vec_groups, float* __restrict__ partials) {
  constexpr std::size_t kPerVec = kType == HalfType::kNone ? 4 : 8;
  float sum = 0.0f;
  const uint4* vec = static_cast<const uint4*>(x);
  for (std::size_t g = global_thread(); g < vec_groups; g += grid_threads()) {
    sum += sq_sum_vec<kType>(vec[g]);
  }
  for (std::size_t i = vec_groups * kPerVec + global_thread(); i < count; i += grid_threads()) {
    const float v = load_one<kType>(x, i);
    sum += v * v;
  }
  const float total = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Pass 2: one block sums the partials in fp64, in a fixed order.
__global__ void sq_norm_finish(const float* __restrict__ partials, unsigned partial_count,
                               float* __restrict__ out, bool accumulate) {
  double sum = 0.0;
  for (unsigned i = threadIdx.x; i < partial_count; i += blockDim.x) sum += partials[i];
  const double total = block_sum(sum);
  if (threadIdx.x == 0) {
    *out = accumulate ? static_cast<float>(static_cast<double>(*out) + total)
                      : static_cast<float>(total);
  }
}

template <HalfType kType>
cudaError_t launch_partials(const void* x, std::size_t count, std::size_t vec_groups,
                            unsigned blocks, float* partials, cudaStream_t s) {
  return detail::launch(sq_norm_partials<kType>, blocks, detail::kThreads, s, x, count, vec_groups,
                        partials);
}

}  // namespace

LaunchError sq_norm(const void* x, HalfType type, std::size_t count, float* partials, float* out,
                    bool accumulate, Stream stream) {
  auto* s = static_cast<cudaStream_t>(stream);
  const std::size_t per_vec = type == HalfType::kNone ? 4 : 8;
  const std::size_t vec_groups = detail::aligned16(x) ? count / per_vec : 0;
  // Enough blocks to fill the GPU several times over at 8 elements a thread, at most one
  // partial per scratch slot. The count alone decides it (see the header on determinism).
  std::size_t blocks = (count / 8 + detail::kThreads - 1) / detail::kThreads;
  if (blocks == 0) blocks = 1;
  if (blocks > kSqNormPartials) blocks = kSqNormPartials;
  const auto grid = static_cast<unsigned>(blocks);
  cudaError_t err = cudaErrorInvalidValue;
  switch (type) {
    case HalfType::kNone:
      err = launch_partials<HalfType::kNone>(x, count, vec_groups, grid, partials, s);
      break;
    case HalfType::kBf16:
      err = launch_partials<HalfType::kBf16>(x, count, vec_groups, grid, partials, s);
      break;
    case HalfType::kF16:
      err = launch_partials<HalfType::kF16>(x, count, vec_groups, grid, partials, s);
      break;
  }
  if (err != cudaSuccess) return static_cast<LaunchError>(err);
  return static_cast<LaunchError>(
      detail::launch(sq_norm_finish, 1, detail::kThreads, s, partials, grid, out, accumulate));
}

}  // namespace zinf::kernels
