// fp32 -> bf16 / f16 casts of a contiguous array, on the GPU and as a scalar reference.
//
// Maths: each output is the input rounded to the nearest representable 16-bit value, ties to
// the even pattern (IEEE 754 roundTiesToEven); values beyond the format's range become
// infinities of the same sign; f16 keeps subnormals; a NaN stays a NaN with its sign and top
// payload bits. The GPU kernel matches zinf::f32_to_bf16 / zinf::f32_to_f16
// (include/zinf/dtype.hpp) bit for bit, so a parameter cast on the GPU and one cast on the CPU
// are the same bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/launch.h"

namespace zinf::kernels {

// Enqueues dst[i] = round(src[i]) for i < count on `stream`. Pointers are device (or managed /
// mapped) memory. 16-byte vector loads and stores are used when both pointers are 16-byte
// aligned; any alignment of 4 bytes (src) and 2 bytes (dst) is correct.
// REQUIRES: src and dst do not overlap. Returns 0 or the launch's cudaError_t.
LaunchError cast_f32_to_bf16(const float* src, std::uint16_t* dst, std::size_t count,
                             Stream stream);
LaunchError cast_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t count, Stream stream);

// The scalar references on host memory: the ground truth for the kernels above.
void cast_f32_to_bf16_ref(const float* src, std::uint16_t* dst, std::size_t count);
void cast_f32_to_f16_ref(const float* src, std::uint16_t* dst, std::size_t count);

}  // namespace zinf::kernels
