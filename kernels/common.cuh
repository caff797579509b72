// Device-side helpers shared by the kernels in this folder (included only by .cu files).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace zinf::kernels::detail {

// Threads per block for the element-wise kernels: enough to hide latency on sm_80/sm_90 with
// grid-stride loops, small enough to leave room for several resident blocks per SM.
constexpr unsigned kThreads = 256;
// Grid-stride loops cover any size, so the grid is capped: 65536 blocks of 256 threads is many
// waves on every current GPU, and keeps the grid size a function of the input size only.
constexpr std::size_t kMaxBlocks = std::size_t{1} << 16;

inline unsigned blocks_for(std::size_t work_items) {
  std::size_t blocks = (work_items + kThreads - 1) / kThreads;
  if (blocks == 0) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned>(blocks);
}

// Every launch in kernels/ goes through here (a ctest checks that no .cu file writes <<< itself):
// launches `kernel` on `stream` and returns that launch's error. cudaGetLastError() returns and
// clears the last error of any runtime call on this thread, so a failure nobody collected before
// (a cudaMalloc that ran out of memory, an invalid copy) would otherwise be reported as this
// launch's; it is cleared first. Such an error was already returned by the call that failed. A
// sticky error (a kernel fault poisons the context) cannot be cleared: the launch returns it too,
// which is right, since nothing can run on that context any more.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                   Args... args) {
  (void)cudaGetLastError();
  kernel<<<grid, block, 0, stream>>>(args...);
  return cudaGetLastError();
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

__device__ inline std::size_t global_thread() {
  return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline std::size_t grid_threads() {
  return static_cast<std::size_t>(gridDim.x) * blockDim.x;
}

// bf16 <- f32, bit for bit as zinf::f32_to_bf16 (include/zinf/dtype.hpp): round to nearest
// even by adding 0x7fff plus the lowest kept bit; a NaN keeps its sign and top payload bits and
// is made quiet only when the kept payload would be empty (which would read as infinity).
__device__ inline std::uint16_t f32_to_bf16(float value) {
  const std::uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    std::uint16_t out = static_cast<std::uint16_t>(bits >> 16);
    if ((out & 0x007fu) == 0) out |= 0x0040u;
    return out;
  }
  const std::uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<std::uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

// f16 <- f32, bit for bit as zinf::f32_to_f16. The hardware conversion (cvt.rn.f16.f32) rounds
// to nearest even with subnormals and overflow to infinity, exactly as the reference does for
// every non-NaN input; NaNs are done by hand because the hardware returns one canonical NaN
// where the reference keeps sign and payload.
__device__ inline std::uint16_t f32_to_f16(float value) {
  const std::uint32_t bits = __float_as_uint(value);
  const std::uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) {
    const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
    std::uint16_t payload = static_cast<std::uint16_t>((abs >> 13) & 0x03ffu);
    if (payload == 0) payload = 0x0200u;
    return sign | 0x7c00u | payload;
  }
  unsigned short out;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(value));
  return out;
}

// f32 <- f16 and f32 <- bf16, exact.
__device__ inline float f16_to_f32(std::uint16_t value) {
  float out;
  asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(static_cast<unsigned short>(value)));
  return out;
}
__device__ inline float bf16_to_f32(std::uint16_t value) {
  return __uint_as_float(static_cast<std::uint32_t>(value) << 16);
}

}  // namespace zinf::kernels::detail
