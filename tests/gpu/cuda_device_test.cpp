// CudaDevice: copies through registered (pinned) host memory, ordering across streams through
// events, kernels on the device's streams, the stream-ordered pool, host functions and their
// errors, timeouts, and the argument checks. Skips with the reason when there is no device.
#include <gtest/gtest.h>

#if defined(ZINF_HAVE_CUDA)

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "base/aligned.hpp"
#include "base/random.hpp"
#include "device/cuda_device.hpp"
#include "gpu/gpu_util.hpp"
#include "kernels/cast.h"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using std::chrono::milliseconds;

#define ASSERT_OK(expr)                                  \
  do {                                                   \
    const ::zinf::Status zinf_s_ = (expr);               \
    ASSERT_TRUE(zinf_s_.is_ok()) << zinf_s_.to_string(); \
  } while (0)

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ZINF_REQUIRE_CUDA_DEVICE();
    Result<std::unique_ptr<Device>> dev = make_cuda_device();
    ASSERT_TRUE(dev.is_ok()) << dev.status().to_string();
    device_ = std::move(dev).value();
  }
  std::unique_ptr<Stream> stream(const char* name) {
    Result<std::unique_ptr<Stream>> s = device_->create_stream(name);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    return s.is_ok() ? std::move(s).value() : nullptr;
  }
  std::unique_ptr<Event> event() {
    Result<std::unique_ptr<Event>> e = device_->create_event();
    EXPECT_TRUE(e.is_ok()) << e.status().to_string();
    return e.is_ok() ? std::move(e).value() : nullptr;
  }
  std::unique_ptr<Device> device_;
};

TEST_F(CudaDeviceTest, PinnedRoundTripAcrossStreamsOrderedByEvents) {
  const std::size_t bytes = (std::size_t{64} << 20) + 12;  // 64 MiB and an odd tail.
  AlignedBuffer host_in(bytes), host_out(bytes);
  fill_random_bytes(host_in.data(), bytes, 0xc0de);
  std::memset(host_out.data(), 0, bytes);
  ASSERT_OK(device_->register_host(host_in.data(), bytes));
  ASSERT_OK(device_->register_host(host_out.data(), bytes));
  Result<DeviceBuffer> a = DeviceBuffer::allocate(*device_, bytes);
  Result<DeviceBuffer> b = DeviceBuffer::allocate(*device_, bytes);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  auto upload = stream("upload"), compute = stream("compute"), download = stream("download");
  auto uploaded = event(), copied = event(), done = event();
  // upload: H2D -> record; compute: wait, D2D -> record; download: wait, D2H -> record. Each
  // stage runs on its own stream, so only the events order them.
  ASSERT_OK(device_->copy_h2d(a->data(), host_in.data(), bytes, *upload));
  ASSERT_OK(device_->record(*uploaded, *upload));
  ASSERT_OK(device_->wait(*compute, *uploaded));
  ASSERT_OK(device_->copy_d2d(b->data(), a->data(), bytes, *compute));
  ASSERT_OK(device_->record(*copied, *compute));
  ASSERT_OK(device_->wait(*download, *copied));
  ASSERT_OK(device_->copy_d2h(host_out.data(), b->data(), bytes, *download));
  ASSERT_OK(device_->record(*done, *download));
  ASSERT_OK(device_->synchronize(*done, milliseconds(30000)));
  EXPECT_EQ(std::memcmp(host_in.data(), host_out.data(), bytes), 0);
  Result<bool> reached = device_->query(*done);
  ASSERT_TRUE(reached.is_ok());
  EXPECT_TRUE(*reached);
  ASSERT_OK(device_->unregister_host(host_in.data()));
  ASSERT_OK(device_->unregister_host(host_out.data()));
}

TEST_F(CudaDeviceTest, KernelOnDeviceStreamSeesPriorCopy) {
  const std::size_t count = 1000003;
  std::vector<float> in(count);
  fill_uniform(in.data(), count, 42, -100.0f, 100.0f);
  std::vector<std::uint16_t> out(count, 0), want(count);
  convert_f32_to_bf16(in.data(), want.data(), count);
  auto s = stream("kernels");
  Result<void*> src = device_->allocate_async(count * 4, *s);
  Result<void*> dst = device_->allocate_async(count * 2, *s);
  ASSERT_TRUE(src.is_ok() && dst.is_ok());
  ASSERT_OK(device_->copy_h2d(*src, in.data(), count * 4, *s));
  ASSERT_EQ(kernels::cast_f32_to_bf16(static_cast<const float*>(*src),
                                      static_cast<std::uint16_t*>(*dst), count, s->native_handle()),
            0);
  ASSERT_OK(device_->copy_d2h(out.data(), *dst, count * 2, *s));
  ASSERT_OK(device_->free_async(*src, *s));
  ASSERT_OK(device_->free_async(*dst, *s));
  ASSERT_OK(device_->synchronize(*s));
  EXPECT_EQ(out, want);
  EXPECT_EQ(device_->memory_used_bytes(), 0u);
}

TEST_F(CudaDeviceTest, ArgumentErrorsAreStatuses) {
  auto s = stream("checks");
  std::vector<unsigned char> host(256);
  int not_device = 0;
  Status st = device_->copy_h2d(&not_device, host.data(), 4, *s);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
  EXPECT_EQ(device_->free(&not_device).code(), Code::kInvalidArgument);
  EXPECT_EQ(device_->allocate(0).status().code(), Code::kInvalidArgument);
  Result<void*> big = device_->allocate(device_->memory_limit_bytes() + 1);
  EXPECT_EQ(big.status().code(), Code::kResourceExhausted) << big.status().to_string();
  Result<DeviceBuffer> small = DeviceBuffer::allocate(*device_, 256);
  ASSERT_TRUE(small.is_ok());
  // A copy running past the end of an allocation is refused before it reaches CUDA.
  st = device_->copy_h2d(small->as<unsigned char>() + 200, host.data(), 100, *s);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
  ASSERT_OK(device_->synchronize(*s));
}

struct Gate {
  std::atomic<bool> open{false};
  std::atomic<int> ran{0};
};

Status wait_for_gate(void* user, const Status&) {
  auto* gate = static_cast<Gate*>(user);
  const auto stop = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!gate->open.load() && std::chrono::steady_clock::now() < stop) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  gate->ran.fetch_add(1);
  return Status::ok();
}

Status fail_once(void*, const Status&) { return Status::internal("host function failed"); }

Status record_upstream(void* user, const Status& upstream) {
  *static_cast<Status*>(user) = upstream;
  return Status::ok();
}

TEST_F(CudaDeviceTest, TimedSynchronizeReturnsTimeoutNotHang) {
  auto s = stream("blocked");
  Gate gate;
  ASSERT_OK(device_->launch_host_func(*s, &wait_for_gate, &gate));
  const auto began = std::chrono::steady_clock::now();
  Status st = device_->synchronize(*s, milliseconds(100));
  EXPECT_EQ(st.code(), Code::kTimeout) << st.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - began, milliseconds(5000));
  gate.open = true;
  ASSERT_OK(device_->synchronize(*s, milliseconds(30000)));
  EXPECT_EQ(gate.ran.load(), 1);
}

TEST_F(CudaDeviceTest, HostFunctionErrorIsStickyForItsStream) {
  auto s = stream("failing");
  auto other = stream("other");
  auto e = event();
  Status seen;
  ASSERT_OK(device_->launch_host_func(*s, &fail_once, nullptr));
  ASSERT_OK(device_->launch_host_func(*s, &record_upstream, &seen));
  ASSERT_OK(device_->record(*e, *s));
  Status st = device_->synchronize(*s);
  EXPECT_EQ(st.code(), Code::kInternal) << st.to_string();
  EXPECT_EQ(seen.code(), Code::kInternal) << "the later host function saw upstream OK";
  EXPECT_EQ(device_->synchronize(*e).code(), Code::kInternal);
  // A stream that waits on the failed stream's event afterwards inherits the error.
  ASSERT_OK(device_->wait(*other, *e));
  EXPECT_EQ(device_->synchronize(*other).code(), Code::kInternal);
}

TEST(CudaDeviceOpen, BadOrdinalIsInvalidArgument) {
  ZINF_REQUIRE_CUDA_DEVICE();
  CudaDeviceOptions options;
  options.ordinal = 1 << 20;
  Result<std::unique_ptr<Device>> dev = make_cuda_device(options);
  EXPECT_EQ(dev.status().code(), Code::kInvalidArgument) << dev.status().to_string();
}

}  // namespace
}  // namespace zinf

#else  // !ZINF_HAVE_CUDA

TEST(CudaDevice, NeedsCuda) { GTEST_SKIP() << "no CUDA device: zinf was built without CUDA"; }

#endif
