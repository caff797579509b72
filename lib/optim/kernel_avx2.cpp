// The AVX2 + FMA + F16C path: 8 elements a vector. The tail (fewer than 8 elements) is copied
// into padded local arrays and run through the same vector code, so every element goes through
// the same instructions and the same operation order as the scalar path (kernel.hpp).
//
// bf16 outputs use the integer rounding of f32_to_bf16 (AVX2 has no bf16 instruction):
//   bf16 = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16, NaN lanes keeping sign and payload.
// f16 outputs use VCVTPS2PH with round-to-nearest-even; NaN lanes (rare) are redone one by one
// with f32_to_f16, to keep its payload rule.
#include <immintrin.h>

#include <cstring>

#include "optim/kernel.hpp"
#include "optim/kernel_update.hpp"

namespace zinf::optim {
namespace {

inline __m128i to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  // NaN (rare, so behind a branch): keep the sign and the top payload bits; set the quiet bit
  // only if none are left.
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  if (_mm256_movemask_ps(nan) != 0) [[unlikely]] {
    const __m256i empty =
        _mm256_cmpeq_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(0x7f)), _mm256_setzero_si256());
    const __m256i nan_bits = _mm256_or_si256(hi, _mm256_and_si256(empty, _mm256_set1_epi32(0x40)));
    r = _mm256_blendv_epi8(r, nan_bits, _mm256_castps_si256(nan));
  }
  // Every lane is in [0, 0xffff], so the unsigned saturating pack is a plain narrowing.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline __m128i to_f16(__m256 x) {
  __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const int nan = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  if (nan != 0) [[unlikely]] {
    alignas(32) float lanes[8];
    alignas(16) std::uint16_t out[8];
    _mm256_store_ps(lanes, x);
    _mm_store_si128(reinterpret_cast<__m128i*>(out), h);
    for (int j = 0; j < 8; ++j) {
      if ((nan >> j) & 1) out[j] = f32_to_f16(lanes[j]);
    }
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(out));
  }
  return h;
}

struct Isa {
  using Vec = __m256;
  static __m256 set1(float x) { return _mm256_set1_ps(x); }
  static __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
  static __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 div(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
  static __m256 sqrt(__m256 a) { return _mm256_sqrt_ps(a); }
  static __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  // sign(c) as torch.sign, NaN kept.
  static __m256 sign(__m256 c) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
    return _mm256_blendv_ps(_mm256_or_ps(pos, neg), c, _mm256_cmp_ps(c, c, _CMP_UNORD_Q));
  }
};

// Elements [i, i + 8) of every stream.
struct Lanes {
  std::size_t i;
  __m256 load(const float* base) const { return _mm256_loadu_ps(base + i); }
  void store(float* base, __m256 x) const { _mm256_storeu_ps(base + i, x); }
  template <DType G>
  __m256 load_grad(const void* grads) const {
    if constexpr (G == DType::kF32) {
      return _mm256_loadu_ps(static_cast<const float*>(grads) + i);
    } else {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(grads) + i));
      if constexpr (G == DType::kBF16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        return _mm256_cvtph_ps(h);
      }
    }
  }
  template <Out O>
  void store_half(void* half, __m256 p) const {
    const __m128i h = O == Out::kBF16 ? to_bf16(p) : to_f16(p);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(half) + i), h);
  }
};

struct Ops {
  template <OptimizerKind K, DType G, Out O>
  static void range(const KernelArgs& a, const OptimizerSpan& s, std::size_t begin,
                    std::size_t end) {
    const Consts<Isa> c(a);
    const Flags f{a.has_l2, a.has_decay};
    const Streams st{s.params, s.exp_avg, s.exp_avg_sq, s.grads, s.params_half};
    std::size_t i = begin;
    for (; i + 8 <= end; i += 8) update_lanes<Isa, K, G, O>(f, c, st, Lanes{i});
    if (i == end) return;
    // Tail: run the vector code on padded copies (zeros beyond the end) and copy the results
    // back.
    const std::size_t left = end - i;
    const std::size_t grad_bytes = dtype_bytes(s.grad_dtype);
    alignas(32) float p[8] = {}, m[8] = {}, v[8] = {}, g[8] = {};
    alignas(32) std::uint16_t half[8] = {};
    std::memcpy(p, s.params + i, left * 4);
    if (s.exp_avg != nullptr) std::memcpy(m, s.exp_avg + i, left * 4);
    if (s.exp_avg_sq != nullptr) std::memcpy(v, s.exp_avg_sq + i, left * 4);
    std::memcpy(g, static_cast<const std::byte*>(s.grads) + i * grad_bytes, left * grad_bytes);
    const Streams local{p, m, v, g, half};
    update_lanes<Isa, K, G, O>(f, c, local, Lanes{0});
    std::memcpy(s.params + i, p, left * 4);
    if (s.exp_avg != nullptr) std::memcpy(s.exp_avg + i, m, left * 4);
    if (s.exp_avg_sq != nullptr) std::memcpy(s.exp_avg_sq + i, v, left * 4);
    if constexpr (O != Out::kNone) {
      std::memcpy(static_cast<std::uint16_t*>(s.params_half) + i, half, left * 2);
    }
  }
};

bool finite(const void* data, DType dtype, std::size_t begin, std::size_t end) {
  const std::byte* bytes = static_cast<const std::byte*>(data);
  const std::size_t elem_bytes = dtype_bytes(dtype);
  const __m256i exp = dtype == DType::kF32    ? _mm256_set1_epi32(0x7f800000)
                      : dtype == DType::kBF16 ? _mm256_set1_epi16(0x7f80)
                                              : _mm256_set1_epi16(0x7c00);
  auto bad = [&](const std::byte* p) {
    const __m256i x =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), exp);
    const __m256i eq = elem_bytes == 4 ? _mm256_cmpeq_epi32(x, exp) : _mm256_cmpeq_epi16(x, exp);
    return _mm256_movemask_epi8(eq) != 0;
  };
  const std::size_t per_vector = 32 / elem_bytes;
  std::size_t i = begin;
  for (; i + per_vector <= end; i += per_vector) {
    if (bad(bytes + i * elem_bytes)) return false;
  }
  if (i == end) return true;
  // Tail: zeros are finite in every format.
  alignas(32) std::byte tail[32] = {};
  std::memcpy(tail, bytes + i * elem_bytes, (end - i) * elem_bytes);
  return !bad(tail);
}

void convert(const float* src, std::uint16_t* dst, DType dtype, std::size_t begin,
             std::size_t end) {
  std::size_t i = begin;
  for (; i < end; i += 8) {
    const std::size_t left = end - i < 8 ? end - i : 8;
    alignas(32) float x[8] = {};
    alignas(16) std::uint16_t h[8];
    std::memcpy(x, src + i, left * 4);
    const __m256 v = _mm256_load_ps(x);
    _mm_store_si128(reinterpret_cast<__m128i*>(h), dtype == DType::kBF16 ? to_bf16(v) : to_f16(v));
    std::memcpy(dst + i, h, left * 2);
  }
}

}  // namespace

const KernelTable& kernels_avx2() {
  static const KernelTable table{&update<Ops>, &finite, &convert};
  return table;
}

}  // namespace zinf::optim
