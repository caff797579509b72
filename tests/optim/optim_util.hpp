// Shared pieces of the optimizer tests: the SIMD paths this CPU can run, seeded problems with
// unaligned starts, and a double-precision reference written from the formulas in
// include/zinf/optim.hpp (independently of the kernels' float operation order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "optim/kernel.hpp"
#include "zinf/dtype.hpp"
#include "zinf/optim.hpp"

namespace zinf::optim_test {

// One way to run the kernels. `table` is the internal kernel table (so the AVX-512 path can be
// tested with and without the AVX512-BF16 instructions); `simd` is what the public API calls it.
struct Path {
  std::string name;
  const optim::KernelTable* table;
  Simd simd;
};
// Every path the kernels have, whether this CPU runs it or not.
inline constexpr const char* kPathNames[] = {"scalar", "avx2", "avx512-intbf16", "avx512-bf16"};
// The path called `name`, or nullopt with the reason this CPU cannot run it in *why_not. A test
// of one path calls GTEST_SKIP() with that reason, so ctest shows the path as not run.
std::optional<Path> find_path(std::string_view name, std::string* why_not);
// Every path this CPU runs (the scalar one always). Tests that loop over them are complemented by
// SimdPaths.RunsHere, which skips visibly for each path left out.
std::vector<Path> available_paths();

// Magnitudes of the random data: params uniform in +-param_scale, gradients in +-grad_scale,
// exp_avg in +-grad_scale, exp_avg_sq in [0, grad_scale^2).
struct Magnitudes {
  double param_scale = 1.0;
  double grad_scale = 1.0;
};

// The arrays of one problem. Each array is allocated with `offset` extra leading elements and
// used from there, so the data starts unaligned.
class Problem {
 public:
  Problem(std::size_t count, DType grad_dtype, bool with_half, DType half_dtype, std::size_t offset,
          Magnitudes magnitudes, std::uint64_t seed);

  OptimizerSpan span();
  float* params() { return params_.data() + offset_; }
  float* exp_avg() { return exp_avg_.data() + offset_; }
  float* exp_avg_sq() { return exp_avg_sq_.data() + offset_; }
  std::uint16_t* half() { return with_half_ ? half_.data() + offset_ : nullptr; }
  // Gradient i as the kernel sees it (widened exactly from bf16/f16).
  float grad(std::size_t i) const;
  void set_grad(std::size_t i, float value);  // rounds to grad_dtype
  void* grad_data();
  std::size_t count() const { return count_; }
  DType grad_dtype() const { return grad_dtype_; }
  DType half_dtype() const { return half_dtype_; }
  // True when every array (and the half copy) is bitwise equal to `other`'s.
  bool same_bits(const Problem& other) const;

 private:
  std::size_t count_, offset_;
  DType grad_dtype_, half_dtype_;
  bool with_half_;
  std::vector<float> params_, exp_avg_, exp_avg_sq_, grad32_;
  std::vector<std::uint16_t> grad16_, half_;
};

// The double-precision result for one element, with the magnitude each output's error is
// relative to: the sum of the absolute values of the terms that make it up (so a result that
// cancels to near zero is judged against the size of what cancelled).
struct RefElement {
  double param = 0, exp_avg = 0, exp_avg_sq = 0;
  double param_scale = 0, exp_avg_scale = 0, exp_avg_sq_scale = 0;
  // Lion only: the update direction is so close to zero that float rounding may flip its sign;
  // then param may be any of param_decayed - lr * {-1, 0, +1}.
  bool sign_ambiguous = false;
  double param_decayed = 0;
};
RefElement reference_element(const OptimizerParams& hp, std::int64_t step, double grad_scale,
                             double param, double exp_avg, double exp_avg_sq, double grad);

// half = the rounding of the f32 value, by the library's scalar conversion.
std::uint16_t round_half(float value, DType dtype);

}  // namespace zinf::optim_test
