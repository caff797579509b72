// xxh3-64, the checksum of every block the swap space writes, computed by the widest code the
// CPU runs (the checkpoint files' checksums still call libxxhash). Debian's libxxhash is built for
// baseline x86-64 (SSE2) and hashes about 7 GB/s on one core even from cache; the same function
// compiled for AVX2 (hash_avx2.cpp) or AVX-512 (hash_avx512.cpp) from xxhash.h's inline definitions
// gives the same 64 bits about three times as fast from cache and 1.4-1.5 times from memory
// (docs/BENCHMARKS.md). The optimizer step on NVMe hashes every byte it writes and reads.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf {

// XXH3_64bits(data, bytes), seed 0: the same value on every path.
std::uint64_t xxh3_64(const void* data, std::size_t bytes);

namespace hash_kernel {

// xxh3_64() compiled for each instruction set. REQUIRES: the CPU has it
// (CpuFeatures::has_avx2_path(), has_avx512_path()).
std::uint64_t xxh3_64_avx2(const void* data, std::size_t bytes);
std::uint64_t xxh3_64_avx512(const void* data, std::size_t bytes);
// The library's own (libxxhash).
std::uint64_t xxh3_64_library(const void* data, std::size_t bytes);

}  // namespace hash_kernel
}  // namespace zinf
