#include "base/random.hpp"

#include <tbb/parallel_for.h>

#include <cstring>

namespace zinf {
namespace {
constexpr std::size_t kChunkElements = std::size_t{1} << 16;

std::uint64_t chunk_seed(std::uint64_t seed, std::size_t chunk) {
  SplitMix64 mix(seed ^ (0xd1b54a32d192ed03ull * (chunk + 1)));
  return mix.next();
}
}  // namespace

void fill_uniform(float* data, std::size_t count, std::uint64_t seed, float lo, float hi) {
  const std::size_t chunks = (count + kChunkElements - 1) / kChunkElements;
  tbb::parallel_for(std::size_t{0}, chunks, [&](std::size_t chunk) {
    SplitMix64 rng(chunk_seed(seed, chunk));
    const std::size_t begin = chunk * kChunkElements;
    const std::size_t end = begin + kChunkElements < count ? begin + kChunkElements : count;
    for (std::size_t i = begin; i < end; ++i) data[i] = rng.uniform(lo, hi);
  });
}

void fill_random_bytes(void* data, std::size_t bytes, std::uint64_t seed) {
  auto* out = static_cast<unsigned char*>(data);
  const std::size_t chunk_bytes = kChunkElements * 8;
  const std::size_t chunks = (bytes + chunk_bytes - 1) / chunk_bytes;
  tbb::parallel_for(std::size_t{0}, chunks, [&](std::size_t chunk) {
    SplitMix64 rng(chunk_seed(seed, chunk));
    const std::size_t begin = chunk * chunk_bytes;
    const std::size_t end = begin + chunk_bytes < bytes ? begin + chunk_bytes : bytes;
    std::size_t i = begin;
    for (; i + 8 <= end; i += 8) {
      const std::uint64_t word = rng.next();
      std::memcpy(out + i, &word, 8);
    }
    if (i < end) {
      const std::uint64_t word = rng.next();
      std::memcpy(out + i, &word, end - i);
    }
  });
}

}  // namespace zinf
