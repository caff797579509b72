// The update of kernel.hpp written once for every path, and the dispatch from (optimizer kind,
// gradient dtype, half-precision output) to one compiled kernel.
//
// Each path's file (kernel_scalar.cpp, kernel_avx2.cpp, kernel_avx512.cpp) defines, inside an
// anonymous namespace, an `Isa` struct of vector operations and a `Lanes` struct that loads and
// stores the vector at one position, and instantiates these templates with them. Because those
// structs are file-local, every instantiation is a distinct function with internal linkage,
// compiled with that file's target flags (lib/CMakeLists.txt): no AVX-512 instruction can reach
// the scalar path through an inline definition the linker merged (ODR). For the same reason this
// header holds only templates and types; a plain inline function here would be compiled once per
// flag set and the linker would keep any one of the copies.
//
// What a path supplies:
//   struct Isa {
//     using Vec = ...;                     // float, __m256 or __m512
//     static Vec set1(float);
//     static Vec mul(Vec, Vec), add(Vec, Vec), div(Vec, Vec), sqrt(Vec);
//     static Vec fma(Vec a, Vec b, Vec c);  // a * b + c, one rounding
//     static Vec sign(Vec);                 // torch.sign: -1, 0, +1, NaN kept
//   };
//   struct Lanes {  // the vector at one position i of every stream
//     Vec load(const float* base) const;   // base[i ...]
//     void store(float* base, Vec) const;
//     template <DType G> Vec load_grad(const void* grads) const;
//     template <Out O> void store_half(void* half, Vec params) const;  // O != kNone
//   };
//   struct Ops {  // the loop over [begin, end), tail included
//     template <OptimizerKind K, DType G, Out O>
//     static void range(const KernelArgs&, const OptimizerSpan&, std::size_t begin,
//                       std::size_t end);
//   };
#pragma once

#include <cstddef>

#include "optim/kernel.hpp"

namespace zinf::optim {

// The half-precision copy the update also writes.
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

template <class Isa>
struct Consts {
  using Vec = typename Isa::Vec;
  Vec beta1, beta2, omb1, omb2, neg_step, inv_sqrt_bc2, eps, l2, decay, grad_scale;
  explicit Consts(const KernelArgs& a)
      : beta1(Isa::set1(a.beta1)),
        beta2(Isa::set1(a.beta2)),
        omb1(Isa::set1(a.omb1)),
        omb2(Isa::set1(a.omb2)),
        neg_step(Isa::set1(-a.step_size)),
        inv_sqrt_bc2(Isa::set1(a.inv_sqrt_bc2)),
        eps(Isa::set1(a.eps)),
        l2(Isa::set1(a.l2)),
        decay(Isa::set1(a.decay)),
        grad_scale(Isa::set1(a.grad_scale)) {}
};

// One vector of the update at the position `at` names, in the operation order of kernel.hpp.
// -step_size * x + p is fma(neg_step, x, p): negating a float is exact, so this is the same
// single rounding as fma(-step_size, x, p) in every path.
template <class Isa, OptimizerKind K, DType G, Out O, class Lanes>
[[gnu::always_inline]] inline void update_lanes(const Flags& f, const Consts<Isa>& c,
                                                const Streams& s, const Lanes& at) {
  using Vec = typename Isa::Vec;
  Vec g = Isa::mul(at.template load_grad<G>(s.grads), c.grad_scale);
  Vec p = at.load(s.params);
  if constexpr (K == OptimizerKind::kAdam || K == OptimizerKind::kAdamW) {
    if (f.has_l2) g = Isa::fma(c.l2, p, g);
    const Vec m = Isa::fma(c.omb1, g, Isa::mul(c.beta1, at.load(s.exp_avg)));
    const Vec v = Isa::fma(Isa::mul(c.omb2, g), g, Isa::mul(c.beta2, at.load(s.exp_avg_sq)));
    const Vec d = Isa::fma(Isa::sqrt(v), c.inv_sqrt_bc2, c.eps);
    if (f.has_decay) p = Isa::mul(p, c.decay);
    p = Isa::fma(c.neg_step, Isa::div(m, d), p);
    at.store(s.exp_avg, m);
    at.store(s.exp_avg_sq, v);
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    if (f.has_l2) g = Isa::fma(c.l2, p, g);
    const Vec sum = Isa::fma(g, g, at.load(s.exp_avg_sq));
    const Vec d = Isa::add(Isa::sqrt(sum), c.eps);
    p = Isa::fma(c.neg_step, Isa::div(g, d), p);
    at.store(s.exp_avg_sq, sum);
  } else {
    if (f.has_decay) p = Isa::mul(p, c.decay);
    const Vec m = at.load(s.exp_avg);
    const Vec dir = Isa::fma(c.omb1, g, Isa::mul(c.beta1, m));
    p = Isa::fma(c.neg_step, Isa::sign(dir), p);
    at.store(s.exp_avg, Isa::fma(c.omb2, g, Isa::mul(c.beta2, m)));
  }
  at.store(s.params, p);
  if constexpr (O != Out::kNone) at.template store_half<O>(s.params_half, p);
}

// The dispatch: picks Ops::range for the span's gradient dtype and half output, then runs it.
template <class Ops, OptimizerKind K, DType G>
UpdateFn pick_out(const OptimizerSpan& s) {
  if (s.params_half == nullptr) return &Ops::template range<K, G, Out::kNone>;
  if (s.half_dtype == DType::kBF16) return &Ops::template range<K, G, Out::kBF16>;
  return &Ops::template range<K, G, Out::kF16>;
}

template <class Ops, OptimizerKind K>
UpdateFn pick_grad(const OptimizerSpan& s) {
  switch (s.grad_dtype) {
    case DType::kF32:
      return pick_out<Ops, K, DType::kF32>(s);
    case DType::kBF16:
      return pick_out<Ops, K, DType::kBF16>(s);
    case DType::kF16:
      return pick_out<Ops, K, DType::kF16>(s);
  }
  return nullptr;
}

// An UpdateFn for the table of a path.
template <class Ops>
void update(const KernelArgs& a, const OptimizerSpan& s, std::size_t begin, std::size_t end) {
  UpdateFn fn = nullptr;
  switch (a.kind) {
    case OptimizerKind::kAdam:
      fn = pick_grad<Ops, OptimizerKind::kAdam>(s);
      break;
    case OptimizerKind::kAdamW:
      fn = pick_grad<Ops, OptimizerKind::kAdamW>(s);
      break;
    case OptimizerKind::kAdagrad:
      fn = pick_grad<Ops, OptimizerKind::kAdagrad>(s);
      break;
    case OptimizerKind::kLion:
      fn = pick_grad<Ops, OptimizerKind::kLion>(s);
      break;
  }
  fn(a, s, begin, end);
}

}  // namespace zinf::optim
