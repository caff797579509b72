// optimizer_step(): validation, the per-call constants, the choice of SIMD path, and the split
// into tiles run on oneTBB. The per-element arithmetic lives in the kernel_*.cpp files.
#include "zinf/optim.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>

#include "base/assert.hpp"
#include "base/cpu.hpp"
#include "optim/kernel.hpp"

namespace zinf {

std::string_view optimizer_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kAdagrad:
      return "adagrad";
    case OptimizerKind::kLion:
      return "lion";
  }
  return "unknown";
}

bool parse_optimizer(std::string_view text, OptimizerKind* kind) {
  for (OptimizerKind k : {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kAdagrad,
                          OptimizerKind::kLion}) {
    if (text == optimizer_name(k)) {
      *kind = k;
      return true;
    }
  }
  return false;
}

std::string_view simd_name(Simd simd) {
  switch (simd) {
    case Simd::kAuto:
      return "auto";
    case Simd::kScalar:
      return "scalar";
    case Simd::kAvx2:
      return "avx2";
    case Simd::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool parse_simd(std::string_view text, Simd* simd) {
  for (Simd s : {Simd::kAuto, Simd::kScalar, Simd::kAvx2, Simd::kAvx512}) {
    if (text == simd_name(s)) {
      *simd = s;
      return true;
    }
  }
  return false;
}

Result<Simd> resolve_simd(Simd requested) {
  const CpuFeatures& cpu = cpu_features();
  Simd simd = requested;
  if (simd == Simd::kAuto) {
    const char* env = std::getenv("ZINF_SIMD");
    if (env != nullptr && *env != '\0') {
      if (!parse_simd(env, &simd)) {
        return Status::invalid_argument(
            fmt::format("ZINF_SIMD={}: expected avx512, avx2, scalar or auto", env));
      }
    }
  }
  if (simd == Simd::kAuto) {
    if (cpu.has_avx512_path()) return Simd::kAvx512;
    if (cpu.has_avx2_path()) return Simd::kAvx2;
    return Simd::kScalar;
  }
  if (simd == Simd::kAvx512 && !cpu.has_avx512_path()) {
    return Status::unsupported("SIMD path avx512: this CPU lacks AVX-512 F/BW/VL/DQ");
  }
  if (simd == Simd::kAvx2 && !cpu.has_avx2_path()) {
    return Status::unsupported("SIMD path avx2: this CPU lacks AVX2, FMA or F16C");
  }
  return simd;
}

namespace optim {

const KernelTable& kernels_for(Simd simd) {
  ZINF_ASSERT_MSG(simd != Simd::kAuto, "kernels_for() takes a resolved path");
  switch (simd) {
    case Simd::kAvx512:
      return kernels_avx512(cpu_features().avx512bf16);
    case Simd::kAvx2:
      return kernels_avx2();
    default:
      return kernels_scalar();
  }
}

}  // namespace optim

namespace {

constexpr std::size_t kDefaultTileElements = 16 * 1024;

bool finite_nonnegative(double x) { return std::isfinite(x) && x >= 0.0; }

Status validate(const OptimizerParams& params, const OptimizerSpan& span,
                const StepOptions& options) {
  const std::string_view name = optimizer_name(params.kind);
  if (name == "unknown") return Status::invalid_argument("optimizer kind: not one of the four");
  if (!finite_nonnegative(params.lr)) {
    return Status::invalid_argument(
        fmt::format("{}: lr = {} (must be finite, >= 0)", name, params.lr));
  }
  if (!finite_nonnegative(params.eps)) {
    return Status::invalid_argument(
        fmt::format("{}: eps = {} (must be finite, >= 0)", name, params.eps));
  }
  if (!finite_nonnegative(params.weight_decay)) {
    return Status::invalid_argument(
        fmt::format("{}: weight_decay = {} (must be finite, >= 0)", name, params.weight_decay));
  }
  if (!finite_nonnegative(params.lr_decay)) {
    return Status::invalid_argument(
        fmt::format("{}: lr_decay = {} (must be finite, >= 0)", name, params.lr_decay));
  }
  if (params.kind != OptimizerKind::kAdagrad) {
    for (double beta : {params.beta1, params.beta2}) {
      if (!(beta >= 0.0 && beta < 1.0)) {
        return Status::invalid_argument(fmt::format("{}: betas = ({}, {}) (each must be in [0, 1))",
                                                    name, params.beta1, params.beta2));
      }
    }
  }
  if (!std::isfinite(options.grad_scale)) {
    return Status::invalid_argument(
        fmt::format("grad_scale = {} (must be finite)", options.grad_scale));
  }
  if (options.step < 1) {
    return Status::invalid_argument(fmt::format("step = {} (counts from 1)", options.step));
  }
  if (options.threads < 0) {
    return Status::invalid_argument(fmt::format("threads = {} (0 or more)", options.threads));
  }
  if (span.grad_dtype != DType::kF32 && span.grad_dtype != DType::kBF16 &&
      span.grad_dtype != DType::kF16) {
    return Status::invalid_argument("grad_dtype: not f32, bf16 or f16");
  }
  if (span.params_half != nullptr && span.half_dtype != DType::kBF16 &&
      span.half_dtype != DType::kF16) {
    return Status::invalid_argument(fmt::format(
        "half_dtype {}: the parameter copy must be bf16 or f16", dtype_name(span.half_dtype)));
  }
  if (span.count == 0) return Status::ok();
  const bool needs_avg = params.kind != OptimizerKind::kAdagrad;
  const bool needs_avg_sq = params.kind != OptimizerKind::kLion;
  if (span.params == nullptr || span.grads == nullptr || (needs_avg && span.exp_avg == nullptr) ||
      (needs_avg_sq && span.exp_avg_sq == nullptr)) {
    return Status::invalid_argument(
        fmt::format("{} over {} elements: params, grads{}{} must not be null", name, span.count,
                    needs_avg ? ", exp_avg" : "", needs_avg_sq ? ", exp_avg_sq" : ""));
  }
  return Status::ok();
}

optim::KernelArgs make_args(const OptimizerParams& params, const StepOptions& options) {
  // Every constant is computed in double and rounded to float once.
  auto f = [](double x) { return static_cast<float>(x); };
  optim::KernelArgs a;
  a.kind = params.kind;
  a.beta1 = f(params.beta1);
  a.beta2 = f(params.beta2);
  a.omb1 = f(1.0 - params.beta1);
  a.omb2 = f(1.0 - params.beta2);
  a.eps = f(params.eps);
  a.grad_scale = options.grad_scale;
  const double lr = params.lr;
  const double wd = params.weight_decay;
  const double t = static_cast<double>(options.step);
  switch (params.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      double step_size = lr;
      double inv_sqrt_bc2 = 1.0;
      if (params.bias_correction) {
        step_size = lr / (1.0 - std::pow(params.beta1, t));
        inv_sqrt_bc2 = 1.0 / std::sqrt(1.0 - std::pow(params.beta2, t));
      }
      a.step_size = f(step_size);
      a.inv_sqrt_bc2 = f(inv_sqrt_bc2);
      if (params.kind == OptimizerKind::kAdam) {
        a.has_l2 = wd != 0.0;
        a.l2 = f(wd);
      } else {
        a.has_decay = wd != 0.0;
        a.decay = f(1.0 - lr * wd);
      }
      break;
    }
    case OptimizerKind::kAdagrad:
      a.step_size = f(lr / (1.0 + (t - 1.0) * params.lr_decay));
      a.has_l2 = wd != 0.0;
      a.l2 = f(wd);
      break;
    case OptimizerKind::kLion:
      a.step_size = f(lr);
      a.has_decay = wd != 0.0;
      a.decay = f(1.0 - lr * wd);
      break;
  }
  return a;
}

// The arena for `threads` > 0 threads, made on first use and kept, so a caller that asks for a
// thread count every step does not build an arena (and wake its threads) every step. Arenas are
// never destroyed: the table is small and lives as long as the process.
tbb::task_arena& arena_for(int threads) {
  constexpr int kCachedMax = 256;
  static std::mutex mutex;
  static std::array<tbb::task_arena*, kCachedMax + 1> arenas{};
  ZINF_ASSERT(threads > 0);
  const int key = std::min(threads, kCachedMax);
  std::lock_guard<std::mutex> lock(mutex);
  if (arenas[static_cast<std::size_t>(key)] == nullptr) {
    arenas[static_cast<std::size_t>(key)] = new tbb::task_arena(key);
  }
  return *arenas[static_cast<std::size_t>(key)];
}

// Runs body(begin, end) over the tiles of [0, count) in the arena the options ask for.
template <typename Body>
void for_each_tile(std::size_t count, const StepOptions& options, const Body& body) {
  const std::size_t tile =
      options.tile_elements != 0 ? options.tile_elements : kDefaultTileElements;
  const std::size_t tiles = (count + tile - 1) / tile;
  auto run = [&] {
    // The static partitioner gives each thread one contiguous run of tiles: long sequential
    // streams for the prefetchers, and no stealing overhead in a loop this uniform.
    tbb::parallel_for(
        tbb::blocked_range<std::size_t>(0, tiles, 1),
        [&](const tbb::blocked_range<std::size_t>& range) {
          for (std::size_t t = range.begin(); t != range.end(); ++t) {
            body(t * tile, std::min(count, (t + 1) * tile));
          }
        },
        tbb::static_partitioner());
  };
  if (tiles <= 1) {
    if (tiles == 1) body(0, count);
  } else if (options.threads > 0) {
    arena_for(options.threads).execute(run);
  } else {
    run();
  }
}

bool all_finite_with(const optim::KernelTable& kernels, const void* data, DType dtype,
                     std::size_t count, const StepOptions& options) {
  std::atomic<bool> finite{true};
  for_each_tile(count, options, [&](std::size_t begin, std::size_t end) {
    if (!finite.load(std::memory_order_relaxed)) return;
    if (!kernels.finite(data, dtype, begin, end)) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

Status validate_ranges(std::span<const OptimizerParams> groups,
                       std::span<const OptimizerRange> ranges, const OptimizerSpan& span) {
  if (groups.empty() || groups.size() > kMaxOptimizerGroups) {
    return Status::invalid_argument(fmt::format("optimizer step: {} parameter groups (1 to {})",
                                                groups.size(), kMaxOptimizerGroups));
  }
  for (const OptimizerParams& g : groups) {
    if (g.kind != groups[0].kind) {
      return Status::invalid_argument(
          fmt::format("optimizer step: parameter groups of different kinds ({} and {})",
                      optimizer_name(groups[0].kind), optimizer_name(g.kind)));
    }
  }
  if (span.count == 0) return Status::ok();
  if (ranges.empty() || ranges[0].begin != 0) {
    return Status::invalid_argument(
        "optimizer step: the ranges must start with one that begins at element 0");
  }
  for (std::size_t r = 0; r < ranges.size(); ++r) {
    if (ranges[r].group >= groups.size()) {
      return Status::invalid_argument(
          fmt::format("optimizer step: range {} (element {}) names group {} of {}", r,
                      ranges[r].begin, ranges[r].group, groups.size()));
    }
    if (r > 0 && !(ranges[r].begin > ranges[r - 1].begin && ranges[r].begin < span.count)) {
      return Status::invalid_argument(
          fmt::format("optimizer step: range {} begins at element {}, not after {} and below {}", r,
                      ranges[r].begin, ranges[r - 1].begin, span.count));
    }
  }
  return Status::ok();
}

}  // namespace

namespace optim {

Result<StepResult> step_with(const KernelTable& kernels, Simd simd,
                             std::span<const OptimizerParams> groups,
                             std::span<const OptimizerRange> ranges, const OptimizerSpan& span,
                             const StepOptions& options) {
  ZINF_RETURN_IF_ERROR(validate_ranges(groups, ranges, span));
  for (std::size_t g = 0; g < groups.size(); ++g) {
    Status s = validate(groups[g], span, options);
    if (!s.is_ok()) {
      return groups.size() == 1 ? s : s.with_context(fmt::format("parameter group {}", g));
    }
  }
  StepResult result;
  result.simd = simd;
  if (span.count == 0) return result;
  if (options.check_overflow &&
      !all_finite_with(kernels, span.grads, span.grad_dtype, span.count, options)) {
    result.overflow = true;
    return result;
  }
  // The constants of every group, once per call; on the stack, so a step allocates nothing.
  std::array<KernelArgs, kMaxOptimizerGroups> args;
  for (std::size_t g = 0; g < groups.size(); ++g) args[g] = make_args(groups[g], options);
  const OptimizerRange* const first = ranges.data();
  const OptimizerRange* const last = ranges.data() + ranges.size();
  for_each_tile(span.count, options, [&](std::size_t begin, std::size_t end) {
    // The range holding `begin`, then each range the tile reaches, up to its end.
    const OptimizerRange* r =
        std::upper_bound(first, last, begin,
                         [](std::size_t e, const OptimizerRange& x) { return e < x.begin; }) -
        1;
    for (std::size_t b = begin; b < end; ++r) {
      const std::size_t stop = r + 1 != last ? std::min(end, r[1].begin) : end;
      kernels.update(args[r->group], span, b, stop);
      b = stop;
    }
  });
  return result;
}

Result<StepResult> step_with(const KernelTable& kernels, Simd simd, const OptimizerParams& params,
                             const OptimizerSpan& span, const StepOptions& options) {
  const OptimizerRange whole;
  return step_with(kernels, simd, std::span<const OptimizerParams>(&params, 1),
                   std::span<const OptimizerRange>(&whole, 1), span, options);
}

}  // namespace optim

Result<StepResult> optimizer_step(const OptimizerParams& params, const OptimizerSpan& span,
                                  const StepOptions& options) {
  ZINF_ASSIGN_OR_RETURN(const Simd simd, resolve_simd(options.simd));
  return optim::step_with(optim::kernels_for(simd), simd, params, span, options);
}

Result<StepResult> optimizer_step(std::span<const OptimizerParams> groups,
                                  std::span<const OptimizerRange> ranges, const OptimizerSpan& span,
                                  const StepOptions& options) {
  ZINF_ASSIGN_OR_RETURN(const Simd simd, resolve_simd(options.simd));
  return optim::step_with(optim::kernels_for(simd), simd, groups, ranges, span, options);
}

Result<bool> all_finite(const void* data, DType dtype, std::size_t count,
                        const StepOptions& options) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return Status::invalid_argument("all_finite: dtype not f32, bf16 or f16");
  }
  if (count != 0 && data == nullptr) return Status::invalid_argument("all_finite: data is null");
  if (options.threads < 0) {
    return Status::invalid_argument(fmt::format("threads = {} (0 or more)", options.threads));
  }
  ZINF_ASSIGN_OR_RETURN(const Simd simd, resolve_simd(options.simd));
  return all_finite_with(optim::kernels_for(simd), data, dtype, count, options);
}

Status narrow_to_half(const float* src, std::uint16_t* dst, DType dtype, std::size_t count,
                      const StepOptions& options) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return Status::invalid_argument("narrow_to_half: dtype not bf16 or f16");
  }
  if (count != 0 && (src == nullptr || dst == nullptr)) {
    return Status::invalid_argument("narrow_to_half: src or dst is null");
  }
  if (options.threads < 0) {
    return Status::invalid_argument(fmt::format("threads = {} (0 or more)", options.threads));
  }
  ZINF_ASSIGN_OR_RETURN(const Simd simd, resolve_simd(options.simd));
  const optim::KernelTable& kernels = optim::kernels_for(simd);
  for_each_tile(count, options, [&](std::size_t begin, std::size_t end) {
    kernels.convert(src, dst, dtype, begin, end);
  });
  return Status::ok();
}

}  // namespace zinf
