// xxh3_64() compiled for AVX512 (see hash.hpp): xxhash.h's definitions inlined here (renamed,
// so they do not meet libxxhash's), which pick their AVX512 loop from this file's flags.
#include "base/hash.hpp"

// GCC 12 reports its own AVX-512 intrinsics' undefined-vector idiom (_mm512_undefined_*) as an
// uninitialized read once they are inlined here; the warning is about the compiler's header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace zinf::hash_kernel {

std::uint64_t xxh3_64_avx512(const void* data, std::size_t bytes) {
  return XXH3_64bits(data, bytes);
}

}  // namespace zinf::hash_kernel

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
