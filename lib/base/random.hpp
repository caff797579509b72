// Seeded pseudo-random data for tests and benchmarks (never time or test on zeros).
// SplitMix64: tiny, fast, and the same stream on every machine for a given seed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf {

class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform in [lo, hi).
  float uniform(float lo, float hi) { return lo + static_cast<float>(uniform()) * (hi - lo); }

 private:
  std::uint64_t state_;
};

// Fills `count` floats uniformly in [lo, hi) from `seed`, in parallel-friendly chunks whose
// content depends only on the seed and the element index.
void fill_uniform(float* data, std::size_t count, std::uint64_t seed, float lo = -1.0f,
                  float hi = 1.0f);
// Fills `bytes` bytes with random bits from `seed`.
void fill_random_bytes(void* data, std::size_t bytes, std::uint64_t seed);

}  // namespace zinf
