// The bandwidth probe's inner loop compiled for AVX512 (see membw_kernel.hpp).
#include "base/membw_kernel.hpp"

namespace zinf::membw {

using Vec = unsigned long long __attribute__((vector_size(64)));

void pass_range_avx512(const StreamView* reads, int read_count, const StreamView* in_place,
                       int in_place_count, const StreamView* writes, int write_count,
                       std::size_t begin, std::size_t end) {
  pass_range<Vec>(reads, read_count, in_place, in_place_count, writes, write_count, begin, end);
}

}  // namespace zinf::membw
