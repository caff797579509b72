// DeviceOps on HostDevice (opaque, as a GPU's memory is to host code): widen runs the kernel's
// scalar reference in stream order, between the copies around it, on offset device pointers; the
// optimizer's ops give their references' bits; narrow rounds to nearest even as an independent
// double-precision reference does; and RegisteredBuffer keeps its memory registered with the
// device while it lives.
#include "device/device_ops.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/assert.hpp"
#include "base/random.hpp"
#include "kernels/sq_norm.h"
#include "kernels/unscale.h"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

TEST(DeviceOps, HostOpsWidenInStreamOrderOnOpaqueMemory) {
  HostDeviceOptions options;
  options.opaque = true;
  options.jitter_max_us = 50;  // a missing order would show
  std::unique_ptr<Device> device = std::move(make_host_device(options)).value();
  Result<std::unique_ptr<DeviceOps>> ops = make_device_ops(*device);
  ASSERT_TRUE(ops.is_ok()) << ops.status().to_string();
  std::unique_ptr<Stream> stream = std::move(device->create_stream("ops")).value();
  const std::size_t count = 1029;
  std::vector<float> base(count), values(count);
  fill_uniform(base.data(), count, 5, -2.0f, 2.0f);
  fill_uniform(values.data(), count, 6, -1.0f, 1.0f);
  std::vector<std::uint16_t> half(count);
  convert_f32_to_bf16(values.data(), half.data(), count);
  DeviceBuffer src = std::move(DeviceBuffer::allocate(*device, count * 2)).value();
  DeviceBuffer dst = std::move(DeviceBuffer::allocate(*device, count * 4)).value();
  std::vector<float> copied(count), summed(count);
  for (int round = 0; round < 5; ++round) {
    ASSERT_TRUE(device->copy_h2d(src.data(), half.data(), count * 2, *stream).is_ok());
    // dst[0, 3) stays as base; dst[3, count) = base + widen(src[3, count)).
    ASSERT_TRUE(device->copy_h2d(dst.data(), base.data(), count * 4, *stream).is_ok());
    ASSERT_TRUE((*ops)
                    ->widen(src.as<std::uint16_t>() + 3, DType::kBF16, dst.as<float>() + 3,
                            count - 3, /*accumulate=*/true, *stream)
                    .is_ok());
    ASSERT_TRUE(device->copy_d2h(summed.data(), dst.data(), count * 4, *stream).is_ok());
    ASSERT_TRUE(
        (*ops)->widen(src.data(), DType::kBF16, dst.as<float>(), count, false, *stream).is_ok());
    ASSERT_TRUE(device->copy_d2h(copied.data(), dst.data(), count * 4, *stream).is_ok());
    ASSERT_TRUE(device->synchronize(*stream).is_ok());
    for (std::size_t i = 0; i < count; ++i) {
      const float x = bf16_to_f32(half[i]);
      const float want = i < 3 ? base[i] : base[i] + x;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(summed[i]), std::bit_cast<std::uint32_t>(want))
          << "round " << round << " i=" << i;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(copied[i]), std::bit_cast<std::uint32_t>(x)) << i;
    }
  }
}

// The optimizer's ops (scale, sum_of_squares, adam_step with a bf16 copy) on an opaque device
// give the references' bits on host copies of the same data.
TEST(DeviceOps, HostOpsStepAdamOnOpaqueMemoryAsTheReferences) {
  HostDeviceOptions options;
  options.opaque = true;
  std::unique_ptr<Device> device = std::move(make_host_device(options)).value();
  std::unique_ptr<DeviceOps> ops = std::move(make_device_ops(*device)).value();
  std::unique_ptr<Stream> stream = std::move(device->create_stream("ops")).value();
  const std::size_t count = 777;
  std::vector<float> p(count), g(count), m(count, 0.0f), v(count, 0.0f);
  fill_uniform(p.data(), count, 8, -1.0f, 1.0f);
  fill_uniform(g.data(), count, 9, -0.5f, 0.5f);
  DeviceBuffer dp = std::move(DeviceBuffer::allocate(*device, count * 4)).value();
  DeviceBuffer dg = std::move(DeviceBuffer::allocate(*device, count * 4)).value();
  DeviceBuffer dm = std::move(DeviceBuffer::allocate(*device, count * 4)).value();
  DeviceBuffer dv = std::move(DeviceBuffer::allocate(*device, count * 4)).value();
  DeviceBuffer dh = std::move(DeviceBuffer::allocate(*device, count * 2)).value();
  DeviceBuffer scratch =
      std::move(DeviceBuffer::allocate(*device, (kernels::kSqNormPartials + 2) * 4)).value();
  Stream& s = *stream;
  ASSERT_TRUE(device->copy_h2d(dp.data(), p.data(), count * 4, s).is_ok());
  ASSERT_TRUE(device->copy_h2d(dg.data(), g.data(), count * 4, s).is_ok());
  ASSERT_TRUE(device->memset_async(dm.data(), 0, count * 4, s).is_ok());
  ASSERT_TRUE(device->memset_async(dv.data(), 0, count * 4, s).is_ok());
  ASSERT_TRUE(device->memset_async(scratch.data(), 0, scratch.bytes(), s).is_ok());
  float* sum = scratch.as<float>() + kernels::kSqNormPartials;
  auto* flag = reinterpret_cast<std::int32_t*>(sum + 1);
  ASSERT_TRUE(ops->scale(dg.as<float>(), count, 0.25f, flag, s).is_ok());
  ASSERT_TRUE(ops->sum_of_squares(dg.as<float>(), count, scratch.as<float>(), sum, s).is_ok());
  kernels::AdamHyper hyper;
  hyper.lr = 1e-2f;
  hyper.weight_decay = 0.05f;
  hyper.adamw = true;
  const kernels::AdamStepArgs args = kernels::adam_step_args(hyper, 3);
  ASSERT_TRUE(ops->adam_step(dp.as<float>(), dg.as<float>(), dm.as<float>(), dv.as<float>(),
                             dh.data(), DType::kBF16, count, args, s)
                  .is_ok());
  std::vector<float> got_p(count), got_m(count), got_v(count);
  std::vector<std::uint16_t> got_h(count);
  float got_sum = 0.0f;
  std::int32_t got_flag = -1;
  ASSERT_TRUE(device->copy_d2h(got_p.data(), dp.data(), count * 4, s).is_ok());
  ASSERT_TRUE(device->copy_d2h(got_m.data(), dm.data(), count * 4, s).is_ok());
  ASSERT_TRUE(device->copy_d2h(got_v.data(), dv.data(), count * 4, s).is_ok());
  ASSERT_TRUE(device->copy_d2h(got_h.data(), dh.data(), count * 2, s).is_ok());
  ASSERT_TRUE(device->copy_d2h(&got_sum, sum, 4, s).is_ok());
  ASSERT_TRUE(device->copy_d2h(&got_flag, flag, 4, s).is_ok());
  ASSERT_TRUE(device->synchronize(s).is_ok());

  std::int32_t want_flag = 0;
  kernels::unscale_grads_ref(g.data(), count, 0.25f, &want_flag);
  const float want_sum = kernels::sq_norm_ref(g.data(), kernels::HalfType::kNone, count);
  std::vector<std::uint16_t> want_h(count);
  kernels::adam_step_ref(p.data(), g.data(), m.data(), v.data(), want_h.data(),
                         kernels::HalfType::kBf16, count, args);
  EXPECT_EQ(got_flag, 0);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(got_sum), std::bit_cast<std::uint32_t>(want_sum));
  EXPECT_GT(got_sum, 0.0f);
  EXPECT_EQ(std::memcmp(got_p.data(), p.data(), count * 4), 0);
  EXPECT_EQ(std::memcmp(got_m.data(), m.data(), count * 4), 0);
  EXPECT_EQ(std::memcmp(got_v.data(), v.data(), count * 4), 0);
  EXPECT_EQ(got_h, want_h);
}

// A 16-bit binary float: `precision` significant bits (the leading one included), exponents
// emin..emax for normal numbers (bias emax), subnormals below 2^emin.
struct HalfFormat {
  const char* name;
  DType dtype;
  int precision;
  int emin;
  int emax;
};
constexpr HalfFormat kBf16Format{"bf16", DType::kBF16, 8, -126, 127};
constexpr HalfFormat kF16Format{"f16", DType::kF16, 11, -14, 15};

// x rounded to `f` by IEEE 754 roundTiesToEven, worked out in double precision from the
// definition and encoded field by field: the quantum at x's exponent (2^emin's below it) is
// ulp = 2^(max(E, emin) - precision + 1); x / ulp (exact, a power-of-two scale of a 24-bit
// significand) rounds to an integer with ties to even (std::nearbyint in the default rounding
// mode); a result beyond the largest finite value, (2 - 2^(1 - precision)) * 2^emax, is an
// infinity. A NaN is a NaN of the same sign whose stored payload is the top bits of x's, or the
// quiet bit alone when those are all zero (so that it does not read as an infinity).
std::uint16_t round_reference(float x, const HalfFormat& f) {
  const int stored = f.precision - 1;
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (bits >> 31) << 15;
  const std::uint32_t exponent_ones = static_cast<std::uint32_t>(2 * f.emax + 1) << stored;
  if (std::isnan(x)) {
    std::uint32_t payload = (bits & 0x7fffffu) >> (23 - stored);
    if (payload == 0) payload = 1u << (stored - 1);
    return static_cast<std::uint16_t>(sign | exponent_ones | payload);
  }
  if (std::isinf(x)) return static_cast<std::uint16_t>(sign | exponent_ones);
  const double a = std::fabs(static_cast<double>(x));
  if (a == 0.0) return static_cast<std::uint16_t>(sign);
  int e = 0;
  (void)std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): x's exponent is e - 1
  const int quantum_exponent = std::max(e - 1, f.emin) - stored;
  const double r = std::nearbyint(std::ldexp(a, -quantum_exponent));
  const double y = std::ldexp(r, quantum_exponent);
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -stored), f.emax);
  if (y > max_finite) return static_cast<std::uint16_t>(sign | exponent_ones);
  if (y < std::ldexp(1.0, f.emin)) {  // subnormal (or zero): exponent field 0
    return static_cast<std::uint16_t>(
        sign | static_cast<std::uint32_t>(std::ldexp(y, -(f.emin - stored))));
  }
  (void)std::frexp(y, &e);
  const auto field = static_cast<std::uint32_t>(e - 1 + f.emax);
  const auto mantissa =
      static_cast<std::uint32_t>(std::ldexp(std::ldexp(y, -(e - 1)) - 1.0, stored));
  return static_cast<std::uint16_t>(sign | (field << stored) | mantissa);
}

// Inputs for `f`: signed zeros, infinities, NaNs (quiet, signalling, payload only below the
// kept bits), ties either way, values at and beyond the largest finite value, f32 and format
// subnormals, then seeded random bit patterns, random values over the format's exponents, and
// random patterns whose dropped bits are exactly half a unit (ties wherever the value is a
// normal number of the format).
std::vector<float> narrow_inputs(const HalfFormat& f, std::uint64_t seed) {
  std::vector<std::uint32_t> bits = {
      0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
      0x7f800001u, 0xff800001u, 0x7fa00000u, 0x7fffffffu, 0xff812345u, 0x7f7fffffu,
      0xff7fffffu, 0x00000001u, 0x80000001u, 0x00008000u, 0x00018000u, 0x007fffffu,
      0x00800000u, 0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, 0xbf818000u,
      0x7f7f0000u, 0x7f7f7fffu, 0x7f7f8000u, 0x7f7e8000u, 0xff7f8000u};
  auto add = [&](double v) {
    const auto x = static_cast<float>(v);
    ZINF_ASSERT(static_cast<double>(x) == v);
    bits.push_back(std::bit_cast<std::uint32_t>(x));
    bits.push_back(std::bit_cast<std::uint32_t>(-x));
  };
  const int stored = f.precision - 1;
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -stored), f.emax);
  if (f.dtype == DType::kF16) {
    add(max_finite);                                                     // 65504
    add(max_finite + std::ldexp(1.0, f.emax - stored - 1) - 1.0 / 256);  // just below the tie
    add(max_finite + std::ldexp(1.0, f.emax - stored - 1));              // 65520: ties to inf
    add(65536.0);
    add(1e5);
    add(std::ldexp(1.0, f.emin));                                         // smallest normal
    add(std::ldexp(1.0, f.emin) - std::ldexp(1.0, f.emin - stored - 1));  // ties up to it
  }
  const int sub = f.emin - stored;  // the smallest subnormal is 2^sub
  add(std::ldexp(1.0, sub));
  add(std::ldexp(1.0, sub - 1));                         // half of it: ties to zero
  add(std::nextafter(std::ldexp(1.0f, sub - 1), 1.0f));  // just above: rounds up
  add(std::ldexp(3.0, sub - 1));                         // 1.5 quanta: ties to 2
  add(std::ldexp(5.0, sub - 1));                         // 2.5 quanta: ties to 2
  add(std::ldexp(1.0, sub - 2));
  add(1.0 + std::ldexp(1.0, -stored - 1));  // ties down to 1
  add(1.0 + std::ldexp(3.0, -stored - 1));  // ties up
  SplitMix64 rng(seed);
  for (int k = 0; k < 4096; ++k) bits.push_back(static_cast<std::uint32_t>(rng.next()));
  for (int k = 0; k < 4096; ++k) {
    // From below half the smallest subnormal to beyond the largest finite value (f32 rounds
    // those beyond its own range on the way: infinities, f32 subnormals).
    const int span = f.emax - f.emin + stored + 6;
    const int e = f.emin - stored - 3 + static_cast<int>(rng.next() % static_cast<unsigned>(span));
    const float x = std::ldexp(rng.uniform(1.0f, 2.0f), e);
    bits.push_back(std::bit_cast<std::uint32_t>(rng.next() % 2 == 0 ? x : -x));
  }
  const std::uint32_t tie = 1u << (23 - stored - 1);
  for (int k = 0; k < 1024; ++k) {
    const auto r = static_cast<std::uint32_t>(rng.next());
    bits.push_back((r & ~(2 * tie - 1)) | tie);
  }
  std::vector<float> out;
  for (std::uint32_t b : bits) out.push_back(std::bit_cast<float>(b));
  return out;
}

// narrow on an opaque device (the stream op, at offsets off 16-byte alignment) against the
// double-precision reference above, bit for bit; the elements around the range keep theirs.
TEST(DeviceOps, HostOpsNarrowRoundsToNearestEven) {
  HostDeviceOptions options;
  options.opaque = true;
  std::unique_ptr<Device> device = std::move(make_host_device(options)).value();
  std::unique_ptr<DeviceOps> ops = std::move(make_device_ops(*device)).value();
  std::unique_ptr<Stream> stream = std::move(device->create_stream("ops")).value();
  Stream& s = *stream;
  for (const HalfFormat& f : {kBf16Format, kF16Format}) {
    const std::uint64_t seed = f.dtype == DType::kBF16 ? 4101 : 4102;
    SCOPED_TRACE(testing::Message() << f.name << " seed " << seed);
    const std::vector<float> in = narrow_inputs(f, seed);
    const std::size_t count = in.size();
    DeviceBuffer src = std::move(DeviceBuffer::allocate(*device, (count + 3) * 4)).value();
    DeviceBuffer dst = std::move(DeviceBuffer::allocate(*device, (count + 2) * 2)).value();
    std::vector<std::uint16_t> got(count + 2, 0xa5a5);
    ASSERT_TRUE(device->copy_h2d(src.as<float>() + 3, in.data(), count * 4, s).is_ok());
    ASSERT_TRUE(device->copy_h2d(dst.data(), got.data(), got.size() * 2, s).is_ok());
    ASSERT_TRUE(
        ops->narrow(src.as<float>() + 3, f.dtype, dst.as<std::uint16_t>() + 1, count, s).is_ok());
    ASSERT_TRUE(device->copy_d2h(got.data(), dst.data(), got.size() * 2, s).is_ok());
    ASSERT_TRUE(device->synchronize(s).is_ok());
    EXPECT_EQ(got.front(), 0xa5a5);
    EXPECT_EQ(got.back(), 0xa5a5);
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < count && mismatches < 10; ++i) {
      const std::uint16_t want = round_reference(in[i], f);
      if (got[i + 1] == want) continue;
      ++mismatches;
      ADD_FAILURE() << std::hex << "input 0x" << std::bit_cast<std::uint32_t>(in[i]) << ": got 0x"
                    << got[i + 1] << ", want 0x" << want;
    }
  }
}

// The reference itself on a few values worked by hand, so that a wrong reference cannot agree
// with a wrong narrow.
TEST(DeviceOps, NarrowReferenceByHand) {
  EXPECT_EQ(round_reference(1.0f, kBf16Format), 0x3f80);
  EXPECT_EQ(round_reference(std::bit_cast<float>(0x3f808000u), kBf16Format), 0x3f80);
  EXPECT_EQ(round_reference(std::bit_cast<float>(0x3f818000u), kBf16Format), 0x3f82);
  EXPECT_EQ(round_reference(std::bit_cast<float>(0x7f7f8000u), kBf16Format), 0x7f80);
  EXPECT_EQ(round_reference(std::bit_cast<float>(0x00018000u), kBf16Format), 0x0002);
  EXPECT_EQ(round_reference(std::bit_cast<float>(0x7f800001u), kBf16Format), 0x7fc0);
  EXPECT_EQ(round_reference(std::bit_cast<float>(0xffa00000u), kBf16Format), 0xffa0);
  EXPECT_EQ(round_reference(-2.0f, kF16Format), 0xc000);
  EXPECT_EQ(round_reference(65504.0f, kF16Format), 0x7bff);
  EXPECT_EQ(round_reference(65519.0f, kF16Format), 0x7bff);
  EXPECT_EQ(round_reference(65520.0f, kF16Format), 0x7c00);
  EXPECT_EQ(round_reference(0x1p-24f, kF16Format), 0x0001);
  EXPECT_EQ(round_reference(0x1p-25f, kF16Format), 0x0000);
  EXPECT_EQ(round_reference(0x3p-25f, kF16Format), 0x0002);
  EXPECT_EQ(round_reference(0x1p-14f, kF16Format), 0x0400);
  EXPECT_EQ(round_reference(1.0f + 0x1p-11f, kF16Format), 0x3c00);
  EXPECT_EQ(round_reference(1.0f + 0x3p-11f, kF16Format), 0x3c02);
  EXPECT_EQ(round_reference(std::bit_cast<float>(0xff800001u), kF16Format), 0xfe00);
}

// An f32 destination is a copy; a count of zero does nothing; a null pointer is refused.
TEST(DeviceOps, HostOpsNarrowToF32CopiesAndRefusesNull) {
  HostDeviceOptions options;
  options.opaque = true;
  std::unique_ptr<Device> device = std::move(make_host_device(options)).value();
  std::unique_ptr<DeviceOps> ops = std::move(make_device_ops(*device)).value();
  std::unique_ptr<Stream> stream = std::move(device->create_stream("ops")).value();
  const std::size_t count = 257;
  std::vector<float> in(count), got(count);
  fill_uniform(in.data(), count, 4103, -3.0f, 3.0f);
  DeviceBuffer src = std::move(DeviceBuffer::allocate(*device, count * 4)).value();
  DeviceBuffer dst = std::move(DeviceBuffer::allocate(*device, count * 4)).value();
  ASSERT_TRUE(device->copy_h2d(src.data(), in.data(), count * 4, *stream).is_ok());
  ASSERT_TRUE(ops->narrow(src.as<float>(), DType::kF32, dst.data(), count, *stream).is_ok());
  ASSERT_TRUE(ops->narrow(src.as<float>(), DType::kBF16, dst.data(), 0, *stream).is_ok());
  ASSERT_TRUE(device->copy_d2h(got.data(), dst.data(), count * 4, *stream).is_ok());
  ASSERT_TRUE(device->synchronize(*stream).is_ok());
  EXPECT_EQ(std::memcmp(got.data(), in.data(), count * 4), 0);
  const Status null = ops->narrow(nullptr, DType::kBF16, dst.data(), count, *stream);
  EXPECT_EQ(null.code(), Code::kInvalidArgument);
  EXPECT_NE(null.message().find("narrow of 257 elements with a null pointer"), std::string::npos)
      << null.to_string();
}

TEST(DeviceOps, RegisteredBufferStaysRegisteredWhileItLives) {
  std::unique_ptr<Device> device = std::move(make_host_device()).value();
  Result<RegisteredBuffer> buffer = RegisteredBuffer::allocate(*device, 100);
  ASSERT_TRUE(buffer.is_ok()) << buffer.status().to_string();
  EXPECT_EQ(buffer->bytes(), 4096u);  // whole pages
  // Registered: registering any part again overlaps.
  EXPECT_EQ(device->register_host(buffer->data() + 8, 8).code(), Code::kInvalidArgument);
  RegisteredBuffer moved = std::move(buffer).value();
  std::byte* data = moved.data();
  moved.reset();
  // Unregistered by reset(): unregistering again is refused.
  EXPECT_EQ(device->unregister_host(data).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace zinf
