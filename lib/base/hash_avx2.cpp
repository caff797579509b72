// xxh3_64() compiled for AVX2 (see hash.hpp): xxhash.h's definitions inlined here (renamed,
// so they do not meet libxxhash's), which pick their AVX2 loop from this file's flags.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "base/hash.hpp"

namespace zinf::hash_kernel {

std::uint64_t xxh3_64_avx2(const void* data, std::size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace zinf::hash_kernel
