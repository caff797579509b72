// Each CUDA kernel against its scalar reference (kernels/*_ref.cpp) on random inputs of awkward
// sizes, with aligned pointers (the 16-byte vector path) and misaligned ones (the scalar path).
// Casts, unscale, Adam and the copies must match bit for bit (each element is the same correctly
// rounded IEEE operations on both sides); the squared norm, a reduction in a different order,
// within abs_tol + rel_eps * |ref|. Without a CUDA device every test skips with the reason.
#include <gtest/gtest.h>

#if defined(ZINF_HAVE_CUDA)

#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "base/random.hpp"
#include "gpu/gpu_util.hpp"
#include "kernels/adam.h"
#include "kernels/cast.h"
#include "kernels/flatten.h"
#include "kernels/sq_norm.h"
#include "kernels/unscale.h"
#include "kernels/widen.h"

namespace zinf::kernels {
namespace {

using gpu_test::DeviceMemory;
using gpu_test::download;
using gpu_test::upload;

struct Shape {
  std::size_t count;
  std::size_t offset_bytes;  // 0: 16-byte aligned; 4: only 4-byte aligned.
};

std::string shape_name(const ::testing::TestParamInfo<Shape>& info) {
  // fmt rather than string concatenation: GCC 12 warns falsely (-Wrestrict) on the latter.
  return fmt::format("n{}_off{}", info.param.count, info.param.offset_bytes);
}

const auto kShapes =
    ::testing::Values(Shape{1, 0}, Shape{7, 0}, Shape{1029, 0}, Shape{1029, 4},
                      Shape{(std::size_t{1} << 20) + 3, 0}, Shape{(std::size_t{1} << 20) + 3, 4});

class CastGpu : public ::testing::TestWithParam<Shape> {};

TEST_P(CastGpu, MatchesReferenceBitForBit) {
  ZINF_REQUIRE_CUDA_DEVICE();
  const Shape s = GetParam();
  const std::vector<float> in = gpu_test::awkward_floats(s.count, 0xca57 + s.count);
  DeviceMemory d_in(s.count * 4 + s.offset_bytes), d_out(s.count * 2 + s.offset_bytes);
  ASSERT_TRUE(d_in.ok() && d_out.ok());
  float* src = d_in.as<float>(s.offset_bytes);
  auto* dst = d_out.as<std::uint16_t>(s.offset_bytes / 2);
  ZINF_CUDA_OK(upload(src, in));
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<std::uint16_t> got(s.count, 0), want(s.count, 1);
    const LaunchError err = kind == 0 ? cast_f32_to_bf16(src, dst, s.count, nullptr)
                                      : cast_f32_to_f16(src, dst, s.count, nullptr);
    ASSERT_EQ(err, 0);
    ZINF_CUDA_OK(cudaDeviceSynchronize());
    ZINF_CUDA_OK(download(got, dst));
    if (kind == 0) {
      cast_f32_to_bf16_ref(in.data(), want.data(), s.count);
    } else {
      cast_f32_to_f16_ref(in.data(), want.data(), s.count);
    }
    for (std::size_t i = 0; i < s.count; ++i) {
      ASSERT_EQ(got[i], want[i]) << (kind == 0 ? "bf16" : "f16") << " i=" << i << " x=" << in[i]
                                 << " bits=0x" << std::hex << std::bit_cast<std::uint32_t>(in[i]);
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Shapes, CastGpu, kShapes, shape_name);

class WidenGpu : public ::testing::TestWithParam<Shape> {};

// Every source format, copy and accumulate, against the reference bit for bit (the widening is
// exact and the accumulation one correctly rounded addition on both sides); the half sources
// are random bit patterns, NaNs and infinities included, and a NaN only has to stay a NaN.
TEST_P(WidenGpu, MatchesReferenceBitForBit) {
  ZINF_REQUIRE_CUDA_DEVICE();
  const Shape s = GetParam();
  const std::vector<float> src32 = gpu_test::awkward_floats(s.count, 0x1de + s.count);
  std::vector<std::uint16_t> src16(s.count);
  SplitMix64 rng(0x16 + s.count);
  for (std::uint16_t& h : src16) h = static_cast<std::uint16_t>(rng.next());
  std::vector<float> base(s.count);
  fill_uniform(base.data(), s.count, 0xba5e + s.count, -4.0f, 4.0f);
  DeviceMemory d_src(s.count * 4 + s.offset_bytes), d_dst(s.count * 4 + s.offset_bytes);
  ASSERT_TRUE(d_src.ok() && d_dst.ok());
  float* dst = d_dst.as<float>(s.offset_bytes);
  for (HalfType type : {HalfType::kNone, HalfType::kBf16, HalfType::kF16}) {
    void* src = d_src.as<void>(s.offset_bytes);
    const void* host_src = type == HalfType::kNone ? static_cast<const void*>(src32.data())
                                                   : static_cast<const void*>(src16.data());
    if (type == HalfType::kNone) {
      ZINF_CUDA_OK(upload(static_cast<float*>(src), src32));
    } else {
      ZINF_CUDA_OK(upload(static_cast<std::uint16_t*>(src), src16));
    }
    for (bool accumulate : {false, true}) {
      ZINF_CUDA_OK(upload(dst, base));
      ASSERT_EQ(widen_to_f32(src, type, dst, s.count, accumulate, nullptr), 0);
      ZINF_CUDA_OK(cudaDeviceSynchronize());
      std::vector<float> got(s.count), want = base;
      ZINF_CUDA_OK(download(got, dst));
      widen_to_f32_ref(host_src, type, want.data(), s.count, accumulate);
      for (std::size_t i = 0; i < s.count; ++i) {
        if (std::isnan(want[i])) {
          ASSERT_TRUE(std::isnan(got[i])) << "i=" << i;
        } else {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i]))
              << "type " << static_cast<int>(type) << " accumulate " << accumulate << " i=" << i;
        }
      }
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Shapes, WidenGpu, kShapes, shape_name);

class UnscaleGpu : public ::testing::TestWithParam<Shape> {};

TEST_P(UnscaleGpu, MatchesReferenceAndFlagsNonFinite) {
  ZINF_REQUIRE_CUDA_DEVICE();
  const Shape s = GetParam();
  DeviceMemory d_grad(s.count * 4 + s.offset_bytes), d_flag(4);
  ASSERT_TRUE(d_grad.ok() && d_flag.ok());
  float* grad = d_grad.as<float>(s.offset_bytes);
  auto* flag = d_flag.as<std::int32_t>();
  for (int poison = 0; poison < 2; ++poison) {
    std::vector<float> host(s.count);
    fill_uniform(host.data(), s.count, 0x11 + s.count + poison, -6e4f, 6e4f);
    if (poison) host[s.count - 1] = std::nanf("");  // In the scalar tail or the last vector.
    ZINF_CUDA_OK(upload(grad, host));
    ZINF_CUDA_OK(cudaMemset(flag, 0, 4));
    ASSERT_EQ(unscale_grads(grad, s.count, 3.0f / 65536.0f, flag, nullptr), 0);
    ZINF_CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> got(s.count);
    std::int32_t got_flag = -1;
    ZINF_CUDA_OK(download(got, grad));
    ZINF_CUDA_OK(cudaMemcpy(&got_flag, flag, 4, cudaMemcpyDeviceToHost));
    std::int32_t want_flag = 0;
    unscale_grads_ref(host.data(), s.count, 3.0f / 65536.0f, &want_flag);
    EXPECT_EQ(got_flag, want_flag);
    EXPECT_EQ(got_flag, poison);
    for (std::size_t i = 0; i < s.count; ++i) {
      // NVIDIA GPUs return the canonical NaN from arithmetic on a NaN where x86 keeps the input's
      // payload, so a NaN only has to stay a NaN; every other value must match bit for bit.
      if (std::isnan(host[i])) {
        ASSERT_TRUE(std::isnan(got[i])) << "i=" << i;
      } else {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(host[i]))
            << "i=" << i << " gpu " << got[i] << " ref " << host[i];
      }
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Shapes, UnscaleGpu, kShapes, shape_name);

class SqNormGpu : public ::testing::TestWithParam<Shape> {};

TEST_P(SqNormGpu, MatchesReferenceAndIsDeterministic) {
  ZINF_REQUIRE_CUDA_DEVICE();
  const Shape s = GetParam();
  std::vector<float> x(s.count);
  fill_uniform(x.data(), s.count, 0x2 + s.count, -4.0f, 4.0f);
  std::vector<std::uint16_t> bf(s.count), h(s.count);
  cast_f32_to_bf16_ref(x.data(), bf.data(), s.count);
  cast_f32_to_f16_ref(x.data(), h.data(), s.count);
  DeviceMemory d_x(s.count * 4 + s.offset_bytes), d_partials(kSqNormPartials * 4), d_out(4);
  ASSERT_TRUE(d_x.ok() && d_partials.ok() && d_out.ok());
  for (HalfType type : {HalfType::kNone, HalfType::kBf16, HalfType::kF16}) {
    const void* host = type == HalfType::kNone   ? static_cast<const void*>(x.data())
                       : type == HalfType::kBf16 ? static_cast<const void*>(bf.data())
                                                 : static_cast<const void*>(h.data());
    const std::size_t elem_bytes = type == HalfType::kNone ? 4 : 2;
    void* dev = d_x.as<unsigned char>(s.offset_bytes);
    ZINF_CUDA_OK(cudaMemcpy(dev, host, s.count * elem_bytes, cudaMemcpyHostToDevice));
    float first = 0, second = 0, accumulated = 0;
    ASSERT_EQ(
        sq_norm(dev, type, s.count, d_partials.as<float>(), d_out.as<float>(), false, nullptr), 0);
    ZINF_CUDA_OK(cudaMemcpy(&first, d_out.as<float>(), 4, cudaMemcpyDeviceToHost));
    ASSERT_EQ(
        sq_norm(dev, type, s.count, d_partials.as<float>(), d_out.as<float>(), false, nullptr), 0);
    ZINF_CUDA_OK(cudaMemcpy(&second, d_out.as<float>(), 4, cudaMemcpyDeviceToHost));
    ASSERT_EQ(sq_norm(dev, type, s.count, d_partials.as<float>(), d_out.as<float>(), true, nullptr),
              0);
    ZINF_CUDA_OK(cudaMemcpy(&accumulated, d_out.as<float>(), 4, cudaMemcpyDeviceToHost));
    const double want = sq_norm_ref(host, type, s.count);
    EXPECT_NEAR(first, want, 1e-30 + 1e-5 * want) << "type " << static_cast<int>(type);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(first), std::bit_cast<std::uint32_t>(second))
        << "two runs gave different bits";
    EXPECT_NEAR(accumulated, 2.0 * want, 1e-30 + 2e-5 * want) << "accumulate adds";
  }
}
INSTANTIATE_TEST_SUITE_P(Shapes, SqNormGpu, kShapes, shape_name);

TEST(SqNormGpuSpecial, InfAndNanPropagate) {
  ZINF_REQUIRE_CUDA_DEVICE();
  std::vector<float> x(4099, 0.5f);
  x[4000] = INFINITY;
  DeviceMemory d_x(x.size() * 4), d_partials(kSqNormPartials * 4), d_out(4);
  ZINF_CUDA_OK(upload(d_x.as<float>(), x));
  float got = 0;
  ASSERT_EQ(sq_norm(d_x.as<float>(), HalfType::kNone, x.size(), d_partials.as<float>(),
                    d_out.as<float>(), false, nullptr),
            0);
  ZINF_CUDA_OK(cudaMemcpy(&got, d_out.as<float>(), 4, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::isinf(got)) << got;
  x[5] = NAN;
  ZINF_CUDA_OK(upload(d_x.as<float>(), x));
  ASSERT_EQ(sq_norm(d_x.as<float>(), HalfType::kNone, x.size(), d_partials.as<float>(),
                    d_out.as<float>(), false, nullptr),
            0);
  ZINF_CUDA_OK(cudaMemcpy(&got, d_out.as<float>(), 4, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::isnan(got)) << got;
}

class AdamGpu : public ::testing::TestWithParam<Shape> {};

TEST_P(AdamGpu, ThreeStepsMatchReferenceBitForBit) {
  ZINF_REQUIRE_CUDA_DEVICE();
  const Shape s = GetParam();
  const std::size_t n = s.count;
  const std::size_t off = s.offset_bytes;
  DeviceMemory d_p(n * 4 + off), d_g(n * 4 + off), d_m(n * 4 + off), d_v(n * 4 + off),
      d_h(n * 2 + off);
  ASSERT_TRUE(d_p.ok() && d_g.ok() && d_m.ok() && d_v.ok() && d_h.ok());
  for (int variant = 0; variant < 3; ++variant) {
    const HalfType half = variant == 0   ? HalfType::kNone
                          : variant == 1 ? HalfType::kBf16
                                         : HalfType::kF16;
    AdamHyper hyper;
    hyper.lr = 3e-3f;
    hyper.weight_decay = 0.05f;
    hyper.adamw = variant != 1;
    std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f);
    std::vector<std::uint16_t> ph(n, 0);
    fill_uniform(p.data(), n, 0xad + n + variant, -1.0f, 1.0f);
    ZINF_CUDA_OK(upload(d_p.as<float>(off), p));
    ZINF_CUDA_OK(upload(d_m.as<float>(off), m));
    ZINF_CUDA_OK(upload(d_v.as<float>(off), v));
    for (std::int64_t step = 1; step <= 3; ++step) {
      fill_uniform(g.data(), n, 0x6 + static_cast<std::uint64_t>(step) * 31 + n, -2.0f, 2.0f);
      ZINF_CUDA_OK(upload(d_g.as<float>(off), g));
      const AdamStepArgs args = adam_step_args(hyper, step);
      ASSERT_EQ(
          adam_step(d_p.as<float>(off), d_g.as<float>(off), d_m.as<float>(off), d_v.as<float>(off),
                    d_h.as<std::uint16_t>(off / 2), half, n, args, nullptr),
          0);
      adam_step_ref(p.data(), g.data(), m.data(), v.data(), ph.data(), half, n, args);
    }
    ZINF_CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> gp(n), gm(n), gv(n);
    std::vector<std::uint16_t> gh(n);
    ZINF_CUDA_OK(download(gp, d_p.as<float>(off)));
    ZINF_CUDA_OK(download(gm, d_m.as<float>(off)));
    ZINF_CUDA_OK(download(gv, d_v.as<float>(off)));
    ZINF_CUDA_OK(download(gh, d_h.as<std::uint16_t>(off / 2)));
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(gp[i]), std::bit_cast<std::uint32_t>(p[i]))
          << "param i=" << i << " gpu " << gp[i] << " ref " << p[i] << " variant " << variant;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(gm[i]), std::bit_cast<std::uint32_t>(m[i])) << i;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(gv[i]), std::bit_cast<std::uint32_t>(v[i])) << i;
      if (half != HalfType::kNone) {
        ASSERT_EQ(gh[i], ph[i]) << "half copy i=" << i;
      }
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Shapes, AdamGpu, kShapes, shape_name);

TEST(FlattenGpu, FlattenAndUnflattenMatchReference) {
  ZINF_REQUIRE_CUDA_DEVICE();
  // 150 tensors (three launches of up to 64 segments) with odd sizes and offsets; every fifth
  // is empty. The gaps between them (padding) must stay untouched.
  const std::size_t tensor_count = 150;
  SplitMix64 rng(0xf1a7);
  std::vector<std::size_t> sizes(tensor_count), offsets(tensor_count);
  std::size_t at = 0, total = 0;
  for (std::size_t i = 0; i < tensor_count; ++i) {
    sizes[i] = i % 5 == 0 ? 0 : 1 + rng.next() % 70000;
    if (i % 3 == 0) sizes[i] = (sizes[i] + 15) / 16 * 16;  // Some vector-friendly ones too.
    offsets[i] = at + (i % 2) * 3;
    at = offsets[i] + sizes[i] + 16;
    total += sizes[i];
  }
  const std::size_t flat_bytes = at;
  DeviceMemory d_tensors(total + 16 * tensor_count), d_flat(flat_bytes);
  ASSERT_TRUE(d_tensors.ok() && d_flat.ok());
  std::vector<unsigned char> host_all(total + 16 * tensor_count);
  fill_random_bytes(host_all.data(), host_all.size(), 99);
  std::vector<const void*> dev_src(tensor_count), host_src(tensor_count);
  std::vector<void*> dev_dst(tensor_count);
  std::size_t t_at = 0;
  for (std::size_t i = 0; i < tensor_count; ++i) {
    const std::size_t pos = t_at + (i % 4) * 4;  // Tensor starts at 0, 4, 8, 12 mod 16.
    dev_src[i] = d_tensors.as<unsigned char>(pos);
    dev_dst[i] = d_tensors.as<unsigned char>(pos);
    host_src[i] = host_all.data() + pos;
    t_at = pos + sizes[i];
  }
  ZINF_CUDA_OK(upload(d_tensors.as<unsigned char>(), host_all));
  std::vector<unsigned char> flat_init(flat_bytes);
  fill_random_bytes(flat_init.data(), flat_bytes, 5);
  ZINF_CUDA_OK(upload(d_flat.as<unsigned char>(), flat_init));
  ASSERT_EQ(flatten(dev_src.data(), sizes.data(), offsets.data(), tensor_count, d_flat.as<void>(),
                    nullptr),
            0);
  std::vector<unsigned char> want = flat_init, got(flat_bytes);
  flatten_ref(host_src.data(), sizes.data(), offsets.data(), tensor_count, want.data());
  ZINF_CUDA_OK(download(got, d_flat.as<unsigned char>()));
  ASSERT_EQ(got, want) << "flatten";

  // Unflatten into the (zeroed) tensors and compare with the original bytes.
  ZINF_CUDA_OK(cudaMemset(d_tensors.as<void>(), 0, host_all.size()));
  ASSERT_EQ(unflatten(d_flat.as<void>(), offsets.data(), sizes.data(), tensor_count, dev_dst.data(),
                      nullptr),
            0);
  std::vector<unsigned char> back(host_all.size());
  ZINF_CUDA_OK(download(back, d_tensors.as<unsigned char>()));
  for (std::size_t i = 0; i < tensor_count; ++i) {
    const auto pos =
        static_cast<std::size_t>(static_cast<const unsigned char*>(host_src[i]) - host_all.data());
    ASSERT_EQ(std::memcmp(back.data() + pos, host_src[i], sizes[i]), 0) << "tensor " << i;
  }
}

// A runtime error that nobody collected (here a cudaMalloc far beyond the GPU's memory: not
// sticky) must not be reported by the next launch as its own. Before the launchers cleared it,
// cast_f32_to_bf16 returned cudaErrorMemoryAllocation here.
TEST(KernelLaunch, AnEarlierUncollectedErrorIsNotBlamedOnTheLaunch) {
  ZINF_REQUIRE_CUDA_DEVICE();
  void* huge = nullptr;
  ASSERT_EQ(cudaMalloc(&huge, std::size_t{1} << 60), cudaErrorMemoryAllocation);
  // cudaMalloc's error is now this thread's last error; the launch must still succeed.
  const std::size_t count = 1031;
  std::vector<float> host(count);
  fill_uniform(host.data(), count, 0x57a1e);
  gpu_test::DeviceMemory src(count * sizeof(float)), dst(count * sizeof(std::uint16_t));
  ASSERT_TRUE(src.ok() && dst.ok());
  ZINF_CUDA_OK(gpu_test::upload(src.as<float>(), host));
  (void)cudaMalloc(&huge, std::size_t{1} << 60);
  EXPECT_EQ(cast_f32_to_bf16(src.as<float>(), dst.as<std::uint16_t>(), count, nullptr), 0);
  std::vector<std::uint16_t> back(count), want(count);
  ZINF_CUDA_OK(gpu_test::download(back, dst.as<std::uint16_t>()));
  cast_f32_to_bf16_ref(host.data(), want.data(), count);
  EXPECT_EQ(back, want);
}

}  // namespace
}  // namespace zinf::kernels

#else  // !ZINF_HAVE_CUDA

TEST(KernelsGpu, NeedsCuda) { GTEST_SKIP() << "no CUDA device: zinf was built without CUDA"; }

#endif
