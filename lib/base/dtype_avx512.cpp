// convert_f32_to_bf16()'s loop compiled for AVX-512 (see dtype_kernel.hpp).
#include "base/dtype_kernel.hpp"

namespace zinf::dtype_kernel {

void f32_to_bf16_avx512(const float* src, std::uint16_t* dst, std::size_t count) {
  f32_to_bf16_range(src, dst, count);
}

}  // namespace zinf::dtype_kernel
