// DeviceOps on HostDevice (opaque, as a GPU's memory is to host code): widen runs the kernel's
// scalar reference in stream order, between the copies around it, on offset device pointers; the
// optimizer's ops give their references' bits; narrow gives zinf::f32_to_bf16 / f32_to_f16's bits
// and copies to f32; and RegisteredBuffer keeps its memory registered with the device while it
// lives.
#include "device/device_ops.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

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

// Inputs for the rounding: signed zeros, infinities, NaNs (quiet, signalling, payload only
// below the kept bits), bf16 and f16 ties either way, values around the largest finite f16 and
// f32, f16 and f32 subnormals, then seeded random bit patterns and patterns whose low 16 bits
// are exactly half a bf16 unit.
std::vector<float> narrow_inputs(std::uint64_t seed) {
  std::vector<std::uint32_t> bits = {
      0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
      0x7f800001u, 0xff800001u, 0x7fa00000u, 0x7fffffffu, 0xff812345u, 0x7f7fffffu,
      0xff7fffffu, 0x00000001u, 0x80000001u, 0x007fffffu, 0x3f808000u, 0x3f818000u,
      0xbf818000u, 0x7f7f8000u, 0x3f801000u, 0x3f803000u};
  for (const float x :
       {65504.0f, 65519.0f, 65520.0f, 0x1p-14f, 0x1p-24f, 0x1p-25f, 0x3p-25f, 0x1.000002p-25f}) {
    bits.push_back(std::bit_cast<std::uint32_t>(x));
    bits.push_back(std::bit_cast<std::uint32_t>(-x));
  }
  SplitMix64 rng(seed);
  for (int k = 0; k < 2048; ++k) bits.push_back(static_cast<std::uint32_t>(rng.next()));
  for (int k = 0; k < 512; ++k) {
    bits.push_back((static_cast<std::uint32_t>(rng.next()) & 0xffff0000u) | 0x8000u);
  }
  std::vector<float> out;
  for (const std::uint32_t b : bits) out.push_back(std::bit_cast<float>(b));
  return out;
}

// narrow on an opaque device (the stream op, at offsets off 16-byte alignment) gives
// zinf::f32_to_bf16 / f32_to_f16's bits for each element, the rounding that lib/base's and the
// kernels' tests check against independent references (tests/base/dtype_test.cpp,
// tests/kernels/cast_ref_test.cpp); the elements around the range keep theirs.
TEST(DeviceOps, HostOpsNarrowRoundsAsTheCasts) {
  HostDeviceOptions options;
  options.opaque = true;
  std::unique_ptr<Device> device = std::move(make_host_device(options)).value();
  std::unique_ptr<DeviceOps> ops = std::move(make_device_ops(*device)).value();
  std::unique_ptr<Stream> stream = std::move(device->create_stream("ops")).value();
  Stream& s = *stream;
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    const std::uint64_t seed = dtype == DType::kBF16 ? 4101 : 4102;
    SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " seed " << seed);
    const std::vector<float> in = narrow_inputs(seed);
    const std::size_t count = in.size();
    DeviceBuffer src = std::move(DeviceBuffer::allocate(*device, (count + 3) * 4)).value();
    DeviceBuffer dst = std::move(DeviceBuffer::allocate(*device, (count + 2) * 2)).value();
    std::vector<std::uint16_t> got(count + 2, 0xa5a5);
    ASSERT_TRUE(device->copy_h2d(src.as<float>() + 3, in.data(), count * 4, s).is_ok());
    ASSERT_TRUE(device->copy_h2d(dst.data(), got.data(), got.size() * 2, s).is_ok());
    ASSERT_TRUE(
        ops->narrow(src.as<float>() + 3, dtype, dst.as<std::uint16_t>() + 1, count, s).is_ok());
    ASSERT_TRUE(device->copy_d2h(got.data(), dst.data(), got.size() * 2, s).is_ok());
    ASSERT_TRUE(device->synchronize(s).is_ok());
    EXPECT_EQ(got.front(), 0xa5a5);
    EXPECT_EQ(got.back(), 0xa5a5);
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < count && mismatches < 10; ++i) {
      const std::uint16_t want = dtype == DType::kBF16 ? f32_to_bf16(in[i]) : f32_to_f16(in[i]);
      if (got[i + 1] == want) continue;
      ++mismatches;
      ADD_FAILURE() << std::hex << "input 0x" << std::bit_cast<std::uint32_t>(in[i]) << ": got 0x"
                    << got[i + 1] << ", want 0x" << want;
    }
  }
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
