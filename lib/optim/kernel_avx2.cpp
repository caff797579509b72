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

namespace zinf::optim {
namespace {

enum class Out { kNone, kBF16, kF16 };

// Loop invariants copied out of the arguments into locals: stores through the intrinsics'
// may_alias vector types would otherwise force the compiler to reload them every iteration.
struct Flags {
  bool has_l2;
  bool has_decay;
};
struct Streams {
  float* params;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grads;
  void* params_half;
};

struct Consts {
  __m256 beta1, beta2, omb1, omb2, neg_step, inv_sqrt_bc2, eps, l2, decay, grad_scale;
  explicit Consts(const KernelArgs& a)
      : beta1(_mm256_set1_ps(a.beta1)),
        beta2(_mm256_set1_ps(a.beta2)),
        omb1(_mm256_set1_ps(a.omb1)),
        omb2(_mm256_set1_ps(a.omb2)),
        neg_step(_mm256_set1_ps(-a.step_size)),
        inv_sqrt_bc2(_mm256_set1_ps(a.inv_sqrt_bc2)),
        eps(_mm256_set1_ps(a.eps)),
        l2(_mm256_set1_ps(a.l2)),
        decay(_mm256_set1_ps(a.decay)),
        grad_scale(_mm256_set1_ps(a.grad_scale)) {}
};

template <DType G>
inline __m256 load_grad(const void* grads, std::size_t i) {
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

// sign(c) as torch.sign, NaN kept.
inline __m256 sign_of(__m256 c) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
  const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
  return _mm256_blendv_ps(_mm256_or_ps(pos, neg), c, _mm256_cmp_ps(c, c, _CMP_UNORD_Q));
}

template <OptimizerKind K, DType G, Out O>
inline void update_vector(const Flags& a, const Consts& c, const Streams& s, std::size_t i) {
  __m256 g = _mm256_mul_ps(load_grad<G>(s.grads, i), c.grad_scale);
  __m256 p = _mm256_loadu_ps(s.params + i);
  if constexpr (K == OptimizerKind::kAdam || K == OptimizerKind::kAdamW) {
    if (a.has_l2) g = _mm256_fmadd_ps(c.l2, p, g);
    const __m256 m =
        _mm256_fmadd_ps(c.omb1, g, _mm256_mul_ps(c.beta1, _mm256_loadu_ps(s.exp_avg + i)));
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(c.omb2, g), g,
                                     _mm256_mul_ps(c.beta2, _mm256_loadu_ps(s.exp_avg_sq + i)));
    const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v), c.inv_sqrt_bc2, c.eps);
    if (a.has_decay) p = _mm256_mul_ps(p, c.decay);
    p = _mm256_fmadd_ps(c.neg_step, _mm256_div_ps(m, d), p);
    _mm256_storeu_ps(s.exp_avg + i, m);
    _mm256_storeu_ps(s.exp_avg_sq + i, v);
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    if (a.has_l2) g = _mm256_fmadd_ps(c.l2, p, g);
    const __m256 sum = _mm256_fmadd_ps(g, g, _mm256_loadu_ps(s.exp_avg_sq + i));
    const __m256 d = _mm256_add_ps(_mm256_sqrt_ps(sum), c.eps);
    p = _mm256_fmadd_ps(c.neg_step, _mm256_div_ps(g, d), p);
    _mm256_storeu_ps(s.exp_avg_sq + i, sum);
  } else {
    if (a.has_decay) p = _mm256_mul_ps(p, c.decay);
    const __m256 m = _mm256_loadu_ps(s.exp_avg + i);
    const __m256 dir = _mm256_fmadd_ps(c.omb1, g, _mm256_mul_ps(c.beta1, m));
    p = _mm256_fmadd_ps(c.neg_step, sign_of(dir), p);
    _mm256_storeu_ps(s.exp_avg + i, _mm256_fmadd_ps(c.omb2, g, _mm256_mul_ps(c.beta2, m)));
  }
  _mm256_storeu_ps(s.params + i, p);
  if constexpr (O != Out::kNone) {
    const __m128i h = O == Out::kBF16 ? to_bf16(p) : to_f16(p);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(s.params_half) + i), h);
  }
}

template <OptimizerKind K, DType G, Out O>
void update_range(const KernelArgs& a, const OptimizerSpan& s, std::size_t begin, std::size_t end) {
  const Consts c(a);
  const Flags f{a.has_l2, a.has_decay};
  const Streams st{s.params, s.exp_avg, s.exp_avg_sq, s.grads, s.params_half};
  std::size_t i = begin;
  for (; i + 8 <= end; i += 8) update_vector<K, G, O>(f, c, st, i);
  if (i == end) return;
  // Tail: run the vector code on padded copies (zeros beyond the end) and copy the results back.
  const std::size_t left = end - i;
  const std::size_t grad_bytes = dtype_bytes(s.grad_dtype);
  alignas(32) float p[8] = {}, m[8] = {}, v[8] = {}, g[8] = {};
  alignas(32) std::uint16_t half[8] = {};
  std::memcpy(p, s.params + i, left * 4);
  if (s.exp_avg != nullptr) std::memcpy(m, s.exp_avg + i, left * 4);
  if (s.exp_avg_sq != nullptr) std::memcpy(v, s.exp_avg_sq + i, left * 4);
  std::memcpy(g, static_cast<const std::byte*>(s.grads) + i * grad_bytes, left * grad_bytes);
  const Streams local{p, m, v, g, half};
  update_vector<K, G, O>(f, c, local, 0);
  std::memcpy(s.params + i, p, left * 4);
  if (s.exp_avg != nullptr) std::memcpy(s.exp_avg + i, m, left * 4);
  if (s.exp_avg_sq != nullptr) std::memcpy(s.exp_avg_sq + i, v, left * 4);
  if constexpr (O != Out::kNone) {
    std::memcpy(static_cast<std::uint16_t*>(s.params_half) + i, half, left * 2);
  }
}

template <OptimizerKind K, DType G>
UpdateFn pick_out(const OptimizerSpan& s) {
  if (s.params_half == nullptr) return &update_range<K, G, Out::kNone>;
  if (s.half_dtype == DType::kBF16) return &update_range<K, G, Out::kBF16>;
  return &update_range<K, G, Out::kF16>;
}

template <OptimizerKind K>
UpdateFn pick_grad(const OptimizerSpan& s) {
  switch (s.grad_dtype) {
    case DType::kF32:
      return pick_out<K, DType::kF32>(s);
    case DType::kBF16:
      return pick_out<K, DType::kBF16>(s);
    case DType::kF16:
      return pick_out<K, DType::kF16>(s);
  }
  return nullptr;
}

void update(const KernelArgs& a, const OptimizerSpan& s, std::size_t begin, std::size_t end) {
  UpdateFn fn = nullptr;
  switch (a.kind) {
    case OptimizerKind::kAdam:
      fn = pick_grad<OptimizerKind::kAdam>(s);
      break;
    case OptimizerKind::kAdamW:
      fn = pick_grad<OptimizerKind::kAdamW>(s);
      break;
    case OptimizerKind::kAdagrad:
      fn = pick_grad<OptimizerKind::kAdagrad>(s);
      break;
    case OptimizerKind::kLion:
      fn = pick_grad<OptimizerKind::kLion>(s);
      break;
  }
  fn(a, s, begin, end);
}

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
  static const KernelTable table{&update, &finite, &convert};
  return table;
}

}  // namespace zinf::optim
