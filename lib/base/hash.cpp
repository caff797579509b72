// xxh3_64(): see hash.hpp.
#include "base/hash.hpp"

#include <xxhash.h>

#include "base/cpu.hpp"

namespace zinf {

namespace hash_kernel {

std::uint64_t xxh3_64_library(const void* data, std::size_t bytes) {
  return XXH3_64bits(data, bytes);
}

}  // namespace hash_kernel

namespace {

using HashFn = std::uint64_t (*)(const void*, std::size_t);

// The widest path the CPU runs, chosen once.
HashFn pick_xxh3_64() {
  if (cpu_features().has_avx512_path()) return &hash_kernel::xxh3_64_avx512;
  if (cpu_features().has_avx2_path()) return &hash_kernel::xxh3_64_avx2;
  return &hash_kernel::xxh3_64_library;
}

}  // namespace

std::uint64_t xxh3_64(const void* data, std::size_t bytes) {
  static const HashFn hash = pick_xxh3_64();
  return hash(data, bytes);
}

}  // namespace zinf
