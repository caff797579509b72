// f32 -> bf16 over an array, written once so that the compiler vectorises it, and compiled for
// the baseline (dtype.cpp: SSE2), AVX2 (dtype_avx2.cpp) and AVX-512 (dtype_avx512.cpp);
// convert_f32_to_bf16() picks the widest the CPU has. Every path gives f32_to_bf16()'s bits.
//
// The rounding is f32_to_bf16()'s: bf16 = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16 rounds to
// nearest with ties to even, a carry out of the mantissa bumping the exponent (up to infinity).
// NaN (|bits| > 0x7f800000) keeps its sign and top payload bits, with the quiet bit set when the
// kept payload is empty. Here the NaN case is a select instead of a branch: a branch in the loop
// kept GCC from vectorising it, and the scalar loop narrowed 256M values in 0.63 s where the
// AVX-512 one takes 0.13 s (the memory's time) on the Xeon this was measured on.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace zinf::dtype_kernel {

inline void f32_to_bf16_range(const float* __restrict src, std::uint16_t* __restrict dst,
                              std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint32_t bits = std::bit_cast<std::uint32_t>(src[i]);
    const std::uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const std::uint32_t top = bits >> 16;
    const std::uint32_t quiet = top | ((top & 0x7fu) == 0 ? 0x40u : 0u);
    dst[i] = static_cast<std::uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
}

// The loop above compiled for each instruction set. REQUIRES: the CPU has it
// (CpuFeatures::has_avx2_path(), has_avx512_path()); src and dst do not overlap.
void f32_to_bf16_sse2(const float* src, std::uint16_t* dst, std::size_t count);
void f32_to_bf16_avx2(const float* src, std::uint16_t* dst, std::size_t count);
void f32_to_bf16_avx512(const float* src, std::uint16_t* dst, std::size_t count);

}  // namespace zinf::dtype_kernel
