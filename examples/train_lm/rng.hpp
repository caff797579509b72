// SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014):
// a tiny seeded generator, so that a run is repeatable from --seed on any platform (the standard
// library's distributions are not specified bit for bit).
#pragma once

#include <cmath>
#include <cstdint>

namespace train_lm {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  // The whole state: Rng(state()) continues the same sequence (a checkpoint keeps it).
  std::uint64_t state() const { return state_; }

  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1), 24 random bits.
  float uniform() { return float(next() >> 40) * (1.0f / 16777216.0f); }
  // Uniform integer in [0, bound), bound > 0 (the modulo bias is below 2^-40 for our bounds).
  std::uint64_t below(std::uint64_t bound) { return next() % bound; }
  // Standard normal by Box-Muller.
  float normal() {
    const double u1 = (double(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    const double u2 = double(next() >> 11) * (1.0 / 9007199254740992.0);
    return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }

 private:
  std::uint64_t state_;
};

}  // namespace train_lm
