// The AVX-512 path (F, BW, VL, DQ; BF16 where the CPU has it): 16 elements a vector, the tail
// done with masked loads and stores, so every element goes through the same instructions and
// the same operation order as the scalar path (kernel.hpp).
//
// bf16 outputs: VCVTNEPS2BF16 rounds to nearest even like f32_to_bf16, but treats denormal
// inputs as zero and always sets the quiet bit of a NaN. Lanes holding a denormal or a NaN (one
// VFPCLASSPS to find them; rare in practice) are redone with the integer rounding
//   bf16 = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16,
// which is what runs everywhere on CPUs without AVX512-BF16.
// f16 outputs: VCVTPS2PH with round-to-nearest-even; NaN lanes are redone in integers, to keep
// f32_to_f16's payload rule.
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized
// reports once inlined (GCC bug 105593); the values are fully defined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <bit>

#include "optim/kernel.hpp"
#include "optim/kernel_update.hpp"

namespace zinf::optim {
namespace {

constexpr int kFpclassQnan = 0x01;
constexpr int kFpclassDenormal = 0x20;
constexpr int kFpclassSnan = 0x80;

template <bool kMasked>
inline __m512 load_f32(const float* p, __mmask16 k) {
  if constexpr (kMasked) return _mm512_maskz_loadu_ps(k, p);
  return _mm512_loadu_ps(p);
}
template <bool kMasked>
inline void store_f32(float* p, __mmask16 k, __m512 x) {
  if constexpr (kMasked) {
    _mm512_mask_storeu_ps(p, k, x);
  } else {
    _mm512_storeu_ps(p, x);
  }
}
template <bool kMasked>
inline __m256i load_u16(const std::uint16_t* p, __mmask16 k) {
  if constexpr (kMasked) return _mm256_maskz_loadu_epi16(k, p);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
template <bool kMasked>
inline void store_u16(std::uint16_t* p, __mmask16 k, __m256i x) {
  if constexpr (kMasked) {
    _mm256_mask_storeu_epi16(p, k, x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
}

// f32_to_bf16 in integers, for all 16 lanes.
inline __m256i bf16_integer(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  // NaN: keep the sign and the top payload bits; set the quiet bit only if none are left.
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __mmask16 empty = _mm512_testn_epi32_mask(hi, _mm512_set1_epi32(0x7f));
  r = _mm512_mask_mov_epi32(r, nan, hi);
  r = _mm512_mask_or_epi32(r, nan & empty, r, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

template <bool kBf16Insn>
inline __m256i to_bf16(__m512 x) {
  if constexpr (kBf16Insn) {
    __m256i h = std::bit_cast<__m256i>(_mm512_cvtneps_pbh(x));
    const __mmask16 odd = _mm512_fpclass_ps_mask(x, kFpclassQnan | kFpclassSnan | kFpclassDenormal);
    if (odd != 0) [[unlikely]]
      h = _mm256_mask_blend_epi16(odd, h, bf16_integer(x));
    return h;
  } else {
    return bf16_integer(x);
  }
}

inline __m256i to_f16(__m512 x) {
  __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 nan = _mm512_fpclass_ps_mask(x, kFpclassQnan | kFpclassSnan);
  if (nan != 0) [[unlikely]] {
    // f32_to_f16 on NaN: sign | 0x7c00 | top 10 payload bits, or the quiet bit if they are 0.
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x8000));
    const __m512i payload =
        _mm512_and_si512(_mm512_srli_epi32(bits, 13), _mm512_set1_epi32(0x03ff));
    const __mmask16 empty = _mm512_testn_epi32_mask(payload, payload);
    __m512i r = _mm512_or_si512(sign, _mm512_or_si512(payload, _mm512_set1_epi32(0x7c00)));
    r = _mm512_mask_or_epi32(r, empty, r, _mm512_set1_epi32(0x0200));
    h = _mm256_mask_blend_epi16(nan, h, _mm512_cvtepi32_epi16(r));
  }
  return h;
}

struct Isa {
  using Vec = __m512;
  static __m512 set1(float x) { return _mm512_set1_ps(x); }
  static __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
  static __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
  static __m512 div(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
  static __m512 sqrt(__m512 a) { return _mm512_sqrt_ps(a); }
  static __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  // sign(c) as torch.sign, NaN kept.
  static __m512 sign(__m512 c) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 s =
        _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
    return _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q), c);
  }
};

// Elements [i, i + 16) of every stream, or the lanes of mask k when kMasked (the tail).
template <bool kBf16Insn, bool kMasked>
struct Lanes {
  std::size_t i;
  __mmask16 k;
  __m512 load(const float* base) const { return load_f32<kMasked>(base + i, k); }
  void store(float* base, __m512 x) const { store_f32<kMasked>(base + i, k, x); }
  template <DType G>
  __m512 load_grad(const void* grads) const {
    if constexpr (G == DType::kF32) {
      return load_f32<kMasked>(static_cast<const float*>(grads) + i, k);
    } else {
      const __m256i h = load_u16<kMasked>(static_cast<const std::uint16_t*>(grads) + i, k);
      if constexpr (G == DType::kBF16) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        return _mm512_cvtph_ps(h);
      }
    }
  }
  template <Out O>
  void store_half(void* half, __m512 p) const {
    const __m256i h = O == Out::kBF16 ? to_bf16<kBf16Insn>(p) : to_f16(p);
    store_u16<kMasked>(static_cast<std::uint16_t*>(half) + i, k, h);
  }
};

template <bool kBf16Insn>
struct Ops {
  template <OptimizerKind K, DType G, Out O>
  static void range(const KernelArgs& a, const OptimizerSpan& s, std::size_t begin,
                    std::size_t end) {
    const Consts<Isa> c(a);
    const Flags f{a.has_l2, a.has_decay};
    const Streams st{s.params, s.exp_avg, s.exp_avg_sq, s.grads, s.params_half};
    std::size_t i = begin;
    for (; i + 16 <= end; i += 16) {
      update_lanes<Isa, K, G, O>(f, c, st, Lanes<kBf16Insn, false>{i, 0xffff});
    }
    if (i < end) {
      const auto k = static_cast<__mmask16>((1u << (end - i)) - 1u);
      update_lanes<Isa, K, G, O>(f, c, st, Lanes<kBf16Insn, true>{i, k});
    }
  }
};

bool finite(const void* data, DType dtype, std::size_t begin, std::size_t end) {
  if (dtype == DType::kF32) {
    const float* f = static_cast<const float*>(data);
    const __m512i exp = _mm512_set1_epi32(0x7f800000);
    std::size_t i = begin;
    for (; i + 16 <= end; i += 16) {
      const __m512i x = _mm512_and_si512(_mm512_loadu_si512(f + i), exp);
      if (_mm512_cmpeq_epi32_mask(x, exp) != 0) return false;
    }
    if (i < end) {
      const __mmask16 k = static_cast<__mmask16>((1u << (end - i)) - 1u);
      const __m512i x = _mm512_and_si512(_mm512_maskz_loadu_epi32(k, f + i), exp);
      return _mm512_mask_cmpeq_epi32_mask(k, x, exp) == 0;
    }
    return true;
  }
  const std::uint16_t* h = static_cast<const std::uint16_t*>(data);
  const __m512i exp = _mm512_set1_epi16(dtype == DType::kBF16 ? 0x7f80 : 0x7c00);
  std::size_t i = begin;
  for (; i + 32 <= end; i += 32) {
    const __m512i x = _mm512_and_si512(_mm512_loadu_si512(h + i), exp);
    if (_mm512_cmpeq_epi16_mask(x, exp) != 0) return false;
  }
  if (i < end) {
    const __mmask32 k = static_cast<__mmask32>((std::uint64_t{1} << (end - i)) - 1u);
    const __m512i x = _mm512_and_si512(_mm512_maskz_loadu_epi16(k, h + i), exp);
    return _mm512_mask_cmpeq_epi16_mask(k, x, exp) == 0;
  }
  return true;
}

template <bool kBf16Insn>
void convert(const float* src, std::uint16_t* dst, DType dtype, std::size_t begin,
             std::size_t end) {
  std::size_t i = begin;
  for (; i < end; i += 16) {
    const std::size_t left = end - i;
    const __mmask16 k =
        left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(k, src + i);
    const __m256i h = dtype == DType::kBF16 ? to_bf16<kBf16Insn>(x) : to_f16(x);
    _mm256_mask_storeu_epi16(dst + i, k, h);
  }
}

}  // namespace

const KernelTable& kernels_avx512(bool use_bf16_instructions) {
  static const KernelTable with_bf16{&update<Ops<true>>, &finite, &convert<true>};
  static const KernelTable without_bf16{&update<Ops<false>>, &finite, &convert<false>};
  return use_bf16_instructions ? with_bf16 : without_bf16;
}

}  // namespace zinf::optim
