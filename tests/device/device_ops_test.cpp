// DeviceOps on HostDevice (opaque, as a GPU's memory is to host code): widen runs the kernel's
// scalar reference in stream order, between the copies around it, on offset device pointers; the
// optimizer's ops give their references' bits; and RegisteredBuffer keeps its memory registered
// with the device while it lives.
#include "device/device_ops.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
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
