// f32 / bf16 / f16 -> f32 widening of a contiguous array, optionally added into the destination,
// on the GPU and as a scalar reference. The engine fills its fp32 reduce buckets with it from the
// gradients the backward pass wrote in the parameters' dtype, and adds micro-batches into stage
// 1's full-size fp32 gradients.
//
// Maths: every bf16 and f16 value is exactly an f32 value, so widening is exact: a bf16 is the
// f32 whose top 16 bits it is; an f16 is rebiased (exponent bias 15 -> 127), its subnormals
// becoming normal f32 values; infinities stay infinities and a NaN stays a NaN with its sign and
// payload (shifted up 13 bits), as zinf::f16_to_f32 / zinf::bf16_to_f32 (include/zinf/dtype.hpp).
// With accumulate, dst[i] = dst[i] + widen(src[i]): one f32 addition, rounded to nearest even
// (the kernel uses __fadd_rn, so nothing is contracted with a neighbouring operation), the same
// bits as the host's `dst[i] += bf16_to_f32(src[i])`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/launch.h"

namespace zinf::kernels {

// Enqueues dst[i] = widen(src[i]) (accumulate: dst[i] += widen(src[i])) for i < count on
// `stream`. `src_type` is the source's 16-bit format, or HalfType::kNone for f32 (a copy, or an
// f32 addition with accumulate). Pointers are device memory; 16-byte vector accesses are used
// when both are 16-byte aligned, and any element alignment is correct.
// REQUIRES: src and dst do not overlap. Returns 0 or the launch's cudaError_t.
LaunchError widen_to_f32(const void* src, HalfType src_type, float* dst, std::size_t count,
                         bool accumulate, Stream stream);

// The scalar reference on host memory: the ground truth for the kernel above.
void widen_to_f32_ref(const void* src, HalfType src_type, float* dst, std::size_t count,
                      bool accumulate);

}  // namespace zinf::kernels
